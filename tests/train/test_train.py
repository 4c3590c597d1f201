"""The train step: sharded equals single-device, shardings follow the rules, one compile, overfits."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from configs import base
from longctx.parallel import mesh as mesh_lib
from longctx.train import loop as train_loop
from longctx.train import optimizer as train_optimizer
from longctx.train import state as train_state
from longctx.train import steps as train_steps
from longctx.train.metrics import MetricsWindow
from tests import synthetic


def step_config(dp=1, fsdp=1, sp=1, **attention):
    c = base.get_config("tiny")
    c.unlock()
    c.mesh.update(dp=dp, fsdp=fsdp, sp=sp)
    c.model.update(vocab_size=97, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                   mlp_dim=96, dtype="float32")
    c.data.update(seq_len=512, global_batch_size=4)
    c.attention.update(impl="xla", layout="zigzag", block_size=64, **attention)
    c.train.update(loss_chunk_size=64, num_steps=100)
    c.optimizer.update(learning_rate=1e-2, warmup_steps=0)
    return c


def run_steps(config, devices, rows_list):
    mesh = mesh_lib.make_mesh(config.mesh, devices=devices)
    sp = mesh.shape["sp"]
    layout = train_state.resolve_layout(config, sp)
    with jax.set_mesh(mesh):
        setup = train_state.make_setup(config, mesh, layout)
        state = setup.init(jax.random.PRNGKey(0))
        train_step, _ = train_steps.jit_steps(config, setup)
        losses = []
        for rows in rows_list:
            batch = {k: jax.device_put(v, setup.batch_sharding) for k, v in synthetic.to_layout(rows, layout, sp).items()}
            state, metrics = train_step(state, batch)
            losses.append(float(metrics["loss"]))
    return state, losses, train_step, setup, batch


def test_sharded_step_matches_single_device():
    rows = [synthetic.packed_rows(4, 512, 97, seed=s) for s in range(2)]
    configs = [step_config(2, 2, 2), step_config(1, 1, 1)]
    for c in configs:
        # Adam divides by sqrt(v) + eps: with the default eps a parameter whose gradient is ~0
        # gets a +-lr update decided by float rounding, whatever the sharding. A larger eps keeps
        # the update a smooth function of the gradient, so the comparison tests the step itself.
        c.optimizer.eps = 1e-3
    state8, losses8, *_ = run_steps(configs[0], jax.devices(), rows)
    state1, losses1, *_ = run_steps(configs[1], jax.devices()[:1], rows)
    np.testing.assert_allclose(losses8, losses1, rtol=1e-5)
    flat8 = jax.tree.leaves(jax.device_get(state8.params))
    flat1 = jax.tree.leaves(jax.device_get(state1.params))
    for a, b in zip(flat8, flat1):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def _lowered_text(config):
    mesh = mesh_lib.make_mesh(config.mesh, devices=jax.devices()[:1])
    with jax.set_mesh(mesh):
        setup = train_state.make_setup(config, mesh, "zigzag")
        train_step, _ = train_steps.jit_steps(config, setup)
        state = train_state.abstract_with_shardings(setup.abstract_state, setup.state_shardings)
        return train_step.lower(state, train_steps.abstract_batch(config, setup)).as_text()


def test_runs_of_another_length_or_warmup_share_one_program():
    """The learning-rate schedule's numbers are the step's argument, not constants in its
    program: a run resumed to train longer, or another test's run, finds the same program in a
    persistent compilation cache. Its peak rate is a number of the schedule too."""
    def config(**changes):
        c = step_config()
        c.train.num_steps = changes.pop("num_steps", 100)
        c.optimizer.update(**changes)
        return c

    one = _lowered_text(config())
    assert one == _lowered_text(config(num_steps=7, warmup_steps=3, learning_rate=3e-4,
                                       min_learning_rate_ratio=0.5))
    assert one != _lowered_text(config(weight_decay=0.5))  # (a constant the text shows)


def test_shardings_follow_the_rules_and_one_compile():
    rows = [synthetic.packed_rows(4, 512, 97, seed=s) for s in range(3)]
    state, _, train_step, setup, batch = run_steps(step_config(2, 2, 2), jax.devices(), rows)
    assert train_step.jitted._cache_size() == 1  # three steps, one trace and compile
    params = state.params
    # parameters: the model dimension over fsdp x sp (tests/train/test_sharding.py tests the rule itself)
    assert params["embed"][...].sharding.spec == P(None, ("fsdp", "sp"))
    assert params["blocks"]["wq"][...].sharding.spec == P(None, ("fsdp", "sp"), None, None)
    assert params["blocks"]["w_down"][...].sharding.spec == P(None, None, ("fsdp", "sp"))
    assert params["blocks"]["attn_norm"][...].sharding.spec == P(None, ("fsdp", "sp"))
    # optimizer moments are sharded like their parameters
    mu = [s for s in jax.tree.leaves(state.opt_state) if s.shape == params["embed"][...].shape]
    assert mu and all(m.sharding.spec == P(None, ("fsdp", "sp")) for m in mu)
    for value in batch.values():
        assert value.sharding.spec == P(("dp", "fsdp"), "sp")
        assert value.addressable_shards[0].data.shape == (1, 256)


def test_overfits_a_fixed_batch():
    config = step_config(1, 2, 4, sliding_window=128)
    rows = synthetic.packed_rows(4, 512, 97, seed=7, mean_doc_len=200)
    _, losses, *_ = run_steps(config, jax.devices(), [rows] * 40)
    assert losses[-1] < 0.25 * losses[0], losses


def test_nonfinite_loss_is_skipped_when_configured():
    config = step_config(1, 1, 1)
    config.train.on_nonfinite = "skip"
    config.optimizer.warmup_steps = 10  # lr 0 at update 0, 1e-3 at update 1: a skipped step shows
    rows = synthetic.packed_rows(4, 512, 97, seed=1)
    poisoned = dict(rows, targets=np.full_like(rows["targets"], 10_000))  # out of vocab -> NaN NLL
    mesh = mesh_lib.make_mesh(config.mesh, devices=jax.devices()[:1])
    schedule = train_optimizer.learning_rate_schedule(config)
    with jax.set_mesh(mesh):
        setup = train_state.make_setup(config, mesh, "contiguous")
        step, _ = train_steps.jit_steps(config, setup)
        put = lambda b: {k: jax.device_put(v, setup.batch_sharding) for k, v in b.items()}  # noqa: E731
        state = setup.init(jax.random.PRNGKey(0))
        before = jax.device_get(state.params)
        state, metrics = step(state, put(poisoned))
        assert not np.isfinite(float(metrics["loss"]))
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(state.params))):
            np.testing.assert_array_equal(a, b)  # the bad step changed nothing...
        assert int(state.step) == 1 and int(train_optimizer.applied_updates(state.opt_state)) == 0
        state, metrics = step(state, put(rows))  # ...and training goes on
        assert np.isfinite(float(metrics["loss"]))
        # The logged rate is the one this update used: the optimizer's first, not schedule(1).
        assert float(metrics["learning_rate"]) == float(schedule(0)) == 0.0
        state, metrics = step(state, put(rows))
        assert float(metrics["learning_rate"]) == float(schedule(1)) > 0.0


def test_metrics_window_means_and_names_the_first_bad_step():
    window = MetricsWindow(step=4, now=0.0)
    for step, loss in ((5, 2.0), (6, 4.0)):
        window.add(step, {"loss": np.float32(loss), "grad_norm": np.float32(1.0)})
    assert window.first_nonfinite() is None
    window.add(7, {"loss": np.float32(3.0), "grad_norm": np.float32(np.inf)})  # a gradient only
    window.add(8, {"loss": np.float32(np.nan), "grad_norm": np.float32(1.0)})
    assert window.first_nonfinite() == (7, 3.0, np.inf)
    summary = window.close(8, now=2.0, timed=True)
    assert summary == {"loss": 3.0, "loss_window_steps": 4, "nonfinite_steps": 2, "step_time_s": 0.5}
    assert window.first_nonfinite() is None  # a new window


@pytest.mark.parametrize("scan_layers, remat_policy", [(True, "none"), (True, "nothing_saveable"), (False, "dots_saveable")])
def test_compiled_step_holds_no_score_matrix(scan_layers, remat_policy):
    """Attention memory stays O(L * block) per device under every layer loop and remat policy:
    no array in the compiled train step has heads x L x L elements (a ring that JAX linearises
    instead of using its VJP would keep sp - 1 of them)."""
    import re

    config = step_config(1, 1, 8)
    config.data.update(seq_len=8192, global_batch_size=1)
    config.attention.update(block_size=256)
    config.train.update(loss_chunk_size=256)
    config.model.update(scan_layers=scan_layers, remat_policy=remat_policy)
    mesh = mesh_lib.make_mesh(config.mesh)
    with jax.set_mesh(mesh):
        setup = train_state.make_setup(config, mesh, train_state.resolve_layout(config, 8))
        step, _ = train_steps.jit_steps(config, setup)
        state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                             setup.abstract_state, setup.state_shardings)
        batch = {k: jax.ShapeDtypeStruct((1, 8192), np.int32, sharding=setup.batch_sharding)
                 for k in train_steps.BATCH_KEYS}
        hlo = step.lower(state, batch).compile().as_text()
    sizes = [int(np.prod([int(d) for d in dims.split(",")])) for dims in re.findall(r"f32\[([0-9,]+)\]", hlo)]
    shard = 8192 // 8
    assert max(sizes) < config.model.num_heads * shard * shard, max(sizes)


def test_metrics_window_counts_nonfinite_steps_in_a_row_across_windows():
    """What stops a skip run (train.max_consecutive_skips): the non-finite steps that end those
    added so far, counted over log lines (a window's close does not reset it), reset by a finite one."""
    window = MetricsWindow(step=0, now=0.0)
    add = lambda step, loss: window.add(step, {"loss": np.float32(loss), "grad_norm": np.float32(1.0)})  # noqa: E731
    add(1, np.nan)
    add(2, 2.0)
    assert window.nonfinite_streak() is None  # ended by a finite step
    add(3, np.nan)
    add(4, np.inf)
    window.close(4, now=1.0, timed=True)
    assert window.nonfinite_streak() == (2, (4, np.inf, 1.0))
    add(5, np.nan)
    assert window.nonfinite_streak()[0] == 3 and window.nonfinite_streak()[1][0] == 5
    add(6, 1.0)
    assert window.nonfinite_streak() is None


def test_first_ctrl_c_is_acknowledged_at_once_and_the_second_abandons(capfd):
    """The first SIGINT sets the stop request and says so on stderr while the loop is still inside
    its step; the second raises KeyboardInterrupt (the scripts print "interrupted", exit 130).
    SIGTERM (a preemption) only stops, however often it comes."""
    import os
    import signal
    import time

    # What SIGINT did before (Python's default_int_handler; SIG_IGN where a shell started the tests
    # in the background): restore() must put back exactly that.
    before = signal.getsignal(signal.SIGINT)
    stop = train_loop._StopRequest()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # (Python runs the handler between bytecodes of the main thread)
        assert stop.requested
        assert capfd.readouterr().err == "longctx: SIGTERM: stopping at the next step (it will be saved).\n"
    finally:
        stop.restore()
    stop = train_loop._StopRequest()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)
        assert stop.requested
        assert capfd.readouterr().err == ("longctx: stopping at the next step (it will be saved); "
                                          "Ctrl-C again to abandon.\n")
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1.0)
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGINT) is before


def test_ctrl_c_is_acknowledged_while_the_main_thread_is_busy_outside_python(monkeypatch):
    """A compile or a long step keeps the main thread out of Python, where no signal handler runs:
    the acknowledgement must not wait for it (until after the step, or the compile)."""
    import hashlib
    import os
    import signal
    import threading
    import time

    read, write = os.pipe()
    monkeypatch.setattr("sys.stderr", open(write, "w", closefd=False))
    stop, heard = None, []  # (when, what, whether the handler had run) of each write to "stderr"
    listener = threading.Thread(target=lambda: [heard.append((time.monotonic(), data, stop.requested))
                                                for data in iter(lambda: os.read(read, 4096), b"")])
    rounds = 200_000
    took = time.monotonic()
    hashlib.pbkdf2_hmac("sha256", b"x", b"y", rounds)  # C code that releases the GIL and no signal stops
    # About 6 s of it as measured now; on a loaded machine the measurement and the run can differ
    # by 2-3x, which still leaves the listener seconds to hear the line while the call runs.
    rounds = int(rounds * 6.0 / max(time.monotonic() - took, 1e-3))
    stop = train_loop._StopRequest()
    listener.start()
    try:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
        hashlib.pbkdf2_hmac("sha256", b"x", b"y", rounds)
        busy_until = time.monotonic()  # (the handler runs at the first bytecode after the call)
        assert stop.requested
    finally:
        stop.restore()
        os.close(write)
        listener.join()
        os.close(read)
    # Said once (not again by the handler), while the main thread was still busy: before the
    # handler had run (False), and read before the busy call returned.
    assert [(data, requested) for _, data, requested in heard] == [
        (b"longctx: stopping at the next step (it will be saved); Ctrl-C again to abandon.\n", False)]
    assert heard[0][0] < busy_until, (heard, busy_until)
