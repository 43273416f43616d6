"""`nsa_jax.nnx.NSAAttention` against the functional layer: forward, gradients, decode, the
parameter pytree both ways, dtypes, precision, `nnx.jit`, split / merge and a `jax.jit` model."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")

import nsa_jax  # noqa: E402
from jax_inputs import dot_precisions, make_inputs  # noqa: E402
from nsa_common.testing import rel_err  # noqa: E402
from nsa_common import NSAConfig  # noqa: E402
from nsa_jax.nnx import NSAAttention  # noqa: E402

CFG = NSAConfig.tiny()
T_PROMPT, T_DECODE = 18, 3


def trees_equal(a, b):
    jax.tree_util.tree_map(np.testing.assert_array_equal, a, b)


@pytest.fixture(scope="module")
def case():
    params, x = make_inputs(CFG, 2, T_PROMPT + T_DECODE, jnp.float32, seed=11)
    return params, x


def test_init_is_init_params_and_round_trips(case):
    params, _ = case
    drawn = NSAAttention(CFG, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(params=3)).to_params()
    # The module draws init_params from its first params key.
    key = nnx.Rngs(params=3).params()
    trees_equal(drawn, nsa_jax.init_params(key, CFG, jnp.bfloat16))
    trees_equal(NSAAttention.from_params(params, CFG).to_params(), params)
    shared = NSAConfig.tiny(shared_kv=True, compress="mean")
    layout = NSAAttention.from_params(nsa_jax.init_params(jax.random.key(0), shared), shared)
    assert set(layout.to_params()["wk"]) == {"shared"} and "cmp_k" not in layout.to_params()


def test_custom_initialisers():
    """Each initialiser reaches its own leaves; the ones left None keep their default."""
    const = lambda value: (lambda key, shape, dtype: jnp.full(shape, value, dtype))
    drawn = NSAAttention(CFG, kernel_init=const(1.0), pos_init=const(2.0),
                         rngs=nnx.Rngs(0)).to_params()
    for leaf in (drawn["wq"], drawn["wk"]["sel"], drawn["wo"], drawn["cmp_v"]["w2"]):
        assert np.all(np.asarray(leaf) == 1)
    assert np.all(np.asarray(drawn["cmp_k"]["pos"]) == 2)
    assert np.all(np.asarray(drawn["bg"]) == 0) and np.all(np.asarray(drawn["cmp_k"]["b1"]) == 0)


def test_forward_and_gradients_equal_the_functional_layer(case):
    params, x = case
    module = NSAAttention.from_params(params, CFG)
    y, aux = module(x, return_aux=True)
    y_ref, aux_ref = nsa_jax.nsa_attention(params, x, CFG, return_aux=True)
    np.testing.assert_array_equal(y, y_ref)
    trees_equal(aux, aux_ref)

    graphdef, state = nnx.split(module)
    loss = lambda state: jnp.sum(jnp.sin(nnx.merge(graphdef, state)(x)))
    grads = nnx.merge(graphdef, jax.grad(loss)(state)).to_params()
    ref = jax.grad(lambda p: jnp.sum(jnp.sin(nsa_jax.nsa_attention(p, x, CFG))))(params)
    for (path, g), g_ref in zip(jax.tree_util.tree_leaves_with_path(grads),
                                jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(g, g_ref, rtol=1e-6, atol=1e-7,
                                   err_msg=jax.tree_util.keystr(path))


def test_nnx_jit_split_merge_and_a_jitted_model(case):
    params, x = case

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.attn = NSAAttention.from_params(params, CFG)
            self.head = nnx.Linear(CFG.d_model, 3, rngs=rngs)

        def __call__(self, x):
            return self.head(x + self.attn(x))

    model = Model(nnx.Rngs(1))
    expected = model(x)
    np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(model, x), expected, rtol=1e-6,
                               atol=1e-6)
    graphdef, state = nnx.split(model)
    merged = nnx.merge(graphdef, state)
    trees_equal(merged.attn.to_params(), params)
    out = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))(state, x)
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)


def test_decode_through_the_module_cache_equals_the_functional_decode(case):
    params, x = case
    module = NSAAttention.from_params(params, CFG)
    module.init_cache(batch=2, max_len=T_PROMPT + T_DECODE)
    cache = nsa_jax.init_cache(CFG, 2, T_PROMPT + T_DECODE)
    prompt = x[:, :T_PROMPT]
    y_ref, cache = nsa_jax.prefill(params, prompt, CFG, cache)
    np.testing.assert_array_equal(module.prefill(prompt), y_ref)

    step = nnx.jit(lambda m, x_t: m.decode_step(x_t))
    for t in range(T_PROMPT, T_PROMPT + T_DECODE):
        y_t_ref, cache, _ = nsa_jax.decode_step(params, x[:, t:t + 1], CFG, cache)
        np.testing.assert_allclose(step(module, x[:, t:t + 1]), y_t_ref, rtol=1e-6, atol=1e-6)
    assert (np.asarray(module.cache.get_value().lengths) == T_PROMPT + T_DECODE).all()
    trees_equal(module.cache.get_value(), cache)


def test_dtype_casts_inputs_and_parameters(case):
    params, x = case
    module = NSAAttention.from_params(
        jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), params), CFG,
        dtype=jnp.float32)
    x16 = x[:, :T_PROMPT].astype(jnp.bfloat16)
    y = module(x16)
    assert y.dtype == jnp.float32
    ref = nsa_jax.nsa_attention(
        jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16).astype(jnp.float32), params),
        x16.astype(jnp.float32), CFG)
    assert rel_err(y, ref) <= 1e-6


def test_precision_reaches_the_matmuls(case):
    params, x = case
    module = NSAAttention.from_params(params, CFG, precision="highest")
    graphdef, state = nnx.split(module)
    jaxpr = jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(x[:, :T_PROMPT]))(state)
    precisions = dot_precisions(jaxpr.jaxpr)
    assert precisions and set(precisions) == {(jax.lax.Precision.HIGHEST,) * 2}


def test_module_errors_name_the_argument(case):
    params, x = case
    module = NSAAttention.from_params(params, CFG)
    with pytest.raises(ValueError, match="init_cache"):
        module.decode_step(x[:, :1])
    with pytest.raises(ValueError, match="precision"):
        NSAAttention(CFG, precision="fastest", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"params\['wo'\]"):
        module.load_params(dict(params, wo=params["wo"][:4]))
    with pytest.raises(ValueError, match="cfg"):
        NSAAttention("tiny", rngs=nnx.Rngs(0))
