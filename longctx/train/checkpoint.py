"""Orbax checkpointing: train state + data iterator + config, saved asynchronously, resumed exactly.

Layout of `workdir/checkpoints/<step>/`:
  state/     the TrainState (params, optimizer state, step, rng), sharded arrays (Orbax StandardSave)
  data/      the Grain iterator state, one JSON file per process (grain's Orbax handler)
  config/    the run's config as JSON
  metadata/  mesh shape, process count, longctx / jax versions

Resume order (`restore_or_init`): (1) the newest complete checkpoint in `workdir`; (2) else
`checkpoint.init_from` (parameters only: a workdir, its checkpoints/ directory, or one step
directory); (3) else a fresh start. The returned sentence says which one happened. init_from's
model must have this run's shapes and compute the same function (config.INIT_FROM_KEYS:
RoPE, norm_eps, the mask): context extension's changes (RoPE scaling added, data.seq_len) are
listed in that sentence, any other is refused unless checkpoint.init_from_allow names it. A Hugging
Face source's config.json (HF_CONFIG_FILE beside init_from's checkpoints/) is copied into the
workdir, for the export.

Crash safety. Orbax writes each step into `<step>.orbax-checkpoint-tmp` and renames it when
complete, so a run killed mid-save leaves only complete steps visible (the leftover tmp directory is
replaced when that step is saved again). A complete-looking step that cannot be read is reported,
moved aside to `workdir/checkpoints_unreadable/<step>-<time>/` (never deleted) and the next older
one is used.

Incompatible, not corrupt. A checkpoint that reads fine but does not fit this run is an error,
raised before anything is written or moved: a different model shape (the config keys that fix
parameter shapes, listed with both values), another block (checkpoint_compat.BLOCK_KEYS: Gemma's
(1 + w) norms, GeGLU, ...) or a different train-state structure (e.g. another
optimizer chain; the differing arrays are listed). Other model keys that changed (rope_theta,
dtype, remat, ...) are only reported, and so is another attention (a mask key, the pattern, a layer
type's mask or RoPE), with the flags that keep the checkpoint's. When the data iterator state
cannot carry over (the process count, the data stream's config, the process -> data shard map or
the dataset changed; metadata/ records the last two), the state is restored, the data stream
restarts from a fresh shuffle seeded with the step, and the sentence says why.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import sys
import time
from typing import Any

import grain
import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

import longctx
from longctx import cli
from longctx import config as config_lib
from longctx import errors
from longctx.parallel import processes
from longctx.train import checkpoint_compat as compat
from longctx.train import workdir as workdir_lib
from longctx.train.state import abstract_with_shardings

_STATE, _DATA, _CONFIG, _METADATA = "state", "data", "config", "metadata"
CHECKPOINTS_DIR = "checkpoints"  # in the workdir: one directory per saved step
# A Hugging Face source model's config.json, kept beside checkpoints/ (scripts/convert_hf.py
# to-longctx writes it; a run started from it with init_from copies it into its workdir).
HF_CONFIG_FILE = "hf_config.json"


def _handlers() -> dict:
    return {_STATE: ocp.StandardCheckpointHandler(), _DATA: grain.checkpoint.CheckpointHandler(),
            _CONFIG: ocp.JsonCheckpointHandler(), _METADATA: ocp.JsonCheckpointHandler()}

def _all_processes_agree(ok: bool) -> bool:
    """True when `ok` holds on every process (a step one process cannot read is unusable for all)."""
    if jax.process_count() == 1:
        return ok
    return bool(np.all(processes.allgather(np.array([ok], np.int32))))


def _say(message: str) -> None:
    if jax.process_index() == 0:
        print(f"longctx: {message}", flush=True)


class _OrbaxFailureLogs(logging.Filter):
    """Drops the error records (each with a traceback, dozens per failed save) that Orbax's
    background save threads and their asyncio loops log: the same failure is raised where the
    Checkpointer waits and reported there as one line. With LONGCTX_DEBUG=1 (`--verbose`) they
    are kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        background = any(f"{os.sep}{package}{os.sep}" in record.pathname for package in ("orbax", "asyncio"))
        return not (background and record.levelno >= logging.ERROR and not cli.debug_enabled())


_ORBAX_FAILURE_LOGS = _OrbaxFailureLogs()


def _is_abandoned_write_callback(unraisable) -> bool:
    """TensorStore's completion callback of a write that Orbax abandoned when its save failed: the
    write finishes on a TensorStore thread and hands its result to the save's asyncio loop, which
    Orbax has already closed. Python reports it through sys.unraisablehook with no object."""
    return (unraisable.object is None and isinstance(unraisable.exc_value, RuntimeError)
            and str(unraisable.exc_value) == "Event loop is closed")


def _is_abandoned_read(unraisable) -> bool:
    """One of Orbax's reads still pending when its restore failed on another array (a corrupt
    checkpoint, which restore_or_init reports and sets aside): when the coroutine is collected,
    the GeneratorExit that closes it is caught by Orbax's `except BaseException` and raised again
    as an Exception, which Python reports through sys.unraisablehook with the coroutine as object."""
    coroutine = unraisable.object
    return (inspect.iscoroutine(coroutine)
            and f"{os.sep}orbax{os.sep}" in coroutine.cr_code.co_filename
            and isinstance(getattr(unraisable.exc_value, "__cause__", None), GeneratorExit))


def _drop_reports_of_abandoned_io() -> None:
    """Installs (once per process) a sys.unraisablehook that drops the errors of abandoned writes
    and reads (above) and passes every other one on. A save that fails with writes in flight gave
    dozens of tracebacks, before or after the one line that reports the failure, depending on
    timing; a resume past a corrupt checkpoint, about one run in ten here, fifteen tracebacks of
    sixty lines each after its one-line warning. With LONGCTX_DEBUG=1 (`--verbose`) they are
    kept."""
    previous = sys.unraisablehook
    if getattr(previous, "drops_reports_of_abandoned_io", False):
        return

    def hook(unraisable) -> None:
        abandoned = _is_abandoned_write_callback(unraisable) or _is_abandoned_read(unraisable)
        if abandoned and not cli.debug_enabled():
            return
        previous(unraisable)

    hook.drops_reports_of_abandoned_io = True
    sys.unraisablehook = hook


def unfinished_saves(directory) -> list[int]:
    """The steps whose save Orbax began under `directory` and never committed: their
    `<step>.orbax-checkpoint-tmp-<time>` directories, left by a run killed while writing."""
    if not directory.exists():
        return []
    steps = (name.split(".", 1)[0] for name in (p.name for p in directory.iterdir())
             if ".orbax-checkpoint-tmp" in name)
    return sorted({int(step) for step in steps if step.isdigit()})


def unfinished_note(steps: list[int]) -> str:
    """What the start's sentence adds for the `steps` a stopped run began to save and never
    finished: why none of them is the one resumed from ("" for none)."""
    if not steps:
        return ""
    if len(steps) == 1:
        return (f"; the save of step {steps[0]} was never finished (the run stopped while writing it), so "
                "it is not a checkpoint")
    return (f"; the saves of steps {', '.join(str(s) for s in steps)} were never finished (a run stopped "
            "while writing them), so they are not checkpoints")


class Checkpointer:
    """One run's checkpoints. Constructed before anything compiles so that a bad checkpoint
    directory or a model-shape mismatch fails fast."""

    def __init__(self, workdir: str, config: ml_collections.ConfigDict):
        self.config = config
        self.workdir = workdir_lib.resolve(workdir)
        self.directory = self.workdir / CHECKPOINTS_DIR
        self._unfinished = unfinished_saves(self.directory)  # (before the manager may tidy them)
        c = config.checkpoint
        options = ocp.CheckpointManagerOptions(
            max_to_keep=c.max_to_keep,
            keep_period=c.keep_period,
            enable_async_checkpointing=c.async_save,
            create=True,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=_handlers())
        for logger in ("absl", "asyncio"):  # (added once each: a logger's filters are a set)
            logging.getLogger(logger).addFilter(_ORBAX_FAILURE_LOGS)
        _drop_reports_of_abandoned_io()
        self._saving: int | None = None  # the step of the save in flight
        self._init_from_changes: list[str] = []  # what this run changes from init_from's model
        self._failed: errors.RunError | None = None
        self._check_model_shape()

    # ------------------------------------------------------------------ checks

    @staticmethod
    def _saved_config(manager: ocp.CheckpointManager, step: int) -> dict:
        restored = manager.restore(step, args=ocp.args.Composite(**{_CONFIG: ocp.args.JsonRestore()}))
        return restored[_CONFIG]

    def saved_config(self, step: int) -> dict:
        """The config `step` was saved with, as a dict (the run's config when it was saved)."""
        return self._saved_config(self.manager, step)

    def _check_model_shape(self) -> None:
        """A config whose model shape differs from the newest checkpoint's (or from init_from's,
        when there is none) fails here, before anything is written or compiled."""
        step = self.manager.latest_step()
        if step is None:
            if self.config.checkpoint.init_from:
                self._check_init_from()
            return
        try:
            saved = self._saved_config(self.manager, step)
        except Exception:  # noqa: BLE001  (unreadable: the restore path reports and skips this step)
            return
        error = compat.model_shape_error(self.config, f"{self.directory} (step {step})", saved)
        if error:
            raise error
        changed = compat.section_differences(saved, self.config.to_dict(), "model", skip=compat.SHAPE_KEYS)
        if changed:
            _say("resuming with changed model settings (parameter shapes are the same): " + "; ".join(changed))
        attention = compat.attention_notice(saved, self.config.to_dict())
        if attention:
            _say(attention)

    def _check_init_from(self) -> None:
        """init_from's model must be this run's: the same shapes, and the same function (RoPE,
        norm, mask: config.INIT_FROM_KEYS) except what context extension changes on purpose or
        checkpoint.init_from_allow names; those are kept for the start-up line."""
        directory, step = _resolve_init_from(self.config.checkpoint.init_from)
        where = f"checkpoint.init_from={self.config.checkpoint.init_from!r} (step {step})"
        with _read_only_manager(directory) as manager:
            saved = _read_or_explain(where, self._saved_config, manager, step)
        error = compat.model_shape_error(self.config, where, saved, init_from=True)
        if error:
            raise error
        allowed = config_lib.init_from_allowed(self.config)
        listed, refused = compat.init_from_differences(saved, self.config.to_dict(), allowed)
        if refused:
            keys = ",".join(text.split(":")[0] for text in refused)
            raise config_lib.ConfigError(
                f"the model in {where} computes another function than this config's: {'; '.join(refused)}; "
                f"set them as the checkpoint has, or pass --config.checkpoint.init_from_allow={keys} "
                "if the change is meant.")
        self._init_from_changes = listed

    # ------------------------------------------------------------------ restore

    def restore_or_init(self, setup, make_data_iterator) -> tuple[Any, Any, str]:
        """Returns (state, data iterator, a sentence saying where they came from).

        `make_data_iterator(seed_offset=0)` builds a fresh training iterator. Raises ConfigError,
        with nothing moved or written, when a readable checkpoint does not fit this run.
        """
        target = abstract_with_shardings(setup.abstract_state, setup.state_shardings)
        for step in sorted(self.manager.all_steps(), reverse=True):
            info, error = None, None
            try:
                info = self._read_step_info(step)
            except Exception as e:  # noqa: BLE001  (any failure here means: this step is unreadable)
                error = e
            if not _all_processes_agree(error is None):
                self._set_aside(step, error)
                continue
            # ConfigError: not corrupt, just not this run's.
            compat.check_fits(self.config, f"{self.directory} (step {step})", info["config"],
                              info["arrays"], target)
            # A data error (a corrupt shard, a bad data config) is about the data, not this
            # checkpoint: it propagates, and the checkpoint stays where it is.
            # (a stream restarted at some step goes on being that stream: its shuffle's seed offset)
            data_iterator = make_data_iterator(seed_offset=compat.saved_seed_offset(info["metadata"]))
            result, error = None, None
            data_mismatch = self._data_state_mismatch(info, data_iterator)
            try:
                result = self._restore_step(step, info, target, data_iterator, make_data_iterator,
                                            data_mismatch)
            except errors.LongctxError:
                data_iterator.close()
                raise
            except Exception as e:  # noqa: BLE001
                error = e
            if not _all_processes_agree(error is None):
                data_iterator.close()
                self._set_aside(step, error)
                continue
            state, data_iterator, data_note = result
            where = f"resumed from {self.directory}/{step} (step {step})"
            return state, data_iterator, f"{where}{data_note}{unfinished_note(self._unfinished)}"

        state = setup.init(jax.random.PRNGKey(self.config.seed))
        init_from = self.config.checkpoint.init_from
        if init_from:
            params, where = self._params_from(init_from, target)
            carried = _carry_hf_config(init_from, self.workdir)
            changed = (f"; changed from its model: {'; '.join(self._init_from_changes)}"
                       if self._init_from_changes else "")
            return state.replace(params=params), make_data_iterator(), (
                f"fresh start with parameters from {where} and a fresh optimizer state{changed}{carried}")
        return state, make_data_iterator(), f"fresh start{unfinished_note(self._unfinished)}"

    def _read_step_info(self, step: int) -> dict:
        """The small parts of a step (config, metadata, the state's array shapes): read first, so
        that a mismatch is reported as such and not mistaken for corruption."""
        restored = self.manager.restore(step, args=ocp.args.Composite(**{
            _CONFIG: ocp.args.JsonRestore(), _METADATA: ocp.args.JsonRestore()}))
        arrays = compat.flat_arrays(self.manager.item_metadata(step)[_STATE])
        if not arrays:
            raise ValueError(f"no array metadata under {self.directory}/{step}/{_STATE}")
        return {"config": restored[_CONFIG], "metadata": restored[_METADATA], "arrays": arrays}

    def _data_state_mismatch(self, info: dict, data_iterator) -> str | None:
        """Why the step's data iterator state cannot continue this run's stream, or None; the same
        answer on every process (one process restoring its state while another restarts would
        mix two streams in one batch, so a mismatch that one process sees restarts all)."""
        why = compat.data_state_mismatch(info["config"], info["metadata"], self.config.to_dict(),
                                         data_iterator.stream_record(), jax.process_count())
        if not _all_processes_agree(why is None):
            why = why or "does not fit the data another process sees"
        return why

    def _restore_step(self, step: int, info: dict, target, data_iterator, make_data_iterator,
                      data_mismatch: str | None):
        restored = self.manager.restore(step, args=ocp.args.Composite(**{_STATE: ocp.args.StandardRestore(target)}))
        state = restored[_STATE]
        saved_config, current = info["config"], self.config.to_dict()
        if data_mismatch is not None:
            # Each process's iterator state describes its own share of one particular stream; with
            # another process count, stream, shard map or dataset that share no longer exists.
            # Start the stream afresh, reshuffled by the step so that the resumed run does not
            # repeat its first batches.
            data_iterator.close()
            return state, make_data_iterator(seed_offset=step), (
                f"; the data iterator state {data_mismatch}, so data restarts from a fresh shuffle seeded with step {step}")
        try:
            self.manager.restore(step, args=ocp.args.Composite(**{
                _DATA: grain.checkpoint.CheckpointRestore(data_iterator.grain_iterator)}))
        except Exception as e:  # noqa: BLE001
            other = compat.section_differences(saved_config, current, "data", skip=("data.cache_dir",))
            if not other:
                raise  # same data config: the saved state itself is bad
            data_iterator.close()
            return state, make_data_iterator(seed_offset=step), (
                f"; the data iterator state could not be restored with this data config "
                f"({'; '.join(other)}: {errors.first_line(e)}), so data restarts from a fresh shuffle "
                f"seeded with step {step}")
        notice = compat.mixture_notice(info["metadata"], data_iterator.stream_record())
        return state, data_iterator, ", data iterator included" + (f"; {notice}" if notice else "")

    def _set_aside(self, step: int, error: BaseException | None) -> None:
        """Moves an unreadable step out of Orbax's sight (never deletes it) and says so."""
        source = self.directory / str(step)
        aside = self.workdir / "checkpoints_unreadable" / f"{step}-{int(time.time())}"
        why = errors.first_line(error) if error is not None else "another process could not read it"
        if jax.process_index() == 0:
            print(f"longctx: WARNING: checkpoint {source} could not be restored ({why}); moving it to "
                  f"{aside} and trying the previous one.", flush=True)
            workdir_lib.move(source, aside)
        processes.allgather(np.int32(step))  # a barrier: the others reload after the move
        self.manager.reload()

    def _params_from(self, init_from: str, target):
        """Only the parameters of another run's checkpoint (partial restore: its optimizer state
        is never read, and may have another structure)."""
        directory, step = _resolve_init_from(init_from)
        where = f"checkpoint.init_from={init_from!r} (step {step})"
        with _read_only_manager(directory) as manager:
            error = compat.model_shape_error(self.config, where, _read_or_explain(where, self._saved_config, manager, step),
                                             init_from=True)
            if error:
                raise error
            saved = _read_or_explain(where, lambda: compat.flat_arrays(manager.item_metadata(step)[_STATE]))
        saved = {k: v for k, v in saved.items() if k.startswith("params/")}
        diffs = compat.structure_differences(saved, compat.flat_arrays({"params": target.params}))
        if diffs:
            raise config_lib.ConfigError(f"the parameters in {where} do not fit this model: " + "; ".join(diffs) + ".")
        item = {"params": target.params}

        def restore():
            with ocp.PyTreeCheckpointer() as checkpointer:
                return checkpointer.restore(
                    directory / str(step) / _STATE,
                    args=ocp.args.PyTreeRestore(item=item, partial_restore=True,
                                                restore_args=ocp.checkpoint_utils.construct_restore_args(item)))

        return _read_or_explain(where, restore)["params"], f"{directory}/{step}"

    # ------------------------------------------------------------------ save

    def is_save_step(self, step: int) -> bool:
        every = self.config.checkpoint.every_steps
        return bool(every and step % every == 0)

    def maybe_save(self, step: int, state, data_iterator, *, force: bool = False) -> bool:
        """Starts an (async) save when `step` is a save step or `force`; returns whether it did.
        The caller is blocked only while the arrays are copied to host memory and the iterator
        state (a small JSON) is written; the rest happens in Orbax's background thread.

        A save that fails (disk full, bucket gone), here or later in the background, raises
        RunError naming the step and the newest complete one, which is where the next start
        resumes; nothing already saved is touched."""
        if not force and not self.is_save_step(step):
            return False
        with self._reporting_failed_save():
            if step in self.manager.all_steps():
                return False
            metadata = {
                "step": step,
                "mesh": {k: int(v) for k, v in state_mesh_shape(state).items()},
                "process_count": jax.process_count(),
                "device_count": jax.device_count(),
                "longctx_version": longctx.__version__,
                "jax_version": jax.__version__,
                "saved_at_unix": time.time(),
                # what the iterator state means beyond the config: every process's data shard and
                # the dataset's fingerprint (checked by compat.data_state_mismatch on resume)
                compat.DATA_STREAM: data_iterator.stream_record(),
            }
            self.manager.wait_until_finished()  # (as Orbax's save would) a failure there names its own step
            self._saving = step
            self._check_writable()
            return self.manager.save(step, args=ocp.args.Composite(**{
                _STATE: ocp.args.StandardSave(state),
                _DATA: grain.checkpoint.CheckpointSave(data_iterator.grain_iterator),
                _CONFIG: ocp.args.JsonSave(self.config.to_dict()),
                _METADATA: ocp.args.JsonSave(metadata),
            }), force=True)

    def _check_writable(self) -> None:
        """Raises the OSError of a probe file in the checkpoints directory, on every process when one
        fails. Orbax makes the step's directory in a background thread, and a directory that refuses
        writes (EPERM, EACCES, EROFS) left the save waiting for it until a barrier's timeout, 300 s
        later ("TimeoutError ... step_directory_creation"); the probe reports it at once."""
        mine = 0
        try:
            probe = self.directory / workdir_lib.probe_name()
            probe.write_text("ok")
            probe.unlink()
        except Exception as e:  # noqa: BLE001  (OSError locally; assorted errors from buckets)
            mine, error = errors.os_errno(e) or -1, e
        codes = processes.allgather(np.array([mine], np.int32)).reshape(-1) if jax.process_count() > 1 else [mine]
        if mine:
            raise error
        failed = [(i, int(code)) for i, code in enumerate(codes) if code]
        if failed:
            process, code = failed[0]
            raise OSError(code if code > 0 else None, f"process {process} cannot write there")

    def wait(self) -> None:
        """Blocks until the save in flight is complete (RunError if it failed)."""
        with self._reporting_failed_save():
            self.manager.wait_until_finished()
            self._saving = None

    def close(self) -> None:
        """Finishes the save in flight and releases Orbax's threads. A save that fails here is
        raised; one already raised is not raised again (the first error is the one the user
        sees)."""
        already_raised = self._failed is not None
        try:
            self.wait()
        except errors.RunError:
            if not already_raised:
                raise
        finally:
            self.manager.close()

    @contextlib.contextmanager
    def _reporting_failed_save(self):
        if self._failed is not None:  # Orbax may raise the same background error again
            raise self._failed
        try:
            yield
        except Exception as e:  # noqa: BLE001  (OSError locally; assorted errors from buckets)
            step = self._saving
            try:
                self.manager.reload()
                newest = self.manager.latest_step()
            except Exception:  # noqa: BLE001
                newest = None
            resume = ("no complete checkpoint, so the next start begins afresh" if newest is None else
                      f"the newest complete checkpoint is step {newest}, where the next start resumes")
            what = "a checkpoint" if step is None else f"checkpoint step {step}"
            self._failed = errors.RunError(
                f"could not save {what} to {self.directory} ({errors.os_reason(e)}); {resume}. "
                f"{errors.write_failed_advice(e)}.")
            raise self._failed from e


def _read_only_manager(directory: str) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(directory, item_handlers=_handlers(),
                                 options=ocp.CheckpointManagerOptions(read_only=True))


def _read_or_explain(where: str, read, *args):
    """init_from is not ours to set aside: an unreadable one is an error that names it."""
    try:
        return read(*args)
    except config_lib.ConfigError:
        raise
    except Exception as e:  # noqa: BLE001
        raise config_lib.ConfigError(f"{where} could not be read ({errors.first_line(e)}).") from e


def run_directory(path: str):
    """The directory that holds checkpoints/ for a workdir, its checkpoints/ directory or a step
    directory (where a run keeps files beside its checkpoints, e.g. HF_CONFIG_FILE)."""
    path = workdir_lib.resolve(path)
    if (path / _STATE).is_dir() and path.name.isdigit():
        path = path.parent
    return path.parent if path.name == "checkpoints" and not (path / "checkpoints").is_dir() else path


def _carry_hf_config(init_from: str, workdir) -> str:
    """Copies the source model's config.json (HF_CONFIG_FILE) from beside init_from's checkpoints
    into this run's workdir, so that exporting the run (`convert_hf.py to-hf`) keeps the fields
    longctx does not know (bos/eos/pad token ids, ...). Returns a note for the start-up line."""
    source = run_directory(init_from) / HF_CONFIG_FILE
    target = workdir / HF_CONFIG_FILE
    if not source.exists() or target.exists():
        return ""
    if jax.process_index() == 0:
        target.write_text(source.read_text())
    return f"; {HF_CONFIG_FILE} carried along for export"


def _resolve_init_from(path: str, name: str = "checkpoint.init_from") -> tuple[str, int]:
    """(checkpoints directory, step) for a workdir, its checkpoints/ directory, or a step directory;
    `name`: the key or flag that gave `path`, which a failure names."""
    path = workdir_lib.resolve(path)
    if (path / _STATE).is_dir() and path.name.isdigit():
        return path.parent, int(path.name)
    directory = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    if not directory.is_dir():
        raise config_lib.ConfigError(f"{name}={str(path)!r} does not exist.")
    manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(read_only=True))
    step = manager.latest_step()
    manager.close()
    if step is None:
        raise config_lib.ConfigError(
            f"{name}={str(path)!r} holds no complete checkpoint yet (a run saves one every "
            "checkpoint.every_steps steps and when it stops): name it once its run has saved one, "
            "or name a directory that holds one.")
    return directory, step


def state_mesh_shape(state) -> dict[str, int]:
    sharding = jax.tree.leaves(state)[0].sharding
    mesh = getattr(sharding, "mesh", None)
    return dict(mesh.shape) if mesh is not None else {}
