"""Decode: `decode_step` after `prefill` reproduces the full layer at every position, selects the
same blocks, and reads exactly the tokens the spec counts (never more than the paper's bound)."""
import dataclasses
import functools

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
        assert cache.lengths.tolist() == [n_prompt] * 2
    for t in range(n_prompt, T):
        y_t, cache, reads, aux = decode_step(layer, x[:, t:t + 1], cache, return_aux=True)
        assert y_t.shape == (2, 1, cfg.d_model) and cache.lengths.tolist() == [t + 1] * 2
        torch.testing.assert_close(y_t[:, 0], y_full[:, t], rtol=0, atol=ATOL)
        assert torch.equal(aux["block_idx"][:, 0], aux_full["block_idx"][:, t]), t
        for branch in ("o_cmp", "o_sel", "o_win", "gates"):
            torch.testing.assert_close(aux[branch][:, 0], aux_full[branch][:, t], rtol=0, atol=ATOL)

        expected = expected_reads(cfg, t, aux_full["block_idx"][:, t].numpy())
        assert reads["cmp"].tolist() == [expected["cmp"]] * 2
        assert reads["win"].tolist() == [expected["win"]] * 2
        np.testing.assert_array_equal(reads["sel"].numpy(), expected["sel"])
        np.testing.assert_array_equal(reads["total"].numpy(),
                                      expected["cmp"] + expected["sel"] + expected["win"])
        bound = max(0, (t + 1 - cfg.cmp_block) // cfg.cmp_stride + 1) \
            + cfg.n_sel * cfg.sel_block + cfg.window
        assert reads["bound"].tolist() == [bound] * 2
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
    compressed blocks of the prompt; unused rows stay zero. (Prefill projects sequence by
    sequence: equal to the batched projection up to rounding.)"""
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
    torch.testing.assert_close(cache.k_sel[:, :n_prompt], k["sel"], rtol=0, atol=ATOL)
    torch.testing.assert_close(cache.v_sel[:, :n_prompt], v["sel"], rtol=0, atol=ATOL)
    assert torch.all(cache.k_sel[:, n_prompt:] == 0)
    close = functools.partial(torch.testing.assert_close, rtol=0, atol=ATOL)
    for t in range(n_prompt - cfg.window, n_prompt):
        close(cache.k_win[:, t % cfg.window], k["win"][:, t])
        close(cache.v_win[:, t % cfg.window], v["win"][:, t])
    for t in range(n_prompt - cfg.cmp_block, n_prompt):
        close(cache.k_cmp_raw[:, t % cfg.cmp_block], k["cmp"][:, t])
        close(cache.v_cmp_raw[:, t % cfg.cmp_block], v["cmp"][:, t])
    torch.testing.assert_close(cache.k_cmp[:, :n_cmp], k_cmp, rtol=0, atol=ATOL)
    torch.testing.assert_close(cache.v_cmp[:, :n_cmp], v_cmp, rtol=0, atol=ATOL)
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
    with pytest.raises(ValueError, match="lengths"):
        prefill(layer, x, cache, lengths=[1, 5])
    _, cache = prefill(layer, x, cache, lengths=[4, 3])
    with pytest.raises(ValueError, match="cache is full for sequence 0"):
        prefill(layer, x, cache, lengths=[2, 2])
    decode_step(layer, x[:, :1], cache)
    with pytest.raises(ValueError, match="cache is full for sequence 0.*max_len 5"):
        decode_step(layer, x[:, :1], cache)
    assert cache.lengths.tolist() == [5, 4]  # the refused step wrote nothing
    with pytest.raises(ValueError, match="max_len"):
        init_cache(cfg, batch=2, max_len=0)
    with pytest.raises(ValueError, match="cache is full"):
        prefill(layer, torch.randn(2, 6, cfg.d_model, dtype=torch.float64),
                init_cache(cfg, batch=2, max_len=5, dtype=torch.float64))


def test_ragged_prefill_chunks_and_decode_match_each_sequence():
    """Prompts of 3, 0 and 21 tokens in one prefill, a ragged continuation (chunked prefill on
    the non-empty cache), then decode steps: each row's outputs at every position equal its
    sequence's full forward, and its reads are its own."""
    cfg = CONFIGS["tiny"]
    layer = make_layer(cfg)
    B, n = 3, 40
    x = torch.randn(B, n, cfg.d_model, generator=torch.Generator().manual_seed(6),
                    dtype=torch.float64)
    y_full, aux_full = layer(x, return_aux=True)  # causal: row b at t is its own prefix's
    prompt, chunk, steps = [3, 0, 21], [9, 14, 2], 6
    cache = init_cache(cfg, batch=B, max_len=n, dtype=torch.float64)
    y, cache = prefill(layer, x[:, :max(prompt)], cache, lengths=prompt)
    for b in range(B):
        torch.testing.assert_close(y[b, :prompt[b]], y_full[b, :prompt[b]], rtol=0, atol=ATOL)
        assert torch.all(y[b, prompt[b]:] == 0)
    x_chunk = torch.stack([x[b, prompt[b]:prompt[b] + max(chunk)] for b in range(B)])
    y, cache = prefill(layer, x_chunk, cache, lengths=chunk)
    for b in range(B):
        torch.testing.assert_close(y[b, :chunk[b]],
                                   y_full[b, prompt[b]:prompt[b] + chunk[b]], rtol=0, atol=ATOL)
    for _ in range(steps):
        t = cache.lengths.clone()
        y_t, cache, reads, aux = decode_step(layer, x[torch.arange(B), t][:, None], cache,
                                             return_aux=True)
        for b in range(B):
            torch.testing.assert_close(y_t[b, 0], y_full[b, t[b]], rtol=0, atol=ATOL)
            assert torch.equal(aux["block_idx"][b, 0], aux_full["block_idx"][b, t[b]])
            expected = expected_reads(cfg, int(t[b]), aux_full["block_idx"][b:b + 1, t[b]].numpy())
            assert reads["cmp"][b] == expected["cmp"] and reads["win"][b] == expected["win"]
            np.testing.assert_array_equal(reads["sel"][b].numpy(), expected["sel"][0])
    assert cache.lengths.tolist() == [p + c + steps for p, c in zip(prompt, chunk)]


def test_chunked_prefill_equals_one_shot():
    cfg = CONFIGS["shared_mean_norope"]
    layer = make_layer(cfg)
    x = torch.randn(2, 30, cfg.d_model, generator=torch.Generator().manual_seed(7),
                    dtype=torch.float64)
    one = init_cache(cfg, batch=2, max_len=32, dtype=torch.float64)
    y_one, one = prefill(layer, x, one)
    chunked = init_cache(cfg, batch=2, max_len=32, dtype=torch.float64)
    ys = [prefill(layer, x[:, a:b], chunked)[0] for a, b in ((0, 11), (11, 12), (12, 30))]
    torch.testing.assert_close(torch.cat(ys, 1), y_one, rtol=0, atol=ATOL)
    for field in dataclasses.fields(one):
        torch.testing.assert_close(getattr(chunked, field.name), getattr(one, field.name),
                                   rtol=0, atol=ATOL)
