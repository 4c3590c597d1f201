"""Validation per source: a mixture (data.sources) evaluates each source's validation split apart.

`evaluate_sources` returns what `steps.evaluate` returns for a one-source run; for a mixture, each
source's `loss` and `loss_by_position` under `<name>/` (metrics.jsonl: `val/<name>/loss`), and as
`loss` the sum of the sources' losses weighted by the mixture's weights: the loss the training
mix of tokens would have. Each source is evaluated on `train.eval_steps` batches of its own.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from longctx.data import mixture
from longctx.train.steps import evaluate


def evaluate_sources(config, eval_step, params, make_iterator: Callable) -> dict:
    """`make_iterator(source)` builds one source's validation iterator (source None: data.path)."""
    sources = mixture.sources(config)
    if not sources:
        return evaluate(config, eval_step, params, lambda: make_iterator(None))
    out, weighted, by_position = {}, 0.0, []
    for s in sources:
        val = evaluate(config, eval_step, params, lambda name=s.name: make_iterator(name))
        if not val:
            return {}
        out.update({f"{s.name}/{k}": v for k, v in val.items() if k != "position_bucket_starts"})
        weighted += s.weight * val["loss"]
        by_position.append((s.weight, val["loss_by_position"]))
        out["position_bucket_starts"] = val["position_bucket_starts"]
    out["loss"] = weighted
    out["loss_by_position"] = _weighted_by_position(by_position)
    return out


def _weighted_by_position(per_source: list[tuple[float, list]]) -> list:
    """The weighted mean of the sources' losses at each position bucket, over the sources that
    reach it (None where none does)."""
    out = []
    for values in zip(*(v for _, v in per_source)):
        pairs = [(w, x) for (w, _), x in zip(per_source, values) if x is not None]
        total = sum(w for w, _ in pairs)
        out.append(float(np.sum([w * x for w, x in pairs]) / total) if pairs else None)
    return out


def describe(val: dict) -> str:
    """'val_loss=2.3456' and, for a mixture, ' (code 2.1000, books 2.6000)'."""
    per = [f"{key[:-len('/loss')]} {value:.4f}" for key, value in val.items() if key.endswith("/loss")]
    return f"val_loss={val['loss']:.4f}" + (f" ({', '.join(per)})" if per else "")
