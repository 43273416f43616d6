"""Attention over the selected blocks (spec step 7), XLA path: gather per (query, KV head)."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from nsa_jax.segments import Segments
from nsa_jax.xla.common import (block_logsumexp, compute_dtype, einsum,
                                map_query_chunks, masked_softmax, merge_heads, split_heads)
from nsa_jax.xla.options import DEFAULT_OPTIONS, XlaOptions


def gather_tokens(x: jax.Array, token: jax.Array) -> jax.Array:
    """x `[B, S, G, D]`, token `[B, Q, G, K]` (valid indices) -> `[B, Q, G, K, D]`."""
    B, Q, G, K = token.shape
    x_t = jnp.swapaxes(x, 1, 2)                                            # [B, G, S, D]
    idx = jnp.swapaxes(token, 1, 2).reshape(B, G, Q * K, 1)
    out = jnp.take_along_axis(x_t, idx, axis=2)                            # [B, G, Q*K, D]
    return jnp.swapaxes(out.reshape(B, G, Q, K, x.shape[-1]), 1, 2)


def _positions(segments: Optional[Segments], B: int, T: int):
    """Each query's local position and its sequence's first token, int32 `[B, T]` each."""
    if segments is None:
        return (jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)),
                jnp.zeros((B, T), jnp.int32))
    return jnp.broadcast_to(segments.pos, (B, T)), jnp.broadcast_to(segments.start, (B, T))


def selected_chunk(q: jax.Array, k: jax.Array, v: jax.Array, block_idx: jax.Array,
                   q_pos: jax.Array, q_start: jax.Array, block_size: int, scale: float):
    """One chunk of queries. q `[B, Q, H, d_k]`, k `[B, S, G, d_k]`, v `[B, S, G, d_v]`,
    block_idx `[B, Q, G, n]` local block indices (-1 = none), q_pos / q_start `[B, Q]` local
    position and first token of each query's sequence. -> `[B, Q, H, d_v]` in q's dtype.

    Local token `j*l_sel + s` lives at `q_start + j*l_sel + s`; it is attended iff `j >= 0` and
    it is `<= t` (hence also inside the query's sequence).
    """
    dtype = compute_dtype(q.dtype, k.dtype, v.dtype)
    B, Q, G, n = block_idx.shape
    local = block_idx[..., None] * block_size + jnp.arange(block_size, dtype=jnp.int32)
    valid = (block_idx[..., None] >= 0) & (local <= q_pos[:, :, None, None, None])
    token = jnp.clip(q_start[:, :, None, None, None] + local, 0, k.shape[1] - 1)
    token, valid = token.reshape(B, Q, G, n * block_size), valid.reshape(B, Q, G, n * block_size)
    # Gathered in the compute dtype: the gather's transpose then sums each token's gradient
    # over the queries that selected it in float32, not in bfloat16.
    k_sel = gather_tokens(k.astype(dtype), token)                         # [B, Q, G, K, D]
    v_sel = gather_tokens(v.astype(dtype), token)
    scores = einsum("bqghd,bqgkd->bqghk", split_heads(q, G), k_sel, dtype) * scale
    p, _ = masked_softmax(scores, valid[:, :, :, None, :])
    return merge_heads(einsum("bqghk,bqgkd->bqghd", p, v_sel, dtype)).astype(q.dtype)


def selected_attention(q: jax.Array, k: jax.Array, v: jax.Array, block_idx: jax.Array, *,
                       block_size: int, scale: float, segments: Optional[Segments] = None,
                       options: Optional[XlaOptions] = None) -> jax.Array:
    """q `[B, T, H, d_k]`, k `[B, T, G, d_k]`, v `[B, T, G, d_v]`, block_idx int32
    `[B, T, G, n]` -> `[B, T, H, d_v]`.

    Gathers the `n * block_size` keys and values of each (query, KV head) inside a chunk:
    `[B, q_chunk, G, n * block_size, d]` at a time.
    """
    options = options or DEFAULT_OPTIONS
    B, T = q.shape[:2]
    pos, start = _positions(segments, B, T)

    def body(chunk_start, q_c, idx_c, pos_c, start_c):
        del chunk_start
        return selected_chunk(q_c, k, v, idx_c, pos_c, start_c, block_size, scale)

    return map_query_chunks(body, options.selected_q_chunk, q, block_idx, pos, start)


def selected_block_mass(q: jax.Array, k: jax.Array, block_idx: jax.Array, *, block_size: int,
                        scale: float, q_chunk: int = 256, kv_blocks: int = 16,
                        segments: Optional[Segments] = None,
                        options: Optional[XlaOptions] = None,
                        q_rows: Optional[jax.Array] = None) -> jax.Array:
    """The log of the selected branch's attention mass on each selected slot, summed over the
    group's heads (the definition: `pallas_kernels.selected_block_mass`). q `[B, T, H, d_k]`,
    k `[B, T, G, d_k]`, block_idx `[B, T, G, n]` -> `[B, T, G, n]` in the compute dtype, -inf
    where a slot holds no attended token; no gradient. q_rows int `[Q]`: the queries are those
    tokens only (q `[B, Q, H, d_k]`, block_idx `[B, Q, G, n]`; the result `[B, Q, G, n]`).

    Per chunk of `q_chunk` queries, `kv_blocks` slots at a time: their keys gathered in the
    compute dtype, `[B, q_chunk, G, kv_blocks * block_size, d_k]`, and the scores
    `[B, q_chunk, H, kv_blocks * block_size]`.
    """
    del options
    B, T = q.shape[0], k.shape[1]
    G, L, K = k.shape[2], block_size, block_idx.shape[-1]
    kv = min(kv_blocks, K)
    n_tiles = -(-K // kv)
    dtype = compute_dtype(q.dtype, k.dtype)
    k = lax.stop_gradient(k).astype(dtype)
    pos, start = _positions(segments, B, T)
    if q_rows is not None:
        pos, start = pos[:, q_rows], start[:, q_rows]
    offsets = jnp.arange(L, dtype=jnp.int32)

    def body(chunk_start, q_c, pos_c, start_c, idx_c):
        del chunk_start
        q_g = split_heads(q_c, G)
        Q, h = q_g.shape[1], q_g.shape[3]
        idx_c = jnp.pad(idx_c, [(0, 0)] * 3 + [(0, n_tiles * kv - K)], constant_values=-1)

        def tile(i, acc):
            blocks = lax.dynamic_slice_in_dim(idx_c, i * kv, kv, axis=3)       # [B, Q, G, kv]
            local = blocks[..., None] * L + offsets                             # [B, Q, G, kv, L]
            valid = (blocks[..., None] >= 0) & (local <= pos_c[:, :, None, None, None])
            token = jnp.clip(start_c[:, :, None, None, None] + local, 0, T - 1)
            keys = gather_tokens(k, token.reshape(B, Q, G, kv * L))
            scores = einsum("bqghd,bqgkd->bqghk", q_g, keys, dtype) * scale
            return acc.at[i].set(block_logsumexp(scores, valid.reshape(B, Q, G, 1, kv * L), kv))

        lse = lax.fori_loop(0, n_tiles, tile,
                            jnp.full((n_tiles, B, Q, G, h, kv), -jnp.inf, dtype))
        lse = jnp.moveaxis(lse, 0, -2).reshape(B, Q, G, h, n_tiles * kv)[..., :K]
        # Each head's softmax over all its selected tokens, summed over the group's heads.
        norm = jax.nn.logsumexp(lse, axis=-1, keepdims=True)
        norm = jnp.where(jnp.isfinite(norm), norm, 0.0)
        return jax.nn.logsumexp(lse - norm, axis=3)                             # [B, Q, G, K]

    q = lax.stop_gradient(q)
    return map_query_chunks(body, q_chunk, q, pos, start, block_idx)
