"""Orbax checkpointing: train state + data iterator + config, saved asynchronously, resumed exactly.

Layout of `workdir/checkpoints/<step>/`:
  state/     the TrainState (params, optimizer state, step, rng), sharded arrays (Orbax StandardSave)
  data/      the Grain iterator state, one JSON file per process (grain's Orbax handler)
  config/    the run's config as JSON
  metadata/  mesh shape, process count, longctx / jax versions

Resume order (`restore_or_init`): (1) the newest complete checkpoint in `workdir`; (2) else
`checkpoint.init_from` (parameters only: a workdir, its checkpoints/ directory, or one step
directory); (3) else a fresh start. The returned sentence says which one happened.

Crash safety. Orbax writes each step into `<step>.orbax-checkpoint-tmp` and renames it when
complete, so a run killed mid-save leaves only complete steps visible (the leftover tmp directory is
replaced when that step is saved again). A complete-looking step that cannot be read is reported,
moved aside to `workdir/checkpoints_unreadable/<step>-<time>/` (never deleted) and the next older
one is used.

Incompatible, not corrupt. A checkpoint that reads fine but does not fit this run is an error,
raised before anything is written or moved: a different model shape (the config keys that fix
parameter shapes, listed with both values) or a different train-state structure (e.g. another
optimizer chain; the differing arrays are listed). Other model keys that changed (rope_theta,
dtype, remat, ...) are only reported. When the data iterator state cannot carry over (process
count or the data stream's config changed), the state is restored, the data stream restarts from a
fresh shuffle seeded with the step, and the sentence says so.
"""

from __future__ import annotations

import time
from typing import Any

import grain
import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

import longctx
from longctx import config as config_lib
from longctx import workdir as workdir_lib

_STATE, _DATA, _CONFIG, _METADATA = "state", "data", "config", "metadata"

# Config keys that fix the shapes (or presence) of parameters: a difference is an error on resume.
_SHAPE_KEYS = tuple(f"model.{k}" for k in (
    "vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
    "tie_embeddings", "param_dtype")) + ("attention.attention_sinks",)
# Data keys that define the training stream: if one differs, the saved iterator state means nothing.
_STREAM_KEYS = tuple(f"data.{k}" for k in (
    "path", "seq_len", "global_batch_size", "packer", "shuffle_seed", "num_workers"))
_MAX_LISTED = 12


def _handlers() -> dict:
    return {_STATE: ocp.StandardCheckpointHandler(), _DATA: grain.checkpoint.CheckpointHandler(),
            _CONFIG: ocp.JsonCheckpointHandler(), _METADATA: ocp.JsonCheckpointHandler()}


def _get(config: dict, dotted: str):
    section, key = dotted.split(".", 1)
    return (config.get(section) or {}).get(key)


def _config_differences(saved: dict, current: dict, keys) -> list[str]:
    return [f"{k}: checkpoint {_get(saved, k)!r} vs config {_get(current, k)!r}"
            for k in keys if _get(saved, k) != _get(current, k)]


def _section_differences(saved: dict, current: dict, section: str, skip=()) -> list[str]:
    keys = sorted(set(saved.get(section) or {}) | set(current.get(section) or {}))
    return _config_differences(saved, current, [f"{section}.{k}" for k in keys
                                                 if f"{section}.{k}" not in skip])


def _key_str(entry) -> str:
    for attribute in ("key", "name", "idx"):
        if hasattr(entry, attribute):
            return str(getattr(entry, attribute))
    return str(entry)


def flat_arrays(tree) -> dict[str, tuple[tuple[int, ...], str]]:
    """`{"params/embed/value": (shape, dtype)}` for a tree of arrays, ShapeDtypeStructs or Orbax
    ArrayMetadata (dataclass fields, dict keys and named-tuple fields all give plain names)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(_key_str(k) for k in path): (tuple(leaf.shape), str(np.dtype(leaf.dtype)))
            for path, leaf in leaves}


def _structure_differences(saved: dict, current: dict) -> list[str]:
    out = []
    for name in sorted(set(saved) | set(current)):
        if name not in current:
            out.append(f"{name} only in the checkpoint")
        elif name not in saved:
            out.append(f"{name} only in this run")
        elif saved[name] != current[name]:
            (s_shape, s_dtype), (c_shape, c_dtype) = saved[name], current[name]
            out.append(f"{name}: checkpoint {s_dtype}{list(s_shape)} vs this run {c_dtype}{list(c_shape)}")
    if len(out) > _MAX_LISTED:
        out = out[:_MAX_LISTED] + [f"... and {len(out) - _MAX_LISTED} more"]
    return out


def _abstract_with_shardings(abstract_state, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract_state, shardings)


def _all_processes_agree(ok: bool) -> bool:
    """True when `ok` holds on every process (a step one process cannot read is unusable for all)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.array([ok], np.int32))))


def _first_line(error: BaseException) -> str:
    """One line about an error: its root cause's first line (Orbax wraps TensorStore's errors, whose
    own message names the file and what is wrong with it, in a long dump of the array spec)."""
    seen = []
    while error is not None and error not in seen and len(seen) < 10:
        seen.append(error)
        error = error.__cause__ or error.__context__
    root = seen[-1]
    lines = str(root).strip().splitlines()
    return f"{type(root).__name__}: {lines[0][:400] if lines else ''}"


def _say(message: str) -> None:
    if jax.process_index() == 0:
        print(f"longctx: {message}", flush=True)


class Checkpointer:
    """One run's checkpoints. Constructed before anything compiles so that a bad checkpoint
    directory or a model-shape mismatch fails fast."""

    def __init__(self, workdir: str, config: ml_collections.ConfigDict):
        self.config = config
        self.workdir = workdir_lib.resolve(workdir)
        self.directory = self.workdir / "checkpoints"
        c = config.checkpoint
        options = ocp.CheckpointManagerOptions(
            max_to_keep=c.max_to_keep,
            keep_period=c.keep_period,
            enable_async_checkpointing=c.async_save,
            create=True,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=_handlers())
        self._check_model_shape()

    # ------------------------------------------------------------------ checks

    @staticmethod
    def _saved_config(manager: ocp.CheckpointManager, step: int) -> dict:
        restored = manager.restore(step, args=ocp.args.Composite(**{_CONFIG: ocp.args.JsonRestore()}))
        return restored[_CONFIG]

    def _shape_error(self, where: str, saved_config: dict) -> config_lib.ConfigError | None:
        diffs = _config_differences(saved_config, self.config.to_dict(), _SHAPE_KEYS)
        if not diffs:
            return None
        return config_lib.ConfigError(
            f"the model in {where} differs from this config: " + "; ".join(diffs)
            + ". Use a new workdir, or checkpoint.init_from to start from its parameters.")

    def _check_model_shape(self) -> None:
        """A config whose model shape differs from the newest checkpoint's (or from init_from's,
        when there is none) fails here, before anything is written or compiled."""
        step = self.manager.latest_step()
        if step is None:
            if self.config.checkpoint.init_from:
                directory, step = _resolve_init_from(self.config.checkpoint.init_from)
                where = f"checkpoint.init_from={self.config.checkpoint.init_from!r} (step {step})"
                with _read_only_manager(directory) as manager:
                    error = self._shape_error(where, _read_or_explain(where, self._saved_config, manager, step))
                if error:
                    raise error
            return
        try:
            saved = self._saved_config(self.manager, step)
        except Exception:  # noqa: BLE001  (unreadable: the restore path reports and skips this step)
            return
        error = self._shape_error(f"{self.directory} (step {step})", saved)
        if error:
            raise error
        changed = _section_differences(saved, self.config.to_dict(), "model", skip=_SHAPE_KEYS)
        if changed:
            _say("resuming with changed model settings (parameter shapes are the same): " + "; ".join(changed))

    # ------------------------------------------------------------------ restore

    def restore_or_init(self, setup, make_data_iterator) -> tuple[Any, Any, str]:
        """Returns (state, data iterator, a sentence saying where they came from).

        `make_data_iterator(seed_offset=0)` builds a fresh training iterator. Raises ConfigError,
        with nothing moved or written, when a readable checkpoint does not fit this run.
        """
        target = _abstract_with_shardings(setup.abstract_state, setup.state_shardings)
        for step in sorted(self.manager.all_steps(), reverse=True):
            info, error = None, None
            try:
                info = self._read_step_info(step)
            except Exception as e:  # noqa: BLE001  (any failure here means: this step is unreadable)
                error = e
            if not _all_processes_agree(error is None):
                self._set_aside(step, error)
                continue
            self._check_fits(step, info, target)  # ConfigError: not corrupt, just not this run's
            data_iterator, result, error = None, None, None
            try:
                data_iterator = make_data_iterator()
                result = self._restore_step(step, info, target, data_iterator, make_data_iterator)
            except Exception as e:  # noqa: BLE001
                error = e
            if not _all_processes_agree(error is None):
                if data_iterator is not None and hasattr(data_iterator, "close"):
                    data_iterator.close()
                self._set_aside(step, error)
                continue
            state, data_iterator, data_note = result
            return state, data_iterator, f"resumed from {self.directory}/{step} (step {step}){data_note}"

        state = setup.init(jax.random.PRNGKey(self.config.seed))
        init_from = self.config.checkpoint.init_from
        if init_from:
            params, where = self._params_from(init_from, target)
            return state.replace(params=params), make_data_iterator(), (
                f"fresh start with parameters from {where} and a fresh optimizer state")
        return state, make_data_iterator(), "fresh start"

    def _read_step_info(self, step: int) -> dict:
        """The small parts of a step (config, metadata, the state's array shapes): read first, so
        that a mismatch is reported as such and not mistaken for corruption."""
        restored = self.manager.restore(step, args=ocp.args.Composite(**{
            _CONFIG: ocp.args.JsonRestore(), _METADATA: ocp.args.JsonRestore()}))
        arrays = flat_arrays(self.manager.item_metadata(step)[_STATE])
        if not arrays:
            raise ValueError(f"no array metadata under {self.directory}/{step}/{_STATE}")
        return {"config": restored[_CONFIG], "metadata": restored[_METADATA], "arrays": arrays}

    def _check_fits(self, step: int, info: dict, target) -> None:
        error = self._shape_error(f"{self.directory} (step {step})", info["config"])
        if error:
            raise error
        diffs = _structure_differences(info["arrays"], flat_arrays(target))
        if diffs:
            raise config_lib.ConfigError(
                f"the train state in {self.directory} (step {step}) does not fit this run's "
                "(optimizer or model settings changed?): " + "; ".join(diffs)
                + ". Use a new workdir, or checkpoint.init_from to start from its parameters.")

    def _restore_step(self, step: int, info: dict, target, data_iterator, make_data_iterator):
        restored = self.manager.restore(step, args=ocp.args.Composite(**{_STATE: ocp.args.StandardRestore(target)}))
        state = restored[_STATE]
        saved_processes = info["metadata"]["process_count"]
        saved_config, current = info["config"], self.config.to_dict()
        stream_diffs = _config_differences(saved_config, current, _STREAM_KEYS)
        if saved_processes != jax.process_count() or stream_diffs:
            # Each process's iterator state describes its own share of one particular stream; with
            # another process count or stream those no longer exist. Start the stream afresh,
            # reshuffled by the step so that the resumed run does not repeat its first batches.
            why = (f"was saved by {saved_processes} process(es) and this run has {jax.process_count()}"
                   if saved_processes != jax.process_count() else
                   "belongs to another data stream (" + "; ".join(stream_diffs) + ")")
            data_iterator.close()
            return state, make_data_iterator(seed_offset=step), (
                f"; the data iterator state {why}, so data restarts from a fresh shuffle seeded with step {step}")
        try:
            self.manager.restore(step, args=ocp.args.Composite(**{
                _DATA: grain.checkpoint.CheckpointRestore(data_iterator.grain_iterator)}))
        except Exception as e:  # noqa: BLE001
            other = _section_differences(saved_config, current, "data", skip=("data.cache_dir",))
            if not other:
                raise  # same data config: the saved state itself is bad
            data_iterator.close()
            return state, make_data_iterator(seed_offset=step), (
                f"; the data iterator state could not be restored with this data config "
                f"({'; '.join(other)}: {_first_line(e)}), so data restarts from a fresh shuffle "
                f"seeded with step {step}")
        return state, data_iterator, ", data iterator included"

    def _set_aside(self, step: int, error: BaseException | None) -> None:
        """Moves an unreadable step out of Orbax's sight (never deletes it) and says so."""
        source = self.directory / str(step)
        aside = self.workdir / "checkpoints_unreadable" / f"{step}-{int(time.time())}"
        why = _first_line(error) if error is not None else "another process could not read it"
        if jax.process_index() == 0:
            print(f"longctx: WARNING: checkpoint {source} could not be restored ({why}); moving it to "
                  f"{aside} and trying the previous one.", flush=True)
            workdir_lib.move(source, aside)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"longctx_set_aside_{step}")
        self.manager.reload()

    def _params_from(self, init_from: str, target):
        """Only the parameters of another run's checkpoint (partial restore: its optimizer state
        is never read, and may have another structure)."""
        directory, step = _resolve_init_from(init_from)
        where = f"checkpoint.init_from={init_from!r} (step {step})"
        with _read_only_manager(directory) as manager:
            error = self._shape_error(where, _read_or_explain(where, self._saved_config, manager, step))
            if error:
                raise error
            saved = _read_or_explain(where, lambda: flat_arrays(manager.item_metadata(step)[_STATE]))
        saved = {k: v for k, v in saved.items() if k.startswith("params/")}
        diffs = _structure_differences(saved, flat_arrays({"params": target.params}))
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

    def maybe_save(self, step: int, state, data_iterator, *, force: bool = False) -> bool:
        """Starts an (async) save when `step` is a save step or `force`; returns whether it did.
        The caller is blocked only while the arrays are copied to host memory and the iterator
        state (a small JSON) is written; the rest happens in Orbax's background thread."""
        every = self.config.checkpoint.every_steps
        if not force and not (every and step % every == 0):
            return False
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
        }
        return self.manager.save(step, args=ocp.args.Composite(**{
            _STATE: ocp.args.StandardSave(state),
            _DATA: grain.checkpoint.CheckpointSave(data_iterator.grain_iterator),
            _CONFIG: ocp.args.JsonSave(self.config.to_dict()),
            _METADATA: ocp.args.JsonSave(metadata),
        }), force=True)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


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
        raise config_lib.ConfigError(f"{where} could not be read ({_first_line(e)}).") from e


def _resolve_init_from(path: str) -> tuple[str, int]:
    """(checkpoints directory, step) for a workdir, its checkpoints/ directory, or a step directory."""
    path = workdir_lib.resolve(path)
    if (path / _STATE).is_dir() and path.name.isdigit():
        return path.parent, int(path.name)
    directory = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    if not directory.is_dir():
        raise config_lib.ConfigError(f"checkpoint.init_from={str(path)!r} does not exist.")
    manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(read_only=True))
    step = manager.latest_step()
    manager.close()
    if step is None:
        raise config_lib.ConfigError(f"checkpoint.init_from={str(path)!r} holds no complete checkpoint.")
    return directory, step


def state_mesh_shape(state) -> dict[str, int]:
    sharding = jax.tree.leaves(state)[0].sharding
    mesh = getattr(sharding, "mesh", None)
    return dict(mesh.shape) if mesh is not None else {}
