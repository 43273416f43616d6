"""GPU matrix, JAX decode: the split-KV Pallas decode kernels (Triton) at paper sizes for a
batch of one with a position per row, and a ragged generation (ragged prefill, chunked prefill,
decode from each sequence's own position) on the Pallas decode path against each sequence's
full forward."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import jax_has_gpu
from jax_inputs import make_inputs
from nsa_common.testing import rel_err
from nsa_common import NSAConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not jax_has_gpu(), reason="needs a GPU")]


@pytest.mark.parametrize("B", [1, 4, 8])
def test_split_kv_kernels_paper_sizes(B):
    """Paper sizes (H 64, G 4, d 128, l 32, d 16, l_sel 64, n_sel 16, w 512), a 20k cache, bf16,
    default tiles (split over up to 64 programs per row and KV head), rows at different t."""
    from test_pallas_decode import _block_idx, _inputs
    from pallas_kernels import decode as D

    H, G, dk, dv, L, ring = 64, 4, 128, 128, 20000, 512
    C = (L - 32) // 16 + 1
    x = _inputs(B, H, G, dk, dv, C, L, ring, jnp.bfloat16, seed=B)
    f32 = {k: v.astype(jnp.float32) for k, v in x.items()}
    t = jnp.asarray(L - 3 - 2311 * np.arange(B), jnp.int32)   # B 1: the end of the cache
    o, _, p = D.decode_compressed(x["q"], x["k_cmp"], x["v_cmp"], t, cmp_block=32,
                                  cmp_stride=16, scale=0.088)
    o_r, _, p_r = D.decode_compressed_reference(f32["q"], f32["k_cmp"], f32["v_cmp"], t,
                                                cmp_block=32, cmp_stride=16, scale=0.088)
    assert rel_err(o, o_r) <= 1e-2 and rel_err(p, p_r) <= 1e-4
    idx = jnp.concatenate([_block_idx(1, G, 16, int(t_b), 64, seed=b)
                           for b, t_b in enumerate(np.asarray(t))])
    got = D.decode_selected_window(x["q"], x["k_sel"], x["v_sel"], idx, x["k_win"], x["v_win"],
                                   t, sel_block=64, window=512, scale=0.088)
    ref = D.decode_selected_window_reference(f32["q"], f32["k_sel"], f32["v_sel"], idx,
                                             f32["k_win"], f32["v_win"], t, sel_block=64,
                                             window=512, scale=0.088)
    for a, r in zip(got, ref):
        assert rel_err(a, r) <= 1e-2


def test_ragged_generation_pallas_float32():
    """Prompts of 700, 0 and 1500 tokens, a ragged chunk, then decode steps on the Pallas
    decode kernels: every position equals the sequence's full forward (float32)."""
    from test_jax_decode import F32_TOL, check_ragged

    cfg = NSAConfig.paper().replace(d_model=256, n_heads=16, n_kv_heads=2, d_k=64, d_v=64)
    params, x_all = make_inputs(cfg, 3, 2048, jnp.float32, seed=12)
    check_ragged(params, x_all, cfg, 2048, prompt=[700, 0, 1500], chunk=[100, 300, 1],
                 steps=24, backend="pallas", tol=F32_TOL)


def test_decode_ranking_equals_the_sort_on_the_gpu():
    """The Pallas decode ranking (`rank_scores` + the top-n kernel, Triton) picks the same
    blocks as `top_blocks`' sort on tie-heavy decode-sized rows (128 rows of 1,024 / 2,049
    blocks, n_sel 16)."""
    import jax

    import pallas_kernels
    from nsa_jax.xla.select_blocks import rank_scores, top_blocks
    from test_pallas_decode import _tie_heavy_scores

    cfg = NSAConfig.paper(d_k=128)
    for n_blocks in (1024, 2049):
        scores = jnp.asarray(_tie_heavy_scores(128, n_blocks, seed=n_blocks))
        t = jnp.asarray(np.random.default_rng(0).integers(0, n_blocks * 64, size=128), jnp.int32)
        want = np.asarray(jax.jit(lambda s, t: top_blocks(s, t, cfg))(scores, t))
        got = jax.jit(lambda s, t: pallas_kernels.top_n(rank_scores(s, t, cfg), cfg.n_sel))(
            scores, t)
        np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("n_cols, n_sel", [(1024, 16), (64, 5)])
def test_top_n_kernel_against_brute_force_on_the_gpu(n_cols, n_sel):
    """The compiled top-n kernel (Triton) on the CPU test's cases: ties, +inf, -inf, NaN, rows
    with fewer eligible blocks than n_sel."""
    import jax

    import pallas_kernels
    from test_pallas_select_blocks import check_top_n, top_n_cases

    score = top_n_cases(n_cols, n_sel)
    got = jax.jit(lambda s: pallas_kernels.top_n(s, n_sel))(jnp.asarray(score))
    check_top_n(got, score, n_sel)


@pytest.mark.parametrize("B", [1, 32])
def test_fused_selection_paper_sizes(B):
    """`decode_compressed_select` (Triton) at paper sizes over a 64k cache, bf16: o and lse as
    `decode_compressed`'s, and the blocks of the unfused path (probabilities, `band_scores`,
    `top_blocks`) except where two blocks' scores tie to rounding (the head sums run in another
    order): there the swapped blocks' scores agree to 1e-5."""
    import jax

    from nsa_jax.xla.select_blocks import band_scores, top_blocks
    from test_pallas_decode import _inputs
    from pallas_kernels import decode as D

    cfg = NSAConfig.paper(d_k=128)
    H, G, dk, dv, L = 64, 4, 128, 128, 65536 + 64
    C, n_blocks = (L - 32) // 16 + 1, L // 64 + 1
    x = _inputs(B, H, G, dk, dv, C, 64, 64, jnp.bfloat16, seed=B)
    t = jnp.asarray(L - 1 - 977 * np.arange(B), jnp.int32)
    kw = dict(cmp_block=32, cmp_stride=16, scale=0.088)
    o, lse, idx = jax.jit(lambda q, k, v, t: D.decode_compressed_select(
        q, k, v, t, sel_block=64, n_sel=16, n_init=1, n_local=2, n_blocks=n_blocks, **kw))(
        x["q"], x["k_cmp"], x["v_cmp"], t)
    o_u, lse_u, p = jax.jit(lambda q, k, v, t: D.decode_compressed(q, k, v, t, **kw))(
        x["q"], x["k_cmp"], x["v_cmp"], t)
    assert rel_err(o, o_u) <= 1e-6 and rel_err(lse, lse_u) <= 1e-6
    score = band_scores(p, cfg, n_blocks)
    want = np.asarray(top_blocks(score, t[:, None], cfg))
    got, score = np.asarray(idx), np.asarray(score)
    for b in range(B):
        for g in range(G):
            extra = set(got[b, g]) ^ set(want[b, g])
            if extra:
                values = score[b, g, sorted(i for i in extra if i >= 0)]
                assert np.ptp(values) <= 1e-5 * np.abs(values).max(), (b, g, extra)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_compress_step_paper_sizes(dtype):
    """The step's compression kernel (Triton) at paper sizes (l 32, d 16, G 4, D 128, the MLP):
    rows whose token completes a block get the XLA compression's summary (bf16: to its
    rounding; float32 to 1e-5), the other rows keep their buffers."""
    import jax
    import pallas_kernels
    from nsa_jax.layer import init_params
    from nsa_jax.xla.compress import compress_blocks

    cfg = NSAConfig.paper(d_k=128)      # the kernel takes D a power of two
    l, d, G, D = cfg.cmp_block, cfg.cmp_stride, cfg.n_kv_heads, cfg.d_k
    B, C, limit = 3, 64, 1024
    rng = np.random.default_rng(8)
    rings = tuple(jnp.asarray(rng.standard_normal((B, l, G, D)), dtype) for _ in range(2))
    bufs = tuple(jnp.asarray(rng.standard_normal((B, C, G, D)), dtype) for _ in range(2))
    params = init_params(jax.random.PRNGKey(2), cfg, dtype)
    mlp = tuple({name: jnp.asarray(rng.standard_normal(w.shape) * 0.05, dtype)
                 for name, w in params[key].items()} for key in ("cmp_k", "cmp_v"))
    t = jnp.asarray([l - 1 + 5 * d, l + 3, l - 1 + 9 * d], jnp.int32)
    got = jax.jit(lambda r, b, t: pallas_kernels.compress_step(
        r, b, t, mlp, cmp_block=l, cmp_stride=d, limit=limit))(rings, bufs, t)
    for k, (ring, buf, out) in enumerate(zip(rings, bufs, got)):
        want = np.asarray(buf, np.float32).copy()
        for b, slot in ((0, 5), (2, 9)):
            first = int(t[b]) - l + 1
            block = ring[b, (first + np.arange(l)) % l]
            with jax.default_matmul_precision("highest"):     # float32's default is TF32
                summary = compress_blocks(block, mlp[k], cfg)
            want[b, slot] = np.asarray(summary.astype(dtype), np.float32)
        out = np.asarray(out, np.float32)
        if dtype == jnp.float32:
            np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)
        else:
            # One bf16 ulp where the float32 sums round differently, and where they cancel
            # (a summary near zero) the error of the kernel's hi + lo product, ~2^-16 of the
            # terms, whose scale is the summaries'. Dropping the low part errs by ~2^-9.
            atol = 2 ** -16 * float(np.abs(want).max())
            np.testing.assert_allclose(out, want, rtol=2 ** -7, atol=atol)
        np.testing.assert_array_equal(out[1], np.asarray(buf[1], np.float32))
