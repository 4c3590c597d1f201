"""scripts/convert_hf.py check-logits on its own defaults, and the one block chooser behind it.

A model converted with the command line keeps the base config's attention (impl splash, block
512, layout auto); check-logits then runs it with the checkpoint's impl on every device of the
ring (--mesh=1,1,-1, the form docs/extend.md gives and the default). Splash's blocks are multiples of 128
(TPU lanes, the same rule in interpret mode on CPU), so 512-token rows on sp=8 in the zigzag
layout are padded to 2 x 8 x 128 = 2,048 tokens: measured against transformers' logits, 2.4e-5
(tolerance 1e-4, the one of tests/interop/test_hf.py). ~20 s for the splash run on 2 cores.
"""

import os
import sys

import numpy as np
import pytest

from configs import base
from longctx import config as config_lib
from longctx.errors import ConfigError
from longctx.evals import inference
from longctx.ops import blocks
from tests import ROOT as REPO
from tests.validate_commands import ScriptServer, run_scripts

HF_DIR = os.path.join(REPO, "tests", "assets", "hf", "llama3_scaling")
ASSETS = os.path.join(REPO, "tests", "assets", "hf")


def run_script(*args):
    env = {**os.environ, "LONGCTX_CPU_DEVICES": "8", "JAX_PLATFORMS": "cpu"}
    return ScriptServer.run([sys.executable, os.path.join(REPO, "scripts", "convert_hf.py"), *args],
                            cwd=REPO, env=env, timeout=600)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """llama3_scaling converted by the command line, with its defaults (the base config)."""
    out = str(tmp_path_factory.mktemp("check_logits") / "converted")
    done = run_script("to-longctx", f"--hf={HF_DIR}", f"--out={out}")
    assert done.returncode == 0, done.stderr
    return out


def golden(tmp_path, rows=slice(None)):
    inputs = dict(np.load(os.path.join(ASSETS, "inputs.npz")))
    logits = np.load(os.path.join(ASSETS, "golden_logits.npz"))
    path = str(tmp_path / "ids.npz")
    np.savez(path, **{k: v[rows] for k, v in inputs.items()}, logits=logits["llama3_scaling"][rows],
             positions_index=logits["positions_index"])
    return path


def test_check_logits_with_its_default_impl_and_mesh_as_the_readme_prints_it(converted, tmp_path):
    ids = golden(tmp_path)
    out = str(tmp_path / "logits.npz")
    done = run_script("check-logits", f"--checkpoint={converted}", f"--tokens={ids}", "--mesh=1,1,-1",
                      f"--out={out}")
    assert done.returncode == 0, done.stderr + done.stdout
    assert "attention impl splash (block 128)" in done.stdout  # the checkpoint's impl, its lane floor
    assert "'sp': 8" in done.stdout and "512 tokens per row padded to 2048" in done.stdout
    assert ": OK" in done.stdout
    assert np.load(out)["logits"].shape == (2, 128, 512)


def test_one_row_on_a_mesh_with_data_parallel_devices_is_padded(converted, tmp_path):
    """dp x fsdp = 2 x 2: one row is padded to two (not refused with data.global_batch_size, a key
    the tool does not have), and only the real row's logits come back."""
    ids = golden(tmp_path, rows=slice(1, 2))  # the row of three packed documents
    done = run_script("check-logits", f"--checkpoint={converted}", f"--tokens={ids}", "--mesh=2,2,2",
                      "--impl=xla")
    assert done.returncode == 0, done.stderr + done.stdout
    assert "logits [1, 128, 512]" in done.stdout and ": OK" in done.stdout


def test_bad_token_ids_are_one_sentence(converted, tmp_path):
    ids = str(tmp_path / "ids.npy")
    np.save(ids, np.array([[1, 2, 3, 512, 4]]))
    done = run_script("check-logits", f"--checkpoint={converted}", f"--tokens={ids}")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"longctx: --tokens={ids}: 'tokens' holds id 512 at [0, 3], outside the model's vocabulary "
        "of 512 ids (model.vocab_size).")


def test_a_missing_hf_directory_and_a_token_file_numpy_cannot_read_are_one_sentence_each(tmp_path):
    """--hf names a local directory (a hub name is no such thing: nothing is downloaded); numpy's
    own advice about allow_pickle, for a text file, is no fix for the user."""
    text = tmp_path / "ids.txt"
    text.write_text("1 2 3\n")
    script = os.path.join(REPO, "scripts", "convert_hf.py")
    fixture = os.path.join(REPO, "tests", "fixtures", "checkpoint_2373a90")
    results = run_scripts([[script, "to-longctx", "--hf=meta-llama/Llama-3-8B", f"--out={tmp_path / 'out'}"],
                           [script, "to-longctx", "--hf=meta-llama/Llama-3-8B", "--print-config", "--validate_only"],
                           [script, "check-logits", f"--checkpoint={fixture}", f"--tokens={text}"]])
    hub = ("longctx: --hf=meta-llama/Llama-3-8B is not a directory here: --hf takes a local directory of a "
           "Hugging Face checkpoint (config.json and model.safetensors) and convert_hf.py downloads nothing, so "
           "download the model's files first and pass their directory.")
    assert [r["returncode"] for r in results] == [2, 2, 2], results
    assert [r["stderr"].strip().splitlines() for r in results[:2]] == [[hub], [hub]]
    assert results[2]["stderr"].strip().splitlines() == [
        f"longctx: --tokens={text} is not a .npy or .npz file: write the token ids with numpy.save (an int array "
        "[batch, n]) or numpy.savez (tokens=..., and the optional arrays convert_hf.py -h lists)."]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("rows, message", [
    ({"tokens": np.array([[1, -2, 3]])}, r"'tokens' holds -2 at \[0, 1\]; it must not be negative"),
    ({"tokens": np.array([[1, 700]])}, r"'tokens' holds id 700 at \[0, 1\], outside the model's vocabulary of 512"),
    ({"tokens": np.array([[1.0, 2.0]])}, r"'tokens' holds float64 values; it must hold integers"),
    ({"tokens": np.ones((2, 3, 4), np.int32)}, r"'tokens' has rank 3 \(shape \[2, 3, 4\]\)"),
    ({"tokens": np.ones((2, 4), np.int32), "positions": np.ones((2, 3), np.int32)},
     r"'positions' has shape \[2, 3\], 'tokens' \[2, 4\]; they must match"),
    ({"tokens": np.ones((1, 4), np.int32), "segment_ids": np.array([[1, 1, -1, 2]])},
     r"'segment_ids' holds -1 at \[0, 2\]"),
    ({"positions": np.ones((1, 4), np.int32)}, r"has no 'tokens'"),
])
def test_rows_are_checked_in_one_sentence(rows, message):
    with pytest.raises(ConfigError, match=message) as raised:
        inference.check_rows(rows, 512, "ids.npz")
    assert str(raised.value).startswith("ids.npz") and str(raised.value).count(". ") == 0


def test_rows_of_rank_one_are_one_row():
    rows = inference.check_rows({"tokens": np.arange(5)}, 512)
    assert rows["tokens"].shape == (1, 5) and rows["segment_ids"].tolist() == [[1] * 5]
    assert rows["positions"].tolist() == [[0, 1, 2, 3, 4]]


# ----------------------------------------------------------------------------- the block chooser


def test_fit_block_keeps_splash_at_whole_lanes():
    assert blocks.fit_block(512, 1024, "splash", "zigzag") == 512
    assert blocks.fit_block(512, 512, "splash", "zigzag") == 256  # divides each zigzag half
    assert blocks.fit_block(512, 256, "splash", "zigzag") == 128
    assert blocks.fit_block(512, 128, "splash", "zigzag") is None  # halves of 64 tokens: none
    assert blocks.fit_block(512, 128, "xla", "zigzag") == 64
    assert blocks.fit_block(512, 96, "xla", "contiguous") == 32


@pytest.mark.parametrize("impl, layout, n, sp, largest, want", [
    ("splash", "zigzag", 512, 8, 512, (2048, 128)),  # 2 x 8 x 128: splash pads past n
    ("splash", "zigzag", 4096, 8, 512, (4096, 256)),  # the largest block at the shortest length
    ("xla", "zigzag", 512, 4, 512, (512, 64)),
    ("xla", "contiguous", 100, 4, 512, (128, 32)),  # not below 16-token blocks
    ("splash", "contiguous", 100, 2, 64, (256, 128)),  # a checkpoint's xla block below the floor
])
def test_padded_length(impl, layout, n, sp, largest, want):
    seq_len, block = blocks.padded_length(n, sp, impl, layout, largest)
    assert (seq_len, block) == want
    assert seq_len >= n and blocks.block_problem(block, seq_len // sp, impl) is None


def test_config_validation_refuses_a_block_splash_cannot_run():
    config = base.get_config()
    config_lib.apply_overrides(config, {"mesh.dp": 1, "mesh.fsdp": 1, "mesh.sp": 8, "data.seq_len": 1024,
                                "attention.block_size": 64, "attention.impl": "splash",
                                "train.loss_chunk_size": 64})
    with pytest.raises(ConfigError, match=r"^attention.block_size=64 must be a multiple of 128 for "
                       r"attention.impl='splash' \(TPU lanes\); set --config.attention.block_size=128\.$"):
        config_lib.validate(config, num_devices=8)
    config.data.seq_len = 512  # shards of 64 tokens: no splash block at all
    with pytest.raises(ConfigError, match="64-token shards hold no such block: use --config.attention.impl=xla"):
        config_lib.validate(config, num_devices=8)
    config.attention.impl = "xla"
    config_lib.validate(config, num_devices=8)
