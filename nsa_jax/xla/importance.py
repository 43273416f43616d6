"""The `selected_importance` dispatch entry on XLA: NSA's log group importance (docs/NSA_SPEC.md,
step 6) at given selection blocks, differentiable in q, the compressed keys and the compressed
attention's lse; the selection-alignment loss's ranking (`nsa_jax.alignment`, sparse mode).
The definition, and the Pallas kernels of the same: `pallas_kernels.selected_importance`.
"""
from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp

from nsa_common import NSAConfig, num_cmp_blocks, overlap_by_offset
from nsa_jax.segments import Segments, single_sequence
from nsa_jax.xla.common import compute_dtype, einsum, map_query_chunks, masked_softmax, split_heads
from nsa_jax.xla.compressed_attention import cmp_block_metadata
from nsa_jax.xla.options import XlaOptions


def logsumexp_masked(a: jax.Array, axis: int) -> jax.Array:
    """log(sum(exp(a))) over `axis`, -inf for an all -inf slice, with finite gradients there."""
    a = jnp.moveaxis(a, axis, -1)
    return masked_softmax(a, a > -jnp.inf)[1]


def log_importance_at(q: jax.Array, k_cmp: jax.Array, lse: jax.Array, blocks: jax.Array,
                      q_pos: jax.Array, q_seg: jax.Array, cmp_offset: jax.Array,
                      segments: Segments, cfg: NSAConfig, scale: float) -> jax.Array:
    """`log_importance` at the given blocks only: the same values, from the scores of the
    compressed blocks that overlap them and the normaliser lse. The scores come from one product
    with every compressed key (`[B, Q, H, C]`); the softmax, log-sum-exp and overlap work is
    O(blocks) per query instead of O(C).

    q `[B, Q, H, d_k]`, k_cmp `[B, C, G, d_k]`, lse `[B, Q, H]` (`compressed_lse`), blocks int
    `[B, Q, G, K]` (local selection blocks, -1 = none); q_pos, q_seg, cmp_offset `[B, Q]`. ->
    `[B, Q, G, K]` (-inf where no admissible compressed block overlaps the block).
    """
    dtype = compute_dtype(q.dtype, k_cmp.dtype)
    B, Q, G, K = blocks.shape
    C = k_cmp.shape[1]
    cmp_last, cmp_seg = cmp_block_metadata(segments, cfg)
    r = cfg.sel_block // cfg.cmp_stride
    weights = overlap_by_offset(cfg)
    m = jnp.asarray([offset for offset, _ in weights], jnp.int32)
    log_w = jnp.asarray([math.log(w) for _, w in weights], dtype)
    local = blocks[..., None] * r + m                                          # [B, Q, G, K, M]
    slot = cmp_offset[:, :, None, None, None] + local
    in_range = (blocks[..., None] >= 0) & (local >= 0) & (slot < C)
    slot = jnp.clip(slot, 0, max(C - 1, 0))
    admissible = (in_range & (cmp_seg[slot] == q_seg[:, :, None, None, None])
                  & (cmp_last[slot] <= q_pos[:, :, None, None, None]))
    # Every compressed block's score (one product), then the overlapping blocks' ones: on an
    # H100 3-7x faster than gathering the keys, whose backward scatters into k_cmp.
    every = einsum("bqghd,bcgd->bqghc", split_heads(q, G), k_cmp, dtype) * scale
    scores = jnp.take_along_axis(every, slot.reshape(B, Q, G, 1, -1), axis=-1)  # [B,Q,G,h,K*M]
    lse = lse.reshape(B, Q, G, -1).astype(dtype)                               # [B, Q, G, h]
    finite = jnp.isfinite(lse)
    log_p = scores - jnp.where(finite, lse, 0.0)[..., None]
    log_p = log_p.reshape(*log_p.shape[:4], K, len(weights))                  # [B, Q, G, h, K, M]
    keep = admissible[:, :, :, None] & finite[..., None, None]
    log_p = jnp.where(keep, log_p, -jnp.inf)
    log_group = logsumexp_masked(log_p, axis=3)                               # [B, Q, G, K, M]
    return logsumexp_masked(log_group + log_w, axis=-1)


def selected_importance(q: jax.Array, k_cmp: jax.Array, lse: jax.Array, blocks: jax.Array,
                        cfg: NSAConfig, *, scale: float, q_chunk: int = 256,
                        segments: Optional[Segments] = None,
                        options: Optional[XlaOptions] = None) -> jax.Array:
    """q `[B, T, H, d_k]`, k_cmp `[B, C, G, d_k]` (slots per sequence when packed), lse
    `[B, T, H]`, blocks int `[B, T, G, K]` (local selection blocks, -1 = none) -> the log group
    importance of each block `[B, T, G, K]` in the compute dtype (-inf where no admissible
    compressed block overlaps it), per chunk of `q_chunk` queries (`log_importance_at`)."""
    del options
    B, T = q.shape[:2]
    if segments is None:
        layout = single_sequence(T, num_cmp_blocks(cfg, T), cfg)
        zeros = jnp.zeros((B, T), jnp.int32)
        pos, seg, offset = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)), zeros, zeros
    else:
        layout = segments
        pos, seg, offset = (jnp.broadcast_to(a, (B, T)) for a in
                            (segments.pos, segments.seg, segments.cmp_offset))

    def body(chunk_start, q_c, lse_c, blocks_c, pos_c, seg_c, offset_c):
        del chunk_start
        return log_importance_at(q_c, k_cmp, lse_c, blocks_c, pos_c, seg_c, offset_c, layout,
                                 cfg, scale)

    return map_query_chunks(body, q_chunk, q, lse, blocks, pos, seg, offset)
