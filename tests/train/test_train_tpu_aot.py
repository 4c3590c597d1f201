"""The whole train step (model, ring-splash kernel, optimizer) compiles for a real TPU topology."""

import pytest

from configs import base
from longctx.plan import aot

pytestmark = [
    pytest.mark.tpu_aot,
    pytest.mark.skipif(not aot.libtpu_available(),
                       reason="libtpu is not installed (make test installs it via the [tpu] extra)"),
]


def test_train_step_compiles_and_fits_on_v5p():
    c = base.get_config("tiny")
    c.unlock()
    c.model.update(dtype="bfloat16")
    c.attention.update(impl="splash", layout="auto", block_size=256)
    c.data.update(seq_len=8192, global_batch_size=2)
    c.mesh.update(dp=1, fsdp=2, sp=4)
    result = aot.compile_train_step(c, "v5p:2x2x2")
    assert result.device_kind.startswith("TPU v5")
    assert result.num_devices == 8
    assert result.hbm_bytes is not None and result.fits
    # the params + Adam state of ~1.3M float32 parameters are really there, sharded over fsdp=2
    assert result.argument_bytes > 0 and result.temp_bytes > 0
