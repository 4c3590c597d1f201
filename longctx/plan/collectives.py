"""Communication of attention over sp: bytes each device sends and receives, read from a program's
HLO and, beside it, in closed form per context-parallel strategy.

Read from the HLO (`hlo_traffic`): every collective of the program (all-gather, all-to-all,
collective-permute, reduce-scatter, all-reduce, their -start/-done async forms and collectives
inside async computations) with its result shape and its replica groups (group size G) or
source-target pairs. Bytes per device are those of a bandwidth-optimal algorithm:

  all-gather, all-to-all   (G - 1) / G x the result       (each device keeps its own 1/G)
  reduce-scatter           (G - 1) x the result           (the operand is G results)
  all-reduce               2 (G - 1) / G x the result     (reduce-scatter + all-gather)
  collective-permute       the result, if the device sends to (receives from) another device

sent = received for the first four; a permute counts the busiest device. Bytes are summed
over the program as it runs: loops (the ring's `lax.fori_loop`) count their body once per trip.
The trip count is XLA's own `known_trip_count` where the HLO carries it (compiled programs), else
read from the loop's condition the way jax lowers `fori_loop` / `scan` (a counter from a constant,
compared `<` with a constant, stepping by one); a loop whose count depends on data (the ring with
documents stops when no document reaches further) cannot be counted from the program: it counts
once and `unknown_loops` says how many such loops there were. For a bound, lower with
`skip_documents=False`: the same collectives over every run step of the static schedule, which is
what the ring with documents sends at most. A conditional counts its largest branch.

In closed form (`formula`): the same bytes from the shapes and the strategy's schedule (what
ops/ring.py, all_gather.py and ulysses.py send; tests/plan/test_collectives.py checks the two
agree), forward and backward, per layer (one attention call). The small per-call collectives of
document skipping (the ring's early stop: block ranges and one maximum) and of the sink gradient
are left out of the formula; the HLO count has them.
"""
from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from longctx.model import layer_types
from longctx.ops import context_parallel, halo, masks
from longctx.ops import ring as ring_lib
from longctx.ops import ulysses

KINDS = ("all-gather", "all-to-all", "collective-permute", "reduce-scatter", "all-reduce")

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2,
                "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
                "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_HEADER = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\))?\s*(?:->.*)?\{\s*$")
_CALLED = re.compile(r"\b(?:to_apply|calls|body|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


# ----------------------------------------------------------------------------- parsing HLO text

@dataclasses.dataclass
class _Instruction:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attributes: str


def _matching(text: str, start: int) -> int:
    """Index just past the bracket that closes text[start] ('(' or '{')."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    depth, close = 0, pairs[text[start]]
    for i in range(start, len(text)):
        if text[i] == text[start]:
            depth += 1
        elif text[i] == close:
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def _instruction(name: str, rest: str) -> _Instruction | None:
    """`shape opcode(operands), attributes` -> _Instruction (None for what is not one)."""
    rest = rest.strip()
    if rest.startswith("("):
        end = _matching(rest, 0)
    else:
        m = re.match(r"[^\s]+", rest)
        if m is None:
            return None
        end = m.end()
    shape, tail = rest[:end], rest[end:].lstrip()
    m = re.match(r"([\w\-]+)\(", tail)
    if m is None:
        return None
    close = _matching(tail, m.end() - 1)
    operands = [o.strip().split(" ")[-1].lstrip("%") for o in _split_top(tail[m.end():close - 1])]
    return _Instruction(name, shape, m.group(1), [o for o in operands if o], tail[close:])


def _split_top(text: str) -> list[str]:
    """Split on commas not inside brackets."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(text[start:i])
            start = i + 1
    out.append(text[start:])
    return out


def parse_computations(hlo_text: str) -> tuple[dict[str, dict[str, _Instruction]], str]:
    """({computation: {instruction name: _Instruction}} in program order, entry computation)."""
    computations, entry, current = {}, None, None
    for line in hlo_text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m and not line.lstrip().startswith("HloModule"):
                current = {}
                computations[m.group(2)] = current
                if m.group(1):
                    entry = m.group(2)
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTRUCTION.match(line)
        if m:
            inst = _instruction(m.group(1), m.group(2))
            if inst is not None:
                current[inst.name] = inst
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return computations, entry


def array_bytes(shape: str) -> int:
    """Bytes of every array in an HLO shape (a tuple's elements summed; layouts ignored)."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        if dtype not in _DTYPE_BYTES:
            continue
        n = 1
        for d in dims.split(","):
            if d:
                n *= int(d)
        total += n * _DTYPE_BYTES[dtype]
    return total


def _group_size(attributes: str, num_devices: int | None) -> int:
    m = re.search(r"replica_groups=\{\{([\d,\s]*)\}", attributes)
    if m:
        return len([x for x in m.group(1).split(",") if x.strip()])
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", attributes)  # iota form [groups, size]<=[...]
    if m:
        return int(m.group(2))
    if num_devices is None:
        raise ValueError(f"a collective without replica groups needs num_devices: {attributes[:120]}")
    return num_devices


def _permute_counts(attributes: str) -> tuple[int, int]:
    """(sends, receives) of the busiest device in source_target_pairs (self-pairs move nothing)."""
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", attributes)
    if not m:
        return 0, 0
    sends, receives = {}, {}
    for a, b in re.findall(r"\{?(\d+),(\d+)", m.group(1) + "}"):
        if a != b:
            sends[a] = sends.get(a, 0) + 1
            receives[b] = receives.get(b, 0) + 1
    return max(sends.values(), default=0), max(receives.values(), default=0)


# ----------------------------------------------------------------------------- traffic

@dataclasses.dataclass
class Traffic:
    """Bytes one device sends and receives, per collective kind, and how many collectives ran."""
    sent: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    received: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    count: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    unknown_loops: int = 0   # loops counted once: their trip count depends on data
    conditionals: int = 0    # conditionals holding collectives: their largest branch counted

    @property
    def total_sent(self) -> int:
        return sum(self.sent.values())

    @property
    def total_received(self) -> int:
        return sum(self.received.values())

    def scaled(self, k: int) -> Traffic:
        return Traffic({n: v * k for n, v in self.sent.items()},
                       {n: v * k for n, v in self.received.items()},
                       {n: v * k for n, v in self.count.items()}, self.unknown_loops,
                       self.conditionals)

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic({n: self.sent[n] + other.sent[n] for n in KINDS},
                       {n: self.received[n] + other.received[n] for n in KINDS},
                       {n: self.count[n] + other.count[n] for n in KINDS},
                       self.unknown_loops + other.unknown_loops,
                       self.conditionals + other.conditionals)

    def __sub__(self, other: Traffic) -> Traffic:
        return self + other.scaled(-1)

    def as_dict(self) -> dict:
        return {"sent_bytes": self.total_sent, "received_bytes": self.total_received,
                "sent_by_kind": {k: v for k, v in self.sent.items() if v},
                "received_by_kind": {k: v for k, v in self.received.items() if v},
                "collectives": {k: v for k, v in self.count.items() if v},
                "unknown_loops": self.unknown_loops, "conditionals": self.conditionals}


def _one(kind: str, shape: str, attributes: str, num_devices: int | None) -> Traffic:
    t = Traffic()
    result = array_bytes(shape)
    if kind == "collective-permute":
        sends, receives = _permute_counts(attributes)
        t.sent[kind], t.received[kind] = sends * result, receives * result
    else:
        g = _group_size(attributes, num_devices)
        share = {"all-gather": (g - 1) * result // g, "all-to-all": (g - 1) * result // g,
                 "reduce-scatter": (g - 1) * result,
                 "all-reduce": 2 * (g - 1) * result // g}[kind]
        t.sent[kind] = t.received[kind] = share
    t.count[kind] = 1
    return t


def _constant(inst: _Instruction | None) -> int | None:
    if inst is None or inst.opcode != "constant":
        return None
    m = re.fullmatch(r"\s*(-?\d+)\s*", inst.operands[0] if inst.operands else "")
    return int(m.group(1)) if m else None


def _trip_count(comps, caller, inst: _Instruction) -> int | None:
    """A while loop's trip count: XLA's known_trip_count, else the fori_loop pattern."""
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', inst.attributes)
    if m:
        return int(m.group(1))
    cond = re.search(r"condition=%?([\w.\-]+)", inst.attributes)
    body = re.search(r"body=%?([\w.\-]+)", inst.attributes)
    if not cond or not body or cond.group(1) not in comps:
        return None
    c = comps[cond.group(1)]
    root = list(c.values())[-1]
    if root.opcode != "compare" or "direction=LT" not in root.attributes or len(root.operands) != 2:
        return None
    counter, bound = (c.get(o) for o in root.operands)
    limit = _constant(bound)
    index = re.search(r"index=(\d+)", counter.attributes) if counter is not None else None
    if limit is None or counter.opcode != "get-tuple-element" or index is None:
        return None
    i = int(index.group(1))
    init = caller.get(inst.operands[0]) if inst.operands else None
    start = _constant(caller.get(init.operands[i])) if init is not None and init.opcode == "tuple" \
        and i < len(init.operands) else None
    # the body adds the constant 1 to the counter (jax's fori_loop and scan do)
    b = comps.get(body.group(1), {})
    b_root = list(b.values())[-1] if b else None
    if start is None or b_root is None or b_root.opcode != "tuple" or i >= len(b_root.operands):
        return None
    step = b.get(b_root.operands[i])
    if step is None or step.opcode != "add" or 1 not in [_constant(b.get(o)) for o in step.operands]:
        return None
    return max(0, limit - start)


def _traffic_of(comps, name: str, num_devices, memo) -> Traffic:
    if name in memo:
        return memo[name]
    memo[name] = Traffic()  # a cycle (none in HLO) would count nothing
    comp = comps.get(name, {})
    total = Traffic()
    for inst in comp.values():
        op = inst.opcode
        base = op[:-len("-done")] if op.endswith("-done") else op
        if base in KINDS and not op.endswith("-start"):
            # a -done carries the result; its -start (the operand) the groups or pairs
            start = comp.get(inst.operands[0]) if op.endswith("-done") and inst.operands else None
            attributes = inst.attributes if start is None else start.attributes
            total = total + _one(base, inst.shape, attributes, num_devices)
            continue
        if op == "while":
            body = re.search(r"body=%?([\w.\-]+)", inst.attributes).group(1)
            inner = _traffic_of(comps, body, num_devices, memo)
            trips = _trip_count(comps, comp, inst)
            if trips is None:
                if inner.total_sent or inner.total_received:
                    inner = dataclasses.replace(inner, unknown_loops=inner.unknown_loops + 1)
                total = total + inner
            else:
                total = total + inner.scaled(trips)
            continue
        branches = _BRANCHES.search(inst.attributes)
        called = ([b.strip().lstrip("%") for b in branches.group(1).split(",")] if branches else
                  [c for c in _CALLED.findall(inst.attributes) if op != "while"])
        if op == "conditional":
            options = [_traffic_of(comps, c, num_devices, memo) for c in called]
            busiest = max(options, key=lambda t: t.total_sent + t.total_received, default=Traffic())
            if busiest.total_sent or busiest.total_received:
                busiest = dataclasses.replace(busiest, conditionals=busiest.conditionals + 1)
            total = total + busiest
            continue
        for c in called:
            total = total + _traffic_of(comps, c, num_devices, memo)
    memo[name] = total
    return total


def hlo_traffic(hlo_text: str, num_devices: int | None = None) -> Traffic:
    """The bytes one device sends and receives when the program in `hlo_text` runs once (HLO
    text of a lowered or compiled program: `lowered.as_text(dialect="hlo")`,
    `compiled.as_text()`). `num_devices`: the group of a collective with no replica groups
    (else the module's num_partitions)."""
    if num_devices is None:
        m = re.search(r"num_partitions=(\d+)", hlo_text)
        num_devices = int(m.group(1)) if m else None
    comps, entry = parse_computations(hlo_text)
    return _traffic_of(comps, entry, num_devices, {})


def lowered_hlo(lowered) -> str:
    """The HLO text of a `jax.jit(...).lower(...)` result."""
    return lowered.as_text(dialect="hlo")


def attention_traffic(mesh, shape: Shape, strategy: str, degree: int | None = None,
                      **attention) -> dict[str, Traffic]:
    """{"forward", "backward"}: the traffic of one context_parallel_attention call, read from
    the lowered programs (nothing compiles or runs) of its forward (out and lse, which the
    backward keeps) and of forward + backward (jax.vjp), the backward being their difference.
    `mesh` has the axis "sp" of size shape.sp (any others of size 1); `attention`: the call's
    keywords (causal, sliding_window, impl, layout, block_sizes, skip_documents, ...)."""
    data = P(None, "sp")
    dtype = {2: jnp.bfloat16, 4: jnp.float32}[shape.dtype_bytes]
    kwargs = dict(attention, strategy=strategy, ulysses_degree=degree)

    def sharded(fn, out_specs):
        return jax.shard_map(fn, mesh=mesh, in_specs=(data, data, data, data if shape.documents
                                                      else None), out_specs=out_specs)

    def forward(q, k, v, seg):
        return sharded(lambda q, k, v, seg: context_parallel.context_parallel_forward(
            q, k, v, seg, **kwargs), (data, data))(q, k, v, seg)

    def forward_backward(q, k, v, seg, d_out):
        attend = sharded(lambda q, k, v, seg: context_parallel.context_parallel_attention(
            q, k, v, seg, **kwargs), data)
        out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, seg), q, k, v)
        return out, vjp(d_out)

    def arg(dims, dt):
        return jax.ShapeDtypeStruct(dims, dt, sharding=NamedSharding(mesh, data))

    b, s, n, kvh, h = shape.batch, shape.seq_len, shape.heads, shape.kv_heads, shape.head_dim
    q, kv = arg((b, s, n, h), dtype), arg((b, s, kvh, h), dtype)
    seg = arg((b, s), jnp.int32) if shape.documents else None
    fwd = hlo_traffic(lowered_hlo(jax.jit(forward).lower(q, kv, kv, seg)))
    both = hlo_traffic(lowered_hlo(jax.jit(forward_backward).lower(q, kv, kv, seg, q)))
    return {"forward": fwd, "backward": both - fwd}


# ----------------------------------------------------------------------------- closed form

@dataclasses.dataclass(frozen=True)
class Shape:
    """One attention call over sp: per device b x L = S/sp tokens of n heads (kv_heads K/V heads)
    of head_dim, `dtype_bytes` per element of Q, K, V, out (2: bf16); documents: int32 segment ids
    travel with K/V."""
    batch: int
    seq_len: int
    sp: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    documents: bool = False


def ring_run_steps(shape: Shape, *, causal=True, sliding_window=None, chunk_size=None,
                   layout="contiguous", block=512) -> tuple[int, ...]:
    """The ring steps the ring runs for a mask (ops/tables.py: steps empty on every device are
    not run, and K/V go no further than the last)."""
    return _config(shape, causal, sliding_window, chunk_size, layout, block).tables.run_steps


def usp_group_steps(shape: Shape, degree: int, *, causal=True, sliding_window=None,
                    chunk_size=None, layout="contiguous", block=512) -> tuple[int, ...]:
    """The steps of usp's ring of groups at which some group holds a pair the mask keeps."""
    return ulysses.group_steps(_config(shape, causal, sliding_window, chunk_size, layout, block),
                               degree)


@dataclasses.dataclass(frozen=True)
class TypeTraffic:
    """One layer type's attention traffic per device per layer, by strategy."""
    layers: int  # how many of the model's layers have this type
    chosen: str  # its own strategy, as labelled in `per_strategy` ("usp U=2")
    per_strategy: dict  # label -> {"forward", "backward"} bytes


def type_layers(config) -> list[tuple[layer_types.LayerType, int]]:
    """[(resolved layer type, how many of the model's layers have it)], in the period's order of
    first appearance (one ("default", num_layers) without a pattern, whose attention is
    config.attention itself: a plan prices thousands of candidates, and resolving copies)."""
    if not layer_types.is_hybrid(config):
        return [(layer_types.LayerType(layer_types.UNIFORM, config.attention, None), config.model.num_layers)]
    types = layer_types.period(config)
    counts: dict = {}
    for layer_type, count in zip(types, layer_types.layer_counts(config.model.num_layers, len(types))):
        counts[layer_type.name] = (layer_type, counts.get(layer_type.name, (None, 0))[1] + count)
    return list(counts.values())


def type_mask(attention, layout: str, seq_len: int, sp: int) -> dict:
    """The mask keywords `ring_run_steps`, `usp_group_steps` and `halo_exchanges` take for a
    type's attention config: with documents a chunk is the window of chunk - 1 keys it spans
    statically, as the kernels are given it; the block no longer than a shard."""
    a = attention
    spec = masks.make_mask_spec(a.causal, None if a.sliding_window is None else (a.sliding_window, 0),
                                a.chunk_size)
    if spec.chunk is not None and a.use_segment_ids:
        spec = masks.within_chunk_window(spec)
    return dict(causal=spec.causal, sliding_window=spec.window, chunk_size=spec.chunk, layout=layout,
                block=min(int(a.block_size), seq_len // sp))


def layer_type_traffic(config, *, sp: int, rows: int, layout: str) -> dict[str, TypeTraffic]:
    """{layer type name: TypeTraffic} of a model (one type, "default", without a pattern): every
    strategy the heads and sp allow, priced by `formula` on the type's mask in the run's `layout`
    (the ring's run steps, usp's group steps, halo's exchanges; `type_mask`), `rows` sequences
    per device, K/V in the compute dtype and, with documents, their segment ids."""
    m = config.model
    out = {}
    for layer_type, count in type_layers(config):
        a = layer_type.attention
        shape = Shape(batch=max(1, rows), seq_len=config.data.seq_len, sp=sp, heads=m.num_heads,
                      kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                      dtype_bytes=jnp.dtype(m.dtype).itemsize, documents=bool(a.use_segment_ids))
        mask = type_mask(a, layout, shape.seq_len, sp)
        per = {"ring": formula("ring", shape, steps=ring_run_steps(shape, **mask)),
               "all_gather": formula("all_gather", shape),
               "halo": formula("halo", shape, exchanges=halo_exchanges(shape, **mask))}
        if sp > 1 and m.num_heads % sp == 0:
            per["ulysses"] = formula("ulysses", shape)
        for u in range(2, sp):
            if sp % u == 0 and m.num_heads % u == 0:
                per[f"usp U={u}"] = formula("usp", shape, degree=u, steps=usp_group_steps(shape, u, **mask))
        cp = a.get("cp", "ring")
        out[layer_type.name] = TypeTraffic(count, f"usp U={a.get('cp_ulysses')}" if cp == "usp" else cp, per)
    return out


def step_bytes(config, *, sp: int, rows: int, layout: str) -> int | None:
    """K/V bytes one device sends in a training step (forward and backward, every layer, each by
    its type's own strategy); None where a type's strategy is not priced (cp=auto unresolved)."""
    total = 0
    for t in layer_type_traffic(config, sp=sp, rows=rows, layout=layout).values():
        if t.chosen not in t.per_strategy:
            return None
        total += t.layers * sum(t.per_strategy[t.chosen].values())
    return total


def halo_exchanges(shape: Shape, *, causal=True, sliding_window=None, chunk_size=None,
                   layout="contiguous", block=512):
    """What the halo strategy sends at each ring offset for a mask (ops/halo.py's plan)."""
    return halo.exchanges(_config(shape, causal, sliding_window, chunk_size, layout, block))


def _config(shape, causal, sliding_window, chunk_size, layout, block):
    spec = masks.make_mask_spec(causal, sliding_window, chunk_size)
    L = shape.seq_len // shape.sp
    block = min(block, L)
    return ring_lib.RingConfig(spec=spec, layout=layout, seq_len=shape.seq_len, sp=shape.sp,
                               bq=block, bkv=block, bkv_compute=block, bkv_dkv_compute=block,
                               impl="xla", soft_cap=None, scale=1.0, axis_name="sp",
                               interpret=False)


def _sends(steps, size: int) -> tuple[int, int]:
    """(sends, final distance) of a ring visiting `steps` (ascending) of a cycle of `size`: one
    send per step after the first, one more to jump a gap (ops/ring._ring_loop), none for 0."""
    sends, pos = 0, 0
    for s in steps:
        if (s - pos) % size:
            sends += 1
        pos = s
    return sends, pos


def formula(strategy: str, shape: Shape, *, degree: int | None = None, steps=None,
            exchanges=None) -> dict:
    """{"forward": bytes, "backward": bytes} one device sends (= receives) in one attention call.

    strategy: ring | all_gather | ulysses | usp | halo (degree U for usp; ulysses is U = sp).
    steps: the ring's run steps (ring) or the ring of groups' steps (usp); default every step
    (a causal or full mask; `ring_run_steps` / `usp_group_steps` give a window's fewer).
    exchanges: halo's (`halo_exchanges`: what each ring offset sends, from the mask)."""
    parts = formula_parts(strategy, shape, degree=degree, steps=steps, exchanges=exchanges)
    return {p: sum(kinds.values()) for p, kinds in parts.items()}


def formula_parts(strategy: str, shape: Shape, *, degree: int | None = None, steps=None,
                  exchanges=None) -> dict:
    """`formula`'s bytes by pass and by kind of collective: {"forward" | "backward": {"permute"
    (the ring's sends), "all_gather", "reduce_scatter", "all_to_all": bytes}}, the kinds the
    planner prices on different links and overlaps differently (plan/step_time.py)."""
    b, L, n, kvh, h, e = (shape.batch, shape.seq_len // shape.sp, shape.heads, shape.kv_heads,
                          shape.head_dim, shape.dtype_bytes)
    sp = shape.sp
    ids = 4 * b * L if shape.documents else 0
    kv, kv32 = b * L * kvh * h * e, b * L * kvh * h * 4  # one of K or V (dK or dV float32)
    if strategy == "ring":
        sends, last = _sends(range(sp) if steps is None else steps, sp)
        home = 1 if last % sp else 0  # dK, dV back to their owner: one send of the distance
        return {"forward": {"permute": sends * (2 * kv + ids)},
                "backward": {"permute": sends * (2 * kv + ids) + (sends + home) * 2 * kv32}}
    if strategy == "all_gather":
        gather = (sp - 1) * (2 * kv + ids)
        return {"forward": {"all_gather": gather},
                "backward": {"all_gather": gather, "reduce_scatter": (sp - 1) * 2 * kv32}}
    if strategy == "halo":
        # One permute per exchange, of its hull: K, V and ids (again in the backward), and in the
        # backward the hull's dK, dV (float32) back to their owners.
        tokens = sum(ex.stop - ex.start for ex in exchanges)
        per_token, per_token32 = (2 * kv + ids) // L, 2 * kv32 // L
        return {"forward": {"permute": tokens * per_token},
                "backward": {"permute": tokens * (per_token + per_token32)}}
    if strategy not in ("ulysses", "usp"):
        raise ValueError(f"strategy={strategy!r} is not one of ring, all_gather, ulysses, usp, halo")
    u = sp if strategy == "ulysses" else int(degree)
    groups = sp // u
    slots = ulysses.kv_head_slots(n, kvh, u).shape[1]  # K/V heads a device holds
    a2a = lambda x: (u - 1) * x // u  # noqa: E731  all-to-all of x bytes per device
    q, q32, row32 = b * L * n * h * e, b * L * n * h * 4, b * L * n * 4
    held, held32 = b * L * u * slots * h * e, b * L * u * slots * h * 4  # K (dK) slots sent
    gathers = 2 * (u - 1) * ids  # query and K/V segment ids of the group
    sends, last = _sends(range(groups) if steps is None else steps, groups)
    home = 1 if last % groups else 0
    travel = 2 * held + u * ids  # K, V slots of the group's U shards (+ their ids)
    return {"forward": {"all_to_all": a2a(q) + 2 * a2a(held) + a2a(q32) + a2a(row32),
                        "all_gather": gathers, "permute": sends * travel},
            "backward": {"all_to_all": (2 * a2a(q) + 2 * a2a(row32) + 2 * a2a(held)
                                        + a2a(q32) + 2 * a2a(held32)),
                         "all_gather": gathers,
                         "permute": sends * (travel + 2 * held32) + home * 2 * held32}}
