"""Helpers shared by the tests, the benches and the scripts: the relative error of a result against
its reference, and random valid selection indices.

Framework-free like the rest of `nsa_common`: NumPy arrays, JAX arrays and PyTorch tensors are
all read through NumPy (a tensor by duck typing, `.detach().cpu().double().numpy()`), and neither
jax nor torch is imported here.
"""
from __future__ import annotations

import numpy as np

NONFINITE = ("raise", "nan", "inf")


def as_float64(x) -> np.ndarray:
    """`x` (NumPy, JAX or PyTorch, any float dtype, any device) as a float64 NumPy array."""
    if hasattr(x, "detach"):  # a torch.Tensor
        x = x.detach().cpu().double().numpy()
    return np.asarray(x, np.float64)


def rel_err(out, ref, *, nonfinite: str = "raise", absolute_if_zero: bool = False) -> float:
    """`||out - ref|| / ||ref||`, the L2 norms over all elements, in float64.

    The denominator is floored at 1e-30, so a zero reference gives the absolute error times 1e30
    (a failure at any tolerance) rather than a division by zero; `absolute_if_zero=True` gives
    the absolute error `||out - ref||` there instead. A non-finite value in `out`: `nonfinite`
    "raise" (AssertionError, for tests), "nan" or "inf" (the value returned, for bench rows and
    scripts that go on).
    """
    if nonfinite not in NONFINITE:
        raise ValueError(f"nonfinite must be one of {NONFINITE}, got {nonfinite!r}")
    out, ref = as_float64(out), as_float64(ref)
    if not np.isfinite(out).all():
        if nonfinite == "raise":
            raise AssertionError("NaN or Inf in the output")
        return float(nonfinite)
    ref_norm = np.linalg.norm(ref)
    if absolute_if_zero and ref_norm == 0:
        ref_norm = 1.0
    return float(np.linalg.norm(out - ref) / max(ref_norm, 1e-30))


def random_block_idx(rng, B: int, T: int, G: int, n_sel: int, block_size: int, *,
                     n_init: int = 0, n_local: int = 0, fill: bool = False, starts=None,
                     query_chunk: int = 4096) -> np.ndarray:
    """A random valid `block_idx int32 [B, T, G, n_sel]` (the spec's step 6 form).

    Query t's eligible blocks are `0 .. local // block_size`, `local = t - starts[t]` (`starts`
    [T]: the first token of t's packed sequence; none: 0). The first `n_init` and the `n_local`
    most recent eligible blocks are always chosen; the others are drawn uniformly. How many are
    chosen: `fill=True`, `min(n_sel, eligible)` (as the model selects); `fill=False`, a random
    count between the forced ones (at least 1) and that, so -1 padding shows up at every t.
    Ascending, -1 padded at the end. `rng`: a `np.random.Generator` or a seed. Built
    `query_chunk` queries at a time, so long sequences stay small in memory.
    """
    if n_sel < n_init + n_local:
        raise ValueError(f"n_sel ({n_sel}) must be >= n_init + n_local ({n_init + n_local})")
    rng = np.random.default_rng(rng)
    n_blocks = -(-T // block_size)
    k_top = min(n_sel, n_blocks)
    blocks = np.arange(n_blocks)[None, :]
    first = np.zeros(T, np.int64) if starts is None else np.asarray(starts, np.int64)
    idx = np.full((B, T, G, n_sel), -1, np.int32)
    for start in range(0, T, query_chunk):
        t = np.arange(start, min(T, start + query_chunk))
        last = ((t - first[t]) // block_size)[:, None]                      # [C, 1]
        eligible = blocks <= last
        forced = eligible & ((blocks < n_init) | (blocks > last - n_local))
        score = rng.random((B, t.size, G, n_blocks))
        score = np.where(forced[None, :, None, :], 2.0, score)
        score = np.where(eligible[None, :, None, :], score, -1.0)
        top = np.argpartition(-score, k_top - 1, axis=-1)[..., :k_top]
        top = np.take_along_axis(top, np.argsort(-np.take_along_axis(score, top, -1), -1), -1)
        count = np.minimum(n_sel, last[:, 0] + 1)[None, :, None]             # [1, C, 1]
        if not fill:
            fewest = np.maximum(forced.sum(-1), 1)[None, :, None]
            count = rng.integers(fewest, count + 1, size=(B, t.size, G))
        keep = np.arange(k_top) < count[..., None]
        top = np.sort(np.where(keep, top, n_blocks), axis=-1)
        idx[:, t, :, :k_top] = np.where(top == n_blocks, -1, top)
    return idx
