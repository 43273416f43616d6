"""NSA decode attention as Pallas GPU kernels: one new query per sequence, forward only.

A decode step attends one token per batch row, at that row's position `t[b]` (each sequence of
the cache has its own length), with the K/V already in the cache. The XLA decode path runs this
as a dozen
small XLA ops per branch and upcasts through float32 matmuls; here each branch is one pass over
exactly the keys it reads, one program per (batch row, KV head) holding the group's `h` query
heads as rows (padded to the 16 a matrix-unit product needs).

- `decode_compressed`: walks the compressed blocks visible to `t` (`i*d + l - 1 <= t`) in
  tiles of `block_cmp`, keeps an online softmax in float32 and writes o_cmp, the log-sum-exp and
  the scores of every slot (log2 domain, masked slots at MASK). The wrapper turns the scores into
  the group's summed probabilities `[B, G, C]` in one fused XLA reduction, so the selection
  needs no second pass over k_cmp (the scores are `h * C` floats per program, 16x smaller than
  the keys they come from at d_k = 128... and 4 bytes each: written once, read once).
- `decode_selected_window`: the `n_sel` selected blocks of the selection cache (keys `<= t`),
  then the sliding-window ring buffer (token `t - (t - s) mod W` in slot `s`; keys
  `> t - w`), each with its own online softmax.

The caches are not copied: a tile that would run past the end of an array starts earlier so that
it ends at the array's end, and the slots it shares with the previous tile are masked out. d_k
enters the scores in power-of-two column parts (`column_parts`: the paper's 192 as 128 + 64),
so the key caches are read as they are stored. An array shorter than one tile, or a head
dimension that is neither a power of two >= 16 nor the sum of two (e.g. 24, or any d_k with
`split_dk` off), is padded: a copy of that cache per call (at d_k 192 with `split_dk` off, the
whole selection cache's keys, every step).

Lowering: the Pallas Triton lowering (`implementation="triton"`); `"xla"` runs the plain-JAX
references below, which the tests compare with the kernels in interpret mode.
"""
from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from nsa_common import (cmp_admissible, completed_cmp_block, completes_cmp_block,
                         overlap_by_offset, overlap_weights)
from pallas_kernels._common import (LOG2_E, LN_2, MASK, check_implementation, check_tile_sizes,
                                    column_parts, dot, dot_parts, load_cols, matmul_dim,
                                    next_pow2, online_softmax_finish, online_softmax_init,
                                    online_softmax_step, pad_axis, pallas_call, parts_width)
from pallas_kernels.select_blocks import BlockSizes, top_n

__all__ = [
    "DecodeBlockSizes",
    "append_rows",
    "append_rows_packed",
    "append_step_packed",
    "compress_step",
    "decode_attention",
    "decode_compressed",
    "decode_compressed_reference",
    "decode_compressed_select",
    "decode_compressed_select_reference",
    "decode_selected_window",
    "decode_selected_window_reference",
]

@dataclasses.dataclass(frozen=True)
class DecodeBlockSizes:
    """Tile sizes of the decode kernels (defaults: sm90's, measured on an H200 at B 32, S 64k;
    a call with `block_sizes=None` takes its architecture's, `pallas_kernels.profiles`).

    block_cmp: compressed slots per tile; block_win: window ring slots per tile (both powers of
    two >= 16). The selected branch's tile is the selection block (rounded up to a power of 2).
    Split-KV (flash-decoding): each (batch row, KV head) is split over up to `max_splits`
    programs, each taking a contiguous share of the compressed tiles (resp. of the selected
    blocks and the window tiles), until the grid holds `target_programs` programs; a combine
    step merges their partial softmaxes. A small batch then still fills the GPU (one program
    per SM is 132 on an H100/H200; 2 waves by default); `target_programs=1` turns it off.
    block_sel, num_warps_select: the selection kernel of `decode_compressed_select` (selection
    blocks scored per program, a power of two; select_contiguous: read the slots inside the
    blocks as one contiguous tile where l_sel / d is a power of two, not with a strided load per
    slot offset; H100, 64k: 19.8 against 28.2 us at B 32). topn_elements, num_warps_topn:
    the top-n kernel that ranks them after (`select_blocks.BlockSizes`' fields of the same names: scores per
    program, so `topn_elements // n_blocks` rows a program, and its warps). Measured at 64k on
    an H100 (bench/profile_decode.py): the selection kernel 3.1 / 28.4 us at B 1 / 32 with
    32 blocks a program (3.9 / 29.7 with 64, 3.4 / 28.6 with 128); the top-n kernel 6.6 / 7.0 us
    with one row of 1,024 blocks a program (8.7 / 9.0 with four, 7.4 / 7.8 with one on 8 warps),
    before its rounds became one argmax each (5.6 / 5.8 us on an H200).
    append_kernel: a step's six cache appends in one kernel (`append_rows`; False: XLA's
    scatters). append_packed: that kernel reads the tokens straight out of the projections and
    its rows out of one index array (`append_rows_packed`), so the step has no slice or row
    kernels of its own; False: `append_rows` over the sliced tokens. split_dk: d_k enters the
    scores in its power-of-two column parts (192 = 128 + 64) and the key caches are read
    unpadded; False: d_k padded to a power of two, a padded copy of every key cache per step.
    """

    block_cmp: int = 64
    block_win: int = 64
    num_warps: int = 4
    num_stages: int = 2
    target_programs: int = 264
    max_splits: int = 64
    block_sel: int = 32
    num_warps_select: int = 4
    select_contiguous: bool = True
    topn_elements: int = 1024
    num_warps_topn: int = 4
    append_kernel: bool = True
    append_packed: bool = True
    split_dk: bool = True

    def splits(self, rows: int, units: int) -> int:
        """Programs per (batch row, KV head) for `rows = B * G` of them and `units` pieces of
        work each (tiles or blocks): enough to reach target_programs, at most one per unit."""
        return max(1, min(self.max_splits, units, -(-self.target_programs // rows)))

    def __post_init__(self):
        check_tile_sizes(self)
        if self.topn_elements != next_pow2(self.topn_elements):
            raise ValueError(f"block_sizes.topn_elements ({self.topn_elements}) must be a power "
                             f"of 2")


def _default_block_sizes(block_sizes: Optional[DecodeBlockSizes], q, v) -> DecodeBlockSizes:
    """`block_sizes`, or the tiles of this GPU architecture and head dims (`profiles`);
    NotImplementedError where it has none for them."""
    if block_sizes is not None:
        return block_sizes
    from pallas_kernels import profiles
    return profiles.block_sizes("decode", q.dtype, q.shape[-1], v.shape[-1])


def _tile(first, size: int, length: int):
    """Start of the `size`-slot tile that covers slots `[first, first + size)` of an array of
    `length >= size` slots without running past its end, and the `[1, size]` slot indices."""
    start = jnp.minimum(first, length - size)
    return start, start + lax.broadcasted_iota(jnp.int32, (1, size), 1)


def _score_tile(s_ref, start, size: int):
    """The `[rows, size]` view of the score row `s_ref` from slot `start`: every index int32
    (a bare `:` would be int64 under jax_enable_x64, which the store rejects)."""
    return s_ref.at[pl.ds(jnp.int32(0), s_ref.shape[0]), pl.ds(start, size)]


# ----------------------------------------------------------------------------------------------
# Kernels (grid: batch row, KV head)


def _cmp_kernel(t_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, s_ref, *, scale, cmp_block,
                cmp_stride, block, n_cmp, tiles_per_split, dk_parts, score_offset=0):
    """Grid (batch row, KV head, split). t_ref [1] (this row's position); q_ref [h_pad, dk_w];
    k_ref [C_pad, dk_w], v_ref [C_pad, dv_pad] (slots from n_cmp on are padding; dk_w: the
    width of the column parts `dk_parts` that the scores are summed over); this
    split's partial softmax over its tiles: o_ref [h_pad, dv_pad] (float32, normalised),
    lse_ref [h_pad] (log2, -inf if it saw no key); s_ref [h_pad, >= score_offset + C_pad] (the
    log2 score of slot i at column score_offset + i: each split writes only its own slots)."""
    n_slots = k_ref.shape[0]
    t = t_ref[0]
    # Blocks visible to t: i*d + l - 1 <= t, written with a non-negative numerator (Triton's
    # integer division truncates). lax.div / lax.rem take int32 constants explicitly: with
    # jax_enable_x64 a Python int would be int64.
    visible = jnp.minimum(lax.div(jnp.maximum(t - cmp_block + 1 + cmp_stride, 0),
                                  jnp.int32(cmp_stride)), n_cmp)
    q = load_cols(q_ref, (), dk_parts)
    scale_log2 = scale * LOG2_E
    first_tile = pl.program_id(2) * tiles_per_split
    end_tile = jnp.minimum(first_tile + tiles_per_split, -(-n_slots // block))
    live_end = jnp.maximum(first_tile, jnp.minimum(end_tile, lax.div(visible + block - 1,
                                                                            jnp.int32(block))))

    def visit(i, carry):
        first = i * block
        start, slot = _tile(first, block, n_slots)
        k = load_cols(k_ref, (pl.ds(start, block),), dk_parts)
        v = v_ref[pl.ds(start, block), :]
        s = jnp.where((slot >= first) & (slot < visible), dot_parts(q, k) * scale_log2, MASK)
        # A tile shifted back to end at the array's end re-reads slots of the tile before it:
        # only its own slots are stored (so the splits write disjoint slots).
        new = jnp.broadcast_to(slot >= first, s.shape)
        pltriton.store(_score_tile(s_ref, start + score_offset, block), s, mask=new)
        return online_softmax_step(carry, s, v)

    carry = lax.fori_loop(first_tile, live_end, visit, online_softmax_init(*o_ref.shape))

    def blank(i, unused):
        first = i * block
        start, slot = _tile(first, block, n_slots)
        rows = s_ref.shape[0]
        pltriton.store(_score_tile(s_ref, start + score_offset, block),
                       jnp.full((rows, block), MASK, jnp.float32),
                       mask=jnp.broadcast_to(slot >= first, (rows, block)))
        return unused

    lax.fori_loop(live_end, end_tile, blank, 0)
    o, lse_log2 = online_softmax_finish(carry)
    o_ref[...] = o
    lse_ref[...] = lse_log2


def _sel_win_kernel(t_ref, idx_ref, q_ref, ks_ref, vs_ref, kw_ref, vw_ref, os_ref, ls_ref,
                    ow_ref, lw_ref, *, scale, sel_block, tile, window, block_win, ring,
                    n_sel, blocks_per_split, ring_tiles_per_split, dk_parts):
    """Grid (batch row, KV head, split). t_ref [1] (this row's position); idx_ref [n_sel_pad]
    (-1 = none; the first n_sel are read); q_ref [h_pad, dk_w]; ks_ref [L, dk_w], vs_ref
    [L, dv_pad] (every token); kw_ref [W_pad, dk_w], vw_ref [W_pad, dv_pad] (ring of `ring`
    slots, then padding: slot s < ring holds token t - (t - s) mod ring). This split's partial
    softmaxes over its share of the selected blocks and of the ring tiles: os_ref, ow_ref
    [h_pad, dv_pad] (float32, normalised), ls_ref, lw_ref [h_pad] (log2, -inf if none)."""
    t = t_ref[0]
    q = load_cols(q_ref, (), dk_parts)
    scale_log2 = scale * LOG2_E
    split = pl.program_id(2)
    length, ring_pad = ks_ref.shape[0], kw_ref.shape[0]

    def visit_block(slot, carry):
        j = idx_ref[slot]
        live = (j >= 0) & (j * sel_block <= t)
        first = jnp.where(live, j, 0) * sel_block
        start, pos = _tile(first, tile, length)
        k = load_cols(ks_ref, (pl.ds(start, tile),), dk_parts)
        v = vs_ref[pl.ds(start, tile), :]
        keep = live & (pos >= first) & (pos < first + sel_block) & (pos <= t)
        s = jnp.where(keep, dot_parts(q, k) * scale_log2, MASK)
        return online_softmax_step(carry, s, v)

    first_block = split * blocks_per_split
    end_block = jnp.minimum(first_block + blocks_per_split, n_sel)
    carry = lax.fori_loop(first_block, jnp.maximum(first_block, end_block), visit_block,
                          online_softmax_init(*os_ref.shape))
    os_ref[...], ls_ref[...] = online_softmax_finish(carry)

    def visit_ring(i, carry):
        first = i * block_win
        start, slot = _tile(first, block_win, ring_pad)
        k = load_cols(kw_ref, (pl.ds(start, block_win),), dk_parts)
        v = vw_ref[pl.ds(start, block_win), :]
        # >= 0 for real slots (s < ring): the modulo's argument is positive.
        token = t - lax.rem(t - slot + ring, jnp.int32(ring))
        keep = (slot >= first) & (slot < ring) & (token >= 0) & (token > t - window)
        s = jnp.where(keep, dot_parts(q, k) * scale_log2, MASK)
        return online_softmax_step(carry, s, v)

    first_tile = split * ring_tiles_per_split
    end_tile = jnp.minimum(first_tile + ring_tiles_per_split, -(-ring_pad // block_win))
    carry = lax.fori_loop(first_tile, jnp.maximum(first_tile, end_tile), visit_ring,
                          online_softmax_init(*ow_ref.shape))
    ow_ref[...], lw_ref[...] = online_softmax_finish(carry)


def _select_kernel(t_ref, lse_ref, s_ref, value_ref, *, offsets, r, sel_block, n_cmp, n_blocks,
                   n_init, n_local, score_offset, block_sel, contiguous, heads, splits, n_steps):
    """Grid (batch row, KV head, step). The decode selection scores of one query from the
    compressed kernel's scores: t_ref [1]; lse_ref [S_pad, h_pad] (the compressed kernel's log2
    lse of each split; rows from `splits` on are never written), merged here as the combine
    merges them (so this kernel does not wait for the combine, and no XLA kernel turns the
    merged lse into the rows below); s_ref [h_pad, n_cols] (slot i's log2 score at column
    score_offset + i, MASK where not admissible); value_ref [1, block_sel]: the scores of
    selection blocks `[k*block_sel, (k+1)*block_sel)` for step k, ranked after by `top_n`.
    Steps from `n_steps` on (the output padded to the top-n kernel's power-of-two rows) write
    -inf and read nothing.

    Selection block j weighs compressed slots `j*r + m` (r = l_sel / d) by `offsets`, the
    `((m, weight), ...)` of `nsa_common.overlap_by_offset`, each slot's `2^(s - lse)` summed over
    the heads. `contiguous` (r a power of two): the slots m >= 0 of the step's blocks are one
    contiguous `[h_pad, block_sel * r]` load, pooled by a reshape to `[block_sel, r]`; the slots
    m < 0 (before each block) are one strided load per m. Otherwise every m is a strided load.
    Forced blocks get +inf, blocks after t's (and NaN scores) -inf. No running top-n here: with
    one query per program its rounds are serial (75 us at B 32, 64k on an H100), while the
    top-n kernel ranks all rows at once."""
    k = pl.program_id(2)

    @pl.when(k >= n_steps)
    def _padding():
        value_ref[...] = jnp.full(value_ref.shape, -jnp.inf, jnp.float32)

    @pl.when(k < n_steps)
    def _scores():
        _select_step(t_ref, _merged_lse(lse_ref, heads, splits), s_ref, value_ref, k,
                     offsets=offsets, r=r, sel_block=sel_block, n_cmp=n_cmp, n_blocks=n_blocks,
                     n_init=n_init, n_local=n_local, score_offset=score_offset,
                     block_sel=block_sel, contiguous=contiguous)


def _merged_lse(lse_ref, heads: int, splits: int):
    """The `[h_pad]` log2 lse the selection divides by, from the splits' `[S_pad, h_pad]`:
    `combine_splits`' merge; 0 for a head that saw no key (its scores are all MASK), +inf on
    the padded heads (whose zero queries have finite scores: 2^(s - inf) = 0 drops them)."""
    m, _, total = _split_weights(lse_ref[...], splits)
    lse = jnp.where(total > 0, m + jnp.log2(jnp.where(total > 0, total, 1.0)), 0.0)
    lse = jnp.where(jnp.abs(lse) < jnp.inf, lse, 0.0)          # NaN too
    head = lax.broadcasted_iota(jnp.int32, lse.shape, 0)
    return jnp.where(head < heads, lse, jnp.inf)


def _select_step(t_ref, lse, s_ref, value_ref, k, *, offsets, r, sel_block, n_cmp, n_blocks,
                 n_init, n_local, score_offset, block_sel, contiguous):
    """`_select_kernel`'s step k < n_steps, with the merged lse `[h_pad]`."""
    t = t_ref[0]
    last = lax.div(t, jnp.int32(sel_block))
    j = k * block_sel + lax.broadcasted_iota(jnp.int32, (1, block_sel), 1)

    def head_sum(s, slot):
        ok = (slot >= 0) & (slot < n_cmp) & (s > 0.5 * MASK)
        return jnp.sum(jnp.where(ok, jnp.exp2(s - lse[:, None]), 0.0), axis=0, keepdims=True)

    score = jnp.zeros((1, block_sel), jnp.float32)
    if contiguous:
        span = block_sel * r
        slot = k * span + lax.broadcasted_iota(jnp.int32, (1, span), 1)
        p = head_sum(s_ref[:, pl.ds(k * span + score_offset, span)], slot)       # [1, span]
        offset = lax.broadcasted_iota(jnp.int32, (1, r), 1)
        w = jnp.zeros((1, r), jnp.float32)
        for m, weight in offsets:
            if m >= 0:
                w = jnp.where(offset == m, weight, w)
        score = jnp.sum(p.reshape(block_sel, r) * w, axis=1).reshape(1, block_sel)
    for m, weight in offsets:
        if contiguous and m >= 0:
            continue
        start = k * (block_sel * r) + (score_offset + m)
        score = score + weight * head_sum(s_ref[:, pl.ds(start, block_sel, stride=r)], j * r + m)
    forced = (j < n_init) | (j > last - n_local)
    value = jnp.where(forced, jnp.inf, jnp.where(score == score, score, -jnp.inf))
    value_ref[...] = jnp.where((j <= last) & (j < n_blocks), value, -jnp.inf)


def _split_weights(lse, used: int):
    """The split-KV merge of log2 lse `[S_pad, h]` (rows from `used` on are never written):
    `(m [h], weight [S_pad, h], total [h])`, the largest lse (0 where no split saw a key), each
    split's `2^(lse - m)` (0 for a split without keys) and their sum."""
    row = lax.broadcasted_iota(jnp.int32, lse.shape, 0)
    lse = jnp.where(row < used, lse, -jnp.inf)
    m = jnp.max(lse, axis=0)
    m = jnp.where(m > -jnp.inf, m, 0.0)
    weight = jnp.where(lse > -jnp.inf, jnp.exp2(lse - m[None, :]), 0.0)
    return m, weight, jnp.sum(weight, axis=0)


def combine_splits(o_part, lse_part):
    """Merge split-KV partial softmaxes: o_part `[..., S, h, dv]` (each normalised over its own
    keys), lse_part `[..., S, h]` (log2, -inf for a split without keys) -> (o `[..., h, dv]`,
    lse `[..., h]` log2; o = 0 and lse = -inf where no split saw a key)."""
    m = jnp.max(lse_part, axis=-2)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    weight = jnp.where(jnp.isfinite(lse_part), jnp.exp2(lse_part - m[..., None, :]), 0.0)
    total = jnp.sum(weight, axis=-2)
    safe = jnp.where(total > 0, total, 1.0)
    o = jnp.sum(weight[..., None] * o_part, axis=-3) / safe[..., None]
    return o, jnp.where(total > 0, m + jnp.log2(safe), -jnp.inf)


def _combine_kernel(*refs, splits: tuple, gate=None):
    """Grid (batch row, KV head, head chunk, d_v chunk). The split-KV combine of `n =
    len(splits)` partial softmaxes: refs = n x lse_ref [S_pad_i, h_c] (log2; rows from
    `splits[i]` on are never written), n x o_ref [S_pad_i, h_c, dv_c] (float32, each normalised
    over its split's keys), then n x out_ref [h_c, dv_c] (the merged o, in the output dtype; 0
    where no split saw a key) and n x lse_out_ref [h_c] (log2, -inf there; every d_v chunk
    writes the same values). The whole slab is loaded at once (no loop over the splits), and
    the grid spreads a batch of one over many SMs. `combine_splits` is the same in XLA.

    gate `(offset, h)` (three parts: the compressed, selected and window branches; h = h_pad): two
    more inputs after the o_refs, logits_ref [W] (the step's projections; head k's gate
    logits at columns `offset + 3k + j`) and bias_ref [3H], and one more output, mix_ref
    [h_c, dv_c]: `sum_j sigmoid(logit_j + bias_j) * o_j` in the output dtype (spec step 9),
    from the float32 merges."""
    n = len(splits)
    lse_refs, o_refs = refs[:n], refs[n:2 * n]
    extra = 2 if gate is not None else 0
    out_refs, lse_out_refs = refs[2 * n + extra:3 * n + extra], refs[3 * n + extra:4 * n + extra]
    merged = []
    for used, lse_ref, o_ref, out_ref, lse_out_ref in zip(splits, lse_refs, o_refs, out_refs,
                                                          lse_out_refs):
        m, weight, total = _split_weights(lse_ref[...], used)                    # [S_pad, h_c]
        row3 = lax.broadcasted_iota(jnp.int32, o_ref.shape, 0)
        o = jnp.where(row3 < used, o_ref[...], 0.0)    # unwritten rows may hold NaN
        acc = jnp.sum(weight[:, :, None] * o, axis=0)
        safe = jnp.where(total > 0, total, 1.0)
        merged.append(acc / safe[:, None])
        out_ref[...] = merged[-1].astype(out_ref.dtype)
        lse_out_ref[...] = jnp.where(total > 0, m + jnp.log2(safe), -jnp.inf)
    if gate is not None:
        offset, h = gate
        logits_ref, bias_ref, mix_ref = refs[2 * n], refs[2 * n + 1], refs[-1]
        h_c = mix_ref.shape[0]
        first = 3 * (pl.program_id(1) * h + pl.program_id(2) * h_c)    # h_c real heads
        mix = jnp.zeros(mix_ref.shape, jnp.float32)
        for j, o in enumerate(merged):
            logit = (logits_ref[pl.ds(offset + first + j, h_c, stride=3)].astype(jnp.float32)
                     + bias_ref[pl.ds(first + j, h_c, stride=3)].astype(jnp.float32))
            mix = mix + (1.0 / (1.0 + jnp.exp(-logit)))[:, None] * o
        mix_ref[...] = mix.astype(mix_ref.dtype)


# Elements of the largest o slab one combine program loads (4,096: 32 float32 registers a thread
# at 4 warps).
_COMBINE_SLAB = 4096


def _combine(parts, dtype, *, num_warps: int, interpret: bool, gate=None):
    """parts: `[(o_part [B, G, S_pad, h_pad, dv_pad], lse_part [B, G, S_pad, h_pad], splits),
    ...]` (S_pad may differ between parts; `splits` rows of each are written) ->
    `[(o [B, G, h_pad, dv_pad] in dtype, lse_log2 [B, G, h_pad]), ...]`: one kernel for all,
    so that a step's branches share one launch. A program takes `[S_pad, h_c, dv_c]` of each
    (about `_COMBINE_SLAB` elements for the largest S_pad, powers of two, dv_c >= 16).
    gate `(logits [B, W], offset, bias [3H])` (three parts, h_pad the group's heads): the
    gated mix of the three as one more output, `[B, G, h_pad, dv_pad]` in dtype
    (`_combine_kernel`)."""
    B, G, _, h_pad, dv_pad = parts[0][0].shape
    s_max = max(o.shape[2] for o, _, _ in parts)
    dv_c = max(16, min(dv_pad, _COMBINE_SLAB // (s_max * h_pad)))
    h_c = max(1, min(h_pad, _COMBINE_SLAB // (s_max * dv_c)))
    n = len(parts)
    grid = (B, G, h_pad // h_c, dv_pad // dv_c)
    lse_specs = [pl.BlockSpec((None, None, o.shape[2], h_c), lambda b, g, i, j: (b, g, 0, i))
                 for o, _, _ in parts]
    o_specs = [pl.BlockSpec((None, None, o.shape[2], h_c, dv_c),
                            lambda b, g, i, j: (b, g, 0, i, j)) for o, _, _ in parts]
    out_spec = pl.BlockSpec((None, None, h_c, dv_c), lambda b, g, i, j: (b, g, i, j))
    lse_out_spec = pl.BlockSpec((None, None, h_c), lambda b, g, i, j: (b, g, i))
    out_o = jax.ShapeDtypeStruct((B, G, h_pad, dv_pad), dtype)
    in_specs, args, kernel_gate = lse_specs + o_specs, [], None
    out_specs = [out_spec] * n + [lse_out_spec] * n
    out_shape = [out_o] * n + [jax.ShapeDtypeStruct((B, G, h_pad), jnp.float32)] * n
    if gate is not None:
        logits, offset, bias = gate
        rows = logits.reshape(B, 1, logits.shape[-1])
        in_specs += [pl.BlockSpec((None, None, rows.shape[2]), lambda b, g, i, j: (b, 0, 0)),
                     pl.BlockSpec((None, bias.shape[0]), lambda b, g, i, j: (0, 0))]
        args = [rows, bias.reshape(1, -1)]
        out_specs.append(out_spec)
        out_shape.append(out_o)
        kernel_gate = (int(offset), h_pad)
    outs = pallas_call(
        functools.partial(_combine_kernel, splits=tuple(used for _, _, used in parts),
                          gate=kernel_gate),
        name="nsa_decode_combine", num_warps=num_warps, num_stages=1, interpret=interpret,
        grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
    )(*[lse for _, lse, _ in parts], *[o for o, _, _ in parts], *args)
    merged = list(zip(outs[:n], outs[n:2 * n]))
    return merged + [outs[-1]] if gate is not None else merged


def _store_row(out_ref, src_ref, src_col: int, row):
    """Write columns `[src_col, src_col + W)` of src_ref's first row at row `row` of out_ref
    `[S, W]`; nothing when row >= S. W goes in power-of-two column parts (`_row_parts`: 768 =
    512 + 256 for the paper's G*d_k), each one vector load and store."""
    size, width = out_ref.shape
    # Every index int32 (a bare `:` would be int64 under jax_enable_x64).
    at = jnp.minimum(row, size - 1)
    for off, part in _row_parts(width):
        token = src_ref[pl.ds(0, 1), pl.ds(src_col + off, part)]
        view = out_ref.at[pl.ds(at, 1), pl.ds(jnp.int32(off), part)]
        pltriton.store(view, token.astype(out_ref.dtype),
                       mask=jnp.broadcast_to(row < size, token.shape))


def _append_kernel(*refs, n: int):
    """Grid (batch row,). refs = n x idx_ref [1] (the row to write; >= the buffer's length: none),
    n x tok_ref [1, W] (the token, W = G*d), n x the aliased buffers (unread), n x out_ref
    [S, W] (the same buffers, written in place)."""
    idx_refs, tok_refs, out_refs = refs[:n], refs[n:2 * n], refs[3 * n:]
    for idx_ref, tok_ref, out_ref in zip(idx_refs, tok_refs, out_refs):
        _store_row(out_ref, tok_ref, 0, idx_ref[0])


def _append_packed_kernel(*refs, n_src: int, columns: tuple, index_columns=None, limit=None):
    """Grid (batch row,). refs = lead_ref, n_src x src_ref [1, W_s] (the step's projections),
    n x the aliased buffers (unread), n x out_ref [S, W] (written in place). Buffer i takes
    columns `columns[i] = (s, off)`: src s's `[off, off + W)`, at the row in column
    `index_columns[i]` of lead_ref [K] (the rows); or, with `limit`, lead_ref [1] holding the
    token's position t, at row `t % S` where `t < limit` and nowhere otherwise."""
    n = len(columns)
    lead_ref, src_refs, out_refs = refs[0], refs[1:1 + n_src], refs[1 + n_src + n:]
    for i, ((s, off), out_ref) in enumerate(zip(columns, out_refs)):
        if limit is None:
            row = lead_ref[index_columns[i]]
        else:
            t, size = lead_ref[0], out_ref.shape[0]
            row = jnp.where(t < limit, lax.rem(t, jnp.int32(size)), size)
        _store_row(out_ref, src_refs[s], off, row)


def _row_parts(width: int) -> tuple:
    """(offset, width) power-of-two parts >= 16 that a cache row of `width` = G*d columns is
    written in: the row itself, or its two binary parts (`column_parts`); else
    NotImplementedError (XLA's scatter writes it)."""
    parts = column_parts(width) if width >= 16 else ()
    if not parts or parts_width(parts) != width:
        raise NotImplementedError(f"append_rows needs G*d a power of two >= 16 or the sum of "
                                  f"two (768 = 512 + 256), got {width}")
    return parts


def _row_buffers(buffers):
    """buffers `[B, S_i, G, d]` -> `[B, S_i, G*d]`, one row of column parts (`_row_parts`)."""
    flat = []
    for buf in buffers:
        width = buf.shape[2] * buf.shape[3]
        _row_parts(width)
        flat.append(buf.reshape(buf.shape[0], buf.shape[1], width))
    return flat


def _append_call(kernel, buffers, flat, lead_specs, lead_args, interpret):
    """The append kernel over grid (batch row,): `lead_args` (indices, tokens) with their
    BlockSpecs, then the buffers, aliased to the outputs (updated in place)."""
    spec = lambda f: pl.BlockSpec((None, f.shape[1], f.shape[2]), lambda b: (b, 0, 0))
    outs = pallas_call(
        kernel, name="nsa_decode_append", num_warps=4, num_stages=1, interpret=interpret,
        grid=(flat[0].shape[0],), in_specs=list(lead_specs) + [spec(f) for f in flat],
        out_specs=[spec(f) for f in flat],
        out_shape=[jax.ShapeDtypeStruct(f.shape, f.dtype) for f in flat],
        input_output_aliases={len(lead_args) + i: i for i in range(len(flat))},
    )(*lead_args, *flat)
    return tuple(o.reshape(b.shape) for o, b in zip(outs, buffers))


def append_rows(buffers, tokens, index, *, interpret: bool = False):
    """The appends of a decode step in one kernel, in place: each `buffers[i] [B, S_i, G, d]`
    with `tokens[i] [B, G, d]` written at row `index[i] [B]` (int; `>= S_i`: not written).
    G*d must be a power of two >= 16, or the sum of two, for every buffer (`_row_parts`).
    Returns the updated buffers (aliased to the inputs: donate them, or XLA copies them first)."""
    n = len(buffers)
    if not (n == len(tokens) == len(index)) or n == 0:
        raise ValueError(f"append_rows takes as many tokens and indices as buffers (got {n}, "
                         f"{len(tokens)}, {len(index)})")
    B = buffers[0].shape[0]
    flat = _row_buffers(buffers)
    for buf, tok, idx in zip(buffers, tokens, index):
        if tok.shape != (B,) + buf.shape[2:] or idx.shape != (B,):
            raise ValueError(f"token {tok.shape} / index {idx.shape} do not match buffer "
                             f"{buf.shape}")
    toks = [tok.astype(f.dtype).reshape(B, 1, f.shape[2]) for tok, f in zip(tokens, flat)]
    rows = [idx.astype(jnp.int32) for idx in index]
    specs = ([pl.BlockSpec((1,), lambda b: (b,))] * n
             + [pl.BlockSpec((None, 1, t.shape[2]), lambda b: (b, 0, 0)) for t in toks])
    return _append_call(functools.partial(_append_kernel, n=n), buffers, flat, specs,
                        rows + toks, interpret)


def append_rows_packed(buffers, sources, columns, index, index_columns, *,
                       interpret: bool = False):
    """`append_rows` with the tokens read straight out of the step's projections: buffer i
    `[B, S_i, G, d]` gets `sources[s][:, off:off + G*d]` (`columns[i] = (s, off)`, static) at
    row `index[:, index_columns[i]]` (`>= S_i`: not written). sources `[B, W_s]`, index
    `[B, K]` int. So the projections' slices and the rows' arithmetic are no kernels of their
    own (H200: 31 -> 24 kernels and 84 -> 78 us busy a B 1 step at 64k). Returns the
    updated buffers (aliased to the inputs)."""
    if len(index_columns) != len(buffers) or not all(0 <= j < index.shape[1]
                                                     for j in index_columns):
        raise ValueError(f"index_columns ({index_columns}) must name a column of index "
                         f"{index.shape} per buffer ({len(buffers)})")
    K = next_pow2(index.shape[1])
    rows = jnp.pad(index.astype(jnp.int32), [(0, 0), (0, K - index.shape[1])])
    return _append_packed_call(buffers, sources, columns, rows,
                               pl.BlockSpec((None, K), lambda b: (b, 0)), interpret,
                               index_columns=tuple(index_columns))


def append_step_packed(buffers, sources, columns, positions, *, limit: int,
                       interpret: bool = False):
    """A decode step's appends with the rows worked out in the kernel: buffer i `[B, S_i, G, d]`
    gets `sources[s][:, off:off + G*d]` (`columns[i] = (s, off)`, static) at row
    `positions[b] % S_i` (a token buffer of S_i = limit: the position itself; a ring: its slot)
    of the sequences with `positions[b] < limit`, nothing in the others. positions int `[B]`.
    `append_rows_packed` with no index array, so the step computes no rows in XLA (a kernel of
    its own). Returns the updated buffers (aliased to the inputs)."""
    if buffers and positions.shape != (buffers[0].shape[0],):
        raise ValueError(f"positions must be [B={buffers[0].shape[0]}], got shape "
                         f"{positions.shape}")
    return _append_packed_call(buffers, sources, columns, positions.astype(jnp.int32),
                               pl.BlockSpec((1,), lambda b: (b,)), interpret, limit=int(limit))


def _append_packed_call(buffers, sources, columns, lead, lead_spec, interpret, **rows):
    """The packed append kernel: the buffers' columns checked against the sources, `lead`
    (the rows, or the positions) first, then the sources; `rows`: the kernel's row rule
    (`index_columns=` or `limit=`)."""
    n = len(buffers)
    if n == 0 or len(columns) != n:
        raise ValueError(f"the packed appends take a column per buffer (got {n} buffers, "
                         f"{len(columns)} columns)")
    flat = _row_buffers(buffers)
    for f, buf, (s, off) in zip(flat, buffers, columns):
        if not (0 <= s < len(sources) and 0 <= off and off + f.shape[2] <= sources[s].shape[1]):
            raise ValueError(f"column ({s}, {off}) of a buffer {buf.shape} outside sources "
                             f"{[x.shape for x in sources]}")
    srcs = [x.reshape(x.shape[0], 1, x.shape[1]) for x in sources]
    specs = [lead_spec] + [pl.BlockSpec((None, 1, x.shape[2]), lambda b: (b, 0, 0))
                           for x in srcs]
    kernel = functools.partial(_append_packed_kernel, n_src=len(srcs), columns=tuple(columns),
                               **rows)
    return _append_call(kernel, buffers, flat, specs, [lead] + srcs, interpret)


# Abramowitz & Stegun 7.1.26: erf to 1.5e-7 (absolute) with exp and a rational polynomial, the
# operations the Triton lowering has (it has no erf).
_ERF_P = 0.3275911
_ERF_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


def _erf(x):
    z = jnp.abs(x)
    u = 1.0 / (1.0 + _ERF_P * z)
    poly = 0.0
    for a in reversed(_ERF_A):
        poly = (poly + a) * u
    y = 1.0 - poly * jnp.exp(-z * z)
    return jnp.where(x < 0, -y, y)


# Hidden units of the compression MLP one pass of the step's compression kernel computes: a
# weight tile of [D, chunk] per token of the block, staged in shared memory by the loop's
# pipeline. 16-bit weights: up to 128 (32 KB a tile); float32 weights multiply on the FMA units
# with the tile in registers: 32 ([D, width] spilled 30 KB).
_MLP_CHUNK = {2: 128, 4: 32}


def _split_rows(x, dtype):
    """x [1, K] float32 -> [16, K] in `dtype`, the left operand whose product with a [K, N] tile
    of `dtype` gives x's product in rows 0 and 8 (summed by `_row_sum`): for 16-bit weights
    rows 0-7 carry x cut to the weights' type and rows 8-15 what the cut left
    (x = hi + lo to ~16 bits of mantissa, on the matrix units); float32 rows 0-7 carry x and
    rows 8-15 zero (IEEE on the FMA units). A product needs 16 rows in any case."""
    rows = lax.broadcasted_iota(jnp.int32, (16, x.shape[1]), 0)
    if jnp.dtype(dtype).itemsize == 2:
        if jnp.dtype(dtype) == jnp.bfloat16:
            # hi: x's top 16 bits, a bfloat16 value by construction: a compiler that keeps
            # float32 across a round trip through bfloat16 (XLA's excess precision) cannot
            # make lo zero.
            bits = lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFF0000)
            hi = lax.bitcast_convert_type(bits, jnp.float32)
        else:
            hi = x.astype(dtype).astype(jnp.float32)
        lo = (x - hi).astype(dtype)
        hi = hi.astype(dtype)
        return jnp.where(rows < 8, jnp.broadcast_to(hi, rows.shape),
                         jnp.broadcast_to(lo, rows.shape))
    return jnp.where(rows < 8, jnp.broadcast_to(x, rows.shape), 0.0).astype(dtype)


def _row_sum(acc):
    """[16, N] products of `_split_rows` operands -> [1, N]: rows 0 and 8."""
    rows = lax.broadcasted_iota(jnp.int32, acc.shape, 0)
    return jnp.sum(jnp.where((rows == 0) | (rows == 8), acc, 0.0), axis=0, keepdims=True)


def _compress_kernel(t_ref, *refs, n: int, cmp_block: int, cmp_stride: int, limit: int,
                     mlp: bool):
    """Grid (batch row, KV head, ring). t_ref [1]: the position of the token the step
    appended. Where it completes a compressed block (`t < limit`, `t = i*d + l - 1`), the
    program's ring (ring_ref [R, D], token s in slot s % R) gives the block's summary, written
    at row i of its out_ref [C, D] (aliased to the compressed cache); elsewhere nothing is read
    or written. refs = n x ring_ref, (mlp: n x (pos_ref [l, D], w1_ref [l*D, D], b1_ref [1, D],
    w2_ref [D, D], b2_ref [1, D]): the phi MLP of the spec, exact GELU through `_erf`), n x the
    aliased buffers (unread), n x out_ref. Mean compression (no MLP): the mean of the block's
    rows. The rings are a grid axis so that a step that emits runs B*G*n programs, each reading
    one l*D x D weight matrix through the pipelined token loop."""
    l, d = cmp_block, cmp_stride
    t = t_ref[0]
    emit = (t < limit) & completes_cmp_block(t, l, d)
    slot = completed_cmp_block(t, l, d)                 # read only where emit
    rings = refs[:n]
    params = refs[n:n + (5 * n if mlp else 0)]
    outs = refs[len(refs) - n:]

    for i in range(n):
        @pl.when(emit & (pl.program_id(2) == i))
        def _write(i=i):
            ring_ref, out_ref = rings[i], outs[i]
            R, D = ring_ref.shape
            first = t - l + 1

            def row(j):
                return ring_ref[pl.ds(lax.rem(first + j, jnp.int32(R)), 1), :].astype(jnp.float32)

            if mlp:
                pos_ref, w1_ref, b1_ref, w2_ref, b2_ref = params[5 * i:5 * i + 5]
                wt = w1_ref.dtype
                width = w1_ref.shape[1]
                chunk = min(_MLP_CHUNK[jnp.dtype(wt).itemsize], width)
                summary = b2_ref[...].astype(jnp.float32)
                # The hidden layer in column chunks, each chunk's GELU going into the output at
                # once; the block's rows are read again for each chunk (l x D values, against
                # l x D x chunk of weights).
                for c in range(0, width, chunk):
                    def visit(j, acc, c=c):
                        x = row(j) + pos_ref[pl.ds(j, 1), :].astype(jnp.float32)
                        return acc + dot(_split_rows(x, wt),
                                         w1_ref[pl.ds(j * D, D), pl.ds(c, chunk)])

                    acc = lax.fori_loop(0, l, visit, jnp.zeros((16, chunk), jnp.float32))
                    hidden = _row_sum(acc) + b1_ref[:, pl.ds(c, chunk)].astype(jnp.float32)
                    hidden = 0.5 * hidden * (1.0 + _erf(hidden * 0.7071067811865476))
                    summary = summary + _row_sum(
                        dot(_split_rows(hidden, wt), w2_ref[pl.ds(c, chunk), :]))
            else:
                summary = lax.fori_loop(0, l, lambda j, acc: acc + row(j),
                                        jnp.zeros((1, D), jnp.float32)) / l
            at = jnp.minimum(slot, out_ref.shape[0] - 1)
            pltriton.store(out_ref.at[pl.ds(at, 1), :], summary.astype(out_ref.dtype),
                           mask=jnp.broadcast_to(slot < out_ref.shape[0], summary.shape))


def compress_step(rings, buffers, positions, cmp_params=None, *, cmp_block: int,
                  cmp_stride: int, limit: int, interpret: bool = False):
    """A decode step's block compression in one kernel, in place and without a `cond`: where
    the token at `positions[b]` (< limit) completes a compressed block (`t = i*d + l - 1`), each
    `rings[k] [B, R, G, D]` (the raw ring, token s in slot s % R, R >= l) gives the block's
    summary, written at row i of `buffers[k] [B, C, G, D]`; other rows and sequences are left
    as they are. cmp_params: per ring `{"pos", "w1", "b1", "w2", "b2"}` (the spec's phi MLP, the
    shapes of `nsa_jax.layer`) or None (mean compression). D must be a power of two >= 16
    (NotImplementedError otherwise: XLA compresses). Returns the updated buffers (aliased)."""
    n = len(rings)
    if n == 0 or len(buffers) != n or (cmp_params is not None and len(cmp_params) != n):
        raise ValueError(f"compress_step takes a buffer (and MLP) per ring (got {n} rings, "
                         f"{len(buffers)} buffers)")
    B, _, G, _ = rings[0].shape
    for ring, buf in zip(rings, buffers):
        D = ring.shape[3]
        if buf.shape[0] != B or buf.shape[2:] != (G, D) or ring.shape[1] < cmp_block:
            raise ValueError(f"ring {ring.shape} and buffer {buf.shape} do not match (B, G, D; "
                             f"R >= cmp_block = {cmp_block})")
        if D != matmul_dim(D):
            raise NotImplementedError(f"compress_step takes D a power of two >= 16, got {D}")
    if positions.shape != (B,):
        raise ValueError(f"positions must be [B={B}], got shape {positions.shape}")
    per_head = lambda x: pl.BlockSpec((None, x.shape[1], None, x.shape[3]),     # noqa: E731
                                      lambda b, g, r: (b, 0, g, 0))
    specs, args = [pl.BlockSpec((1,), lambda b, g, r: (b,))], [positions.astype(jnp.int32)]
    specs += [per_head(r) for r in rings]
    args += list(rings)
    if cmp_params is not None:
        for p in cmp_params:
            for name in ("pos", "w1", "b1", "w2", "b2"):
                x = p[name] if p[name].ndim == 3 else p[name][:, None, :]
                specs.append(pl.BlockSpec((None,) + x.shape[1:], lambda b, g, r: (g, 0, 0)))
                args.append(x)
    lead = len(args)
    outs = pallas_call(
        functools.partial(_compress_kernel, n=n, cmp_block=cmp_block, cmp_stride=cmp_stride,
                          limit=int(limit), mlp=cmp_params is not None),
        name="nsa_decode_compress", num_warps=4, num_stages=2, interpret=interpret,
        grid=(B, G, n), in_specs=specs + [per_head(b) for b in buffers],
        out_specs=[per_head(b) for b in buffers],
        out_shape=[jax.ShapeDtypeStruct(b.shape, b.dtype) for b in buffers],
        input_output_aliases={lead + i: i for i in range(n)},
    )(*args, *buffers)
    return tuple(outs)


# ----------------------------------------------------------------------------------------------
# Wrappers


def _query_input(q, n_groups: int, dk_pad: int, q_rows=None):
    """(the array the kernels read q from, its BlockSpec over grid (batch row, KV head, split)):
    `q_rows [B, W]` itself where given and no padding is needed (its first H*d_k columns are q,
    head by head: the step's RoPE'd heads, which the append kernel reads too, so that q is no
    XLA slice of its own), else `_query_rows(q)`."""
    B, H, dk = q.shape
    h = H // n_groups
    if q_rows is not None and h == matmul_dim(h) and dk == dk_pad:
        rows = q_rows.reshape(B, q_rows.shape[1] // dk, dk)
        return rows, pl.BlockSpec((None, h, dk), lambda b, g, i: (b, g, 0))
    return _query_rows(q, n_groups, dk_pad), pl.BlockSpec(
        (None, None, matmul_dim(h), dk_pad), lambda b, g, i: (b, g, 0, 0))


def _query_rows(q, n_groups: int, dk_pad: int):
    """q [B, H, d_k] -> [B, G, h_pad, dk_pad] (zero rows and features for the padding)."""
    B, H, dk = q.shape
    h = H // n_groups
    rows = q.reshape(B, n_groups, h, dk)
    return pad_axis(pad_axis(rows, 2, matmul_dim(h)), 3, dk_pad)


def _cache(x, min_len: int, d_pad: int):
    """A `[B, S, G, d]` cache as the kernels read it: padded only where it must be (S shorter
    than a tile, d narrower than the width its column parts read)."""
    return pad_axis(pad_axis(x, 1, max(min_len, x.shape[1])), 3, d_pad)


def _positions(t, batch: int):
    """t: an int scalar (every sequence at the same position) or int `[B]` (each sequence's
    own) -> int32 `[B]`, the array the kernels read one entry of per program."""
    t = jnp.asarray(t)
    if t.shape not in ((), (batch,)) or not jnp.issubdtype(t.dtype, jnp.integer):
        raise ValueError(f"t must be an integer scalar or [B={batch}] (the query positions), "
                         f"got {t.dtype}{list(t.shape)}")
    return jnp.broadcast_to(t.astype(jnp.int32), (batch,))


def _check_group_inputs(q, caches: dict, d_v_of: str):
    if q.ndim != 3:
        raise ValueError(f"q must be [B, H, d_k] (one query per sequence), got shape {q.shape}")
    B, H, dk = q.shape
    G = None
    for name, x in caches.items():
        if x.ndim != 4 or x.shape[0] != B:
            raise ValueError(f"{name} must be [B={B}, S, G, d], got shape {x.shape}")
        if G is None:
            G = x.shape[2]
        if x.shape[2] != G:
            raise ValueError(f"{name} has {x.shape[2]} KV heads, expected {G}")
        if name.startswith("k") and x.shape[3] != dk:
            raise ValueError(f"{name} has d_k {x.shape[3]}, q has {dk}")
        if x.dtype != q.dtype:
            raise ValueError(f"{name} has dtype {x.dtype}, q has {q.dtype}")
    if H % G:
        raise ValueError(f"q's {H} heads are not a multiple of the caches' {G} KV heads")
    return B, H, G, dk, caches[d_v_of].shape[3]


def decode_compressed(q, k_cmp, v_cmp, t, *, cmp_block: int, cmp_stride: int, scale: float,
                      block_sizes: Optional[DecodeBlockSizes] = None,
                      interpret: bool = False, implementation: str = "triton"):
    """Compressed attention of one query per sequence, and its selection probabilities.

    q `[B, H, d_k]` at positions `t` (int scalar or `[B]`, may be traced); k_cmp `[B, C, G, d_k]`,
    v_cmp `[B, C, G, d_v]`: compressed slots in block order (slot i is admissible iff
    `i*cmp_stride + cmp_block - 1 <= t`; later slots are ignored whatever they hold).
    Returns `(o [B, H, d_v] in q's dtype, lse [B, H] float32, p_group [B, G, C] float32)`:
    p_group[b, g, i] is the softmax probability of slot i summed over the group's heads (0 for
    slots not admissible), the input of the block selection. A query with no admissible block
    gets o = 0, lse = -inf, p_group = 0.
    """
    check_implementation(implementation)
    B, H, G, dk, dv = _check_group_inputs(q, {"k_cmp": k_cmp, "v_cmp": v_cmp}, "v_cmp")
    if k_cmp.shape[1] != v_cmp.shape[1]:
        raise ValueError(f"k_cmp has {k_cmp.shape[1]} slots, v_cmp {v_cmp.shape[1]}")
    t = _positions(t, B)
    if implementation == "xla":
        return decode_compressed_reference(q, k_cmp, v_cmp, t, cmp_block=cmp_block,
                                           cmp_stride=cmp_stride, scale=scale)
    o, lse_log2, s = _compressed_call(q, k_cmp, v_cmp, t, cmp_block=cmp_block,
                                      cmp_stride=cmp_stride, scale=scale,
                                      bs=_default_block_sizes(block_sizes, q, v_cmp),
                                      interpret=interpret)
    # One fused XLA pass: p = 2^(s - lse2) over the real heads and slots, summed over the heads.
    h, C = H // G, k_cmp.shape[1]
    s = s[:, :, :h, :C]
    finite = jnp.where(jnp.isfinite(lse_log2), lse_log2, 0.0)
    p_group = jnp.sum(jnp.where(s > 0.5 * MASK, jnp.exp2(s - finite[..., None]), 0.0), axis=2)
    return o, (lse_log2 * LN_2).reshape(B, H), p_group


def _compressed_call(q, k_cmp, v_cmp, t, *, cmp_block, cmp_stride, scale, bs, interpret):
    """The compressed kernel and the combine of its splits: (o [B, H, d_v] in q's dtype,
    lse_log2 [B, G, h] float32, the raw log2 scores of `_compressed_parts`)."""
    B, H, _ = q.shape
    G, dv = k_cmp.shape[2], v_cmp.shape[3]
    h = H // G
    part, s = _compressed_parts(q, k_cmp, v_cmp, t, cmp_block=cmp_block, cmp_stride=cmp_stride,
                                scale=scale, bs=bs, interpret=interpret)
    [(o, lse_log2)] = _combine([part], q.dtype, num_warps=bs.num_warps, interpret=interpret)
    return _heads(o, H, dv), lse_log2[:, :, :h], s


def _compressed_parts(q, k_cmp, v_cmp, t, *, cmp_block, cmp_stride, scale, bs, interpret,
                      score_offset: int = 0, min_cols: int = 0, q_rows=None):
    """The compressed kernel: ((o_part [B, G, S_pad, h_pad, dv_pad], lse_part [B, G, S_pad,
    h_pad], splits), the split-KV partial softmaxes that `_combine` merges; the raw log2 scores
    [B, G, h_pad, n_cols] float32 with slot i at column score_offset + i, n_cols >=
    max(score_offset + slots, min_cols); columns no slot maps to are never written)."""
    B, H, dk = q.shape
    G, C, dv = k_cmp.shape[2], k_cmp.shape[1], v_cmp.shape[3]
    h = H // G
    dk_parts = column_parts(dk, bs.split_dk)
    dk_pad, dv_pad, h_pad = parts_width(dk_parts), matmul_dim(dv), matmul_dim(h)
    kc, vc = _cache(k_cmp, bs.block_cmp, dk_pad), _cache(v_cmp, bs.block_cmp, dv_pad)
    n_slots = kc.shape[1]
    n_cols = max(score_offset + n_slots, min_cols)
    n_tiles = -(-n_slots // bs.block_cmp)
    splits = bs.splits(B * G, n_tiles)
    kernel = functools.partial(_cmp_kernel, scale=float(scale), cmp_block=cmp_block,
                               cmp_stride=cmp_stride, block=bs.block_cmp, n_cmp=C,
                               tiles_per_split=-(-n_tiles // splits), dk_parts=dk_parts,
                               score_offset=score_offset)
    per_group = lambda *tail: pl.BlockSpec((None, None, *tail),                # noqa: E731
                                           lambda b, g, i: (b, g) + (0,) * len(tail))
    per_split = lambda *tail: pl.BlockSpec((None, None, None, *tail),          # noqa: E731
                                           lambda b, g, i: (b, g, i) + (0,) * len(tail))
    cache_spec = lambda d: pl.BlockSpec((None, n_slots, None, d),              # noqa: E731
                                        lambda b, g, i: (b, 0, g, 0))
    s_pad = next_pow2(splits)  # the combine kernel's block; splits from `splits` on stay unwritten
    queries, q_spec = _query_input(q, G, dk_pad, q_rows)
    o_part, lse_part, s = pallas_call(
        kernel, name="nsa_decode_compressed", num_warps=bs.num_warps, num_stages=bs.num_stages,
        interpret=interpret,
        grid=(B, G, splits),
        in_specs=[pl.BlockSpec((1,), lambda b, g, i: (b,)), q_spec,
                  cache_spec(dk_pad), cache_spec(dv_pad)],
        out_specs=[per_split(h_pad, dv_pad), per_split(h_pad), per_group(h_pad, n_cols)],
        out_shape=[jax.ShapeDtypeStruct((B, G, s_pad, h_pad, dv_pad), jnp.float32),
                   jax.ShapeDtypeStruct((B, G, s_pad, h_pad), jnp.float32),
                   jax.ShapeDtypeStruct((B, G, h_pad, n_cols), jnp.float32)],
    )(t, queries, kc, vc)
    return (o_part, lse_part, splits), s


def _check_selection(k_cmp, v_cmp, *, cmp_block, cmp_stride, sel_block, n_sel, n_blocks):
    if k_cmp.shape[1] != v_cmp.shape[1]:
        raise ValueError(f"k_cmp has {k_cmp.shape[1]} slots, v_cmp {v_cmp.shape[1]}")
    if sel_block % cmp_stride or cmp_block % cmp_stride:
        raise ValueError(f"sel_block ({sel_block}) and cmp_block ({cmp_block}) must be "
                         f"multiples of cmp_stride ({cmp_stride})")
    if n_sel < 1 or n_blocks < 1:
        raise ValueError(f"n_sel ({n_sel}) and n_blocks ({n_blocks}) must be >= 1")


def _check_selected_window(q, k_sel, v_sel, block_idx, k_win, v_win):
    B, H, G, dk, dv = _check_group_inputs(
        q, {"k_sel": k_sel, "v_sel": v_sel, "k_win": k_win, "v_win": v_win}, "v_sel")
    if block_idx is not None and (block_idx.ndim != 3 or block_idx.shape[:2] != (B, G)):
        raise ValueError(f"block_idx must be [B={B}, G={G}, n_sel], got shape {block_idx.shape}")
    if v_win.shape[3] != dv:
        raise ValueError(f"v_win has d_v {v_win.shape[3]}, v_sel has {dv}")


def decode_compressed_select(q, k_cmp, v_cmp, t, *, cmp_block: int, cmp_stride: int,
                             sel_block: int, n_sel: int, n_init: int, n_local: int,
                             n_blocks: int, scale: float,
                             block_sizes: Optional[DecodeBlockSizes] = None,
                             interpret: bool = False, implementation: str = "triton"):
    """`decode_compressed` and the block selection of its query in two kernels, with no
    `[B, G, C]` probabilities in between: the compressed kernel writes its log2 scores, a
    selection kernel over (batch row, KV head, blocks) turns them into the selection blocks'
    scores (probabilities summed over the group's heads, weighted by the blocks' overlap) and
    forces the `n_init` first and `n_local` last blocks, and the top-n kernel (`top_n`) keeps the
    best `n_sel`.

    Returns `(o [B, H, d_v] in q's dtype, lse [B, H] float32, block_idx [B, G, n_sel] int32)`:
    the `n_sel` best of the `n_blocks` selection blocks visible to t (`j <= t // sel_block`),
    ascending, -1 padded; among equal scores the lower index (docs/NSA_SPEC.md).
    """
    check_implementation(implementation)
    B, H, G, dk, dv = _check_group_inputs(q, {"k_cmp": k_cmp, "v_cmp": v_cmp}, "v_cmp")
    _check_selection(k_cmp, v_cmp, cmp_block=cmp_block, cmp_stride=cmp_stride,
                     sel_block=sel_block, n_sel=n_sel, n_blocks=n_blocks)
    t = _positions(t, B)
    if implementation == "xla":
        return decode_compressed_select_reference(
            q, k_cmp, v_cmp, t, cmp_block=cmp_block, cmp_stride=cmp_stride, sel_block=sel_block,
            n_sel=n_sel, n_init=n_init, n_local=n_local, n_blocks=n_blocks, scale=scale)
    bs = _default_block_sizes(block_sizes, q, v_cmp)
    part, idx = _compressed_select_parts(
        q, k_cmp, v_cmp, t, cmp_block=cmp_block, cmp_stride=cmp_stride, sel_block=sel_block,
        n_sel=n_sel, n_init=n_init, n_local=n_local, n_blocks=n_blocks, scale=scale, bs=bs,
        interpret=interpret)
    [(o, lse_log2)] = _combine([part], q.dtype, num_warps=bs.num_warps, interpret=interpret)
    return _heads(o, H, dv), (lse_log2[:, :, :H // G] * LN_2).reshape(B, H), idx


def _compressed_select_parts(q, k_cmp, v_cmp, t, *, cmp_block, cmp_stride, sel_block, n_sel,
                             n_init, n_local, n_blocks, scale, bs, interpret, q_rows=None):
    """The compressed kernel, the selection kernel and the top-n kernel: (the compressed
    branch's split parts for `_combine`, block_idx [B, G, n_sel])."""
    B, H, _ = q.shape
    G = k_cmp.shape[2]
    r, left = sel_block // cmp_stride, cmp_block // cmp_stride - 1
    block_sel = bs.block_sel
    n_steps = -(-n_blocks // block_sel)
    part, s = _compressed_parts(
        q, k_cmp, v_cmp, t, cmp_block=cmp_block, cmp_stride=cmp_stride, scale=scale, bs=bs,
        interpret=interpret, score_offset=left, min_cols=left + n_steps * block_sel * r,
        q_rows=q_rows)
    _, lse_part, splits = part
    h_pad, s_pad = s.shape[2], lse_part.shape[2]
    # The output as wide as the top-n kernel's rows (a power of two), so that no XLA pad
    # kernel sits between the two.
    n_out = -(-next_pow2(max(n_steps * block_sel, n_sel)) // block_sel)
    geometry = SimpleNamespace(cmp_block=cmp_block, cmp_stride=cmp_stride, sel_block=sel_block)
    kernel = functools.partial(_select_kernel, offsets=overlap_by_offset(geometry), r=r,
                               sel_block=sel_block, n_cmp=k_cmp.shape[1], n_blocks=n_blocks,
                               n_init=n_init, n_local=n_local, score_offset=left,
                               block_sel=block_sel,
                               contiguous=bs.select_contiguous and r == next_pow2(r),
                               heads=H // G, splits=splits, n_steps=n_steps)
    value = pallas_call(
        kernel, name="nsa_decode_select", num_warps=bs.num_warps_select, num_stages=1,
        interpret=interpret,
        grid=(B, G, n_out),
        in_specs=[pl.BlockSpec((1,), lambda b, g, k: (b,)),
                  pl.BlockSpec((None, None, s_pad, h_pad), lambda b, g, k: (b, g, 0, 0)),
                  pl.BlockSpec((None, None, h_pad, s.shape[3]), lambda b, g, k: (b, g, 0, 0))],
        out_specs=pl.BlockSpec((None, None, 1, block_sel), lambda b, g, k: (b, g, 0, k)),
        out_shape=jax.ShapeDtypeStruct((B, G, 1, n_out * block_sel), jnp.float32),
    )(t, lse_part, s)
    # Columns past n_blocks hold -inf, so the top-n never picks them.
    ranking = BlockSizes(topn_elements=bs.topn_elements, num_warps_topn=bs.num_warps_topn)
    return part, top_n(value[:, :, 0], n_sel, block_sizes=ranking, interpret=interpret)


def decode_selected_window(q, k_sel, v_sel, block_idx, k_win, v_win, t, *, sel_block: int,
                           window: int, scale: float,
                           block_sizes: Optional[DecodeBlockSizes] = None,
                           interpret: bool = False, implementation: str = "triton"):
    """Selected and sliding-window attention of one query per sequence.

    q `[B, H, d_k]` at positions `t` (int scalar or `[B]`, may be traced); k_sel `[B, L, G, d_k]`,
    v_sel `[B, L, G, d_v]`: every cached token by position (tokens after t are ignored);
    block_idx int `[B, G, n_sel]` (-1 = none; block j is tokens `[j*sel_block, (j+1)*sel_block)`);
    k_win `[B, W, G, d_k]`, v_win `[B, W, G, d_v]`: the ring buffer, token s in slot `s mod W`
    (W >= min(window, t + 1)). Returns `(o_sel, o_win)`, each `[B, H, d_v]` in q's dtype.
    """
    check_implementation(implementation)
    _check_selected_window(q, k_sel, v_sel, block_idx, k_win, v_win)
    t = _positions(t, q.shape[0])
    if implementation == "xla":
        return decode_selected_window_reference(q, k_sel, v_sel, block_idx, k_win, v_win, t,
                                                sel_block=sel_block, window=window, scale=scale)
    bs = _default_block_sizes(block_sizes, q, v_sel)
    parts = _selected_window_parts(q, k_sel, v_sel, block_idx, k_win, v_win, t,
                                   sel_block=sel_block, window=window, scale=scale, bs=bs,
                                   interpret=interpret)
    merged = _combine(parts, q.dtype, num_warps=bs.num_warps, interpret=interpret)
    return tuple(_heads(o, q.shape[1], v_sel.shape[3]) for o, _ in merged)


def _heads(o, H: int, dv: int):
    """A combine's o `[B, G, h_pad, dv_pad]` -> `[B, H, d_v]`."""
    B, G = o.shape[:2]
    return o[:, :, :H // G, :dv].reshape(B, H, dv)


def _selected_window_parts(q, k_sel, v_sel, block_idx, k_win, v_win, t, *, sel_block, window,
                           scale, bs, interpret, q_rows=None):
    """The selected + window kernel: the two branches' split parts for `_combine`."""
    B, H, dk = q.shape
    G, dv = k_sel.shape[2], v_sel.shape[3]
    h = H // G
    dk_parts = column_parts(dk, bs.split_dk)
    dk_pad, dv_pad, h_pad = parts_width(dk_parts), matmul_dim(dv), matmul_dim(h)
    tile = matmul_dim(sel_block)
    ks, vs = _cache(k_sel, tile, dk_pad), _cache(v_sel, tile, dv_pad)
    kw, vw = _cache(k_win, bs.block_win, dk_pad), _cache(v_win, bs.block_win, dv_pad)
    ring = k_win.shape[1]
    n_sel, n_ring_tiles = block_idx.shape[2], -(-kw.shape[1] // bs.block_win)
    splits = bs.splits(B * G, max(n_sel, n_ring_tiles))
    blocks_per_split = -(-n_sel // splits)
    # The last split stops at n_sel: the blocks need no padding to the splits' share (an XLA
    # kernel of its own), only to the power of two a block of the kernel takes.
    idx = pad_axis(block_idx.astype(jnp.int32), 2, next_pow2(n_sel), value=-1)
    n_sel_pad = idx.shape[2]
    kernel = functools.partial(_sel_win_kernel, scale=float(scale), sel_block=sel_block,
                               tile=tile, window=window, block_win=bs.block_win, ring=ring,
                               n_sel=n_sel, blocks_per_split=blocks_per_split,
                               ring_tiles_per_split=-(-n_ring_tiles // splits),
                               dk_parts=dk_parts)
    per_group = lambda *tail: pl.BlockSpec((None, None, *tail),                # noqa: E731
                                           lambda b, g, i: (b, g) + (0,) * len(tail))
    per_split = lambda *tail: pl.BlockSpec((None, None, None, *tail),          # noqa: E731
                                           lambda b, g, i: (b, g, i) + (0,) * len(tail))
    cache_spec = lambda n, d: pl.BlockSpec((None, n, None, d),                 # noqa: E731
                                           lambda b, g, i: (b, 0, g, 0))
    s_pad = next_pow2(splits)  # the combine kernel's block; splits from `splits` on stay unwritten
    o_part = jax.ShapeDtypeStruct((B, G, s_pad, h_pad, dv_pad), jnp.float32)
    lse_part = jax.ShapeDtypeStruct((B, G, s_pad, h_pad), jnp.float32)
    queries, q_spec = _query_input(q, G, dk_pad, q_rows)
    os_part, ls_part, ow_part, lw_part = pallas_call(
        kernel, name="nsa_decode_selected_window", num_warps=bs.num_warps,
        num_stages=bs.num_stages, interpret=interpret,
        grid=(B, G, splits),
        in_specs=[pl.BlockSpec((1,), lambda b, g, i: (b,)), per_group(n_sel_pad),
                  q_spec, cache_spec(ks.shape[1], dk_pad),
                  cache_spec(ks.shape[1], dv_pad), cache_spec(kw.shape[1], dk_pad),
                  cache_spec(kw.shape[1], dv_pad)],
        out_specs=[per_split(h_pad, dv_pad), per_split(h_pad)] * 2,
        out_shape=[o_part, lse_part] * 2,
    )(t, idx, queries, ks, vs, kw, vw)

    return [(os_part, ls_part, splits), (ow_part, lw_part, splits)]




def decode_attention(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, t, *, cmp_block: int,
                     cmp_stride: int, sel_block: int, n_sel: int, n_init: int, n_local: int,
                     n_blocks: int, window: int, scale: float, block_idx=None, gate=None,
                     q_rows=None, block_sizes: Optional[DecodeBlockSizes] = None,
                     interpret: bool = False, implementation: str = "triton"):
    """The three branches of one query per sequence: `decode_compressed_select` and
    `decode_selected_window` with one combine kernel for the three branches' splits (a batch of
    one launches five attention kernels a step: compressed, selection, top-n, selected + window,
    combine). Arguments as theirs; block_idx `[B, G, n_sel]` given: the selected branch reads
    those blocks and the selection kernels do not run. gate `(logits [B, W], offset, bias
    [3H])`: the gate logits of head k at columns `offset + 3k + (0, 1, 2)` (cmp, sel, win) of
    the step's projections; the combine kernel then also mixes the branches (spec step 9:
    `sum_j sigmoid(logit_j + bias_j) * o_j`), where a group's heads are a power of two >= 16.
    q_rows `[B, W]` (W >= H*d_k): q's values as its first H*d_k columns, head by head (the
    step's RoPE'd heads); the kernels then read q there (where no padding is needed), so that q
    need not be a sliced copy.

    Returns `(o_cmp, o_sel, o_win [B, H, d_v] in q's dtype, block_idx [B, G, n_sel] int32, o)`:
    o `[B, H, d_v]` the gated mix, None without gate (or where the kernel does not mix: the
    caller mixes).
    """
    check_implementation(implementation)
    B, H, G, dk, dv = _check_group_inputs(q, {"k_cmp": k_cmp, "v_cmp": v_cmp}, "v_cmp")
    _check_selection(k_cmp, v_cmp, cmp_block=cmp_block, cmp_stride=cmp_stride,
                     sel_block=sel_block, n_sel=n_sel, n_blocks=n_blocks)
    _check_selected_window(q, k_sel, v_sel, block_idx, k_win, v_win)
    t = _positions(t, B)
    selection = dict(cmp_block=cmp_block, cmp_stride=cmp_stride, sel_block=sel_block,
                     n_sel=n_sel, n_init=n_init, n_local=n_local, n_blocks=n_blocks,
                     scale=scale)
    if implementation == "xla":
        o_cmp, _, idx = decode_compressed_select_reference(q, k_cmp, v_cmp, t, **selection)
        idx = idx if block_idx is None else block_idx.astype(jnp.int32)
        o_sel, o_win = decode_selected_window_reference(q, k_sel, v_sel, idx, k_win, v_win, t,
                                                        sel_block=sel_block, window=window,
                                                        scale=scale)
        return o_cmp, o_sel, o_win, idx, None
    bs = _default_block_sizes(block_sizes, q, v_cmp)
    if block_idx is None:
        part, idx = _compressed_select_parts(q, k_cmp, v_cmp, t, bs=bs, interpret=interpret,
                                             q_rows=q_rows, **selection)
    else:
        part, _ = _compressed_parts(q, k_cmp, v_cmp, t, cmp_block=cmp_block,
                                    cmp_stride=cmp_stride, scale=scale, bs=bs,
                                    interpret=interpret, q_rows=q_rows)
        idx = block_idx.astype(jnp.int32)
    parts = _selected_window_parts(q, k_sel, v_sel, idx, k_win, v_win, t, sel_block=sel_block,
                                   window=window, scale=scale, bs=bs, interpret=interpret,
                                   q_rows=q_rows)
    h = H // G
    mixes = gate is not None and matmul_dim(h) == h
    merged = _combine([part] + parts, q.dtype, num_warps=bs.num_warps, interpret=interpret,
                      gate=gate if mixes else None)
    o_cmp, o_sel, o_win = (_heads(o, H, dv) for o, _ in merged[:3])
    return o_cmp, o_sel, o_win, idx, _heads(merged[3], H, dv) if mixes else None


# ----------------------------------------------------------------------------------------------
# Plain-JAX references (dense masks; float32 softmax)


def _masked_attention(q, k, v, allowed, scale):
    """q [B, G, h, dk], k [B, S, G, dk], v [B, S, G, dv], allowed [B?, G?, S] -> o [B, G, h, dv]
    and lse [B, G, h] (natural log, -inf on empty rows, o = 0 there)."""
    s = jnp.einsum("bghd,bsgd->bghs", q, k, preferred_element_type=jnp.float32,
                   precision=lax.Precision.HIGHEST) * scale
    allowed = jnp.broadcast_to(allowed[:, :, None, :], s.shape)
    m = jnp.max(jnp.where(allowed, s, -jnp.inf), axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(allowed, jnp.exp(s - m), 0.0)
    total = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(total > 0, total, 1.0)
    o = jnp.einsum("bghs,bsgd->bghd", p, v.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    lse = jnp.where(total[..., 0] > 0, m[..., 0] + jnp.log(jnp.where(total > 0, total, 1.0))[..., 0],
                    -jnp.inf)
    return o, lse, p


def decode_compressed_reference(q, k_cmp, v_cmp, t, *, cmp_block: int, cmp_stride: int,
                                scale: float):
    """`decode_compressed` in plain JAX."""
    B, H, dk = q.shape
    G, C = k_cmp.shape[2], k_cmp.shape[1]
    qg = q.reshape(B, G, H // G, dk)
    t = jnp.broadcast_to(jnp.asarray(t, jnp.int32), (B,))[:, None, None]
    slot = jnp.arange(C, dtype=jnp.int32)
    allowed = jnp.broadcast_to(cmp_admissible(slot, t, cmp_block, cmp_stride), (B, G, C))
    o, lse, p = _masked_attention(qg, k_cmp, v_cmp, allowed, scale)
    return (o.reshape(B, H, -1).astype(q.dtype), lse.reshape(B, H), jnp.sum(p, axis=2))


def decode_compressed_select_reference(q, k_cmp, v_cmp, t, *, cmp_block: int, cmp_stride: int,
                                       sel_block: int, n_sel: int, n_init: int, n_local: int,
                                       n_blocks: int, scale: float):
    """`decode_compressed_select` in plain JAX: the probabilities of `decode_compressed_reference`
    times the dense overlap matrix, forced and eligible blocks, then `lax.top_k` (the lower index
    first on ties) and a sort (`top_n(implementation="xla")`)."""
    o, lse, p_group = decode_compressed_reference(q, k_cmp, v_cmp, t, cmp_block=cmp_block,
                                                  cmp_stride=cmp_stride, scale=scale)
    weights = jnp.asarray(overlap_weights(SimpleNamespace(
        cmp_block=cmp_block, cmp_stride=cmp_stride, sel_block=sel_block), p_group.shape[-1],
        n_blocks))
    score = jnp.einsum("bgc,cs->bgs", p_group, weights, precision=lax.Precision.HIGHEST)
    j = jnp.arange(n_blocks, dtype=jnp.int32)
    last = (jnp.broadcast_to(jnp.asarray(t, jnp.int32), (q.shape[0],)) // sel_block)[:, None, None]
    forced = (j < n_init) | (j > last - n_local)
    value = jnp.where(j <= last, jnp.where(forced, jnp.inf, score), -jnp.inf)
    return o, lse, top_n(value, n_sel, implementation="xla")


def decode_selected_window_reference(q, k_sel, v_sel, block_idx, k_win, v_win, t, *,
                                     sel_block: int, window: int, scale: float):
    """`decode_selected_window` in plain JAX."""
    B, H, dk = q.shape
    G, L, ring = k_sel.shape[2], k_sel.shape[1], k_win.shape[1]
    qg = q.reshape(B, G, H // G, dk)
    t = jnp.broadcast_to(jnp.asarray(t, jnp.int32), (B,))[:, None, None]
    pos = jnp.arange(L, dtype=jnp.int32)
    chosen = jnp.any((block_idx[..., None] >= 0)
                     & (pos // sel_block == block_idx[..., None]), axis=2)    # [B, G, L]
    o_sel, _, _ = _masked_attention(qg, k_sel, v_sel, chosen & (pos <= t), scale)
    slot = jnp.arange(ring, dtype=jnp.int32)
    token = t - (t - slot) % ring
    in_window = jnp.broadcast_to((token >= 0) & (token > t - window), (B, G, ring))
    o_win, _, _ = _masked_attention(qg, k_win, v_win, in_window, scale)
    return (o_sel.reshape(B, H, -1).astype(q.dtype), o_win.reshape(B, H, -1).astype(q.dtype))
