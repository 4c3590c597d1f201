"""Planning a run on TPU before renting one: the whole train step compiled ahead of time for a
TPU topology with its true memory (aot.py) and the per-layer memory model that explains it
(memory.py).

Imports: longctx.train, longctx.model, longctx.parallel, longctx.config. Only scripts import it.
"""
