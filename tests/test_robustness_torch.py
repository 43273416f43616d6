"""Robustness of the torch layer (docs/ROBUSTNESS.md): non-finite isolation on the reference
("sdpa") path and the Triton selection kernel in interpret mode, and input checks.

A NaN / inf at token t of a sequence must change nothing before t and nothing in another batch
row or packed sequence, forward and backward (gradient wrt x of a loss over the clean rows).
"""
import numpy as np
import pytest
import torch

from nsa_common import NSAConfig
from nsa_torch_ref import reference
from test_torch_layer import make_layer

T, BAD = 60, 30   # the bad token sits mid-sequence, inside every branch's reach
CFG = NSAConfig.tiny(n_sel=3)            # l_sel 16: query 29's block [16, 32) holds 30 and 31
CFG_MEAN = NSAConfig.tiny(n_sel=3, compress="mean", shared_kv=True, window=5)
# Clean rows compute on the same values in both runs; only sums whose masked terms were 0 * x
# and are now 0 * 0 may differ, and they do not: float64 agreement to rounding.
TOL = 1e-12
AUX_FLOAT = ("o_cmp", "o_sel", "o_win", "gates")


def assert_same(bad_run, clean_run, what):
    bad_run, clean_run = bad_run.detach().numpy(), clean_run.detach().numpy()
    assert np.isfinite(bad_run).all(), f"{what}: non-finite where the clean run is finite"
    np.testing.assert_allclose(bad_run, clean_run, rtol=TOL, atol=TOL, err_msg=what)


def run_layer(layer, x, keep, cu_seqlens=None):
    """(y, aux, grad of `sum(y * w)` over the rows where keep [B, T] is True wrt x)."""
    x = x.clone().requires_grad_(True)
    y, aux = layer(x, cu_seqlens=cu_seqlens, return_aux=True)
    w = torch.randn(y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(7))
    torch.where(keep[..., None], y * w, torch.zeros_like(y)).sum().backward()
    return y, aux, x.grad


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")])
@pytest.mark.parametrize("cfg", [CFG, CFG_MEAN], ids=["mlp", "mean-shared-w5"])
def test_nonfinite_token_stays_in_its_row_and_after_it(cfg, bad_value):
    layer = make_layer(cfg)
    x = torch.randn(2, T, cfg.d_model, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(1))
    x_bad = x.clone()
    x_bad[0, BAD, 0] = bad_value
    keep = torch.arange(T)[None, :] < torch.tensor([[BAD], [T]])  # row 0 before t, all of row 1
    y, aux, grad = run_layer(layer, x, keep)
    y_bad, aux_bad, grad_bad = run_layer(layer, x_bad, keep)
    for name, clean, dirty in [("y", y, y_bad)] + [(k, aux[k], aux_bad[k]) for k in AUX_FLOAT]:
        assert_same(dirty[0, :BAD], clean[0, :BAD], f"{name} before t")
        assert_same(dirty[1], clean[1], f"{name} of the other batch row")
    assert not torch.isfinite(y_bad[0, BAD]).any()
    for name in ("o_cmp", "o_sel", "o_win"):  # the rows that see token t are NaN, not wrong
        assert not torch.isfinite(aux_bad[name][0, BAD]).any(), name
    assert torch.equal(aux_bad["block_idx"][0, :BAD], aux["block_idx"][0, :BAD])
    assert_same(grad_bad[0, :BAD], grad[0, :BAD], "dx before t")
    assert_same(grad_bad[1], grad[1], "dx of the other batch row")


@pytest.mark.parametrize("bad", [45, 3], ids=["in-second", "in-first"])
def test_packed_sequences_do_not_leak(bad):
    cfg, cu = CFG, torch.tensor([0, 30, 60], dtype=torch.int32)
    layer = make_layer(cfg)
    x = torch.randn(1, T, cfg.d_model, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(2))
    x_bad = x.clone()
    x_bad[0, bad] = float("nan")
    own_start = 30 if bad >= 30 else 0
    clean_rows = torch.ones(T, dtype=torch.bool)
    clean_rows[bad:own_start + 30] = False          # tokens >= bad of its own sequence
    keep = clean_rows[None, :]
    y, aux, grad = run_layer(layer, x, keep, cu)
    y_bad, aux_bad, grad_bad = run_layer(layer, x_bad, keep, cu)
    for name, clean, dirty in [("y", y, y_bad)] + [(k, aux[k], aux_bad[k]) for k in AUX_FLOAT]:
        assert_same(dirty[0, clean_rows], clean[0, clean_rows], name)
    assert not torch.isfinite(y_bad[0, bad]).any()
    assert_same(grad_bad[0, clean_rows], grad[0, clean_rows], "dx of the clean tokens")


@pytest.mark.parametrize("branch", ["compressed", "selected", "window"])
def test_reference_kernels_isolate_nonfinite_keys_and_values(branch):
    """Kernel level, float64: a NaN key and an inf value at token t; query gradients of a loss
    over the queries before t equal the clean run's, key / value gradients too."""
    cfg = CFG
    gen = torch.Generator().manual_seed(3)
    B, G, h = 1, cfg.n_kv_heads, cfg.heads_per_group
    q = torch.randn(B, T, G * h, cfg.d_k, dtype=torch.float64, generator=gen)
    if branch == "compressed":
        C = (T - cfg.cmp_block) // cfg.cmp_stride + 1
        k = torch.randn(B, C, G, cfg.d_k, dtype=torch.float64, generator=gen)
        v = torch.randn(B, C, G, cfg.d_v, dtype=torch.float64, generator=gen)
        bad_key = BAD // cfg.cmp_stride  # first query that sees it: bad_key * d + l - 1 > BAD
        first_seen = bad_key * cfg.cmp_stride + cfg.cmp_block - 1
        fn = lambda q, k, v: reference.compressed_attention(q, k, v, cfg)  # noqa: E731
    else:
        k = torch.randn(B, T, G, cfg.d_k, dtype=torch.float64, generator=gen)
        v = torch.randn(B, T, G, cfg.d_v, dtype=torch.float64, generator=gen)
        bad_key, first_seen = BAD, BAD
        if branch == "selected":
            # Every block up to the query's own: block BAD // l_sel is gathered, in part past t.
            idx = torch.arange(cfg.n_sel).expand(B, T, G, cfg.n_sel).to(torch.int32)
            idx = torch.where(idx <= (torch.arange(T) // cfg.sel_block)[None, :, None, None],
                              idx, -1)
            def fn(q, k, v):
                return reference.selected_attention(q, k, v, idx, cfg.sel_block)
        else:
            def fn(q, k, v):
                return reference.sliding_window_attention(q, k, v, cfg.window)
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[0, bad_key, 0, 1] = float("nan")
    v_bad[0, bad_key, 1, 0] = float("inf")

    def run(k, v):
        leaves = [a.clone().requires_grad_(True) for a in (q, k, v)]
        o = fn(*leaves)
        o[:, :first_seen].sum().backward()
        return o, [a.grad for a in leaves]

    o, grads = run(k, v)
    o_bad, grads_bad = run(k_bad, v_bad)
    assert_same(o_bad[:, :first_seen], o[:, :first_seen], "o before t")
    assert not torch.isfinite(o_bad[:, first_seen]).all()
    assert_same(grads_bad[0], grads[0], "dq")
    for name, g_bad, g in (("dk", grads_bad[1], grads[1]), ("dv", grads_bad[2], grads[2])):
        keep = torch.ones(g.shape[1], dtype=torch.bool)
        keep[bad_key] = False
        assert_same(g_bad[:, keep], g[:, keep], name)


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("branch", ["window", "compressed"])
def test_fa2_wrappers_isolate_nonfinite_tokens(branch, packed):
    """The FA-2 entry points zero non-finite inputs and poison the rows that see them, whatever
    the kernel does with masked keys (on a CPU they run the reference; the GPU test runs the
    kernels). Packed: a NaN in the second sequence leaves the first and its own prefix alone."""
    from nsa_common import num_cmp_blocks
    from nsa_torch_ref.fast import fa2
    cfg = CFG
    gen = torch.Generator().manual_seed(4)
    G, H = cfg.n_kv_heads, cfg.n_heads
    cu = torch.tensor([0, 30, 60], dtype=torch.int32) if packed else None
    lengths = [30, 30] if packed else [T]
    q = torch.randn(1, T, H, cfg.d_k, dtype=torch.float64, generator=gen)
    if branch == "window":
        S, bad, first_seen = T, 45, 45
        fn = lambda q, k, v: fa2.sliding_window_attention_fa2(q, k, v, cfg.window,  # noqa: E731
                                                              cu_seqlens=cu)
    else:
        S = sum(num_cmp_blocks(cfg, n) for n in lengths)
        bad = S - 1  # the last block of the last sequence, first seen by its last token(s)
        last_block = num_cmp_blocks(cfg, lengths[-1]) - 1
        first_seen = T - lengths[-1] + last_block * cfg.cmp_stride + cfg.cmp_block - 1
        fn = lambda q, k, v: fa2.compressed_attention_fa2(q, k, v, cfg, cu_seqlens=cu)  # noqa: E731
    k = torch.randn(1, S, G, cfg.d_k, dtype=torch.float64, generator=gen)
    v = torch.randn(1, S, G, cfg.d_v, dtype=torch.float64, generator=gen)
    k_bad = k.clone()
    k_bad[0, bad, 0, 0] = float("nan")
    o, o_bad = fn(q, k, v), fn(q, k_bad, v)
    assert_same(o_bad[:, :first_seen], o[:, :first_seen], "rows before the bad key")
    assert not torch.isfinite(o_bad[:, first_seen]).all()
