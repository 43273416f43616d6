"""Errors against the float64 reference and the limits they are judged by (docs/NSA_SPEC.md,
"Tolerances").

Every quantity is computed three times in the report's dtype: by JAX, by PyTorch, and by a
plain implementation (the PyTorch reference on its SDPA path, every intermediate kept in the
dtype: `nsa_torch_ref.reference.plain_arithmetic`), each against
the float64 reference run on the same (dtype-rounded) weights and inputs. A quantity passes when
both frameworks' errors are at most `MULTIPLE` times the plain implementation's: in bfloat16 /
float16 the rule of FlashAttention's tests (a low-precision kernel may be at most twice as far
from a float32 reference as plain PyTorch in the same dtype), in float32 four times. The limit so follows dtype, size and quantity by
itself: a 1024-token reduction in bfloat16 gets the error bfloat16 makes there, a window output
in float32 the error float32 makes there.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np

from parity.selection import UNIT_ROUNDOFF

# A framework may be this many times further from the float64 reference than the plain
# implementation. bfloat16 / float16: FlashAttention's rule (2); their error is the rounding of
# inputs and results to the dtype, which any correct algorithm shares. float32: 4; there the
# error is the order of long float32 reductions, which an algorithm may legitimately change by a
# small factor: a streaming kernel sums a selected block's dk / dv over every query that chose it
# (32,768 query-head rows for the forced first block at the paper preset, T 2048) in sequential
# partial sums and recomputes softmax weights from the log-sum-exp, where the plain
# implementation takes a GEMM's blocked sums of softmax weights it holds; measured on an H100,
# the Pallas selected branch's dk / dv land at 2.3x and 2.9x the plain error there. Every planted
# fault and every 1% weight change lands orders of magnitude above either limit in float32.
MULTIPLE = {"float64": 4.0, "float32": 4.0, "bfloat16": 2.0, "float16": 2.0}
# On one stage's shared inputs the two frameworks may be at most this many times the plain error
# apart from each other: they start from the same dtype-rounded values and make that stage's
# one rounding, so what separates them (accumulation order, values rounded on different sides
# of a tie) is under the plain implementation's distance to float64, while a fault of one
# framework, even one the size of the dtype's rounding (a 1% weight in bfloat16), is not. Where
# one framework rounds less than the other (JAX's compression MLP and gates keep float32 inside,
# the PyTorch reference rounds its hidden layer to the dtype), their distance approaches the
# plain error itself: the 1.5 leaves room for that.
AGREEMENT = 1.5
# Stages made of matrix products and elementwise functions alone (projections, gates, the
# compression MLP, the output projection) in bfloat16 / float16 round once, at the same point,
# in both frameworks after a float32 accumulation: their results differ only where an
# accumulation lands on the other side of a rounding tie. (In float32 the accumulation order
# itself shows, and AGREEMENT applies.)
AGREEMENT_EXACT = 0.25
# The plain error is floored at FLOOR_ROUNDOFFS unit roundoffs of the dtype: a quantity that a
# plain implementation happens to get (almost) exactly must not get a zero limit. bfloat16 and
# float16 accumulate in float32, so a result's own final rounding dominates its error (about
# u / 2 of relative L2): a quarter of u is below any real error. A float32 result also carries
# its accumulation's roundings, which differ with the order of the sum (a plain product or
# reduction lands at 2-3 u): 4 u.
FLOOR_ROUNDOFFS = {"float64": 4.0, "float32": 4.0, "bfloat16": 0.25, "float16": 0.25}
# A reference below ZERO_RATIO times the run's gradient scale is zero in exact arithmetic (a
# bias that cancels in a softmax: float64 leaves ~1e-16 of it): its errors are measured against
# that scale (one absolute scale, the same for every preset) instead of its own norm.
ZERO_RATIO = 1e-9


def as_float64(value) -> np.ndarray:
    """Any torch tensor, JAX array or NumPy array (bfloat16 included) as a float64 NumPy array."""
    if hasattr(value, "detach"):  # torch
        value = value.detach().cpu().double() if value.dtype.is_floating_point else value.cpu()
        return value.numpy().astype(np.float64)
    return np.asarray(value).astype(np.float64)


def limit(plain_error: float, dtype: str) -> float:
    """MULTIPLE[dtype] times the plain implementation's error, floored at FLOOR_ROUNDOFFS
    roundoffs."""
    if dtype not in UNIT_ROUNDOFF:
        raise ValueError(f"dtype ({dtype!r}) must be one of {sorted(UNIT_ROUNDOFF)}")
    return MULTIPLE[dtype] * max(plain_error, FLOOR_ROUNDOFFS[dtype] * UNIT_ROUNDOFF[dtype])


def agreement_limit(plain_error: float, dtype: str, multiple: float = None) -> float:
    """`multiple` (AGREEMENT by default) times the plain error, floored as in `limit`."""
    multiple = AGREEMENT if multiple is None else multiple
    return multiple * max(plain_error, FLOOR_ROUNDOFFS[dtype] * UNIT_ROUNDOFF[dtype])


@dataclasses.dataclass(frozen=True)
class Judged:
    """One quantity: each implementation's distance to the float64 reference, and the verdict.

    Errors are relative L2 (||x - ref|| / ||ref||), or ||x - ref|| / scale for a reference
    that is zero in exact arithmetic (`zero`). nonfinite counts NaN / Inf in jax and torch.
    """
    name: str
    jax: float
    torch: float
    plain: float
    limit: float
    cross: float = 0.0          # ||jax - torch||, in the same units
    cross_limit: float = 0.0
    nonfinite: int = 0
    zero: bool = False

    @property
    def passed(self) -> bool:
        return (self.nonfinite == 0 and self.jax <= self.limit and self.torch <= self.limit
                and self.cross <= self.cross_limit)


def _error(x: np.ndarray, ref: np.ndarray, denominator: float) -> float:
    diff = float(np.linalg.norm(x - ref))
    return diff / denominator if denominator > 0 else diff


def judge(name: str, jax_value, torch_value, plain_value, reference, dtype: str, *,
          scale: float = 0.0, rows: Optional[np.ndarray] = None,
          agreement: Optional[float] = None) -> Judged:
    """Judge one quantity. `scale`: the absolute scale of a zero-in-exact-arithmetic reference
    (the RMS of all the reference's gradients times sqrt(size)); rows: a bool mask over the
    leading axes `[B, T]` keeping only those rows (the own-selection comparison outside the
    near-tie rows); agreement: a multiple of the plain error that bounds the frameworks'
    distance to each other too (stages on shared inputs: AGREEMENT or AGREEMENT_EXACT); None
    reports that distance without judging it."""
    values = [as_float64(v) for v in (jax_value, torch_value, plain_value, reference)]
    shapes = {v.shape for v in values}
    if len(shapes) != 1:
        raise ValueError(f"{name}: shapes differ: {[v.shape for v in values]}")
    if rows is not None:
        values = [v[rows] for v in values]
    j, t, p, r = values
    nonfinite = int((~np.isfinite(j)).sum() + (~np.isfinite(t)).sum())
    if nonfinite:
        return Judged(name, math.nan, math.nan, math.nan, math.nan, nonfinite=nonfinite)
    norm = float(np.linalg.norm(r))
    zero = scale > 0 and norm <= ZERO_RATIO * scale
    denominator = scale if zero else norm
    plain = _error(p, r, denominator)
    return Judged(name, _error(j, r, denominator), _error(t, r, denominator), plain,
                  limit(plain, dtype), _error(j, t, denominator),
                  math.inf if agreement is None else agreement_limit(plain, dtype, agreement),
                  0, zero)


def carried_share(full_error: float, kept_error: float) -> float:
    """The share of a squared error carried by the rows a mask left out."""
    if not full_error > 0:
        return 0.0
    return float(max(0.0, 1.0 - (kept_error / full_error) ** 2))
