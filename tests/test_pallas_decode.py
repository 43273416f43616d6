"""Pallas decode kernels (`pallas_kernels.decode`) in interpret mode against their plain-JAX
references and a NumPy brute force, the banded selection scores against the dense overlap
matrix, and `decode_step(..., backend="pallas")` against the full layer at every position."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nsa_jax
from jax_inputs import make_inputs
from nsa_common.testing import rel_err
from nsa_common import NSAConfig, overlap_weights
from nsa_jax.pallas_backend import PallasOptions
from nsa_jax.xla.select_blocks import band_scores, top_blocks
from pallas_kernels import decode as D

F32_TOL = 1e-5


# The plain-JAX references and the unfused selection, jitted: one compilation a shape instead of
# one an operation.
compressed_reference = jax.jit(D.decode_compressed_reference,
                               static_argnames=("cmp_block", "cmp_stride", "scale"))
selected_window_reference = jax.jit(D.decode_selected_window_reference,
                                    static_argnames=("sel_block", "window", "scale"))
compressed_select_reference = jax.jit(
    D.decode_compressed_select_reference,
    static_argnames=("cmp_block", "cmp_stride", "sel_block", "n_sel", "n_init", "n_local",
                     "n_blocks", "scale"))


@functools.partial(jax.jit, static_argnames=("cfg", "n_blocks"))
def unfused_blocks(p_group, t, cfg, n_blocks):
    """The unfused path's blocks: `band_scores` of the group probabilities `[B, G, C]`, then
    `top_blocks` at positions t `[B]`."""
    return top_blocks(band_scores(p_group, cfg, n_blocks), t[:, None], cfg)


def _inputs(B, H, G, dk, dv, C, L, ring, dtype, seed=0):
    rng = np.random.default_rng(seed)
    normal = lambda shape: jnp.asarray(rng.standard_normal(shape, np.float32), dtype)  # noqa: E731
    return dict(q=normal((B, H, dk)),
                k_cmp=normal((B, C, G, dk)), v_cmp=normal((B, C, G, dv)),
                k_sel=normal((B, L, G, dk)), v_sel=normal((B, L, G, dv)),
                k_win=normal((B, ring, G, dk)), v_win=normal((B, ring, G, dv)))


def _block_idx(B, G, n_sel, t, l_sel, seed):
    """Random ascending blocks <= t // l_sel, -1 padded (one slot always -1)."""
    rng = np.random.default_rng(seed)
    idx = np.full((B, G, n_sel), -1, np.int32)
    n_blocks = t // l_sel + 1
    for b in range(B):
        for g in range(G):
            chosen = np.sort(rng.choice(n_blocks, size=min(n_sel - 1, n_blocks), replace=False))
            idx[b, g, :len(chosen)] = chosen
    return jnp.asarray(idx)


def _brute_force(q, k, v, allowed, scale):
    """NumPy float64: q [H, dk], k [S, dk], v [S, dv], allowed [S] -> o [H, dv] (0 if none)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    if not allowed.any():
        return np.zeros((q.shape[0], v.shape[1]))
    s = q @ k[allowed].T * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v[allowed]


# C, L and the ring either shorter than a tile (padded copy) or longer and not a multiple of it
# (the last tile starts early and masks the overlap): both ways of reading a cache.
SHAPES = [
    # B, H, G, dk, dv, C, L, ring, l, d, l_sel, n_sel, w
    (2, 8, 2, 16, 16, 24, 100, 24, 8, 4, 16, 4, 24),
    (1, 4, 4, 32, 16, 70, 150, 70, 8, 4, 16, 5, 70),      # h = 1, d_k != d_v, 70 slots
    (2, 6, 2, 24, 8, 140, 600, 130, 32, 16, 64, 3, 100),  # h = 3, d_k 24 (padded), ring > w
    (1, 4, 2, 48, 32, 70, 150, 70, 8, 4, 16, 5, 70),      # d_k 48 read as 32 + 16
]


# Split-KV: 16-slot tiles split 3 ways leave uneven shares (and splits with no work at small
# t). The default tiles (64 slots, one split per tile) run in the other tests of this file,
# where the tiny caches often hold a single tile: the plain one-split pass.
SPLIT_3_WAYS = D.DecodeBlockSizes(block_cmp=16, block_win=16, target_programs=3, max_splits=3)


@pytest.mark.parametrize("shape", SHAPES[:1] + [pytest.param(shape, marks=pytest.mark.slow)
                                   for shape in SHAPES[1:]])
def test_kernels_match_reference_and_brute_force(shape):
    B, H, G, dk, dv, C, L, ring, l, d, l_sel, n_sel, w = shape
    x = _inputs(B, H, G, dk, dv, C, L, ring, jnp.float32)
    scale = 0.3
    h = H // G
    bs = SPLIT_3_WAYS
    # Jitted with t traced: one interpretation per kernel for all positions.
    compressed = jax.jit(lambda q, k, v, t: D.decode_compressed(
        q, k, v, t, cmp_block=l, cmp_stride=d, scale=scale, interpret=True, block_sizes=bs))
    selected_window = jax.jit(lambda q, ks, vs, idx, kw, vw, t: D.decode_selected_window(
        q, ks, vs, idx, kw, vw, t, sel_block=l_sel, window=w, scale=scale, interpret=True,
        block_sizes=bs))
    for t in sorted({0, l - 2, l - 1, l + d, min(L, C * d + l) - 1, ring - 1, L - 1}):
        if t >= L or t < 0:
            continue
        o, lse, p = compressed(x["q"], x["k_cmp"], x["v_cmp"], t)
        o_r, lse_r, p_r = compressed_reference(x["q"], x["k_cmp"], x["v_cmp"], t,
                                               cmp_block=l, cmp_stride=d, scale=scale)
        np.testing.assert_allclose(o, o_r, atol=2e-6)
        np.testing.assert_allclose(p, p_r, atol=2e-6)
        assert np.array_equal(np.isinf(lse), np.isinf(lse_r))
        np.testing.assert_allclose(np.where(np.isinf(lse), 0, lse),
                                   np.where(np.isinf(lse_r), 0, lse_r), atol=2e-6)
        idx = _block_idx(B, G, n_sel, t, l_sel, seed=t)
        o_sel, o_win = selected_window(x["q"], x["k_sel"], x["v_sel"], idx, x["k_win"],
                                       x["v_win"], t)
        ref_sel, ref_win = selected_window_reference(
            x["q"], x["k_sel"], x["v_sel"], idx, x["k_win"], x["v_win"], t, sel_block=l_sel,
            window=w, scale=scale)
        np.testing.assert_allclose(o_sel, ref_sel, atol=2e-6)
        np.testing.assert_allclose(o_win, ref_win, atol=2e-6)
        # Brute force for one (batch row, group): explicit token sets.
        b, g = B - 1, G - 1
        heads = slice(g * h, (g + 1) * h)
        visible = np.arange(C) * d + l - 1 <= t
        np.testing.assert_allclose(o[b, heads], _brute_force(
            x["q"][b, heads], x["k_cmp"][b, :, g], x["v_cmp"][b, :, g], visible, scale),
            atol=2e-6)
        tokens = np.arange(L)
        chosen = np.isin(tokens // l_sel, [j for j in np.asarray(idx[b, g]) if j >= 0])
        np.testing.assert_allclose(o_sel[b, heads], _brute_force(
            x["q"][b, heads], x["k_sel"][b, :, g], x["v_sel"][b, :, g],
            chosen & (tokens <= t), scale), atol=2e-6)
        slot_token = t - (t - np.arange(ring)) % ring
        np.testing.assert_allclose(o_win[b, heads], _brute_force(
            x["q"][b, heads], x["k_win"][b, :, g], x["v_win"][b, :, g],
            (slot_token >= 0) & (slot_token > t - w), scale), atol=2e-6)


def test_kernels_take_a_position_per_row():
    """t `[B]`: each row attends at its own position, as the reference does row by row."""
    B, H, G, dk, dv, C, L, ring = 3, 4, 2, 16, 16, 40, 100, 24
    x = _inputs(B, H, G, dk, dv, C, L, ring, jnp.float32, seed=11)
    t = jnp.array([5, 99, 40], jnp.int32)
    idx = jnp.concatenate([_block_idx(1, G, 4, int(t_b), 16, seed=b)
                           for b, t_b in enumerate(t)])
    compressed = jax.jit(functools.partial(D.decode_compressed, cmp_block=8, cmp_stride=4,
                                           scale=0.3, interpret=True))
    selected_window = jax.jit(functools.partial(D.decode_selected_window, sel_block=16,
                                                window=24, scale=0.3, interpret=True))
    o, lse, p = compressed(x["q"], x["k_cmp"], x["v_cmp"], t)
    o_sel, o_win = selected_window(x["q"], x["k_sel"], x["v_sel"], idx, x["k_win"], x["v_win"],
                                   t)
    rows = {k: np.asarray(v) for k, v in x.items()}
    for b, t_b in enumerate(np.asarray(t)):
        row = {k: v[b:b + 1] for k, v in rows.items()}
        o_r, _, p_r = compressed_reference(row["q"], row["k_cmp"], row["v_cmp"], int(t_b),
                                           cmp_block=8, cmp_stride=4, scale=0.3)
        np.testing.assert_allclose(o[b:b + 1], o_r, atol=2e-6)
        np.testing.assert_allclose(p[b:b + 1], p_r, atol=2e-6)
        sel_r, win_r = selected_window_reference(
            row["q"], row["k_sel"], row["v_sel"], np.asarray(idx)[b:b + 1], row["k_win"],
            row["v_win"], int(t_b), sel_block=16, window=24, scale=0.3)
        np.testing.assert_allclose(o_sel[b:b + 1], sel_r, atol=2e-6)
        np.testing.assert_allclose(o_win[b:b + 1], win_r, atol=2e-6)


@pytest.mark.slow
def test_kernels_bfloat16_and_empty_rows():
    B, H, G, dk, dv, C, L, ring = 2, 32, 2, 64, 64, 80, 200, 64
    x = _inputs(B, H, G, dk, dv, C, L, ring, jnp.bfloat16, seed=3)
    f32 = {k: v.astype(jnp.float32) for k, v in x.items()}
    for t in (10, 150):   # t = 10 < l - 1: no compressed block yet
        o, lse, p = D.decode_compressed(x["q"], x["k_cmp"], x["v_cmp"], t, cmp_block=32,
                                        cmp_stride=16, scale=0.125, interpret=True)
        o_r, _, p_r = compressed_reference(f32["q"], f32["k_cmp"], f32["v_cmp"], t,
                                           cmp_block=32, cmp_stride=16, scale=0.125)
        assert o.dtype == jnp.bfloat16 and p.dtype == jnp.float32
        if t < 31:
            assert not np.any(np.asarray(o, np.float32)) and np.all(np.isneginf(lse))
            assert not np.any(np.asarray(p))
        else:
            assert rel_err(o, o_r) <= 1e-2
            np.testing.assert_allclose(p, p_r, atol=1e-5)
        idx = _block_idx(B, G, 4, t, 64, seed=t)
        got = D.decode_selected_window(x["q"], x["k_sel"], x["v_sel"], idx, x["k_win"],
                                       x["v_win"], t, sel_block=64, window=64, scale=0.125,
                                       interpret=True)
        ref = selected_window_reference(f32["q"], f32["k_sel"], f32["v_sel"], idx,
                                        f32["k_win"], f32["v_win"], t, sel_block=64,
                                        window=64, scale=0.125)
        for a, r in zip(got, ref):
            assert a.dtype == jnp.bfloat16 and rel_err(a, r) <= 1e-2


@pytest.mark.parametrize("l,d,l_sel", [(32, 16, 64), (8, 4, 16), (16, 16, 16), (12, 4, 24),
                                       (4, 2, 16)])
@pytest.mark.parametrize("C,S", [(0, 3), (1, 1), (7, 2), (50, 13), (20, 40)])
def test_band_scores_equal_the_dense_overlap_matrix(l, d, l_sel, C, S):
    cfg = NSAConfig.tiny(cmp_block=l, cmp_stride=d, sel_block=l_sel)
    p = np.random.default_rng(C + S).random((3, 2, C)).astype(np.float32)
    np.testing.assert_allclose(band_scores(jnp.asarray(p), cfg, S),
                               p @ overlap_weights(cfg, C, S), atol=1e-5)


def _generation(params, x, cfg, max_len, backend):
    cache = nsa_jax.init_cache(cfg, x.shape[0], max_len, x.dtype)
    step = jax.jit(lambda p, x_t, c: nsa_jax.decode_step(p, x_t, cfg, c, return_aux=True,
                                                         backend=backend))
    ys, idx, reads = [], [], []
    for t in range(x.shape[1]):
        y_t, cache, r, aux = step(params, x[:, t:t + 1], cache)
        ys.append(y_t)
        idx.append(aux["block_idx"][:, 0])
        reads.append({k: np.asarray(v).tolist() for k, v in r.items()})
    return jnp.concatenate(ys, axis=1), idx, reads


def _tie_heavy_scores(rows: int, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    scores = rng.integers(0, 4, size=(rows, n)).astype(np.float32)
    scores[::5] = rng.standard_normal((len(scores[::5]), n))
    scores[1::9] = 0.0
    scores[2::9] = -0.0
    scores[3::13, ::7] = np.inf
    return scores


@pytest.mark.parametrize("n_blocks,n_sel", [(1024, 16), (37, 5), (3, 4)])
def test_decode_ranking_equals_the_sort(n_blocks, n_sel):
    """The Pallas decode path ranks with `rank_scores` + the top-n kernel (interpret mode): the
    same blocks as `top_blocks`' sort on tie-heavy rows (ties, +-0, +inf, rows with fewer
    eligible blocks than n_sel)."""
    import pallas_kernels
    from nsa_jax.xla.select_blocks import rank_scores

    cfg = NSAConfig.paper(d_k=128, n_sel=n_sel)
    scores = jnp.asarray(_tie_heavy_scores(24, n_blocks, seed=n_blocks))
    t = jnp.asarray(np.random.default_rng(1).integers(0, n_blocks * 64, size=24), jnp.int32)
    want = np.asarray(top_blocks(scores, t, cfg))
    got = pallas_kernels.top_n(rank_scores(scores, t, cfg), n_sel, interpret=True)
    np.testing.assert_array_equal(np.asarray(got), want)
    got_xla = pallas_kernels.top_n(rank_scores(scores, t, cfg), n_sel, implementation="xla")
    np.testing.assert_array_equal(np.asarray(got_xla), want)


SELECT_SHAPES = [
    (8, 4, 16, 4, 12, 40),      # the paper's ratios, 4x smaller
    (32, 16, 64, 16, 30, 100),  # the paper's sizes
    (16, 16, 16, 3, 9, 9),      # l = d = l_sel: the overlap matrix is the identity
    (12, 4, 24, 5, 7, 37),      # r = 6 (not a power of two), two slots before each block
    (8, 4, 16, 8, 5, 20),       # fewer blocks than n_sel
    (8, 4, 16, 4, 100, 400),    # 7 programs of 16 blocks per row, 1 more writing the padding
]
SELECT_TILES = [(16, True), (64, True), (16, False)]  # block_sel, contiguous


def _fused_select(q, k_cmp, v_cmp, t, tiles, **kw):
    """`decode_compressed_select` in interpret mode with the tiles `DecodeBlockSizes`, jitted."""
    select = jax.jit(functools.partial(D.decode_compressed_select, interpret=True,
                                       block_sizes=tiles, **kw))
    return select(q, k_cmp, v_cmp, t)


def _unfused_compressed(q, k_cmp, v_cmp, t, **kw):
    """`decode_compressed` in interpret mode (the unfused selection's probabilities), jitted."""
    compressed = jax.jit(functools.partial(D.decode_compressed, interpret=True, **kw))
    return compressed(q, k_cmp, v_cmp, t)


def _select_case(tiles, shape):
    """The default run keeps the first shape on every tiling and three more on the first (the
    last: an output padded to the top-n kernel's power-of-two rows); the rest is slow."""
    fast = shape == SELECT_SHAPES[0] or (tiles == SELECT_TILES[0]
                                         and shape in SELECT_SHAPES[2:4] + SELECT_SHAPES[5:])
    return pytest.param(*tiles, *shape, marks=() if fast else pytest.mark.slow)


@pytest.mark.parametrize("block_sel,contiguous,l,d,l_sel,n_sel,n_blocks,C",
                         [_select_case(t, s) for t in SELECT_TILES for s in SELECT_SHAPES])
def test_decode_compressed_select_matches_the_unfused_path(l, d, l_sel, n_sel, n_blocks, C,
                                                           block_sel, contiguous):
    """The fused selection (interpret mode) picks the blocks of the unfused path
    (`decode_compressed`'s probabilities, `band_scores`, `top_blocks`) and of its plain-JAX
    reference, with the same o and lse, rows at different positions (one before any block);
    selection programs of 16 and 64 blocks, the slots read as contiguous tiles (where l_sel / d
    is a power of two) or with strided loads only."""
    B, H, G = 4, 8, 2
    x = _inputs(B, H, G, 16, 16, C, 64, 32, jnp.float32, seed=C)
    t = jnp.asarray([n_blocks * l_sel - 1, l_sel * 2 + 3, l - 2, (C - 1) * d + l - 1], jnp.int32)
    kw = dict(cmp_block=l, cmp_stride=d, sel_block=l_sel, n_sel=n_sel, n_init=1, n_local=2,
              n_blocks=n_blocks, scale=0.3)
    tiles = D.DecodeBlockSizes(block_sel=block_sel, select_contiguous=contiguous)
    o, lse, idx = _fused_select(x["q"], x["k_cmp"], x["v_cmp"], t, tiles, **kw)
    o_r, lse_r, idx_r = compressed_select_reference(x["q"], x["k_cmp"], x["v_cmp"], t, **kw)
    o_u, lse_u, p_group = _unfused_compressed(x["q"], x["k_cmp"], x["v_cmp"], t, cmp_block=l,
                                              cmp_stride=d, scale=0.3)
    cfg = NSAConfig.tiny(cmp_block=l, cmp_stride=d, sel_block=l_sel, n_sel=n_sel, n_init=1,
                         n_local=2, window=l_sel)
    want = np.asarray(unfused_blocks(p_group, t, cfg, n_blocks))
    np.testing.assert_array_equal(np.asarray(idx), want)
    np.testing.assert_array_equal(np.asarray(idx_r), want)
    assert rel_err(o, o_u) <= F32_TOL and rel_err(o, o_r) <= F32_TOL
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse_u))
    # t = l - 2: no compressed block yet, only the forced block 0.
    np.testing.assert_array_equal(np.asarray(idx)[2], [[0] + [-1] * (n_sel - 1)] * G)


@pytest.mark.parametrize("forced", [False, True])
def test_decode_attention_equals_its_two_entries(forced):
    """`decode_attention` (one combine for the three branches' splits, interpret mode) gives the
    outputs and blocks of `decode_compressed_select` then `decode_selected_window`, and of the
    plain-JAX path; with block_idx given, the selected branch reads those blocks. Tiles split
    the compressed slots and the selected blocks 3 ways (combined parts of different S_pad;
    3 splits of 2 blocks stop at n_sel = 4)."""
    B, H, G, dk, dv, C, L, ring, l, d, l_sel, n_sel, w = SHAPES[0]
    x = _inputs(B, H, G, dk, dv, C, L, ring, jnp.float32, seed=7)
    t = jnp.asarray([L - 1, 2 * l_sel + 5], jnp.int32)
    n_blocks = L // l_sel + 1
    sel = dict(cmp_block=l, cmp_stride=d, sel_block=l_sel, n_sel=n_sel, n_init=1, n_local=2,
               n_blocks=n_blocks, scale=0.3)
    bs = dataclasses.replace(SPLIT_3_WAYS, target_programs=12)
    # Every slot of row 0 holds a block, so a split reading past n_sel would count one twice.
    given = jnp.asarray([[[0, 2, 4, 6], [1, 3, 5, 6]], [[0, 1, 2, -1], [2, -1, -1, -1]]],
                        jnp.int32) if forced else None
    caches = (x["q"], x["k_cmp"], x["v_cmp"], x["k_sel"], x["v_sel"], x["k_win"], x["v_win"])
    got = jax.jit(functools.partial(D.decode_attention, window=w, block_sizes=bs,
                                    interpret=True, **sel))(*caches, t, block_idx=given)
    o_cmp, _, idx = jax.jit(functools.partial(D.decode_compressed_select, block_sizes=bs,
                                              interpret=True, **sel))(*caches[:3], t)
    idx = idx if given is None else given
    o_sel, o_win = D.decode_selected_window(
        x["q"], x["k_sel"], x["v_sel"], idx, x["k_win"], x["v_win"], t, sel_block=l_sel,
        window=w, scale=0.3, block_sizes=bs, interpret=True)
    ref = D.decode_attention(*caches, t, window=w, block_idx=given, implementation="xla", **sel)
    np.testing.assert_array_equal(np.asarray(got[3]), np.asarray(idx))
    np.testing.assert_array_equal(np.asarray(ref[3]), np.asarray(idx))
    for a, b, r in zip(got[:3], (o_cmp, o_sel, o_win), ref[:3]):
        np.testing.assert_allclose(a, b, atol=2e-6)
        np.testing.assert_allclose(a, r, atol=2e-6)
    assert got[4] is None and ref[4] is None


def test_decode_attention_reads_q_out_of_the_heads_row():
    """With q_rows (q's values first in a wider row, other heads after them) the kernels read q
    there, not q's own array (NaN here): the same outputs and blocks as with q itself
    (interpret mode), 16 heads a group."""
    rng = np.random.default_rng(10)
    B, G, h, dk, C, L, ring = 2, 2, 16, 16, 24, 100, 24
    H = G * h
    x = _inputs(B, H, G, dk, dk, C, L, ring, jnp.float32, seed=11)
    rows = jnp.concatenate([x["q"].reshape(B, H * dk),
                            jnp.asarray(rng.standard_normal((B, 6 * dk)), jnp.float32)], axis=1)
    t = jnp.asarray([L - 1, 30], jnp.int32)
    sel = dict(cmp_block=8, cmp_stride=4, sel_block=16, n_sel=4, n_init=1, n_local=2,
               n_blocks=L // 16 + 1, window=24, scale=0.3)
    caches = (x["q"], x["k_cmp"], x["v_cmp"], x["k_sel"], x["v_sel"], x["k_win"], x["v_win"])
    want = D.decode_attention(*caches, t, interpret=True, **sel)
    got = D.decode_attention(jnp.full_like(x["q"], jnp.nan), *caches[1:], t, q_rows=rows,
                             interpret=True, **sel)
    np.testing.assert_array_equal(np.asarray(got[3]), np.asarray(want[3]))
    for a, b in zip(got[:3], want[:3]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_decode_attention_mixes_the_branches_by_the_gates():
    """With the step's gate logits (columns of a wider projection row) and bias, the combine
    kernel also returns `sum_j sigmoid(logit_j + bias_j) * o_j` (the layer's
    `mix_branches(gates_from_logits)`), 16 heads a group in two head chunks; where a
    group's heads are not a power of two >= 16 it returns no mix."""
    from nsa_jax.core import mix_branches

    rng = np.random.default_rng(8)
    B, G, h, dk, dv, C, L, ring = 2, 2, 16, 16, 16, 288, 100, 24
    H = G * h
    x = _inputs(B, H, G, dk, dv, C, L, ring, jnp.float32, seed=9)
    t = jnp.asarray([L - 1, 37], jnp.int32)
    offset, width = 11, 3 * H + 20
    row = jnp.asarray(3 * rng.standard_normal((B, width)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(3 * H), jnp.float32)
    sel = dict(cmp_block=8, cmp_stride=4, sel_block=16, n_sel=4, n_init=1, n_local=2,
               n_blocks=L // 16 + 1, window=24, scale=0.3)
    caches = (x["q"], x["k_cmp"], x["v_cmp"], x["k_sel"], x["v_sel"], x["k_win"], x["v_win"])
    # 18 splits of the compressed slots (S_pad 32): h_c = 8, two head chunks of a group.
    bs = D.DecodeBlockSizes(block_cmp=16, target_programs=72, max_splits=18)
    o_cmp, o_sel, o_win, _, o = D.decode_attention(*caches, t, gate=(row, offset, bias),
                                                   block_sizes=bs, interpret=True, **sel)
    gates = jax.nn.sigmoid(row[:, offset:offset + 3 * H] + bias).reshape(B, 1, H, 3)
    want = mix_branches(gates, o_cmp[:, None], o_sel[:, None], o_win[:, None])[:, 0]
    np.testing.assert_allclose(o, want, atol=2e-6)
    assert float(jnp.abs(o - o_sel).max()) > 1e-2
    x4 = _inputs(B, 8, G, dk, dv, C, L, ring, jnp.float32, seed=9)    # 4 heads a group
    caches4 = (x4["q"],) + caches[1:]
    assert D.decode_attention(*caches4, t, gate=(row, offset, bias[:24]), interpret=True,
                              **sel)[4] is None


@pytest.mark.parametrize("splits,s_pad", [(1, 1), (3, 4), (16, 16), (5, 8), (37, 64)])
def test_combine_kernel_equals_the_xla_combine(splits, s_pad):
    """The split-KV combine kernel (interpret mode) against `combine_splits`: random partial
    softmaxes, a split without keys (-inf), a row no split saw (o 0, lse -inf), and the unwritten
    padding rows of S_pad holding NaN (masked). S_pad 64 splits the heads over 4 programs and
    d_v over 2."""
    rng = np.random.default_rng(splits)
    B, G, h, dv = 2, 3, 16, 32
    o = rng.standard_normal((B, G, s_pad, h, dv)).astype(np.float32)
    lse = (3 * rng.standard_normal((B, G, s_pad, h))).astype(np.float32)
    lse[0, 0, 0, :] = -np.inf
    lse[1, 2, :, 5] = -np.inf
    o[..., splits:, :, :], lse[..., splits:, :] = np.nan, np.nan
    [(got, got_lse)] = D._combine([(jnp.asarray(o), jnp.asarray(lse), splits)], jnp.float32,
                                  num_warps=4, interpret=True)
    want, want_lse = D.combine_splits(jnp.asarray(o[:, :, :splits]),
                                      jnp.asarray(lse[:, :, :splits]))
    assert rel_err(got, want) <= F32_TOL
    np.testing.assert_allclose(got_lse, want_lse, rtol=1e-6)
    assert np.all(np.asarray(got)[1, 2, 5] == 0) and np.asarray(got_lse)[1, 2, 5] == -np.inf


def test_append_rows_writes_in_place_and_drops_out_of_range_rows():
    """The append kernel (interpret mode) writes each token at its row of its buffer, leaves
    every other row as it was, and writes nothing for an index past the buffer's end; the
    result equals XLA's scatter (`put_rows`)."""
    import pallas_kernels
    from nsa_jax.xla.decode import put_rows

    rng = np.random.default_rng(3)
    B, G = 3, 2
    # Rows of 32 and 64 columns (one part each) and of 48 (32 + 16) and 384 = 256 + 128 (the
    # paper's G*d_k is 768 = 512 + 256): two column parts.
    buffers = tuple(jnp.asarray(rng.standard_normal((B, S, G, d)), jnp.bfloat16)
                    for S, d in ((40, 16), (8, 32), (5, 16), (6, 24), (7, 192)))
    tokens = tuple(jnp.asarray(rng.standard_normal((B, G, b.shape[3])), jnp.float32)
                   for b in buffers)
    index = (jnp.asarray([0, 39, 40], jnp.int32), jnp.asarray([7, 3, 100], jnp.int32),
             jnp.asarray([2, 4, 0], jnp.int32), jnp.asarray([5, 0, 6], jnp.int32),
             jnp.asarray([6, 1, 3], jnp.int32))
    got = pallas_kernels.append_rows(buffers, tokens, index, interpret=True)
    for g, b, t, i in zip(got, buffers, tokens, index):
        want = put_rows(b, t[:, None], i[:, None])
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(want, np.float32))
    # 3 x 16 = 48 = 32 + 16 is written; 3 x 8 = 24 (a part under 16) and 3 x 40 = 120 (three
    # binary parts) are declined, for XLA's scatter.
    for d in (8, 40):
        with pytest.raises(NotImplementedError, match="power of two"):
            pallas_kernels.append_rows((jnp.zeros((1, 4, 3, d)),), (jnp.zeros((1, 3, d)),),
                                       (jnp.zeros((1,), jnp.int32),), interpret=True)


def test_append_rows_packed_reads_tokens_and_rows_out_of_their_arrays():
    """The packed append (interpret mode): buffer i's token is columns `[off, off + G*d)` of
    its source, its row a column of one index array; the same writes as `append_rows` over
    the sliced tokens, an index past the end writing nothing; bad columns raise."""
    import pallas_kernels

    rng = np.random.default_rng(4)
    B, G = 3, 2
    buffers = tuple(jnp.asarray(rng.standard_normal((B, S, G, d)), jnp.bfloat16)
                    for S, d in ((40, 16), (8, 32), (5, 16), (6, 24)))
    sources = (jnp.asarray(rng.standard_normal((B, 100)), jnp.float32),
               jnp.asarray(rng.standard_normal((B, 70)), jnp.bfloat16))
    columns = ((0, 3), (1, 6), (0, 68), (0, 50))
    index = jnp.asarray([[0, 7], [39, 3], [40, 100]], jnp.int32)
    index_columns = (0, 1, 0, 1)
    got = pallas_kernels.append_rows_packed(buffers, sources, columns, index, index_columns,
                                            interpret=True)
    tokens = tuple(sources[s][:, off:off + b.shape[2] * b.shape[3]].reshape(b.shape[0], G, -1)
                   for (s, off), b in zip(columns, buffers))
    want = pallas_kernels.append_rows(buffers, tokens, tuple(index[:, j] for j in index_columns),
                                      interpret=True)
    for g, w, b in zip(got, want, buffers):
        assert g.shape == b.shape and g.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    assert not np.array_equal(np.asarray(got[0], np.float32), np.asarray(buffers[0], np.float32))
    with pytest.raises(ValueError, match="outside sources"):
        pallas_kernels.append_rows_packed(buffers, sources, ((0, 90),) * 4, index,
                                          (0, 0, 0, 0), interpret=True)


def test_append_step_packed_works_out_each_buffers_row():
    """The step's packed append (interpret mode): buffer i gets its columns at row `t % S_i`
    where `t < limit` (a token buffer of limit rows: the position; a ring: its slot), the same
    writes as `append_rows` at those rows; a position at the limit writes nothing anywhere."""
    import pallas_kernels

    rng = np.random.default_rng(5)
    B, G, limit = 3, 2, 40
    buffers = tuple(jnp.asarray(rng.standard_normal((B, S, G, d)), jnp.bfloat16)
                    for S, d in ((limit, 16), (8, 32), (5, 16), (6, 24)))
    sources = (jnp.asarray(rng.standard_normal((B, 100)), jnp.float32),
               jnp.asarray(rng.standard_normal((B, 70)), jnp.bfloat16))
    columns = ((0, 3), (1, 6), (0, 68), (0, 50))
    t = jnp.asarray([13, 39, 40], jnp.int32)
    got = pallas_kernels.append_step_packed(buffers, sources, columns, t, limit=limit,
                                            interpret=True)
    tokens = tuple(sources[s][:, off:off + b.shape[2] * b.shape[3]].reshape(b.shape[0], G, -1)
                   for (s, off), b in zip(columns, buffers))
    rows = tuple(jnp.where(t < limit, t % b.shape[1], b.shape[1]) for b in buffers)
    want = pallas_kernels.append_rows(buffers, tokens, rows, interpret=True)
    for g, w, b in zip(got, want, buffers):
        assert g.shape == b.shape and g.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
        np.testing.assert_array_equal(np.asarray(g[2], np.float32), np.asarray(b[2], np.float32))
    assert np.asarray(got[1][0, 13 % 8] != buffers[1][0, 13 % 8]).any()
    with pytest.raises(ValueError, match="positions must be"):
        pallas_kernels.append_step_packed(buffers, sources, columns, t[:2], limit=limit,
                                          interpret=True)


@pytest.mark.slow
def test_packed_append_step_equals_the_sliced_one():
    """A Pallas decode step with the packed append and one with `append_rows` over the sliced
    tokens leave the same cache and output (interpret mode)."""
    cfg = NSAConfig.tiny()
    params, x = make_inputs(cfg, 2, 40, jnp.float32, seed=21)
    prepared = nsa_jax.decode.prepare_decode_params(params, cfg)
    _, cache = nsa_jax.prefill(params, x[:, :33], cfg, nsa_jax.init_cache(cfg, 2, 48))
    outs = []
    for packed in (True, False):
        options = {"pallas": nsa_jax.PallasOptions(
            interpret=True, decode_blocks=D.DecodeBlockSizes(
                append_packed=packed))}
        outs.append(nsa_jax.decode_step(prepared, x[:, 33:34], cfg, cache, backend="pallas",
                                        options=options)[:2])
    (y_a, cache_a), (y_b, cache_b) = outs
    np.testing.assert_array_equal(np.asarray(y_a), np.asarray(y_b))
    for a, b in zip(jax.tree_util.tree_leaves(cache_a), jax.tree_util.tree_leaves(cache_b)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("block_sel,contiguous", [(16, True), (64, True), (16, False)])
def test_decode_compressed_select_breaks_ties_to_the_lower_block(block_sel, contiguous):
    """q = 0: every visible compressed block gets the same probability, so interior selection
    blocks tie; the fused selection picks the lowest ones, as `top_blocks`, whatever the
    blocks per program."""
    B, H, G, l, d, l_sel, n_sel, n_blocks, C = 2, 4, 2, 8, 4, 16, 5, 100, 400
    x = _inputs(B, H, G, 16, 16, C, 64, 32, jnp.float32, seed=9)
    q = jnp.zeros_like(x["q"])
    t = jnp.asarray([n_blocks * l_sel - 1, 40 * l_sel + 7], jnp.int32)
    kw = dict(cmp_block=l, cmp_stride=d, sel_block=l_sel, n_sel=n_sel, n_init=1, n_local=2,
              n_blocks=n_blocks, scale=0.3)
    tiles = D.DecodeBlockSizes(block_sel=block_sel, select_contiguous=contiguous)
    _, _, idx = _fused_select(q, x["k_cmp"], x["v_cmp"], t, tiles, **kw)
    _, _, p_group = _unfused_compressed(q, x["k_cmp"], x["v_cmp"], t, cmp_block=l, cmp_stride=d,
                                        scale=0.3)
    cfg = NSAConfig.tiny(cmp_block=l, cmp_stride=d, sel_block=l_sel, n_sel=n_sel, n_init=1,
                         n_local=2, window=l_sel)
    want = np.asarray(unfused_blocks(p_group, t, cfg, n_blocks))
    np.testing.assert_array_equal(np.asarray(idx), want)


@pytest.mark.slow
def test_decode_step_with_the_append_kernel_off_is_the_same_step():
    """`DecodeBlockSizes(append_kernel=False)` sends the appends to XLA's scatters: the same
    outputs and the same cache as the kernel's (interpret mode)."""
    cfg = NSAConfig.tiny()
    params, x = make_inputs(cfg, 2, 12, jnp.float32, seed=21)
    _, cache = nsa_jax.prefill(params, x[:, :11], cfg, nsa_jax.init_cache(cfg, 2, 16))
    outs = []
    for on in (True, False):
        options = {"pallas": PallasOptions(interpret=True,
                                           decode_blocks=D.DecodeBlockSizes(append_kernel=on))}
        outs.append(nsa_jax.decode_step(params, x[:, 11:12], cfg, cache, backend="pallas",
                                        options=options))
    (y_on, cache_on, _), (y_off, cache_off, _) = outs
    np.testing.assert_array_equal(np.asarray(y_on), np.asarray(y_off))
    for a, b in zip(cache_on, cache_off):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_top_n_rejects_bad_arguments():
    import pallas_kernels

    with pytest.raises(ValueError, match="n_sel"):
        pallas_kernels.top_n(jnp.zeros((2, 8)), 0, interpret=True)
    with pytest.raises(ValueError, match="implementation"):
        pallas_kernels.top_n(jnp.zeros((2, 8)), 2, implementation="cuda")


@pytest.mark.parametrize("cfg", [
    NSAConfig.tiny(),                                                      # h = 2, d_k != d_v
    NSAConfig.tiny(compress="mean", shared_kv=True, n_heads=8, window=40),  # ring = max_len
])
def test_decode_step_pallas_matches_layer(cfg):
    """From an empty cache, every position: output, selected blocks and read counts equal the
    layer's and the XLA decode's (float32)."""
    T = 70 if cfg.window < 40 else 36
    params, x = make_inputs(cfg, 2, T, jnp.float32, seed=4)
    ref_y, ref_aux = nsa_jax.nsa_attention(params, x, cfg, return_aux=True)
    y, idx, reads = _generation(params, x, cfg, T, "pallas")
    _, _, reads_xla = _generation(params, x, cfg, T, "xla")
    assert rel_err(y, ref_y) <= F32_TOL
    for t in range(T):
        np.testing.assert_array_equal(idx[t], ref_aux["block_idx"][:, t])
    assert reads == reads_xla


def test_decode_step_pallas_mixes_the_branches_in_the_combine(monkeypatch):
    """With prepared params and 16 heads a group, the Pallas step's combine kernel mixes the
    branches by the gate logits of the projection GEMM; the step's output still equals the
    layer's (float32, every position from an empty cache)."""
    gated = []
    combine = D._combine

    def spy(parts, dtype, **kwargs):
        gated.append(kwargs.get("gate") is not None)
        return combine(parts, dtype, **kwargs)

    monkeypatch.setattr(D, "_combine", spy)
    cfg = NSAConfig.tiny(n_heads=32)
    T = 24
    params, x = make_inputs(cfg, 2, T, jnp.float32, seed=6)
    ref_y = nsa_jax.nsa_attention(params, x, cfg)
    y, _, _ = _generation(nsa_jax.decode.prepare_decode_params(params, cfg), x, cfg, T,
                          "pallas")
    assert rel_err(y, ref_y) <= F32_TOL
    assert gated == [True]          # traced once (jitted step): one gated combine


@pytest.mark.parametrize("compress,dtype,D", [("mlp", jnp.float32, 16), ("mean", jnp.float32, 16),
                                              ("mlp", jnp.bfloat16, 16), ("mlp", jnp.float32, 64),
                                              ("mlp", jnp.bfloat16, 256)])
def test_compress_step_writes_the_completed_blocks_only(compress, dtype, D):
    """The step's compression kernel (interpret mode): a sequence whose token completes a block
    gets the block's summary from its ring (read in token order) at row (t + 1 - l) / d, the
    XLA compression's to float32 rounding (the MLP's GELU on an erf to 1.5e-7); a token that
    completes none, one before the first block, and one at the limit leave the buffers as they
    are; D not a power of two >= 16 declines. The MLP's hidden layer in two chunks: float32 D
    64, bfloat16 D 256."""
    import pallas_kernels
    from nsa_jax.layer import init_params
    from nsa_jax.xla.compress import compress_blocks

    cfg = NSAConfig.tiny(d_k=D, d_v=D, compress=compress)
    l, d, G = cfg.cmp_block, cfg.cmp_stride, cfg.n_kv_heads
    B, C, limit = 4, 12, 40      # C past the limit's blocks: a write at the limit would land
    rng = np.random.default_rng(3)
    rings = tuple(jnp.asarray(rng.standard_normal((B, l, G, D)), dtype) for _ in range(2))
    bufs = tuple(jnp.asarray(rng.standard_normal((B, C, G, D)), dtype) for _ in range(2))
    params = init_params(jax.random.PRNGKey(1), cfg, dtype)
    # Biases and positions random too (the initialisation's are zero).
    mlp = tuple({name: jnp.asarray(rng.standard_normal(w.shape) * 0.1, dtype)
                 for name, w in params[key].items()}
                for key in ("cmp_k", "cmp_v")) if compress == "mlp" else None
    t = jnp.asarray([l - 1 + 2 * d, l + d, limit + d - 1 - (limit - l) % d, l - 2], jnp.int32)
    got = pallas_kernels.compress_step(rings, bufs, t, mlp, cmp_block=l, cmp_stride=d,
                                       limit=limit, interpret=True)
    for k, (ring, buf, out) in enumerate(zip(rings, bufs, got)):
        first = int(t[0]) - l + 1
        block = ring[0, (first + np.arange(l)) % l]
        with jax.default_matmul_precision("highest"):     # GPUs' float32 default is TF32
            summary = compress_blocks(block, None if mlp is None else mlp[k], cfg)
        summary = summary.astype(dtype)
        want = np.asarray(buf, np.float32).copy()
        want[0, 2] = np.asarray(summary, np.float32)
        # bfloat16: the stored summary within an ulp of the XLA compression's (the float32
        # sums, in another order, may round to the neighbouring value).
        np.testing.assert_allclose(np.asarray(out, np.float32), want,
                                   atol=2e-6 if dtype == jnp.float32 else 1e-2,
                                   rtol=4e-6 if dtype == jnp.float32 else 2 ** -7)
        np.testing.assert_array_equal(np.asarray(out[1:], np.float32),
                                      np.asarray(buf[1:], np.float32))
    narrow = tuple(jnp.zeros((B, l, G, 8), dtype) for _ in range(2))
    with pytest.raises(NotImplementedError, match="power of two"):
        pallas_kernels.compress_step(narrow, tuple(jnp.zeros((B, C, G, 8), dtype)
                                                   for _ in range(2)),
                                     t, None, cmp_block=l, cmp_stride=d, limit=limit)


@pytest.mark.parametrize("wdtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_compress_products_keep_float32_rows(wdtype):
    """The compression kernel multiplies a float32 row by a 16-bit weight tile as two 16-bit
    parts (rows 0-7 and 8-15 of one product): their sum is the float32 product to ~2^-16 of
    the row (x rounded to the weights' type alone is off by ~2^-9); float32 weights: IEEE."""
    from pallas_kernels.decode import _row_sum, _split_rows, dot

    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((1, 64)) * 3, jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 32)), wdtype)
    got = _row_sum(dot(_split_rows(x, wdtype), w))
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    scale = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64))
    assert np.max(np.abs(np.asarray(got) - want) / scale) < (3e-5 if wdtype != jnp.float32
                                                             else 1e-6)


@pytest.mark.parametrize("cfg", [NSAConfig.tiny(d_v=16), NSAConfig.tiny(d_v=16, shared_kv=True)])
def test_decode_step_pallas_compresses_in_one_kernel(monkeypatch, cfg):
    """A Pallas decode step with D 16 compresses through the kernel (no `cond`) and still
    equals the layer at every position from an empty cache (float32), blocks included; with
    one K/V for the three branches too."""
    import pallas_kernels

    calls = []
    compress_step = pallas_kernels.compress_step

    def spy(*args, **kwargs):
        calls.append(kwargs["limit"])
        return compress_step(*args, **kwargs)

    monkeypatch.setattr(pallas_kernels, "compress_step", spy)
    T = 40
    params, x = make_inputs(cfg, 2, T, jnp.float32, seed=12)
    ref_y, ref_aux = nsa_jax.nsa_attention(params, x, cfg, return_aux=True)
    y, idx, _ = _generation(params, x, cfg, T, "pallas")
    assert calls == [T]
    assert rel_err(y, ref_y) <= F32_TOL
    for t in range(T):
        np.testing.assert_array_equal(idx[t], ref_aux["block_idx"][:, t])


def test_decode_step_pallas_options_and_errors():
    cfg = NSAConfig.tiny()
    params, x = make_inputs(cfg, 1, 3, jnp.float32)
    cache = nsa_jax.init_cache(cfg, 1, 8)
    with pytest.raises(ValueError, match="backend"):
        nsa_jax.decode_step(params, x[:, :1], cfg, cache, backend="triton")
    options = {"pallas": PallasOptions(interpret=True,
                                       decode_blocks=D.DecodeBlockSizes(block_cmp=16,
                                                                         block_win=16))}
    y, _, _ = nsa_jax.decode_step(params, x[:, :1], cfg, cache, backend="pallas",
                                  options=options)
    assert bool(jnp.all(jnp.isfinite(y)))
    with pytest.raises(ValueError, match="block_cmp"):
        D.DecodeBlockSizes(block_cmp=48)
    with pytest.raises(ValueError, match="topn_elements"):
        D.DecodeBlockSizes(topn_elements=1000)
    q = jnp.zeros((1, 4, 16))
    with pytest.raises(ValueError, match="k_cmp"):
        D.decode_compressed(q, jnp.zeros((1, 5, 2, 8)), jnp.zeros((1, 5, 2, 8)), 3, cmp_block=2,
                            cmp_stride=1, scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="t must be"):
        D.decode_compressed(q, jnp.zeros((1, 5, 2, 16)), jnp.zeros((1, 5, 2, 8)), 2.5,
                            cmp_block=2, cmp_stride=1, scale=1.0, interpret=True)


def test_split_dk_reads_the_same_scores_as_the_padded_keys():
    """d_k 48 read in column parts (32 + 16, the caches unpadded) and padded to 64 (split_dk
    off): the same outputs, lse and probabilities to float32 rounding, both kernels."""
    B, H, G, dk, dv, C, L, ring = 2, 4, 2, 48, 16, 40, 100, 24
    x = _inputs(B, H, G, dk, dv, C, L, ring, jnp.float32, seed=5)
    idx = _block_idx(B, G, 3, 90, 16, seed=1)
    outs = []
    for split in (True, False):
        bs = dataclasses.replace(SPLIT_3_WAYS, split_dk=split)
        outs.append(D.decode_compressed(x["q"], x["k_cmp"], x["v_cmp"], 90, cmp_block=8,
                                        cmp_stride=4, scale=0.3, interpret=True,
                                        block_sizes=bs)
                    + D.decode_selected_window(x["q"], x["k_sel"], x["v_sel"], idx, x["k_win"],
                                               x["v_win"], 90, sel_block=16, window=24,
                                               scale=0.3, interpret=True, block_sizes=bs))
    for got, want in zip(*outs):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_lowers_to_triton_on_any_host():
    """The decode kernels (with their split combines, the selection and its top-n, the appends)
    lower through the Pallas Triton lowering at the paper's decode sizes (B 32, 64k cache, not a
    multiple of any tile; d_k 192 read as 128 + 64: no padded copy of a key cache, which
    `split_dk=False` makes)."""
    import pallas_kernels

    shape = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    B, H, G, dv, L, ring = 32, 64, 4, 128, 65600, 512
    C = (L - 32) // 16 + 1
    for dk in (128, 192):
        def f(q, kc, vc, ks, vs, kw, vw, idx, t, bs=None):
            o, _, p = D.decode_compressed(q, kc, vc, t, cmp_block=32, cmp_stride=16, scale=0.1,
                                          block_sizes=bs)
            return (o, p) + D.decode_selected_window(q, ks, vs, idx, kw, vw, t, sel_block=64,
                                                     window=512, scale=0.1, block_sizes=bs)
        args = (shape((B, H, dk), bf), shape((B, C, G, dk), bf), shape((B, C, G, dv), bf),
                shape((B, L, G, dk), bf), shape((B, L, G, dv), bf), shape((B, ring, G, dk), bf),
                shape((B, ring, G, dv), bf), shape((B, G, 16), jnp.int32),
                shape((), jnp.int32))
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("xla.gpu.triton") == 4      # two kernels, each with its combine
        assert f"{L}x4x256xbf16" not in text         # the selection cache's keys, padded
        if dk == 192:
            padded = jax.jit(functools.partial(
                f, bs=D.DecodeBlockSizes(split_dk=False))).trace(*args).lower(
                lowering_platforms=("cuda",)).as_text()
            assert f"{L}x4x256xbf16" in padded

        def fused(q, kc, vc, t):
            return D.decode_compressed_select(q, kc, vc, t, cmp_block=32, cmp_stride=16,
                                              sel_block=64, n_sel=16, n_init=1, n_local=2,
                                              n_blocks=L // 64 + 1, scale=0.1)
        text = jax.jit(fused).trace(*args[:3], shape((B,), jnp.int32)).lower(
            lowering_platforms=("cuda",)).as_text()
        assert text.count("xla.gpu.triton") == 4      # compressed, combine, selection, top-n

        def attention(q, kc, vc, ks, vs, kw, vw, t):
            return D.decode_attention(q, kc, vc, ks, vs, kw, vw, t, cmp_block=32, cmp_stride=16,
                                      sel_block=64, n_sel=16, n_init=1, n_local=2,
                                      n_blocks=L // 64 + 1, window=512, scale=0.1)
        text = jax.jit(attention).trace(*args[:7], shape((B,), jnp.int32)).lower(
            lowering_platforms=("cuda",)).as_text()
        # compressed, selection, top-n, selected + window, one combine; nothing in XLA
        # between them but reshapes (no pad of the scores, no lse fix-up).
        assert text.count("xla.gpu.triton") == 5
        assert "stablehlo.pad" not in text and "stablehlo.select" not in text

        def gated(q, kc, vc, ks, vs, kw, vw, t, row, bias):
            return D.decode_attention(q, kc, vc, ks, vs, kw, vw, t, cmp_block=32, cmp_stride=16,
                                      sel_block=64, n_sel=16, n_init=1, n_local=2,
                                      n_blocks=L // 64 + 1, window=512, scale=0.1,
                                      gate=(row, 11264, bias))[4]
        text = jax.jit(gated).trace(*args[:7], shape((B,), jnp.int32), shape((B, 11456), bf),
                                    shape((3 * H,), bf)).lower(
            lowering_platforms=("cuda",)).as_text()
        # The mix comes out of the combine kernel: no sigmoid or sum of the branches in XLA.
        assert text.count("xla.gpu.triton") == 5 and "stablehlo.logistic" not in text
        assert "stablehlo.add" not in text

    def append(*buffers_and_tokens):
        buffers, tokens = buffers_and_tokens[:6], buffers_and_tokens[6:]
        rows = jnp.arange(B, dtype=jnp.int32)
        return pallas_kernels.append_rows(buffers, tokens, (rows,) * 6)
    bufs = [shape((B, n, G, 128), bf) for n in (L, L, ring, ring, 32, 32)]
    toks = [shape((B, G, 128), bf)] * 6
    text = jax.jit(append, donate_argnums=tuple(range(6))).trace(*bufs, *toks).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 1

    def append_packed(*buffers_and_sources):
        buffers, sources = buffers_and_sources[:6], buffers_and_sources[6:]
        rows = jnp.zeros((B, 3), jnp.int32)
        columns = [(0, 512 * i) for i in range(3)] + [(1, 512 * i) for i in range(3)]
        return pallas_kernels.append_rows_packed(buffers, sources, columns, rows,
                                                 (0, 0, 1, 1, 2, 2))
    srcs = [shape((B, 11264), bf), shape((B, 1536 + 192), bf)]  # widths not powers of two
    text = jax.jit(append_packed, donate_argnums=tuple(range(6))).trace(*bufs, *srcs).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 1

    def append_step(*args):
        columns = [(0, 512 * i) for i in range(3)] + [(1, 512 * i) for i in range(3)]
        return pallas_kernels.append_step_packed(args[:6], args[6:8], columns, args[8],
                                                 limit=L)
    text = jax.jit(append_step, donate_argnums=tuple(range(6))).trace(
        *bufs, *srcs, shape((B,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 1 and "stablehlo.remainder" not in text


@pytest.mark.slow
def test_ragged_decode_pallas_matches_each_sequence():
    """The ragged-batch check of test_jax_decode on the Pallas decode kernels (each row at its
    own position), with the backend given as a fallback sequence."""
    from test_jax_decode import check_ragged

    cfg = NSAConfig.tiny()
    params, x_all = make_inputs(cfg, 3, 36, jnp.float32, seed=9)
    check_ragged(params, x_all, cfg, 36, prompt=[3, 0, 21], chunk=[9, 14, 2], steps=8,
                 backend=("pallas", "xla"), tol=F32_TOL)


@pytest.mark.slow
def test_decode_step_branches_pallas():
    """The breakdown hook on the Pallas kernels (win: the fused kernel with no blocks)."""
    from test_jax_decode import check_branch_steps

    check_branch_steps("pallas")


def test_decode_step_pallas_under_x64(x64):
    """With jax_enable_x64 (float32 inputs) the Pallas decode path keeps int32 indices and
    agrees with the layer (the XLA path runs under x64 in test_jax_decode)."""
    cfg = NSAConfig.tiny()
    params, x = make_inputs(cfg, 2, 20, jnp.float32, seed=13)
    ref = nsa_jax.nsa_attention(params, x, cfg)
    _, cache = nsa_jax.prefill(params, x[:, :19], cfg, nsa_jax.init_cache(cfg, 2, 24),
                               lengths=np.array([19, 19]))
    y_t, after, reads = nsa_jax.decode_step(params, x[:, 19:20], cfg, cache, backend="pallas")
    assert rel_err(y_t[:, 0], ref[:, 19]) <= F32_TOL
    assert after.lengths.dtype == jnp.int32
    assert all(v.dtype == jnp.int32 for v in reads.values())


def test_chunked_prefill_on_pallas_runs_the_chunk_on_xla():
    """A chunk of several queries on a non-empty cache: the Pallas decode kernels take one query
    per sequence and refuse it, so "pallas" runs it on XLA's chunk functions (ranked by the
    Pallas selection's banded scores): the outputs and blocks of "xla"."""
    cfg = NSAConfig.tiny()
    params, x = make_inputs(cfg, 2, 40, jnp.float32, seed=16)
    _, cache = nsa_jax.prefill(params, x[:, :21], cfg, nsa_jax.init_cache(cfg, 2, 40))
    want, _, aux_want = nsa_jax.prefill(params, x[:, 21:30], cfg, cache, return_aux=True)
    got, _, aux = nsa_jax.prefill(params, x[:, 21:30], cfg, cache, backend="pallas",
                                  return_aux=True)
    assert rel_err(got, want) <= F32_TOL
    np.testing.assert_array_equal(aux["block_idx"], aux_want["block_idx"])
