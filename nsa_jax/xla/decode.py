"""The decode entries of the XLA backend (`nsa_jax.dispatch`): queries at given positions over a
decode cache, through the same chunk functions as prefill (so a decode step computes what a
prefill over tokens `0..t` computes at t). Any number of queries per sequence: a decode step
passes one, a chunked prefill its whole chunk.

Shapes: q `[B, Q, H, d_k]` at positions `[B, Q]` (each query's token index in its sequence);
the caches `[B, S, G, d]` of `nsa_jax.decode.DecodeCache`.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from nsa_common import NSAConfig, cmp_block_end, overlap_weights
from nsa_jax.xla.common import einsum, merge_heads
from nsa_jax.xla.compressed_attention import cmp_probabilities
from nsa_jax.xla.options import XlaOptions
from nsa_jax.xla.select_blocks import top_blocks
from nsa_jax.xla.selected_attention import selected_chunk
from nsa_jax.xla.sliding_window import window_chunk


def put_rows(buf: jax.Array, values: jax.Array, index: jax.Array) -> jax.Array:
    """buf `[B, S, ...]` with `values [B, T, ...]` written at `index [B, T]`; indices `>= S`
    (the tokens not to write) are dropped, so a donated buffer is updated in place."""
    rows = jnp.arange(buf.shape[0], dtype=jnp.int32)[:, None]
    return buf.at[rows, index].set(values.astype(buf.dtype), mode="drop")


def decode_append(buffers: tuple, tokens: tuple, index: tuple, cfg: NSAConfig, *,
                  positions: jax.Array, packed=None, options: Optional[XlaOptions] = None) -> tuple:
    """The cache appends of a step or a chunk: each `buffers[i] [B, S_i, G, d]` with
    `tokens[i] [B, T, G, d]` written at `index[i] [B, T]` (`>= S_i`: not written). `packed`
    (the same tokens and rows as columns of the projections, for kernels) is not needed here."""
    del cfg, positions, options, packed
    return tuple(put_rows(b, v, i) for b, v, i in zip(buffers, tokens, index))


def decode_compressed_attention(q: jax.Array, k_cmp: jax.Array, v_cmp: jax.Array,
                                cfg: NSAConfig, *, positions: jax.Array, scale: float,
                                options: Optional[XlaOptions] = None):
    """k_cmp `[B, C, G, d_k]`, v_cmp `[B, C, G, d_v]`: compressed blocks in block order (slot i
    is admissible to position t iff `i*d + l - 1 <= t`; later slots are ignored whatever they
    hold). -> `(o_cmp [B, Q, H, d_v]` in q's dtype, `p_group [B, Q, G, C]` the selection
    probabilities summed over each group's heads, no gradient, in the compute dtype)."""
    del options  # no chunking: Q is one token per sequence, or one prefill chunk
    n_slots = k_cmp.shape[1]
    slot = jnp.arange(n_slots, dtype=jnp.int32)
    p_cmp, _ = cmp_probabilities(q, k_cmp, positions, jnp.zeros_like(positions),
                                 cmp_block_end(slot, cfg.cmp_block, cfg.cmp_stride),
                                 jnp.zeros_like(slot), scale)
    o_cmp = merge_heads(einsum("bqghc,bcgd->bqghd", p_cmp, v_cmp, p_cmp.dtype)).astype(q.dtype)
    return o_cmp, jnp.sum(lax.stop_gradient(p_cmp), axis=-2)


def decode_select_blocks(p_group: jax.Array, cfg: NSAConfig, *, positions: jax.Array,
                         n_sel_blocks: int, options: Optional[XlaOptions] = None) -> jax.Array:
    """p_group `[B, Q, G, C]` -> block_idx int32 `[B, Q, G, n_sel]`, ranked among the
    `n_sel_blocks` selection blocks of the cache (the dense overlap matrix, as in prefill)."""
    del options
    overlap = jnp.asarray(overlap_weights(cfg, p_group.shape[-1], n_sel_blocks))
    scores = einsum("...gc,cs->...gs", p_group, overlap.astype(p_group.dtype), p_group.dtype)
    return top_blocks(scores, positions[..., None], cfg)


def decode_compressed_select(q: jax.Array, k_cmp: jax.Array, v_cmp: jax.Array, cfg: NSAConfig,
                             *, positions: jax.Array, scale: float, n_sel_blocks: int,
                             options: Optional[XlaOptions] = None):
    """`decode_compressed_attention` then `decode_select_blocks`: `(o_cmp [B, Q, H, d_v],
    block_idx [B, Q, G, n_sel])`. The entry a backend may fuse (Pallas: no `[B, Q, G, C]`
    probabilities in between)."""
    o_cmp, p_group = decode_compressed_attention(q, k_cmp, v_cmp, cfg, positions=positions,
                                                 scale=scale, options=options)
    return o_cmp, decode_select_blocks(p_group, cfg, positions=positions,
                                       n_sel_blocks=n_sel_blocks, options=options)


def decode_selected_window_attention(q: jax.Array, k_sel: jax.Array, v_sel: jax.Array,
                                     block_idx: jax.Array, k_win: jax.Array, v_win: jax.Array,
                                     cfg: NSAConfig, *, positions: jax.Array, scale: float,
                                     window_tokens: Optional[jax.Array] = None,
                                     options: Optional[XlaOptions] = None):
    """k_sel `[B, L, G, d_k]`, v_sel `[B, L, G, d_v]`: every cached token by position;
    block_idx `[B, Q, G, n_sel]` (-1 = none). k_win `[B, K, G, d_k]`, v_win `[B, K, G, d_v]`:
    the window's keys, row r holding token `window_tokens[b, r]` (int `[B, K]`; None: the
    cache's ring of the last K tokens up to `positions[:, 0]`, token s in slot `s % K`).
    -> `(o_sel, o_win)`, each `[B, Q, H, d_v]` in q's dtype."""
    del options
    first = jnp.zeros_like(positions)  # every sequence starts at token 0 of its cache row
    o_sel = selected_chunk(q, k_sel, v_sel, block_idx, positions, first, cfg.sel_block, scale)
    if window_tokens is None:
        ring = k_win.shape[1]
        t = positions[:, :1]
        window_tokens = t - (t - jnp.arange(ring, dtype=jnp.int32)) % ring   # token per slot
    o_win = window_chunk(q, k_win, v_win, window_tokens[:, None], positions, first, cfg.window,
                         scale)
    return o_sel, o_win


def decode_attention(q: jax.Array, k_cmp: jax.Array, v_cmp: jax.Array, k_sel: jax.Array,
                     v_sel: jax.Array, k_win: jax.Array, v_win: jax.Array, cfg: NSAConfig, *,
                     positions: jax.Array, scale: float, n_sel_blocks: int,
                     block_idx: Optional[jax.Array] = None, gate=None, q_rows=None,
                     options: Optional[XlaOptions] = None):
    """`decode_compressed_select` then `decode_selected_window_attention` on the cache's ring:
    `(o_cmp, o_sel, o_win [B, Q, H, d_v], block_idx [B, Q, G, n_sel], None)`; block_idx given:
    the selected branch reads those blocks. The entry a backend may fuse (Pallas: one combine
    for the three branches, which mixes them by `gate`, the last output); here the caller
    mixes them (the last output None)."""
    del gate, q_rows
    o_cmp, selected = decode_compressed_select(q, k_cmp, v_cmp, cfg, positions=positions,
                                               scale=scale, n_sel_blocks=n_sel_blocks,
                                               options=options)
    block_idx = selected if block_idx is None else block_idx
    o_sel, o_win = decode_selected_window_attention(q, k_sel, v_sel, block_idx, k_win, v_win,
                                                    cfg, positions=positions, scale=scale,
                                                    options=options)
    return o_cmp, o_sel, o_win, block_idx, None
