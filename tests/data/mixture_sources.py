"""Three prepared sources for the tests that train on a mixture (tests/data/test_mixture_training.py,
tests/train/test_mixture_resume.py, tests/data/test_mixture_multiprocess.py): tagged corpora
(tests/synthetic.make_corpus) of short, middling and long documents, so that a weight on documents
would be far from one on tokens."""

from longctx.data import prepare
from tests.synthetic import make_corpus

WEIGHTS = {"books": 0.5, "code": 0.3, "web": 0.2}
_SHORT = {"books": 400, "code": 100, "web": 20}  # make_corpus's `short`: lengths up to 5x it


def prepare_sources(root) -> dict[str, str]:
    """`{name: prepared directory}` under `root` (a pathlib.Path), 60 documents each, 20% validation."""
    out = {}
    for k, name in enumerate(sorted(_SHORT)):
        (root / name).mkdir()
        corpus = make_corpus(root / name, num_docs=60, seed=k, short=_SHORT[name])
        out[name] = str(root / f"{name}_data")
        prepare.prepare([str(corpus)], out[name], val_fraction=0.2, progress=False)
    return out


def sources_override(dirs: dict[str, str], weights: dict[str, float] = WEIGHTS) -> str:
    """The command-line flag that sets data.sources to these directories and weights."""
    return "--config.data.sources=" + repr({n: {"path": dirs[n], "weight": w} for n, w in weights.items()})
