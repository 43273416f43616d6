"""Block-selection Pallas kernel (interpret mode on CPU) against the plain-jnp reference and the
float64 brute force. Random float32 inputs give distinct scores (no near-ties), so `block_idx`
must agree exactly; the exact ties of the spec (forced blocks, zero scores) are decided by index
on both sides."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bruteforce as bf
from conftest import jax_has_gpu
from nsa_common import NSAConfig
from pallas_kernels.compressed_attention import (
    compressed_attention,
    compressed_attention_reference,
    compressed_lse,
)
from pallas_kernels.select_blocks import BlockSizes, select_blocks, select_blocks_reference


# The kernel in interpret mode and the references, jitted with every other argument static: one
# compilation a shape and setting instead of one an operation.
_SELECTION = ("cmp_block", "cmp_stride", "sel_block", "n_sel", "n_init", "n_local", "scale")
select_blocks_jit = jax.jit(select_blocks,
                            static_argnames=_SELECTION + ("block_sizes", "interpret"))
select_blocks_reference_jit = jax.jit(select_blocks_reference, static_argnames=_SELECTION)


@functools.partial(jax.jit, static_argnames=("cmp_block", "cmp_stride"))
def lse_reference(q, k_cmp, *, cmp_block, cmp_stride):
    """The log-sum-exp `[B, T, H]` of `compressed_attention_reference` (k_cmp as the values)."""
    return compressed_attention_reference(q, k_cmp, k_cmp, cmp_block=cmp_block,
                                          cmp_stride=cmp_stride)[1]


def make_inputs(seed, B, T, H, G, d_k, l, d):
    C = max(0, (T - l) // d + 1)
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, T, H, d_k), dtype=np.float32))
    k = jnp.asarray(rng.standard_normal((B, C, G, d_k), dtype=np.float32))
    return q, k


def selection(l, d, l_sel, n_sel, n_init, n_local):
    return dict(cmp_block=l, cmp_stride=d, sel_block=l_sel, n_sel=n_sel, n_init=n_init,
                n_local=n_local)


def brute_force(q, k, kw):
    cfg = NSAConfig(**kw)
    return bf.bf_select_blocks(np.asarray(q, np.float64), np.asarray(k, np.float64), cfg)


# (B, T, H, G, d_k), selection (l, d, l_sel, n_sel, n_init, n_local), block_q rows of the "rows"
# layout (half as many queries a tile in the "heads" layout), 16 selection blocks per step.
CASES = [
    # the paper's ratios (l = 2d, l_sel = 4d), h = 2
    ((1, 100, 4, 2, 16), (8, 4, 16, 4, 1, 2), 64),
    # h = 16: 4 queries a tile (the head sum is mapped without tl.dot); n_sel not a power of 2
    ((1, 150, 16, 1, 16), (8, 4, 16, 3, 1, 1), 64),
    # h = 1, l = d = l_sel (p_sel = p_cmp), no forced initial block, d_k not a power of 2
    ((2, 77, 2, 2, 24), (8, 8, 8, 5, 0, 2), 64),
    # l_sel / d = 3: a step's compressed blocks do not fill a power-of-2 tile
    ((1, 90, 1, 1, 16), (4, 4, 12, 4, 1, 2), 32),
    # several steps of 16 selection blocks, with l = 2d so blocks straddle step boundaries
    ((1, 300, 2, 1, 16), (4, 2, 8, 4, 1, 2), 64),
    # nothing forced: eligible blocks that no admissible compressed block reaches score an exact
    # 0 (they tie, lower index first) and still beat ineligible ones (-1 padding after them)
    ((1, 60, 2, 1, 16), (16, 4, 16, 3, 0, 0), 64),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}T{}H{}G{}dk{}".format(*c[0]) +
                         "-l{}d{}ls{}n{}i{}o{}".format(*c[1]))
def test_matches_reference_and_brute_force(case):
    shape, sel, block_q = case
    q, k = make_inputs(0, *shape, *sel[:2])
    kw = selection(*sel)
    lse = lse_reference(q, k, cmp_block=kw["cmp_block"], cmp_stride=kw["cmp_stride"])
    sizes = BlockSizes(layout="rows", topn="pallas", block_q=block_q, block_sel=16)
    block_idx = select_blocks_jit(q, k, lse, block_sizes=sizes, interpret=True, **kw)
    B, T, H, G, _ = shape
    assert block_idx.shape == (B, T, G, kw["n_sel"]) and block_idx.dtype == jnp.int32
    np.testing.assert_array_equal(block_idx, select_blocks_reference_jit(q, k, lse, **kw))
    np.testing.assert_array_equal(block_idx, brute_force(q, k, kw))


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}T{}H{}G{}dk{}".format(*c[0]) +
                         "-l{}d{}ls{}n{}i{}o{}".format(*c[1]))
def test_heads_layout_matches_brute_force(case):
    """The "heads" layout (queries a tile, the group's heads looped in a step) on the same
    cases: 16 or 32 queries a tile (several tiles and steps)."""
    shape, sel, block_q = case
    q, k = make_inputs(0, *shape, *sel[:2])
    kw = selection(*sel)
    lse = lse_reference(q, k, cmp_block=kw["cmp_block"], cmp_stride=kw["cmp_stride"])
    sizes = BlockSizes(layout="heads", block_queries=block_q // 2, block_sel=16)
    block_idx = select_blocks_jit(q, k, lse, block_sizes=sizes, interpret=True, **kw)
    np.testing.assert_array_equal(block_idx, brute_force(q, k, kw))


@pytest.mark.parametrize("d_k", [48, 96, 192, 24])
@pytest.mark.parametrize("split_dk", [True, False])
def test_heads_layout_column_parts(d_k, split_dk):
    """d_k = 32 + 16, 64 + 32, 128 + 64 enter `q k^T` as two column parts (`split_dk`, the
    default) or padded to the next power of two; 24 = 16 + 8 has a part under 16 and is padded
    either way. Both give the brute force's blocks."""
    q, k = make_inputs(3, 1, 130, 4, 2, d_k, 8, 4)
    kw = selection(8, 4, 16, 4, 1, 2)
    lse = lse_reference(q, k, cmp_block=8, cmp_stride=4)
    sizes = BlockSizes(layout="heads", block_queries=32, block_sel=16, split_dk=split_dk)
    block_idx = select_blocks_jit(q, k, lse, block_sizes=sizes, interpret=True, **kw)
    np.testing.assert_array_equal(block_idx, brute_force(q, k, kw))


@pytest.mark.parametrize("split_dk, width", [(True, 192), (False, 256)])
def test_split_dk_reads_unpadded_operands_in_the_triton_lowering(split_dk, width):
    """On the CUDA lowering (no GPU needed) the kernel's q and k_cmp operands are 192 wide with
    the column parts and 256 wide padded: the split removes the padded copies."""
    import jax

    shape = jax.ShapeDtypeStruct
    sizes = BlockSizes(split_dk=split_dk)

    def select(q, k, lse):
        return select_blocks(q, k, lse, block_sizes=sizes, **selection(32, 16, 64, 16, 1, 2))

    text = jax.jit(select).trace(shape((1, 320, 16, 192), jnp.bfloat16),
                                 shape((1, 19, 4, 192), jnp.bfloat16),
                                 shape((1, 320, 16), jnp.float32)).lower(
        lowering_platforms=("cuda",)).as_text()
    call = [line for line in text.splitlines() if "xla.gpu.triton" in line]
    assert len(call) == 1
    operands = call[0].rsplit(" : (", 1)[1]
    assert operands.count(f"x{width}xbf16>") == 2
    assert operands.count("xbf16>") == 2


def test_block_straddling_two_steps_scores_in_both():
    """A compressed block that straddles the boundary of two kernel steps (l = 2d) weighs on the
    last selection block of one step and the first of the next. Make that block dominate the
    attention: both selection blocks must then be chosen."""
    l, d, l_sel, n_sel = 4, 2, 8, 5
    kw = selection(l, d, l_sel, n_sel, 1, 2)
    step = BlockSizes().block_sel  # selection blocks per kernel step (default tiles)
    span = step * l_sel // d  # compressed blocks per step
    rng = np.random.default_rng(5)
    T, H, d_k = (step + 8) * l_sel, 2, 16
    direction = rng.standard_normal(d_k).astype(np.float32)
    direction /= np.linalg.norm(direction)
    q = 4 * direction + 0.1 * rng.standard_normal((1, T, H, d_k), dtype=np.float32)
    k = 0.5 * rng.standard_normal((1, (T - l) // d + 1, 1, d_k), dtype=np.float32)
    k[0, span - 1, 0] = 4 * direction
    q, k = jnp.asarray(q), jnp.asarray(k)
    lse = lse_reference(q, k, cmp_block=l, cmp_stride=d)
    block_idx = np.asarray(select_blocks_jit(q, k, lse, interpret=True, **kw))
    late = np.arange(T) >= (step + 2) * l_sel  # where neither block is forced any more
    assert np.isin(block_idx[0, late, 0], [step - 1]).any(axis=-1).all()
    assert np.isin(block_idx[0, late, 0], [step]).any(axis=-1).all()
    np.testing.assert_array_equal(block_idx, brute_force(q, k, kw))


def test_lse_from_the_compressed_attention_kernel():
    """The pipeline as the layer runs it: the kernel's own lse feeds the selection."""
    q, k = make_inputs(1, 1, 120, 8, 2, 32, 8, 4)
    kw = selection(8, 4, 16, 4, 1, 2)
    kernel = jax.jit(functools.partial(compressed_attention, cmp_block=8, cmp_stride=4,
                                       interpret=True))
    _, lse = kernel(q, k, k)
    block_idx = select_blocks_jit(q, k, lse, interpret=True, **kw)
    np.testing.assert_array_equal(block_idx, select_blocks_reference_jit(q, k, **kw))
    np.testing.assert_array_equal(block_idx, brute_force(q, k, kw))


def test_no_compressed_block_yet():
    """T < l: no compressed block, lse = -inf; only block 0 is eligible (l <= l_sel)."""
    q, k = make_inputs(2, 1, 7, 4, 2, 16, 8, 4)
    assert k.shape[1] == 0
    kw = selection(8, 4, 8, 3, 1, 1)
    lse = jnp.full(q.shape[:3], -jnp.inf, jnp.float32)
    block_idx = select_blocks_jit(q, k, lse, interpret=True, **kw)
    np.testing.assert_array_equal(block_idx, brute_force(q, k, kw))
    np.testing.assert_array_equal(block_idx, select_blocks_reference_jit(q, k, lse, **kw))


def test_bad_inputs_raise_value_error():
    q, k = make_inputs(3, 1, 40, 4, 2, 16, 8, 4)
    lse = jnp.zeros(q.shape[:3], jnp.float32)
    kw = selection(8, 4, 16, 4, 1, 2)
    with pytest.raises(ValueError, match="n_sel"):
        select_blocks(q, k, lse, interpret=True, **{**kw, "n_sel": 2})
    with pytest.raises(ValueError, match="cmp_stride"):
        select_blocks(q, k, lse, interpret=True, **{**kw, "sel_block": 18})
    with pytest.raises(ValueError, match="lse"):
        select_blocks(q, k, lse[:, :-1], interpret=True, **kw)
    with pytest.raises(ValueError, match="block_sel"):
        BlockSizes(block_sel=8)
    with pytest.raises(ValueError, match="layout"):
        BlockSizes(layout="columns")


@pytest.mark.gpu
@pytest.mark.skipif(not jax_has_gpu(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout, d_k", [("rows", 64), ("heads", 64), ("heads", 192)])
def test_gpu_matches_reference(layout, d_k):
    q, k = make_inputs(4, 1, 2000, 16, 4, d_k, 32, 16)
    kw = selection(32, 16, 64, 16, 1, 2)
    _, lse = compressed_attention(q, k, k, cmp_block=32, cmp_stride=16)
    block_idx = np.asarray(select_blocks(q, k, lse, block_sizes=BlockSizes(layout=layout), **kw))
    reference = np.asarray(select_blocks_reference(q, k, lse, **kw))
    # On the GPU the scores are summed in another order; a flipped near-tie may differ.
    assert (block_idx == reference).all(axis=-1).mean() >= 0.999


@pytest.mark.parametrize("topn, head_sum_dot", [("xla", False), ("fused", False),
                                                ("pallas", True)])
def test_top_n_methods_agree(topn, head_sum_dot):
    """Every top-n method (and head-sum product) gives the same block_idx, also with the score
    buffer cut into several chunks of queries (`score_bytes` small)."""
    q, k = make_inputs(5, 1, 300, 2, 1, 16, 4, 2)
    kw = selection(4, 2, 8, 4, 1, 2)
    lse = compressed_lse(q, k, cmp_block=4, cmp_stride=2, interpret=True)
    expected = select_blocks_jit(q, k, lse, interpret=True, **kw,
                                 block_sizes=BlockSizes(block_q=64, block_sel=16,
                                                        score_bytes=64 * 4 * 64))
    np.testing.assert_array_equal(expected, brute_force(q, k, kw))
    got = select_blocks_jit(q, k, lse, interpret=True, **kw,
                            block_sizes=BlockSizes(block_q=64, block_sel=16, topn=topn,
                                                   head_sum_dot=head_sum_dot))
    np.testing.assert_array_equal(got, expected)


def top_n_cases(n_cols, n_sel):
    """Scores with many equal values, forced (+inf) and ineligible (-inf, NaN) blocks, and rows
    with fewer eligible blocks than n_sel (row 4: three, two of them tied; row 5: all forced)."""
    rng = np.random.default_rng(n_cols + n_sel)
    rows = 24
    score = rng.integers(0, 6, (rows, n_cols)).astype(np.float32)        # ties everywhere
    score[rng.random((rows, n_cols)) < 0.2] = -np.inf
    score[rng.random((rows, n_cols)) < 0.05] = np.nan
    score[rng.random((rows, n_cols)) < 0.01] = np.inf
    score[3, :] = -np.inf
    score[4, :] = -np.inf
    score[4, [7, 2, 11]] = [1.0, 1.0, -2.0]                  # three eligible, two of them tied
    score[5, :] = np.inf                                      # every block forced: the lowest
    return score


def check_top_n(got, score, n_sel):
    want = np.full(score.shape[:-1] + (n_sel,), -1, np.int32)     # -1 padded
    for row in range(score.shape[0]):
        best = bf.bf_top_n(score[row], n_sel)
        want[row, :len(best)] = best
    np.testing.assert_array_equal(np.asarray(got), want)
    assert (np.asarray(got)[4] == [2, 7, 11] + [-1] * (n_sel - 3)).all()


@pytest.mark.parametrize("n_cols, n_sel", [(1024, 16), (64, 5), (16, 16)])
def test_top_n_kernel_against_brute_force(n_cols, n_sel):
    """The top-n kernel on `top_n_cases`: one row a program (1,024 columns) and 16 (64)."""
    import pallas_kernels

    score = top_n_cases(n_cols, n_sel)
    check_top_n(pallas_kernels.top_n(jnp.asarray(score), n_sel, interpret=True), score, n_sel)


def test_compressed_lse_matches_the_forward():
    q, k = make_inputs(6, 1, 70, 4, 2, 16, 8, 4)
    _, lse = compressed_attention(q, k, k, cmp_block=8, cmp_stride=4, interpret=True)
    lse_only = compressed_lse(q, k, cmp_block=8, cmp_stride=4, interpret=True)
    np.testing.assert_array_equal(np.isneginf(lse_only), np.isneginf(lse))
    finite = np.isfinite(np.asarray(lse))
    np.testing.assert_allclose(np.asarray(lse_only)[finite], np.asarray(lse)[finite], rtol=1e-6)
