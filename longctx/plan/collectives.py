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

In closed form (`formula`): the same bytes from the shapes and the strategy's own account of
what it sends (its `transfers`, ops/strategy.py; tests/plan/test_collectives.py checks the two
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

from longctx.model import attention as attention_lib
from longctx.model import layer_types
from longctx.ops import context_parallel, halo, masks
from longctx.ops import ring as ring_lib
from longctx.ops.strategy import Shape

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
# What each strategy sends is its own account (ops/strategy.py `transfers`, in the strategy's
# module); here it is read per layer type of a config, by kind and by pass.

def layer_config(shape: Shape, *, causal=True, sliding_window=None, chunk_size=None,
                 layout="contiguous", block=512) -> ring_lib.RingConfig:
    """The static configuration of one attention call of `shape` with a mask, as the strategies'
    prices take it (no device is needed: the host tables of the mask, layout and blocks)."""
    spec = masks.make_mask_spec(causal, sliding_window, chunk_size)
    block = min(block, shape.shard_len)
    return ring_lib.RingConfig(spec=spec, layout=layout, seq_len=shape.seq_len, sp=shape.sp,
                               bq=block, bkv=block, bkv_compute=block, bkv_dkv_compute=block,
                               impl="xla", soft_cap=None, scale=1.0, axis_name="sp",
                               interpret=False)


def ring_run_steps(shape: Shape, **mask) -> tuple[int, ...]:
    """The ring steps the ring runs for a mask (ops/tables.py: steps empty on every device are
    not run, and K/V go no further than the last)."""
    return layer_config(shape, **mask).tables.run_steps


def halo_exchanges(shape: Shape, **mask):
    """What the halo strategy sends at each ring offset for a mask (ops/halo.py's plan)."""
    return halo.exchanges(layer_config(shape, **mask))


def by_kind(transfers: dict) -> dict:
    """{"forward" | "backward": {kind: bytes}} of a strategy's `transfers`."""
    out = {}
    for p, parts in transfers.items():
        out[p] = {}
        for t in parts:
            out[p][t.kind] = out[p].get(t.kind, 0) + t.sent
    return out


def formula_parts(strategy: str, shape: Shape, *, degree: int | None = None, steps=None,
                  **mask) -> dict:
    """The bytes one device sends (= receives) in one attention call by pass and by kind of
    collective: {"forward" | "backward": {"permute" (the ring's sends), "all_gather",
    "reduce_scatter", "all_to_all": bytes}}, the kinds the planner prices on different links
    and overlaps differently (plan/step_time.py).

    strategy: one of ops.context_parallel.STRATEGIES (degree U for usp); the mask keywords
    (causal, sliding_window, chunk_size, layout, block: `layer_config`) decide the ring's run
    steps, usp's ring of groups' steps and halo's exchanges; `steps`: the steps K/V visit
    where documents stop them earlier (default: those the mask runs)."""
    chosen = context_parallel.named(strategy, degree)
    return by_kind(chosen.transfers(shape, layer_config(shape, **mask), steps))


def per_pass(parts: dict) -> dict:
    """{"forward": bytes, "backward": bytes} of `formula_parts`' (or `by_kind`'s) bytes by kind."""
    return {p: sum(kinds.values()) for p, kinds in parts.items()}


def formula(strategy: str, shape: Shape, **kwargs) -> dict:
    """{"forward": bytes, "backward": bytes} one device sends (= receives) in one attention call
    (`formula_parts`' arguments)."""
    return per_pass(formula_parts(strategy, shape, **kwargs))


@dataclasses.dataclass(frozen=True)
class TypeTraffic:
    """One layer type's attention traffic per device per layer, by strategy."""
    layers: int  # how many of the model's layers have this type
    chosen: str  # its own strategy, as labelled in `per_strategy` ("usp U=2")
    per_strategy: dict  # label -> {"forward", "backward"} bytes


def label(chosen) -> str:
    """A strategy as `TypeTraffic` and the reports name it: "ring", "usp U=2"."""
    return chosen.name if chosen.degree is None else f"{chosen.name} U={chosen.degree}"


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
    """The mask keywords `layer_config` takes for a type's attention config: with documents a
    chunk is the window of chunk - 1 keys it spans statically, as the kernels are given it; the
    block no longer than a shard."""
    a = attention
    spec = masks.make_mask_spec(a.causal, None if a.sliding_window is None else (a.sliding_window, 0),
                                a.chunk_size)
    if spec.chunk is not None and a.use_segment_ids:
        spec = masks.within_chunk_window(spec)
    return dict(causal=spec.causal, sliding_window=spec.window, chunk_size=spec.chunk, layout=layout,
                block=min(int(a.block_size), seq_len // sp))


def type_shape(config, attention, sp: int, rows: int) -> Shape:
    """The Shape of one of a type's attention calls: `rows` sequences per device, the model's
    heads, K/V in the compute dtype and, with documents, their segment ids."""
    m = config.model
    return Shape(batch=rows, seq_len=config.data.seq_len, sp=sp, heads=m.num_heads,
                 kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                 dtype_bytes=jnp.dtype(m.dtype).itemsize, documents=bool(attention.use_segment_ids))


def type_config(attention, shape: Shape, layout: str) -> ring_lib.RingConfig:
    """`layer_config` of a type's attention config in the run's `layout`."""
    return layer_config(shape, **type_mask(attention, layout, shape.seq_len, shape.sp))


def layer_type_traffic(config, *, sp: int, rows: int, layout: str) -> dict[str, TypeTraffic]:
    """{layer type name: TypeTraffic} of a model (one type, "default", without a pattern): every
    strategy the heads and sp allow (ops.context_parallel.candidates), priced on the type's mask
    in the run's `layout` (`type_config`), `rows` sequences per device."""
    out = {}
    for layer_type, count in type_layers(config):
        a = layer_type.attention
        shape = type_shape(config, a, sp, max(1, rows))
        cfg = type_config(a, shape, layout)
        per = {label(s): per_pass(by_kind(s.transfers(shape, cfg)))
               for s in context_parallel.candidates(config.model.num_heads, sp)}
        # a strategy the registry does not name (cp=auto, unresolved) is not priced
        own = attention_lib.cp_name(a)
        chosen = label(attention_lib.strategy_of(a)) if own in context_parallel.REGISTRY else own
        out[layer_type.name] = TypeTraffic(count, chosen, per)
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
