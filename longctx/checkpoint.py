"""Orbax checkpointing: train state + data iterator + config, saved asynchronously, resumed exactly.

Layout of `workdir/checkpoints/<step>/`:
  state/     the TrainState (params, optimizer state, step, rng), sharded arrays (Orbax StandardSave)
  data/      the Grain iterator state, one JSON file per process (grain's Orbax handler)
  config/    the run's config as JSON
  metadata/  mesh shape, process count, longctx / jax versions

Resume order (`restore_or_init`): (1) the newest complete checkpoint in `workdir`; (2) else
`checkpoint.init_from` (parameters only); (3) else a fresh start. Orbax writes each step into a
temporary directory and renames it when complete, so a run killed mid-save leaves only complete
steps visible; a complete-looking step that fails to restore is reported, moved aside to
`workdir/checkpoints_unreadable/`, and the next older one is used. Nothing is ever deleted by a
failed start.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any

import grain
import jax
import ml_collections
import orbax.checkpoint as ocp

import longctx
from longctx import config as config_lib

_STATE, _DATA, _CONFIG, _METADATA = "state", "data", "config", "metadata"


def _model_differences(saved: dict, current: dict) -> list[str]:
    keys = sorted(set(saved) | set(current))
    return [f"model.{k}: checkpoint {saved.get(k)!r} vs config {current.get(k)!r}"
            for k in keys if saved.get(k) != current.get(k)]


def _abstract_with_shardings(abstract_state, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract_state, shardings)


class Checkpointer:
    """One run's checkpoints. Constructed before anything compiles so that a bad checkpoint
    directory or a model-shape mismatch fails fast."""

    def __init__(self, workdir: str, config: ml_collections.ConfigDict):
        self.config = config
        self.workdir = workdir
        self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
        c = config.checkpoint
        options = ocp.CheckpointManagerOptions(
            max_to_keep=c.max_to_keep,
            keep_period=c.keep_period,
            enable_async_checkpointing=c.async_save,
            create=True,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        self._check_model_shape()

    # ------------------------------------------------------------------ checks

    def _saved_config(self, manager: ocp.CheckpointManager, step: int) -> dict:
        restored = manager.restore(step, args=ocp.args.Composite(**{_CONFIG: ocp.args.JsonRestore()}))
        return restored[_CONFIG]

    def _check_model_shape(self) -> None:
        """A config whose model differs from the newest checkpoint's fails before anything is
        overwritten: resuming would load arrays of the wrong shape, or silently retrain."""
        step = self.manager.latest_step()
        if step is None:
            return
        try:
            saved = self._saved_config(self.manager, step)
        except Exception:  # unreadable config: the restore path reports and skips this step
            return
        diffs = _model_differences(saved.get("model", {}), self.config.model.to_dict())
        if diffs:
            raise config_lib.ConfigError(
                f"the model in {self.directory} (step {step}) differs from this config: "
                + "; ".join(diffs) + ". Use a new workdir, or checkpoint.init_from to start from its parameters.")

    # ------------------------------------------------------------------ restore

    def restore_or_init(self, setup, make_data_iterator) -> tuple[Any, Any, str]:
        """Returns (state, data iterator, a sentence saying where they came from).

        `make_data_iterator(seed_offset=0)` builds a fresh training iterator.
        """
        target = _abstract_with_shardings(setup.abstract_state, setup.state_shardings)
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                state, data_iterator, data_note = self._restore_step(step, target, make_data_iterator)
            except Exception as e:  # noqa: BLE001  (any failure means: this step is unusable)
                self._set_aside(step, e)
                continue
            return state, data_iterator, f"resumed from {self.directory}/{step} (step {step}){data_note}"

        state = setup.init(jax.random.PRNGKey(self.config.seed))
        init_from = self.config.checkpoint.init_from
        if init_from:
            params, step = self._params_from(init_from, target)
            return state.replace(params=params), make_data_iterator(), (
                f"fresh start with parameters from {init_from} (step {step}) and a fresh optimizer state")
        return state, make_data_iterator(), "fresh start"

    def _restore_step(self, step: int, target, make_data_iterator):
        restored = self.manager.restore(step, args=ocp.args.Composite(**{
            _STATE: ocp.args.StandardRestore(target),
            _METADATA: ocp.args.JsonRestore(),
        }))
        saved_processes = restored[_METADATA]["process_count"]
        if saved_processes != jax.process_count():
            # Each process's iterator state describes its own share of the data; with another
            # process count those shares no longer exist. Start the data stream afresh, reshuffled
            # by the step so the resumed run does not repeat the first batches it saw.
            return restored[_STATE], make_data_iterator(seed_offset=step), (
                f"; the data iterator was saved by {saved_processes} process(es) and this run has "
                f"{jax.process_count()}, so data restarts from a fresh shuffle seeded with step {step}")
        data_iterator = make_data_iterator()
        self.manager.restore(step, args=ocp.args.Composite(**{
            _DATA: grain.checkpoint.CheckpointRestore(data_iterator.grain_iterator)}))
        return restored[_STATE], data_iterator, ", data iterator included"

    def _set_aside(self, step: int, error: Exception) -> None:
        """Moves an unreadable step out of Orbax's sight (never deletes it) and says so."""
        source = os.path.join(self.directory, str(step))
        aside = os.path.join(os.path.abspath(self.workdir), "checkpoints_unreadable",
                             f"{step}-{int(time.time())}")
        if jax.process_index() == 0:
            print(f"longctx: WARNING: checkpoint {source} could not be restored "
                  f"({type(error).__name__}: {str(error).splitlines()[0][:300]}); moving it to {aside} "
                  "and trying the previous one.", flush=True)
            os.makedirs(os.path.dirname(aside), exist_ok=True)
            shutil.move(source, aside)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"longctx_set_aside_{step}")
        self.manager.reload()

    def _params_from(self, directory: str, target):
        manager = ocp.CheckpointManager(os.path.join(os.path.abspath(directory), "checkpoints")
                                        if os.path.isdir(os.path.join(directory, "checkpoints"))
                                        else os.path.abspath(directory))
        step = manager.latest_step()
        if step is None:
            raise config_lib.ConfigError(f"checkpoint.init_from={directory!r} holds no checkpoint.")
        diffs = _model_differences(self._saved_config(manager, step).get("model", {}),
                                   self.config.model.to_dict())
        if diffs:
            raise config_lib.ConfigError(
                f"checkpoint.init_from={directory!r} has another model shape: " + "; ".join(diffs) + ".")
        restored = manager.restore(step, args=ocp.args.Composite(**{_STATE: ocp.args.StandardRestore(target)}))
        manager.close()
        return restored[_STATE].params, step

    # ------------------------------------------------------------------ save

    def maybe_save(self, step: int, state, data_iterator, *, force: bool = False) -> bool:
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


def state_mesh_shape(state) -> dict[str, int]:
    sharding = jax.tree.leaves(state)[0].sharding
    mesh = getattr(sharding, "mesh", None)
    return dict(mesh.shape) if mesh is not None else {}
