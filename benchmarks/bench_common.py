"""Shared by the benchmarks: the machine, the base config, HLO checks, the output flags; and the
report writer of longctx.reports (JSON, markdown sections, tables), under the names the
benchmarks use (bc.write_json, bc.table, ...).
"""
from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import statistics
import time

from longctx import cli

from longctx.reports import (BENCHMARKS_MD, DOCS, REPO, command_line, table, write_json,
                             write_markdown, write_section)

__all__ = ["BENCHMARKS_MD", "DOCS", "REPO", "command_line", "table", "write_json", "write_markdown",
           "write_section", "base_config", "add_output_arguments", "add_page_arguments", "render_only",
           "largest_square", "max_dim_product",
           "cpu_model", "sp_mesh", "machine"]


def base_config(preset: str):
    """`configs/base.py`'s `get_config(preset)` (configs/ is not an installed package: by path)."""
    return _configs_base().get_config(preset)


@functools.lru_cache(maxsize=None)
def _configs_base():
    spec = importlib.util.spec_from_file_location("longctx_configs_base",
                                                  os.path.join(REPO, "configs", "base.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def add_output_arguments(parser, section: str, render_only_help: str | None = None) -> None:
    """--json (default docs/<section>.json) and --md (docs/benchmarks.md, whose <section> the script
    writes); with `render_only_help`, also --render-only: rewrite the section from --json."""
    parser.add_argument("--json", default=os.path.join(DOCS, f"{section}.json"))
    parser.add_argument("--md", default=BENCHMARKS_MD)
    if render_only_help:
        parser.add_argument("--render-only", action="store_true", help=render_only_help)


def add_page_arguments(parser, page: str) -> None:
    """--json and --md (docs/<page>.json and .md: a page of its own, not a section of
    docs/benchmarks.md) and --render-only (the page rewritten from the JSON, nothing measured)."""
    parser.add_argument("--json", default=os.path.join(DOCS, f"{page}.json"))
    parser.add_argument("--md", default=os.path.join(DOCS, f"{page}.md"))
    parser.add_argument("--render-only", action="store_true", help="rewrite the markdown from --json")


def render_only(args, markdown) -> bool:
    """Under --render-only: the page rewritten from its JSON by `markdown` and printed (True: the
    script has nothing else to do)."""
    if not args.render_only:
        return False
    cli.validated(f"--render-only from {args.json}")
    with open(args.json) as f:
        result = json.load(f)
    write_markdown(args.md, markdown(result))
    print(markdown(result))
    return True


_SHAPE = re.compile(r"\b(?:f32|bf16|f16|s32|u32|pred|s8|u8|f64|s64)\[([\d,]+)\]")


def largest_square(hlo_text: str, threshold: int):
    """The shapes in compiled HLO with at least two dimensions >= threshold (an L x L array)."""
    found = set()
    for m in _SHAPE.finditer(hlo_text):
        dims = [int(d) for d in m.group(1).split(",") if d]
        if sum(d >= threshold for d in dims) >= 2:
            found.add(m.group(0))
    return sorted(found)


def max_dim_product(hlo_text: str) -> int:
    """Elements of the largest array in the HLO text (any dtype)."""
    best = 0
    for m in _SHAPE.finditer(hlo_text):
        n = 1
        for d in m.group(1).split(","):
            if d:
                n *= int(d)
        best = max(best, n)
    return best


def median_seconds(f, args, reps: int) -> float:
    """Median wall seconds of `reps` calls of `f(*args)`, each waited for, after one untimed call
    (the first compiles)."""
    import jax
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what `platform` knows: timings on CPU differ
    from one model to the next, and the machines these scripts run on do."""
    import platform as py_platform
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return py_platform.processor() or py_platform.machine()


def sp_mesh(sp: int):
    """The first `sp` devices as a mesh with the one axis "sp": the ring benchmarks' mesh."""
    import jax
    return jax.make_mesh((sp,), ("sp",), devices=jax.devices()[:sp],
                         axis_types=(jax.sharding.AxisType.Auto,))


def machine() -> dict:
    import platform as py_platform

    import jax
    return {"jax": jax.__version__, "python": py_platform.python_version(),
            "cpu_count": os.cpu_count(), "cpu_model": cpu_model(), "devices": jax.device_count(),
            "platform": jax.devices()[0].platform,
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
