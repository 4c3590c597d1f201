"""A train step the compiler refuses for lack of memory stops the run before its first step with
one sentence (exit status 2): which memory, the bytes needed and available, and the nearest change
that fits; the workdir, its checkpoint included, is left as it was. The compiler's refusal is
injected (CPU compiles have no HBM): its message in the TPU compiler's words."""

import hashlib
import json
import os
import re
import types

import jax
import pytest

from configs import base
from longctx import cli, errors
from longctx.plan import fit_remedy, memory_model
from longctx.train import loop as train_loop

GIB = 2 ** 30

# The TPU compiler's three messages (libtpu's own words; the figures are the issue's v5e runs).
TEMPORARIES = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory on HBM, the total memory "
               "required for HLO temporaries ({needed}) exceeds available HBM ({available}).")
PROGRAM = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: XLA:TPU compile permanent error. Ran out of memory in "
           "memory space hbm. Used {needed} of {available} hbm. Exceeded hbm capacity by 1.00G.")
SCOPED = ("RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom: XLA:TPU compile permanent error. Ran out of "
          "memory in memory space vmem while allocating on stack for %fusion.3 = ... Scoped allocation with size "
          "{needed} and limit {available} exceeded scoped vmem limit by 2.00M.")


def test_the_compiler_s_messages_are_read():
    assert errors.out_of_memory(TEMPORARIES.format(needed="21.45G", available="15.75G")) == errors.OutOfMemory(
        errors.HBM, int(21.45 * GIB), int(15.75 * GIB), "temporaries")
    assert errors.out_of_memory(PROGRAM.format(needed="16.75G", available="15.75G")) == errors.OutOfMemory(
        errors.HBM, int(16.75 * GIB), int(15.75 * GIB), "program")
    assert errors.out_of_memory(SCOPED.format(needed="18.00M", available="16.00M")) == errors.OutOfMemory(
        errors.SCOPED_VMEM, 18 * 2 ** 20, 16 * 2 ** 20, "kernel")
    assert errors.out_of_memory("RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom: Used 16.14M of 16.00M "
                                "vmem.") == errors.OutOfMemory(errors.SCOPED_VMEM, int(16.14 * 2 ** 20),
                                                               16 * 2 ** 20, "kernel")
    assert errors.out_of_memory("INVALID_ARGUMENT: Mosaic failed to compile TPU kernel") is None


def _config(num_steps: int):
    c = base.get_config("tiny")
    c.unlock()
    c.model.update(d_model=64, mlp_dim=128, head_dim=16, remat_policy="nothing_saveable")
    c.data.update(seq_len=1024, global_batch_size=4)
    c.attention.block_size = 256
    c.train.update(num_steps=num_steps, log_every=1, eval_every=0, loss_chunk_size=128)
    c.checkpoint.update(every_steps=2)
    return c


def _files(workdir) -> dict:
    """Every file of the workdir but the lease (taken and let go by each start): contents and times."""
    out = {}
    for folder, dirs, names in os.walk(workdir):
        dirs[:] = [d for d in dirs if d != ".lease"]
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, workdir)] = (hashlib.sha256(f.read()).hexdigest(), os.stat(path).st_mtime_ns)
    return out


def _refuse_compiles(monkeypatch, message: str):
    def compile(self, *args, **kwargs):
        raise jax.errors.JaxRuntimeError(message)

    monkeypatch.setattr(jax.stages.Lowered, "compile", compile)


def test_the_step_compiled_ahead_is_the_one_the_loop_runs(tmp_path, monkeypatch, capsys):
    """One compile: the executable compiled before the first step is the one every step calls (jit's
    cache holds it), and the start-up says how long it took and what it holds per device."""
    jitted = []
    real = train_loop.jit_steps

    def jit_steps(config, setup):
        train_step, eval_step = real(config, setup)
        jitted.append(train_step)
        return train_step, eval_step

    monkeypatch.setattr(train_loop, "jit_steps", jit_steps)
    workdir = str(tmp_path / "run")
    train_loop.train_and_evaluate(_config(3), workdir)
    assert jitted[0].jitted._cache_size() == 1
    out = capsys.readouterr().out
    assert re.search(r"^longctx: compiled the train step in \d+\.\d s: \d+\.\d\d MiB per device by the compiler\.$",
                     out, re.M), out
    with open(os.path.join(workdir, "run_info.json")) as f:
        info = json.load(f)
    assert info["compiled_bytes_per_device"] > 0 and info["compile_seconds"] > 0
    assert "after_first_step" not in info  # (CPU devices report no memory statistics)


def _advice(config, oom):
    return fit_remedy.out_of_memory_advice(config, oom, jax.devices())


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> str:
    """A workdir with a checkpoint at step 2 (and its metrics and run_info)."""
    workdir = str(tmp_path_factory.mktemp("oom") / "run")
    train_loop.train_and_evaluate(_config(2), workdir)
    assert os.path.isdir(os.path.join(workdir, "checkpoints", "2"))
    return workdir


def test_out_of_hbm_at_compile_is_one_sentence_and_leaves_the_workdir_as_it_was(trained, monkeypatch, capsys):
    """The resumed run (steps 3 and 4) is refused over the device's memory: the sentence names
    the bytes (the compiler's temporaries and the state and batch the loop adds), says nothing was
    written, and gives the nearest change that fits by the memory model fitted to that figure."""
    config = _config(4)
    # (the memory model puts this step at ~6 MiB per device)
    assert 5 * 2 ** 20 < memory_model.per_device_bytes(config, {"dp": 1, "fsdp": 2, "sp": 4}).total_bytes < 7 * 2 ** 20
    _refuse_compiles(monkeypatch, TEMPORARIES.format(needed="7.50M", available="6.00M"))
    before = _files(trained)
    with pytest.raises(errors.OutOfMemoryError) as raised:
        train_loop.train_and_evaluate(config, trained, memory_advice=_advice)
    message, status = cli.describe(raised.value)
    assert status == cli.EXIT_BAD_INPUT == 2
    assert "\n" not in message
    assert message.startswith("the train step does not fit: it needs ")
    assert " of HBM per device (7.50 MiB of temporaries, over the device's memory by themselves, and " in message
    # The tiny model's q/k/v are a small share of what it keeps: the first change that fits is two
    # micro-batches (recompute_qkv and the policies keep too much; no MLP chunk of 512+ tokens).
    assert (" of state and batch) where the device has 6.00 MiB (the compiler's figure, before any step ran: nothing was trained or written); the nearest change "
            "that fits: --config.train.grad_accum_steps=2 (~") in message, message
    assert message.endswith(" per device by the memory model fitted to this compile).")
    assert _files(trained) == before
    assert "step 3" not in capsys.readouterr().out


def test_out_of_scoped_vmem_names_a_smaller_block(trained, monkeypatch):
    _refuse_compiles(monkeypatch, SCOPED.format(needed="18.00M", available="16.00M"))
    before = _files(trained)
    with pytest.raises(errors.OutOfMemoryError) as raised:
        train_loop.train_and_evaluate(_config(4), trained, memory_advice=_advice)
    assert str(raised.value) == (
        "the train step does not fit: it has a kernel that asks for 18.00 MiB of scoped VMEM, over its limit of "
        "16.00 MiB (the compiler's figure, before any step ran: nothing was trained or written); the nearest "
        "change that should fit: --config.attention.block_size=128 (a kernel's scoped VMEM grows with its "
        "block; the blocks the planner tries on this device are (512,)).")
    assert _files(trained) == before


def test_without_advice_the_sentence_points_to_estimate(trained, monkeypatch):
    _refuse_compiles(monkeypatch, PROGRAM.format(needed="16.75G", available="15.75G"))
    with pytest.raises(errors.OutOfMemoryError) as raised:
        train_loop.train_and_evaluate(_config(4), trained)
    assert str(raised.value) == (
        "the train step does not fit: it needs 16.75 GiB of HBM per device where the device has 15.75 GiB (the "
        "compiler's figure, before any step ran: nothing was trained or written); scripts/estimate.py with this "
        "config and the slice's --topology lists the changes that should fit.")


V5E_CHIP = types.SimpleNamespace(device_kind="TPU v5 lite", coords=(0, 0, 0), platform="tpu")


def _v5e_0p5b(block_size=None, **data):
    c = base.get_config("v5e_0p5b")
    c.unlock()
    c.data.update(**data)
    if block_size is not None:
        c.attention.block_size = block_size
    c.lock()
    return c


def test_on_one_v5e_chip_the_issue_s_refused_run_gets_the_planner_s_nearest_fit():
    """8 layers at 65,536 tokens on one v5e chip: the compiler's 21.45 GiB of temporaries and the
    6.1 GiB of state and batch. No single change of a policy, chunk or micro-batches fits (the
    model, fitted to that figure, puts the nearest at ~22 GiB); two chips do, or 32,768 tokens
    (which ran on the chip)."""
    config = _v5e_0p5b(seq_len=65_536)
    state_and_batch = 511_739_904 * 12 + 5 * 65_536 * 4  # float32 parameters and AdamW moments; the batch
    oom = errors.OutOfMemory(errors.HBM, int(21.45 * GIB) + state_and_batch, int(15.75 * GIB), "program")
    assert fit_remedy.out_of_memory_advice(config, oom, [V5E_CHIP]) == (
        "no change of a policy, chunk or micro-batches fits (by the memory model fitted to this compile); "
        "--topology=v5e:1x2 (2 chips; scripts/plan.py says how to run it) is the smallest slice that fits it "
        "and --config.data.seq_len=32768 fits these chips")
    # the issue's kernel at blocks of 1,024 over the default 16 MiB of scoped VMEM: halve the block
    advice = fit_remedy.out_of_memory_advice(_v5e_0p5b(block_size=1024), errors.OutOfMemory(
        errors.SCOPED_VMEM, int(16.14 * 2 ** 20), 16 * 2 ** 20, "kernel"), [V5E_CHIP])
    assert advice.startswith("the nearest change that should fit: --config.attention.block_size=512 ")
    assert advice.endswith("the blocks the planner tries on this device are (512, 1024, 2048))")


def test_four_sequences_that_do_not_fit_are_accumulated():
    """4 x 16,384 tokens a step, which the compiler (estimate.py for v5e:1x1) puts at 26.19 GiB
    per device: the memory model, fitted to that figure, finds four micro-batches of one sequence
    under the chip, at about what the chip held for that run (13.41 GiB: docs/tpu.md)."""
    oom = errors.OutOfMemory(errors.HBM, int(26.19 * GIB), int(15.75 * GIB), "program")
    advice = fit_remedy.out_of_memory_advice(_v5e_0p5b(global_batch_size=4, seq_len=16384), oom,
                                             [V5E_CHIP])
    assert advice.startswith("the nearest change that fits: --config.train.grad_accum_steps=4 (~"), advice
    assert advice.endswith(" GiB per device by the memory model fitted to this compile)")
    assert abs(float(advice.split("(~")[1].split(" GiB")[0]) / 13.41 - 1) <= 0.10


def test_four_sequences_of_32k_fit_no_micro_batches_on_one_chip():
    """At 4 x 32,768 tokens (38.62 GiB by the compiler) even four micro-batches are over the
    chip, as the chip's compiler found (16.55 GiB of temporaries): more chips, or fewer tokens."""
    oom = errors.OutOfMemory(errors.HBM, int(38.62 * GIB), int(15.75 * GIB), "program")
    advice = fit_remedy.out_of_memory_advice(_v5e_0p5b(global_batch_size=4), oom, [V5E_CHIP])
    assert advice.startswith("no change of a policy, chunk or micro-batches fits"), advice
    assert "--topology=v5e:1x2 (2 chips" in advice


class _Device:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_peak_memory_is_the_busiest_device_s_where_the_backend_reports_it():
    tpu = [_Device({"peak_bytes_in_use": 7 * GIB, "bytes_limit": int(15.75 * GIB), "bytes_in_use": GIB,
                    "peak_bytes_reserved": 3 * GIB}),
           _Device({"peak_bytes_in_use": 9 * GIB, "bytes_limit": int(15.75 * GIB), "peak_bytes_reserved": 2 * GIB})]
    assert train_loop._peak_memory(tpu) == {"peak_bytes_in_use": 9 * GIB, "peak_bytes_reserved": 3 * GIB,
                                            "bytes_limit": int(15.75 * GIB)}
    gpu = [_Device({"peak_bytes_in_use": 7 * GIB, "bytes_limit": int(15.75 * GIB)})]
    assert train_loop._peak_memory(gpu) == {"peak_bytes_in_use": 7 * GIB, "bytes_limit": int(15.75 * GIB)}
    assert train_loop._peak_memory([_Device(None)]) == {}  # CPU
    assert train_loop._peak_memory(jax.local_devices()) == {}


def test_the_first_step_s_peak_memory_is_said_and_recorded(tmp_path, monkeypatch, capsys):
    """Where the devices report memory (a TPU's peak_bytes_in_use), the first step's peak is one
    line, a field of the first metrics row and an entry of run_info.json."""
    peak = {"peak_bytes_in_use": int(5.75 * GIB), "peak_bytes_reserved": 10 * GIB, "bytes_limit": int(15.75 * GIB)}
    monkeypatch.setattr(train_loop, "_peak_memory", lambda devices: dict(peak))
    workdir = str(tmp_path / "run")
    train_loop.train_and_evaluate(_config(2), workdir)
    assert ("longctx: peak device memory after the first step: 5.75 GiB in arrays (peak_bytes_in_use) and "
            "10.00 GiB reserved for programs (peak_bytes_reserved) of 15.75 GiB, on the busiest device."
            ) in capsys.readouterr().out
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert rows[0]["train/peak_bytes_in_use"] == peak["peak_bytes_in_use"]
    assert "train/peak_bytes_in_use" not in rows[1]
    with open(os.path.join(workdir, "run_info.json")) as f:
        assert json.load(f)["after_first_step"] == peak
