"""Attention over the compressed blocks (spec step 5), XLA path, chunked over queries."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from nsa_common import NSAConfig, cmp_block_end
from nsa_jax.segments import Segments, single_sequence
from nsa_jax.xla import cudnn
from nsa_jax.xla.common import (compute_dtype, einsum, map_query_chunks, masked_softmax,
                                merge_heads, split_heads)
from nsa_jax.xla.options import DEFAULT_OPTIONS, XlaOptions


def cmp_probabilities(q: jax.Array, k_cmp: jax.Array, q_pos: jax.Array, q_seg: jax.Array,
                      cmp_last: jax.Array, cmp_seg: jax.Array, scale: float):
    """Compressed-attention probabilities of a chunk of queries.

    q: `[B, Q, H, d_k]`; k_cmp: `[B, C, G, d_k]`; q_pos, q_seg: `[B, Q]` local position and
    sequence of each query; cmp_last, cmp_seg: `[C]` local position of each block's last token
    (`i*d + l - 1`) and its sequence (-1: unused slot).
    Returns `(p [B, Q, G, h, C], lse [B, Q, G, h])` in the compute dtype; query t sees block i
    iff they share a sequence and `i*d + l - 1 <= t`.
    """
    dtype = compute_dtype(q.dtype, k_cmp.dtype)
    qg = split_heads(q, k_cmp.shape[2])
    scores = einsum("bqghd,bcgd->bqghc", qg, k_cmp, dtype) * scale
    admissible = (cmp_seg == q_seg[..., None]) & (cmp_last <= q_pos[..., None])   # [B, Q, C]
    return masked_softmax(scores, admissible[:, :, None, None, :])


def cmp_block_metadata(segments: Segments, cfg: NSAConfig):
    """`(cmp_last [C], cmp_seg [C])` of `cmp_probabilities`."""
    return cmp_block_end(segments.cmp_local, cfg.cmp_block, cfg.cmp_stride), segments.cmp_seg


def compressed_attention(q: jax.Array, k_cmp: jax.Array, v_cmp: jax.Array, cfg: NSAConfig, *,
                         scale: float, return_lse: bool = False,
                         segments: Optional[Segments] = None,
                         options: Optional[XlaOptions] = None):
    """q `[B, T, H, d_k]`, k_cmp `[B, C, G, d_k]`, v_cmp `[B, C, G, d_v]` ->
    o_cmp `[B, T, H, d_v]` (q's dtype), and lse `[B, T, H]` float32+ if `return_lse`.

    Scores per chunk: `[B, q_chunk, H, C]`. A query with no admissible block gets o = 0 and
    lse = -inf, with zero gradients.
    """
    options = options or DEFAULT_OPTIONS
    if (options.compressed_cudnn and segments is None
            and cudnn.fused_takes(q, k_cmp, v_cmp, fa3=options.fa3,
                                  cudnn_kernel=options.cudnn_kernel)):
        try:
            o, lse = cudnn.compressed_attention(q, k_cmp, v_cmp, cfg, scale=scale,
                                                attend=cudnn.fused_causal(options.fa3, q, k_cmp,
                                                                          v_cmp))
            return (o, lse) if return_lse else o
        except (ValueError, NotImplementedError, RuntimeError):
            pass  # cuDNN refuses the shapes (or T < l): the chunked path below is exact too
    B, T = q.shape[:2]
    if segments is None:
        segments = single_sequence(T, k_cmp.shape[1], cfg)
    cmp_last, cmp_seg = cmp_block_metadata(segments, cfg)
    dtype = compute_dtype(q.dtype, k_cmp.dtype, v_cmp.dtype)

    def body(chunk_start, q_c, pos_c, seg_c):
        del chunk_start
        p, lse = cmp_probabilities(q_c, k_cmp, pos_c, seg_c, cmp_last, cmp_seg, scale)
        o = einsum("bqghc,bcgd->bqghd", p, v_cmp, dtype)
        # Explicit sizes, no -1: a reshape cannot infer it from 0 elements (B = 0).
        return merge_heads(o).astype(q.dtype), lse.reshape(lse.shape[:2] + (q.shape[2],))

    pos = jnp.broadcast_to(segments.pos, (B, T))
    seg = jnp.broadcast_to(segments.seg, (B, T))
    o, lse = map_query_chunks(body, options.compressed_q_chunk, q, pos, seg)
    return (o, lse) if return_lse else o
