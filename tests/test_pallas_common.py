"""What every Pallas op shares (`pallas_kernels._common`): the same knobs on every public op,
`implementation="xla"` running the plain-JAX reference beside the kernel, a bad
`implementation` refused with a ValueError that names the argument, and the one `dot`."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._common import IMPLEMENTATIONS, dot
from pallas_kernels.compressed_attention import (
    compressed_attention,
    compressed_attention_reference,
    compressed_lse,
)
from pallas_kernels.decode import (
    decode_compressed,
    decode_compressed_reference,
    decode_selected_window,
    decode_selected_window_reference,
)
from pallas_kernels.select_blocks import select_blocks, select_blocks_reference
from pallas_kernels.selected_attention import (
    random_block_idx,
    selected_attention,
    selected_attention_reference,
)

# One small case per op: B 1, T 40, H 4, G 2, l 8, d 4, l_sel 8, n_sel 3, d_k 16, d_v 8.
B, T, H, G, D_K, D_V, L, D, L_SEL, N_SEL = 1, 40, 4, 2, 16, 8, 8, 4, 8, 3
C = (T - L) // D + 1
SELECTION = dict(cmp_block=L, cmp_stride=D, sel_block=L_SEL, n_sel=N_SEL, n_init=1, n_local=1)


def _normal(seed, shape):
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)


def _prefill_inputs():
    return dict(q=_normal(0, (B, T, H, D_K)), k_cmp=_normal(1, (B, C, G, D_K)),
                v_cmp=_normal(2, (B, C, G, D_V)), k=_normal(3, (B, T, G, D_K)),
                v=_normal(4, (B, T, G, D_V)), lse=_normal(5, (B, T, H)),
                block_idx=random_block_idx(jax.random.PRNGKey(6), B, T, G, N_SEL, L_SEL))


def _decode_inputs():
    t = jnp.array([T - 1], jnp.int32)
    return dict(q=_normal(7, (B, H, D_K)), k_cmp=_normal(1, (B, C, G, D_K)),
                v_cmp=_normal(2, (B, C, G, D_V)), k_sel=_normal(3, (B, T, G, D_K)),
                v_sel=_normal(4, (B, T, G, D_V)), k_win=_normal(8, (B, 16, G, D_K)),
                v_win=_normal(9, (B, 16, G, D_V)), t=t,
                block_idx=jnp.array([[[0, 2, 4]] * G], jnp.int32))


# op name -> (the op with every knob passed through, its reference on the same inputs)
OPS = {
    "compressed_attention": (
        lambda x, **knobs: compressed_attention(x["q"], x["k_cmp"], x["v_cmp"], cmp_block=L,
                                                   cmp_stride=D, **knobs),
        lambda x: compressed_attention_reference(x["q"], x["k_cmp"], x["v_cmp"], cmp_block=L,
                                                    cmp_stride=D)),
    "compressed_lse": (
        lambda x, **knobs: compressed_lse(x["q"], x["k_cmp"], cmp_block=L, cmp_stride=D,
                                             **knobs),
        lambda x: compressed_attention_reference(x["q"], x["k_cmp"], x["v_cmp"], cmp_block=L,
                                                    cmp_stride=D)[1]),
    "select_blocks": (
        lambda x, **knobs: select_blocks(x["q"], x["k_cmp"], x["lse"], **SELECTION, **knobs),
        lambda x: select_blocks_reference(x["q"], x["k_cmp"], x["lse"], **SELECTION)),
    "selected_attention": (
        lambda x, **knobs: selected_attention(x["q"], x["k"], x["v"], x["block_idx"], L_SEL,
                                                 **knobs),
        lambda x: selected_attention_reference(x["q"], x["k"], x["v"], x["block_idx"], L_SEL)),
    "decode_compressed": (
        lambda x, **knobs: decode_compressed(x["q"], x["k_cmp"], x["v_cmp"], x["t"],
                                                cmp_block=L, cmp_stride=D, scale=0.25, **knobs),
        lambda x: decode_compressed_reference(x["q"], x["k_cmp"], x["v_cmp"], x["t"],
                                                 cmp_block=L, cmp_stride=D, scale=0.25)),
    "decode_selected_window": (
        lambda x, **knobs: decode_selected_window(
            x["q"], x["k_sel"], x["v_sel"], x["block_idx"], x["k_win"], x["v_win"], x["t"],
            sel_block=L_SEL, window=16, scale=0.25, **knobs),
        lambda x: decode_selected_window_reference(
            x["q"], x["k_sel"], x["v_sel"], x["block_idx"], x["k_win"], x["v_win"], x["t"],
            sel_block=L_SEL, window=16, scale=0.25)),
}


PUBLIC_OPS = {op.__name__: op for op in (compressed_attention, compressed_lse, select_blocks,
                                         selected_attention, decode_compressed,
                                         decode_selected_window)}


def _inputs(op: str):
    return _decode_inputs() if op.startswith("decode") else _prefill_inputs()


@pytest.mark.parametrize("op", [pytest.param(op, marks=pytest.mark.slow)
                                if op == "compressed_attention" else op for op in sorted(OPS)])
def test_xla_implementation_is_the_reference(op):
    run, reference = OPS[op]
    x = _inputs(op)
    got, expected = run(x, implementation="xla"), jax.jit(reference)(x)
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        assert g.shape == e.shape and g.dtype == e.dtype
        # Equal up to XLA's fusion of the same float32 ops (the op may run under jit).
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("op", sorted(OPS))
def test_bad_implementation_raises(op):
    run, _ = OPS[op]
    with pytest.raises(ValueError, match="implementation"):
        run(_inputs(op), implementation="mosaic", interpret=True)


def test_every_op_takes_the_same_knobs():
    """`block_sizes`, `interpret` and `implementation` on every public op, with the kernel's
    defaults: `implementation` one of `IMPLEMENTATIONS`, the kernel first."""
    import inspect

    assert set(PUBLIC_OPS) == set(OPS)
    for op in OPS:
        params = inspect.signature(PUBLIC_OPS[op]).parameters
        assert params["block_sizes"].default is None, op
        assert params["interpret"].default is False, op
        assert params["implementation"].default == IMPLEMENTATIONS[0] == "triton", op


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, True)])
def test_dot_accumulates_in_float32(dtype, trans_a, trans_b):
    a = _normal(10, (32, 16)).astype(dtype)
    b = _normal(11, (16, 32) if not trans_b else (32, 16)).astype(dtype)
    if trans_a:
        a = _normal(10, (16, 32)).astype(dtype)
    got = dot(a, b, trans_a=trans_a, trans_b=trans_b)
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    expected = (a64.T if trans_a else a64) @ (b64.T if trans_b else b64)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)


def test_package_exports_every_op():
    import pallas_kernels

    for name, op in PUBLIC_OPS.items():
        assert name in pallas_kernels.__all__ and getattr(pallas_kernels, name) is op, name
    missing = [name for name in pallas_kernels.__all__ if not hasattr(pallas_kernels, name)]
    assert not missing
