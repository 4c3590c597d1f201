"""Each strategy's account of what overlaps (ops/strategy.py: a Transfer `under_blocks` hides behind
the pass's blocks in plan/step_time.py) against its program: a collective can run under a kernel
call only if neither waits for the other. Read from the traced program (jax.make_jaxpr, nothing
compiles or runs), one loop iteration at a time: the ring sends the next step's K/V while this
step's blocks compute; the halo stacks every received hull before its one loop of kernel calls and
sends the dK/dV hulls home after it, so no call can run beside a permute, and its account must say
so."""
import jax
import jax.numpy as jnp
import pytest
from jax.extend import core as jax_core
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from longctx.ops import context_parallel
from longctx.plan import collectives

SEQ_LEN, SP, HEADS, HEAD_DIM, BLOCK = 1024, 4, 4, 128, 128

# The collectives of each Transfer kind, as jax's primitives name them.
PRIMITIVES = {"ppermute": "permute", "all_gather": "all_gather", "all_to_all": "all_to_all",
              "reduce_scatter": "reduce_scatter"}
KERNEL = "pallas_call"


class _Graph:
    """The kernel calls and collectives of a jaxpr, each with the calls and collectives it waits for
    (its ancestors), inside loops per iteration (a loop body's inputs are its carry, not what the
    iteration before sent)."""

    def __init__(self, closed):
        self.kernels, self.collectives = {}, {}  # id -> ancestors; id -> (kind, ancestors)
        self._walk(closed.jaxpr, [frozenset()] * len(closed.jaxpr.invars))

    def _walk(self, jaxpr, inputs):
        deps = dict(zip(jaxpr.invars, inputs))
        read = lambda v: frozenset() if isinstance(v, jax_core.Literal) else deps.get(v, frozenset())  # noqa: E731
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            before = frozenset().union(*ins)
            outs = self._eqn(eqn, ins, before)
            for v, d in zip(eqn.outvars, outs):
                deps[v] = d
        return [read(v) for v in jaxpr.outvars]

    def _eqn(self, eqn, ins, before):
        name, p = eqn.primitive.name, eqn.params
        if name == KERNEL or name in PRIMITIVES:
            node = len(self.kernels) + len(self.collectives)
            if name == KERNEL:
                self.kernels[node] = before
            else:
                self.collectives[node] = (PRIMITIVES[name], before)
            return [before | {node}] * len(eqn.outvars)
        if name == "scan":
            body = self._walk(p["jaxpr"].jaxpr, ins)
            return [before | d for d in body]
        if name == "while":
            body = self._walk(p["body_jaxpr"].jaxpr, ins[p["cond_nconsts"]:])
            return [before | d for d in body]
        if name == "cond":
            outs = [self._walk(branch.jaxpr, ins[1:]) for branch in p["branches"]]
            return [ins[0].union(*column) for column in zip(*outs)]
        inner = [getattr(v, "jaxpr", v) for v in p.values()]
        inner = [j for j in inner if hasattr(j, "eqns")]
        if len(inner) == 1:
            sub = inner[0]
            if len(sub.invars) == len(ins):
                return self._walk(sub, ins)
        return [before] * len(eqn.outvars)

    def overlaps(self, kind: str) -> bool:
        """Whether some collective of `kind` and some kernel call wait for neither."""
        return any(k == kind and node not in kernel and call not in ancestors
                   for node, (k, ancestors) in self.collectives.items()
                   for call, kernel in self.kernels.items())


def _programs(chosen):
    """{"forward", "backward"}: the traced programs of one attention call (causal, no documents)."""
    mesh = jax.make_mesh((SP,), ("sp",))
    data = P(None, "sp")
    kw = dict(strategy=chosen.name, ulysses_degree=chosen.degree, causal=True, impl="splash",
              block_sizes=BLOCK, layout="contiguous")
    x = jax.ShapeDtypeStruct((1, SEQ_LEN, HEADS, HEAD_DIM), jnp.float32,
                             sharding=NamedSharding(mesh, data))
    lse = jax.ShapeDtypeStruct((1, SEQ_LEN, HEADS), jnp.float32, sharding=NamedSharding(mesh, data))

    def forward(q, k, v):
        return jax.shard_map(lambda q, k, v: context_parallel.context_parallel_forward(q, k, v, **kw),
                             mesh=mesh, in_specs=(data,) * 3, out_specs=(data, data))(q, k, v)

    def backward(q, k, v, out, lse, d_out):
        return jax.shard_map(
            lambda *a: context_parallel.context_parallel_backward(*a, **kw)[:3],
            mesh=mesh, in_specs=(data,) * 6, out_specs=(data,) * 3)(q, k, v, out, lse, d_out)

    return {"forward": jax.make_jaxpr(forward)(x, x, x),
            "backward": jax.make_jaxpr(backward)(x, x, x, x, lse, x)}


@pytest.mark.parametrize("chosen", context_parallel.candidates(HEADS, SP), ids=str)
def test_what_the_account_hides_behind_the_blocks_can_run_beside_them(chosen):
    shape = collectives.Shape(batch=1, seq_len=SEQ_LEN, sp=SP, heads=HEADS, kv_heads=HEADS,
                              head_dim=HEAD_DIM, dtype_bytes=4)
    transfers = chosen.transfers(shape, collectives.layer_config(shape, block=BLOCK))
    for part, program in _programs(chosen).items():
        graph = _Graph(program)
        assert graph.kernels, part
        for t in transfers[part]:
            if t.under_blocks and t.sent:
                assert graph.overlaps(t.kind), (str(chosen), part, t.kind)


def test_the_ring_overlaps_and_the_halo_does_not():
    """The reading itself: the ring's permutes run beside its blocks, the halo's never do."""
    ring, halo = context_parallel.named("ring"), context_parallel.named("halo")
    for part, program in _programs(ring).items():
        assert _Graph(program).overlaps("permute"), part
    for part, program in _programs(halo).items():
        graph = _Graph(program)
        assert graph.collectives and not graph.overlaps("permute"), part
