"""Hugging Face checkpoints in and out: logits against transformers itself, exact round trips, bad input.

The fixtures (tests/assets/hf, made by make_fixtures.py with transformers; versions in
versions.json) are tiny random Llama and Mistral models and transformers' float32 logits for two
512-token rows (one document; three packed documents). Converting them and running longctx's
forward on the 1x2x4 mesh, the ring over sp=4 in the zigzag layout, must reproduce those logits
within 1e-4; measured (this machine, XLA CPU): llama_untied 3.6e-5, llama_tied 1.6e-5,
llama3_scaling 3.2e-5, mistral_window 1.9e-5. The weights are scaled up so that logits are O(1)
to O(10): a RoPE, window or layout error moves them by 0.02 to 10, far above the tolerance
(test_logit_check_has_teeth).
"""

import json
import os
import shutil
import sys

import ml_dtypes
import numpy as np
import pytest

from configs import base
from longctx import config as config_lib
from longctx.errors import ConfigError
from longctx.evals import inference
from longctx.interop import hf, params_io, staging
from tests import ASSETS, FIXTURES
from tests.validate_commands import ScriptServer, run_scripts

ASSETS = os.path.join(ASSETS, "hf")
from tests import ROOT as REPO

MODELS = ("llama_untied", "llama_tied", "llama3_scaling", "mistral_window")
RING = {"mesh.dp": 1, "mesh.fsdp": 2, "mesh.sp": 4, "attention.impl": "xla", "attention.layout": "zigzag",
        "attention.block_size": 64, "data.seq_len": 512, "data.global_batch_size": 2,
        "train.loss_chunk_size": 128, "model.dtype": "float32"}
TOLERANCE = 1e-4


def converted_config(hf_dir: str, **extra):
    config = base.get_config()
    config_lib.apply_overrides(config, hf.config_overrides(hf.read_config(hf_dir), hf_dir))
    config_lib.apply_overrides(config, {**RING, **extra})
    return config


def convert(hf_dir: str, out: str) -> str:
    """HF directory -> longctx checkpoint directory, the library path scripts/convert_hf.py takes."""
    config = converted_config(hf_dir)
    runner = inference.make_runner(config, lambda a, s: hf.load_params(hf_dir, config, a, s))
    params_io.save(out, config, runner.params, source=hf_dir)
    with open(os.path.join(out, "hf_config.json"), "w") as f:  # (as to-longctx writes it)
        json.dump(hf.read_config(hf_dir), f)
    return out


def golden_rows():
    inputs = dict(np.load(os.path.join(ASSETS, "inputs.npz")))
    golden = np.load(os.path.join(ASSETS, "golden_logits.npz"))
    where = np.tile(golden["positions_index"], (2, 1))
    return inputs, golden, where


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("converted")
    return {name: convert(os.path.join(ASSETS, name), str(root / name)) for name in MODELS}


def assert_logits_match_transformers(checkpoint, name):
    """`checkpoint` restored on the 1x2x4 mesh -> ring (sp=4, zigzag) forward, against the
    fixture `name`'s golden logits from transformers."""
    runner = inference.runner_from_checkpoint(checkpoint, RING)
    assert runner.layout == "zigzag" and runner.sp == 4
    inputs, golden, where = golden_rows()
    logits = runner.logits_at(inputs, where)
    diff = float(np.abs(logits - golden[name]).max())
    print(f"{name}: max |logit difference| vs transformers = {diff:.3g}")
    assert np.abs(golden[name]).max() > 5.0  # logits large enough for errors to show
    assert diff <= TOLERANCE


@pytest.mark.parametrize("name", MODELS)
def test_logits_match_transformers(name, converted):
    """Converted checkpoint -> restored on the 1x2x4 mesh -> ring (sp=4, zigzag) forward."""
    assert_logits_match_transformers(converted[name], name)


@pytest.mark.parametrize("name, wrong, min_diff", [
    ("mistral_window", {"attention.sliding_window": 100}, 1.0),  # HF's window taken as ours (off by one)
    ("llama3_scaling", {"model.rope_scaling.type": "none"}, 1.0),  # scaling ignored
    ("llama_untied", {"model.rope_theta": 10_001.0}, 0.01),  # theta off by 1e-4 relative
])
def test_logit_check_has_teeth(name, wrong, min_diff):
    hf_dir = os.path.join(ASSETS, name)
    config = converted_config(hf_dir, **wrong)
    runner = inference.make_runner(config, lambda a, s: hf.load_params(hf_dir, config, a, s))
    inputs, golden, where = golden_rows()
    assert np.abs(runner.logits_at(inputs, where) - golden[name]).max() > min_diff


def test_weights_are_sharded_on_the_mesh(converted):
    runner = inference.runner_from_checkpoint(converted["llama_untied"], RING)
    wq = runner.params["blocks"]["wq"][...]
    assert wq.shape == (2, 64, 4, 16)
    assert {s.data.shape for s in wq.addressable_shards} == {(2, 8, 4, 16)}  # d_model over fsdp x sp = 2 x 4


@pytest.mark.parametrize("name", ["llama_untied", "llama_tied", "mistral_window"])
def test_round_trip_is_bit_identical(name, converted, tmp_path):
    """HF -> longctx -> HF: every tensor equal bit for bit, none added or lost (several shards)."""
    runner = inference.runner_from_checkpoint(converted[name], RING)
    with open(os.path.join(ASSETS, name, "config.json")) as f:
        template = json.load(f)
    out = str(tmp_path / "hf")
    written = hf.write_hf(runner.params, runner.config, out, dtype=np.float32, template=template,
                          max_shard_bytes=200_000)
    assert hf.INDEX_FILE in written and len(written) > 3
    source = dict(hf.iter_hf_tensors(os.path.join(ASSETS, name)))
    again = dict(hf.iter_hf_tensors(out))
    assert sorted(again) == sorted(source)
    for key, value in source.items():
        assert again[key].dtype == value.dtype and again[key].shape == value.shape, key
        assert again[key].tobytes() == value.tobytes(), key
    exported = hf.read_config(out)
    for key in ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
                "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "tie_word_embeddings", "sliding_window", "bos_token_id", "eos_token_id"):
        assert exported.get(key) == template.get(key), key
    # What the safetensors package itself reads (what transformers' loader uses).
    from safetensors import safe_open

    index = json.load(open(os.path.join(out, hf.INDEX_FILE)))
    key = "model.layers.1.self_attn.o_proj.weight"
    with safe_open(os.path.join(out, index["weight_map"][key]), framework="numpy") as f:
        np.testing.assert_array_equal(f.get_tensor(key), source[key])


def test_llama3_scaling_exports_in_both_spellings_readers_understand(converted, tmp_path):
    runner = inference.runner_from_checkpoint(converted["llama3_scaling"], RING)
    hf.write_hf(runner.params, runner.config, str(tmp_path), dtype=np.float32)
    exported = hf.read_config(str(tmp_path))
    assert exported["rope_theta"] == 500_000.0
    assert exported["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    # factor x original = 2,048 (the fixture's own value), above the 512 tokens the model ran at.
    assert exported["max_position_embeddings"] == 2048
    source = hf.read_config(os.path.join(ASSETS, "llama3_scaling"))  # rope_parameters spelling
    assert hf.config_overrides(exported) == hf.config_overrides(source)


EXPORT_GOLDEN = json.load(open(os.path.join(ASSETS, "rope_export_golden.json")))
EXPORT_KEYS = ("hidden_size", "num_attention_heads", "head_dim", "rope_theta", "max_position_embeddings",
               "rope_scaling")


def spelled(source: dict, key: str) -> dict:
    """A config.json with its rope type under `key`: "type" (older releases) or "rope_type"."""
    scaling = dict(source["rope_scaling"])
    scaling[key] = scaling.pop("rope_type")
    return {**LLAMA31_8B, **source, "rope_scaling": scaling}


def longctx_rotary(hf_config: dict):
    """The frequencies longctx computes for a config.json (as converted)."""
    from longctx.model import rope

    config = base.get_config()
    config_lib.apply_overrides(config, hf.config_overrides(hf_config))
    return rope.from_model_config(config.model)


def assert_same_rotary(got, reading: dict, what: str) -> None:
    expected = np.asarray(reading["inv_freq"], np.float32)
    assert got.inv_freq.shape == expected.shape, what
    # tests/model/test_rope.py: equal, or 1 ulp where torch's float32 pow is not correctly rounded.
    assert np.abs(got.inv_freq.view(np.int32) - expected.view(np.int32)).max() <= 1, what
    assert got.attention_scaling == pytest.approx(reading["attention_scaling"], rel=1e-12, abs=0), what


@pytest.mark.parametrize("kind", ["linear", "llama3", "yarn"])
@pytest.mark.parametrize("spelling", ["type", "rope_type"])
def test_rope_scaling_exports_what_transformers_reads_as_the_source(kind, spelling):
    """Source config.json (either spelling) -> longctx, trained at seq_len -> exported config.json.
    The exported RoPE fields are exactly the expected ones (YaRN: max_position_embeddings =
    factor x original, whatever the template's or the training length), and every transformers
    version in the fixture (5.x; 4.51, which reads YaRN's factor back from max_position_embeddings;
    4.57) computes from the export the frequencies it computes from the source, and longctx's."""
    case = EXPORT_GOLDEN["cases"][kind]
    source = spelled(case["source"], spelling)
    config = base.get_config()
    config_lib.apply_overrides(config, hf.config_overrides(source))
    config_lib.apply_overrides(config, {"data.seq_len": case["seq_len"]})
    exported = hf.export_config(config, np.float32, template=source)
    assert {k: exported[k] for k in EXPORT_KEYS} == case["exported"]
    assert exported["bos_token_id"] == LLAMA31_8B["bos_token_id"]  # the template's other fields
    ours = longctx_rotary(exported)
    assert_same_rotary(ours, {"inv_freq": longctx_rotary(source).inv_freq.astype(np.float64).tolist(),
                              "attention_scaling": longctx_rotary(source).attention_scaling}, "round trip")
    assert set(EXPORT_GOLDEN["transformers"]) >= {"4.51.3", "5.24.0"}
    for version, readings in EXPORT_GOLDEN["transformers"].items():
        reading = readings[kind]
        assert reading["exported"] == reading[f"source_{spelling}"], f"transformers {version}"
        assert_same_rotary(ours, reading["exported"], f"transformers {version}")


def test_yarn_export_as_written_before_is_read_differently_by_transformers_4():
    """Why YaRN's max_position_embeddings must be factor x original: the export longctx wrote
    before (the 32,768-token training length) is read by transformers 4.51 as factor 8, not 4."""
    before = EXPORT_GOLDEN["written_before"]["yarn_written_before"]
    fixed = EXPORT_GOLDEN["cases"]["yarn"]["exported"]
    assert before["max_position_embeddings"] == 2 * fixed["max_position_embeddings"] == 32_768
    readings = EXPORT_GOLDEN["transformers"]
    assert readings["4.51.3"]["yarn_written_before"]["exported"] != readings["4.51.3"]["yarn"]["source_rope_type"]
    assert readings["4.51.3"]["yarn_written_before"]["exported"]["attention_scaling"] == pytest.approx(
        0.1 * np.log(8.0) + 1)
    assert readings["5.24.0"]["yarn_written_before"]["exported"] == readings["5.24.0"]["yarn"]["source_rope_type"]


def write_bf16_copy(source: str, out: str) -> None:
    """The fixture in bfloat16, split over two files with an index (as released checkpoints are)."""
    from safetensors.numpy import save_file

    os.makedirs(out)
    tensors = {k: np.asarray(v, np.float32).astype(ml_dtypes.bfloat16) for k, v in hf.iter_hf_tensors(source)}
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file_name, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, os.path.join(out, file_name), metadata={"format": "pt"})
    with open(os.path.join(out, hf.INDEX_FILE), "w") as f:
        json.dump({"metadata": {}, "weight_map": {k: f for f, ks in halves.items() for k in ks}}, f)
    config = hf.read_config(source)
    config["torch_dtype"] = "bfloat16"
    with open(os.path.join(out, hf.CONFIG_FILE), "w") as f:
        json.dump(config, f)


def test_bfloat16_sharded_checkpoint_round_trips(tmp_path):
    source = str(tmp_path / "bf16")
    write_bf16_copy(os.path.join(ASSETS, "llama_untied"), source)
    converted = convert(source, str(tmp_path / "longctx"))
    runner = inference.runner_from_checkpoint(converted, RING)
    assert runner.params["embed"][...].dtype == np.float32  # float32 master weights
    out = str(tmp_path / "back")
    hf.write_hf(runner.params, runner.config, out, dtype=ml_dtypes.bfloat16)
    original, again = dict(hf.iter_hf_tensors(source)), dict(hf.iter_hf_tensors(out))
    assert sorted(again) == sorted(original)
    for key, value in original.items():
        assert again[key].dtype == ml_dtypes.bfloat16 and again[key].tobytes() == value.tobytes(), key


def test_init_from_accepts_a_converted_checkpoint(converted, tmp_path):
    """The trainer's own restore path (checkpoint.init_from) takes the converted parameters."""
    import jax

    from longctx.parallel import mesh as mesh_lib
    from longctx.train import checkpoint as checkpoint_lib
    from longctx.train import state as train_state

    config = converted_config(os.path.join(ASSETS, "llama_tied"))
    config.checkpoint.init_from = converted["llama_tied"]
    mesh = mesh_lib.make_mesh(config.mesh)
    with jax.set_mesh(mesh):
        setup = train_state.make_setup(config, mesh, "zigzag")
        checkpointer = checkpoint_lib.Checkpointer(str(tmp_path / "run"), config)
        try:
            state, _, note = checkpointer.restore_or_init(setup, lambda seed_offset=0: None)
        finally:
            checkpointer.close()
    assert "fresh start with parameters from" in note
    # The source's config.json comes along, so that exporting this run keeps its token ids.
    assert note.endswith("; hf_config.json carried along for export"), note
    os.makedirs(tmp_path / "run" / "checkpoints" / "7" / "state")  # (a step directory's shape)
    for path in ("run", "run/checkpoints", "run/checkpoints/7"):  # what to-hf --checkpoint takes
        assert params_io.hf_config_path(str(tmp_path / path)) == str(tmp_path / "run" / "hf_config.json")
    carried = str(tmp_path / "run" / "hf_config.json")
    assert json.load(open(carried)) == hf.read_config(os.path.join(ASSETS, "llama_tied"))
    source = dict(hf.iter_hf_tensors(os.path.join(ASSETS, "llama_tied")))
    np.testing.assert_array_equal(np.asarray(state.params["embed"][...]), source["model.embed_tokens.weight"])
    np.testing.assert_array_equal(np.asarray(state.params["blocks"]["w_down"][...])[1],
                                  source["model.layers.1.mlp.down_proj.weight"].T)


@pytest.mark.parametrize("change, refused", [
    ({"model.rope_theta": 500_000.0}, "model.rope_theta: checkpoint 10000.0 vs config 500000.0"),
    ({"model.norm_eps": 1e-6}, "model.norm_eps: checkpoint 1e-05 vs config 1e-06"),
    ({"attention.sliding_window": 99}, "attention.sliding_window: checkpoint None vs config 99"),
    ({"attention.causal": False}, "attention.causal: checkpoint True vs config False"),
])
def test_init_from_refuses_a_model_that_computes_another_function(converted, tmp_path, change, refused):
    """Same shapes, another function: refused before anything is compiled, in one sentence naming
    the key and the flag that accepts it; accepted when checkpoint.init_from_allow names it."""
    from longctx.train import checkpoint as checkpoint_lib

    config = converted_config(os.path.join(ASSETS, "llama_untied"), **change)
    config.checkpoint.init_from = converted["llama_untied"]
    key = refused.split(":")[0]
    with pytest.raises(ConfigError) as raised:
        checkpoint_lib.Checkpointer(str(tmp_path / "run"), config)
    message = str(raised.value)
    assert refused in message and f"--config.checkpoint.init_from_allow={key} " in message
    assert "\n" not in message and message.count(". ") == 0, message
    config.checkpoint.init_from_allow = f"model.mlp_dim,{key}"  # (validate refuses the first)
    with pytest.raises(ConfigError, match="init_from_allow names 'model.mlp_dim', which init_from does not compare"):
        config_lib.validate(config)
    config.checkpoint.init_from_allow = key
    config_lib.validate(config)
    checkpointer = checkpoint_lib.Checkpointer(str(tmp_path / "run"), config)
    checkpointer.close()
    assert checkpointer._init_from_changes == [refused]


def test_init_from_lists_the_context_extension_and_refuses_other_scaling(converted, tmp_path):
    """docs/extend.md's recipe: the converted model plus RoPE scaling and a longer seq_len starts, and the
    start-up line lists both; changing the scaling a model already has is refused."""
    from longctx.train import checkpoint as checkpoint_lib

    extension = {"model.rope_scaling.type": "llama3", "model.rope_scaling.factor": 8.0,
                 "model.rope_scaling.original_max_position": 512, "data.seq_len": 1024,
                 "train.loss_chunk_size": 256}
    config = converted_config(os.path.join(ASSETS, "llama_untied"), **extension)
    config.checkpoint.init_from = converted["llama_untied"]
    checkpointer = checkpoint_lib.Checkpointer(str(tmp_path / "run"), config)
    checkpointer.close()
    assert checkpointer._init_from_changes == [
        "data.seq_len: checkpoint 512 vs config 1024",
        "model.rope_scaling: checkpoint none vs config llama3(factor=8.0, low_freq_factor=1.0, "
        "high_freq_factor=4.0, original_max_position=512)"]

    config = converted_config(os.path.join(ASSETS, "llama3_scaling"), **{"model.rope_scaling.factor": 4.0})
    config.checkpoint.init_from = converted["llama3_scaling"]
    with pytest.raises(ConfigError, match=r"model\.rope_scaling: checkpoint llama3\(factor=8\.0, .*\) vs "
                                          r"config llama3\(factor=4\.0, "):
        checkpoint_lib.Checkpointer(str(tmp_path / "run2"), config)


# ----------------------------------------------------------------------------- output directories


def listing(directory) -> dict[str, bytes]:
    return {name: open(os.path.join(directory, name), "rb").read() for name in sorted(os.listdir(directory))}


def test_export_into_a_used_directory(converted, tmp_path, monkeypatch):
    """A non-empty --out is refused; with overwrite it is replaced whole (no shard or index of the
    older, sharded export stays beside the new model.safetensors); a failed export leaves the old
    one as it was; files are 0644 whatever the umask."""
    runner = inference.runner_from_checkpoint(converted["llama_untied"], RING)
    out = str(tmp_path / "hf")
    hf.write_hf(runner.params, runner.config, out, dtype=np.float32, max_shard_bytes=200_000)
    sharded = listing(out)
    assert hf.INDEX_FILE in sharded and len(sharded) > 3
    with pytest.raises(ConfigError, match=rf"^--out={out} is not empty; pass --overwrite to replace it"):
        hf.write_hf(runner.params, runner.config, out, dtype=np.float32)
    assert listing(out) == sharded

    from safetensors import numpy as safetensors_numpy

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(safetensors_numpy, "save_file", disk_full)
        with pytest.raises(OSError, match="No space left"):
            hf.write_hf(runner.params, runner.config, out, dtype=np.float32, overwrite=True)
    assert listing(out) == sharded
    assert os.listdir(tmp_path) == ["hf"]  # no partial directory left behind

    old_umask = os.umask(0o077)
    try:
        written = hf.write_hf(runner.params, runner.config, out, dtype=np.float32, overwrite=True)
    finally:
        os.umask(old_umask)
    assert sorted(written + [staging.MARKER]) == sorted(os.listdir(out)) == [
        hf.CONFIG_FILE, staging.MARKER, hf.SINGLE_FILE]
    assert os.listdir(tmp_path) == ["hf"]
    assert oct(os.stat(out).st_mode & 0o777) == oct(0o755)
    assert {oct(os.stat(os.path.join(out, f)).st_mode & 0o777) for f in written} == {oct(0o644)}
    source = dict(hf.iter_hf_tensors(os.path.join(ASSETS, "llama_untied")))
    assert all(v.tobytes() == source[k].tobytes() for k, v in hf.iter_hf_tensors(out))


def test_overwrite_never_deletes_what_the_export_reads(tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    for out in (tmp_path, tmp_path / "run"):
        with pytest.raises(ConfigError, match=rf"^--out={out} holds --checkpoint={tmp_path}/run/checkpoints, "
                                              r"which replacing it would delete; choose another --out\.$"):
            staging.check_destination(str(out), True, source=("--checkpoint", str(tmp_path / "run/checkpoints")))
    staging.check_destination(str(tmp_path / "run2"), True, source=("--checkpoint", str(tmp_path / "run")))


def test_overwrite_replaces_an_export_never_the_users_own_files(tmp_path):
    """An export carries staging.MARKER and --overwrite replaces it; a non-empty directory without
    it (the user's own files, a downloaded model) is refused, with --overwrite or without, and
    left as it is."""
    export = str(tmp_path / "export")
    with staging.staged(export, overwrite=False) as out:
        open(os.path.join(out, "model.safetensors"), "w").close()
    assert sorted(os.listdir(export)) == [staging.MARKER, "model.safetensors"]
    with staging.staged(export, overwrite=True) as out:
        open(os.path.join(out, "config.json"), "w").close()
    assert sorted(os.listdir(export)) == ["config.json", staging.MARKER]

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    for overwrite in (False, True):
        with pytest.raises(ConfigError, match=(
                rf"^--out={mine} holds files that are not a longctx export \(no {staging.MARKER}\), which "
                r"longctx never deletes, with --overwrite or without; choose another --out\.$")):
            with staging.staged(str(mine), overwrite=overwrite):
                pass
    assert os.listdir(mine) == ["notes.txt"] and (mine / "notes.txt").read_text() == "the user's"
    assert sorted(os.listdir(tmp_path)) == ["export", "mine"]  # no partial directory left


def run_validated(*commands):
    """[(returncode, stdout + stderr)] of `convert_hf.py ARGS` for each ARGS (`--validate_only`
    where a command says so, else the real run)."""
    script = os.path.join(REPO, "scripts", "convert_hf.py")
    return [(r["returncode"], r["stdout"] + r["stderr"]) for r in run_scripts([[script, *c] for c in commands])]


def test_validate_only_checks_out_as_the_export_does(tmp_path):
    """to-hf and to-longctx --validate_only refuse the --out the command would refuse (before,
    both said "fine"), in the same sentence; the real run refuses the user's directory before
    reading anything, and deletes none of it."""
    export, mine = tmp_path / "export", tmp_path / "mine"
    export.mkdir()
    (export / staging.MARKER).write_text("{}")
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    hf_dir = os.path.join(ASSETS, "llama_tied")
    to_hf = ("to-hf", f"--checkpoint={os.path.join(FIXTURES, 'checkpoint_2373a90')}")
    results = run_validated(
        (*to_hf, f"--out={export}", "--validate_only"),
        (*to_hf, f"--out={export}", "--overwrite", "--validate_only"),
        (*to_hf, f"--out={mine}", "--overwrite", "--validate_only"),
        (*to_hf, f"--out={mine}", "--overwrite"),
        ("to-longctx", f"--hf={hf_dir}", f"--out={export}", "--validate_only"),
        ("to-longctx", f"--hf={hf_dir}", f"--out={mine}", "--overwrite", "--validate_only"),
        ("to-longctx", f"--hf={hf_dir}", f"--out={tmp_path / 'new'}", "--validate_only"))
    not_empty = (f"longctx: --out={export} is not empty; pass --overwrite to replace it (the old contents "
                 "are kept until the new ones are complete).")
    not_export = (f"longctx: --out={mine} holds files that are not a longctx export (no {staging.MARKER}), "
                  "which longctx never deletes, with --overwrite or without; choose another --out.")
    for (returncode, out), (want_code, want_line) in zip(results, [
            (2, not_empty), (0, "longctx: --validate_only: "), (2, not_export), (2, not_export),
            (2, not_empty), (2, not_export), (0, "longctx: --validate_only: ")]):
        lines = out.strip().splitlines()
        assert returncode == want_code and len(lines) == 1 and lines[0].startswith(want_line), out
    assert os.listdir(mine) == ["notes.txt"] and (mine / "notes.txt").read_text() == "the user's"
    assert not os.path.exists(tmp_path / "new")


def test_reader_prefers_model_safetensors_as_transformers_does(tmp_path):
    """transformers' from_pretrained takes model.safetensors before model.safetensors.index.json;
    so does longctx (here the index lists another export's shard, all zeros)."""
    from safetensors.numpy import save_file

    directory = copy_fixture(tmp_path)
    tensors = dict(hf.iter_hf_tensors(directory))
    save_file({k: np.zeros_like(v) for k, v in tensors.items()},
              os.path.join(directory, "model-00001-of-00001.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, hf.INDEX_FILE), "w") as f:
        json.dump({"metadata": {}, "weight_map": {k: "model-00001-of-00001.safetensors" for k in tensors}}, f)
    again = dict(hf.iter_hf_tensors(directory))
    assert sorted(again) == sorted(tensors)
    assert all(again[k].tobytes() == v.tobytes() for k, v in tensors.items())
    assert hf.ignored_index(directory)  # (to-longctx says so)


def test_params_io_overwrite_keeps_the_old_directory_when_the_save_fails(converted, tmp_path, monkeypatch):
    import orbax.checkpoint as ocp

    out = shutil.copytree(converted["llama_tied"], str(tmp_path / "converted"))
    before = sorted(os.path.relpath(os.path.join(d, f), out) for d, _, fs in os.walk(out) for f in fs)
    config, _, _ = params_io.read_config(out)
    with pytest.raises(ConfigError, match="is not empty; pass --overwrite"):
        params_io.save(out, config, {}, source="x")

    def save_fails(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ocp.CheckpointManager, "save", save_fails)
    with pytest.raises(OSError, match="No space left"):
        params_io.save(out, config, {}, source="x", overwrite=True)
    after = sorted(os.path.relpath(os.path.join(d, f), out) for d, _, fs in os.walk(out) for f in fs)
    assert after == before and os.listdir(tmp_path) == ["converted"]
    monkeypatch.undo()
    runner = inference.runner_from_checkpoint(out, RING)  # still the converted model
    source = dict(hf.iter_hf_tensors(os.path.join(ASSETS, "llama_tied")))
    np.testing.assert_array_equal(np.asarray(runner.params["embed"][...]), source["model.embed_tokens.weight"])


# ----------------------------------------------------------------------------- config.json


LLAMA31_8B = {  # Llama-3.1-8B's config.json as released (legacy rope spelling)
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 128000,
    "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256}


def test_llama31_config_gives_the_extend_preset_model():
    overrides = hf.config_overrides(LLAMA31_8B)
    assert overrides["model.rope_scaling.type"] == "llama3"
    preset = base.get_config("llama3_8b_extend_128k")
    assert hf.print_overrides(overrides, base=preset) == ""  # nothing to override: the same model
    # Llama-3-8B (8K, no scaling) differs only in the RoPE scaling the preset adds.
    llama3 = {k: v for k, v in LLAMA31_8B.items() if k != "rope_scaling"}
    assert hf.print_overrides(hf.config_overrides(llama3), base=preset) == "--config.model.rope_scaling.type=none"


def test_extend_recipe_passes_the_init_from_check():
    """docs/extend.md's recipe: Llama-3-8B converted with the default --config, then the
    llama3_8b_extend_128k preset started from it: nothing refused, two changes listed."""
    from longctx.train import checkpoint_compat as compat

    llama3 = {k: v for k, v in LLAMA31_8B.items() if k != "rope_scaling"}
    converted = base.get_config()
    config_lib.apply_overrides(converted, hf.config_overrides(llama3))
    preset = base.get_config("llama3_8b_extend_128k")
    listed, refused = compat.init_from_differences(converted.to_dict(), preset.to_dict(), ())
    assert refused == []
    assert listed == ["data.seq_len: checkpoint 2048 vs config 131072",
                      "model.rope_scaling: checkpoint none vs config llama3(factor=8.0, low_freq_factor=1.0, "
                      "high_freq_factor=4.0, original_max_position=8192)"]
    # Converted from Llama-3.1 (which has the scaling) but started without it: refused.
    config_lib.apply_overrides(converted, hf.config_overrides(LLAMA31_8B))
    listed, refused = compat.init_from_differences(converted.to_dict(), base.get_config("llama3_8b_128k").to_dict(), ())
    assert refused == ["model.rope_scaling: checkpoint llama3(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, "
                       "original_max_position=8192) vs config none"]


def test_mistral_window_maps_exactly():
    mistral = {**LLAMA31_8B, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
               "sliding_window": 4096, "rope_scaling": None, "rope_theta": 10000.0}
    assert hf.config_overrides(mistral)["attention.sliding_window"] == 4095  # HF W keys = our w+1
    config = base.get_config()
    config_lib.apply_overrides(config, hf.config_overrides(mistral))
    assert hf.export_config(config, np.float32)["sliding_window"] == 4096
    assert hf.config_overrides({**mistral, "sliding_window": None})["attention.sliding_window"] is None


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["PhiForCausalLM"], "model_type": "phi"}, "architecture 'PhiForCausalLM'"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope type 'dynamic' is not supported"),
    ({"attention_bias": True}, "attention_bias=true is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({"num_hidden_layers": None}, "has no 'num_hidden_layers'"),
])
def test_unsupported_config_is_named(change, message):
    with pytest.raises(ConfigError, match=message):
        hf.config_overrides({**LLAMA31_8B, **change}, "x/config.json")


def copy_fixture(tmp_path, name="llama_untied"):
    out = str(tmp_path / name)
    shutil.copytree(os.path.join(ASSETS, name), out)
    return out


def rewrite_tensors(directory, edit):
    from safetensors.numpy import save_file

    tensors = {k: np.array(v) for k, v in hf.iter_hf_tensors(directory)}
    edit(tensors)
    save_file(tensors, os.path.join(directory, hf.SINGLE_FILE), metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path):
    directory = copy_fixture(tmp_path)
    rewrite_tensors(directory, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    config = converted_config(directory)
    with pytest.raises(ConfigError, match=r"has no tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        inference.make_runner(config, lambda a, s: hf.load_params(directory, config, a, s))


def test_shape_disagreeing_with_config_json_is_named(tmp_path):
    directory = copy_fixture(tmp_path)
    config_path = os.path.join(directory, hf.CONFIG_FILE)
    hf_config = hf.read_config(directory)
    hf_config["num_key_value_heads"] = 4
    with open(config_path, "w") as f:
        json.dump(hf_config, f)
    config = converted_config(directory)
    with pytest.raises(ConfigError, match=r"tensor model\.layers\.0\.self_attn\.k_proj\.weight has shape "
                                          r"\[32, 64\] but config\.json implies \[64, 64\]"):
        inference.make_runner(config, lambda a, s: hf.load_params(directory, config, a, s))


def test_unexpected_tensor_is_named(tmp_path):
    directory = copy_fixture(tmp_path)
    rewrite_tensors(directory, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)}))
    config = converted_config(directory)
    with pytest.raises(ConfigError, match=r"holds tensor model\.layers\.0\.self_attn\.q_proj\.bias"):
        inference.make_runner(config, lambda a, s: hf.load_params(directory, config, a, s))


def test_missing_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match="config.json does not exist"):
        hf.read_config(str(tmp_path))
    with pytest.raises(ConfigError, match="has neither model.safetensors nor model.safetensors.index.json"):
        hf.SafetensorsFiles(str(tmp_path))
    (tmp_path / hf.SINGLE_FILE).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(ConfigError, match="is not a safetensors file"):
        hf.SafetensorsFiles(str(tmp_path))


# ----------------------------------------------------------------------------- the command line


def run_script(*args):
    env = {**os.environ, "LONGCTX_CPU_DEVICES": "8", "JAX_PLATFORMS": "cpu"}
    return ScriptServer.run([sys.executable, os.path.join(REPO, "scripts", "convert_hf.py"), *args],
                            cwd=REPO, env=env, timeout=600)


@pytest.mark.slow
def test_command_line_convert_check_and_export(tmp_path):
    hf_dir = os.path.join(ASSETS, "llama3_scaling")
    printed = run_script("to-longctx", f"--hf={hf_dir}", "--print-config")
    assert printed.returncode == 0, printed.stderr
    assert "--config.model.rope_scaling.type=llama3" in printed.stdout
    assert "--config.model.d_model=64" in printed.stdout

    out = str(tmp_path / "converted")
    done = run_script("to-longctx", f"--hf={hf_dir}", f"--out={out}")
    assert done.returncode == 0, done.stderr
    assert f"--config.checkpoint.init_from={out}" in done.stdout
    assert os.path.isfile(os.path.join(out, "config_overrides.txt"))

    inputs, golden, _ = golden_rows()
    ids = str(tmp_path / "ids.npz")
    np.savez(ids, **inputs, logits=golden["llama3_scaling"], positions_index=golden["positions_index"])
    checked = run_script("check-logits", f"--checkpoint={out}", f"--tokens={ids}", "--mesh=1,2,4", "--impl=xla")
    assert checked.returncode == 0, checked.stderr + checked.stdout
    assert "max |logit difference| =" in checked.stdout and ": OK" in checked.stdout

    np.savez(ids, **inputs, logits=golden["llama3_scaling"] + 1e-3, positions_index=golden["positions_index"])
    failed = run_script("check-logits", f"--checkpoint={out}", f"--tokens={ids}", "--mesh=1,2,4", "--impl=xla")
    assert failed.returncode == 1 and "FAILED" in failed.stdout

    back = str(tmp_path / "back")
    exported = run_script("to-hf", f"--checkpoint={out}", f"--out={back}")
    assert exported.returncode == 0, exported.stderr
    again = run_script("to-hf", f"--checkpoint={out}", f"--out={back}")  # refused before any work
    assert again.returncode == 2
    assert "Traceback" not in again.stderr and again.stderr.strip().splitlines()[-1] == (
        f"longctx: --out={back} is not empty; pass --overwrite to replace it (the old contents are kept "
        "until the new ones are complete).")
    assert hf.read_config(back)["torch_dtype"] == "float32"  # the source model's dtype
    for key, value in hf.iter_hf_tensors(hf_dir):
        assert dict(hf.iter_hf_tensors(back))[key].tobytes() == value.tobytes(), key

    bad = run_script("to-longctx", f"--hf={tmp_path}", f"--out={tmp_path / 'x'}")
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1].startswith("longctx: ") and "config.json does not exist" in bad.stderr
