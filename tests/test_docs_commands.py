"""Every shell command in README.md, docs/*.md, launch/README.md and the config files' docstrings
runs as written on a fresh clone.

Each command is taken from the Markdown as a reader would copy it: every line of a ```bash block
(continuation lines joined, comments dropped), and every command written in prose or in a plain
code block (`.venv/bin/python ...` in backticks, or an indented or untagged code line). It runs
from the repository root with `--validate_only` appended (longctx/cli.py: flags, config and input
files are checked, nothing is trained, compiled or written), with `.venv/bin/python` meaning this
interpreter. It must exit 0 with one line, or, when it needs a file a fresh clone does not have
(the reader's own data, or what an earlier command in the same recipe writes: NEEDS_A_FILE), exit
2 with one line that names that file. Commands that are not longctx's own are skipped, each kind
with its reason (SKIPPED). A launcher's `--dry-run` (launch/: it prints what it would run and
changes nothing) runs as printed and must exit 0 with nothing on stderr. Nothing in the repository
may change.
"""

from __future__ import annotations

import ast
import glob
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from longctx import cli
from longctx.data import prepare

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCUMENTS = (["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
             + ["launch/README.md"])
# Config files: their docstrings show the commands that use them (big_vision's convention).
CONFIG_FILES = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "configs", "**", "*.py"),
                                                                  recursive=True))
VENV_PYTHON = ".venv/bin/python"
# Commands that start with these are not longctx's to validate.
SKIPPED = {
    "make": "make demo / make test set up .venv and run the demo or this whole suite",
    "pip": "installs packages",
    "gcloud": "Google Cloud's CLI: acts on the reader's account, project and TPUs",
}
# Launchers whose --dry-run prints what they would run and changes nothing: run as printed.
DRY_RUN_LAUNCHERS = ("launch/tpu_vm.sh", "launch/gke_jobset.py")
# Wrappers in front of a command: the command inside is what is checked.
WRAPPERS = {("/usr/bin/time", "-v"): "measures the command it runs"}
# Files a fresh clone does not have, and why a command may name one; such a command must stop
# at that file (exit 2, one line naming it), having checked everything before it.
NEEDS_A_FILE = {
    "corpus/": "the reader's own text files",
    "docs.jsonl": "the reader's own JSONL documents",
    "long_docs.jsonl": "the reader's own long documents",
    "data/mine": "written by the prepare_data command above it",
    "runs/demo": "written by the train.py command above it (docs/ruler.md)",
    "runs/v5e_resume": "written by the train.py command above it (docs/tpu.md)",
    "runs/llama_tiny_hf": "written by the convert_hf.py command above it (docs/ruler.md)",
    "Meta-Llama-3-8B": "the released model the reader downloads",
    "runs/llama3_8b_hf": "written by step 1 of 'Extend a released model'",
    "data/llama3_long": "written by step 2 of 'Extend a released model'",
    "code_repos.jsonl.zst": "the reader's own code repositories (docs/data.md, 'A ProLong-style run')",
    "books.parquet": "the reader's own books (docs/data.md, 'A ProLong-style run')",
    "textbooks.jsonl.gz": "the reader's own textbooks (docs/data.md, 'A ProLong-style run')",
    "short_mix/": "the reader's own short data (docs/data.md, 'A ProLong-style run')",
    "runs/llama3_8b_extend": "written by step 3 of 'Extend a released model'",
    "Qwen3-8B": "the released model the reader downloads (docs/extend.md, 'Extending Qwen3-8B')",
    "runs/qwen3_8b_hf": "written by the to-longctx command of 'Extending Qwen3-8B'",
    "data/qwen3_long": "written by the prepare_data command of 'Extending Qwen3-8B'",
    "runs/qwen3_8b_extend": "written by the train.py command of 'Extending Qwen3-8B'",
    "ids.npz": "the reader's token ids and transformers' logits",
    "my_config.py": "the reader's own config file, as docs/configs.md shows it (tests/test_user_config.py runs it)",
    "DIR": "where the reader pip-installed the peer rings (--peers DIR)",
    "/tmp/peers": "where the reader pip-installed the peer rings (--peers DIR)",
    # docs/per_document.md's corpus commands, as benchmarks/bench_per_document.py prints them
    "~/.cache/longctx/" + prepare.stdlib_cache_name(): "the embedded corpus, which the benchmark prepares",
}
# The same for a file a preset names (its data.path), in commands that read the data.
PRESET_FILES = {"configs/base.py:llama3_8b_extend_128k": "data/llama3_long",
                # (its first source, sorted: the prepare_data commands above it write each)
                "configs/base.py:llama3_8b_prolong_64k": "data/prolong/books"}
READS_DATA = ("scripts/train.py",)
# Presets for hardware this machine lacks: validated against that many (virtual CPU) devices.
DEVICES_OF = {"configs/base.py:llama3_8b_extend_128k": (64, "a v5p:4x4x4 pod (64 chips), as the README says"),
              "configs/base.py:llama3_8b_prolong_64k": (64, "a v5p:4x4x4 pod (64 chips), as docs/data.md says"),
              "configs/base.py:qwen3_8b_128k": (64, "v5p-128 (64 chips), as docs/extend.md says"),
              "configs/base.py:v5e_0p5b": (1, "one TPU v5e chip, as its preset says")}
# Text that looks like a command but stands for several (a table header, "...").
NOT_A_COMMAND = {
    "--config.attention.impl=xla ...": "a table header: the rows below complete it",
    "launch/tpu_vm.sh ... --": "step 3's command with more train.py flags after --",
    "...same flags without --dry-run...": "the command above it without --dry-run (it applies the JobSet)",
    "--config=... --workdir=gs://...": "what launch/tpu_vm.sh runs on each TPU worker, its flags elided",
}
_RUNNERS = (VENV_PYTHON + " ", "python ", "python3 ", "/usr/bin/time ")


def _fenced_blocks(text: str):
    """(language, [lines]) of every ``` block."""
    blocks, lang, lines = [], None, []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            if lang is None:
                lang, lines = stripped[3:].strip().lower(), []
            else:
                blocks.append((lang, lines))
                lang = None
        elif lang is not None:
            lines.append(line)
    return blocks


def _join_continuations(lines: list[str]) -> list[str]:
    out, current = [], ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
        else:
            out.append(current + line)
            current = ""
    if current:
        out.append(current)
    return out


def _outside_fences(text: str) -> str:
    return re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.S | re.M)


def extract_commands(text: str) -> list[str]:
    """The shell commands of one Markdown document, in order."""
    commands = []
    for lang, lines in _fenced_blocks(text):
        if lang in ("bash", "sh", "shell", "console"):
            commands += [c.strip() for c in _join_continuations(lines)]
        elif lang == "":  # a plain block may hold a command or a program's output
            commands += [c.strip() for c in _join_continuations(lines) if _is_command(c.strip())]
    prose = _outside_fences(text)
    for span in re.findall(r"`([^`]+)`", prose):
        span = " ".join(span.split())
        if _is_command(span):
            commands.append(span)
    indented = [line[4:] for line in prose.splitlines() if line.startswith("    ")]
    commands += [c.strip() for c in _join_continuations(indented) if _is_command(c.strip())]
    out = []
    for command in commands:
        words = shlex.split(command, comments=True)
        if words:
            out += [" ".join(shlex.quote(w) for w in part) for part in _split_and(words)]
    return out


def _is_command(text: str) -> bool:
    """A line or code span outside a bash block is a command when it runs one of the scripts."""
    return text.startswith(_RUNNERS) and re.search(r"\.py\b", text) is not None


def _needed_files(words: list[str]) -> list[str]:
    """The files the command needs that this machine lacks (a fresh clone lacks them all; a
    machine where someone installed the peers in /tmp/peers has that one, and the command must
    then run as any other)."""
    # (train.py writes its --workdir, convert_hf.py its --out: that command is the one the others
    # need, not one of them)
    writes = {w.split("=", 1)[1] for w in words if ("scripts/train.py" in words and w.startswith("--workdir="))
              or ("scripts/convert_hf.py" in words and w.startswith("--out="))}
    needed = [path for path in NEEDS_A_FILE if path not in writes
              and (path in words or any(w.endswith(("=" + path, ":" + path)) for w in words))]
    if any(script in words for script in READS_DATA):
        needed += [path for preset, path in PRESET_FILES.items() if f"--config={preset}" in words]
    return [path for path in needed if not os.path.exists(os.path.join(ROOT, path))]


def _split_and(words: list[str]) -> list[list[str]]:
    parts, current = [], []
    for w in words:
        if w == "&&":
            parts.append(current)
            current = []
        else:
            current.append(w)
    return parts + [current]


def docstring_commands(source: str) -> list[str]:
    """The commands in a Python file's module docstring: its lines that run a script (continuation
    lines joined), however far they are indented."""
    docstring = ast.get_docstring(ast.parse(source)) or ""
    lines = [line.strip() for line in _join_continuations(docstring.splitlines())]
    out = []
    for command in (line for line in lines if _is_command(line)):
        out += [" ".join(shlex.quote(w) for w in part) for part in _split_and(shlex.split(command, comments=True))]
    return out


def _all_commands() -> list[tuple[str, str]]:
    seen, out = set(), []
    for doc in DOCUMENTS + CONFIG_FILES:
        with open(os.path.join(ROOT, doc)) as f:
            text = f.read()
        for command in (docstring_commands(text) if doc.endswith(".py") else extract_commands(text)):
            if command not in seen:
                seen.add(command)
                out.append((doc, command))
    return out


COMMANDS = _all_commands()


def _repo_state() -> str | None:
    try:
        return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT,
                              capture_output=True, text=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def test_the_extraction_finds_the_documented_commands():
    """The extractor sees bash blocks with continuations, commands in prose, and chains."""
    text = ("```bash\nmake demo   # set up\n.venv/bin/python scripts/a.py --x=1 \\\n    --y=2\n```\n"
            "```\nlongctx: an output line\n.venv/bin/python scripts/b.py\n```\n"
            "Run `.venv/bin/python scripts/c.py --z && .venv/bin/python scripts/d.py` or\n\n"
            "    /usr/bin/time -v .venv/bin/python scripts/e.py \\\n        --w\n")
    assert extract_commands(text) == ["make demo", ".venv/bin/python scripts/a.py --x=1 --y=2",
                                      ".venv/bin/python scripts/b.py", ".venv/bin/python scripts/c.py --z",
                                      ".venv/bin/python scripts/d.py",
                                      "/usr/bin/time -v .venv/bin/python scripts/e.py --w"]
    scripts = {c.split()[1] for _, c in COMMANDS if c.startswith(VENV_PYTHON)}
    assert {"scripts/train.py", "scripts/prepare_data.py", "launch/local.py", "scripts/estimate.py",
            "scripts/ring_report.py", "scripts/convert_hf.py", "scripts/eval_needle.py",
            "scripts/ablate.py"} <= scripts, scripts


def _words(command: str) -> list[str] | None:
    """The command's words as run (wrappers taken off), or None when it is skipped."""
    words = shlex.split(command)
    if words[0] in SKIPPED or any(text in command for text in NOT_A_COMMAND):
        return None
    for wrapper in WRAPPERS:
        if tuple(words[:len(wrapper)]) == wrapper:
            words = words[len(wrapper):]
    return words


def _dry_run(words: list[str]) -> bool:
    """A launcher's --dry-run: it validates by printing, and takes no --validate_only."""
    return "--dry-run" in words and any(w in DRY_RUN_LAUNCHERS for w in words[:2])


def _argv(words: list[str]) -> list[str]:
    return [sys.executable if w == VENV_PYTHON else w for w in words] + ([] if _dry_run(words) else ["--validate_only"])


def _env(command: str) -> dict:
    """LONGCTX_CPU_DEVICES for a command of a DEVICES_OF preset (launch/local.py's children
    choose their own)."""
    for preset, (devices, _) in DEVICES_OF.items():
        if f"--config={preset}" in command.split() and "launch/local.py" not in command:
            return {"LONGCTX_CPU_DEVICES": str(devices)}
    return {}


@pytest.fixture(scope="module")
def results():
    """{command: (returncode, stdout + stderr)} of every command run with --validate_only, each in
    its own process (tests/validate_commands.py: forked after the imports, which would otherwise
    cost most of each command's time), and whether the repository changed."""
    runnable = [c for _, c in COMMANDS if (w := _words(c)) and w[0] == VENV_PYTHON]
    env = {k: v for k, v in os.environ.items() if k not in (cli.DEBUG_ENV, cli.VALIDATE_ENV)}
    env["PYTHONPATH"] = ROOT  # this tree, as the editable install gives .venv
    before = _repo_state()
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "validate_commands.py")],
                       input=json.dumps([{"argv": _argv(_words(c)), "env": _env(c)} for c in runnable]),
                       cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    done = {c: (x["returncode"], x["stdout"] + x["stderr"], x["stderr"]) for c, x in zip(runnable, json.loads(r.stdout))}
    return done, _repo_state() == before


def test_validate_only_changes_nothing_in_the_repository(results):
    assert results[1], "a documented command run with --validate_only changed the repository"


@pytest.mark.parametrize("doc, command", COMMANDS, ids=[f"{d}:{c[:80]}" for d, c in COMMANDS])
def test_documented_command_runs_as_written(doc, command, results):
    words = _words(command)
    if words is None:
        pytest.skip(SKIPPED.get(command.split()[0]) or "; ".join(
            reason for text, reason in NOT_A_COMMAND.items() if text in command))
    if _dry_run(words):
        if words[0] == VENV_PYTHON:
            returncode, _, stderr = results[0][command]
        else:  # a shell script, run as printed
            done = subprocess.run(words, cwd=ROOT, capture_output=True, text=True, timeout=120)
            returncode, stderr = done.returncode, done.stderr
        assert returncode == 0 and not stderr.strip(), f"{doc}: {command!r} exited {returncode}: {stderr[-2000:]}"
        return
    assert words[0] == VENV_PYTHON, (
        f"{doc}: {command!r} does not start with {VENV_PYTHON}: a fresh clone's `python` has no "
        "longctx (ModuleNotFoundError); write .venv/bin/python")
    returncode, out, _ = results[0][command]
    assert "Traceback" not in out, out[-3000:]
    needed = _needed_files(words)
    lines = [line for line in out.splitlines() if line.strip()]
    if needed:
        assert returncode == 2, f"{command!r} (needs {needed}) exited {returncode}: {out[-2000:]}"
        assert len(lines) == 1 and any(path in lines[0] for path in needed), (
            f"{command!r} should stop at a missing {' or '.join(needed)} "
            f"({'; '.join(NEEDS_A_FILE.get(p, 'named by the preset') for p in needed)}), "
            f"said: {out[-2000:]}")
    else:
        assert returncode == 0, f"{doc}: {command!r} cannot run: {out[-2000:]}"
        assert lines == [line for line in lines if line.startswith("longctx: --validate_only: ")] \
            and len(lines) == 1, out[-2000:]


def test_commands_in_docstrings_keep_their_line_continuations():
    """A script's docstring is its --help: a command there split with a backslash must print the
    backslash. In a plain (not raw) string literal a backslash before the newline joins the lines
    and is gone, leaving a run of spaces where the reader copies `\\`."""
    import io
    import tokenize

    lost = []
    for path in sorted(glob.glob(os.path.join(ROOT, "**", "*.py"), recursive=True)):
        if os.sep + ".venv" + os.sep in path:
            continue
        with open(path, "rb") as f:
            tokens = list(tokenize.tokenize(io.BytesIO(f.read()).readline))
        for token in tokens:
            if token.type != tokenize.STRING or "r" in re.match(r"[a-zA-Z]*", token.string).group().lower():
                continue
            for offset, line in enumerate(token.string.splitlines()):
                if re.search(r"(?<!\\)(\\\\)*\\$", line):
                    lost.append(f"{os.path.relpath(path, ROOT)}:{token.start[0] + offset}")
    assert not lost, f"write \\\\ (or make the string raw) at {lost}"
