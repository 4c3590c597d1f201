"""The training loop and its entry point `train_and_evaluate(config, workdir, *, evaluators=())`:
the start-up checks, the run's mesh, layout and run_info.json, restore-or-init, then steps with
logging, validation, the evaluators it is given (longctx.train.hooks), checkpoints, a profiler
trace, and a clean stop on SIGTERM or Ctrl-C.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
import time
from typing import Callable, Sequence

import jax
import ml_collections
import numpy as np
from tqdm import tqdm

from longctx import cli
from longctx import config as config_lib
from longctx import data as data_lib
from longctx import errors, ops
from longctx.model import attention as attention_lib
from longctx.model import flops as flops_lib
from longctx.model import layer_types as layer_types_lib
from longctx.ops import tables
from longctx.parallel import mesh as mesh_lib
from longctx.parallel import processes
from longctx.train import checkpoint as checkpoint_lib
from longctx.train import hooks
from longctx.train import lease as lease_lib
from longctx.train import source_eval
from longctx.train import workdir as workdir_lib
from longctx.train.metrics import MetricsWindow, MetricsWriter
from longctx.train.optimizer import applied_updates, optimizer_notes
from longctx.train.state import abstract_with_shardings, make_setup, resolve_layout, shard_bytes
from longctx.train.steps import abstract_batch, compile_ahead, jit_steps


class _StopRequest:
    """SIGTERM (a preemption) and a first Ctrl-C ask the loop to stop: it finishes the current step,
    saves and exits cleanly ("stopped at step N (saved)"). Each is acknowledged on stderr when it
    arrives; a second Ctrl-C abandons the run (KeyboardInterrupt: "interrupted", exit status 130).
    With several processes the decision is agreed (any process asked -> all stop at the same step),
    and the save needs every process: the acknowledgement promises it only if every process gets
    there (the launcher sends SIGTERM to the others when one dies: then `_loop` says in one line
    that nothing was saved, where the run said "it will be saved" and then failed).

    Before the first step (`starting`, from `train_and_evaluate`'s start until `training`) nothing
    has been trained, so there is nothing to save: a signal ends the run at once, with one line and
    SystemExit(128 + the signal), through every `finally` (the lease is released, what was opened
    is closed), not the silent status 143 of Python's default SIGTERM.

    Python runs a signal's handler only when the main thread is next in Python, which a compile or
    a long step can put off for minutes. So the acknowledgement also comes from a thread that reads
    the signal numbers that `signal.set_wakeup_fd` writes into a pipe the moment a signal arrives
    (whichever of the two is first says it, once); two Ctrl-Cs within one such wait reach the
    handler as one, a stop. The line is written straight to the file descriptor: a handler that
    interrupts a write to sys.stderr and writes there again fails ("reentrant call")."""

    ACKNOWLEDGED = {signal.SIGINT: "stopping at {when} ({saved}); Ctrl-C again to abandon.",
                    signal.SIGTERM: "SIGTERM: stopping at {when} ({saved})."}
    NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}

    def __init__(self, *, after_progress_bar: bool = False, starting: bool = False):
        self.requested = False
        self._interrupts = 0
        self._new_line = "\n" if after_progress_bar else ""  # (a bar's line has no end yet)
        self._acknowledge = jax.process_index() == 0  # (logs are written once, by process 0)
        # (processes agree at sync points only: see `_loop`)
        self._when, self._saved = (("the next step", "it will be saved") if jax.process_count() == 1 else
                                   ("the next log or checkpoint step", "saved if every process gets there"))
        self._phase = threading.Lock()  # (the first signal's phase and the phase change agree)
        self._starting = starting
        self._first: tuple[int, bool] | None = None  # the first signal and whether it came at start-up
        self.arrived = False  # a signal came (set at once by the watcher, unlike `requested`)
        self.failed = False  # the loop ended in an error: a signal after it promises nothing
        self._acknowledged = threading.Lock()  # taken, never released, by whoever says it
        self._previous = {sig: signal.signal(sig, self._handle) for sig in self.ACKNOWLEDGED}
        read, self._wakeup = os.pipe()
        os.set_blocking(self._wakeup, False)  # (set_wakeup_fd's condition)
        self._previous_wakeup = signal.set_wakeup_fd(self._wakeup, warn_on_full_buffer=False)
        self._watcher = threading.Thread(target=self._watch, args=(read,), name="longctx-stop-request",
                                         daemon=True)
        self._watcher.start()

    def training(self, *, after_progress_bar: bool = False) -> None:
        """The first step is next: from here a signal asks for a stop that saves. A signal that came
        during start-up (said already; its handler may not have run yet) ends the run now."""
        self._new_line = "\n" if after_progress_bar else ""
        with self._phase:
            self._starting = False
            first = self._first
        if first is not None and first[1]:
            raise SystemExit(128 + first[0])

    def _watch(self, read: int) -> None:
        try:
            while data := os.read(read, 64):  # (empty: restore() closed the pipe)
                for signum in data:
                    if signum in self.ACKNOWLEDGED:
                        self._say(signum)
        finally:
            os.close(read)

    def _say(self, signum: int) -> None:
        """Notes the first signal and the phase it came in, and says so (once, on process 0)."""
        with self._phase:
            if self._first is None:
                self._first = (signum, self._starting)
            first, at_start_up = self._first
        self.arrived = True
        if self._acknowledge and self._acknowledged.acquire(blocking=False):
            name = self.NAMES[signal.Signals(first)]
            if at_start_up:
                text = (f"{name} during start-up: stopped before the first step; nothing was trained, so "
                        "nothing is lost (the same command starts the run).")
            elif self.failed:
                text = f"{name}: the run is already ending, on an error (said when it exits)."
            else:
                text = self.ACKNOWLEDGED[signal.Signals(signum)].format(when=self._when, saved=self._saved)
            try:
                os.write(sys.stderr.fileno(), f"{self._new_line}longctx: {text}\n".encode())
            except (OSError, ValueError):  # no stderr to write to: stopping is what matters
                pass

    def _handle(self, signum, frame):
        self._say(signum)
        if self._first[1]:  # at start-up: nothing to save, so stop now
            raise SystemExit(128 + self._first[0])
        if signum == signal.SIGINT:
            self._interrupts += 1
            if self._interrupts > 1:
                raise KeyboardInterrupt
        self.requested = True

    def agreed(self, lease_lost: bool = False) -> tuple[bool, bool]:
        """(whether any process asked to stop, whether any found the lease lost): one all-gather."""
        if jax.process_count() == 1:
            return self.requested, lease_lost
        flags = processes.allgather(np.array([self.requested, lease_lost], np.int32))
        return bool(np.any(flags[..., 0])), bool(np.any(flags[..., 1]))

    def restore(self):
        signal.set_wakeup_fd(self._previous_wakeup)
        os.close(self._wakeup)  # the watcher reads the pipe's end and stops
        self._watcher.join()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def check_workdir(workdir: str, *, create: bool = True) -> None:
    """The workdir, and the directories in it that the run writes at once (the lease at start-up,
    the checkpoints at the first save), can be written: a checkpoints/ that refuses writes (an
    immutable or foreign-owned directory in a writable workdir) would otherwise be found only by the
    first save, which Orbax leaves waiting 300 s. Only the workdir is made here (none with `create=False`,
    for --validate_only): one not made yet is judged by the directory it would be made in."""
    workdir_lib.check_named(workdir)
    for name in ("", checkpoint_lib.CHECKPOINTS_DIR, lease_lib.LEASE_DIR):
        path = f"{str(workdir).rstrip('/')}/{name}" if name else workdir
        why = workdir_lib.check_writable(path, create=create and not name)
        if why is None:
            continue
        fix = ("" if workdir_lib.file_in_the_way(path) else
               f"; make it writable ({errors.WRITABLE_HOW}) or pass another --workdir")
        raise config_lib.ConfigError(f"workdir {workdir!r} is not writable: {why}{fix}.")


def check_vocab(config, data_dir: str, metadata: dict) -> None:
    if metadata["vocab_size"] > config.model.vocab_size:
        raise config_lib.ConfigError(
            f"model.vocab_size={config.model.vocab_size} is smaller than the dataset's tokenizer "
            f"vocabulary ({metadata['vocab_size']} in {data_dir}/metadata.json): "
            f"set --config.model.vocab_size={metadata['vocab_size']}.")


def _local_inputs(config, workdir: str) -> str:
    """The start-up checks that read this host's files (no collectives): the workdir is
    writable, the dataset whole and within model.vocab_size. Returns the data directory."""
    check_workdir(workdir)
    try:
        data_dir = data_lib.resolve_dataset(config)
        metadata = data_lib.load_metadata(data_dir)
    except (OSError, ValueError) as e:  # the data module's messages name the file or key
        raise config_lib.ConfigError(str(e)) from None
    check_vocab(config, data_dir, metadata)
    return data_dir


def check_inputs(config, workdir: str, sizes: dict) -> str:
    """`--validate_only`'s checks past `config_lib.validate`, none of which leaves anything written:
    the workdir and its checkpoints and lease directories can be written (`check_workdir`, the run's
    own check, with probe files that come and go and no directory made) and no live run on this
    machine holds its lease, the dataset (data.path, every source of data.sources, or
    the embedded corpus when it is prepared already) is whole and fits model.vocab_size. Returns what
    was checked, in words."""
    check_workdir(workdir, create=False)
    lease_lib.check_free(workdir)  # (not held by a live run here)
    if config.data.get("sources"):  # every source, each failure naming it (data/mixture.py)
        data_dir, data = data_lib.check_sources(config, mesh_lib.make_mesh(config.mesh))
        if data_dir is not None:
            check_vocab(config, data_dir, data_lib.load_metadata(data_dir))
    elif config.data.path:
        try:
            data_dir = data_lib.resolve_dataset(config)
            check_vocab(config, data_dir, data_lib.load_metadata(data_dir))
        except (OSError, ValueError) as e:
            raise config_lib.ConfigError(str(e)) from None
        data = f"data {data_dir}"
    else:
        data = "the embedded corpus (prepared on first use)"
    mesh = " x ".join(f"{ax}={n}" for ax, n in sizes.items())
    return f"config, mesh {mesh}, workdir {workdir} and {data} are fine"


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *,
                       evaluators: Sequence[hooks.Evaluator] = (), run_info: dict | None = None,
                       memory_advice: Callable[[ml_collections.ConfigDict, errors.OutOfMemory], str] | None = None
                       ) -> dict:
    """Trains (resuming if `workdir` holds a checkpoint) and returns the last logged metrics.

    `evaluators`: evaluations of the parameters being trained, each run every
    `config.train[evaluator.every_key]` steps (longctx.train.hooks; scripts/train.py passes the
    passkey evaluator of longctx.evals.needle when train.eval_needle_every > 0). `run_info`: more
    entries for run_info.json (scripts/train.py: what attention.cp=auto chose and why).
    `memory_advice(config, out_of_memory)`: the nearest change that fits, in words, when the
    compiler refuses the train step for lack of memory (scripts/train.py passes the planner's,
    longctx.plan.fit_remedy.out_of_memory_advice; the error says it in its one sentence)."""
    mesh_lib.maybe_initialize_distributed(config.distributed)
    stop = _StopRequest(starting=True)  # from here a signal is one line (until the loop: a stop now)
    try:
        sizes = config_lib.validate(config)
        hooks.check_evaluators(config, evaluators)
        if cli.validate_only():
            cli.validated(check_inputs(config, workdir, sizes))
        # This host's files: a failure on one process is raised on all (cli.agreed), not left to
        # hang the others in the first collective.
        data_dir = cli.agreed(lambda: _local_inputs(config, workdir))
        with lease_lib.hold(workdir) as lease:  # one run per workdir: a second one is refused here
            return _train_and_evaluate_held(config, workdir, sizes, data_dir, evaluators, run_info or {}, lease,
                                            stop, memory_advice)
    finally:
        stop.restore()


def _train_and_evaluate_held(config: ml_collections.ConfigDict, workdir: str, sizes: dict, data_dir: str,
                             evaluators: Sequence[hooks.Evaluator], run_info: dict, lease, stop,
                             memory_advice=None) -> dict:
    """`train_and_evaluate` once the inputs are checked and this run holds `workdir`."""
    checkpointer = checkpoint_lib.Checkpointer(workdir, config)  # checks the workdir's checkpoints
    writer = train_iter = None
    try:  # (from here on, also a stop during start-up closes the checkpointer)
        mesh = mesh_lib.make_mesh(config.mesh)
        # e.g. no validation documents to evaluate on (the count of data shards needs the mesh)
        data_lib.check_splits(config, data_lib.load_metadata(data_dir), data_dir, mesh)
        by_documents = (config.attention.layout == "auto" and config.attention.use_segment_ids
                        and data_lib.packer_layout(config.data.packer) is None)
        documents = data_lib.layout_sample(config, data_dir) if by_documents else None
        layout = resolve_layout(config, sizes[mesh_lib.SP], documents)
        mix = (data_lib.achieved_shares(config, sizes[mesh_lib.SP])  # (data/mixture.py)
               if config.data.get("sources") and jax.process_index() == 0 else None)
        if jax.process_index() == 0:
            chosen = (f" (auto, chosen on the documents of {len(documents)} sampled rows)" if by_documents
                      else f" (auto, the layout data.packer={config.data.packer} places documents for)"
                      if config.attention.layout == "auto" and data_lib.packer_layout(config.data.packer)
                      else " (auto, chosen by the mask)" if config.attention.layout == "auto" else "")
            print(f"longctx: {jax.process_count()} process(es), {jax.device_count()} {jax.devices()[0].platform} "
                  f"devices, mesh {dict(mesh.shape)}, layout {layout}{chosen}, attention impl {config.attention.impl}, "
                  f"~{config_lib.num_params_estimate(config) / 1e6:.1f}M params, "
                  f"{data_lib.describe_data(config, data_dir)}", flush=True)
            if mix:
                print(f"longctx: {data_lib.describe_shares(mix)}", flush=True)

        def make_train_iterator(seed_offset: int = 0):
            return data_lib.make_batch_iterator(config, mesh, split="train", layout=layout, data_dir=data_dir,
                                                seed_offset=seed_offset)

        def make_eval_iterator(source=None):  # (a mixture's sources are evaluated apart: source_eval)
            return data_lib.make_batch_iterator(config, mesh, split="validation", layout=layout, data_dir=data_dir,
                                                source=source)

        with jax.set_mesh(mesh):
            setup = make_setup(config, mesh, layout)
            state, train_iter, resumed_from = checkpointer.restore_or_init(setup, make_train_iterator)
            first_step = int(jax.device_get(state.step))
            notes = _start_up_notes(config, checkpointer, state)
            if jax.process_index() == 0:
                for line in (resumed_from, *notes):
                    print(f"longctx: {line}", flush=True)
            if first_step >= config.train.num_steps:  # a finished run started again: no compile
                if jax.process_index() == 0:
                    print(f"longctx: nothing to do: the checkpoint is at step {first_step} and "
                          f"train.num_steps={config.train.num_steps} (raise it to train further).", flush=True)
                return {}
            train_step, eval_step = jit_steps(config, setup)
            # Before anything is written: a step the compiler refuses leaves the workdir as it was.
            compile_info = _compile_ahead(config, setup, train_step, memory_advice)
            _write_run_info(config, workdir, mesh, layout, data_dir, documents,
                            {**run_info, **compile_info, **({"data_mixture": mix} if mix else {})})
            writer = MetricsWriter(workdir, resume_step=first_step)
            context = hooks.RunContext(config, setup, mesh, layout, data_dir, workdir)
            hooked = tuple((e, e.build(context)) for e in evaluators if e.every(config) > 0)
            run = _Run(config, workdir, train_step, eval_step, make_eval_iterator, checkpointer, writer,
                       lease, hooked)
            result, stopped_at = _loop(run, state, train_iter, stop)
    finally:
        # Also on an error: files are closed and the save in flight completes. A save that failed
        # is raised last, so it is the error the user sees: it names the checkpoint the next start
        # resumes from (a full disk usually fails the metrics files too).
        try:
            if writer is not None:
                writer.close()
        finally:
            try:
                checkpointer.close()
            finally:
                if train_iter is not None:  # Grain's prefetch thread / worker processes
                    train_iter.close()
    if jax.process_index() == 0 and result:
        val = (f", val loss {result['val_loss']:.4f}" if "val_loss" in result else "") + "".join(
            f", {key[4:-5]} {value:.4f}" for key, value in result.items()
            if key.startswith("val_") and key.endswith("/loss"))  # a mixture's sources (source_eval)
        speed = f", {result['tokens_per_s']:.0f} tokens/s" if "tokens_per_s" in result else ""
        ended = ("finished" if stopped_at is None else
                 f"stopped at step {stopped_at} (saved to {checkpointer.directory}/{stopped_at}; the same "
                 f"command resumes it)")
        print(f"longctx: {ended}; last logged train loss {result['loss']:.4f}{val}{speed}; "
              f"metrics in {workdir}/metrics.jsonl", flush=True)
    return result


def _start_up_notes(config, checkpointer, state) -> list[str]:
    """`optimizer_notes` for this start (on a resume, against the config the checkpoint was saved
    with), and the layer types whose window or chunk spans the whole row."""
    step, saved = int(jax.device_get(state.step)), None
    if step > 0:  # (a fresh start, init_from included, is at step 0)
        saved = checkpointer.saved_config(step)
    return (optimizer_notes(config, saved, int(jax.device_get(applied_updates(state.opt_state))))
            + layer_types_lib.whole_row_notes(config))


def _compile_ahead(config, setup, train_step, memory_advice) -> dict:
    """Compiles the train step before the first step (steps.compile_ahead) and says how long it
    took and the per-device bytes the compiler planned; returns those for run_info.json. A compile
    refused for lack of memory is an OutOfMemoryError: one sentence with the memory, the bytes and
    the nearest change that fits (`memory_advice`)."""
    start = time.perf_counter()
    try:
        compiled = compile_ahead(train_step, config, setup)
    except jax.errors.JaxRuntimeError as e:
        oom = errors.out_of_memory(str(e))
        if oom is None:
            raise
        raise _out_of_memory_error(config, setup, oom, memory_advice) from None
    seconds = time.perf_counter() - start
    stats = compiled.memory_analysis()
    planned = (None if stats is None else stats.argument_size_in_bytes + stats.output_size_in_bytes
               - stats.alias_size_in_bytes + stats.temp_size_in_bytes)
    if jax.process_index() == 0:
        bytes_note = "" if planned is None else f": {errors.byte_size(planned)} per device by the compiler"
        print(f"longctx: compiled the train step in {seconds:.1f} s{bytes_note}.", flush=True)
    return {"compile_seconds": seconds, "compiled_bytes_per_device": planned}


def _out_of_memory_error(config, setup, oom: errors.OutOfMemory, memory_advice) -> errors.OutOfMemoryError:
    """The sentence for a train step the compiler refused: which memory, the bytes (HBM: the
    whole step per device, the state and batch added where the compiler counted only its
    temporaries), and the nearest change that fits."""
    size = errors.byte_size
    if oom.memory == errors.HBM:
        arguments = (shard_bytes(abstract_with_shardings(setup.abstract_state, setup.state_shardings))
                     + shard_bytes(abstract_batch(config, setup)))
        total = oom.needed + (arguments if oom.counts == "temporaries" else 0)
        parts = (f" ({size(oom.needed)} of temporaries, over the device's memory by themselves, and "
                 f"{size(arguments)} of state and batch)" if oom.counts == "temporaries" else "")
        what = f"needs {size(total)} of HBM per device{parts} where the device has {size(oom.available)}"
        oom = errors.OutOfMemory(errors.HBM, total, oom.available, "program")
    else:
        what = (f"has a kernel that asks for {size(oom.needed)} of scoped VMEM, over its limit of "
                f"{size(oom.available)}")
    advice = (memory_advice(config, oom) if memory_advice is not None else
              "scripts/estimate.py with this config and the slice's --topology lists the changes that should fit")
    return errors.OutOfMemoryError(f"the train step does not fit: it {what} (the compiler's figure, before any "
                                   f"step ran: nothing was trained or written); {advice}.")


def _peak_memory(devices) -> dict:
    """The most device memory in use so far (`peak_bytes_in_use`, the largest over `devices`) and
    the memory there is (`bytes_limit`), where the backend reports them (TPU, GPU); {} where it
    does not (CPU)."""
    stats = [d.memory_stats() for d in devices]
    if not stats or any(not s or "peak_bytes_in_use" not in s for s in stats):
        return {}
    out = {"peak_bytes_in_use": max(int(s["peak_bytes_in_use"]) for s in stats)}
    if all("bytes_limit" in s for s in stats):
        out["bytes_limit"] = min(int(s["bytes_limit"]) for s in stats)
    return out


def _add_run_info(workdir: str, entries: dict) -> None:
    """`entries` added to run_info.json (process 0's, written at start-up)."""
    if jax.process_index() != 0:
        return
    path = workdir_lib.resolve(workdir) / "run_info.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **entries}, indent=1))


def _write_run_info(config, workdir: str, mesh, layout: str, data_dir: str, documents=None,
                    extra: dict | None = None) -> None:
    """`workdir/run_info.json`: what this run is, for reports that compare runs (scripts/ablate.py).
    The ring's schedule is the mask's (every row); `documents`: the rows "auto" was chosen on."""
    if jax.process_index() != 0:
        return
    a = config.attention
    schedule = ops.ring_schedule(config.data.seq_len, mesh.shape[mesh_lib.SP], a.block_size, layout=layout,
                                 **attention_lib.mask_kwargs(a))
    info = {
        "mesh": {k: int(v) for k, v in mesh.shape.items()},
        "process_count": jax.process_count(),
        "platform": jax.devices()[0].platform,
        "layout": layout,
        "layout_chosen_on": (None if a.layout != "auto" else "the mask" if documents is None
                             else f"the documents of {len(documents)} sampled rows"),
        "ring_steps_run": int(len(schedule.run_steps)),
        # K/V hops, which can exceed the steps with work where chunks count per document.
        "ring_steps_visited": (tables.one_document_steps_visited(
            config.data.seq_len, mesh.shape[mesh_lib.SP], a.block_size, layout, **attention_lib.mask_kwargs(a))
            if a.use_segment_ids else int(len(schedule.run_steps))),
        "ring_schedule_efficiency": float(schedule.efficiency),
        "params": config_lib.num_params_estimate(config),
        "tokens_per_step": config.data.global_batch_size * config.data.seq_len,
        "data_dir": data_dir,
        "config": config.to_dict(),
        **(extra or {}),
    }
    (workdir_lib.resolve(workdir) / "run_info.json").write_text(json.dumps(info, indent=1))


@dataclasses.dataclass(frozen=True)
class _Run:
    """The fixed parts of a run that the loop uses."""

    config: ml_collections.ConfigDict
    workdir: str
    train_step: Callable
    eval_step: Callable
    make_eval_iterator: Callable
    checkpointer: checkpoint_lib.Checkpointer
    writer: MetricsWriter
    lease: lease_lib.Lease | lease_lib._NotHeld  # (process 0's; the others' answers "held")
    # (the evaluator, its (params, step) -> metrics) for each evaluator the config turns on
    evaluators: tuple[tuple[hooks.Evaluator, Callable], ...] = ()


class _Profiler:
    """A trace of `train.profile_steps` steps from `train.profile_start`, stopped also when the
    loop leaves early."""

    def __init__(self, train_config, workdir: str):
        self.start, self.steps = train_config.profile_start, train_config.profile_steps
        self.directory = str(workdir_lib.resolve(workdir) / "profile")
        self.running = False

    def before(self, step: int) -> None:
        if self.start is not None and step == self.start:
            jax.profiler.start_trace(self.directory)
            self.running = True

    def after(self, done: int, state) -> None:
        if self.running and done == self.start + self.steps:
            jax.block_until_ready(state)
            self.stop()

    def stop(self) -> None:
        if self.running:
            self.running = False
            jax.profiler.stop_trace()


def _nonfinite_error(step: int, loss: float, grad_norm: float, checkpointer, *,
                     skipped_in_a_row: int | None = None, limit: int | None = None) -> errors.RunError:
    """The one line for a run stopped for non-finite steps: with on_nonfinite=stop, the first such
    step; with skip, the last of `skipped_in_a_row` (at least train.max_consecutive_skips=`limit`)."""
    try:
        checkpointer.wait()
    except errors.RunError:
        pass  # reported by the checkpointer when it closes; the steps on disk are what counts
    newest = checkpointer.manager.latest_step()
    saved = ("no checkpoint was written" if newest is None else
             f"the newest checkpoint, step {newest}, holds only finite steps")
    if skipped_in_a_row is None:
        streak, advice = "", "Set train.on_nonfinite=skip to skip such steps instead."
    else:
        streak = (f", the last of {skipped_in_a_row} steps in a row skipped for it "
                  f"(train.max_consecutive_skips={limit})")
        advice = ("Skipping does not get this run past them: check the data and the learning rate "
                  "(or raise train.max_consecutive_skips).")
    return errors.RunError(
        f"non-finite loss or gradient at step {step} (loss {loss}, grad norm {grad_norm}){streak}; "
        f"stopped before saving it, and {saved}. {advice}")


def _lease_lost_error(run: _Run, step: int) -> errors.RunError:
    reason = (run.lease.lost_error() if jax.process_index() == 0 else
              f"process 0 found the lease of workdir {run.workdir} taken over by another run")
    return errors.RunError(
        f"{reason}; stopped after step {step} without saving it, so as not to write over that run's "
        "checkpoints. That run goes on in this workdir: to go on with this one instead, stop that run and "
        "start this command again.")


def _loop(run: _Run, state, train_iter, stop: _StopRequest) -> tuple[dict, int | None]:
    """Steps until `train.num_steps`, a stop request or an error; returns the last logged metrics.

    The host runs ahead of the device between sync points, by at most one step: a step is
    dispatched, its loss and gradient norm join the metrics window as device scalars, and the
    loop waits only for the step before it (a bounded queue; with hundreds of steps queued on
    virtual CPU devices, XLA:CPU's all-gathers over 8 devices were seen to deadlock). At a sync
    point (a log, eval or save step, the last step, or an agreed stop) the loop waits for the
    device and, in this order: checks every step since the last check for a non-finite loss or
    gradient (with on_nonfinite=stop this raises before anything is saved, so no checkpoint ever
    holds such a state; with on_nonfinite=skip, it raises once train.max_consecutive_skips steps in
    a row were skipped), logs, evaluates, saves, stops.

    Returns (the last logged metrics, the step it stopped and saved at on request, or None)."""
    config, t, checkpointer = run.config, run.config.train, run.checkpointer
    peak = flops_lib.peak_tflops(jax.devices()[0].device_kind, t.peak_tflops_override)
    tokens_per_step = config.data.global_batch_size * config.data.seq_len
    first_step = int(jax.device_get(state.step))
    progress = None
    if jax.process_index() == 0:
        # disable=None: no bar when stderr is not a terminal (a log file would get every redraw).
        progress = tqdm(total=t.num_steps, initial=first_step, desc="train", unit="step", dynamic_ncols=True,
                        disable=None)
    stop.training(after_progress_bar=progress is not None and not progress.disable)
    profiler = _Profiler(t, run.workdir)

    def say(line: str) -> None:
        if progress is not None:
            progress.write(line)  # (above the bar, if there is one)
            sys.stdout.flush()  # a redirected stdout is block-buffered: a log shows each line now

    compile_start = time.perf_counter()
    window = MetricsWindow(first_step, compile_start)
    last: dict = {}
    stopped_at = None
    previous_loss = None  # the step before the one just dispatched
    try:
        for step in range(first_step, t.num_steps):
            profiler.before(step)
            batch, local = train_iter.next_with_local()
            state, metrics = run.train_step(state, batch)
            # (counted on the host while the device runs the step)
            pairs = flops_lib.attention_pairs(config, local["segment_ids"])
            if previous_loss is not None:
                jax.block_until_ready(previous_loss)
            previous_loss = metrics["loss"]
            done = step + 1
            window.add(done, metrics, attention_pairs=pairs)
            profiler.after(done, state)
            if progress is not None:
                progress.update(1)

            log = step == first_step or done % t.log_every == 0 or done == t.num_steps
            evaluate_now = bool(t.eval_every) and (done % t.eval_every == 0 or done == t.num_steps)
            save = checkpointer.is_save_step(done) or done == t.num_steps
            hooks_now = [(e, call) for e, call in run.evaluators if done % e.every(config) == 0]
            sync = log or evaluate_now or save or bool(hooks_now)
            # Agreeing on a stop across processes is a collective that waits for the step: only at
            # sync points (every step when there is one process, where it costs nothing). Before
            # anything is written the lease is read again: a run paused past the stale time may
            # have been taken over, and must then write nothing over the other run's files.
            stopping = lease_lost = False
            if sync or jax.process_count() == 1:
                lost_here = not run.lease.still_held() if (sync or stop.requested) else run.lease.lost
                stopping, lease_lost = stop.agreed(lost_here)
            if lease_lost:
                raise _lease_lost_error(run, done)
            if not (sync or stopping):
                continue

            bad = window.first_nonfinite()
            if bad is not None and t.on_nonfinite == "stop":
                raise _nonfinite_error(*bad, checkpointer)
            streak = window.nonfinite_streak()  # (read at sync points only: no wait per step)
            if streak is not None and streak[0] >= t.max_consecutive_skips:
                raise _nonfinite_error(*streak[1], checkpointer, skipped_in_a_row=streak[0],
                                       limit=t.max_consecutive_skips)
            if log:
                # The first step is logged on its own, untimed: it includes the first transfers and
                # allocations (the step is compiled before it, _compile_ahead).
                now = time.perf_counter()
                last = {**_step_metrics(metrics), **window.close(done, now, timed=step != first_step)}
                if step == first_step:
                    memory = _peak_memory(jax.local_devices())  # (the first step's: a sync point)
                    if memory:
                        last.update(memory)
                        _add_run_info(run.workdir, {"after_first_step": memory})
                        say(_peak_line(memory))
                if "step_time_s" in last:
                    pairs = _batch_pairs(last.pop("attention_pairs"), train_iter.shard)
                    last.update(_throughput(last["step_time_s"], tokens_per_step, config, peak, pairs))
                run.writer.write(done, last, prefix="train/")
                say(_log_line(done, last, now - compile_start))
            if evaluate_now:
                val = source_eval.evaluate_sources(config, run.eval_step, state.params, run.make_eval_iterator)
                if val:
                    run.writer.write(done, val, prefix="val/")
                    say(f"step {done}: {source_eval.describe(val)}")
                    last.update({f"val_{k}": v for k, v in val.items()})
                window.restart_clock(done, time.perf_counter())
            for evaluator, call in hooks_now:
                found = call(state.params, done)
                run.writer.write(done, found, prefix=f"{evaluator.prefix}/")
                say(f"step {done}: {evaluator.log_line(found)}")
                window.restart_clock(done, time.perf_counter())
            if (save or stopping) and (evaluate_now or hooks_now):
                # An evaluation takes minutes, in which another run may have taken the lease over:
                # read it again right before the save.
                _, lease_lost = stop.agreed(not run.lease.still_held())
                if lease_lost:
                    raise _lease_lost_error(run, done)
            if save or stopping:
                checkpointer.maybe_save(done, state, train_iter, force=True)
            if stopping:
                checkpointer.wait()
                stopped_at = done
                break
    except Exception as e:
        if stop.arrived and jax.process_count() > 1 and not isinstance(e, errors.LongctxError):
            raise _stop_not_saved_error(checkpointer, e) from e
        stop.failed = True
        raise
    finally:
        profiler.stop()
        if progress is not None:
            progress.close()
    return last, stopped_at


def _stop_not_saved_error(checkpointer, error: Exception) -> errors.RunError:
    """A stop asked for on a run of several processes that then failed in a collective (agreeing on
    the stop, a step, the save): another process is gone (the launcher sends SIGTERM to the others
    when one dies), so no save is possible. Said as such, not as an unexpected error after the
    promise of a save."""
    try:
        checkpointer.manager.reload()  # (complete steps only: a save in flight cannot end now)
        newest = checkpointer.manager.latest_step()
    except Exception:  # noqa: BLE001  (only for the message)
        newest = None
    resume = ("no checkpoint was saved, so the next start begins afresh" if newest is None else
              f"the newest checkpoint, step {newest}, is where the next start resumes")
    return errors.RunError(f"stopped without saving: another process of this run is gone or failed (a collective "
                           f"failed after the stop request: {errors.first_line(error)}); {resume}.")


def _step_metrics(metrics) -> dict:
    """The last step's own metrics (gradient norm, learning rate, loss tokens) as floats."""
    return {k: float(v) for k, v in jax.device_get(metrics).items() if k != "loss"}


def _batch_pairs(local_pairs: float, shard) -> float:
    """The global batch's attention pairs per step from each process's count of its own rows: one
    count per data shard (the processes of one sp group feed the same rows). (Exchanged as
    float32: a relative error of 1e-7 in MFU.)"""
    if jax.process_count() == 1:
        return local_pairs
    counts = processes.allgather(np.array([shard.index, local_pairs], np.float32))
    return float(sum(dict(zip(counts[:, 0].astype(int), counts[:, 1])).values()))


def _throughput(step_time: float, tokens_per_step: int, config, peak: float | None, pairs: float) -> dict:
    """Tokens/s and MFU, the attention counted over `pairs` (the batches' own: model/flops.py)."""
    model_tflops = flops_lib.flops_per_step(config, pairs) / step_time / 1e12 / jax.device_count()
    return {"tokens_per_s": tokens_per_step / step_time, "model_tflops_per_device": model_tflops,
            "mfu": model_tflops / peak if peak else "n/a", "attention_pairs": pairs,
            "attention_pairs_share": pairs / flops_lib.attention_pairs(config),
            "mfu_attention_counts": flops_lib.attention_convention(config)}


def _peak_line(peak: dict) -> str:
    limit = f" of {peak['bytes_limit'] / 2 ** 30:.2f}" if "bytes_limit" in peak else ""
    return (f"longctx: peak device memory after the first step: {peak['peak_bytes_in_use'] / 2 ** 30:.2f}"
            f"{limit} GiB (peak_bytes_in_use of the busiest device).")


def _log_line(step: int, m: dict, since_start: float) -> str:
    if "step_time_s" not in m:
        return f"step {step}: loss={m['loss']:.4f} (the first step, in {since_start:.1f}s)"
    mfu = m["mfu"] if isinstance(m["mfu"], str) else f"{m['mfu']:.3f}"
    skipped = f" nonfinite_steps={m['nonfinite_steps']}" if m["nonfinite_steps"] else ""
    share = m["attention_pairs_share"]
    shown = f", {share:.1%} of whole rows' pairs" if share < 1 else ""
    counted = f" (attention: {m['mfu_attention_counts']}{shown})"
    return (f"step {step}: loss={m['loss']:.4f} grad_norm={m['grad_norm']:.3g} lr={m['learning_rate']:.3g} "
            f"step_time={m['step_time_s']:.3f}s tokens/s={m['tokens_per_s']:.0f} mfu={mfu}{counted}{skipped}")
