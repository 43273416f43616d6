"""nsa_jax kernel-level functions (XLA backend) against the NumPy float64 brute force.

Every comparison runs in float64 (`x64` fixture) and must agree to TOL; small query chunks make
the chunked code paths (lax.map over query chunks, padded last chunk) run on tiny inputs.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import bruteforce
import nsa_jax
from conftest import jax_has_gpu, skip_above_cudnn_head_dim
from bruteforce import (bf_compress, bf_compressed_attention, bf_select_blocks,
                        bf_selected_attention, bf_sliding_window_attention)
from nsa_common import NSAConfig, num_cmp_blocks, overlap_weights
from nsa_common.testing import random_block_idx, rel_err
from nsa_jax import XlaOptions, dispatch
from nsa_jax.xla import top_blocks
from nsa_jax.xla.select_blocks import sel_scores

TOL = 1e-10  # relative error of float64 results against the float64 brute force
SMALL_CHUNKS = {"xla": XlaOptions(compressed_q_chunk=8, select_q_chunk=8, selected_q_chunk=8,
                                  window_q_chunk=8)}


def normal(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape))


def cmp_params(rng, G, l, dim):
    return {"pos": normal(rng, G, l, dim) * 0.1,
            "w1": normal(rng, G, l * dim, dim) / math.sqrt(l * dim),
            "b1": normal(rng, G, dim) * 0.1, "w2": normal(rng, G, dim, dim) / math.sqrt(dim),
            "b2": normal(rng, G, dim) * 0.1}


def np_tree(tree):
    return jax.tree_util.tree_map(np.asarray, tree)


# -- compression ---------------------------------------------------------------------------------
@pytest.mark.parametrize("G,T,compress", [(1, 13, "mlp"), (2, 5, "mlp"), (4, 21, "mean"),
                                          (2, 8, "mean")])
def test_compress_kv_matches_bruteforce(x64, G, T, compress):
    rng = np.random.default_rng(0)
    cfg = NSAConfig.tiny(n_kv_heads=G, n_heads=G, compress=compress)
    k = normal(rng, 2, T, G, 12)
    params = cmp_params(rng, G, cfg.cmp_block, 12) if compress == "mlp" else None
    out = nsa_jax.compress_kv(k, params, cfg)
    assert out.shape == (2, num_cmp_blocks(cfg, T), G, 12) and out.dtype == k.dtype
    ref = bf_compress(np.asarray(k), None if params is None else np_tree(params), cfg)
    if ref.size:
        assert rel_err(out, ref) <= TOL


# -- compressed attention ------------------------------------------------------------------------
def bf_lse(q, k_cmp, cfg):
    """log-sum-exp of the admissible compressed scores, -inf on rows without any."""
    q, k_cmp = np.asarray(q), np.asarray(k_cmp)
    h = q.shape[2] // k_cmp.shape[2]
    s = np.einsum("bthd,bshd->bths", q, np.repeat(k_cmp, h, axis=2)) / math.sqrt(q.shape[-1])
    mask = bruteforce.cmp_mask(cfg, q.shape[1], k_cmp.shape[1])[None, :, None, :]
    s = np.where(mask, s, -np.inf)
    m = s.max(axis=-1, initial=-np.inf)
    safe = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        return safe + np.log(np.exp(s - safe[..., None]).sum(-1))


@pytest.mark.parametrize("H,G,T,d_k,d_v,options", [
    (1, 1, 23, 16, 8, None),
    (4, 2, 23, 16, 8, SMALL_CHUNKS),
    (16, 1, 19, 8, 16, None),
    (16, 4, 30, 8, 12, SMALL_CHUNKS),
    (8, 4, 5, 16, 8, None),  # T < l: no compressed block at all
])
def test_compressed_attention_matches_bruteforce(x64, H, G, T, d_k, d_v, options):
    rng = np.random.default_rng(1)
    cfg = NSAConfig.tiny(n_heads=H, n_kv_heads=G, d_k=d_k, d_v=d_v)
    C = num_cmp_blocks(cfg, T)
    q = normal(rng, 2, T, H, d_k)
    k_cmp, v_cmp = normal(rng, 2, C, G, d_k), normal(rng, 2, C, G, d_v)
    o, lse = nsa_jax.compressed_attention(q, k_cmp, v_cmp, cfg, return_lse=True, options=options)
    ref_o, _ = bf_compressed_attention(np.asarray(q), np.asarray(k_cmp), np.asarray(v_cmp), cfg)
    ref_lse = bf_lse(q, k_cmp, cfg)
    assert o.shape == (2, T, H, d_v) and lse.shape == (2, T, H)
    empty = np.arange(T) < cfg.cmp_block - 1  # rows without an admissible block
    assert np.all(np.asarray(o)[:, empty] == 0) and np.all(np.asarray(lse)[:, empty] == -np.inf)
    if (~empty).any():
        assert rel_err(o, ref_o) <= TOL
        assert rel_err(np.asarray(lse)[:, ~empty], ref_lse[:, ~empty]) <= TOL


def test_compressed_attention_scale_argument(x64):
    rng = np.random.default_rng(2)
    cfg = NSAConfig.tiny()
    q, k_cmp, v_cmp = normal(rng, 1, 20, 4, 16), normal(rng, 1, 4, 2, 16), normal(rng, 1, 4, 2, 8)
    out = nsa_jax.compressed_attention(q, k_cmp, v_cmp, cfg, scale=0.7)
    ref, _ = bf_compressed_attention(np.asarray(q), np.asarray(k_cmp), np.asarray(v_cmp), cfg,
                                     scale=0.7)
    assert rel_err(out, ref) <= TOL


# -- selection -----------------------------------------------------------------------------------
@pytest.mark.parametrize("T,changes,options", [
    (37, dict(), None),
    (50, dict(n_heads=16, n_kv_heads=4), SMALL_CHUNKS),    # h = 4, chunked
    (43, dict(n_heads=4, n_kv_heads=4, n_sel=3), None),   # h = 1
    (20, dict(n_heads=2, n_kv_heads=1), None),            # n_sel > eligible blocks
    (6, dict(), None),                                    # T < l: no compressed block
    (12, dict(), None),                                   # T < l_sel
    (40, dict(cmp_block=8, cmp_stride=8, sel_block=8, n_sel=3), SMALL_CHUNKS),  # p_sel = p_cmp
    (45, dict(n_init=2, n_local=0, n_sel=3), None),        # forced prefix only
    (45, dict(n_init=0, n_local=0, n_sel=2), None),        # nothing forced
])
def test_select_blocks_matches_bruteforce(x64, T, changes, options):
    rng = np.random.default_rng(3)
    cfg = NSAConfig.tiny(**changes)
    C = num_cmp_blocks(cfg, T)
    q, k_cmp = normal(rng, 2, T, cfg.n_heads, cfg.d_k), normal(rng, 2, C, cfg.n_kv_heads, cfg.d_k)
    block_idx = nsa_jax.select_blocks(q, k_cmp, cfg, options=options)
    _, lse = nsa_jax.compressed_attention(q, k_cmp, k_cmp, cfg, return_lse=True)
    np.testing.assert_array_equal(nsa_jax.select_blocks(q, k_cmp, cfg, lse=lse), block_idx)
    assert block_idx.dtype == jnp.int32
    assert block_idx.shape == (2, T, cfg.n_kv_heads, cfg.n_sel)
    ref = bf_select_blocks(np.asarray(q), np.asarray(k_cmp), cfg)
    np.testing.assert_array_equal(block_idx, ref)


def test_select_blocks_rules(x64):
    """Forced, causal, ascending, -1 padded, and forced blocks present whatever the scores."""
    rng = np.random.default_rng(4)
    cfg = NSAConfig.tiny(n_sel=4, n_init=1, n_local=2)
    T = 90
    q = normal(rng, 2, T, cfg.n_heads, cfg.d_k)
    k_cmp = normal(rng, 2, num_cmp_blocks(cfg, T), cfg.n_kv_heads, cfg.d_k)
    block_idx = np.asarray(nsa_jax.select_blocks(q, k_cmp, cfg))
    for t in range(T):
        last = t // cfg.sel_block
        for row in block_idx[:, t].reshape(-1, cfg.n_sel):
            valid = row[row >= 0]
            n_valid = min(cfg.n_sel, last + 1)
            assert len(valid) == n_valid and np.all(row[n_valid:] == -1)   # -1 only at the end
            assert np.all(np.diff(valid) > 0)                               # ascending, distinct
            assert valid.max() <= last                                      # causal
            forced = {0} | set(range(max(0, last - 1), last + 1))
            assert forced <= set(valid.tolist())


def python_top_blocks(scores, t, cfg):
    last = t // cfg.sel_block
    forced = (set(range(min(cfg.n_init, last + 1)))
              | set(range(max(0, last - cfg.n_local + 1), last + 1)))
    key = {j: (-math.inf if j in forced else -scores[j]) for j in range(last + 1)}
    chosen = sorted(sorted(key, key=lambda j: (key[j], j))[: cfg.n_sel])
    return chosen + [-1] * (cfg.n_sel - len(chosen))


def test_ties_go_to_lower_index():
    """Scores drawn from {0, 1, 2} tie constantly: the lower block index must win every tie
    (+inf scores included: they tie with the forced blocks)."""
    rng = np.random.default_rng(5)
    cfg = NSAConfig.tiny(n_sel=5, n_init=1, n_local=1)
    S = 12
    scores = rng.integers(0, 3, size=(64, S)).astype(np.float32)
    scores[::7] = 0.0  # whole rows of ties, including -0.0 vs +0.0 after negation
    scores[3::11] = np.inf
    t = rng.integers(0, S * cfg.sel_block, size=64)
    got = np.asarray(top_blocks(jnp.asarray(scores), jnp.asarray(t, jnp.int32), cfg))
    want = np.array([python_top_blocks(scores[i], t[i], cfg) for i in range(64)])
    np.testing.assert_array_equal(got, want)


def test_overlap_weighting_1_2_2_2_1():
    """With l = 2d, l_sel = 4d, selection block j weighs compressed blocks 4j-1 .. 4j+3 by
    [1, 2, 2, 2, 1], and the h heads of a group add up."""
    cfg = NSAConfig.tiny()  # l 8, d 4, l_sel 16
    C, S, j = 20, 6, 2
    M = jnp.asarray(overlap_weights(cfg, C, S))
    p = np.zeros((1, 2, C))  # [G, h, C]: uniform p over all blocks on both heads of group 0
    p[0, :, :] = 1.0
    scores = np.asarray(sel_scores(jnp.asarray(p), M))
    assert scores[0, j] == 2 * (1 + 2 + 2 + 2 + 1)
    one_hot = np.zeros((1, 1, C))
    for i, w in zip(range(4 * j - 1, 4 * j + 4), [1, 2, 2, 2, 1]):
        one_hot[:] = 0.0
        one_hot[0, 0, i] = 1.0
        assert np.asarray(sel_scores(jnp.asarray(one_hot), M))[0, j] == w
    identity = NSAConfig.tiny(cmp_block=8, cmp_stride=8, sel_block=8)
    np.testing.assert_array_equal(overlap_weights(identity, 5, 5), np.eye(5))


# -- selected attention --------------------------------------------------------------------------
@pytest.mark.parametrize("H,G,T,block_size,n_sel,options", [
    (1, 1, 29, 8, 3, None),
    (4, 2, 33, 4, 4, SMALL_CHUNKS),
    (4, 4, 21, 8, 2, None),
    (16, 4, 26, 4, 5, SMALL_CHUNKS),
    (2, 1, 6, 8, 3, None),  # T < block size
])
def test_selected_attention_matches_bruteforce(x64, H, G, T, block_size, n_sel, options):
    rng = np.random.default_rng(6)
    q, k, v = normal(rng, 2, T, H, 12), normal(rng, 2, T, G, 12), normal(rng, 2, T, G, 6)
    block_idx = random_block_idx(rng, 2, T, G, n_sel, block_size)
    out = nsa_jax.selected_attention(q, k, v, jnp.asarray(block_idx), block_size, options=options)
    ref = bf_selected_attention(np.asarray(q), np.asarray(k), np.asarray(v), block_idx, block_size)
    assert out.shape == (2, T, H, 6)
    assert rel_err(out, ref) <= TOL


# -- sliding window ------------------------------------------------------------------------------
@pytest.mark.parametrize("H,G,T,window,options", [
    (4, 2, 23, 5, None),
    (4, 2, 23, 5, SMALL_CHUNKS),
    (2, 1, 17, 1, SMALL_CHUNKS),
    (16, 4, 13, 40, None),        # window longer than the sequence
    (4, 4, 30, 9, SMALL_CHUNKS),
])
def test_sliding_window_matches_bruteforce(x64, H, G, T, window, options):
    rng = np.random.default_rng(7)
    q, k, v = normal(rng, 2, T, H, 8), normal(rng, 2, T, G, 8), normal(rng, 2, T, G, 4)
    out = nsa_jax.sliding_window_attention(q, k, v, window, options=options)
    ref = bf_sliding_window_attention(np.asarray(q), np.asarray(k), np.asarray(v), window)
    assert rel_err(out, ref) <= TOL


# -- gradients -----------------------------------------------------------------------------------
def test_kernel_gradients_match_finite_differences(x64):
    """Reverse-mode gradients of every attention branch against central differences,
    including compressed rows with no admissible block (t < l - 1) and a chunked path."""
    rng = np.random.default_rng(8)
    cfg = NSAConfig.tiny()
    T, H, G = 19, 4, 2
    C = num_cmp_blocks(cfg, T)
    q, k, v = normal(rng, 1, T, H, 16), normal(rng, 1, T, G, 16), normal(rng, 1, T, G, 8)
    k_cmp, v_cmp = normal(rng, 1, C, G, 16), normal(rng, 1, C, G, 8)
    block_idx = jnp.asarray(random_block_idx(rng, 1, T, G, 2, cfg.sel_block))
    params = cmp_params(rng, G, cfg.cmp_block, 16)

    @jax.jit
    def branches(q, k, v, k_cmp, v_cmp, params):
        return (nsa_jax.compressed_attention(q, k_cmp, v_cmp, cfg, options=SMALL_CHUNKS),
                nsa_jax.selected_attention(q, k, v, block_idx, cfg.sel_block, options=SMALL_CHUNKS),
                nsa_jax.sliding_window_attention(q, k, v, 6, options=SMALL_CHUNKS),
                nsa_jax.compress_kv(k, params, cfg))

    check_grads(branches, (q, k, v, k_cmp, v_cmp, params), order=1, modes=["rev"], atol=1e-5,
                rtol=1e-5)  # central differences, eps = 1e-4 in float64


def test_gradients_finite_without_any_compressed_block():
    """T < l: o_cmp = 0, lse = -inf, and zero (not NaN) gradients."""
    cfg = NSAConfig.tiny()
    rng = np.random.default_rng(9)
    q = jnp.asarray(rng.standard_normal((1, 5, 4, 16)), jnp.float32)
    k_cmp = jnp.zeros((1, 0, 2, 16), jnp.float32)
    v_cmp = jnp.zeros((1, 0, 2, 8), jnp.float32)

    def loss(q):
        o, lse = nsa_jax.compressed_attention(q, k_cmp, v_cmp, cfg, return_lse=True)
        return jnp.sum(o) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    grad = jax.grad(loss)(q)
    assert np.all(np.asarray(grad) == 0)


def test_select_blocks_has_no_gradient():
    cfg = NSAConfig.tiny()
    rng = np.random.default_rng(10)
    q = jnp.asarray(rng.standard_normal((1, 20, 4, 16)), jnp.float32)
    k_cmp = jnp.asarray(rng.standard_normal((1, 4, 2, 16)), jnp.float32)
    grads = jax.grad(lambda q, k: jnp.sum(nsa_jax.select_blocks(q, k, cfg).astype(jnp.float32)),
                     argnums=(0, 1))(q, k_cmp)
    assert all(np.all(np.asarray(g) == 0) for g in grads)


# -- errors and dispatch -------------------------------------------------------------------------
def test_kernel_input_errors_name_the_argument():
    cfg = NSAConfig.tiny()
    q, k, v = jnp.zeros((1, 8, 4, 16)), jnp.zeros((1, 8, 2, 16)), jnp.zeros((1, 8, 2, 8))
    idx = jnp.zeros((1, 8, 2, 4), jnp.int32)
    cases = [
        (lambda: nsa_jax.sliding_window_attention(q, k, v, 0), "window"),
        (lambda: nsa_jax.sliding_window_attention(q[0], k, v, 3), "q"),
        (lambda: nsa_jax.sliding_window_attention(q, k[..., :8], v, 3), "k"),
        (lambda: nsa_jax.sliding_window_attention(q, k, v, 3, scale=-1.0), "scale"),
        (lambda: nsa_jax.selected_attention(q, k, v, idx, 0), "block_size"),
        (lambda: nsa_jax.selected_attention(q, k, v, idx.astype(jnp.float32), 4), "block_idx"),
        (lambda: nsa_jax.selected_attention(jnp.zeros((1, 8, 3, 16)), k, v, idx, 4), "q"),
        (lambda: nsa_jax.compressed_attention(q, k[:, :2], v[:, :2], cfg), "k_cmp"),
        (lambda: nsa_jax.compress_kv(k, None, cfg), "cmp_params"),
        (lambda: nsa_jax.compress_kv(k, {"pos": k}, cfg), "cmp_params"),
        (lambda: nsa_jax.select_blocks(q, k[:, :1], "tiny"), "cfg"),
    ]
    for fn, name in cases:
        with pytest.raises(ValueError, match=name):
            fn()


def test_unknown_backend_lists_the_known_ones():
    q, k, v = jnp.zeros((1, 8, 4, 16)), jnp.zeros((1, 8, 2, 16)), jnp.zeros((1, 8, 2, 8))
    with pytest.raises(ValueError, match=r"'nope'.*xla"):
        nsa_jax.sliding_window_attention(q, k, v, 3, backend="nope")


def test_dispatch_registration_and_fallback(monkeypatch):
    monkeypatch.setattr(dispatch, "_REGISTRY", dict(dispatch._REGISTRY))
    calls = []

    def refuses(q, k, v, *, window, scale):
        raise NotImplementedError("test backend refuses every input")

    def halves(q, k, v, *, window, scale):
        calls.append(window)
        return 0.5 * dispatch.xla.sliding_window_attention(q, k, v, window=window, scale=scale)

    nsa_jax.register_backend("sliding_window_attention", "test-refuses", refuses)
    nsa_jax.register_backend("sliding_window_attention", "test-halves", halves)
    assert {"xla", "test-refuses", "test-halves"} <= set(nsa_jax.known_backends())
    rng = np.random.default_rng(11)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32)
               for s in ((1, 9, 4, 8), (1, 9, 2, 8), (1, 9, 2, 8)))
    ref = nsa_jax.sliding_window_attention(q, k, v, 4)
    with pytest.raises(NotImplementedError, match="refuses"):
        nsa_jax.sliding_window_attention(q, k, v, 4, backend="test-refuses")
    out = nsa_jax.sliding_window_attention(q, k, v, 4, backend=("test-refuses", "xla"))
    np.testing.assert_array_equal(out, ref)
    out = nsa_jax.sliding_window_attention(q, k, v, 4, backend=("test-halves", "xla"))
    np.testing.assert_allclose(out, 0.5 * ref, rtol=1e-6)
    assert calls == [4]
    # A backend without the branch falls through only when the caller lists a fallback.
    cfg = NSAConfig.tiny()
    with pytest.raises(NotImplementedError, match="no selected_attention"):
        nsa_jax.selected_attention(q, k, v, jnp.zeros((1, 9, 2, 2), jnp.int32), 4,
                                   backend="test-halves")
    # Re-registering a name replaces what compiled calls run.
    nsa_jax.register_backend("sliding_window_attention", "test-halves",
                             lambda q, k, v, *, window, scale: 0 * q[..., :8])
    out = nsa_jax.sliding_window_attention(q, k, v, 4, backend="test-halves")
    assert np.all(np.asarray(out) == 0)
    del cfg


@pytest.mark.gpu
@pytest.mark.skipif(not jax_has_gpu(), reason="needs a GPU")
@pytest.mark.parametrize("d_k,d_v", [(128, 128), (192, 128), (64, 32)])
def test_gpu_window_cudnn_matches_banded_path(d_k, d_v):
    """The cuDNN window path (v zero-padded when d_v < d_k; head sizes up to 256 on Hopper)
    against the exact banded XLA path, forward and gradients, bf16."""
    from nsa_jax.xla.options import XlaOptions
    from nsa_jax.xla.sliding_window import _cudnn_applies, sliding_window_attention

    skip_above_cudnn_head_dim(d_k)
    B, T, H, G, w = 1, 2048, 8, 2, 512
    keys = jax.random.split(jax.random.PRNGKey(3), 4)
    q = jax.random.normal(keys[0], (B, T, H, d_k), jnp.bfloat16)
    k = jax.random.normal(keys[1], (B, T, G, d_k), jnp.bfloat16)
    v = jax.random.normal(keys[2], (B, T, G, d_v), jnp.bfloat16)
    do = jax.random.normal(keys[3], (B, T, H, d_v), jnp.bfloat16)
    assert _cudnn_applies(q, k, v, None, XlaOptions())

    def run(cudnn):
        fn = lambda q, k, v: sliding_window_attention(  # noqa: E731
            q, k, v, window=w, scale=d_k ** -0.5, options=XlaOptions(window_cudnn=cudnn))
        o, pullback = jax.vjp(fn, q, k, v)
        return (o, *pullback(do))

    for got, want in zip(run(True), run(False)):
        assert got.shape == want.shape
        err = float(jnp.linalg.norm((got - want).astype(jnp.float32))
                    / jnp.linalg.norm(want.astype(jnp.float32)))
        assert err <= 1e-2, err
