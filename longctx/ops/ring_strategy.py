"""The ring as a context-parallel strategy: K/V pass around the sp devices, one hop per step.

What it runs is ring.py's (`forward`, `backward`: the ppermute schedule, the float32 merge, the
backward ring carrying dK/dV home), beside the machinery every strategy shares. Here: its
schedule and its price.

Schedule: device a computes its pairs one ring step at a time, and every step waits for the
busiest device, since the K/V pass on together. Price: K, V (and their segment ids) sent once per
step it travels, again in the backward with dK, dV (float32) travelling beside them, and one
send of the distance home; each send is issued before the step's blocks compute (ring.py
`_ring_loop`), so it hides behind them. Working memory: K, V in flight (two buffers) and dK, dV
float32 travelling with them.
"""
from __future__ import annotations

from longctx.ops import ring, strategy, strategy_schedule


class Ring(strategy.AnyHeads, strategy.Strategy):
    name = "ring"
    simplicity = 0

    forward = staticmethod(ring.forward)
    backward = staticmethod(ring.backward)

    def from_step_blocks(self, per_step, ring_critical_path, kept, ring_steps, static_pairs):
        return strategy_schedule.StrategySchedule(self.name, 1, per_step.astype(float),
                                                  ring_critical_path, kept, ring_steps)

    def dead_grid_steps(self, live):
        nq = live.shape[2]
        rows = live.sum(axis=3)                      # [a, s, q block]: live kv blocks of each row
        cols = live.sum(axis=2)                      # [a, s, kv block]: live q blocks of each column
        step_blocks = rows.sum(axis=2)               # [a, s]
        run = step_blocks.any(axis=0)
        critical = step_blocks.max(axis=0)[run]
        # one call per ring step, its grid sized by the busiest row (column) of any device
        return (float((nq * rows.max(axis=(0, 2))[run] - critical).sum()),
                float((nq * cols.max(axis=(0, 2))[run] - critical).sum()))

    def steps_in_words(self, cfg):
        return f"{len(cfg.tables.run_steps)} ring steps"

    def transfers(self, shape, cfg, steps=None):
        steps = cfg.tables.run_steps if steps is None else steps
        sends, last = strategy.ring_sends(steps, shape.sp)
        home = 1 if last % shape.sp else 0  # dK, dV back to their owner: one send of the distance
        travel = 2 * shape.kv_bytes + shape.ids_bytes
        calls = max(1, len(steps))

        def permute(sent):
            return (strategy.Transfer("permute", sent, calls, 2, under_blocks=True),)

        return {"forward": permute(sends * travel),
                "backward": permute(sends * travel + (sends + home) * 2 * shape.kv32_bytes)}

    def kernel_calls(self, cfg, travelled):
        return max(1.0, float(travelled))

    def working_bytes(self, shape, cfg):
        return 2 * (2 * shape.kv_bytes + 2 * shape.kv32_bytes)
