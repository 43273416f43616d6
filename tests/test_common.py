"""The shared block arithmetic (`nsa_common.layout`) and sanity checks of the brute-force reference."""
import numpy as np
import pytest

from bruteforce import (bf_compressed_attention, bf_select_blocks, bf_selected_attention,
                        bf_sliding_window_attention)
from nsa_common import (NSAConfig, decode_read_bound, num_cmp_blocks, num_sel_blocks,
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
