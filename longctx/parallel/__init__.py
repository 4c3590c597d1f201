"""How the devices and the sequence are split: process start-up (devices.py), the (dp, fsdp, sp)
mesh and its logical axes (mesh.py), and the order tokens take along the sp ring (layout.py).

Imports: jax, numpy and longctx.errors only. Everything else in longctx may import it.
"""
