"""How the devices and the sequence are split: process start-up (devices.py), the (dp, fsdp, sp)
mesh and its logical axes (mesh.py), the order tokens take along the sp ring (layout.py; per row from its documents:
document_layout.py), and the
small host values the processes of a job agree on (processes.py).

Imports: jax, numpy and longctx.errors only. Everything else in longctx may import it.
"""
