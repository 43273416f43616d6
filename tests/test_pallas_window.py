"""Sliding-window attention Pallas kernels (interpret mode on CPU) against a float64 reference
and the NumPy brute force: outputs, lse, gradients, windows shorter and longer than T, GQA,
d_k != d_v; the key and query tiles the kernels visit."""
from __future__ import annotations

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bruteforce as bf
from conftest import enable_x64, jax_has_gpu
from nsa_common.testing import rel_err
from pallas_kernels.window_attention import (BlockSizes, window_attention,
                                             window_attention_reference)

window_module = importlib.import_module("pallas_kernels.window_attention")

# Relative L2 error bounds (docs/NSA_SPEC.md "Tolerances"): float32 kernels against float64,
# bfloat16 kernels against float32 on the same bfloat16 inputs.
TOL = {jnp.float32: {"out": 1e-5, "grad": 1e-4}, jnp.bfloat16: {"out": 1e-2, "grad": 1e-2}}

# Small tiles, so that the CPU shapes span several query and key tiles and every kind of tile
# (masked at the window's start, whole, masked on the diagonal) occurs.
SMALL = BlockSizes(block_q=32, block_kv=16, block_q_dq=16, block_kv_dq=16, block_q_dkv=16,
                   block_kv_dkv=16)


def make_inputs(seed, B, T, H, G, d_k, d_v):
    """q, k, v and the cotangents of o and lse, float32 (NumPy's generator: no compile)."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, dtype=np.float32))  # noqa
    return (normal(B, T, H, d_k), normal(B, T, G, d_k), normal(B, T, G, d_v),
            normal(B, T, H, d_v), normal(B, T, H))


def outputs_and_grads(attention, q, k, v, do, dlse, **kw):
    """(o, lse, (dq, dk, dv)) in one jitted call; the loss pulls on o and lse."""
    def loss(q, k, v):
        o, lse = attention(q, k, v, return_lse=True, **kw)
        return jnp.sum(o.astype(do.dtype) * do) + jnp.sum(lse * dlse), (o, lse)

    (_, (o, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        q, k, v)
    return o, lse, grads


def float64_reference(q, k, v, do, dlse, window, scale=None):
    """o, lse and gradients of the plain reference, computed in float64, as NumPy arrays."""
    with enable_x64():
        f64 = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, do, dlse)]
        o, lse, grads = outputs_and_grads(window_attention_reference, *f64, window=window,
                                          scale=scale)
        return np.asarray(o), np.asarray(lse), [np.asarray(g) for g in grads]


# (B, T, H, G, d_k, d_v, window, dkv_transposed): window < T with h = 2 and odd head dims;
# window > T (causal) with h = 3 (heads padded to 4), d_k = 96 in two column parts (64 + 32),
# B = 2, and the transposed dK/dV products.
CASES = [
    (1, 300, 4, 2, 24, 40, 37, False),
    (2, 100, 3, 1, 96, 32, 128, True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}T{}H{}G{}dk{}dv{}w{}-t{}".format(*c))
def test_float32_matches_float64_reference(case):
    B, T, H, G, d_k, d_v, window, transposed = case
    q, k, v, do, dlse = make_inputs(0, B, T, H, G, d_k, d_v)
    tiles = dataclasses.replace(SMALL, dkv_transposed=transposed)
    o, lse, grads = outputs_and_grads(window_attention, q, k, v, do, dlse, window=window,
                                      block_sizes=tiles, interpret=True)
    o_ref, lse_ref, grads_ref = float64_reference(q, k, v, do, dlse, window)
    assert o.shape == (B, T, H, d_v) and o.dtype == jnp.float32
    assert lse.shape == (B, T, H) and lse.dtype == jnp.float32
    assert rel_err(o, o_ref) <= TOL[jnp.float32]["out"]
    assert rel_err(lse, lse_ref) <= TOL[jnp.float32]["out"]
    # The reference itself against the brute force of the spec (NumPy, float64).
    o_bf = bf.bf_sliding_window_attention(np.asarray(q), np.asarray(k), np.asarray(v), window)
    assert rel_err(o_ref, o_bf) <= 1e-12
    for name, g, g_ref, x in zip(("dq", "dk", "dv"), grads, grads_ref, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        assert rel_err(g, g_ref) <= TOL[jnp.float32]["grad"], name


def test_bfloat16_paper_heads_default_tiles():
    """d_k 192 (two column parts) / d_v 128 on the default tiles, custom scale."""
    window, scale = 48, 0.07
    q, k, v, do, dlse = make_inputs(1, 1, 200, 8, 2, 192, 128)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    o, lse, grads = outputs_and_grads(window_attention, q, k, v, do, dlse, window=window,
                                      scale=scale, interpret=True)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    o_ref, lse_ref, grads_ref = outputs_and_grads(window_attention_reference, *f32, do, dlse,
                                                  window=window, scale=scale)
    assert o.dtype == jnp.bfloat16
    assert rel_err(o, o_ref) <= TOL[jnp.bfloat16]["out"]
    assert rel_err(lse, lse_ref) <= TOL[jnp.bfloat16]["out"]
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert g.dtype == jnp.bfloat16, name
        assert rel_err(g, g_ref) <= TOL[jnp.bfloat16]["grad"], name


# ----------------------------------------------------------------------------------------------
# The tiles the kernels visit: exactly those that meet the window, masks only where needed


def _keys_seen(first, count, window):
    """Keys the window of any of queries first .. first + count - 1 contains."""
    return set().union(*(range(max(0, t - window + 1), t + 1) for t in range(first, first +
                                                                             count)))


@pytest.mark.parametrize("q_tile, block_kv, window", [(8, 16, 37), (16, 16, 16), (2, 32, 1),
                                                      (32, 16, 512)])
def test_key_tiles_cover_the_window_and_no_more(q_tile, block_kv, window):
    for first in range(0, 200, q_tile):
        start, bulk_start, bulk_stop, stop = map(int, window_module._key_tiles(
            jnp.int32(first), q_tile, block_kv, window))
        tiles = {s // block_kv for s in _keys_seen(first, q_tile, window)}
        assert set(range(start, stop)) == tiles, first          # O(T * w): no other tile
        assert start <= bulk_start <= bulk_stop <= stop
        for tile in range(start, stop):
            keys = range(tile * block_kv, (tile + 1) * block_kv)
            whole = all(t - window < s <= t for t in range(first, first + q_tile) for s in keys)
            # A whole tile may still be masked at the ends, but a bulk tile must be whole.
            assert whole or not bulk_start <= tile < bulk_stop, (first, tile)
        # Only the tiles at each end of the band are masked.
        assert (bulk_start - start) + (stop - bulk_stop) <= 2 * (-(-q_tile // block_kv) + 1)


@pytest.mark.parametrize("block_kv, q_tile, window", [(16, 8, 37), (16, 16, 16), (32, 2, 1),
                                                      (16, 32, 512)])
def test_query_tiles_cover_the_keys_readers(block_kv, q_tile, window):
    n_q_tiles = 256 // q_tile
    for first_key in range(0, 256, block_kv):
        start, bulk_start, bulk_stop, stop = map(int, window_module._query_tiles(
            jnp.int32(first_key), block_kv, q_tile, window, n_q_tiles))
        readers = {t // q_tile for t in range(256)
                   if any(t - window < s <= t for s in range(first_key, first_key + block_kv))}
        assert set(range(start, stop)) == readers, first_key
        for tile in range(bulk_start, bulk_stop):
            assert all(t - window < s <= t for t in range(tile * q_tile, (tile + 1) * q_tile)
                       for s in range(first_key, first_key + block_kv)), (first_key, tile)


# ----------------------------------------------------------------------------------------------
# Contract


def test_bad_inputs_raise_value_error_and_float64_declines():
    q, k, v, _, _ = make_inputs(3, 1, 20, 4, 2, 16, 8)
    with pytest.raises(ValueError, match="window"):
        window_attention(q, k, v, window=0, interpret=True)
    with pytest.raises(ValueError, match="multiple of the heads"):
        window_attention(q[:, :, :3], k, v, window=4, interpret=True)
    with pytest.raises(ValueError, match="must be"):
        window_attention(q, k, v[:, :10], window=4, interpret=True)
    with pytest.raises(ValueError, match="head dim"):
        window_attention(q, k[..., :8], v, window=4, interpret=True)
    with pytest.raises(ValueError, match="block_kv"):
        BlockSizes(block_kv=24)
    with enable_x64():
        q64 = jnp.asarray(np.asarray(q, np.float64))
        with pytest.raises(NotImplementedError, match="float64"):
            window_attention(q64, q64[:, :, :2], q64[:, :, :2], window=4, interpret=True)


@pytest.mark.gpu
@pytest.mark.skipif(not jax_has_gpu(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", [
    (1, 2048, 64, 4, 192, 128, 512),   # the paper's heads and window
    (2, 1000, 16, 4, 64, 32, 100),     # T not a multiple of the tiles
    (1, 300, 4, 4, 128, 128, 512),     # h = 1, window > T
    (1, 1000, 64, 4, 128, 128, 512),   # the bench preset's heads (h = 16, d 128)
    (1, 777, 6, 2, 96, 80, 33),        # h = 3, d_k in two parts, d_v padded
])
def test_gpu_matches_reference(dtype, case):
    """float32: within TOL of the float32 reference. bfloat16: the kernel's error against the
    float32 reference on the same bfloat16 inputs at most twice that of the plain reference run
    in bfloat16 (docs/NSA_SPEC.md "Tolerances"), so that a wrong tile shows even where a fixed
    bound would hide it."""
    B, T, H, G, d_k, d_v, window = case
    q, k, v, do, dlse = make_inputs(4, B, T, H, G, d_k, d_v)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    got = outputs_and_grads(window_attention, q, k, v, do, dlse, window=window)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref = outputs_and_grads(window_attention_reference, *f32, do, dlse, window=window)
    plain = outputs_and_grads(window_attention_reference, q, k, v, do, dlse, window=window)
    flat = lambda out: (out[0], out[1], *out[2])  # noqa: E731
    for name, x, x_ref, x_plain in zip(("o", "lse", "dq", "dk", "dv"), flat(got), flat(ref),
                                       flat(plain)):
        err = float(rel_err(x, x_ref))
        if dtype == jnp.float32:
            limit = TOL[dtype]["out" if name in ("o", "lse") else "grad"]
        else:
            limit = 2.0 * float(rel_err(x_plain, x_ref)) + 1e-5
        assert err <= limit, f"{name}: relative error {err:.3g} > {limit:.3g}"
