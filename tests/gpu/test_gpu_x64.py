"""GPU: `jax_enable_x64` on with the compiled kernels (docs/ROBUSTNESS.md). The CPU
file `tests/test_robustness_x64.py` runs the same checks with the kernels in interpret mode;
here the Pallas kernels, cuDNN's window and compressed paths are compiled for the GPU.

T 256 with l_sel 32 and n_sel 8 selects every block, so half-precision runs cannot flip a
selection and the whole layer compares with the float64 brute force.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nsa_jax
from bruteforce import bf_nsa_layer
from conftest import jax_has_gpu
from jax_inputs import make_inputs
from nsa_common import NSAConfig
from nsa_common.testing import rel_err
from test_robustness_x64 import check_float64_falls_through, check_selected_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not jax_has_gpu(), reason="needs a GPU (JAX)")]

CFG = NSAConfig(d_model=128, n_heads=4, n_kv_heads=2, d_k=32, d_v=32, cmp_block=16,
                cmp_stride=8, sel_block=32, n_sel=8, window=64)
B, T = 2, 256
TOL = {jnp.bfloat16: 2e-2, jnp.float16: 5e-3, jnp.float32: 1e-5}
PALLAS = ("pallas", "xla")
# The Pallas compressed kernel instead of cuDNN's (bf16 / fp16 take cuDNN by default).
PALLAS_KERNEL_ONLY = {"pallas": nsa_jax.PallasOptions(compressed_cudnn=False)}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32],
                         ids=["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("options", [None, PALLAS_KERNEL_ONLY], ids=["default", "no_cudnn_cmp"])
def test_layer_in_x64_mode(x64, dtype, options):
    params, x = make_inputs(CFG, B, T, dtype)
    y = nsa_jax.nsa_attention(params, x, CFG, backend=PALLAS, options=options)
    assert y.dtype == x.dtype
    ref, _ = bf_nsa_layer(jax.tree_util.tree_map(np.asarray, params), np.asarray(x), CFG)
    assert rel_err(y, ref) <= TOL[dtype]


def test_layer_gradient_in_x64_mode(x64):
    """float32 gradients wrt x under x64 (compiled kernels) equal those with x64 off."""
    params, x = make_inputs(CFG, B, T, jnp.float32)

    def grad_x(x):
        return jax.grad(lambda x: jnp.sum(jnp.sin(nsa_jax.nsa_attention(
            params, x, CFG, backend=PALLAS))))(x)

    g = grad_x(x)
    with jax.enable_x64(False):
        g_ref = grad_x(x)
    assert g.dtype == jnp.float32
    assert rel_err(g, g_ref) <= 1e-4


SELECTED = dict(shape=(1, 200, 4, 2, 32, 32, 4), l_sel=32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_selected_attention_kernel_in_x64_mode(x64, dtype):
    """The compiled kernel, forward and gradients, against its reference."""
    check_selected_attention(dtype, interpret=False, **SELECTED)


def test_float64_falls_through_to_xla(x64):
    check_float64_falls_through(interpret=False, **SELECTED)
