"""`nsa_attention(..., backend=("pallas", "xla"))`: the Pallas kernels through the dispatch point
(interpret mode on CPU) against the XLA path."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nsa_jax
from nsa_common import NSAConfig
from nsa_common.testing import rel_err

RTOL_OUT, RTOL_GRAD = 1e-5, 1e-4  # float32, spec tolerances


@pytest.fixture(scope="module")
def case():
    cfg = NSAConfig.tiny(n_sel=3)
    params = nsa_jax.init_params(jax.random.PRNGKey(0), cfg)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 53, cfg.d_model))  # 53: no block multiple
    return cfg, params, x


def test_layer_forward_matches_xla(case):
    cfg, params, x = case
    y_xla, aux_xla = nsa_jax.nsa_attention(params, x, cfg, return_aux=True)
    y_pl, aux_pl = nsa_jax.nsa_attention(params, x, cfg, backend=("pallas", "xla"),
                                         return_aux=True)
    np.testing.assert_array_equal(aux_pl["block_idx"], aux_xla["block_idx"])
    for name in ("o_cmp", "o_sel", "o_win"):
        assert rel_err(aux_pl[name], aux_xla[name]) <= RTOL_OUT, name
    assert rel_err(y_pl, y_xla) <= RTOL_OUT


def test_layer_gradients_match_xla(case):
    cfg, params, x = case

    def grads(backend):
        loss = lambda p, x: jnp.sum(jnp.sin(nsa_jax.nsa_attention(p, x, cfg, backend=backend)))
        return jax.grad(loss, argnums=(0, 1))(params, x)

    (gp_xla, gx_xla), (gp_pl, gx_pl) = grads("xla"), grads(("pallas", "xla"))
    assert rel_err(gx_pl, gx_xla) <= RTOL_GRAD
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(gp_pl),
                            jax.tree_util.tree_leaves(gp_xla)):
        assert bool(jnp.all(jnp.isfinite(a))), jax.tree_util.keystr(path)
        if jax.tree_util.keystr(path) == "['cmp_k']['b2']":
            continue  # analytically zero (softmax is shift-invariant): rounding noise only
        assert rel_err(a, b) <= RTOL_GRAD, jax.tree_util.keystr(path)


def test_pallas_alone_runs_compression_and_the_window_on_xla(case):
    """`"pallas"` has no compression kernel, and in interpret mode its window kernel is off by
    default: both fall back to XLA, bit for bit. With `window_kernel` the window runs on the
    Pallas window kernel (interpreted) and agrees with XLA's banded path."""
    cfg, params, x = case
    k = jax.random.normal(jax.random.PRNGKey(4), (1, 20, cfg.n_kv_heads, cfg.d_k))
    np.testing.assert_array_equal(nsa_jax.compress_kv(k, params["cmp_k"], cfg, backend="pallas"),
                                  nsa_jax.compress_kv(k, params["cmp_k"], cfg))
    want = nsa_jax.sliding_window_attention(k, k, k, 5)
    np.testing.assert_array_equal(nsa_jax.sliding_window_attention(k, k, k, 5, backend="pallas"),
                                  want)
    kernel = {"pallas": nsa_jax.PallasOptions(window_kernel=True)}
    assert rel_err(nsa_jax.sliding_window_attention(k, k, k, 5, backend="pallas",
                                                    options=kernel), want) <= RTOL_OUT


def test_kernel_level_select_blocks_without_lse(case):
    cfg, params, x = case
    q = jax.random.normal(jax.random.PRNGKey(2), (1, 40, cfg.n_heads, cfg.d_k))
    k_cmp = jax.random.normal(jax.random.PRNGKey(3), (1, 9, cfg.n_kv_heads, cfg.d_k))
    np.testing.assert_array_equal(nsa_jax.select_blocks(q, k_cmp, cfg, backend="pallas"),
                                  nsa_jax.select_blocks(q, k_cmp, cfg))


def test_interpret_defaults_to_the_platform():
    expected = jax.default_backend() != "gpu"
    assert nsa_jax.PallasOptions().resolve_interpret() is expected
    assert nsa_jax.PallasOptions(interpret=False).resolve_interpret() is False
