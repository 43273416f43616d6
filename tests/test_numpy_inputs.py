"""NumPy inputs are taken as `jnp.asarray` takes them: float64 arrays become float32 while x64 is
off (the output is float32 and equals the float32 call's), stay float64 with x64 on, and an
integer input is refused by name. The layer, the core and decode's prefill and step."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nsa_jax
from jax_inputs import make_inputs
from nsa_common import NSAConfig

CFG = NSAConfig.tiny()
B, T = 1, 24


def as_numpy(tree, dtype=np.float64):
    return jax.tree_util.tree_map(lambda a: np.asarray(a, dtype), tree)


@pytest.fixture(scope="module")
def layer_inputs():
    """float32 params and x, and their float64 NumPy copies (exact: float32 -> float64)."""
    params, x = make_inputs(CFG, B, T, jnp.float32)
    return params, x, as_numpy(params), as_numpy(x)


def core_inputs():
    rng = np.random.default_rng(1)
    H, G, d = CFG.n_heads, CFG.n_kv_heads, CFG.d_k
    q, k, v = (rng.standard_normal((B, T, heads, d)) for heads in (H, G, G))
    gates = rng.uniform(size=(B, T, H, 3))
    return q, k, v, gates  # float64 NumPy


def test_layer_float64_numpy_is_the_float32_call(layer_inputs):
    params, x, params64, x64 = layer_inputs
    want = nsa_jax.nsa_attention(params, x, CFG)
    for p in (params, params64):
        y = nsa_jax.nsa_attention(p, x64, CFG)
        assert y.dtype == jnp.float32
        np.testing.assert_array_equal(y, want)


def test_layer_float64_numpy_stays_float64_with_x64(x64, layer_inputs):
    _, _, params64, x64_np = layer_inputs
    y, aux = nsa_jax.nsa_attention(params64, x64_np, CFG, return_aux=True)
    assert y.dtype == jnp.float64 and aux["o_sel"].dtype == jnp.float64


def test_core_float64_numpy_is_the_float32_call():
    q, k, v, gates = core_inputs()
    cfg = CFG.replace(compress="mean")
    want = nsa_jax.native_sparse_attention(*(jnp.asarray(a, jnp.float32) for a in (q, k, v, gates)),
                                           cfg)
    o = nsa_jax.native_sparse_attention(q, k, v, gates, cfg)
    assert o.dtype == jnp.float32
    np.testing.assert_array_equal(o, want)


def test_integer_inputs_are_refused_by_name(layer_inputs):
    params = layer_inputs[0]
    with pytest.raises(ValueError, match="x must be a floating-point array"):
        nsa_jax.nsa_attention(params, np.ones((B, T, CFG.d_model), np.int64), CFG)
    q, k, v, gates = core_inputs()
    with pytest.raises(ValueError, match="q must be a floating-point array"):
        nsa_jax.native_sparse_attention(q.astype(np.int32), k, v, gates,
                                        CFG.replace(compress="mean"))


def test_decode_float64_numpy_is_the_float32_call(layer_inputs):
    params, x, params64, x64 = layer_inputs
    prefix = T - 2
    results = []
    for p, inputs in ((params, x), (params64, x64)):
        cache = nsa_jax.init_cache(CFG, B, T)
        y, cache = nsa_jax.prefill(p, inputs[:, :prefix], CFG, cache)
        steps = [y]
        for t in range(prefix, T):
            y_t, cache, _ = nsa_jax.decode_step(p, inputs[:, t:t + 1], CFG, cache)
            steps.append(y_t)
        results.append(steps)
    for want, got in zip(*results):
        assert got.dtype == jnp.float32
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="x must be a floating-point array"):
        nsa_jax.prefill(params, np.ones((B, 2, CFG.d_model), np.int64), CFG,
                        nsa_jax.init_cache(CFG, B, T))
