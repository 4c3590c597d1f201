"""Run scripts/train.py with a checkpoint save that stalls in the middle, for a SIGKILL mid-save test.

  python tests/stalled_save.py --stall-step=3 --marker=PATH -- [scripts/train.py flags]

The hook lives only in this process (longctx is not touched): once Orbax imports its array
serializer, `async_serialize_from_host` (each array's TensorStore write, run in Orbax's background
save thread) is wrapped. For a save of step >= --stall-step every array write blocks, after the
step's `<step>.orbax-checkpoint-tmp*` directory has been created and before anything is committed,
and the first blocked write records {"step", "tmp_dir", "pid"} in --marker (written atomically).
The save can then never finish, so a SIGKILL sent after the marker appears lands inside a real
save every time. Saves of earlier steps are untouched.
"""

from __future__ import annotations

import asyncio
import importlib.abc
import json
import os
import re
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "scripts", "train.py")
SERIALIZER = "orbax.checkpoint._src.serialization.serialization"
TMP_DIR = re.compile(r"(/[^'\"]*/(\d+)\.orbax-checkpoint-tmp[^/'\"]*)")


def _stalling(original, stall_step: int, marker: str):
    state = {"marked": False}

    async def async_serialize_from_host(rslices_on_host, tensorstore_spec, **kwargs):
        found = TMP_DIR.search(json.dumps(tensorstore_spec, default=str))
        if found is None or int(found.group(2)) < stall_step:
            return await original(rslices_on_host, tensorstore_spec, **kwargs)
        if not state["marked"]:
            state["marked"] = True
            tmp_dir = found.group(1)
            while os.path.basename(os.path.dirname(tmp_dir)) != "checkpoints" and tmp_dir != "/":
                tmp_dir = os.path.dirname(tmp_dir)  # .../checkpoints/<step>.orbax-checkpoint-tmp-*
            with open(marker + ".tmp", "w") as f:
                json.dump({"step": int(found.group(2)), "tmp_dir": tmp_dir, "pid": os.getpid()}, f)
            os.replace(marker + ".tmp", marker)
        while True:  # until the test's SIGKILL
            await asyncio.sleep(3600)

    return async_serialize_from_host


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Calls `patch(module)` right after `name` is first imported (jax must not be imported here:
    scripts/train.py configures the CPU devices before it imports jax)."""

    def __init__(self, name: str, patch):
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            self.patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def main(argv: list[str]) -> None:
    split = argv.index("--")
    own = dict(a.lstrip("-").split("=", 1) for a in argv[:split])
    stall_step, marker = int(own["stall-step"]), own["marker"]

    def patch(module):
        module.async_serialize_from_host = _stalling(module.async_serialize_from_host, stall_step, marker)

    sys.meta_path.insert(0, _PatchAfterImport(SERIALIZER, patch))
    sys.argv = [TRAIN, *argv[split + 1:]]
    runpy.run_path(TRAIN, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
