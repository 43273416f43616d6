"""Block selection (NSA spec step 6) as a Pallas Triton kernel: scores and top-n in one pass.

From `q`, `k_cmp` and the log-sum-exp of compressed attention, a program recomputes the
compressed-attention probabilities `p_cmp = exp(s - lse)` one tile of compressed blocks at a
time, maps them to selection-block scores with the overlap weights, sums them over the `h` heads
of its KV group, forces the initial and local blocks, and folds the tile into a running top
`n_sel` held in registers. Memory is the output `[B, T, G, n_sel]`; no `[T, T/d]` array exists.

Program: one per (batch, query tile, KV group). By default ("heads" layout) it holds
`block_queries` queries and loops over the group's `h` heads inside each step, accumulating
their probabilities in float32 registers; the "rows" layout holds `q_tile * h` (query, head)
rows like `compressed_attention` and sums heads by a reshape. Step `k` covers selection blocks
`[k*S, (k+1)*S)` (`S = block_sel`) and the compressed blocks `[k*S*r, (k+1)*S*r)`
(`r = l_sel / d`, the compressed blocks that start inside them). A compressed block that
starts in the previous step's range can still overlap this step's first selection block (when
`l > d`), so each step also weights its head-summed probabilities for the next step's blocks and
carries that `[queries, block_sel]` tile (not the `[queries, blocks]` probabilities: 16
registers a thread instead of 64 at the defaults): each `q k^T` is computed once. The weights
are `overlap(cmp block i, sel block j) / d` (`nsa_common.overlap_weights`), built in the kernel
from iotas; with l = 2d, l_sel = 4d they weight blocks `4j-1 .. 4j+3` by `[1, 2, 2, 2, 1]`.

Top-n: the running best `n_sel` (score, index) pairs are an unsorted set in registers. A step
inserts its candidates best first, each replacing the set's worst member while it beats it
(higher score, or equal score and lower index: the spec's tie rule), and stops at the first that
does not, so a step costs one round plus one per insertion. At the end the set's indices are
sorted ascending by extracting the minimum `n_sel` times. Only max/min reductions, `where` and
iota comparisons are used (argmax is emulated as the lowest index among the maxima), all of
which the Triton lowering supports.

Layout: BTHD. `q [B, T, H, d_k]`, `k_cmp [B, C, G, d_k]`, `lse [B, T, H]` float32.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from nsa_common import NSAConfig, overlap_weights
from pallas_kernels._common import (LOG2_E, MATMUL_MIN, check_implementation, check_kernel_dtype,
                                    check_tile_sizes, column_parts, dot, dot_parts, load_cols,
                                    matmul_dim, next_pow2, pad_axis, pallas_call, parts_width)
# The tile layout this kernel shares with compressed_attention (rows of one KV group's heads
# over tiles of compressed keys).
import pallas_kernels._compressed_tiles as tiles
from pallas_kernels._topn import (NO_BLOCK as _NO_BLOCK, ascending, ascending_by_rank,
                                  empty_top, insert_top)



TOPN_METHODS = ("pallas", "xla", "fused")
LAYOUTS = ("rows", "heads")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes, the layout of a program's queries and the top-n method.

    layout: how a program holds its queries' heads.
      "heads" (default): `block_queries` queries; a step loops over the group's heads, one
        `q_h k^T` and `exp2` each, accumulating `[queries, blocks]` probabilities in float32
        registers (no reshape; each head's q tile is re-read from L2 every step). The head loop
        stays a loop: unrolled, Triton hoisted every head's q tile into shared memory (604 KiB
        at h 16, over the H100's 227 KiB).
      "rows": `block_q` rows of (query, head) pairs (`h` padded to a power of two), one `q k^T` a
        step; the head sum is a register reshape through shared memory. 2.6x slower at 64k.
    `block_sel` counts selection blocks scored per step.

    topn: how the `n_sel` best blocks of a query are found.
      "fused" (default): the scoring kernel keeps a running top-n in registers (no score buffer).
      "pallas": the score kernel writes each row's selection-block scores (float32, HBM), then a
        top-n kernel takes `n_sel` argmax rounds over whole rows (`topn_elements` scores per
        program: rows of up to 4096 blocks, i.e. T up to 256k at l_sel 64, in one pass).
      "xla": the same scores, then `lax.top_k` and a sort.
    score_bytes: the score buffer ("pallas", "xla") is built for chunks of queries of at most this
      many bytes, so memory stays bounded at any T.

    Measured (H100, T 64k, H 64, G 4, d 128, bf16, `bench/breakdown_prefill.py --stages select`,
    bench/RESULTS.md): "rows" + "pallas" 26.9 ms; "heads" + "pallas" 12.6-14.1 ms (its top-n
    kernel alone 2.6 ms); "heads" + "fused" 10.4 ms with 2 stages, 9.5 ms with 3 (the default).
    4 warps; 128 queries a tile with 8 warps 11.7 ms, 32 queries 18.4 ms (with "pallas"),
    16 selection blocks a step 18.5 ms (with "pallas"), 64 with 3 stages 26.1 ms.

    split_dk ("heads" layout): a d_k that is the sum of two powers of two >= 16 (192 = 128 + 64)
      enters `q k^T` as two column parts instead of padded to the next power of two, so q and
      the keys are neither copied into padded arrays nor read at 256 columns
      (`_common.column_parts`, as the selected-attention kernels do).
    """

    block_q: int = 256
    block_sel: int = 32
    num_warps: int = 4
    num_stages: int = 3
    topn: str = "fused"
    topn_elements: int = 4096
    num_warps_topn: int = 4
    score_bytes: int = 1 << 30
    # "rows" only: sum a query's heads with a 0/1 matrix product (bf16 halves of p on the matrix
    # units) rather than a register reshape + sum. Slower on an H100 at 64k (29.4 ms).
    head_sum_dot: bool = False
    layout: str = "heads"
    block_queries: int = 64
    split_dk: bool = True

    def __post_init__(self):
        check_tile_sizes(self)
        if self.topn not in TOPN_METHODS:
            raise ValueError(f"block_sizes.topn ({self.topn!r}) must be one of {TOPN_METHODS}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"block_sizes.layout ({self.layout!r}) must be one of {LAYOUTS}")
        if self.topn_elements != next_pow2(self.topn_elements):
            raise ValueError(f"block_sizes.topn_elements ({self.topn_elements}) must be a power "
                             f"of 2")


def _overlap_tiles(width: int, block_sel: int, span: int, cmp_block: int, cmp_stride: int,
                   sel_block: int):
    """Overlap weights `[width, block_sel]` of a step's compressed blocks (rows) with its
    selection blocks (columns), and of the previous step's. They do not depend on the step: a
    step shifts blocks and selection blocks by the same `block_sel * l_sel` tokens. Integers
    (d | l, d | l_sel) divided by d, as `nsa_common.overlap_weights`."""
    a = lax.broadcasted_iota(jnp.int32, (width, block_sel), 0)
    b = lax.broadcasted_iota(jnp.int32, (width, block_sel), 1)

    def weights(shift):
        start = (a - shift) * cmp_stride
        overlap = (jnp.minimum(start + cmp_block, (b + 1) * sel_block)
                   - jnp.maximum(start, b * sel_block))
        overlap = jnp.where(a < span, jnp.maximum(overlap, 0), 0)
        return lax.div(overlap, jnp.int32(cmp_stride)).astype(jnp.float32)

    return weights(0), weights(span)


def _exact_dot(a, b, *, split: str):
    """`a @ b` in float32 accuracy on the matrix units, for one float32 operand (`split`: "a" or
    "b") and one that bf16 holds exactly (0/1 or small integers): the float32 operand is split
    into two bf16 halves (hi + lo, relative error ~2^-17) and the products accumulate in float32.
    A float32 `tl.dot` at HIGHEST precision would run on the CUDA cores instead."""
    x = a if split == "a" else b
    hi = x.astype(jnp.bfloat16)
    lo = (x - hi.astype(jnp.float32)).astype(jnp.bfloat16)
    if split == "a":
        b = b.astype(jnp.bfloat16)
        return dot(hi, b) + dot(lo, b)
    a = a.astype(jnp.bfloat16)
    return dot(a, hi) + dot(a, lo)


class _Scorer:
    """What the scoring kernels share: the selection-block scores of one query tile, one step
    (`block_sel` selection blocks, `span` compressed blocks) at a time.

    Step `k` covers selection blocks `[k*S, (k+1)*S)` and the compressed blocks
    `[k*span, (k+1)*span)` that start inside them; a compressed block that starts in the previous
    step's range can still overlap this step's first selection block (when `l > d`), so a step
    also weights its head-summed probabilities with the next step's overlap weights and carries
    that `[q_tile, block_sel]` share (each `q k^T` is computed once). Steps whose compressed
    blocks every row of the tile sees whole need no mask (`n_bulk`)."""

    def __init__(self, q_ref, k_ref, lse_ref, first_query, *, tiling: tiles.Tiling, cmp_block: int,
                 cmp_stride: int, sel_block: int, n_init: int, n_local: int, scale: float,
                 block_sel: int, span: int, head_sum_dot: bool, parts: tuple):
        self.k_ref, self.tiling, self.scale, self.parts = k_ref, tiling, scale, parts
        self.head_sum_dot = head_sum_dot
        self.block_sel, self.span, self.n_init, self.n_local = block_sel, span, n_init, n_local
        self.q_tile = q_tile = q_ref.shape[0]
        self.width = width = matmul_dim(span)  # compressed blocks loaded per step (>= span)
        self._hold_queries(q_ref, lse_ref, first_query)
        query = first_query + jnp.arange(q_tile, dtype=jnp.int32)
        self.last_sel = lax.div(query, jnp.int32(sel_block))  # each query's last eligible block
        self.geometry = dict(tiling=tiling, cmp_block=cmp_block, cmp_stride=cmp_stride)
        self.w_current, self.w_previous = _overlap_tiles(width, block_sel, span, cmp_block,
                                                         cmp_stride, sel_block)
        last_query = jnp.minimum(first_query + q_tile - 1, tiling.seq_len - 1)
        self.n_steps = lax.div(lax.div(last_query, jnp.int32(sel_block)),
                               jnp.int32(block_sel)) + 1
        # Steps whose `width` loaded blocks the first query sees: no mask, no empty rows.
        seen_by_all = tiles.blocks_visible_to(first_query, **self.geometry)
        self.n_bulk = jnp.minimum(lax.div(jnp.maximum(seen_by_all - width, -span) + span,
                                          jnp.int32(span)), self.n_steps)

    def _hold_queries(self, q_ref, lse_ref, first_query):
        """The tile's (query, head) rows in registers, their lse, positions and padding."""
        tiling = self.tiling
        self.q = tiles.load_rows(q_ref, first_query, tiling, tiling.d_k)
        self.lse2 = tiles.load_row_stats(lse_ref, tiling) * LOG2_E
        self.position, self.real = tiles.row_positions(first_query, self.q_tile, tiling)
        if self.head_sum_dot:
            self.summer = self._summer(self.q_tile, tiling)

    @staticmethod
    def _summer(q_tile: int, tiling: tiles.Tiling):
        """[q_tile, rows] 0/1: sums a query's real heads (rows r = query * h_pad + head)."""
        rows = q_tile * tiling.h_pad
        i = lax.broadcasted_iota(jnp.int32, (q_tile, rows), 0)
        r = lax.broadcasted_iota(jnp.int32, (q_tile, rows), 1)
        return ((lax.div(r, jnp.int32(tiling.h_pad)) == i)
                & (lax.rem(r, jnp.int32(tiling.h_pad)) < tiling.heads))

    def init(self):
        return jnp.zeros((self.q_tile, self.block_sel), jnp.float32)

    def step(self, k, carried, masked: bool):
        """(scores `[q_tile, block_sel]` with forced blocks +inf and ineligible ones -inf, the
        share `[q_tile, block_sel]` of this step's probabilities in step k + 1's blocks).
        carried: the previous step's share in this step's blocks."""
        first_block = k * self.span
        keys = self.k_ref[pl.ds(first_block, self.width), :]
        s2 = dot(self.q, keys, trans_b=True) * (self.scale * LOG2_E)
        p = jnp.exp2(s2 - self.lse2[:, None])
        # A non-finite row (NaN in q or lse) must not reach the other queries of the tile
        # through `0 * NaN` in the head-sum product: it scores 0 instead.
        p = jnp.where((p == p) & (p < jnp.inf), p, 0.0)
        if masked:
            # Columns past `span` belong to the next step; their weight rows are zero here and in
            # `w_previous`, so only admissibility is masked.
            p = jnp.where(tiles.admissible(self.position, self.real, first_block, self.width,
                                     **self.geometry), p, 0.0)
        if self.head_sum_dot and self.q_tile >= MATMUL_MIN:
            # Padded heads get weight 0 in `summer`, also in unmasked steps where their p is not.
            p_sum = _exact_dot(self.summer, p, split="b")
        else:
            p = jnp.where(self.real[:, None], p, 0.0)  # padded heads
            p_sum = p.reshape(self.q_tile, self.tiling.h_pad, self.width).sum(axis=1)
        return self._force(k, self._weigh(p_sum, self.w_current) + carried), \
            self._weigh(p_sum, self.w_previous)

    def _weigh(self, p_sum, weights):
        """Selection-block scores `[q_tile, block_sel]` of head-summed probabilities `[q_tile,
        width]` under overlap weights `[width, block_sel]` (this step's or the next's)."""
        if self.q_tile >= MATMUL_MIN:
            return _exact_dot(p_sum, weights, split="a")
        # a tl.dot needs >= 16 rows: tiny tiles weight in registers
        return (p_sum[:, :, None] * weights[None]).sum(axis=1)

    def _force(self, k, score):
        """Step k's scores with forced blocks +inf and blocks after the query's own -inf."""
        index = k * self.block_sel + lax.broadcasted_iota(jnp.int32,
                                                          (self.q_tile, self.block_sel), 1)
        eligible = index <= self.last_sel[:, None]
        forced = (index < self.n_init) | (index > self.last_sel[:, None] - self.n_local)
        return jnp.where(eligible, jnp.where(forced, jnp.inf, score), -jnp.inf)

    def run(self, body, carry):
        """fori_loop `body(k, (carried, carry), masked)` over the unmasked steps, then the
        masked ones; returns the final carry."""
        state = (self.init(), carry)
        state = lax.fori_loop(0, self.n_bulk, functools.partial(body, masked=False), state)
        state = lax.fori_loop(self.n_bulk, self.n_steps, functools.partial(body, masked=True),
                              state)
        return state[1]


class _HeadLoopScorer(_Scorer):
    """`_Scorer` for the "heads" layout: a program holds `q_tile` queries (not query x head
    rows), and a step accumulates the group's heads one `q_h k^T` at a time into float32
    `[q_tile, width]` probabilities, so the head sum needs no reshape. Each head's `[q_tile,
    d_k]` query tile is loaded again every step (from L2: a program's q is `q_tile * h * d_k`)."""

    def _hold_queries(self, q_ref, lse_ref, first_query):
        """Nothing loaded yet (a step reads each head's q and lse); positions per query."""
        self.q_ref, self.lse_ref = q_ref, lse_ref
        query = first_query + jnp.arange(self.q_tile, dtype=jnp.int32)
        self.position, self.real = query, query < self.tiling.seq_len

    def step(self, k, carried, masked: bool):
        first_block = k * self.span
        keys = load_cols(self.k_ref, (pl.ds(first_block, self.width),), self.parts)
        scale2 = self.scale * LOG2_E

        def add_head(head, p_sum):
            q = load_cols(self.q_ref, (slice(None), head), self.parts)
            lse2 = self.lse_ref[:, head] * LOG2_E
            return p_sum + jnp.exp2(dot_parts(q, keys) * scale2 - lse2[:, None])

        p_sum = lax.fori_loop(0, self.tiling.heads, add_head,
                              jnp.zeros((self.q_tile, self.width), jnp.float32))
        # A non-finite query (NaN in q or lse) scores 0 rather than reach the weighted sums.
        p_sum = jnp.where((p_sum == p_sum) & (p_sum < jnp.inf), p_sum, 0.0)
        if masked:
            p_sum = jnp.where(tiles.admissible(self.position, self.real, first_block, self.width,
                                         **self.geometry), p_sum, 0.0)
        return (self._force(k, self._weigh(p_sum, self.w_current) + carried),
                self._weigh(p_sum, self.w_previous))


def _make_scorer(q_ref, k_ref, lse_ref, first_query, *, layout: str, **geometry):
    if layout == "heads":
        return _HeadLoopScorer(q_ref, k_ref, lse_ref, first_query, **geometry)
    return _Scorer(q_ref, k_ref, lse_ref, first_query, **geometry)


def _select_kernel(q_ref, k_ref, lse_ref, idx_ref, *, n_sel: int, **geometry):
    """Scores and a running top-n in registers (`_topn.insert_top`), one kernel."""
    q_tile = q_ref.shape[0]
    scorer = _make_scorer(q_ref, k_ref, lse_ref, pl.program_id(1) * q_tile, **geometry)
    block_sel = geometry["block_sel"]

    def body(k, state, masked):
        carried, (top_val, top_idx) = state
        score, carried = scorer.step(k, carried, masked)
        index = k * block_sel + lax.broadcasted_iota(jnp.int32, (q_tile, block_sel), 1)
        return carried, insert_top(top_val, top_idx, score, index)

    _, top_idx = scorer.run(body, empty_top(q_tile, n_sel, idx_ref.shape[1]))
    block_idx = ascending(top_idx, n_sel)
    if idx_ref.shape[1] == n_sel:
        idx_ref[...] = block_idx
    else:
        column = lax.broadcasted_iota(jnp.int32, block_idx.shape, 1)
        pltriton.store(idx_ref, block_idx, mask=column < n_sel)


def _score_kernel(q_ref, k_ref, lse_ref, score_ref, *, q_offset: int, **geometry):
    """Selection-block scores of a query tile into `score_ref [q_tile, n_cols]` (float32):
    forced blocks +inf, blocks after the query's own -inf."""
    q_tile = q_ref.shape[0]
    scorer = _make_scorer(q_ref, k_ref, lse_ref, q_offset + pl.program_id(1) * q_tile,
                          **geometry)
    block_sel = geometry["block_sel"]

    def body(k, state, masked):
        carried, carry = state
        score, carried = scorer.step(k, carried, masked)
        score_ref[:, pl.ds(k * block_sel, block_sel)] = score
        return carried, carry

    scorer.run(body, jnp.int32(0))

    def blank(k, carry):  # blocks after the tile's last query: never eligible
        score_ref[:, pl.ds(k * block_sel, block_sel)] = jnp.full((q_tile, block_sel), -jnp.inf,
                                                                 jnp.float32)
        return carry

    lax.fori_loop(scorer.n_steps, score_ref.shape[1] // block_sel, blank, 0)


def _topn_kernel(score_ref, idx_ref, *, n_sel: int):
    """`n_sel` argmax rounds over whole score rows `[R, n_cols]`: each round takes every row's
    best score, the lowest index among equal bests (the spec's tie rule; one reduction of
    (score, index) pairs), and removes it; a row yields as many blocks as it has eligible
    scores (neither `-inf` nor NaN), counted once before the rounds. Output ascending
    (`ascending_by_rank`), `-1` padded."""
    score = score_ref[...]
    score = jnp.where(score == score, score, -jnp.inf)
    column = lax.broadcasted_iota(jnp.int32, score.shape, 1)
    slot = lax.broadcasted_iota(jnp.int32, idx_ref.shape, 1)
    eligible = jnp.sum((score > -jnp.inf).astype(jnp.int32), axis=1)

    def pick(i, carry):
        score, chosen = carry
        index = lax.argmax(score, 1, jnp.int32)
        index = jnp.where(i < eligible, index, _NO_BLOCK)
        chosen = jnp.where(slot == i, index[:, None], chosen)
        score = jnp.where(column == index[:, None], -jnp.inf, score)
        return score, chosen

    _, chosen = lax.fori_loop(0, n_sel, pick,
                              (score, jnp.full(idx_ref.shape, _NO_BLOCK, jnp.int32)))
    idx_ref[...] = ascending_by_rank(chosen)


def _top_n_xla(score, n_sel: int):
    """`lax.top_k` (lower index first among equal values) and an ascending sort."""
    value, index = lax.top_k(score, n_sel)
    index = jnp.sort(jnp.where(value == -jnp.inf, _NO_BLOCK, index), axis=-1)
    return jnp.where(index >= _NO_BLOCK, -1, index).astype(jnp.int32)


def _top_n_pallas(score, n_sel: int, block_sizes: BlockSizes, interpret: bool):
    """score `[..., n_cols]` (n_cols a power of 2) -> ascending block_idx `[..., n_sel]`."""
    lead, n_cols = score.shape[:-1], score.shape[-1]
    rows = score.reshape(-1, n_cols)
    per_program = max(1, min(16, block_sizes.topn_elements // n_cols))
    n_rows = pl.cdiv(rows.shape[0], per_program) * per_program
    rows = pad_axis(rows, 0, n_rows, value=-jnp.inf)
    n_sel_pad = next_pow2(n_sel)
    idx = pallas_call(
        functools.partial(_topn_kernel, n_sel=n_sel),
        name="nsa_select_top_n",
        num_warps=block_sizes.num_warps_topn,
        num_stages=1,
        interpret=interpret,
        grid=(n_rows // per_program,),
        in_specs=[pl.BlockSpec((per_program, n_cols), lambda r: (r, 0))],
        out_specs=pl.BlockSpec((per_program, n_sel_pad), lambda r: (r, 0)),
        out_shape=jax.ShapeDtypeStruct((n_rows, n_sel_pad), jnp.int32),
    )(rows)
    return idx[:math.prod(lead), :n_sel].reshape(*lead, n_sel)


def top_n(score, n_sel: int, *, block_sizes: Optional[BlockSizes] = None,
          interpret: bool = False, implementation: str = "triton"):
    """The `n_sel` best of each row of `score [..., n]` (float32, higher is better; `-inf` and
    NaN are never picked, `+inf` always first): block_idx int32 `[..., n_sel]`, ascending, `-1`
    padded; among equal scores the lower index first (the spec's tie rule). The top-n kernel of
    `topn="pallas"` (n padded to a power of two with `-inf`); `implementation="xla"`:
    `lax.top_k` and a sort. Decode ranks its `[B, G, n_blocks]` scores with it: XLA's sort of a
    row of 1,024 took 17 us on an H100 and its top-k kernel 62 us (bench/RESULTS.md)."""
    check_implementation(implementation)
    block_sizes = block_sizes or BlockSizes()
    if not isinstance(n_sel, int) or n_sel < 1:
        raise ValueError(f"n_sel ({n_sel!r}) must be an int >= 1")
    n = max(score.shape[-1], n_sel)
    n = n if implementation == "xla" else next_pow2(n)   # the kernel's rows: a power of two
    score = pad_axis(score.astype(jnp.float32), score.ndim - 1, n, value=-jnp.inf)
    if implementation == "xla":
        return _top_n_xla(score, n_sel)
    return _top_n_pallas(score, n_sel, block_sizes, interpret)


def _selection_config(*, cmp_block, cmp_stride, sel_block, n_sel, n_init, n_local) -> NSAConfig:
    """Validate the selection hyperparameters through `NSAConfig`, the one place that checks
    them (`ValueError` naming the field, which is also the argument's name here)."""
    return NSAConfig(cmp_block=cmp_block, cmp_stride=cmp_stride, sel_block=sel_block,
                     n_sel=n_sel, n_init=n_init, n_local=n_local)


def _check_lse(lse, q):
    B, T, H, _ = q.shape
    if lse.shape != (B, T, H):
        raise ValueError(f"lse must be [B, T, H] = {(B, T, H)} to match q, got {lse.shape}")


@functools.partial(jax.jit, static_argnums=tuple(range(3, 12)))
def _select_blocks(q, k_cmp, lse, cmp_block, cmp_stride, sel_block, n_sel, n_init, n_local,
                   scale, block_sizes, interpret):
    B, T, H, d_k = q.shape
    G = k_cmp.shape[2]
    heads = H // G
    # The "rows" layout flattens (query, head) rows of one padded width: no column parts there.
    parts = column_parts(d_k, block_sizes.split_dk and block_sizes.layout == "heads")
    tiling = tiles.Tiling(seq_len=T, n_cmp=k_cmp.shape[1], heads=heads, h_pad=next_pow2(heads),
                          d_k=d_k, d_v=d_k, dk_pad=parts_width(parts), dv_pad=parts_width(parts))
    if block_sizes.layout == "heads":
        q_tile = block_sizes.block_queries
    else:
        q_tile = tiling.q_tile(block_sizes.block_q)
    block_sel = block_sizes.block_sel
    span = block_sel * (sel_block // cmp_stride)
    n_steps = ((T - 1) // sel_block) // block_sel + 1
    n_blocks = max(tiling.n_cmp, (n_steps - 1) * span + matmul_dim(span))
    k_pad = pad_axis(pad_axis(k_cmp, 1, n_blocks), 3, tiling.dk_pad)
    geometry = dict(tiling=tiling, cmp_block=cmp_block, cmp_stride=cmp_stride,
                    sel_block=sel_block, n_init=n_init, n_local=n_local, scale=scale,
                    block_sel=block_sel, span=span, head_sum_dot=block_sizes.head_sum_dot,
                    layout=block_sizes.layout, parts=parts)
    q5 = tiles.group_view(q, G)
    lse4 = tiles.group_view(lse.astype(jnp.float32), G)
    if block_sizes.topn == "fused":
        return _select_fused(q5, k_pad, lse4, n_sel, q_tile, geometry, block_sizes, interpret)

    # Score columns: every selection block, a power of two (the top-n kernel's rows), >= n_sel.
    n_cols = next_pow2(max(n_steps * block_sel, n_sel))
    bytes_per_query = B * G * n_cols * 4
    chunk = max(q_tile, block_sizes.score_bytes // bytes_per_query // q_tile * q_tile)
    pieces = []
    for start in range(0, T, chunk):  # static: a bounded score buffer per chunk of queries
        stop = min(T, start + chunk)
        kernel = functools.partial(_score_kernel, q_offset=start, **geometry)
        score = _query_tile_call(kernel, q5[:, start:stop], k_pad, lse4[:, start:stop],
                                 pl.cdiv(stop - start, q_tile) * q_tile, n_cols, jnp.float32,
                                 q_tile=q_tile,
                                 tiling=tiling, block_sizes=block_sizes, interpret=interpret,
                                 name="nsa_select_scores")
        score = score[:, :stop - start]
        if block_sizes.topn == "xla":
            pieces.append(_top_n_xla(score, n_sel))
        else:
            pieces.append(_top_n_pallas(score, n_sel, block_sizes, interpret))
    return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=1)


def _select_fused(q5, k_pad, lse4, n_sel, q_tile, geometry, block_sizes, interpret):
    T = q5.shape[1]
    kernel = functools.partial(_select_kernel, n_sel=n_sel, **geometry)
    block_idx = _query_tile_call(kernel, q5, k_pad, lse4, pl.cdiv(T, q_tile) * q_tile,
                                 next_pow2(n_sel), jnp.int32, q_tile=q_tile,
                                 tiling=geometry["tiling"], block_sizes=block_sizes,
                                 interpret=interpret, name="nsa_select_blocks")
    return block_idx[:, :T, :, :n_sel]


def _query_tile_call(kernel, q5, k_pad, lse4, rows_pad: int, out_cols: int, out_dtype, *,
                     q_tile: int, tiling: tiles.Tiling, block_sizes: BlockSizes, interpret: bool,
                     name: str):
    """One program per (batch, query tile, KV group) over q5 `[B, n, G, h, d_k]` and lse4
    `[B, n, G, h]` (padded here to `rows_pad` queries; padded rows get lse +inf, so p = 0 there)
    and every compressed key of the group -> `[B, rows_pad, G, out_cols]` of `out_dtype`."""
    B, G = q5.shape[0], q5.shape[2]
    return pallas_call(
        kernel,
        name=name,
        num_warps=block_sizes.num_warps,
        num_stages=block_sizes.num_stages,
        interpret=interpret,
        grid=(B, rows_pad // q_tile, G),
        in_specs=[tiles.row_spec(q_tile, tiling, tiling.dk_pad),
                  tiles.kv_spec(k_pad.shape[1], tiling.dk_pad),
                  tiles.row_spec(q_tile, tiling, None)],
        out_specs=pl.BlockSpec((None, q_tile, None, out_cols), lambda b, i, g: (b, i, g, 0)),
        out_shape=jax.ShapeDtypeStruct((B, rows_pad, G, out_cols), out_dtype),
    )(tiles.pad_rows(q5, rows_pad, tiling, tiling.dk_pad), k_pad,
      tiles.pad_rows(lse4, rows_pad, tiling, None, value=jnp.inf))


def select_blocks(q, k_cmp, lse, *, cmp_block: int, cmp_stride: int, sel_block: int, n_sel: int,
                  n_init: int, n_local: int, scale: Optional[float] = None,
                  block_sizes: Optional[BlockSizes] = None, interpret: bool = False,
                  implementation: str = "triton"):
    """Selected blocks of every query and KV group (spec step 6), as a Pallas Triton kernel.

    Args:
      q: `[B, T, H, d_k]`, queries at positions `0..T-1`.
      k_cmp: `[B, C, G, d_k]`, compressed keys.
      lse: `[B, T, H]` float32, the log-sum-exp `compressed_attention` returns with the same
        `q`, `k_cmp`, `scale` (`-inf` where a query sees no compressed block).
      cmp_block, cmp_stride, sel_block, n_sel, n_init, n_local: l, d, l_sel and the selection
        counts of the spec (checked as `NSAConfig` checks them).
      scale: softmax scale, `1/sqrt(d_k)` when None. block_sizes: tiles (None: this GPU
        architecture's, `pallas_kernels.profiles`). interpret: run in Pallas' interpreter (CPU tests). implementation: "triton"
        (the Pallas Triton kernels) or "xla" (the reference below).

    Raises NotImplementedError for inputs outside `_common.KERNEL_DTYPES` (float64) with
    "triton", and for a d_k the architecture has no tiles for (`profiles`).

    Returns:
      `block_idx int32 [B, T, G, n_sel]`: the chosen selection blocks in ascending order, `-1`
      padded at the end. No gradient (the scores are computed under `stop_gradient`).
    """
    check_implementation(implementation)
    scale = tiles.check_inputs(q, k_cmp, cmp_block=cmp_block, cmp_stride=cmp_stride, scale=scale)
    _selection_config(cmp_block=cmp_block, cmp_stride=cmp_stride, sel_block=sel_block,
                      n_sel=n_sel, n_init=n_init, n_local=n_local)
    _check_lse(lse, q)
    if implementation == "xla":
        return select_blocks_reference(q, k_cmp, lse, cmp_block=cmp_block, cmp_stride=cmp_stride,
                                       sel_block=sel_block, n_sel=n_sel, n_init=n_init,
                                       n_local=n_local, scale=scale)
    check_kernel_dtype("select_blocks", q.dtype)
    if q.shape[0] == 0:  # no sequence: no grid to launch
        return jnp.full((0, q.shape[1], k_cmp.shape[2], n_sel), -1, jnp.int32)
    if block_sizes is None:
        from pallas_kernels import profiles
        block_sizes = profiles.block_sizes("select", q.dtype, q.shape[3])
    if not isinstance(block_sizes, BlockSizes):
        raise ValueError(f"block_sizes must be a select_blocks.BlockSizes, got "
                         f"{type(block_sizes).__name__}")
    q, k_cmp, lse = (lax.stop_gradient(x) for x in (q, k_cmp, lse))
    return _select_blocks(q, k_cmp, lse, cmp_block, cmp_stride, sel_block, n_sel, n_init,
                          n_local, scale, block_sizes, interpret)


# ----------------------------------------------------------------------------------------------
# Plain-JAX reference


def select_blocks_reference(q, k_cmp, lse=None, *, cmp_block: int, cmp_stride: int,
                            sel_block: int, n_sel: int, n_init: int, n_local: int,
                            scale: Optional[float] = None, q_offset: int = 0):
    """Plain-jnp block selection in float32, with the dense `[T, C]` probabilities and the
    `nsa_common.overlap_weights` matrix. Same contract as `select_blocks`; `lse=None` computes
    the log-sum-exp here. `q_offset` places the queries at `q_offset .. q_offset + T - 1` (to
    evaluate a long sequence a chunk of queries at a time). Memory O(B T H C): tests only.
    """
    scale = tiles.check_inputs(q, k_cmp, cmp_block=cmp_block, cmp_stride=cmp_stride, scale=scale)
    cfg = _selection_config(cmp_block=cmp_block, cmp_stride=cmp_stride, sel_block=sel_block,
                            n_sel=n_sel, n_init=n_init, n_local=n_local)
    if lse is not None:
        _check_lse(lse, q)
    B, T, H, _ = q.shape
    C, G = k_cmp.shape[1], k_cmp.shape[2]
    qg = tiles.group_view(lax.stop_gradient(q), G).astype(jnp.float32)
    s = jnp.einsum("btghd,bcgd->btghc", qg, lax.stop_gradient(k_cmp).astype(jnp.float32),
                   precision=lax.Precision.HIGHEST) * scale
    mask = tiles.reference_mask(T, C, cmp_block, cmp_stride, q_offset)[None, :, None, None, :]
    if lse is None:
        lse = jax.nn.logsumexp(jnp.where(mask, s, -jnp.inf), axis=-1)
    else:
        lse = tiles.group_view(lax.stop_gradient(lse), G).astype(jnp.float32)
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]
    p_cmp = jnp.where(mask, jnp.exp(jnp.where(mask, s, 0.0) - lse), 0.0)

    n_sel_blocks = (q_offset + T - 1) // sel_block + 1
    weights = jnp.asarray(overlap_weights(cfg, C, n_sel_blocks))
    p_sel = jnp.einsum("btghc,cj->btghj", p_cmp, weights, precision=lax.Precision.HIGHEST)
    score = p_sel.sum(axis=3)  # [B, T, G, n_sel_blocks]

    last = (q_offset + jnp.arange(T)) // sel_block
    block = jnp.arange(n_sel_blocks)
    eligible = (block[None, :] <= last[:, None])[None, :, None, :]
    forced = ((block[None, :] < n_init) | (block[None, :] > last[:, None] - n_local))[
        None, :, None, :]
    score = jnp.where(eligible, jnp.where(forced, jnp.inf, score), -jnp.inf)
    if n_sel_blocks < n_sel:
        score = pad_axis(score, 3, n_sel, value=-jnp.inf)
    # lax.top_k puts the lower index first among equal values: the spec's tie rule.
    value, index = lax.top_k(score, n_sel)
    index = jnp.sort(jnp.where(value == -jnp.inf, _NO_BLOCK, index), axis=-1)
    return jnp.where(index == _NO_BLOCK, -1, index).astype(jnp.int32)


__all__ = ["BlockSizes", "select_blocks", "select_blocks_reference"]
