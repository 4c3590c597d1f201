"""What a TPU chip's runtime holds for a compiled train step, against the compiler's own figure.

The TPU compiler's `memory_analysis()` counts the step's temporaries; a step whose state plus
those temporaries exceed the chip still runs when the temporaries alone do not. On one v5e chip
the v5e_0p5b step at 32,768 tokens was planned at 18.00 GiB per device (12.25 GiB of temporaries
beside 5.75 GiB of state and batch) on a 15.75 GiB chip, and ran: after its first step the
runtime had reserved 8.56 GiB for the program (`peak_bytes_reserved`) beside 5.75 GiB of arrays
(`peak_bytes_in_use`). The compiler refused the programs whose temporaries alone exceeded HBM
(20.50 GiB at 65,536 tokens; 16.55 GiB for four micro-batches at 32,768).

So a step fits a measured chip when its temporaries fit the chip (the compiler's own test) and its
state and batch plus the share of its temporaries the runtime holds fit too. That share is a fit:
the largest reserved / temporaries ratio over the FITTED points below (a bound: it errs toward "does
not fit"), checked on the held-out ones. A chip not measured here keeps the compiler's whole
figure (share 1), as every TPU generation did before this measurement.

The points: `scripts/train.py --config=configs/base.py:v5e_0p5b` with the overrides named, on a
v5e chip (docs/tpu.md); the temporaries are the trainer's "GiB per device by the compiler" less
the arrays it held.
"""
from __future__ import annotations

import dataclasses

GIB = 1024 ** 3


@dataclasses.dataclass(frozen=True)
class Point:
    run: str
    temporaries_gib: float  # the chip's compiler: memory_analysis() temporaries
    reserved_gib: float     # the runtime, after the first step: peak_bytes_reserved
    arrays_gib: float       # the runtime, after the first step: peak_bytes_in_use
    fit: bool = False

    @property
    def share(self) -> float:
        return self.reserved_gib / self.temporaries_gib

    @property
    def peak_gib(self) -> float:
        return self.arrays_gib + self.reserved_gib


POINTS = {"TPU v5 lite": (
    Point("causal 32,768", 12.25, 8.56, 5.75, fit=True),
    Point("causal 8,192", 5.67, 3.92, 5.75, fit=True),
    Point("4 layers, causal 65,536", 12.52, 8.78, 3.65, fit=True),
    Point("causal 16,384", 8.20, 5.50, 5.75),
    Point("documents 16,384", 8.42, 5.58, 5.75),
    Point("documents 8,192", 5.71, 3.94, 5.75),
    Point("causal 16,384, 4 micro-batches", 12.27, 7.66, 5.75),
)}


def program_share(device_kind: str) -> float | None:
    """The largest share of the compiler's temporaries the runtime was seen to hold on
    `device_kind`, over the fitted points; None for a chip not measured here."""
    fitted = [p.share for p in POINTS.get(device_kind, ()) if p.fit]
    return max(fitted) if fitted else None


def held_out_errors(device_kind: str) -> dict[str, float]:
    """Relative error of the predicted peak (arrays + share x temporaries) on each held-out point."""
    share = program_share(device_kind)
    return {p.run: (p.arrays_gib + share * p.temporaries_gib) / p.peak_gib - 1
            for p in POINTS.get(device_kind, ()) if not p.fit}


def runtime_bytes(device_kind: str, state_and_batch: int, temporaries: int) -> int | None:
    """What the runtime should hold for a step of these compiler figures on `device_kind`; None
    where the chip was not measured."""
    share = program_share(device_kind)
    return None if share is None else int(state_and_batch + share * temporaries)
