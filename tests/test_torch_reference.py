"""The kernel-level functions of `nsa_torch_ref` against the NumPy float64 brute force.

Everything runs in float64, where the reference path computes exactly: outputs must agree with
`bruteforce` to RTOL, and block selections must be identical.
"""
import functools
import math

import numpy as np
import pytest
import torch

import bruteforce
from bruteforce import (bf_compress, bf_select_blocks, bf_selected_attention,
                        bf_sliding_window_attention)
from nsa_common import NSAConfig, num_cmp_blocks
from nsa_common.testing import rel_err as _rel_err
from nsa_torch_ref import (compress_kv, compressed_attention, select_blocks, selected_attention,
                           sliding_window_attention)

RTOL = 1e-10  # relative error ||out - ref|| / ||ref|| allowed against the float64 brute force

# (G, h): every G in {1, 2, 4} and every h in {1, 2, 4, 16}, without the full product.
GROUPS = [(1, 1), (2, 2), (4, 4), (1, 16), (4, 1), (2, 4)]
# T not a multiple of any block (37, 70), T < l (5), l <= T < l_sel (12). With tiny()'s
# n_sel = 4, T in {5, 12, 37} has fewer eligible blocks than n_sel (-1 padding) and 70 has more.
LENGTHS = [5, 12, 37, 70]

# A zero reference (an exactly zero output or gradient) is compared by its absolute error.
rel_err = functools.partial(_rel_err, absolute_if_zero=True)


def bf_compressed_attention(*args, **kwargs):
    return bruteforce.bf_compressed_attention(*args, **kwargs)


def random_qkv(B, T, G, h, d_k, d_v, *, seed, S=None):
    """q [B,T,G*h,d_k], k [B,S,G,d_k], v [B,S,G,d_v] float64 tensors (S defaults to T)."""
    gen = torch.Generator().manual_seed(seed)
    S = T if S is None else S
    q = torch.randn(B, T, G * h, d_k, generator=gen, dtype=torch.float64)
    k = torch.randn(B, S, G, d_k, generator=gen, dtype=torch.float64)
    v = torch.randn(B, S, G, d_v, generator=gen, dtype=torch.float64)
    return q, k, v


def cmp_params(cfg, G, dim, seed):
    gen = torch.Generator().manual_seed(seed)
    l = cfg.cmp_block

    def normal(*shape, std):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * std

    return {"pos": normal(G, l, dim, std=0.1), "w1": normal(G, l * dim, dim, std=(l * dim) ** -0.5),
            "b1": normal(G, dim, std=0.1), "w2": normal(G, dim, dim, std=dim ** -0.5),
            "b2": normal(G, dim, std=0.1)}


def np_params(params):
    return None if params is None else {name: p.numpy() for name, p in params.items()}


# ---------------------------------------------------------------------------------------------
# compress_kv
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("compress", ["mlp", "mean"])
@pytest.mark.parametrize("T", LENGTHS)
def test_compress_kv_matches_bruteforce(compress, T):
    cfg = NSAConfig.tiny(compress=compress)
    G, dim = 2, 6
    _, k, _ = random_qkv(2, T, G, 1, dim, 1, seed=T)
    params = cmp_params(cfg, G, dim, seed=1) if compress == "mlp" else None
    out = compress_kv(k, params, cfg)
    assert out.shape == (2, num_cmp_blocks(cfg, T), G, dim)
    ref = bf_compress(k.numpy(), np_params(params), cfg)
    assert rel_err(out, ref) <= RTOL


# ---------------------------------------------------------------------------------------------
# compressed_attention
# ---------------------------------------------------------------------------------------------
def compressed_inputs(cfg, T, G, h, seed):
    q, k, v = random_qkv(2, T, G, h, cfg.d_k, cfg.d_v, seed=seed)
    k_cmp = compress_kv(k, None, cfg)
    v_cmp = compress_kv(v, None, cfg)
    # Mean-compressed keys have small norms; rescale so the softmax is far from uniform.
    return q, k_cmp * 3.0, v_cmp


@pytest.mark.parametrize("G, h", GROUPS)
@pytest.mark.parametrize("T", LENGTHS)
def test_compressed_attention_matches_bruteforce(G, h, T):
    cfg = NSAConfig.tiny(n_heads=G * h, n_kv_heads=G)
    q, k_cmp, v_cmp = compressed_inputs(cfg, T, G, h, seed=10 * G + h + T)
    o, lse = compressed_attention(q, k_cmp, v_cmp, cfg, return_lse=True)
    o_ref, _ = bf_compressed_attention(q.numpy(), k_cmp.numpy(), v_cmp.numpy(), cfg)
    assert o.shape == (2, T, G * h, cfg.d_v) and o.dtype == q.dtype
    assert rel_err(o, o_ref) <= RTOL

    # lse: log-sum-exp of the admissible scaled scores, -inf where none is admissible.
    scores = np.einsum("bthd,bchd->bthc", q.numpy(),
                       np.repeat(k_cmp.numpy(), h, axis=2)) / math.sqrt(cfg.d_k)
    admissible = (np.arange(k_cmp.shape[1]) * cfg.cmp_stride + cfg.cmp_block - 1
                  <= np.arange(T)[:, None])  # [T, C]
    masked = np.where(admissible[None, :, None, :], scores, -np.inf)
    lse_ref = np.full(masked.shape[:3], -np.inf)
    rows = admissible.any(axis=1)
    if rows.any():
        m = masked[:, rows].max(-1, keepdims=True)
        lse_ref[:, rows] = (m + np.log(np.exp(masked[:, rows] - m).sum(-1, keepdims=True)))[..., 0]
    assert lse.dtype == torch.float32
    np.testing.assert_array_equal(np.isneginf(lse.numpy()), np.isneginf(lse_ref))
    np.testing.assert_allclose(lse.numpy()[:, rows], lse_ref[:, rows], rtol=1e-6)


@pytest.mark.parametrize("T", [5, 12])
def test_compressed_attention_empty_rows_are_zero_with_zero_finite_gradients(T):
    """Rows t < l - 1 (all rows when T < l, where C = 0) give o = 0 and exactly zero gradients."""
    cfg = NSAConfig.tiny()
    q, k_cmp, v_cmp = compressed_inputs(cfg, T, 2, 2, seed=T)
    q, k_cmp, v_cmp = (t.clone().requires_grad_() for t in (q, k_cmp, v_cmp))
    o = compressed_attention(q, k_cmp, v_cmp, cfg)
    empty = cfg.cmp_block - 1
    assert torch.all(o[:, :empty] == 0)
    o.mul(torch.randn_like(o)).sum().backward()
    for grad in (q.grad, k_cmp.grad, v_cmp.grad):
        assert grad is not None and torch.isfinite(grad).all()
    assert torch.all(q.grad[:, :empty] == 0)
    if T < cfg.cmp_block:
        assert k_cmp.shape[1] == 0 and torch.all(q.grad == 0)
    else:
        assert q.grad[:, empty:].abs().sum() > 0


def test_compressed_attention_low_precision_output_dtype():
    cfg = NSAConfig.tiny()
    q, k_cmp, v_cmp = compressed_inputs(cfg, 37, 2, 2, seed=0)
    q, k_cmp, v_cmp = (t.bfloat16() for t in (q, k_cmp, v_cmp))
    o = compressed_attention(q, k_cmp, v_cmp, cfg)
    o_ref, _ = bf_compressed_attention(*(t.double().numpy() for t in (q, k_cmp, v_cmp)), cfg)
    assert o.dtype == torch.bfloat16
    assert rel_err(o.double(), o_ref) <= 1e-2


# ---------------------------------------------------------------------------------------------
# select_blocks
# ---------------------------------------------------------------------------------------------
SELECT_CONFIGS = {
    "tiny": NSAConfig.tiny(),
    "no_forced": NSAConfig.tiny(n_init=0, n_local=0, n_sel=3),
    "more_forced": NSAConfig.tiny(n_init=2, n_local=3, n_sel=6),
    "l=d=l_sel": NSAConfig.tiny(cmp_block=8, cmp_stride=8, sel_block=8),
}


@pytest.mark.parametrize("name", sorted(SELECT_CONFIGS))
@pytest.mark.parametrize("G, h", GROUPS)
@pytest.mark.parametrize("T", LENGTHS)
def test_select_blocks_matches_bruteforce(name, G, h, T):
    cfg = SELECT_CONFIGS[name].replace(n_heads=G * h, n_kv_heads=G)
    q, k_cmp, _ = compressed_inputs(cfg, T, G, h, seed=G + 7 * h + T)
    block_idx = select_blocks(q, k_cmp, cfg)
    assert block_idx.dtype == torch.int32 and block_idx.shape == (2, T, G, cfg.n_sel)
    ref = bf_select_blocks(q.numpy(), k_cmp.numpy(), cfg)
    np.testing.assert_array_equal(block_idx.numpy(), ref)


@pytest.mark.parametrize("name", sorted(SELECT_CONFIGS))
def test_select_blocks_structure(name):
    """Forced blocks present, nothing after t // l_sel, ascending, -1 only as trailing padding,
    no duplicates, and exactly min(n_sel, eligible) valid entries."""
    cfg = SELECT_CONFIGS[name]
    T = 100
    q, k_cmp, _ = compressed_inputs(cfg, T, cfg.n_kv_heads, cfg.heads_per_group, seed=3)
    block_idx = select_blocks(q, k_cmp, cfg).numpy()
    for t in range(T):
        last = t // cfg.sel_block
        forced = (set(range(min(cfg.n_init, last + 1)))
                  | set(range(max(0, last - cfg.n_local + 1), last + 1)))
        for row in block_idx[:, t].reshape(-1, cfg.n_sel):
            n_valid = min(cfg.n_sel, last + 1)
            valid, padding = row[:n_valid], row[n_valid:]
            assert np.all(padding == -1)
            assert np.all(valid >= 0) and np.all(valid <= last)
            assert np.all(np.diff(valid) > 0)
            assert forced <= set(valid.tolist())


def test_select_blocks_ties_go_to_the_lower_index():
    """q = 0 makes every admissible compressed block equally likely, and with l = d = l_sel the
    eligible selection scores tie exactly: the free picks must be the lowest indices."""
    cfg = NSAConfig.tiny(cmp_block=4, cmp_stride=4, sel_block=4, n_sel=4, n_init=1, n_local=1)
    T = 30
    q, k_cmp, _ = compressed_inputs(cfg, T, 2, 2, seed=0)
    block_idx = select_blocks(torch.zeros_like(q), k_cmp, cfg).numpy()
    for t in range(T):
        last = t // cfg.sel_block
        forced = {0, last}
        free = [j for j in range(1, last) if j not in forced][: cfg.n_sel - len(forced)]
        expected = sorted(forced | set(free))
        expected += [-1] * (cfg.n_sel - len(expected))
        assert np.all(block_idx[:, t] == expected), (t, block_idx[0, t, 0], expected)


def crafted_k_cmp(logits: np.ndarray, T: int):
    """q [1, T, 1, C] of ones and k_cmp [1, C, 1, C] = diag(logits): with scale = 1 the
    compressed scores of every query are exactly `logits`."""
    C = len(logits)
    q = torch.ones(1, T, 1, C, dtype=torch.float64)
    k_cmp = torch.diag(torch.tensor(logits, dtype=torch.float64))[None, :, None, :]
    return q, k_cmp


def test_select_blocks_overlap_weights_default_ratios():
    """With l = 2d, l_sel = 4d, compressed block 4j+1 lies inside selection block j (weight 2)
    while 4j+3 straddles blocks j and j+1 (weight 1 each). Probability 0.4 on block 9 (inside
    selection block 2) must beat 0.6 on block 19 (straddling 4 and 5): 0.8 against 0.6."""
    cfg = NSAConfig.tiny(n_heads=1, n_kv_heads=1, n_sel=4, n_init=1, n_local=2)
    T = 120
    t = T - 1  # last = 7, forced {0, 6, 7}: one free pick among 1..5
    logits = np.full(num_cmp_blocks(cfg, T), -1e4)
    logits[9], logits[19] = np.log(0.4), np.log(0.6)
    q, k_cmp = crafted_k_cmp(logits, T)
    block_idx = select_blocks(q, k_cmp, cfg, scale=1.0).numpy()
    np.testing.assert_array_equal(block_idx[0, t, 0], [0, 2, 6, 7])
    # Moving the 0.4 onto the straddling block 11 (weight 1 for blocks 2 and 3) flips the pick.
    logits[9], logits[11] = -1e4, np.log(0.4)
    q, k_cmp = crafted_k_cmp(logits, T)
    np.testing.assert_array_equal(select_blocks(q, k_cmp, cfg, scale=1.0).numpy()[0, t, 0],
                                  [0, 4, 6, 7])


def test_select_blocks_p_sel_equals_p_cmp_when_blocks_coincide():
    """l = d = l_sel: the selection score of block j is p_cmp of compressed block j, so the
    free picks are the compressed blocks of highest probability (computed here in NumPy)."""
    cfg = NSAConfig.tiny(n_heads=1, n_kv_heads=1, cmp_block=8, cmp_stride=8, sel_block=8,
                         n_sel=4, n_init=1, n_local=1)
    T = 61
    rng = np.random.default_rng(0)
    logits = rng.normal(size=num_cmp_blocks(cfg, T)) * 2
    q, k_cmp = crafted_k_cmp(logits, T)
    block_idx = select_blocks(q, k_cmp, cfg, scale=1.0).numpy()[0, :, 0]
    for t in range(T):
        last = t // cfg.sel_block
        n_adm = (t + 1 - cfg.cmp_block) // cfg.cmp_stride + 1 if t + 1 >= cfg.cmp_block else 0
        p_cmp = np.zeros(last + 1)
        if n_adm:
            e = np.exp(logits[:n_adm] - logits[:n_adm].max())
            p_cmp[:n_adm] = e / e.sum()
        forced = {0, last}
        rest = sorted((j for j in range(last + 1) if j not in forced), key=lambda j: (-p_cmp[j], j))
        expected = sorted(forced | set(rest[: cfg.n_sel - len(forced)]))
        expected += [-1] * (cfg.n_sel - len(expected))
        np.testing.assert_array_equal(block_idx[t], expected)


def test_select_blocks_has_no_gradient():
    cfg = NSAConfig.tiny()
    q, k_cmp, _ = compressed_inputs(cfg, 37, 2, 2, seed=0)
    q.requires_grad_()
    block_idx = select_blocks(q, k_cmp.requires_grad_(), cfg)
    assert not block_idx.requires_grad and block_idx.grad_fn is None


# ---------------------------------------------------------------------------------------------
# selected_attention
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("G, h", GROUPS)
@pytest.mark.parametrize("T", LENGTHS)
def test_selected_attention_matches_bruteforce(G, h, T):
    cfg = NSAConfig.tiny(n_heads=G * h, n_kv_heads=G)
    q, k, v = random_qkv(2, T, G, h, cfg.d_k, cfg.d_v, seed=100 + T + G + h)
    k_cmp = compress_kv(k, None, cfg) * 3.0
    block_idx = select_blocks(q, k_cmp, cfg)
    out = selected_attention(q, k, v, block_idx, cfg.sel_block)
    ref = bf_selected_attention(q.numpy(), k.numpy(), v.numpy(), block_idx.numpy(), cfg.sel_block)
    assert out.shape == (2, T, G * h, cfg.d_v)
    assert rel_err(out, ref) <= RTOL


@pytest.mark.parametrize("block_size", [1, 5, 11])
def test_selected_attention_arbitrary_blocks(block_size):
    """Random (unsorted, -1 holed) block lists, a block size that divides nothing, and a scale."""
    B, T, G, h, n = 2, 37, 2, 2, 3
    q, k, v = random_qkv(B, T, G, h, 12, 4, seed=block_size)
    rng = np.random.default_rng(block_size)
    n_blocks = -(-T // block_size)
    block_idx = np.full((B, T, G, n), -1, dtype=np.int32)
    for b, t, g in np.ndindex(B, T, G):
        eligible = np.arange(t // block_size + 1)
        picks = rng.choice(eligible, size=min(n, len(eligible)), replace=False)
        block_idx[b, t, g, : len(picks)] = picks
        if t % 3 == 0 and len(picks) > 1:
            block_idx[b, t, g, 0] = -1  # a hole, not only trailing padding
    assert n_blocks > n
    out = selected_attention(q, k, v, torch.from_numpy(block_idx), block_size, scale=0.3)
    ref = bf_selected_attention(q.numpy(), k.numpy(), v.numpy(), block_idx, block_size, scale=0.3)
    assert rel_err(out, ref) <= RTOL


# ---------------------------------------------------------------------------------------------
# sliding_window_attention
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("G, h", GROUPS)
@pytest.mark.parametrize("window", [1, 7, 16, 100])
def test_sliding_window_attention_matches_bruteforce(G, h, window):
    T = 37
    q, k, v = random_qkv(2, T, G, h, 16, 8, seed=window + G + h)
    out = sliding_window_attention(q, k, v, window)
    ref = bf_sliding_window_attention(q.numpy(), k.numpy(), v.numpy(), window)
    assert out.shape == (2, T, G * h, 8)
    assert rel_err(out, ref) <= RTOL


def test_sliding_window_attention_chunked(monkeypatch):
    """Force many small query chunks: the key slices at chunk edges must still be right."""
    from nsa_torch_ref import reference
    monkeypatch.setattr(reference, "ELEMENT_BUDGET", 64)
    q, k, v = random_qkv(1, 53, 2, 2, 8, 4, seed=0)
    for window in (3, 16):
        ref = bf_sliding_window_attention(q.numpy(), k.numpy(), v.numpy(), window, scale=0.5)
        assert rel_err(sliding_window_attention(q, k, v, window, scale=0.5), ref) <= RTOL
    cfg = NSAConfig.tiny()
    k_cmp, v_cmp = compress_kv(k, None, cfg) * 3.0, compress_kv(v, None, cfg)
    block_idx = select_blocks(q, k_cmp, cfg)
    ref = bf_select_blocks(q.numpy(), k_cmp.numpy(), cfg)
    np.testing.assert_array_equal(block_idx.numpy(), ref)
    o_ref, _ = bf_compressed_attention(q.numpy(), k_cmp.numpy(), v_cmp.numpy(), cfg)
    assert rel_err(compressed_attention(q, k_cmp, v_cmp, cfg), o_ref) <= RTOL
    ref = bf_selected_attention(q.numpy(), k.numpy(), v.numpy(), block_idx.numpy(), cfg.sel_block)
    assert rel_err(selected_attention(q, k, v, block_idx, cfg.sel_block), ref) <= RTOL


# ---------------------------------------------------------------------------------------------
# Input validation
# ---------------------------------------------------------------------------------------------
def test_kernel_functions_reject_bad_shapes():
    cfg = NSAConfig.tiny()
    q, k, v = random_qkv(1, 20, 2, 2, 16, 8, seed=0)
    with pytest.raises(ValueError, match="q must be"):
        sliding_window_attention(q[0], k, v, 4)
    with pytest.raises(ValueError, match="k head dim"):
        sliding_window_attention(q, k[..., :8], v, 4)
    with pytest.raises(ValueError, match="q heads"):
        sliding_window_attention(q[:, :, :3], k, v, 4)
    with pytest.raises(ValueError, match="window"):
        sliding_window_attention(q, k, v, 0)
    with pytest.raises(ValueError, match="block_idx"):
        selected_attention(q, k, v, torch.zeros(1, 20, 2, 3), 16)
    with pytest.raises(ValueError, match="block_idx"):
        selected_attention(q, k, v, torch.zeros(1, 19, 2, 3, dtype=torch.int32), 16)
    with pytest.raises(ValueError, match="block_size"):
        selected_attention(q, k, v, torch.zeros(1, 20, 2, 3, dtype=torch.int32), 0)
    with pytest.raises(ValueError, match="k_cmp"):
        compressed_attention(q, k[:, :4, :, :8], v[:, :4], cfg)
    with pytest.raises(ValueError, match="cmp_params"):
        compress_kv(k, {"pos": torch.zeros(2, 8, 15)}, cfg)
