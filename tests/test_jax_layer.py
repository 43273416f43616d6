"""nsa_jax layer: parameter tree, layer vs the float64 brute force, gradients, jit / grad / vmap,
bf16 against float32, packed sequences against separate ones, errors and backend dispatch."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import nsa_jax
from jax_inputs import AUX_FLOAT, make_inputs
from nsa_common.testing import rel_err
from bruteforce import bf_nsa_layer
from nsa_common import NSAConfig
from nsa_jax import XlaOptions, dispatch

TOL = 1e-10       # float64 against the float64 brute force
F32_TOL = 1e-5    # the spec's float32 output tolerance
BF16_TOL = 1e-2   # the spec's bfloat16 tolerance
SMALL_CHUNKS = {"xla": XlaOptions(compressed_q_chunk=16, select_q_chunk=8, selected_q_chunk=8,
                                  window_q_chunk=8)}


def np_tree(tree):
    return jax.tree_util.tree_map(np.asarray, tree)


# -- parameters ----------------------------------------------------------------------------------
def shapes_of(tree):
    return jax.tree_util.tree_map(lambda a: tuple(a.shape), tree)


def init_shapes(cfg):
    return shapes_of(jax.eval_shape(lambda: nsa_jax.init_params(jax.random.PRNGKey(0), cfg)))


def test_param_tree_matches_design():
    cfg = NSAConfig.tiny()  # d_model 64, H 4, G 2, d_k 16, d_v 8, l 8
    cmp_k = {"pos": (2, 8, 16), "w1": (2, 128, 16), "b1": (2, 16), "w2": (2, 16, 16), "b2": (2, 16)}
    cmp_v = {"pos": (2, 8, 8), "w1": (2, 64, 8), "b1": (2, 8), "w2": (2, 8, 8), "b2": (2, 8)}
    expected = {"wq": (64, 64), "wk": {c: (64, 32) for c in ("cmp", "sel", "win")},
                "wv": {c: (64, 16) for c in ("cmp", "sel", "win")}, "cmp_k": cmp_k,
                "cmp_v": cmp_v, "wg": (64, 12), "bg": (12,), "wo": (32, 64)}
    assert init_shapes(cfg) == expected
    shared = init_shapes(cfg.replace(shared_kv=True))
    assert shared["wk"] == {"shared": (64, 32)} and shared["wv"] == {"shared": (64, 16)}
    mean = init_shapes(cfg.replace(compress="mean"))
    assert "cmp_k" not in mean and "cmp_v" not in mean
    bf16 = nsa_jax.init_params(jax.random.PRNGKey(0), cfg, jnp.bfloat16)
    assert all(a.dtype == jnp.bfloat16 for a in jax.tree_util.tree_leaves(bf16))
    assert np.all(np.asarray(bf16["bg"]) == 0) and np.all(np.asarray(bf16["cmp_k"]["b1"]) == 0)


# -- layer against the brute force ---------------------------------------------------------------
LAYER_CASES = {
    "mlp-rope": (NSAConfig.tiny(), 2, 45, None),
    "mean-norope-chunked": (NSAConfig.tiny(compress="mean", rope_theta=None), 2, 37, SMALL_CHUNKS),
    "shared-kv-h4": (NSAConfig.tiny(shared_kv=True, n_heads=8, n_kv_heads=2), 1, 40, None),
    "G1-dv>dk-short-window": (NSAConfig.tiny(n_heads=2, n_kv_heads=1, d_k=8, d_v=16, window=5,
                                             n_sel=3, n_local=1), 2, 29, None),
    "T<l": (NSAConfig.tiny(), 2, 6, None),
}


@pytest.mark.parametrize("name", list(LAYER_CASES))
def test_layer_matches_bruteforce(x64, name):
    cfg, B, T, options = LAYER_CASES[name]
    params, x = make_inputs(cfg, B, T, jnp.float64)
    y, aux = nsa_jax.nsa_attention(params, x, cfg, return_aux=True, options=options)
    ref_y, ref_aux = bf_nsa_layer(np_tree(params), np.asarray(x), cfg)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel_err(y, ref_y) <= TOL
    for key in AUX_FLOAT:
        assert rel_err(aux[key], ref_aux[key]) <= TOL, key
    assert aux["block_idx"].dtype == jnp.int32
    np.testing.assert_array_equal(aux["block_idx"], ref_aux["block_idx"])


def test_layer_float32_within_spec_tolerance():
    cfg = NSAConfig.tiny()
    params, x = make_inputs(cfg, 2, 45, jnp.float32, seed=3)
    y, aux = jax.jit(lambda p, x: nsa_jax.nsa_attention(p, x, cfg, return_aux=True))(params, x)
    ref_y, ref_aux = bf_nsa_layer(np_tree(params), np.asarray(x), cfg)
    assert y.dtype == jnp.float32
    np.testing.assert_array_equal(aux["block_idx"], ref_aux["block_idx"])
    assert rel_err(y, ref_y) <= F32_TOL


# -- gradients, jit, vmap, dtypes ----------------------------------------------------------------
@pytest.mark.parametrize("T", [5, 40])
def test_gradients_finite_for_every_param_and_input(T):
    cfg = NSAConfig.tiny()
    params, x = make_inputs(cfg, 2, T, jnp.float32, seed=4)

    @jax.jit
    @jax.grad
    def grads(params_and_x):
        params, x = params_and_x
        return jnp.sum(nsa_jax.nsa_attention(params, x, cfg) ** 2)

    g_params, g_x = grads((params, x))
    flat, _ = jax.tree_util.tree_flatten_with_path(g_params)
    for path, leaf in flat + [(("x",), g_x)]:
        assert np.all(np.isfinite(np.asarray(leaf))), jax.tree_util.keystr(path)
        # Below l no compressed block exists, so the cmp branch's weights get no gradient.
        if T >= cfg.cmp_block or "cmp" not in jax.tree_util.keystr(path):
            assert np.any(np.asarray(leaf) != 0), jax.tree_util.keystr(path)


@pytest.mark.slow
def test_layer_gradient_matches_finite_differences(x64):
    cfg = NSAConfig.tiny(d_model=16, n_heads=2, n_kv_heads=1, d_k=8, d_v=4)
    params, x = make_inputs(cfg, 1, 21, jnp.float64, seed=5)
    layer = jax.jit(lambda params, x: nsa_jax.nsa_attention(params, x, cfg))
    check_grads(layer, (params, x), order=1, modes=["rev"], atol=1e-5, rtol=1e-5)


def test_jit_matches_eager_and_vmap_matches_batch():
    cfg = NSAConfig.tiny()
    params, x = make_inputs(cfg, 6, 24, jnp.float32, seed=6)
    eager = nsa_jax.nsa_attention(params, x, cfg)
    jitted = jax.jit(nsa_jax.nsa_attention, static_argnames=("cfg",))(params, x, cfg=cfg)
    np.testing.assert_allclose(jitted, eager, rtol=1e-6, atol=1e-6)
    stacked = x.reshape(3, 2, 24, cfg.d_model)
    mapped = jax.vmap(lambda xb: nsa_jax.nsa_attention(params, xb, cfg))(stacked)
    assert rel_err(mapped.reshape(x.shape), eager) <= F32_TOL


def test_bf16_inputs_against_float32():
    """bf16 params and input against float32 on the same (bf16-representable) values."""
    cfg = NSAConfig.tiny()
    params, x = make_inputs(cfg, 2, 48, jnp.bfloat16, seed=7)
    layer = jax.jit(lambda p, x: nsa_jax.nsa_attention(p, x, cfg, return_aux=True))
    y16, aux16 = layer(params, x)
    y32, aux32 = layer(*jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), (params, x)))
    assert y16.dtype == jnp.bfloat16
    assert rel_err(y16, y32) <= BF16_TOL
    for key in AUX_FLOAT:
        assert rel_err(aux16[key], aux32[key]) <= BF16_TOL, key


# -- packed sequences ----------------------------------------------------------------------------
def test_packed_equals_separate(x64):
    """A traced cu_seqlens with an empty sequence, one shorter than l, and sequences crossing
    several compression and selection blocks; chunks straddle the sequence boundaries."""
    cfg = NSAConfig.tiny(n_sel=3, n_local=1)
    params, x = make_inputs(cfg, 1, 80, jnp.float64, seed=8)
    traces = []

    @jax.jit
    def packed(x, cu_seqlens):
        traces.append(1)
        return nsa_jax.nsa_attention(params, x, cfg, cu_seqlens=cu_seqlens, return_aux=True,
                                     options=SMALL_CHUNKS)

    for cu, check_separate in (([0, 5, 30, 30, 80], True), ([0, 41, 47, 60, 80], False)):
        cu = np.array(cu, np.int32)
        y, aux = packed(x, jnp.asarray(cu))
        for start, end in zip(cu[:-1], cu[1:]):
            if start == end or not check_separate:  # each separate length costs a compile
                continue
            part = x[:, start:end]
            y_sep, aux_sep = nsa_jax.nsa_attention(params, part, cfg, return_aux=True)
            assert rel_err(y[:, start:end], y_sep) <= TOL
            np.testing.assert_array_equal(aux["block_idx"][:, start:end], aux_sep["block_idx"])
            for key in AUX_FLOAT:
                assert rel_err(aux[key][:, start:end], aux_sep[key]) <= TOL, key
        ref_y, ref_aux = bf_nsa_layer(np_tree(params), np.asarray(x), cfg, cu_seqlens=cu)
        assert rel_err(y, ref_y) <= TOL
        np.testing.assert_array_equal(aux["block_idx"], ref_aux["block_idx"])
    assert len(traces) == 1  # same N: one compilation for both packings


def test_packed_gradients_finite():
    cfg = NSAConfig.tiny()
    params, x = make_inputs(cfg, 1, 40, jnp.float32, seed=9)
    cu = jnp.asarray([0, 3, 3, 26, 40], jnp.int32)
    loss = lambda p, x: jnp.sum(nsa_jax.nsa_attention(p, x, cfg, cu_seqlens=cu) ** 2)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
    assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree_util.tree_leaves(grads))


# -- errors and dispatch -------------------------------------------------------------------------
def test_layer_errors_name_the_argument():
    cfg = NSAConfig.tiny()
    params, x = make_inputs(cfg, 2, 12, jnp.float32)
    bad_params = dict(params, wq=params["wq"][:, :8])
    no_wk = {k: v for k, v in params.items() if k != "wk"}
    cases = [
        (lambda: nsa_jax.nsa_attention(params, x[..., :10], cfg), "x"),
        (lambda: nsa_jax.nsa_attention(params, x[0], cfg), "x"),
        (lambda: nsa_jax.nsa_attention(params, x, cfg, cu_seqlens=jnp.array([0, 12])),
         "cu_seqlens"),
        (lambda: nsa_jax.nsa_attention(params, x[:1], cfg, cu_seqlens=jnp.array([0, 5, 11])),
         "cu_seqlens"),
        (lambda: nsa_jax.nsa_attention(params, x[:1], cfg, cu_seqlens=jnp.array([0.0, 12.0])),
         "cu_seqlens"),
        (lambda: nsa_jax.nsa_attention(bad_params, x, cfg), r"params\['wq'\]"),
        (lambda: nsa_jax.nsa_attention(no_wk, x, cfg), "'wk'"),
        (lambda: nsa_jax.nsa_attention(params, x, cfg.replace(shared_kv=True)), "shared"),
        (lambda: nsa_jax.nsa_attention(params, x, cfg, backend="nope"), "xla"),
        (lambda: nsa_jax.nsa_attention(params, x, cfg, options={"xla": {"q": 1}}), "options"),
    ]
    for fn, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            fn()


def test_layer_uses_registered_backend_and_falls_back(monkeypatch):
    """A backend for one branch, without packed support: used where it can run, skipped (with a
    fallback listed) where it cannot, refused without one."""
    monkeypatch.setattr(dispatch, "_REGISTRY", dict(dispatch._REGISTRY))
    calls = []

    def traced_selected(q, k, v, block_idx, *, block_size, scale):
        calls.append(q.shape)
        return dispatch.xla.selected_attention(q, k, v, block_idx, block_size=block_size,
                                               scale=scale)

    def select_with_lse(q, k_cmp, cfg, *, scale, lse):
        calls.append(lse.shape)  # the layer hands the compressed branch's lse to selection
        return dispatch.xla.select_blocks(q, k_cmp, cfg, scale=scale)

    nsa_jax.register_backend("selected_attention", "test-sel", traced_selected)
    nsa_jax.register_backend("select_blocks", "test-sel", select_with_lse)
    cfg = NSAConfig.tiny()
    params, x = make_inputs(cfg, 1, 20, jnp.float32, seed=10)
    ref = nsa_jax.nsa_attention(params, x, cfg)
    out = nsa_jax.nsa_attention(params, x, cfg, backend=("test-sel", "xla"))
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)
    assert sorted(calls) == [(1, 20, 4), (1, 20, 4, 16)]
    cu = jnp.asarray([0, 9, 20], jnp.int32)
    packed = nsa_jax.nsa_attention(params, x, cfg, cu_seqlens=cu, backend=("test-sel", "xla"))
    assert len(calls) == 2  # packed input went to "xla"
    np.testing.assert_allclose(packed, nsa_jax.nsa_attention(params, x, cfg, cu_seqlens=cu),
                               rtol=1e-6, atol=1e-6)
    with pytest.raises(NotImplementedError, match="test-sel"):
        nsa_jax.nsa_attention(params, x, cfg, backend="test-sel")
