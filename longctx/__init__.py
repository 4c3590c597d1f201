"""longctx: long-context LLM pretraining in JAX with ring attention around the Pallas splash kernel.

Packages by job; imports go one way (errors <- parallel <- ops <- model, data <- config, cli,
reports <- train <- interop <- evals, plan <- scripts/, benchmarks/):
  parallel/  devices, the (dp, fsdp, sp) mesh, sequence layouts along the sp ring
  ops/       attention over sp: masks, block tables, ring_attention, its splash and xla backends
  model/     the decoder, its attention layer (the ring over the mesh), RoPE, FLOPs
  data/      prepare, tokenizers, packers, the Grain pipeline, per-process sharding
  train/     optimizer, state and shardings, step functions, the loop (train_and_evaluate and
             the evaluator hooks it is given), checkpoints, metrics, the workdir lease
  interop/   Hugging Face models in and out, parameter-only checkpoints
  evals/     inference outside training, passkey retrieval, ablation reports
  plan/      ahead-of-time TPU compiles on CPU and their memory breakdown
One step: data pipeline -> batch (laid out over sp) -> model -> ring attention -> loss ->
optimizer -> metrics and checkpoint. docs/architecture.md has the data flow in full and where to
add a mask, a context-parallel strategy, a packer or a model family.
"""

__version__ = "0.1.0"
