"""The shared block arithmetic (`nsa_common.layout`) and sanity checks of the brute-force reference."""
import numpy as np
import pytest

from bruteforce import (bf_compressed_attention, bf_select_blocks, bf_selected_attention,
                        bf_sliding_window_attention)
from nsa_common import (NSAConfig, cmp_admissible, cmp_block_end, completed_cmp_block,
                        completes_cmp_block, decode_read_bound, num_admissible_cmp_blocks,
                        num_cmp_blocks, num_sel_blocks, overlap_by_offset,
                        overlap_weights)


def _causal_attention(q, k, v):
    """Plain causal softmax attention with GQA, written independently of the brute force."""
    T, H = q.shape[1], q.shape[2]
    h = H // k.shape[2]
    out = np.zeros(q.shape[:3] + (v.shape[-1],))
    for head in range(H):
        s = np.einsum("btd,bsd->bts", q[:, :, head], k[:, :, head // h]) / np.sqrt(q.shape[-1])
        s = s + np.triu(np.full((T, T), -np.inf), k=1)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[:, :, head] = p @ v[:, :, head // h]
    return out


def test_overlap_weights_default_ratios():
    cfg = NSAConfig.paper()
    weights = overlap_weights(cfg, 40, 10)
    for j in range(1, 9):
        column = weights[:, j]
        np.testing.assert_array_equal(column[4 * j - 1: 4 * j + 4], [1, 2, 2, 2, 1])
        assert column.sum() == 8  # l_sel / d tokens-per-stride, each counted l / d = 2 times
    np.testing.assert_array_equal(weights[:4, 0], [2, 2, 2, 1])


def test_overlap_weights_identity_when_blocks_coincide():
    cfg = NSAConfig(cmp_block=64, cmp_stride=64, sel_block=64)
    np.testing.assert_array_equal(overlap_weights(cfg, 5, 5), np.eye(5))


@pytest.mark.parametrize("l, d, l_sel", [(32, 16, 64), (16, 16, 16), (12, 4, 24), (32, 8, 32)])
def test_overlap_by_offset_is_every_column_of_overlap_weights(l, d, l_sel):
    """Column j of the overlap matrix holds weight w at row j*r + m for each (m, w) of
    `overlap_by_offset`, and zero elsewhere (rows before block 0 cut off)."""
    cfg = NSAConfig(cmp_block=l, cmp_stride=d, sel_block=l_sel)
    r, offsets = l_sel // d, overlap_by_offset(cfg)
    weights = overlap_weights(cfg, 12 * r, 10)
    for j in range(10):
        want = np.zeros(12 * r, np.float32)
        for m, w in offsets:
            if j * r + m >= 0:
                want[j * r + m] = w
        np.testing.assert_array_equal(weights[:, j], want)
    assert [m for m, _ in offsets] == sorted(m for m, _ in offsets)


@pytest.mark.parametrize("T, expected", [(31, 0), (32, 1), (47, 1), (48, 2), (64, 3)])
def test_num_cmp_blocks(T, expected):
    assert num_cmp_blocks(NSAConfig.paper(), T) == expected


def test_num_sel_blocks_counts_partial_block():
    assert num_sel_blocks(NSAConfig.paper(), 64) == 1
    assert num_sel_blocks(NSAConfig.paper(), 65) == 2


def test_decode_read_bound_matches_paper_table4():
    cfg = NSAConfig.paper()
    # Spec formula at the last of 65,536 tokens; the paper's 5,632 rounds T/d up to 4,096.
    assert decode_read_bound(cfg, 65535) == 4095 + 16 * 64 + 512
    assert decode_read_bound(cfg, 0) == 16 * 64 + 512


@pytest.mark.parametrize("l, d", [(32, 16), (8, 4), (16, 16), (12, 4), (4, 1)])
def test_admissibility_rule_against_counting_token_sets(l, d):
    """Block i covers tokens [i*d, i*d + l); query t may attend it iff all of them are <= t.
    Counted from the token sets, for positions before the first block and after many."""
    blocks = np.arange(210)  # more than any t below can see (d = 1)
    for t in range(-1, 200):
        covered = [set(range(i * d, i * d + l)) for i in blocks]
        brute = [tokens <= set(range(t + 1)) for tokens in covered]
        np.testing.assert_array_equal(cmp_admissible(blocks, t, l, d), brute)
        assert num_admissible_cmp_blocks(t, l, d) == sum(brute), t
        assert all(max(tokens) == cmp_block_end(i, l, d) for i, tokens in zip(blocks, covered))
    # Arrays of positions give the same counts as ints, element by element.
    t = np.arange(-1, 200)
    np.testing.assert_array_equal(num_admissible_cmp_blocks(t, l, d),
                                  [num_admissible_cmp_blocks(int(s), l, d) for s in t])
    cfg = NSAConfig.tiny(cmp_block=l, cmp_stride=d, sel_block=max(l, 4 * d))
    assert [num_cmp_blocks(cfg, n) for n in range(200)] == [
        num_admissible_cmp_blocks(n - 1, l, d) for n in range(200)]
    # Decode emits block i at the token that completes it, i*d + l - 1: exactly where the count
    # of admissible blocks grows, and the block emitted is the newest admissible one.
    for s in range(0, 200):
        grows = num_admissible_cmp_blocks(s, l, d) > num_admissible_cmp_blocks(s - 1, l, d)
        assert bool(completes_cmp_block(s, l, d)) == grows, s
        if grows:
            assert completed_cmp_block(s, l, d) == num_admissible_cmp_blocks(s, l, d) - 1
            assert cmp_block_end(completed_cmp_block(s, l, d), l, d) == s
    np.testing.assert_array_equal(completes_cmp_block(t, l, d),
                                  [bool(completes_cmp_block(int(s), l, d)) for s in t])


def test_rules_keep_each_framework_type():
    """The same expression runs on ints, NumPy, JAX (traced too) and PyTorch, keeping the dtype."""
    import jax
    import jax.numpy as jnp
    import torch

    cfg = NSAConfig.paper()
    t = [0, 30, 31, 47, 48, 65535]
    want = [decode_read_bound(cfg, s) for s in t]
    assert isinstance(want[0], int) and want[0] == 16 * 64 + 512
    got_jax = jax.jit(lambda t: decode_read_bound(cfg, t))(jnp.asarray(t, jnp.int32))
    assert got_jax.dtype == jnp.int32 and got_jax.tolist() == want
    got_torch = decode_read_bound(cfg, torch.tensor(t))
    assert got_torch.dtype == torch.int64 and got_torch.tolist() == want
    counts = num_admissible_cmp_blocks(torch.tensor(t), cfg.cmp_block, cfg.cmp_stride)
    assert counts.tolist() == [0, 0, 1, 2, 2, 4095]


def test_bruteforce_full_window_and_all_blocks_equal_causal_attention():
    rng = np.random.default_rng(0)
    B, T, H, G, dk, dv = 2, 21, 4, 2, 8, 6
    q, k = rng.normal(size=(B, T, H, dk)), rng.normal(size=(B, T, G, dk))
    v = rng.normal(size=(B, T, G, dv))
    reference = _causal_attention(q, k, v)
    np.testing.assert_allclose(bf_sliding_window_attention(q, k, v, window=T), reference, atol=1e-12)
    every_block = np.broadcast_to(np.arange(6, dtype=np.int32), (B, T, G, 6))
    np.testing.assert_allclose(bf_selected_attention(q, k, v, every_block, 4), reference, atol=1e-12)


def test_bruteforce_compressed_attention_empty_rows_are_zero():
    cfg = NSAConfig.tiny()
    rng = np.random.default_rng(1)
    q = rng.normal(size=(1, 12, 4, 16))
    k_cmp, v_cmp = rng.normal(size=(1, 2, 2, 16)), rng.normal(size=(1, 2, 2, 8))
    o, p = bf_compressed_attention(q, k_cmp, v_cmp, cfg)
    assert np.all(o[:, : cfg.cmp_block - 1] == 0) and np.all(p[:, : cfg.cmp_block - 1] == 0)
    np.testing.assert_allclose(p[:, cfg.cmp_block - 1:].sum(-1), 1.0)


def test_bruteforce_selection_forced_and_padded():
    cfg = NSAConfig.tiny(n_sel=4)
    rng = np.random.default_rng(2)
    T = 40
    q = rng.normal(size=(1, T, 4, 16))
    k_cmp = rng.normal(size=(1, num_cmp_blocks(cfg, T), 2, 16))
    block_idx = bf_select_blocks(q, k_cmp, cfg)
    for t in range(T):
        last = t // cfg.sel_block
        row = block_idx[0, t, 0]
        assert list(row[: last + 1]) == list(range(last + 1))  # at most 3 eligible blocks <= n_sel
        assert np.all(row[last + 1:] == -1)


def test_bruteforce_handles_no_compressed_block():
    cfg = NSAConfig.tiny()
    rng = np.random.default_rng(3)
    q = rng.normal(size=(1, 5, 4, 16))
    k_cmp, v_cmp = np.zeros((1, 0, 2, 16)), np.zeros((1, 0, 2, 8))
    o, p = bf_compressed_attention(q, k_cmp, v_cmp, cfg)
    assert o.shape == (1, 5, 4, 8) and np.all(o == 0) and p.shape == (1, 5, 4, 0)
    assert np.all(bf_select_blocks(q, k_cmp, cfg)[0, :, :, 0] == 0)
