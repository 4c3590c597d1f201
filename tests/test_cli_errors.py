"""One line for every failure: the real scripts run as a user would, each failure checked for its
exact one-line message on stderr, its exit status (2 bad input, 1 a failed run, see longctx/cli.py),
no traceback (unless LONGCTX_DEBUG=1 or --verbose), and nothing already saved lost."""

import glob
import hashlib
import importlib.util
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest

from configs import base
from longctx import cli
from longctx.data import pipeline, prepare
from longctx.errors import ConfigError, LongctxError, RunError
from tests.validate_commands import ScriptServer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "scripts", "train.py")
PREPARE = os.path.join(ROOT, "scripts", "prepare_data.py")
WORDS = "the of and to in is was for on that with as by at from long context ring attention".split()


def run(*args, env=None, timeout=180):
    full_env = {k: v for k, v in os.environ.items() if k not in (cli.DEBUG_ENV, cli.VALIDATE_ENV)}
    full_env.update(env or {})
    return ScriptServer.run([sys.executable, *args], cwd=ROOT, env=full_env, timeout=timeout)


def the_line(result) -> str:
    """The `longctx: ...` line on stderr; checks it is the only one and no traceback was printed."""
    out = result.stdout + result.stderr
    assert "Traceback" not in out, out[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("longctx: ")]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


def digest(directory) -> dict:
    return {os.path.relpath(os.path.join(d, f), directory):
            hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest()
            for d, _, files in os.walk(directory) for f in files}


def write_texts(directory, n=12, seed=0):
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (directory / f"doc{i:02d}.txt").write_text(
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(50, 400))) + ".\n")
    return directory


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_data")
    out = root / "data"
    prepare.prepare([str(write_texts(root / "texts", n=40))], str(out), val_fraction=0.1,
                    progress=False)
    return out


# ----------------------------------------------------------------------------- item 8: unknown key


def test_unknown_override_key_names_the_section_and_its_keys_closest_first(tmp_path):
    r = run(TRAIN, "--config=configs/base.py:tiny", f"--workdir={tmp_path / 'w'}",
            "--config.model.num_layerz=4")
    assert r.returncode == 2
    keys = list(base.get_config("tiny").model.keys())
    m = re.fullmatch(r"longctx: unknown config key model\.num_layerz in --config\.model\.num_layerz=4; "
                     r"the keys of model, closest first: (.*)\.", the_line(r))
    assert m, r.stderr
    listed = m.group(1).split(", ")
    assert listed[0] == "num_layers" and sorted(listed) == sorted(keys)
    assert not (tmp_path / "w").exists()  # refused before anything was created


def test_unknown_section_lists_the_top_level_keys(tmp_path):
    r = run(TRAIN, "--config=configs/base.py:tiny", f"--workdir={tmp_path / 'w'}",
            "--config.modle.num_layers=4")
    assert r.returncode == 2
    line = the_line(r)
    assert line.startswith("longctx: unknown config key modle in --config.modle.num_layers=4; the "
                           "config's top-level keys, closest first: model, "), line


def test_bad_flag_value_is_one_line(tmp_path):
    r = run(TRAIN, "--config=configs/base.py:tiny", f"--workdir={tmp_path / 'w'}",
            "--config.model.num_layers=four")
    assert r.returncode == 2
    assert the_line(r) == ("longctx: flag --config.model.num_layers=four: invalid literal for int() "
                           "with base 10: 'four' (--helpshort lists the flags).")


def test_a_layer_type_named_by_a_python_keyword_takes_overrides(tmp_path):
    """ml_collections reads an override's path as Python, where `global` (the name Gemma gives its
    full-attention layers; tiny_hybrid's too) is a keyword: the override reaches the type (its
    value is validated), and a typo after it is named as any unknown key is."""
    common = (TRAIN, "--config=configs/base.py:tiny_hybrid", f"--workdir={tmp_path / 'w'}", "--validate_only")
    bad = run(*common, "--config.attention.layer_types.global.rope_theta=-1.0")
    assert bad.returncode == 2
    assert the_line(bad) == "longctx: attention.layer_types.global.rope_theta=-1.0 must be positive."
    typo = run(*common, "--config.attention.layer_types.global.rope_thetaa=5e5")
    assert typo.returncode == 2
    assert the_line(typo).startswith("longctx: unknown config key attention.layer_types.global.rope_thetaa in "
                                     "--config.attention.layer_types.global.rope_thetaa=5e5; the keys a layer "
                                     "type sets, closest first: rope_theta, "), the_line(typo)
    good = run(*common, "--config.attention.layer_types.global.rope_theta=500000.0")
    assert good.returncode == 0, good.stderr[-2000:]


def test_keyword_keys_are_quoted_only_in_config_overrides():
    from ml_collections.config_flags import config_path

    argv = ["script", "--config.attention.layer_types.global.rope_theta=1.0", "--config.model.d_model=8",
            "--noconfig.a.lambda.b", "--other.global.x=1", "--config=configs/base.py:tiny_hybrid"]
    quoted = cli.quote_keyword_keys(argv, ["config"])
    assert quoted == ["script", '--config.attention.layer_types["global"].rope_theta=1.0',
                      "--config.model.d_model=8", '--noconfig.a["lambda"].b', "--other.global.x=1",
                      "--config=configs/base.py:tiny_hybrid"]
    assert config_path.split(quoted[1].split("=")[0].split(".", 1)[1]) == \
        ("attention", "layer_types", "global", "rope_theta")
    assert cli.quote_keyword_keys(argv, []) == argv


# ----------------------------------------------------------------------------- item 9: corrupt shard


def test_corrupt_shard_is_one_line_and_the_checkpoints_stay(dataset, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for f in os.listdir(dataset):
        (data / f).write_bytes((dataset / f).read_bytes())
    shard = data / "train-00000.array_record"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # truncated copy
    # A run that already saved: its (stand-in) checkpoint must not be touched by the failure
    # (a data error while resuming was taken for an unreadable checkpoint and set aside).
    saved = tmp_path / "w" / "checkpoints" / "7"
    saved.mkdir(parents=True)
    (saved / "stand_in").write_text("a saved step")
    before = digest(tmp_path / "w")
    r = run(TRAIN, "--config=configs/base.py:tiny", f"--workdir={tmp_path / 'w'}",
            f"--config.data.path={data}", "--config.train.num_steps=2")
    assert r.returncode == 2
    assert the_line(r) == (f"longctx: {shard} is corrupt: not a readable ArrayRecord file; prepare the "
                           "data again with scripts/prepare_data.py (or restore the file from a copy).")
    assert digest(tmp_path / "w") == before
    assert not (tmp_path / "w" / "checkpoints_unreadable").exists()


def _damaged_copy(dataset, tmp_path, offsets):
    """A copy of the dataset whose first train shard has the bytes at `offsets` flipped."""
    data = tmp_path / "data"
    data.mkdir()
    for f in os.listdir(dataset):
        (data / f).write_bytes((dataset / f).read_bytes())
    shard = data / "train-00000.array_record"
    raw = bytearray(shard.read_bytes())
    for i in offsets(len(raw)):
        raw[i] ^= 0x55
    shard.write_bytes(bytes(raw))
    return data, shard


def test_corrupt_record_found_while_training_is_one_line(dataset, tmp_path):
    """A record whose bytes are damaged inside an otherwise readable file (its chunk headers
    intact, so start-up's count check passes) surfaces from Grain's read threads in the middle of
    the loop; still one line."""
    data, shard = _damaged_copy(dataset, tmp_path, lambda size: range(1000, 1064))
    r = run(TRAIN, "--config=configs/base.py:tiny", f"--workdir={tmp_path / 'w'}",
            f"--config.data.path={data}", "--config.train.num_steps=2")
    assert r.returncode == 2
    assert re.fullmatch(rf"longctx: {re.escape(str(shard))} record \d+ is corrupt \(.+\); prepare "
                        r"the data again with scripts/prepare_data\.py \(or restore the file from a "
                        r"copy\)\.", the_line(r)), r.stderr[-2000:]


def test_damaged_chunk_headers_are_refused_at_start_up_in_one_line(dataset, tmp_path):
    """Bytes flipped all over the file's start, its chunk headers among them: the start-up check of
    the shards' counts (data/shard_counts.py) refuses it before anything compiles."""
    data, shard = _damaged_copy(dataset, tmp_path, lambda size: range(300, 20000, 7))
    r = run(TRAIN, "--config=configs/base.py:tiny", f"--workdir={tmp_path / 'w'}",
            f"--config.data.path={data}", "--validate_only")
    assert r.returncode == 2
    assert re.fullmatch(rf"longctx: {re.escape(str(shard))} is corrupt: its chunk headers .+; prepare "
                        r"the data again with scripts/prepare_data\.py \(or restore the file from a "
                        r"copy\)\.", the_line(r)), r.stderr[-2000:]


# ----------------------------------------------------------------------------- item 11: prepare_data


def test_prepare_data_skips_binary_files_and_says_so(tmp_path):
    src = write_texts(tmp_path / "in", n=3)
    (src / "noise.txt").write_bytes(random.Random(1).randbytes(5000))  # not UTF-8
    (src / "zeros.txt").write_bytes(b"abc\0def")  # decodes, but NUL bytes
    r = run(PREPARE, "--quiet", "--input", src, "--output", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.splitlines() == [
        f"prepare_data: skipped 2 of 5 input files that are not utf-8 text, e.g. {src}/noise.txt "
        "(not valid utf-8)."]
    meta = json.load(open(tmp_path / "out" / "metadata.json"))
    assert meta["num_documents"] == 3 and meta["num_skipped_files"] == 2


def test_prepare_data_with_only_binary_input_is_one_line(tmp_path):
    (tmp_path / "noise.txt").write_bytes(random.Random(2).randbytes(5000))
    r = run(PREPARE, "--quiet", "--input", tmp_path / "noise.txt", "--output", tmp_path / "out")
    assert r.returncode == 2
    assert the_line(r) == (f"longctx: no documents found in {tmp_path}/noise.txt (all inputs are "
                           f"empty or not utf-8 text: 1 of 1 file(s) skipped, e.g. "
                           f"{tmp_path}/noise.txt: not valid utf-8).")
    assert not (tmp_path / "out").exists()


def test_prepare_data_refuses_to_overwrite_without_the_flag(tmp_path):
    src = write_texts(tmp_path / "in", n=4)
    out = tmp_path / "out"
    assert run(PREPARE, "--quiet", "--input", src, "--output", out).returncode == 0
    before = digest(out)
    write_texts(tmp_path / "in", n=6, seed=3)  # different input
    r = run(PREPARE, "--quiet", "--input", src, "--output", out)
    assert r.returncode == 2
    assert the_line(r) == (f"longctx: --output {out} already holds a dataset; pass --overwrite to "
                           "replace it, or choose another --output.")
    assert digest(out) == before  # nothing lost
    r = run(PREPARE, "--quiet", "--input", src, "--output", out, "--overwrite")
    assert r.returncode == 0, r.stderr
    assert json.load(open(out / "metadata.json"))["num_documents"] == 6


# ----------------------------------------------------------------------------- item 12: workdir is a file


def test_workdir_that_is_a_file_is_named_as_a_file(tmp_path):
    blocker = tmp_path / "wfile"
    blocker.write_text("not a directory")
    r = run(TRAIN, "--config=configs/base.py:tiny", f"--workdir={blocker}")
    assert r.returncode == 2
    assert the_line(r) == (f"longctx: workdir '{blocker}' is not writable: {blocker} is a file, "
                           "not a directory.")
    assert blocker.read_text() == "not a directory"


def test_cache_dir_that_cannot_hold_the_corpus_is_named(tmp_path):
    blocker = tmp_path / "cfile"
    blocker.write_text("not a directory")
    config = base.get_config("tiny")
    for cache in (blocker, blocker / "below"):
        config.data.cache_dir = str(cache)
        with pytest.raises(ConfigError) as e:
            pipeline.resolve_dataset(config)
        assert str(e.value) == (f"data.cache_dir={cache} cannot hold the prepared embedded corpus "
                                "(Not a directory (errno 20)); point it at a writable directory.")
    assert blocker.read_text() == "not a directory"


# ----------------------------------------------------------------------------- the generic handler


def test_unexpected_error_is_one_line_with_a_hint(tmp_path):
    args = ("scripts/ring_report.py", "--seq-len", "4096", "--sp", "4", "--block", "512", "--causal",
            "--layout", "zigzag", "--png", tmp_path / "missing" / "x.png")
    r = run(*args)
    assert r.returncode == 1
    assert the_line(r) == (f"longctx: unexpected FileNotFoundError: [Errno 2] No such file or "
                           f"directory: '{tmp_path}/missing/x.png' (pass --verbose or set "
                           "LONGCTX_DEBUG=1 for the traceback)")
    for debug in ({"env": {"LONGCTX_DEBUG": "1"}}, {"verbose": True}):
        r = run(*args, "--verbose") if debug.get("verbose") else run(*args, env=debug["env"])
        assert r.returncode == 1
        assert "Traceback (most recent call last)" in r.stderr
        assert r.stderr.splitlines()[-1] == (f"longctx: unexpected FileNotFoundError: [Errno 2] No "
                                             f"such file or directory: '{tmp_path}/missing/x.png'")


def test_bad_device_count_is_one_line_before_jax_starts(tmp_path):
    r = run(TRAIN, "--config=configs/base.py:tiny", f"--workdir={tmp_path / 'w'}",
            env={"LONGCTX_CPU_DEVICES": "eight"})
    assert r.returncode == 2
    assert the_line(r) == "longctx: LONGCTX_CPU_DEVICES='eight' must be a positive number of CPU devices."


def test_config_error_with_debug_shows_the_traceback(tmp_path):
    blocker = tmp_path / "wfile"
    blocker.write_text("x")
    r = run(TRAIN, "--config=configs/base.py:tiny", f"--workdir={blocker}",
            env={"LONGCTX_DEBUG": "1"})
    assert r.returncode == 2
    assert "Traceback (most recent call last)" in r.stderr
    assert r.stderr.splitlines()[-1].startswith(f"longctx: workdir '{blocker}' is not writable")


def test_a_failed_run_is_one_line_exit_1(tmp_path):
    """RunError (what ablate raises for a failed variant; the loop raises it for a non-finite loss
    or a failed save) prints one line and exits 1; the variant's own line is shown above it."""
    grid = tmp_path / "grid.py"
    missing = tmp_path / "no_data"  # (a valid config: the run finds the directory missing)
    grid.write_text('BASE = "configs/base.py:tiny"\n'
                    f'def get_grid():\n    return {{"bad": {{"data.path": "{missing}"}}}}\n')
    r = run("scripts/ablate.py", f"--grid={grid}", f"--workdir={tmp_path / 'runs'}")
    assert r.returncode == 1
    assert "Traceback" not in r.stdout + r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("longctx: ")]
    assert lines[0].startswith(f"longctx: data.path={missing} "), lines  # the training run's own message
    assert re.fullmatch(r"longctx: variant 'bad' failed with exit code 2 \(its message is above\): "
                        rf".*scripts/train\.py --config=configs/base\.py:tiny .*--config\.data\.path={missing}",
                        lines[-1]), lines


@pytest.mark.parametrize("error, status, line", [
    (ConfigError("data.path=x does not exist."), 2, "longctx: data.path=x does not exist."),
    (RunError("non-finite loss nan at step 21;\nstopping."), 1,
     "longctx: non-finite loss nan at step 21; stopping."),
    (LongctxError("something the user can fix."), 1, "longctx: something the user can fix."),
    (KeyboardInterrupt(), 130, "longctx: interrupted."),
    (ValueError("bad\nvalue"), 1, "longctx: unexpected ValueError: bad (pass --verbose or set "
                                  "LONGCTX_DEBUG=1 for the traceback)"),
])
def test_handler_prints_one_line_and_exits_with_the_documented_status(error, status, line, capsys,
                                                                     monkeypatch):
    monkeypatch.setenv(cli.DEBUG_ENV, "0")  # restored afterwards (run may set it)

    def main():
        raise error

    with pytest.raises(SystemExit) as exit_:
        cli.run(main, argv=["script"])
    assert exit_.value.code == status
    assert capsys.readouterr().err == line + "\n"


def test_verbose_is_taken_off_the_command_line_before_the_script_sees_it(capsys, monkeypatch):
    monkeypatch.setenv(cli.DEBUG_ENV, "0")  # restored afterwards (run may set it)
    argv = ["script", "--verbose", "--x=1", "--", "--verbose"]
    seen = []

    def main():
        seen.append(list(argv))
        raise RunError("stop.")

    with pytest.raises(SystemExit):
        cli.run(main, argv=argv)
    assert seen == [["script", "--x=1", "--", "--verbose"]]
    err = capsys.readouterr().err
    assert "Traceback" in err and err.endswith("longctx: stop.\n")
    assert os.environ[cli.DEBUG_ENV] == "1"  # children (ablate's runs) show tracebacks too


# ----------------------------------------------------------------------------- a config file that does not load


def test_config_file_with_a_syntax_error_is_one_line_naming_file_and_line(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import ml_collections\n\ndef get_config(arg=None):\n    c = ml_collections.ConfigDict(\n"
                   "    return c\n")
    r = run(TRAIN, f"--config={bad}:tiny", f"--workdir={tmp_path / 'w'}")
    assert r.returncode == 2
    assert the_line(r) == (f"longctx: --config={bad}:tiny: the config file does not load: {bad}:4: "
                           "SyntaxError: '(' was never closed.")
    assert not (tmp_path / "w").exists()


def test_config_file_raising_a_type_error_is_one_line_naming_file_and_line(tmp_path):
    """ml_collections re-raises a TypeError from get_config inside absl's flag error, with the
    traceback in its text: still one line, at the config file's line."""
    bad = tmp_path / "bad.py"
    bad.write_text("import ml_collections\n\ndef get_config(arg=None):\n    return ml_collections.ConfigDict(\n"
                   "        dict(a=1) + 2)\n")
    r = run(TRAIN, f"--config={bad}", f"--workdir={tmp_path / 'w'}")
    assert r.returncode == 2
    assert the_line(r) == (f"longctx: --config={bad}: the config file does not load: {bad}:5: "
                           "TypeError: unsupported operand type(s) for +: 'dict' and 'int'.")


@pytest.mark.parametrize("body, line, error", [
    ("x = undefined_name\n", 2, "NameError: name 'undefined_name' is not defined"),
    ("def get_config(arg=None):\n    return 1 / 0\n", 3, "ZeroDivisionError: division by zero"),
    ("def get_config(arg=None):\n    return [1][\n", 3, "SyntaxError: '[' was never closed"),
])
def test_config_file_that_does_not_load_names_file_and_line_for_argparse_scripts(tmp_path, body, line,
                                                                                  error):
    """cli.load_config_file, what scripts/convert_hf.py's --config goes through."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n" + body)
    with pytest.raises(ConfigError) as e:
        cli.load_config_file(f"{bad}:tiny")
    assert str(e.value) == f"--config={bad}:tiny: the config file does not load: {bad}:{line}: {error}."
    with pytest.raises(ConfigError, match=r"^configs/base\.py: unknown preset 'tinyy'"):
        cli.load_config_file("configs/base.py:tinyy")  # the config's own sentence, as it was


def test_a_misspelt_key_in_a_config_file_names_the_key_and_the_closest_ones(tmp_path):
    """ml_collections' own message dumps the whole section (YAML of its FieldReferences included)."""
    bad = tmp_path / "mine.py"
    bad.write_text("import ml_collections\n\ndef get_config(arg=None):\n"
                   "    c = ml_collections.ConfigDict({'model': {'num_layers': 2, 'num_heads': 4, 'dtype': 'float32'}})\n"
                   "    c.lock()\n    c.model.num_layer = 4\n    return c\n")
    with pytest.raises(ConfigError) as e:
        cli.load_config_file(str(bad))
    assert str(e.value) == (f"--config={bad}: the config file does not load: {bad}:6: 'num_layer' is not a key of "
                            "the section it is set on (the config is locked against new keys); its keys, closest "
                            "first: num_layers, num_heads, dtype.")


# ----------------------------------------------------------------------------- the fix, said


def _suggested_fix(message: str) -> dict:
    """{key: value} of the `set --config.KEY=VALUE` a message suggests first."""
    m = re.search(r": set --config\.([\w.]+)=(\w+)", message)
    assert m, message
    return {m.group(1): int(m.group(2)) if m.group(2).isdigit() else m.group(2) == "True"}


@pytest.mark.parametrize("overrides, expected", [
    ({"mesh.sp": 8}, "mesh: dp*fsdp*sp = 1*2*8 = 16 does not match the 8 devices: set "
                     "--config.mesh.fsdp=1 (or --config.mesh.sp=4)."),
    ({"mesh.dp": 3}, "mesh: dp*fsdp*sp = 3*2*4 = 24 does not match the 8 devices: set --config.mesh.dp=1."),
    ({"mesh.fsdp": 1, "mesh.sp": 8}, "train.loss_chunk_size=256 does not divide the per-device shard "
                                     "of 128 tokens: set --config.train.loss_chunk_size=128."),
    ({"train.loss_chunk_size": 384}, "train.loss_chunk_size=384 does not divide the per-device shard "
                                     "of 256 tokens: set --config.train.loss_chunk_size=256."),
    ({"model.mlp_chunk_size": 96}, "model.mlp_chunk_size=96 does not divide the per-device shard of "
                                   "256 tokens: set --config.model.mlp_chunk_size=64."),
    ({"data.global_batch_size": 3}, "data.global_batch_size=3 is not divisible by dp*fsdp = 1*2 = 2: "
                                    "set --config.data.global_batch_size=4."),
    ({"attention.causal": False, "attention.chunk_size": 128},
     "attention.chunk_size is chunked *causal* attention and needs attention.causal=True: set "
     "--config.attention.causal=True."),
])
def test_an_error_with_one_obvious_fix_says_it_and_the_fix_works(overrides, expected):
    from longctx import config as config_lib

    config = base.get_config("tiny")
    config.unlock()
    for key, value in overrides.items():
        section, name = key.split(".")
        config[section][name] = value
    with pytest.raises(ConfigError) as e:
        config_lib.validate(config, num_devices=8)
    assert str(e.value) == expected
    # Doing what the messages say gives a config that runs (the mesh's fix can uncover the shard's:
    # README's override example met both).
    for _ in range(3):
        try:
            config_lib.validate(config, num_devices=8)
            break
        except ConfigError as error:
            for key, value in _suggested_fix(str(error)).items():
                section, name = key.split(".")
                config[section][name] = value
    else:
        pytest.fail("the suggested fixes did not lead to a config that validates")


def test_vocab_too_small_for_the_dataset_says_the_size_to_set(dataset, tmp_path):
    common = ("--config=configs/base.py:tiny", f"--config.data.path={dataset}")
    r = run(TRAIN, *common, "--config.model.vocab_size=100", f"--workdir={tmp_path / 'w'}")
    assert r.returncode == 2
    vocab = json.loads((dataset / "metadata.json").read_text())["vocab_size"]
    assert the_line(r) == (f"longctx: model.vocab_size=100 is smaller than the dataset's tokenizer "
                           f"vocabulary ({vocab} in {dataset}/metadata.json): set "
                           f"--config.model.vocab_size={vocab}.")
    fixed = run(TRAIN, *common, f"--config.model.vocab_size={vocab}", f"--workdir={tmp_path / 'w'}",
                "--validate_only")
    assert fixed.returncode == 0, fixed.stderr[-2000:]


# ----------------------------------------------------------------------------- --validate_only


def test_validated_ends_a_validate_only_run_with_one_line_and_status_0(capsys, monkeypatch):
    monkeypatch.setenv(cli.VALIDATE_ENV, "0")  # restored afterwards (run sets it)
    ran = []

    def main():
        cli.validated("the flags are fine")
        ran.append(True)
        return 3

    with pytest.raises(SystemExit) as exit_:  # without the flag: validated() does nothing
        cli.run(main, argv=["script"])
    assert exit_.value.code == 3 and ran == [True]
    with pytest.raises(SystemExit) as exit_:
        cli.run(main, argv=["script", "--validate_only"])
    assert exit_.value.code == 0 and ran == [True]
    assert capsys.readouterr().out.endswith(
        "longctx: --validate_only: the flags are fine; nothing was run.\n")


def test_every_script_stops_at_validated_under_validate_only():
    """Each script with a main checks what it can and stops (cli.validated); scripts/train.py's
    point is inside longctx.train.train_and_evaluate."""
    scripts = (sorted(glob.glob(os.path.join(ROOT, "scripts", "*.py"))) + sorted(glob.glob(os.path.join(ROOT, "benchmarks", "*.py")))
               + [os.path.join(ROOT, "launch", "local.py")])
    missing = []
    for path in scripts:
        text = open(path).read()
        if "cli.run" not in text and "__main__" not in text:
            continue  # a library of the scripts (bench_common, bench_ring_report)
        if not re.search(r"cli\.validated\(|validate_command\(", text):
            missing.append(os.path.relpath(path, ROOT))
    assert missing == ["scripts/train.py"]
    assert "cli.validated(check_inputs(" in open(os.path.join(ROOT, "longctx", "train", "loop.py")).read()


def test_train_validate_only_checks_and_writes_nothing(dataset, tmp_path):
    ok = run(TRAIN, "--config=configs/base.py:tiny", f"--workdir={tmp_path / 'w'}",
             f"--config.data.path={dataset}", "--validate_only")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert ok.stdout.strip().splitlines() == [
        f"longctx: --validate_only: config, mesh dp=1 x fsdp=2 x sp=4, workdir {tmp_path / 'w'} and "
        f"data {dataset} are fine; nothing was run."]
    assert not (tmp_path / "w").exists()
    blocker = tmp_path / "wfile"
    blocker.write_text("x")
    bad = run(TRAIN, "--config=configs/base.py:tiny", f"--workdir={blocker / 'below'}", "--validate_only")
    assert bad.returncode == 2
    assert the_line(bad) == (f"longctx: workdir '{blocker / 'below'}' is not writable: {blocker} is a "
                             "file, not a directory.")


# ----------------------------------------------------------------------------- long waits say so


def test_ring_report_says_it_is_working_before_a_large_schedule():
    large = run("scripts/ring_report.py", "--seq-len", "131072", "--sp", "8", "--block", "512",
                "--causal", "--layout", "zigzag", "--json")
    assert large.returncode == 0, large.stderr[-2000:]
    assert large.stderr.splitlines() == [
        "ring_report: working out the zigzag schedule of 256 x 256 blocks over 8 devices ..."]
    assert json.loads(large.stdout)["steps"] == 8  # stdout is still the one JSON object
    small = run("scripts/ring_report.py", "--seq-len", "4096", "--sp", "4", "--block", "512",
                "--causal", "--layout", "zigzag", "--json")
    assert small.returncode == 0 and small.stderr == ""


def test_first_use_corpus_preparation_says_so_once_and_where(tmp_path, monkeypatch, capsys):
    """The line comes before the (half-minute) preparation starts; a prepared corpus is silent."""
    said = []

    def write_dataset(inputs, out_dir, **kwargs):
        said.append(capsys.readouterr().err)
        raise RuntimeError("stop here")

    monkeypatch.setattr(prepare, "write_dataset", write_dataset)
    with pytest.raises(RuntimeError, match="stop here"):
        prepare.prepare_stdlib(str(tmp_path))
    final = os.path.join(str(tmp_path), prepare.stdlib_cache_name())
    assert said == [f"preparing the embedded corpus (the Python standard library in {prepare.stdlib_root()}) "
                    f"once, into {final}; later runs reuse it ...\n"]
    os.makedirs(final)
    open(os.path.join(final, prepare.METADATA), "w").close()
    assert prepare.prepare_stdlib(str(tmp_path)) == final and capsys.readouterr().err == ""


# ----------------------------------------------------------------------------- several processes

ONE_HOST_LACKS_THE_DATA = '''
import importlib.util
import os

_spec = importlib.util.spec_from_file_location("_base", {base!r})
_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_base)


def get_config(arg=None):
    """tiny, whose data.path exists on process 0's "host" only (as when one host of a pod lacks
    the dataset): the start-up check fails on one process of the two."""
    c = _base.get_config("tiny")
    c.data.path = {good!r} if os.environ.get("LONGCTX_PROCESS_ID") == "0" else {missing!r}
    return c
'''


def _one_host_lacks_the_data(dataset, tmp_path):
    config = tmp_path / "one_host.py"
    missing = str(tmp_path / "not_on_this_host")
    config.write_text(ONE_HOST_LACKS_THE_DATA.format(base=os.path.join(ROOT, "configs", "base.py"),
                                                     good=str(dataset), missing=missing))
    return [TRAIN, f"--config={config}", f"--workdir={tmp_path / 'w'}"], missing


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_start_up_error_on_one_process_reaches_the_other(dataset, tmp_path):
    """Two processes of one job, started on their own (as on a pod: no launcher stops the
    survivor): process 1 cannot find the data; both exit 2 within seconds, each with one line
    (process 0 names process 1 and its reason), and stderr holds nothing else. Without the
    agreement process 0 went on into its first collective and waited there for process 1."""
    command, missing = _one_host_lacks_the_data(dataset, tmp_path)
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LONGCTX_")}
    procs = []
    for i in range(2):
        env_i = dict(env, LONGCTX_COORDINATOR=f"127.0.0.1:{port}", LONGCTX_NUM_PROCESSES="2",
                     LONGCTX_PROCESS_ID=str(i), LONGCTX_CPU_DEVICES="4", JAX_PLATFORMS="cpu")
        procs.append(subprocess.Popen([sys.executable, *command], cwd=ROOT, env=env_i, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            results.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            proc.kill()
    own = f"longctx: data.path={missing} does not exist."
    assert results[1][0] == 2 and results[1][2].splitlines() == [own], results[1][2][-3000:]
    assert results[0][0] == 2, results[0][2][-3000:]
    assert results[0][2].splitlines() == [
        f"longctx: process 1 of 2 stopped at start-up: data.path={missing} does not exist."]


def test_a_multi_process_run_shows_no_third_party_log_lines(dataset, tmp_path):
    """launch/local.py's job (the same start-up failure, so that gloo connects for the agreement
    and nothing compiles): no "[Gloo] Rank N is connected" lines, and stderr holds only the
    launcher's and longctx's own lines; with --verbose gloo's lines are there."""
    command, missing = _one_host_lacks_the_data(dataset, tmp_path)
    launch = [os.path.join(ROOT, "launch", "local.py"), "-n", "2", "-d", "4", "--", sys.executable]
    quiet = run(*launch, *command, timeout=300)
    assert quiet.returncode == 2, quiet.stderr[-3000:]
    assert "[Gloo]" not in quiet.stdout + quiet.stderr, (quiet.stdout + quiet.stderr)[-3000:]
    for line in quiet.stderr.splitlines():
        assert re.match(r"(\[launch/local\.py\] |\[p[01]\] longctx: )", line), quiet.stderr[-3000:]
    assert f"[p1] longctx: data.path={missing} does not exist." in quiet.stderr.splitlines()
    loud = run(*launch, *command, "--verbose", timeout=300)
    assert loud.returncode == 2 and re.search(r"\[Gloo\] Rank \d is connected to 1 peer ranks", loud.stdout)


def _launcher():
    spec = importlib.util.spec_from_file_location("launch_local", os.path.join(ROOT, "launch", "local.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gloo_messages_are_dropped_whole_interleaved_or_inside_a_line():
    """launch/local.py's filter on what gloo's threads write: one message, two written at once
    (the pieces interleaved, as a loaded two-process start-up printed it), a message spliced into
    a child's line; a child's own lines stay, digits and gloo-like words included."""
    drop = _launcher().drop_gloo_noise
    one = b"[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n"
    interleaved = (b"[Gloo] Rank [Gloo] Rank 00 is connected to  is connected to 11 peer ranks.  peer ranks. "
                   b"Expected number of connected peer ranks is : Expected number of connected peer ranks is : 11\n\n")
    assert drop(one + b"step 1\n" + interleaved + b"step 2\n") == b"step 1\nstep 2\n"
    assert drop(b"longctx: resumed " + one + b"at step 7\n") == b"longctx: resumed at step 7\n"
    own = b"42\n\nthe ring is connected to 1 peer ranks. on each side\n"
    assert drop(own) == own


LIBRARY_LOGS = '''
import sys
sys.path.insert(0, sys.argv[1])
from longctx import cli
cli.start(cpu_devices=None)
from absl import logging
from tensorboardX import summary
summary.scalar("loss", float("nan"))  # tensorboardX: "NaN or Inf found in input tensor."
logging.warning("a library's absl warning")  # (this file is outside longctx: a library)
logging.error("a library's absl error")
print("done")
'''


def test_library_log_lines_are_kept_out_unless_verbose(tmp_path):
    script = tmp_path / "library_logs.py"
    script.write_text(LIBRARY_LOGS)
    quiet = run(script, ROOT)
    assert quiet.returncode == 0 and quiet.stdout == "done\n"
    assert quiet.stderr.splitlines() == ["ERROR:absl:a library's absl error"]  # errors stay
    loud = run(script, ROOT, "--verbose")
    assert loud.returncode == 0
    assert "NaN or Inf found in input tensor." in loud.stderr
    assert "WARNING:absl:a library's absl warning" in loud.stderr


SIGTERM_WHILE_EXITING = '''
import atexit, os, signal, sys, time
sys.path.insert(0, sys.argv[1])
from longctx import cli
cli.start(cpu_devices=None)

def slow_shutdown():  # as jax's, waiting on a dead peer until the coordination service aborts it
    os.kill(os.getpid(), signal.SIGTERM)  # (the launcher's, for the peer's death)
    time.sleep(60)
    print("the shutdown finished", flush=True)

atexit.register(slow_shutdown)

def main():
    raise RuntimeError("Gloo AllGather failed")

cli.run(main)
'''


def test_sigterm_after_the_outcome_is_said_ends_the_process_with_its_status(tmp_path):
    """A 2-process run whose peer was killed: process 0 said its error, and the launcher's SIGTERM
    came while it exited (test_stop_signals.py's peer test caught it in make test). It printed
    "SIGTERM: stopped." and a traceback from the atexit callback it interrupted, then the
    coordination service's abort; now the process ends at once with the error's status."""
    script = tmp_path / "sigterm_while_exiting.py"
    script.write_text(SIGTERM_WHILE_EXITING)
    r = run(script, ROOT, env={cli.DEBUG_ENV: "0"})
    assert r.returncode == 1, r.stderr
    assert r.stderr == ("longctx: unexpected RuntimeError: Gloo AllGather failed (pass --verbose or set "
                        "LONGCTX_DEBUG=1 for the traceback)\n"), r.stderr
    assert r.stdout == ""  # the shutdown did not go on


@pytest.mark.parametrize("where, kept", [
    ("longctx/train/checkpoint.py", True), ("scripts/train.py", True),
    (".venv/lib/python3.11/site-packages/orbax/checkpoint/x.py", False),  # `make`'s venv is in the repo
    ("/usr/lib/python3/site-packages/tensorboardX/x2num.py", False),
])
def test_own_log_records_are_kept_and_libraries_warnings_dropped(where, kept, monkeypatch):
    import logging

    monkeypatch.setenv(cli.DEBUG_ENV, "0")
    record = logging.LogRecord("absl", logging.WARNING, os.path.join(ROOT, where), 1, "x", None, None)
    assert cli._ThirdPartyLogs().filter(record) is kept
    record.levelno = logging.ERROR
    assert cli._ThirdPartyLogs().filter(record) is True


def _catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (/proc/<pid>/status SigCgt)."""
    with open(f"/proc/{pid}/status") as f:
        caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return bool(caught >> (signum - 1) & 1)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc/<pid>/status")
def test_sigterm_while_a_script_imports_is_one_line_and_status_143(tmp_path):
    """cli.start handles SIGTERM first thing; the signal is sent as soon as the handler is there,
    while the script is still importing jax (seconds before train_and_evaluate takes over)."""
    full_env = {k: v for k, v in os.environ.items() if k not in (cli.DEBUG_ENV, cli.VALIDATE_ENV)}
    p = subprocess.Popen([sys.executable, TRAIN, "--config=configs/base.py:tiny", f"--workdir={tmp_path / 'w'}"],
                         cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not _catches(p.pid, signal.SIGTERM):
            assert p.poll() is None and time.monotonic() < deadline
            time.sleep(0.005)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 143, err[-2000:]
    assert err.strip().splitlines() == ["longctx: SIGTERM: stopped."] and not out.strip(), err[-2000:]
    assert not (tmp_path / "w").exists()
