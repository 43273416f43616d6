"""Decode: `decode_step` after `prefill` reproduces the full layer at every position, selects the
same blocks, and reads exactly the tokens the spec counts (never more than the paper's bound)."""
import numpy as np
import pytest
import torch

from nsa_common import NSAConfig, num_cmp_blocks
from nsa_torch_ref import NSAAttention, decode_step, init_cache, prefill
from nsa_torch_ref.module import compress_branch_kv, project

ATOL = 1e-12  # float64: decode and prefill differ only by summation order
T = 70  # tiny(): l = 8, d = 4, l_sel = 16, w = 16: many compression and selection boundaries


def make_layer(cfg: NSAConfig, seed: int = 0) -> NSAAttention:
    torch.manual_seed(seed)
    layer = NSAAttention(cfg).double()
    with torch.no_grad():
        layer.bg.normal_(0, 0.5)
    return layer


def expected_reads(cfg: NSAConfig, t: int, block_idx_row: np.ndarray) -> dict:
    """The spec's per-step counts, by enumeration. block_idx_row: [B, G, n_sel] for token t."""
    cmp = sum(1 for i in range(t + 1) if i * cfg.cmp_stride + cfg.cmp_block - 1 <= t)
    sel = np.zeros(block_idx_row.shape[:2], dtype=np.int64)
    for b, g in np.ndindex(*sel.shape):
        tokens = {s for j in block_idx_row[b, g] if j >= 0
                  for s in range(j * cfg.sel_block, (j + 1) * cfg.sel_block) if s <= t}
        sel[b, g] = len(tokens)
    win = len(range(max(0, t - cfg.window + 1), t + 1))
    return dict(cmp=cmp, sel=sel, win=win)


CONFIGS = {
    "tiny": NSAConfig.tiny(),
    "shared_mean_norope": NSAConfig.tiny(shared_kv=True, compress="mean", rope_theta=None),
    # No forced local block: the newest block may be left out, so heads read different amounts.
    "no_local": NSAConfig.tiny(n_init=1, n_local=0, n_sel=2, window=5),
}


@pytest.mark.parametrize("name, n_prompt", [("tiny", 0), ("tiny", 21), ("shared_mean_norope", 1),
                                            ("no_local", 21)])
def test_decode_matches_prefill_at_every_position(name, n_prompt):
    cfg = CONFIGS[name]
    assert cfg.n_heads > cfg.n_kv_heads
    layer = make_layer(cfg)
    x = torch.randn(2, T, cfg.d_model, generator=torch.Generator().manual_seed(5),
                    dtype=torch.float64)
    y_full, aux_full = layer(x, return_aux=True)

    cache = init_cache(cfg, batch=2, max_len=T, dtype=torch.float64)
    if n_prompt:
        y_prompt, cache = prefill(layer, x[:, :n_prompt], cache)
        torch.testing.assert_close(y_prompt, y_full[:, :n_prompt], rtol=0, atol=ATOL)
        assert cache.pos == n_prompt
    for t in range(n_prompt, T):
        y_t, cache, reads, aux = decode_step(layer, x[:, t:t + 1], cache, return_aux=True)
        assert y_t.shape == (2, 1, cfg.d_model) and cache.pos == t + 1
        torch.testing.assert_close(y_t[:, 0], y_full[:, t], rtol=0, atol=ATOL)
        assert torch.equal(aux["block_idx"][:, 0], aux_full["block_idx"][:, t]), t
        for branch in ("o_cmp", "o_sel", "o_win", "gates"):
            torch.testing.assert_close(aux[branch][:, 0], aux_full[branch][:, t], rtol=0, atol=ATOL)

        expected = expected_reads(cfg, t, aux_full["block_idx"][:, t].numpy())
        assert reads["cmp"] == expected["cmp"] and reads["win"] == expected["win"]
        np.testing.assert_array_equal(reads["sel"].numpy(), expected["sel"])
        np.testing.assert_array_equal(reads["total"].numpy(),
                                      expected["cmp"] + expected["sel"] + expected["win"])
        bound = max(0, (t + 1 - cfg.cmp_block) // cfg.cmp_stride + 1) \
            + cfg.n_sel * cfg.sel_block + cfg.window
        assert reads["bound"] == bound
        assert np.all(reads["total"].numpy() <= bound)


def test_no_local_config_reads_differ_between_heads():
    """Guards the test above: with n_local = 0 the per-head `sel` counts are not all equal, so
    the comparison against the enumeration checks more than a constant."""
    cfg = CONFIGS["no_local"]
    layer = make_layer(cfg)
    x = torch.randn(2, T, cfg.d_model, generator=torch.Generator().manual_seed(5),
                    dtype=torch.float64)
    cache = init_cache(cfg, batch=2, max_len=T, dtype=torch.float64)
    _, cache = prefill(layer, x[:, :40], cache)
    varied = False
    for t in range(40, T):
        _, cache, reads = decode_step(layer, x[:, t:t + 1], cache)
        varied |= bool(reads["sel"].unique().numel() > 1)
    assert varied


def test_cache_layout_after_prefill():
    """Ring slots hold token t at t % w (window) and t % l (raw cmp keys); k_cmp holds the
    compressed blocks of the prompt; unused rows stay zero."""
    cfg = NSAConfig.tiny()
    layer = make_layer(cfg)
    n_prompt, max_len = 30, 40
    x = torch.randn(2, n_prompt, cfg.d_model, dtype=torch.float64)
    cache = init_cache(cfg, batch=2, max_len=max_len, dtype=torch.float64)
    _, cache = prefill(layer, x, cache)
    params = layer.param_tree()
    _, k, v = project(params, x, cfg, torch.arange(n_prompt))
    k_cmp, v_cmp = compress_branch_kv(params, k["cmp"], v["cmp"], cfg)
    n_cmp = k_cmp.shape[1]
    assert cache.k_sel.shape == (2, max_len, cfg.n_kv_heads, cfg.d_k)
    assert cache.k_cmp.shape == (2, num_cmp_blocks(cfg, max_len), cfg.n_kv_heads, cfg.d_k)
    assert torch.equal(cache.k_sel[:, :n_prompt], k["sel"])
    assert torch.equal(cache.v_sel[:, :n_prompt], v["sel"])
    assert torch.all(cache.k_sel[:, n_prompt:] == 0)
    for t in range(n_prompt - cfg.window, n_prompt):
        assert torch.equal(cache.k_win[:, t % cfg.window], k["win"][:, t])
        assert torch.equal(cache.v_win[:, t % cfg.window], v["win"][:, t])
    for t in range(n_prompt - cfg.cmp_block, n_prompt):
        assert torch.equal(cache.k_cmp_raw[:, t % cfg.cmp_block], k["cmp"][:, t])
        assert torch.equal(cache.v_cmp_raw[:, t % cfg.cmp_block], v["cmp"][:, t])
    assert torch.equal(cache.k_cmp[:, :n_cmp], k_cmp)
    assert torch.equal(cache.v_cmp[:, :n_cmp], v_cmp)
    assert torch.all(cache.k_cmp[:, n_cmp:] == 0)


def test_decode_rejects_bad_inputs():
    cfg = NSAConfig.tiny()
    layer = make_layer(cfg)
    x = torch.randn(2, 4, cfg.d_model, dtype=torch.float64)
    cache = init_cache(cfg, batch=2, max_len=5, dtype=torch.float64)
    with pytest.raises(ValueError, match="x_t must hold 1"):
        decode_step(layer, x[:, :2], cache)
    with pytest.raises(ValueError, match="x_t batch"):
        decode_step(layer, x[:1, :1], cache)
    with pytest.raises(ValueError, match="x_t must be"):
        decode_step(layer, x[:, :1, :-1], cache)
    _, cache = prefill(layer, x, cache)
    with pytest.raises(ValueError, match="cache must be empty"):
        prefill(layer, x, cache)
    decode_step(layer, x[:, :1], cache)
    with pytest.raises(ValueError, match="cache is full"):
        decode_step(layer, x[:, :1], cache)
    with pytest.raises(ValueError, match="max_len"):
        init_cache(cfg, batch=2, max_len=0)
    with pytest.raises(ValueError, match="cache is full"):
        prefill(layer, torch.randn(2, 6, cfg.d_model, dtype=torch.float64),
                init_cache(cfg, batch=2, max_len=5, dtype=torch.float64))
