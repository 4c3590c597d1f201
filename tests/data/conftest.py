"""The dataset the data tests share: tests/synthetic.make_corpus prepared with a 10% validation
split, once per pytest worker (three files read it; none writes into it: a test that damages a
dataset copies it first)."""

import pytest

from longctx.data import prepare
from tests.synthetic import make_corpus


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("tagged_corpus")
    out = root / "data"
    prepare.prepare([str(make_corpus(root))], str(out), val_fraction=0.1, progress=False)
    return str(out)
