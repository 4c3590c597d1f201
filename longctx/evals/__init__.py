"""What a model or a set of runs is measured by: a forward pass over packed rows with the run's
mesh and ring (inference.py), passkey retrieval on real text (needle.py), and the reports of a
grid of ablation runs (ablation.py).

Imports: longctx.train, longctx.interop, longctx.model, longctx.data, longctx.ops,
longctx.parallel, longctx.config. The train loop runs the passkey evaluator as a hook it is given.
"""
