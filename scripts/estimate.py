"""Will it fit? Compiles the whole train step ahead of time for a TPU topology and reports memory.

  .venv/bin/python scripts/estimate.py --config=configs/base.py:llama3_8b_128k --topology=v5p:4x4x4
  .venv/bin/python scripts/estimate.py --config=configs/base.py:llama3_8b_128k --topology=v5e:8x8 \\
      --config.mesh.sp=32 --config.model.remat_policy=nothing_saveable
  .venv/bin/python scripts/estimate.py --config=configs/base.py:tiny --topology=v5p:2x2x2 --json

Runs on any machine with `libtpu` installed (the [tpu] extra): the model, the ring-splash Mosaic
kernels and the optimizer go through the real TPU compiler for the named topology (v4, v5e, v5p,
v6e, e.g. "v5p:4x4x4", "v5e:8x8", "v5e:1x1" for one chip), nothing runs. Prints per-device
arguments, outputs, temporaries and total (the compiler's peak for the step); a breakdown of them
(parameters, optimizer state, batch, gradients, saved activations per layer with what each
residual is, the largest arrays of the compiled program); the chip's HBM, whether it fits and,
when it does not, the overrides that should make it fit, most bytes saved first; and the
planner's memory model's figure for the same run. `--json` prints the same as one JSON object.
Exit status 0 fits, 1 does not fit, 2 bad input (one line on stderr, `longctx: ...`).

Sweep: the longest sequence that fits, per chip type and sp (docs/fit_llama3_8b.md + .json):
  .venv/bin/python scripts/estimate.py --config=configs/base.py:llama3_8b_128k --sweep \\
      --sweep_topologies=v5p:4x4x4,v6e:16x16,v5e:16x16 --sweep_sp=16,32
For each topology and sp the mesh is dp=1, fsdp=N/sp, sp with one sequence per fsdp rank
(global batch = fsdp: every chip holds one L = S/sp token shard); L doubles (or halves) from
--sweep_start_shard until the step stops (or starts) fitting. Every number is a real compile of
the whole model at that length; nothing is extrapolated.
"""

import os
import sys

# longctx from this checkout even without .venv, so that cli.start() can say in one line what is missing
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from longctx import cli  # noqa: E402

cli.start()  # before jax is imported

import copy  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402

from absl import flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from longctx.model import block_options, layer_types  # noqa: E402
from longctx.plan import aot, auto, collectives, memory_model, planner  # noqa: E402
from longctx.train import state as train_state  # noqa: E402
from longctx import config as config_lib  # noqa: E402
from longctx import reports  # noqa: E402
from longctx.parallel import mesh as mesh_lib  # noqa: E402
from longctx.errors import ConfigError  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/base.py:llama3_8b_128k.",
                                          lock_config=True)
_TOPOLOGY = flags.DEFINE_string("topology", "", "TPU topology known to libtpu, e.g. v5p:4x4x4, v5e:8x8, "
                                "v6e:4x4, v4:2x2x2.")
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object instead of the table.")
_BREAKDOWN = flags.DEFINE_bool("breakdown", True, "Also say what the bytes hold (a second, one-layer "
                               "compile); --nobreakdown reports the totals only.")
_SWEEP = flags.DEFINE_bool("sweep", False, "Find the longest sequence that fits per topology and sp.")
_SWEEP_TOPOLOGIES = flags.DEFINE_list("sweep_topologies", ["v5p:4x4x4", "v6e:16x16", "v5e:16x16"],
                                      "Topologies for --sweep.")
_SWEEP_SP = flags.DEFINE_list("sweep_sp", ["16", "32"], "sp sizes for --sweep.")
_SWEEP_START = flags.DEFINE_integer("sweep_start_shard", 8192, "First L = S/sp tried by --sweep.",
                                    lower_bound=1)
_SWEEP_MAX = flags.DEFINE_integer("sweep_max_shard", 131072, "Largest L = S/sp tried by --sweep.",
                                  lower_bound=1)
_SWEEP_MIN = flags.DEFINE_integer("sweep_min_shard", 1024, "Smallest L = S/sp tried by --sweep.",
                                  lower_bound=1)
_SWEEP_POINTS = flags.DEFINE_list("sweep_points", [], "Searches as topology/sp/first L, e.g. "
                                   "v5p:4x4x4/16/131072,v6e:16x16/32/32768 (instead of topologies x sp).")
_SWEEP_GROW = flags.DEFINE_bool("sweep_grow", True, "Keep doubling L while it fits; with "
                                 "--nosweep_grow a search stops at the first L that fits.")
_SWEEP_SHRINK = flags.DEFINE_bool("sweep_shrink", True, "Halve L until it fits; with "
                                   "--nosweep_shrink a search that does not fit at its first L stops.")
_SWEEP_OUT = flags.DEFINE_string("sweep_out", "docs/fit_llama3_8b", "Output path stem (.md, .json).")


def estimate(config, topology: str, breakdown: bool = True) -> aot.CompiledStep:
    """Compiles `config`'s train step for `topology`; ConfigError (one sentence) on bad input.
    `breakdown`: also what the bytes hold (aot.MemoryBreakdown: one more, one-layer compile)."""
    if not aot.libtpu_available():
        raise ConfigError("libtpu is not installed, so TPU programs cannot be compiled here "
                          "(pip install -e '.[tpu]').")
    try:
        check(config, topology)
        cli.validated(f"config and topology {topology} are fine")
        # A compile takes from seconds (tiny) to minutes (an 8B model at 131,072 tokens): say so
        # before it starts and when it ends, on stderr so that --json's stdout stays one JSON object.
        return aot.compile_train_step(config, topology, breakdown=breakdown,
                                      say=lambda line: print(f"estimate: {line}", file=sys.stderr, flush=True))
    except ConfigError as e:
        raise ConfigError(f"the config does not fit topology {topology}: {e}") from None
    except ValueError as e:  # aot: a topology libtpu does not know
        raise ConfigError(str(e)) from None


def check(config, topology: str) -> None:
    """What a compile for `topology` checks first, without compiling: the topology is known and
    the config fits its device count (ConfigError / ValueError, one sentence)."""
    devices = aot.topology_devices(topology)
    config = auto.resolve(config, devices).config  # auto keys, as compile_train_step does
    config_lib.validate(config, num_devices=len(devices))
    mesh_lib.make_mesh(config.mesh, devices=devices)


def communication(config, mesh_shape: dict) -> dict:
    """{layer type: collectives.TypeTraffic} per device per layer of the run as compiled: every
    strategy the heads and sp allow, on each type's mask in the run's layout."""
    sp = mesh_shape[mesh_lib.SP]
    rows = config.data.global_batch_size // max(1, mesh_shape.get("dp", 1) * mesh_shape.get("fsdp", 1))
    return collectives.layer_type_traffic(config, sp=sp, rows=rows,
                                          layout=train_state.resolve_layout(config, sp))


def _communication_lines(config, mesh_shape: dict) -> str:
    lines = ["attention communication per device per layer (formula: longctx/plan/collectives.py):"]
    for name, traffic in communication(config, mesh_shape).items():
        what = "" if name == layer_types.UNIFORM else f"layer type {name}: "
        lines.append(f" {what}x {traffic.layers} layers per step")
        for strategy, b in traffic.per_strategy.items():
            lines.append(f"  {strategy:11s} forward {b['forward'] / 2**20:9,.1f} MiB   backward "
                         f"{b['backward'] / 2**20:9,.1f} MiB"
                         + ("   <- attention.cp" if strategy == traffic.chosen else ""))
    return "\n".join(lines)


def memory_model_bytes(config, mesh_shape: dict) -> int:
    """The planner's memory model's bytes per device for the run as compiled (what a plan prunes
    by), beside the compiler's figure."""
    sizes = {ax: mesh_shape[ax] for ax in (mesh_lib.DP, mesh_lib.FSDP, mesh_lib.SP)}
    return memory_model.per_device_bytes(config, sizes).total_bytes


def result_dict(config, result: aot.CompiledStep) -> dict:
    out = dataclasses.asdict(result)
    out.pop("hlo", None)
    out.update(total_bytes=result.total_bytes, peak_bytes=result.peak_bytes, hbm_bytes=result.hbm_bytes,
               fits=result.fits,
               seq_len=config.data.seq_len, global_batch_size=config.data.global_batch_size,
               remat_policy=config.model.remat_policy, impl=config.attention.impl,
               memory_model_bytes=memory_model_bytes(config, result.mesh_shape),
               remedies=aot.suggest_remedies(config, result),
               remedy_estimates=[dataclasses.asdict(r) for r in aot.remedy_estimates(config, result)],
               attention_communication_bytes_per_layer={
                   name: traffic.per_strategy for name, traffic in communication(config, result.mesh_shape).items()})
    if result.breakdown is None:
        out.pop("breakdown", None)
    else:
        b = result.breakdown
        out["breakdown"].update(saved_activation_bytes=b.saved_activation_bytes,
                                other_temp_bytes=b.other_temp_bytes(result.temp_bytes))
    return out


def _sweep_config(config, num_devices: int, sp: int, shard_len: int):
    c = copy.deepcopy(config)
    c.unlock()
    fsdp = num_devices // sp
    c.mesh.update(dp=1, fsdp=fsdp, sp=sp, dcn_dp=1, dcn_fsdp=1, dcn_sp=1)
    c.data.update(seq_len=shard_len * sp, global_batch_size=fsdp)
    return c


def sweep_point(config, topology: str, sp: int, shard_len: int) -> dict:
    c = _sweep_config(config, len(aot.topology_devices(topology)), sp, shard_len)
    try:
        r = estimate(c, topology, breakdown=False)  # a sweep wants the totals, fast
    except ValueError as e:
        return {"topology": topology, "sp": sp, "shard_len": shard_len, "error": str(e)}
    except Exception as e:  # noqa: BLE001  (a compiler failure is a result of the sweep too)
        return {"topology": topology, "sp": sp, "shard_len": shard_len,
                "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    out = result_dict(c, r)
    out.update(sp=sp, shard_len=shard_len)
    return out


def sweep(config, searches, lo_limit, hi_limit, out_stem) -> dict:
    """Doubling search of the longest per-chip shard L (power of two) that fits, for each
    (topology, sp, first L) of `searches`."""
    results = {"command": reports.command_line(), "model": _model_line(config),
               "source": aot.source_digest(), "points": [], "best": [],
               "search": _SWEEP_GROW.value or _SWEEP_SHRINK.value}
    # Points of an earlier sweep of the same model by the same code are reused (compiles take
    # minutes): an interrupted sweep resumes; a changed longctx measures afresh.
    previous = {}
    if os.path.exists(out_stem + ".json"):
        with open(out_stem + ".json") as f:
            old = json.load(f)
        if old.get("model") == results["model"] and old.get("source") == results["source"]:
            previous = {(p["topology"], p["sp"], p["shard_len"]): p for p in old["points"]}

    save = functools.partial(_save_sweep, out_stem, results)

    for topology, sp, start in searches:
        try:
            n = len(aot.topology_devices(topology))
        except ValueError as e:
            print(f"estimate: {e}", file=sys.stderr)
            continue
        if n % sp:
            print(f"sweep: skipping sp={sp}: it does not divide {n} devices of {topology}")
            continue
        tried = {}

        def fits(L):
            if L not in tried:
                p = previous.get((topology, sp, L)) or sweep_point(config, topology, sp, L)
                tried[L] = p
                results["points"].append(p)
                status = ("error: " + p["error"]) if "error" in p else (
                    f"{p['total_bytes'] / aot.GIB:7.1f} GiB of {p['hbm_bytes'] / aot.GIB:.0f} "
                    f"-> {'fits' if p['fits'] else 'does not fit'}")
                print(f"  {topology:11s} sp={sp:3d} L={L:6d} S={L * sp:8d}: {status}", flush=True)
                save()
            return "error" not in tried[L] and bool(tried[L]["fits"])

        L, best = start, None
        try:
            config_lib.validate(_sweep_config(config, n, sp, L), num_devices=n)
            mesh_lib.make_mesh(_sweep_config(config, n, sp, L).mesh,
                               devices=aot.topology_devices(topology))
        except Exception as e:  # noqa: BLE001
            print(f"sweep: skipping {topology} sp={sp}: {str(e).splitlines()[0][:200]}")
            results["best"].append({"topology": topology, "device_kind": "?", "sp": sp,
                                    "fsdp": n // sp, "hbm_gib": None, "longest_shard_len": None,
                                    "longest_seq_len": None, "total_gib_at_best": None,
                                    "compiles": 0, "errors": [str(e).splitlines()[0][:200]]})
            save()
            continue
        if fits(L):
            best = L
            while _SWEEP_GROW.value and L * 2 <= hi_limit and fits(L * 2):
                L *= 2
                best = L
        else:
            while _SWEEP_SHRINK.value and L // 2 >= lo_limit:
                L //= 2
                if fits(L):
                    best = L
                    break
        ok = [p for p in tried.values() if "error" not in p]
        kind = ok[0]["device_kind"] if ok else "?"
        errors = sorted({p["error"] for p in tried.values() if "error" in p})
        results["best"].append({
            "topology": topology, "device_kind": kind, "sp": sp, "fsdp": n // sp,
            "hbm_gib": ok[0]["hbm_bytes"] / aot.GIB if ok else None,
            "longest_shard_len": best, "longest_seq_len": None if best is None else best * sp,
            "total_gib_at_best": None if best is None else tried[best]["total_bytes"] / aot.GIB,
            "compiles": len(tried), "errors": errors})
        save()
    return results


def _searches() -> list[tuple[str, int, int]]:
    """(topology, sp, first L) per search: --sweep_points, else every topology x sp from
    --sweep_start_shard."""
    if not _SWEEP_POINTS.value:
        return [(t, int(sp), _SWEEP_START.value) for t in _SWEEP_TOPOLOGIES.value for sp in _SWEEP_SP.value]
    searches = []
    for point in _SWEEP_POINTS.value:
        parts = point.split("/")
        if len(parts) != 3 or not (parts[1].isdigit() and parts[2].isdigit()):
            raise ConfigError(f"--sweep_points entry {point!r} is not topology/sp/L, e.g. v5p:4x4x4/16/131072.")
        searches.append((parts[0], int(parts[1]), int(parts[2])))
    return searches


def _model_line(config) -> str:
    m = config.model
    return (f"{m.num_layers} layers, d_model {m.d_model}, {m.num_heads} heads / {m.num_kv_heads} kv "
            f"heads x {m.head_dim}, mlp {m.mlp_dim}, vocab {m.vocab_size}{_block_text(config)}, {m.dtype} compute, "
            f"{m.param_dtype} params + AdamW, remat {m.remat_policy}, scan_layers {m.scan_layers}, "
            f"attention {config.attention.impl} (block {config.attention.block_size}, "
            f"layout {config.attention.layout}, causal {config.attention.causal}, "
            f"residuals {config.attention.get('residuals', 'save_qkv')}, "
            f"cp {config.attention.get('cp', 'ring')}"
            f"{'' if config.attention.get('cp_ulysses') is None else ' x' + str(config.attention.cp_ulysses)}"
            f"{_pattern_text(config)}), parameters over "
            f"{'x'.join(mesh_lib.split_axes('embed'))}, optimizer state over "
            f"{'x'.join(mesh_lib.split_axes('embed', config.optimizer.get('shard_state_over_dp', False)))}")


# How the Model line names a block option away from Llama's value (else "key value", or "key").
_BLOCK_WORDS = {("norm_position", "post"): "post-norms", ("norm_position", "sandwich"): "sandwich norms",
                ("norm_plus_one", True): "(1 + w) norms", ("mlp_activation", "gelu_tanh"): "GeGLU",
                ("scale_embeddings", True): "embeddings x sqrt(d_model)"}


def _block_text(config) -> str:
    """", qk_norm per_head, GeGLU, ..." for the block options (and final logit soft cap) a model
    sets away from Llama's, in block_options.DEFAULTS' order; "" for Llama's block."""
    options = block_options.options(config.model)
    parts = []
    for key, default in block_options.DEFAULTS.items():
        value = getattr(options, key)
        if value == default:
            continue
        plain = key if value is True else f"{key} {value:g}" if isinstance(value, float) else f"{key} {value}"
        parts.append(_BLOCK_WORDS.get((key, value), plain))
    if config.model.get("final_logits_soft_cap") is not None:
        parts.append(f"final logit soft cap {config.model.final_logits_soft_cap:g}")
    return "".join(f", {part}" for part in parts)


def _pattern_text(config) -> str:
    """", pattern local x5 (window 1024, cp halo) + global (...)" for a hybrid model, else ""."""
    if not layer_types.is_hybrid(config):
        return ""
    parts = []
    for name, repeats in itertools.groupby(layer_types.pattern(config.attention)):
        length = len(list(repeats))
        own = dict(config.attention.layer_types[name])
        keys = ", ".join(f"{k} {dict(v) if hasattr(v, 'items') else v}" for k, v in own.items()) or "attention.*"
        parts.append(f"{name}{' x' + str(length) if length > 1 else ''} ({keys})")
    return ", pattern " + " + ".join(parts)


def _save_sweep(out_stem: str, results: dict) -> None:
    """Writes the sweep so far (JSON + markdown): a long sweep keeps what it has if interrupted."""
    reports.write_json(out_stem + ".json", results)
    reports.write_markdown(out_stem + ".md", _sweep_markdown(results))


def _sweep_markdown(results) -> str:
    lines = ["# Longest sequence that fits, per chip type and sp\n",
             f"Generated by `{results['command']}`.\n",
             f"Model: {results['model']}. Mesh dp=1, fsdp=N/sp, sp; global batch = fsdp, so every "
             "chip holds one shard of L = S/sp tokens. Per-device memory from the TPU compiler "
             "(`memory_analysis()`, or the compiler's own out-of-HBM figure when it refuses), "
             "arguments + outputs - aliased + temporaries. "
             + ("L is searched in powers of two" if results.get("search", True) else
                "Each search is one compile at its first L (--nosweep_grow --nosweep_shrink): "
                "\"longest S\" is the S that was tried and fits, longer may fit too")
             + "; every row is a real compile of the full model, nothing is extrapolated.\n"]
    rows = []
    for b in results["best"]:
        rows.append([b["topology"], b["device_kind"], f"{b['hbm_gib']:.1f}" if b["hbm_gib"] else "-",
                     b["sp"], b["fsdp"],
                     b["longest_seq_len"] if b["longest_seq_len"] else "none tried fits",
                     b["longest_shard_len"] or "-",
                     f"{b['total_gib_at_best']:.1f}" if b["total_gib_at_best"] else "-",
                     b["compiles"], "; ".join(b["errors"])[:200] or ""])
    lines.append(reports.table(["topology", "chip", "HBM GiB/device", "sp", "fsdp", "longest S",
                           "L = S/sp", "GiB/device at that S", "compiles", "errors"], rows))
    lines.append("\n## Every compile\n")
    prow = []
    for p in results["points"]:
        if "error" in p:
            prow.append([p["topology"], p["sp"], p["shard_len"] * p["sp"], p["shard_len"], "-", "-",
                         "-", "error", "-"])
        else:
            g = lambda k: f"{p[k] / aot.GIB:.1f}"  # noqa: E731
            prow.append([p["topology"], p["sp"], p["seq_len"], p["shard_len"], g("argument_bytes"),
                         g("temp_bytes") + (" (compiler OOM)" if p["oom_at_compile"] else ""),
                         g("total_bytes"), "fits" if p["fits"] else "no",
                         f"{p['compile_seconds']:.0f}" if "compile_seconds" in p else "-"])
    lines.append(reports.table(["topology", "sp", "S", "L", "arguments GiB", "temporaries GiB",
                           "total GiB", "fits", "compile s"], prow))
    return "\n".join(lines) + "\n"


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    config = _CONFIG.value
    if _SWEEP.value:
        searches = _searches()
        if cli.validate_only():
            for topology, _, _ in searches:
                aot.topology_devices(topology)  # ValueError (one sentence) for an unknown one
            cli.validated(f"the sweep's {len(searches)} searches name known topologies")
        sweep(config, searches, _SWEEP_MIN.value, _SWEEP_MAX.value, _SWEEP_OUT.value)
        return
    if not _TOPOLOGY.value:
        raise ConfigError("give --topology (e.g. v5p:4x4x4) or --sweep.")
    if planner.auto_keys(config) and aot.libtpu_available():
        try:  # the report describes the config the planner chose
            resolution = auto.resolve(config, aot.topology_devices(_TOPOLOGY.value))
        except ValueError as e:  # a topology libtpu does not know
            raise ConfigError(str(e)) from None
        config = resolution.config
        print(f"estimate: {auto.describe(resolution)}", file=sys.stderr, flush=True)
    result = estimate(config, _TOPOLOGY.value, breakdown=_BREAKDOWN.value)
    if _JSON.value:
        print(json.dumps(result_dict(config, result), indent=1))
    else:
        print(aot.format_report(config, result))
        print(f"memory model {memory_model_bytes(config, result.mesh_shape) / aot.GIB:8.2f} GiB per device, the "
              "planner's estimate (longctx/plan/memory_model.py)")
        print(_communication_lines(config, result.mesh_shape))
    sys.exit(0 if result.fits in (True, None) else 1)


if __name__ == "__main__":
    cli.run_absl(main)
