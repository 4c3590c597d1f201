"""Ulysses x ring (usp, "unified sequence parallelism") as a context-parallel strategy: Ulysses
inside groups of U neighbouring devices, the ring across the sp / U groups.

What it runs, its schedule and its price are ulysses.py's (`UlyssesGroups`), for U below sp: the
ring of groups passes K/V from device j to j + U (its permutes' stride on the sp ring's cycle,
which plan/links.py turns into links), one pass per step of the ring of groups that holds a pair
the mask keeps (ulysses.group_steps), and it holds two groups' K/V at once, one in flight.
"""
from __future__ import annotations

from longctx.ops import ulysses


class UlyssesRing(ulysses.UlyssesGroups):
    name = "usp"
    simplicity = 4
    takes_degree = True
    kv_buffers = 2  # the ring of groups' pass in flight

    @classmethod
    def candidates(cls, heads, sp):
        return [cls(u) for u in range(2, sp) if sp % u == 0 and heads % u == 0]

    @classmethod
    def config_problem(cls, heads, sp, degree, cp_key, degree_key):
        if degree is not None and degree >= 1 and sp % degree == 0 and heads % degree == 0:
            return None
        fits, degrees = ulysses.degrees_in_words(heads, sp)
        fix = (f"set {degree_key} to one of {degrees}" if fits else
               f"none above 1 does: use {cp_key}=ring or all_gather")
        return (f"{cp_key}=usp needs {degree_key} (now {degree}) dividing both sp={sp} "
                f"and model.num_heads={heads}: {fix}.")

    def ulysses_degree(self, sp):
        return int(self.degree)

    def steps_in_words(self, cfg):
        steps = ulysses.group_steps(cfg, self.ulysses_degree(cfg.sp))
        return f"{len(steps)} steps of the ring of groups"
