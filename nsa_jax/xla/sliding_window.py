"""Sliding-window attention (spec step 8), XLA path: banded and chunked over queries, or cuDNN."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from nsa_jax.segments import Segments
from nsa_jax.xla import cudnn
from nsa_jax.xla.common import (compute_dtype, einsum, map_query_chunks, masked_softmax,
                                merge_heads, split_heads)
from nsa_jax.xla.options import DEFAULT_OPTIONS, XlaOptions


def window_chunk(q: jax.Array, k: jax.Array, v: jax.Array, key_token: jax.Array,
                 q_token: jax.Array, q_start: jax.Array, window: int, scale: float) -> jax.Array:
    """q `[B, Q, H, d_k]`; k `[B, K, G, d_k]`, v `[B, K, G, d_v]` hold the tokens whose global
    indices are key_token `[K]` (any order: a band in prefill, a ring buffer in decode; indices
    outside the sequence are masked); q_token / q_start `[B, Q]` global index of each query and
    of its sequence's first token. Query t attends keys `max(q_start, t - w + 1) .. t`.
    -> `[B, Q, H, d_v]` in q's dtype.
    """
    dtype = compute_dtype(q.dtype, k.dtype, v.dtype)
    key = key_token
    t = q_token[..., None]
    allowed = (key <= t) & (key > t - window) & (key >= q_start[..., None])   # [B, Q, K]
    scores = einsum("bqghd,bkgd->bqghk", split_heads(q, k.shape[2]), k, dtype) * scale
    p, _ = masked_softmax(scores, allowed[:, :, None, None, :])
    return merge_heads(einsum("bqghk,bkgd->bqghd", p, v, dtype)).astype(q.dtype)


def _cudnn_applies(q, k, v, segments, options) -> bool:
    """cuDNN takes one head size for q, k and v: d_v < d_k goes in with v zero-padded."""
    return (options.window_cudnn and segments is None
            and cudnn.fused_takes(q, k, v, fa3=options.fa3, cudnn_kernel=options.cudnn_kernel))


def sliding_window_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, window: int,
                             scale: float, segments: Optional[Segments] = None,
                             options: Optional[XlaOptions] = None) -> jax.Array:
    """q `[B, T, H, d_k]`, k `[B, T, G, d_k]`, v `[B, T, G, d_v]` -> `[B, T, H, d_v]`.

    Each chunk of queries `[s, s + Q)` attends only the band `[s - w + 1, s + Q)` of keys, so the
    scores are `[B, Q, H, Q + w - 1]` and the work is O(T * w), exactly. On a GPU with cuDNN-able
    shapes the fused `jax.nn.dot_product_attention` runs instead (flash-style, same result), or
    FlashAttention-3 where `flash_attn3_jax` is installed (`XlaOptions.fa3`).
    """
    options = options or DEFAULT_OPTIONS
    B, T = q.shape[:2]
    if _cudnn_applies(q, k, v, segments, options):
        try:
            return cudnn.window_attention(q, k, v, window=window, scale=scale, fa3=options.fa3)
        except (ValueError, NotImplementedError, RuntimeError):
            pass  # this cuDNN build refuses the shapes: the banded path below is exact too
    # A window longer than the sequence is the causal mask: shrink it to keep the band small.
    window = min(window, T)
    chunk = min(options.window_q_chunk, T)
    n_chunks = -(-T // chunk)
    pad = [(0, 0), (window - 1, n_chunks * chunk - T), (0, 0), (0, 0)]
    k_pad, v_pad = jnp.pad(k, pad), jnp.pad(v, pad)  # k_pad[r] is token r - (w - 1)
    token = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    start = (jnp.zeros((B, T), jnp.int32) if segments is None
             else jnp.broadcast_to(segments.start, (B, T)))

    def body(chunk_start, q_c, token_c, start_c):
        band = q_c.shape[1] + window - 1
        k_band = lax.dynamic_slice_in_dim(k_pad, chunk_start, band, axis=1)
        v_band = lax.dynamic_slice_in_dim(v_pad, chunk_start, band, axis=1)
        key_token = chunk_start - (window - 1) + jnp.arange(band, dtype=jnp.int32)
        return window_chunk(q_c, k_band, v_band, key_token, token_c, start_c, window, scale)

    return map_query_chunks(body, chunk, q, token, start)
