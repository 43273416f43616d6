"""Rotary position embedding (spec step 3): rotate-half (GPT-NeoX) over the whole head dim."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from nsa_jax.xla.common import compute_dtype


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """x `[B, T, n, D]` (D even), positions int `[T]` or `[B, T]` -> `[B, T, n, D]`, x's dtype.

    Pair `(i, i + D/2)` turns by `pos * theta^(-2i/D)`. Angles are formed in float32 (float64
    for float64 x): exact for integer positions below 2^24.
    """
    dtype = compute_dtype(x.dtype)
    half = x.shape[-1] // 2
    inv_freq = jnp.asarray(theta ** (-2.0 * np.arange(half) / x.shape[-1]), dtype)
    pos = jnp.broadcast_to(jnp.asarray(positions), x.shape[:2]).astype(dtype)
    angle = pos[:, :, None, None] * inv_freq                               # [B, T, 1, D/2]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = x[..., :half].astype(dtype), x[..., half:].astype(dtype)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
