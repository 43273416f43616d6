"""`jax_enable_x64` on (docs/ROBUSTNESS.md): the layer and the Pallas kernels run for bfloat16,
float16 and float32 inputs on every backend; float64 runs on XLA, and a Pallas kernel refuses it
by name so that a fallback tuple moves on.

T = 24 with l_sel 16 and n_sel 3 selects every block, so half-precision runs cannot flip a
selection and the whole layer compares with the float64 brute force at the spec's tolerances.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nsa_jax
from bruteforce import bf_nsa_layer
from jax_inputs import make_inputs
from nsa_common.testing import rel_err
from nsa_common import NSAConfig
from pallas_kernels.selected_attention import selected_attention as pallas_selected_attention
from test_pallas_selected_attention import check_against_reference
from test_pallas_selected_attention import make_inputs as selected_inputs

CFG = NSAConfig.tiny(n_sel=3)
B, T = 1, 24
TOL = {jnp.bfloat16: 2e-2, jnp.float16: 5e-3, jnp.float32: 1e-5, jnp.float64: 1e-10}
BACKENDS = [pytest.param("xla", id="xla"),
            pytest.param(("pallas", "xla"), id="pallas,xla")]
DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64]
LAYER_CASES = ([pytest.param("xla", d, id=f"xla-{jnp.dtype(d).name}") for d in DTYPES]
               + [pytest.param(("pallas", "xla"), d, id=f"pallas,xla-{jnp.dtype(d).name}")
                  for d in DTYPES])


@pytest.mark.parametrize("backend,dtype", LAYER_CASES)
def test_layer_runs_in_x64_mode(x64, backend, dtype):
    params, x = make_inputs(CFG, B, T, dtype)
    y = nsa_jax.nsa_attention(params, x, CFG, backend=backend)
    assert y.dtype == x.dtype
    ref, _ = bf_nsa_layer(jax.tree_util.tree_map(np.asarray, params), np.asarray(x), CFG)
    assert rel_err(y, ref) <= TOL[dtype]


@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_gradient_in_x64_mode(x64, backend):
    """float32 gradients wrt x under x64 equal the XLA path's with x64 off."""
    params, x = make_inputs(CFG, B, T, jnp.float32)

    def grad_x(x, backend):
        return jax.grad(lambda x: jnp.sum(jnp.sin(nsa_jax.nsa_attention(params, x, CFG,
                                                                        backend=backend))))(x)
    g = grad_x(x, backend)
    with jax.enable_x64(False):
        g_ref = grad_x(x, "xla")
    assert g.dtype == jnp.float32
    assert rel_err(g, g_ref) <= 1e-4


# Selected-attention shapes (seed, B, T, H, G, d_k, d_v, n_sel) and l_sel; tests/gpu/test_gpu_x64.py
# runs the same checks compiled at larger ones.
SELECTED = dict(shape=(1, 20, 2, 1, 16, 8, 2), l_sel=16)


def check_selected_attention(dtype, *, interpret, shape, l_sel):
    """The kernel, forward and gradients, against its reference (the existing check)."""
    check_against_reference(*selected_inputs(0, *shape, l_sel, dtype), l_sel, interpret=interpret)


def check_float64_falls_through(*, interpret, shape, l_sel):
    """The kernel refuses float64 by name; ("pallas", "xla") and "pallas" fall through to XLA."""
    q, k, v, block_idx, _ = selected_inputs(1, *shape, l_sel, jnp.float64)
    with pytest.raises(NotImplementedError, match="float32.*got float64"):
        pallas_selected_attention(q, k, v, block_idx, l_sel, interpret=interpret)
    ref = nsa_jax.selected_attention(q, k, v, block_idx, l_sel, backend="xla")
    # "pallas" alone means Pallas where a kernel takes the input, XLA for the rest (docs/API.md).
    for backend in (("pallas", "xla"), "pallas"):
        out = nsa_jax.selected_attention(q, k, v, block_idx, l_sel, backend=backend)
        assert out.dtype == jnp.float64
        np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_pallas_selected_attention_in_x64_mode(x64, dtype):
    check_selected_attention(dtype, interpret=True, **SELECTED)


def test_pallas_selected_attention_refuses_float64_and_falls_through(x64):
    check_float64_falls_through(interpret=True, **SELECTED)
