"""Two RULER tasks learned by a tiny model on CPU: docs/ruler_synthetic.{json,png}.

  .venv/bin/python benchmarks/bench_ruler.py                 # 1,000 steps, seed 0 (~10 min on 2 busy cores)
  .venv/bin/python benchmarks/bench_ruler.py --steps=300 --seed=1

benchmarks/ruler_synthetic.py's model (the tiny preset at d=128, 128-token rows over the 1x2x4 mesh,
ring over sp=4) trained with the real train_step on niah_single_1 and niah_multikey_2 samples,
then scored by longctx.evals.ruler.evaluate (what scripts/eval_ruler.py runs) on samples of another
seed: 4 per (task, length, depth) at 5 depths. Writes the result with the training time and the
untrained model's score beside it, and the task x length heatmap.
"""

from longctx import cli

cli.start()  # before jax is imported

import argparse  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402

import bench_common as bc  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
import ruler_synthetic as synthetic  # noqa: E402
from longctx import config as config_lib  # noqa: E402
from longctx.evals import ruler  # noqa: E402

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")


def main(argv=None) -> int:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=cli.int_at_least(1), default=1000, help="training steps")
    p.add_argument("--seed", type=cli.int_at_least(0), default=0, help="training seed (data and init)")
    p.add_argument("--out", default=DOCS, help="where ruler_synthetic.json and .png go")
    args = p.parse_args(argv)
    config = bc.base_config("tiny")
    config_lib.apply_overrides(config, {**synthetic.RULER_OVERRIDES, "train.num_steps": args.steps})
    cli.validated("the synthetic RULER run")
    untrained = synthetic.score(synthetic.untrained(config, args.seed))
    start = time.perf_counter()
    runner = synthetic.train(config, args.seed, {"xla_backend_optimization_level": 1})
    trained_s = time.perf_counter() - start
    result = synthetic.score(runner)
    result.update(steps=args.steps, training_seed=args.seed, train_seconds=round(trained_s, 1),
                  untrained_score=untrained["score"], untrained_mean_score=untrained["mean_score"],
                  tokenizer="benchmarks/ruler_synthetic.py:WordTokenizer",
                  command=f"benchmarks/bench_ruler.py --steps={args.steps} --seed={args.seed}")
    paths = ruler.write_results(result, args.out, title=f"RULER, tiny model after {args.steps} steps",
                                name="ruler_synthetic")
    print(f"bench_ruler: {args.steps} steps in {trained_s:.0f} s; score {result['score']} (untrained "
          f"{untrained['score']}); wrote {' and '.join(paths)}")
    return 0


if __name__ == "__main__":
    cli.run(main)
