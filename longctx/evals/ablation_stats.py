"""The figures of an ablation's table that are more than one run's last line: mean and spread over
seeds, which variants lie within each other's spread, and the validation loss on the tokens a
variant's local layers cannot see (past its shortest window).

Spread is the sample standard deviation over seeds (n - 1 in the denominator; None for one seed).
Two variants are "within the spread" of each other when their mean validation losses differ by
less than the larger of their two standard deviations: the run does not tell them apart.
"""

from __future__ import annotations

import math
from typing import Sequence


def mean_std(values: Sequence[float | None]) -> tuple[float | None, float | None]:
    """(mean, sample standard deviation) of the values that are not None; std is None for fewer
    than two, both None for none."""
    present = [float(v) for v in values if v is not None]
    if not present:
        return None, None
    mean = sum(present) / len(present)
    if len(present) < 2:
        return mean, None
    return mean, math.sqrt(sum((v - mean) ** 2 for v in present) / (len(present) - 1))


def blind_from(sliding_windows: Sequence[int | None], chunk_sizes: Sequence[int | None]) -> int | None:
    """The first in-document position from which some layer cannot see its document's first
    token: a window of w sees back to p - w, so from p = w + 1 on; a chunk of c starts at a
    multiple of c, so from p = c on. None where no layer has a window or a chunk."""
    reach = [w + 1 for w in sliding_windows if w] + [c for c in chunk_sizes if c]
    return min(reach) if reach else None


def first_bucket_from(position: int, starts: Sequence[int]) -> int | None:
    """The first position bucket start (buckets [0, 1), [1, 3), [3, 7), ..., train/steps.py) at or
    after `position`: the buckets from there on hold only tokens at `position` or later. None if
    there is none."""
    return next((s for s in starts if s >= position), None)


def loss_from(start: int, starts: Sequence[int], losses: Sequence[float | None],
              tokens: Sequence[int]) -> float | None:
    """The validation loss on the tokens of the buckets starting at `start` or later, each bucket
    weighted by its tokens; None if they hold none."""
    total = count = 0.0
    for s, loss, n in zip(starts, losses, tokens):
        if s >= start and loss is not None and n:
            total += loss * n
            count += n
    return total / count if count else None


def within_spread(names: Sequence[str], means: Sequence[float | None],
                  stds: Sequence[float | None]) -> dict[str, list[str]]:
    """{variant: the other variants whose mean differs from its mean by less than the larger of
    the two standard deviations}; a variant without a mean or a spread has none."""
    close = {name: [] for name in names}
    for i, (a, mean_a, std_a) in enumerate(zip(names, means, stds)):
        for b, mean_b, std_b in list(zip(names, means, stds))[i + 1:]:
            if None in (mean_a, mean_b, std_a, std_b):
                continue
            if abs(mean_a - mean_b) < max(std_a, std_b):
                close[a].append(b)
                close[b].append(a)
    return close


def mean_curve(curves: Sequence[Sequence[tuple[int, float]]]) -> list[tuple[int, float, float, float]]:
    """(step, mean, min, max) over the runs at the steps every run logged."""
    if not curves:
        return []
    by_run = [dict(curve) for curve in curves]
    steps = sorted(set.intersection(*(set(run) for run in by_run)))
    return [(s, sum(run[s] for run in by_run) / len(by_run), min(run[s] for run in by_run),
             max(run[s] for run in by_run)) for s in steps]


def mean_lists(lists: Sequence[Sequence[float | None]]) -> list[float | None]:
    """Elementwise mean of equally long lists, over the entries that are not None."""
    return [mean_std(column)[0] for column in zip(*lists)]
