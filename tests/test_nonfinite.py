"""Non-finite isolation in nsa_jax (docs/ROBUSTNESS.md): a NaN / inf at token t of a sequence
changes nothing before t and nothing in another sequence (batched or packed), forward and
backward, on the XLA path and on the Pallas kernels (interpret mode on a CPU; compiled on a GPU in
tests/gpu/test_gpu_nonfinite_jax.py).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nsa_jax
from jax_inputs import make_inputs
from nsa_common import NSAConfig

T, BAD = 60, 30          # 60 tokens; the bad token sits mid-sequence, inside every branch's reach
CFG = NSAConfig.tiny(n_sel=3)
CFG_MEAN = NSAConfig.tiny(n_sel=3, compress="mean", shared_kv=True)
# Clean rows run on the same finite values in both runs; only reductions whose masked entries
# were NaN before and are 0 now may round differently.
TOL = 1e-6
BACKENDS = {"xla": "xla", "pallas": ("pallas", "xla")}


def _close(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "non-finite value where the clean run is finite"
    np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL)


def _run(cfg, backend, x, cu_seqlens=None, params=None):
    params = params if params is not None else make_inputs(cfg, 1, 1, jnp.float32)[0]
    return nsa_jax.nsa_attention(params, x, cfg, backend=backend, cu_seqlens=cu_seqlens)


def _loss_on(cfg, backend, keep, cu_seqlens=None):
    """Gradient wrt x of `sum(y * w)` over the outputs where `keep` `[B, T]` is True."""
    params = make_inputs(cfg, 1, 1, jnp.float32)[0]
    w = jax.random.normal(jax.random.PRNGKey(7), keep.shape + (cfg.d_model,))

    def loss(x):
        y = nsa_jax.nsa_attention(params, x, cfg, backend=backend, cu_seqlens=cu_seqlens)
        return jnp.sum(jnp.where(keep[..., None], y * w, 0.0))
    return jax.jit(jax.grad(loss))


@pytest.mark.parametrize("backend, cfg, bad_value", [
    ("xla", CFG, np.nan), ("xla", CFG_MEAN, np.inf), ("pallas", CFG, np.nan)],
    ids=["xla-mlp-nan", "xla-mean_shared-inf", "pallas-mlp-nan"])
def test_batched_forward_and_backward(backend, cfg, bad_value):
    backend = BACKENDS[backend]
    x = jax.random.normal(jax.random.PRNGKey(1), (2, T, cfg.d_model))
    x_bad = x.at[0, BAD].set(bad_value)
    y, y_bad = _run(cfg, backend, x), _run(cfg, backend, x_bad)
    _close(y_bad[0, :BAD], y[0, :BAD])
    _close(y_bad[1], y[1])
    assert not np.isfinite(np.asarray(y_bad[0, BAD])).any()

    keep = jnp.arange(T)[None, :] < jnp.array([[BAD], [T]])   # row 0 before t, all of row 1
    grad = _loss_on(cfg, backend, keep)
    g, g_bad = grad(x), grad(x_bad)
    _close(g_bad[0, :BAD], g[0, :BAD])
    _close(g_bad[1], g[1])


def test_packed_sequences_do_not_leak():
    """cu_seqlens [0, 30, 60]: a NaN in one sequence leaves the other alone, and the tokens of
    its own sequence before it. Token 3 is inside the first compressed block, which the unused
    compressed slots also read (they must not carry the NaN back in the backward pass)."""
    cfg, cu = CFG, jnp.array([0, 30, 60], jnp.int32)
    bad, other, own_before = 3, slice(30, 60), slice(0, 3)
    x = jax.random.normal(jax.random.PRNGKey(2), (1, T, cfg.d_model))
    x_bad = x.at[0, bad].set(jnp.nan)
    y, y_bad = _run(cfg, "xla", x, cu), _run(cfg, "xla", x_bad, cu)
    _close(y_bad[0, other], y[0, other])
    _close(y_bad[0, own_before], y[0, own_before])
    assert not np.isfinite(np.asarray(y_bad[0, bad])).any()

    keep = jnp.zeros((1, T), bool).at[0, other].set(True).at[0, own_before].set(True)
    grad = _loss_on(cfg, "xla", keep, cu)
    g, g_bad = grad(x), grad(x_bad)
    _close(g_bad[0, other], g[0, other])
    _close(g_bad[0, own_before], g[0, own_before])


@pytest.mark.parametrize("branch", ["compressed", "selected", "window"])
def test_kernel_level_outputs_poisoned_exactly_where_they_attend(branch):
    """Per branch: the rows that are NaN are exactly those whose mask reaches the bad key (one
    NaN in k at token 21, group 1): found by brute force from a clean run with v marked."""
    cfg = CFG
    B, H, G = 1, cfg.n_heads, cfg.n_kv_heads
    keys = jax.random.split(jax.random.PRNGKey(3), 3)
    q = jax.random.normal(keys[0], (B, T, H, cfg.d_k))
    k = jax.random.normal(keys[1], (B, T, G, cfg.d_k))
    v = jax.random.normal(keys[2], (B, T, G, cfg.d_v))
    k_bad = k.at[0, 21, 1, 0].set(jnp.nan)
    # The rows that attend token 21 of group 1: those whose output moves when v[21] moves.
    v_marked = v.at[0, 21, 1].add(1e3)
    if branch == "compressed":
        k_cmp, v_cmp, k_cmp_clean, v_cmp_marked = (
            nsa_jax.compress_kv(a, None, CFG_MEAN) for a in (k_bad, v, k, v_marked))
        out = nsa_jax.compressed_attention(q, k_cmp, v_cmp, cfg)
        clean = nsa_jax.compressed_attention(q, k_cmp_clean, v_cmp, cfg)
        marked = nsa_jax.compressed_attention(q, k_cmp_clean, v_cmp_marked, cfg)
    elif branch == "selected":
        idx = nsa_jax.select_blocks(q, nsa_jax.compress_kv(k, None, CFG_MEAN), cfg)
        out = nsa_jax.selected_attention(q, k_bad, v, idx, cfg.sel_block)
        clean = nsa_jax.selected_attention(q, k, v, idx, cfg.sel_block)
        marked = nsa_jax.selected_attention(q, k, v_marked, idx, cfg.sel_block)
    else:
        out = nsa_jax.sliding_window_attention(q, k_bad, v, cfg.window)
        clean = nsa_jax.sliding_window_attention(q, k, v, cfg.window)
        marked = nsa_jax.sliding_window_attention(q, k, v_marked, cfg.window)
    reaches = np.any(np.asarray(marked) != np.asarray(clean), axis=-1)     # [B, T, H]
    assert reaches.any() and not reaches.all()
    nonfinite = ~np.all(np.isfinite(np.asarray(out)), axis=-1)
    np.testing.assert_array_equal(nonfinite, reaches)
    np.testing.assert_array_equal(np.asarray(out)[~reaches], np.asarray(clean)[~reaches])


def test_decode_keeps_batch_rows_apart():
    """A NaN in one row's prompt and in its next token leaves the other row's decode unchanged;
    the NaN row's own earlier outputs were emitted before it arrived."""
    cfg = CFG
    params, x = make_inputs(cfg, 2, 24, jnp.float32, seed=4)
    x_bad = x.at[0, 10].set(jnp.nan).at[0, 21].set(jnp.inf)

    def decode(x):
        cache = nsa_jax.init_cache(cfg, 2, 24)
        y, cache = nsa_jax.prefill(params, x[:, :20], cfg, cache)
        outs = [y]
        for t in range(20, 24):
            y_t, cache, _ = nsa_jax.decode_step(params, x[:, t:t + 1], cfg, cache)
            outs.append(y_t)
        return jnp.concatenate(outs, axis=1)

    y, y_bad = decode(x), decode(x_bad)
    _close(y_bad[1], y[1])
    _close(y_bad[0, :10], y[0, :10])
    assert not np.isfinite(np.asarray(y_bad[0, 10])).any()
