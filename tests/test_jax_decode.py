"""nsa_jax decode: prefill + decode_step against the full layer at every position, read counts,
compile-once, cache layout and errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nsa_jax
from jax_inputs import AUX_FLOAT, make_inputs, rel_err
from nsa_common import NSAConfig, decode_read_bound
from nsa_jax.decode import decode_read_bound as jnp_decode_read_bound

TOL = 1e-10      # float64 decode against the float64 layer
F32_TOL = 1e-5   # the spec's float32 tolerance


def expected_reads(cfg, t, block_idx):
    """The spec's per-step counts; block_idx `[B, G, n_sel]` of the token at position t."""
    l, d, l_sel = cfg.cmp_block, cfg.cmp_stride, cfg.sel_block
    cmp = max(0, (t + 1 - l) // d + 1)
    sel = max(sum(min(l_sel, t - j * l_sel + 1) for j in row if j >= 0)
              for row in np.asarray(block_idx).reshape(-1, cfg.n_sel))
    win = min(cfg.window, t + 1)
    return dict(cmp=cmp, sel=sel, win=win, total=cmp + sel + win, bound=decode_read_bound(cfg, t))


def run_generation(params, x, cfg, max_len, prefix):
    """Prefill `prefix` tokens (none if 0), then decode the rest one by one through a jitted
    step. -> (y [B, T, D], aux per position, reads per position, number of step traces)."""
    B, T, _ = x.shape
    cache = nsa_jax.init_cache(cfg, B, max_len, x.dtype)
    outputs, auxes, reads_log = [], [], []
    if prefix:
        y, cache, aux = nsa_jax.prefill(params, x[:, :prefix], cfg, cache, return_aux=True)
        assert int(cache.pos) == prefix
        outputs.append(y)
        auxes.extend({k: v[:, t] for k, v in aux.items()} for t in range(prefix))
        reads_log.extend([None] * prefix)
    traces = []

    @jax.jit
    def step(params, x_t, cache):
        traces.append(1)  # runs only while tracing
        return nsa_jax.decode_step(params, x_t, cfg, cache, return_aux=True)

    for t in range(prefix, T):
        y_t, cache, reads, aux = step(params, x[:, t:t + 1], cache)
        assert int(cache.pos) == t + 1
        outputs.append(y_t)
        auxes.append({k: v[:, 0] for k, v in aux.items()})
        reads_log.append({k: int(v) for k, v in reads.items()})
    return jnp.concatenate(outputs, axis=1), auxes, reads_log, len(traces)


@pytest.mark.parametrize("prefix", [5, 37])
def test_decode_matches_layer_at_every_position(x64, prefix):
    """B = 2, H = 4 > G = 2, 70 tokens: 16 compressed blocks, 5 selection blocks, a window of 16
    that wraps its ring buffer several times; prefill below l and past w."""
    cfg = NSAConfig.tiny()
    params, x = make_inputs(cfg, 2, 70, jnp.float64, seed=1)
    ref_y, ref_aux = nsa_jax.nsa_attention(params, x, cfg, return_aux=True)
    y, auxes, reads_log, traces = run_generation(params, x, cfg, max_len=72, prefix=prefix)
    assert traces == 1  # one compilation for the whole generation
    for t in range(x.shape[1]):
        assert rel_err(y[:, t], ref_y[:, t]) <= TOL, t
        np.testing.assert_array_equal(auxes[t]["block_idx"], ref_aux["block_idx"][:, t])
        for key in AUX_FLOAT:
            assert rel_err(auxes[t][key], ref_aux[key][:, t]) <= TOL, (t, key)
        if reads_log[t] is not None:
            assert reads_log[t] == expected_reads(cfg, t, ref_aux["block_idx"][:, t]), t
            assert reads_log[t]["total"] <= reads_log[t]["bound"]


def test_decode_from_empty_cache_float32_mean_shared_short_cache():
    """No prefill; compress="mean", no RoPE, shared K/V, and max_len < w (the window ring
    buffer shrinks to max_len)."""
    cfg = NSAConfig.tiny(compress="mean", rope_theta=None, shared_kv=True, window=40,
                         n_heads=8, n_kv_heads=2)
    params, x = make_inputs(cfg, 2, 30, jnp.float32, seed=2)
    cache = nsa_jax.init_cache(cfg, 2, 30, jnp.float32)
    assert cache.k_win.shape == (2, 30, 2, cfg.d_k)
    ref_y, ref_aux = nsa_jax.nsa_attention(params, x, cfg, return_aux=True)
    y, auxes, reads_log, traces = run_generation(params, x, cfg, max_len=30, prefix=0)
    assert traces == 1
    assert rel_err(y, ref_y) <= F32_TOL
    for t in range(30):
        np.testing.assert_array_equal(auxes[t]["block_idx"], ref_aux["block_idx"][:, t])
        assert reads_log[t] == expected_reads(cfg, t, ref_aux["block_idx"][:, t])


def test_read_bound_formula():
    cfg = NSAConfig.paper()
    t = np.array([0, 1, 30, 31, 32, 46, 47, 48, 4095, 65535])
    got = np.asarray(jax.vmap(lambda t: jnp_decode_read_bound(cfg, t))(jnp.asarray(t)))
    np.testing.assert_array_equal(got, [decode_read_bound(cfg, int(s)) for s in t])
    assert got[-1] == 5631  # the paper's Table 4 (which rounds T/d up and prints 5,632)


def test_cache_layout():
    cfg = NSAConfig.tiny()  # G 2, d_k 16, d_v 8, l 8, d 4, w 16
    cache = nsa_jax.init_cache(cfg, 3, 50, jnp.bfloat16)
    shapes = {name: tuple(a.shape) for name, a in cache._asdict().items()}
    assert shapes == {"k_sel": (3, 50, 2, 16), "v_sel": (3, 50, 2, 8),
                      "k_win": (3, 16, 2, 16), "v_win": (3, 16, 2, 8),
                      "k_raw": (3, 8, 2, 16), "v_raw": (3, 8, 2, 8),
                      "k_cmp": (3, 11, 2, 16), "v_cmp": (3, 11, 2, 8), "pos": ()}
    assert cache.k_sel.dtype == jnp.bfloat16 and cache.pos.dtype == jnp.int32


def test_decode_errors_name_the_argument():
    cfg = NSAConfig.tiny()
    params, x = make_inputs(cfg, 2, 12, jnp.float32)
    cache = nsa_jax.init_cache(cfg, 2, 10)
    cases = [
        (lambda: nsa_jax.prefill(params, x, cfg, cache), "max_len"),
        (lambda: nsa_jax.prefill(params, x[:1, :4], cfg, cache), "cache"),
        (lambda: nsa_jax.decode_step(params, x[:, :2], cfg, cache), "x_t"),
        (lambda: nsa_jax.decode_step(params, x[:, :1, :8], cfg, cache), "x"),
        (lambda: nsa_jax.decode_step(params, x[:, :1], cfg.replace(window=4), cache), "cache"),
        (lambda: nsa_jax.init_cache(cfg, 0, 10), "batch"),
        (lambda: nsa_jax.init_cache(cfg, 2, -1), "max_len"),
    ]
    for fn, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            fn()
    _, used = nsa_jax.prefill(params, x[:, :4], cfg, cache)
    with pytest.raises(ValueError, match="fresh"):
        nsa_jax.prefill(params, x[:, :4], cfg, used)
