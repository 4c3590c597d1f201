"""Model parameters in and out of longctx checkpoints, outside a training run.

`save` writes what `scripts/convert_hf.py` produces: a directory laid out like a training workdir,

  DIR/checkpoints/0/state/     {"params": ...}, sharded arrays (Orbax StandardSave)
  DIR/checkpoints/0/config/    the full longctx config (JSON), whose model section describes them
  DIR/checkpoints/0/metadata/  where the parameters came from, versions

so that `--config.checkpoint.init_from=DIR` starts a run from them (`checkpoint.init_from` reads
parameters only; it never looks for an optimizer state). `restore` reads the config and the
parameters of any longctx checkpoint (such a directory, or a training run's workdir, its
checkpoints/ directory or one step directory) onto the caller's mesh, in whatever sharding that
mesh gives them.
"""

from __future__ import annotations

import os
import time

import jax
import ml_collections
import orbax.checkpoint as ocp

import longctx
from longctx.errors import ConfigError, first_line
from longctx.interop import staging
from longctx.train import checkpoint as checkpoint_lib
from longctx.train.state import abstract_with_shardings

# The item names of a longctx checkpoint step (longctx/train/checkpoint.py).
STATE, CONFIG, METADATA = "state", "config", "metadata"


def save(directory: str, config: ml_collections.ConfigDict, params, *, source: str,
         overwrite: bool = False, files: dict[str, str] | None = None) -> str:
    """Writes `params` (an nnx.State of jax.Arrays) as step 0 of `directory`/checkpoints, and
    `files` ({name: text}) beside checkpoints/. A non-empty `directory` is refused unless
    `overwrite`; everything is written into a sibling directory that then replaces `directory`
    (longctx/interop/staging.py), so a save that fails leaves the old contents as they were."""
    with staging.staged(directory, overwrite) as out:
        checkpoints = os.path.join(out, "checkpoints")
        handlers = {STATE: ocp.StandardCheckpointHandler(), CONFIG: ocp.JsonCheckpointHandler(),
                    METADATA: ocp.JsonCheckpointHandler()}
        options = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False)
        metadata = {"step": 0, "source": source, "parameters_only": True,
                    "process_count": jax.process_count(), "longctx_version": longctx.__version__,
                    "jax_version": jax.__version__, "saved_at_unix": time.time()}
        with ocp.CheckpointManager(checkpoints, options=options, item_handlers=handlers) as manager:
            manager.save(0, args=ocp.args.Composite(**{
                STATE: ocp.args.StandardSave({"params": params}),
                CONFIG: ocp.args.JsonSave(config.to_dict()),
                METADATA: ocp.args.JsonSave(metadata),
            }))
            manager.wait_until_finished()
        for name, text in (files or {}).items():
            with open(os.path.join(out, name), "w") as f:
                f.write(text)
    return os.path.join(os.path.abspath(directory), "checkpoints", "0")


def hf_config_path(path: str) -> str:
    """Where the source model's config.json is kept for a longctx checkpoint `path` (a converted
    directory or a training workdir, its checkpoints/ or a step directory): beside checkpoints/
    (`checkpoint.HF_CONFIG_FILE`, written by to-longctx and carried along init_from)."""
    return str(checkpoint_lib.run_directory(path) / checkpoint_lib.HF_CONFIG_FILE)


def read_config(path: str, flag: str = "--checkpoint") -> tuple[ml_collections.ConfigDict, str, int]:
    """(the saved config, checkpoints directory, step) of the newest checkpoint under `path`; a
    path without one is one sentence naming `flag`, the script's flag that gave it."""
    directory, step = checkpoint_lib._resolve_init_from(path, flag)  # (the resolution init_from uses)
    options = ocp.CheckpointManagerOptions(read_only=True)
    try:
        with ocp.CheckpointManager(directory, options=options,
                                   item_handlers={CONFIG: ocp.JsonCheckpointHandler()}) as manager:
            saved = manager.restore(step, args=ocp.args.Composite(**{CONFIG: ocp.args.JsonRestore()}))[CONFIG]
    except Exception as e:  # noqa: BLE001  (a step without a readable config is not usable here)
        raise ConfigError(f"{directory}/{step} has no readable config ({type(e).__name__}).") from e
    return ml_collections.ConfigDict(saved), str(directory), step


def restore(directory: str, step: int, abstract_params, shardings):
    """The parameters of one step, placed with `shardings` (partial restore: nothing else is read)."""
    target = abstract_with_shardings(abstract_params, shardings)
    item = {"params": target}
    try:
        with ocp.PyTreeCheckpointer() as checkpointer:
            restored = checkpointer.restore(
                os.path.join(directory, str(step), STATE),
                args=ocp.args.PyTreeRestore(item=item, partial_restore=True,
                                            restore_args=ocp.checkpoint_utils.construct_restore_args(item)))
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"the parameters in {directory}/{step} could not be read for this model "
                          f"({first_line(e)}).") from e
    return restored["params"]
