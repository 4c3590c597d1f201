"""Planning a run on TPU before renting one: the whole train step compiled ahead of time for a
TPU topology with its true memory (aot.py) and the per-layer memory model that explains it
(memory.py); the bytes each context-parallel strategy sends (collectives.py); and the planner that
ranks meshes, strategies and memory policies by a step-time model calibrated on published TPU
step times (hardware.py, attention_work.py, step_time.py, memory_model.py, calibration.py,
planner.py; auto.py applies its choice for attention.cp=auto). docs/planner.md.

Imports: longctx.train (aot.py, memory.py: they compile its step), longctx.model, longctx.ops,
longctx.parallel, longctx.config. Only scripts import it.
"""
