"""Block selection from the compressed-attention scores (spec step 6), XLA path."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from nsa_common import NSAConfig, num_sel_blocks, overlap_weights
from nsa_jax.segments import Segments, single_sequence
from nsa_jax.xla.common import einsum, map_query_chunks
from nsa_jax.xla.compressed_attention import cmp_block_metadata, cmp_probabilities
from nsa_jax.xla.options import DEFAULT_OPTIONS, XlaOptions


def _block_roles(S: int, q_pos: jax.Array, cfg: NSAConfig):
    """(j `[S]`, last `[..., 1]`, eligible, forced) of S selection blocks for queries at q_pos:
    eligible `j <= t // l_sel`; forced `j < n_init` or among the `n_local` most recent."""
    j = jnp.arange(S, dtype=jnp.int32)
    last = (q_pos // cfg.sel_block)[..., None]
    return j, last, j <= last, (j < cfg.n_init) | (j > last - cfg.n_local)


def top_blocks(scores: jax.Array, q_pos: jax.Array, cfg: NSAConfig) -> jax.Array:
    """scores: `[..., S]` group scores of selection blocks; q_pos: `[...]` local query positions.
    Returns block_idx int32 `[..., n_sel]`: the `n_sel` best eligible blocks, ascending, -1 padded.

    Eligible: `j <= t // l_sel`. Forced (+inf): `j < n_init` and the `n_local` most recent
    eligible blocks. Equal scores go to the lower index: the sort key is `(-score, j)`, which is
    deterministic on every backend. (`lax.top_k` has the same tie rule, but XLA's GPU top-k
    kernel took 62 us for the 4-128 rows of 1,024 scores of a decode step on an H100, the
    sort 17 us; the Pallas decode path ranks with `pallas_kernels.top_n`.)
    """
    S = scores.shape[-1]
    j, last, eligible, forced = _block_roles(S, q_pos, cfg)
    key = jnp.where(forced, -jnp.inf, -scores)
    key = jnp.where(key == 0, 0.0, key)  # -0.0 and +0.0 must tie (the sort is a total order)
    key = jnp.where(eligible, key, jnp.inf)
    _, ranked = lax.sort((key, jnp.broadcast_to(j, key.shape)), dimension=-1, num_keys=2)
    top = ranked[..., :cfg.n_sel]
    # Ineligible picks (fewer than n_sel eligible blocks) go last, then become -1.
    top = jnp.sort(jnp.where(top <= last, top, S), axis=-1)
    top = jnp.where(top == S, -1, top)
    if S < cfg.n_sel:
        top = jnp.pad(top, [(0, 0)] * (top.ndim - 1) + [(0, cfg.n_sel - S)], constant_values=-1)
    return top.astype(jnp.int32)


def rank_scores(scores: jax.Array, q_pos: jax.Array, cfg: NSAConfig) -> jax.Array:
    """`top_blocks`' eligibility and forcing as values where higher is better, for a top-n that
    takes the best `n_sel` (lower index first on ties) and never picks `-inf`: forced blocks
    `+inf`, ineligible blocks (and NaN scores) `-inf`, the others their score."""
    _, _, eligible, forced = _block_roles(scores.shape[-1], q_pos, cfg)
    value = jnp.where(jnp.isnan(scores), -jnp.inf, scores)
    return jnp.where(eligible, jnp.where(forced, jnp.inf, value), -jnp.inf)


def sel_scores(p_cmp: jax.Array, overlap: jax.Array) -> jax.Array:
    """p_cmp `[..., G, h, C]` (local block order) -> group scores `[..., G, S]`.

    `sum_heads(p_cmp @ M) = sum_heads(p_cmp) @ M`: summing the heads first is the cheaper order.
    """
    return einsum("...gc,cs->...gs", jnp.sum(p_cmp, axis=-2), overlap, p_cmp.dtype)


def band_scores(p_group: jax.Array, cfg: NSAConfig, n_sel_blocks: int) -> jax.Array:
    """`sel_scores` for probabilities already summed over the heads: p_group `[..., C]` ->
    `[..., n_sel_blocks]`, without the dense `[C, n_sel_blocks]` overlap matrix.

    The overlap weight of compressed block i and selection block j depends only on
    `i - j * r` (r = l_sel / d, an integer by the config's checks): block j sums
    `f(m) * p[j*r + m]` over the few m with `f(m) = |[m*d, m*d + l) & [0, l_sel)| / d > 0`
    (5 strided slices with the paper's sizes), p being 0 outside `[0, C)`.
    """
    l, d, l_sel = cfg.cmp_block, cfg.cmp_stride, cfg.sel_block
    r, left = l_sel // d, l // d - 1          # m runs over [-left, r - 1]
    C = p_group.shape[-1]
    width = n_sel_blocks * r                  # p[j*r + m] for j < n_sel_blocks, m < r
    widths = [(0, 0)] * (p_group.ndim - 1) + [(left, max(0, width - C))]
    padded = jnp.pad(p_group, widths)[..., :left + width]
    total = jnp.zeros(p_group.shape[:-1] + (n_sel_blocks,), p_group.dtype)
    for m in range(-left, r):
        weight = (min(m * d + l, l_sel) - max(m * d, 0)) / d
        if weight > 0:
            total = total + weight * padded[..., left + m:left + m + width:r]
    return total


def select_blocks(q: jax.Array, k_cmp: jax.Array, cfg: NSAConfig, *, scale: float,
                  lse: Optional[jax.Array] = None, segments: Optional[Segments] = None,
                  options: Optional[XlaOptions] = None) -> jax.Array:
    """q `[B, T, H, d_k]`, k_cmp `[B, C, G, d_k]` -> block_idx int32 `[B, T, G, n_sel]`.

    Packed: block indices are local to each query's sequence. Scores per chunk
    `[B, q_chunk, H, C]`; the selection itself sorts `[B, q_chunk, G, ceil(T / l_sel)]`.
    No gradient flows through the selection. `lse` (the compressed branch's, which kernels
    such as Pallas' reuse) is not needed here: the probabilities come from one exact softmax.
    """
    del lse
    options = options or DEFAULT_OPTIONS
    q, k_cmp = lax.stop_gradient(q), lax.stop_gradient(k_cmp)
    B, T = q.shape[:2]
    C = k_cmp.shape[1]
    packed = segments is not None
    if not packed:
        segments = single_sequence(T, C, cfg)
    cmp_last, cmp_seg = cmp_block_metadata(segments, cfg)
    overlap = jnp.asarray(overlap_weights(cfg, C, num_sel_blocks(cfg, T)))

    def body(chunk_start, q_c, pos_c, seg_c, offset_c):
        del chunk_start
        p, _ = cmp_probabilities(q_c, k_cmp, pos_c, seg_c, cmp_last, cmp_seg, scale)
        if packed and C > 0:
            # Slots -> the query's own local block order: local block i is slot offset + i.
            slot = offset_c[..., None] + jnp.arange(C, dtype=jnp.int32)            # [B, Q, C]
            p = jnp.take_along_axis(p, jnp.clip(slot, 0, C - 1)[:, :, None, None, :], axis=-1)
            p = jnp.where((slot < C)[:, :, None, None, :], p, 0.0)
        return top_blocks(sel_scores(p, overlap.astype(p.dtype)), pos_c[..., None], cfg)

    per_token = [jnp.broadcast_to(a, (B, T))
                 for a in (segments.pos, segments.seg, segments.cmp_offset)]
    return map_query_chunks(body, options.select_q_chunk, q, *per_token)
