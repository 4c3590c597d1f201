"""`jit`: jax.jit for the tests' own programs that run for well under a second, compiled with LLVM
at level 0 instead of the suite's level 1 (tests/conftest.py).

Level 0 compiled the ring's forward + VJP (tests/ops/test_ring_attention.py) about a third faster
and runs a program about half as fast again: a win where compiling is nearly all of a test's time,
a loss for a program that runs for seconds (the needle test's 200 training steps), so the suite
keeps level 1 and only programs like these ask for level 0. Without fast-math (off on XLA's CPU
backend) every level keeps IEEE semantics; no tolerance is loosened for it.
"""

import functools

import jax

jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})
