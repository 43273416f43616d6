"""Rotary position embedding (spec step 3): rotate-half (GPT-NeoX) over the whole head dim."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from nsa_jax.xla.common import compute_dtype


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """x `[B, T, n, D]` (D even), positions int `[T]` or `[B, T]` -> `[B, T, n, D]`, x's dtype.

    Pair `(i, i + D/2)` turns by `pos * theta^(-2i/D)`, for integer positions below 2^24.
    The rotation is not formed from a float32 angle `pos * freq`, whose rounding grows with the
    position (4e-3 rad at 64k, which GPUs' sine and cosine then pass on): it is composed from
    three tables of exact rotations, one per byte of the position (`_rotation`), so its error is
    a few roundings of the compute dtype at every position.
    """
    dtype = compute_dtype(x.dtype)
    half = x.shape[-1] // 2
    inv_freq = theta ** (-2.0 * np.arange(half) / x.shape[-1])            # float64, host
    pos = jnp.broadcast_to(jnp.asarray(positions), x.shape[:2]).astype(jnp.int32)
    cos, sin = _rotation(pos, inv_freq, dtype)                            # [B, T, D/2]
    cos, sin = cos[:, :, None], sin[:, :, None]
    x1, x2 = x[..., :half].astype(dtype), x[..., half:].astype(dtype)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


_BYTES = 3  # positions below 2^24


def _rotation(pos: jax.Array, inv_freq: np.ndarray, dtype) -> tuple[jax.Array, jax.Array]:
    """cos and sin of `pos * inv_freq` `[..., D/2]` for int32 positions: the position's bytes
    index tables of cos / sin computed in float64 on the host, combined by the angle-sum rule."""
    cos = sin = None
    for byte in range(_BYTES):
        angle = (np.arange(256, dtype=np.float64)[:, None] * 256.0 ** byte) * inv_freq[None]
        index = (pos >> (8 * byte)) & 255
        c = jnp.asarray(np.cos(angle), dtype)[index]
        s = jnp.asarray(np.sin(angle), dtype)[index]
        if cos is None:
            cos, sin = c, s
        else:
            cos, sin = cos * c - sin * s, sin * c + cos * s
    return cos, sin
