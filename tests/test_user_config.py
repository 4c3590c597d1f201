"""A user's own config file, anywhere, builds on a preset with `from configs import base`
(docs/configs.md, "Your own config file"): the page's file and command, run from a directory
outside the checkout with nothing on PYTHONPATH, as a user would run them."""

import os
import re
import shlex
import subprocess
import sys

from longctx import cli
from tests import ROOT

PAGE = os.path.join(ROOT, "docs", "configs.md")


def _page_example() -> tuple[str, list[str]]:
    """(the config file's text, the command's words) as docs/configs.md prints them."""
    with open(PAGE) as f:
        text = f.read()
    (config_file,) = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "from configs import base" in b]
    (command,) = [c for c in re.findall(r"```bash\n(.*?)```", text, re.S) if "--config=my_config.py" in c]
    return config_file, shlex.split(command.replace("\\\n", " "))


def test_a_config_file_outside_the_checkout_builds_on_a_preset(tmp_path):
    config_file, words = _page_example()
    (tmp_path / "my_config.py").write_text(config_file)
    assert words[:2] == [".venv/bin/python", "scripts/train.py"], words
    argv = [sys.executable, os.path.join(ROOT, "scripts", "train.py"), *words[2:], "--validate_only"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", cli.VALIDATE_ENV, cli.DEBUG_ENV)}
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 0 and len(lines) == 1, done.stdout + done.stderr
    # the file's own change (the ring over all 8 devices) is what was validated
    assert lines[0].startswith("longctx: --validate_only: config, mesh dp=1 x fsdp=1 x sp=8, workdir runs/mine "), lines
    assert sorted(os.listdir(tmp_path)) == ["my_config.py"]  # nothing written beside it
