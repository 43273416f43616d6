"""Comparison of two results: relative L2 error, max abs error, non-finite values, spec tolerances."""
from __future__ import annotations

import dataclasses

import numpy as np

# docs/NSA_SPEC.md, "Tolerances": relative L2 error by dtype and kind.
TOLERANCES = {
    "float32": {"output": 1e-5, "grad": 1e-4},
    "float64": {"output": 1e-5, "grad": 1e-4},
    "bfloat16": {"output": 1e-2, "grad": 1e-2},
    "float16": {"output": 1e-2, "grad": 1e-2},
}
SELECTION_AGREEMENT_MIN = {"float32": 0.999, "float64": 0.999}


def tolerance(dtype: str, kind: str) -> float:
    if dtype not in TOLERANCES:
        raise ValueError(f"dtype ({dtype!r}) must be one of {sorted(TOLERANCES)}")
    if kind not in ("output", "grad"):
        raise ValueError(f"kind ({kind!r}) must be 'output' or 'grad'")
    return TOLERANCES[dtype][kind]


def as_float64(value) -> np.ndarray:
    """Any torch tensor, JAX array or NumPy array (bfloat16 included) as a float64 NumPy array."""
    if hasattr(value, "detach"):  # torch
        value = value.detach().cpu().float() if value.dtype.is_floating_point else value.cpu()
        return value.numpy().astype(np.float64)
    return np.asarray(value).astype(np.float64)


@dataclasses.dataclass(frozen=True)
class Comparison:
    name: str
    rel_err: float
    max_abs: float
    tol: float
    nonfinite: int
    floored: bool = False  # the error was measured against `scale_floor`, not ||ref||

    @property
    def passed(self) -> bool:
        return self.nonfinite == 0 and self.rel_err <= self.tol


ZERO_RATIO = 1e-3


def compare(name: str, actual, reference, tol: float, typical_norm: float = 0.0) -> Comparison:
    """Relative L2 error ||a - r|| / ||r|| and max |a - r|; any NaN or Inf fails.

    `typical_norm` serves quantities that are analytically zero and hold only rounding noise
    (the gradient of the compressed keys' output bias, to which softmax is invariant): when
    ||r|| < ZERO_RATIO * typical_norm the reference counts as zero and the error is measured
    against `typical_norm` (the size such a quantity usually has) instead of its own norm.
    """
    a, r = as_float64(actual), as_float64(reference)
    if a.shape != r.shape:
        raise ValueError(f"{name}: shapes differ, {a.shape} vs {r.shape}")
    nonfinite = int((~np.isfinite(a)).sum() + (~np.isfinite(r)).sum())
    if nonfinite:
        return Comparison(name, float("nan"), float("nan"), tol, nonfinite)
    diff = np.linalg.norm(a - r)
    norm = np.linalg.norm(r)
    floored = norm < ZERO_RATIO * typical_norm
    denominator = typical_norm if floored else norm
    rel = float(diff / denominator) if denominator > 0 else float(diff)
    max_abs = float(np.abs(a - r).max()) if a.size else 0.0
    return Comparison(name, rel, max_abs, tol, 0, floored)


def selection_agreement(block_idx_a, block_idx_b) -> float:
    """Share of (b, t, g) rows whose whole `block_idx` row agrees."""
    a, b = np.asarray(block_idx_a), np.asarray(block_idx_b)
    if a.shape != b.shape:
        raise ValueError(f"block_idx shapes differ: {a.shape} vs {b.shape}")
    if a.size == 0:
        return 1.0
    return float(np.all(a == b, axis=-1).mean())
