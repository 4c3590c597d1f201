"""The splash ring (forward + backward, Mosaic kernels) compiles for a real TPU topology and fits.

With libtpu installed, `jax.experimental.topologies` gives abstract v5p devices; lowering the
ring on a mesh of them compiles the real TPU program on this CPU host (the Pallas kernels go
through Mosaic, not the interpreter) and `memory_analysis()` gives per-chip memory.
Size: 8 chips on the ring, 64K tokens, bf16, block 512, GQA 8/2 heads of 128, causal with
segment ids (blocks without a common document skipped per row) and sinks, layout "auto".
"""
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from longctx.ops import ring_attention
from longctx.plan import aot
from tests import exhaustive_only

pytestmark = [
    pytest.mark.tpu_aot,
    pytest.mark.skipif(not aot.libtpu_available(),
                       reason="libtpu is not installed (make test installs it via the [tpu] extra)"),
]


@pytest.mark.parametrize("batch", [  # 2 rows: a MaskInfo per row (documents differ by row)
    pytest.param(1, marks=exhaustive_only("one row's tables are the shared case of two rows' own")), 2])
def test_splash_ring_fwd_bwd_compiles_and_fits_on_v5p_2x2x2(batch):
    devices = aot.topology_devices("v5p:2x2x2")
    mesh = jax.sharding.Mesh(np.array(devices).reshape(1, 1, 8), ("dp", "fsdp", "sp"),
                             axis_types=(AxisType.Auto,) * 3)
    seq_len, heads, kv_heads, head_dim = 65536, 8, 2, 128
    data = P(("dp", "fsdp"), "sp")

    def attention(q, k, v, seg, sinks):
        return jax.shard_map(
            lambda q, k, v, seg, sinks: ring_attention(
                q, k, v, seg, None, sinks, causal=True, layout="auto", impl="splash",
                block_sizes=512),
            mesh=mesh, in_specs=(data, data, data, data, P()), out_specs=data)(q, k, v, seg, sinks)

    def loss(q, k, v, seg, sinks):
        return jnp.sum(attention(q, k, v, seg, sinks).astype(jnp.float32) ** 2)

    sds = lambda shape, dtype, spec: jax.ShapeDtypeStruct(shape, dtype,
                                                          sharding=NamedSharding(mesh, spec))
    args = (sds((batch, seq_len, heads, head_dim), jnp.bfloat16, data),
            sds((batch, seq_len, kv_heads, head_dim), jnp.bfloat16, data),
            sds((batch, seq_len, kv_heads, head_dim), jnp.bfloat16, data),
            sds((batch, seq_len), jnp.int32, data),
            sds((heads,), jnp.float32, P()))
    start = time.perf_counter()
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 4))).lower(*args).compile()
    seconds = time.perf_counter() - start

    hlo = compiled.as_text()
    # The kernels are real Mosaic custom calls (2 forward, 2 fused backward: each ring loop
    # body plus its last step), not the Pallas interpreter.
    assert hlo.count('custom_call_target="tpu_custom_call"') >= 4
    memory = compiled.memory_analysis()
    total = (memory.argument_size_in_bytes + memory.output_size_in_bytes
             - memory.alias_size_in_bytes + memory.temp_size_in_bytes)
    hbm = aot.HBM_BYTES_BY_CHIP[devices[0].device_kind]
    print(f"v5p:2x2x2 ring fwd+bwd, batch {batch}: compile {seconds:.1f}s, {total / 2**20:.0f} MiB per chip "
          f"of {hbm / 2**30:.0f} GiB")
    assert 0 < total <= hbm
