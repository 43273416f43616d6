"""GPU: non-finite isolation through the compiled Pallas kernels (docs/ROBUSTNESS.md); the same
cases run in interpret mode on a CPU in tests/test_nonfinite.py."""
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import jax_has_gpu
from jax_inputs import make_inputs
from nsa_common import NSAConfig
from test_nonfinite import TOL, _run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not jax_has_gpu(), reason="needs a GPU (JAX)")]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_pallas_kernels_isolate(dtype):
    """The compiled Pallas kernels (not interpret mode) and the cuDNN window path (bf16),
    causal and batch isolation."""
    cfg = NSAConfig(d_model=128, n_heads=4, n_kv_heads=2, d_k=32, d_v=32, cmp_block=16,
                    cmp_stride=8, sel_block=32, n_sel=4, window=64)
    params, x = make_inputs(cfg, 2, 256, dtype)
    x_bad = x.at[0, 150].set(jnp.nan)
    backend = ("pallas", "xla")
    y, y_bad = _run(cfg, backend, x, params=params), _run(cfg, backend, x_bad, params=params)
    # Same finite values in both runs; the GPU's reductions may still round differently.
    tol = TOL if dtype == jnp.float32 else 1e-2
    for got, want in ((y_bad[0, :150], y[0, :150]), (y_bad[1], y[1])):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    assert not np.isfinite(np.asarray(y_bad[0, 150], np.float32)).any()
