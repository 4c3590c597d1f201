"""Each context-parallel strategy (forward + backward, Mosaic kernels) compiles for v5p:2x2x2 at
65,536 tokens and fits (the ring also for TPU7x, tpu7x:2x2x1), as the ring does (tests/ops/test_ring_tpu_aot.py: the same shapes, 8
chips on sp, bf16, block 512, GQA 8/2 heads of 128, causal with documents and sinks).
Ulysses over 8 chips sends each of the 2 KV heads to 4 of them."""
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from longctx.ops import context_parallel
from longctx.plan import aot
from tests import exhaustive_only

pytestmark = [
    pytest.mark.tpu_aot,
    pytest.mark.skipif(not aot.libtpu_available(),
                       reason="libtpu is not installed (make test installs it via the [tpu] extra)"),
]

SEQ_LEN, HEADS, KV_HEADS, HEAD_DIM = 65536, 8, 2, 128


def _compile(strategy, degree, topology="v5p:2x2x2"):
    devices = aot.topology_devices(topology)
    mesh = jax.sharding.Mesh(np.array(devices).reshape(1, 1, 8), ("dp", "fsdp", "sp"),
                             axis_types=(AxisType.Auto,) * 3)
    data = P(("dp", "fsdp"), "sp")

    def attention(q, k, v, seg, sinks):
        return jax.shard_map(
            lambda q, k, v, seg, sinks: context_parallel.context_parallel_attention(
                q, k, v, seg, None, sinks, causal=True, layout="auto", impl="splash",
                block_sizes=512, strategy=strategy, ulysses_degree=degree),
            mesh=mesh, in_specs=(data, data, data, data, P()), out_specs=data)(q, k, v, seg, sinks)

    def loss(q, k, v, seg, sinks):
        return jnp.sum(attention(q, k, v, seg, sinks).astype(jnp.float32) ** 2)

    sds = lambda shape, dtype, spec: jax.ShapeDtypeStruct(shape, dtype,  # noqa: E731
                                                          sharding=NamedSharding(mesh, spec))
    args = (sds((1, SEQ_LEN, HEADS, HEAD_DIM), jnp.bfloat16, data),
            sds((1, SEQ_LEN, KV_HEADS, HEAD_DIM), jnp.bfloat16, data),
            sds((1, SEQ_LEN, KV_HEADS, HEAD_DIM), jnp.bfloat16, data),
            sds((1, SEQ_LEN), jnp.int32, data),
            sds((HEADS,), jnp.float32, P()))
    start = time.perf_counter()
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 4))).lower(*args).compile()
    hbm = aot.HBM_BYTES_BY_CHIP[devices[0].device_kind] // aot.cores_per_chip(devices)
    return compiled, time.perf_counter() - start, hbm


@pytest.mark.parametrize("strategy,degree", [
    ("all_gather", None),
    pytest.param("ulysses", None, marks=exhaustive_only("usp x2 compiles Ulysses' all-to-all")),
    ("usp", 2)])
def test_strategy_fwd_bwd_compiles_and_fits_on_v5p_2x2x2(strategy, degree):
    compiled, seconds, hbm = _compile(strategy, degree)
    hlo = compiled.as_text()
    assert 'custom_call_target="tpu_custom_call"' in hlo  # Mosaic kernels, not the interpreter
    memory = compiled.memory_analysis()
    total = (memory.argument_size_in_bytes + memory.output_size_in_bytes
             - memory.alias_size_in_bytes + memory.temp_size_in_bytes)
    print(f"v5p:2x2x2 {strategy} fwd+bwd: compile {seconds:.1f}s, {total / 2**20:.0f} MiB per chip "
          f"of {hbm / 2**30:.0f} GiB")
    assert 0 < total <= hbm


def test_the_ring_fwd_bwd_compiles_and_fits_on_tpu7x_2x2x1():
    """Ironwood: 8 devices on 4 chips (a TensorCore each, 96 GiB of the chip's 192), the same shapes."""
    compiled, seconds, hbm = _compile("ring", None, "tpu7x:2x2x1")
    assert 'custom_call_target="tpu_custom_call"' in compiled.as_text()
    memory = compiled.memory_analysis()
    total = (memory.argument_size_in_bytes + memory.output_size_in_bytes
             - memory.alias_size_in_bytes + memory.temp_size_in_bytes)
    print(f"tpu7x:2x2x1 ring fwd+bwd: compile {seconds:.1f}s, {total / 2**20:.0f} MiB per device")
    assert hbm == 96 * 2 ** 30 and 0 < total <= hbm
