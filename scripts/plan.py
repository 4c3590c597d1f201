"""How should I run this? The planner's ranked table for a config on a TPU slice.

  .venv/bin/python scripts/plan.py --config=configs/base.py:llama3_8b_128k --topology=v5p:4x4x4
  .venv/bin/python scripts/plan.py --config=configs/base.py:llama3_8b_128k --topology=v5p:4x4x4 \\
      --seq-len 2097152 --doc-lengths 8192,32768,2048 --json
  .venv/bin/python scripts/plan.py --config=configs/base.py:llama3_70b_128k --topology=v5p:8x8x8

Every valid mesh (dp x fsdp x sp), context-parallel strategy (ring, all_gather, ulysses, usp with
each Ulysses degree), layout, attention residual policy, remat policy and block size is priced by
the step-time model (longctx/plan/step_time.py, calibrated against published TPU step times:
docs/planner.md) and the memory model, ranked by predicted step time among those that fit; then
the best rows are compiled for the topology ahead of time (scripts/estimate.py, each in its own
process) for their true memory, until one fits or --compile rows were compiled. A compile is cached
under --cache by the config, the topology and longctx's source digest. Prints the table (step
time, tokens/s/chip, MFU, HBM per chip, exposed communication, what bounds the step) and why
each top row wins or loses against the first; `--json` prints one JSON object instead; `--png`
draws the top rows' predicted step-time breakdown.

The attention is priced on rows of one document each (the static mask) unless documents are
given: --doc-lengths (one row of these lengths repeated in order to fill it, laid out as given:
no packer places them) or --data (the first packed rows of a prepared dataset, as a run with
attention.layout=auto samples them, packed with the config's data.packer). Under
data.packer=shard_balanced, whose rows depend on sp and the block (it balances documents over the
sp shards by their work in blocks), each candidate is priced on the rows packed with its own sp
and attention.block_size, packed once per distinct pair; the other packers ignore both, and one
packing serves every candidate. The model, the data shape and everything not searched stay as
the config has them; --seq-len overrides data.seq_len.

`--config.attention.cp=auto` and `--config.attention.block_size=auto` in scripts/train.py and
estimate.py apply the same planner to a run at start-up (only the strategy, the mesh's -1 axes, the
block and attention.layout=auto are chosen, each where the config asks).
A long search (documents at millions of tokens) says how far it is on stderr every 10 s.
Exit status 0, or 2 with one line (`longctx: ...`) on bad input or where no candidate fits by
the memory model (the line names the nearest slice, sequence or batch that does).
"""

import os
import sys

# longctx from this checkout even without .venv, so that cli.start() can say in one line what is missing
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from longctx import cli  # noqa: E402

cli.start()  # before jax is imported

import copy  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402

from absl import flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from longctx import reports  # noqa: E402
from longctx.data import length_mixes  # noqa: E402
from longctx.data import pipeline as data_lib  # noqa: E402
from longctx.errors import ConfigError  # noqa: E402
from longctx.plan import aot, fit_remedy, hardware, planner, step_time  # noqa: E402  (aot: the source digest)

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/base.py:llama3_8b_128k.",
                                          lock_config=True)
_TOPOLOGY = flags.DEFINE_string("topology", None, "TPU slice, e.g. v5p:4x4x4, v5e:16x16, v6e:8x8.")
_SEQ_LEN = flags.DEFINE_integer("seq-len", None, "Tokens per sequence (overrides data.seq_len).",
                                 lower_bound=1)
_DOC_LENGTHS = flags.DEFINE_list("doc-lengths", [], "Document lengths that fill each row, repeated "
                                 "(laid out as given, not packed by data.packer).")
_DATA = flags.DEFINE_string("data", "", "A prepared dataset (scripts/prepare_data.py) whose packed rows "
                            "price the attention (packed with data.packer; shard_balanced's with "
                            "each candidate's sp and block).")
_TOP = flags.DEFINE_integer("top", 10, "Rows of the table: the best ways to split attention.",
                             lower_bound=1)
_COMPILE = flags.DEFINE_integer("compile", 1, "Compile the best rows ahead of time until one fits, at "
                                "most this many (0: none; each takes 1-10 minutes for an 8B model).",
                                lower_bound=0)
_CACHE = flags.DEFINE_string("cache", os.path.expanduser("~/.cache/longctx/plan"),
                             "Where compiles are kept.")
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object instead of the table.")
_PNG = flags.DEFINE_string("png", "", "Draw the top rows' predicted step-time breakdown here.")
_MD = flags.DEFINE_string("md", "", "Also write the table as a markdown page here, with this command.")
flags.mark_flags_as_required(["config", "topology"])

GIB = 2 ** 30
# The step's parts, as the breakdown and the reasons name them.
PARTS = {"matmul": "matmuls", "attention": "attention blocks", "optimizer": "optimizer update",
         "fsdp_exposed": "exposed FSDP gathers", "cp_exposed": "exposed context-parallel collectives",
         "dp_exposed": "exposed dp all-reduce"}


def _config(config):
    """The config to plan: --seq-len applied."""
    if _SEQ_LEN.value is None:
        return config
    c = copy.deepcopy(config)
    c.unlock()
    c.data.seq_len = _SEQ_LEN.value
    c.lock()
    return c


def _documents(config):
    """Segment ids [rows, S] to price the attention by, `(sp, block) -> [rows, S]` (--data: as
    each candidate's run packs them), or None (the static mask)."""
    if _DOC_LENGTHS.value and _DATA.value:
        raise ConfigError("give --doc-lengths or --data, not both.")
    if _DOC_LENGTHS.value:
        try:
            return length_mixes.segment_ids_of(_DOC_LENGTHS.value, config.data.seq_len)
        except ValueError:
            raise ConfigError(f"--doc-lengths {','.join(_DOC_LENGTHS.value)}: give positive "
                              "whole numbers of tokens.") from None
    if _DATA.value:
        if not os.path.isdir(_DATA.value):
            raise ConfigError(f"--data {_DATA.value}: no such directory (scripts/prepare_data.py writes one).")
        c = copy.deepcopy(config)
        c.unlock()
        c.data.path = _DATA.value
        try:
            packed = data_lib.PackedSample(c, data_lib.resolve_dataset(c))
        except (OSError, ValueError) as e:
            raise ConfigError(f"--data {_DATA.value}: {e}") from None

        def sample(sp: int, block: int):
            try:
                return packed(sp, block)
            except (OSError, ValueError) as e:
                raise ConfigError(f"--data {_DATA.value}: {e}") from None

        sample(1, planner.BLOCK_SIZES[0])  # read now: bad data fails before the plan says it is fine
        return sample
    return None


def reasons(rows) -> list[str]:
    """Why each row wins or loses against the first: its bound, and the part that differs most."""
    best = rows[0].step
    out = []
    for i, row in enumerate(rows):
        s = row.step
        share = max(PARTS, key=lambda p: getattr(s, p))
        text = (f"{s.bound}-bound: {PARTS[share]} {getattr(s, share) / s.seconds:.0%} of the step")
        if i:
            delta = {p: getattr(s, p) - getattr(best, p) for p in PARTS}
            worst = max(delta, key=delta.get)
            text += (f"; {s.seconds / best.seconds - 1:+.1%} vs #1, most from {PARTS[worst]} "
                     f"({delta[worst]:+.3g} s)")
        if not row.fits:
            text += (f"; does not fit: ~{row.held_bytes / GIB:.0f} GiB by the memory model, "
                     f"{planner.HBM_HEADROOM:.0%} of {row.hbm_bytes / GIB:.0f} allowed")
        if row.tie:
            fastest = min(r.step.seconds for r in rows if r.tie)
            text += (f"; a tie: {s.seconds / fastest - 1:+.1%} of the fastest tied row, within the "
                     f"model's held-out error ({step_time.HELD_OUT_ERROR:.0%}), so ranked by HBM "
                     f"headroom ({row.held_bytes / row.hbm_bytes:.0%} of HBM by the memory "
                     f"model), exposed communication ({s.exposed_communication:.3g} s) and the "
                     f"simpler strategy ({row.strategy})")
        out.append(text)
    return out


def _tie_note(top) -> str:
    """The heading's words on the tie rule, where the first rows are a tie."""
    tied = [i + 1 for i, r in enumerate(top) if r.tie]
    if len(tied) < 2:
        return ""
    return (f"; rows {', '.join(f'#{i}' for i in tied)} are a tie (predicted within "
            f"{step_time.HELD_OUT_ERROR:.0%} of each other, the model's held-out error): ranked by "
            f"memory headroom, exposed communication and the simpler strategy, not by time")


def _cache_path(row, topology: str) -> str:
    key = json.dumps({"config": row.config.to_dict(), "topology": topology,
                      "source": aot.source_digest()}, sort_keys=True, default=str)
    return os.path.join(_CACHE.value, hashlib.sha256(key.encode()).hexdigest()[:20] + ".json")


def _config_flags() -> list[str]:
    """This command's --config and --config.* flags, for estimate.py."""
    return [a for a in sys.argv[1:] if a.startswith("--config")]


def compile_row(row, topology: str) -> dict:
    """The row's whole train step compiled for the topology (scripts/estimate.py --nobreakdown, in
    its own process: a compiler that aborts takes only that process with it): HBM per chip,
    whether it fits, XLA's own cost analysis; or what went wrong."""
    path = _cache_path(row, topology)
    if os.path.exists(path):
        with open(path) as f:
            return {**json.load(f), "cached": True}
    seq = [] if _SEQ_LEN.value is None else [f"--config.data.seq_len={_SEQ_LEN.value}"]
    command = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "estimate.py"),
               *_config_flags(), *seq, *row.overrides(), f"--topology={topology}", "--nobreakdown",
               "--json"]
    print(f"plan: compiling {' '.join(row.overrides())} for {topology} "
          f"({aot.compile_duration(row.config)}) ...", file=sys.stderr, flush=True)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode in (0, 1):  # fits, does not fit
        r = json.loads(done.stdout)
        out = {"total_bytes": r["total_bytes"], "peak_bytes": r["peak_bytes"], "fits": r["fits"],
               "hbm_bytes": r["hbm_bytes"],
               "compile_seconds": r["compile_seconds"], "oom_at_compile": r["oom_at_compile"],
               "xla_flops_per_device": r.get("cost_flops"),
               "xla_bytes_accessed_per_device": r.get("cost_bytes_accessed")}
    else:  # the compiler refused or crashed: say how, in its own last line
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        why = next((line for line in lines if "Check failed" in line or line.startswith("longctx: ")),
                   lines[-1] if lines else f"exit status {done.returncode}")
        out = {"fits": False, "error": why.strip()[:300], "exit_status": done.returncode}
    os.makedirs(_CACHE.value, exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    return {**out, "cached": False}


def _table(rows, compiled: dict, why: list[str]) -> str:
    header = ["#", "mesh dp,fsdp,sp", "cp", "layout", "block", "residuals", "remat", "step s",
              "tokens/s/chip", "MFU (document FLOPs)", "HBM GiB (model)", "HBM GiB (AOT)",
              "exposed comm s", "bound"]
    body = []
    for i, r in enumerate(rows):
        s = r.step
        c = compiled.get(i)
        aot_text = ("" if c is None else f"compiler failed ({c['error'][:40]})" if "error" in c
                    else f"{c.get('peak_bytes', c['total_bytes']) / GIB:.1f} {'fits' if c['fits'] else 'NO'}")
        body.append([i + 1, f"{r.mesh['dp']},{r.mesh['fsdp']},{r.mesh['sp']}", str(r.strategy),
                     r.layout, r.block, r.residuals, r.remat, f"{s.seconds:.3g}",
                     f"{s.tokens_per_second_per_chip:,.0f}", f"{s.mfu:.1%}",
                     f"{r.held_bytes / GIB:.1f}{'' if r.fits else ' no'}", aot_text,
                     f"{s.exposed_communication:.3g}", s.bound])
    lines = [reports.table(header, body), ""]
    lines += [f"{i + 1}. {text}" for i, text in enumerate(why)]
    for i, c in sorted(compiled.items()):
        if c.get("xla_flops_per_device"):
            lines.append(f"\n#{i + 1} compiled: XLA's cost analysis counts {c['xla_flops_per_device']:.3g} "
                         f"FLOP per device per step, the model {rows[i].step.device_flops:.3g} (XLA "
                         f"counts the layer loop's body once and the Pallas kernels not at all); "
                         f"compile {c['compile_seconds']:.0f} s{' (cached)' if c.get('cached') else ''}.")
        elif "error" in c:
            lines.append(f"\n#{i + 1} did not compile: {c['error']}")
    return "\n".join(lines)


def draw(path: str, rows) -> None:
    """A stacked bar per row: the predicted step by part."""
    import matplotlib  # lazily: a plotting library only --png needs
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazily: as above

    fig, ax = plt.subplots(figsize=(9, 0.5 * len(rows) + 1.5))
    labels = [f"#{i + 1} {r.strategy} {r.layout} sp={r.mesh['sp']}" for i, r in enumerate(rows)]
    left = [0.0] * len(rows)
    for part, name in PARTS.items():
        values = [getattr(r.step, part) for r in rows]
        ax.barh(labels, values, left=left, label=name)
        left = [a + b for a, b in zip(left, values)]
    ax.invert_yaxis()
    ax.set_xlabel("predicted seconds per step")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    try:
        topology = hardware.parse_topology(_TOPOLOGY.value)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    config = _config(_CONFIG.value)
    documents = _documents(config)
    cli.validated(f"config, topology {topology.name} and documents are fine")
    rows = planner.plan(config, topology, segment_ids=documents,
                        progress=planner.progress_lines(sys.stderr))
    if not rows:
        raise ConfigError(f"no mesh, strategy and block of this config is valid on {topology.name} "
                          f"({topology.num_devices} devices): data.seq_len must divide by sp, "
                          f"data.global_batch_size by dp x fsdp and model.d_model by fsdp x sp for "
                          f"some split of the devices.")
    if not any(r.fits for r in rows):  # no run to recommend: say what would fit instead
        raise ConfigError(fit_remedy.why_nothing_fits(config, topology))
    top = planner.distinct(rows)[:_TOP.value]
    compiled = {}
    for i, row in enumerate(top[:_COMPILE.value]):
        compiled[i] = compile_row(row, topology.name)
        if compiled[i]["fits"]:
            break
    why = reasons(top)
    result = {"topology": topology.name, "chips": topology.num_chips, "devices": topology.num_devices, "candidates": len(rows),
              "fit_by_model": sum(r.fits for r in rows),
              "documents": None if documents is None else
              ("--doc-lengths " + ",".join(_DOC_LENGTHS.value) if _DOC_LENGTHS.value else f"--data {_DATA.value}"),
              "rows": [{**r.as_dict(), "why": w, "aot": compiled.get(i)}
                       for i, (r, w) in enumerate(zip(top, why))]}
    if _PNG.value:
        draw(_PNG.value, top)
    # MFU's numerator: what the documents need, as the step's attention is priced (step_time.py).
    flops_basis = ("of rows of one document" if documents is None else
                   "these documents need (attention within each document only)")
    heading = (f"{topology.name}: {len(rows)} candidates, {result['fit_by_model']} fit by the memory "
               f"model; the best {len(top)} ways to split attention (sp, strategy, layout: each with "
               f"its best dp x fsdp, block and policies) by predicted step time"
               f"{'' if documents is None else ', attention priced on ' + result['documents']}; "
               f"MFU counts the model FLOPs {flops_basis}"
               f"{_tie_note(top)}:")
    # The first row the compiler fits, where one was compiled; else the model's first.
    chosen = next((i for i, c in sorted(compiled.items()) if c.get("fits")), 0)
    text = (f"{heading}\n\n{_table(top, compiled, why)}\n\nrun #{chosen + 1}: "
            f"{' '.join(top[chosen].overrides())}")
    if _MD.value:
        reports.write_markdown(_MD.value, f"# Plan: {config.model.num_layers} layers, d_model "
                               f"{config.model.d_model}, {config.data.seq_len:,} tokens on {topology.name}\n\n"
                               f"Generated by `{reports.command_line()}` (`scripts/plan.py`, "
                               f"[planner.md](planner.md)).\n\n{text}\n")
    if _JSON.value:
        print(json.dumps(result, indent=1, default=str))
        return
    print(text)


if __name__ == "__main__":
    cli.run_absl(main)
