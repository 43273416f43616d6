"""RoPE keeps its accuracy at long positions: the rotation comes from exact per-byte tables,
not from a float32 angle whose rounding grows with the position."""
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from nsa_jax.rope import apply_rope
from nsa_torch_ref import reference


def _float64_rope(x, positions, theta):
    half = x.shape[-1] // 2
    angle = np.asarray(positions, np.float64)[:, None] * theta ** (-2.0 * np.arange(half)
                                                                   / x.shape[-1])
    cos, sin = np.cos(angle)[None, :, None], np.sin(angle)[None, :, None]
    x1, x2 = x[..., :half].astype(np.float64), x[..., half:].astype(np.float64)
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_rope_is_float32_accurate_at_every_position(theta):
    rng = np.random.default_rng(0)
    positions = np.array([0, 1, 255, 256, 4097, 65535, 65536, 1_000_003, 2 ** 24 - 1])
    x = rng.standard_normal((1, positions.size, 2, 64)).astype(np.float32)
    want = _float64_rope(x, positions, theta)
    got = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(positions), theta))
    assert np.abs(got - want).max() < 2e-6          # a float32 angle is off by 4e-3 at 64k
    torch_got = reference.apply_rope(torch.from_numpy(x), torch.from_numpy(positions), theta)
    assert np.abs(torch_got.numpy() - want).max() < 2e-6


def test_plain_arithmetic_keeps_the_dtype_inside():
    assert reference._acc_dtype(torch.bfloat16) == torch.float32
    with reference.plain_arithmetic():
        assert reference._acc_dtype(torch.bfloat16) == torch.bfloat16
        assert reference._acc_dtype(torch.float32) == torch.float32
    assert reference._acc_dtype(torch.float16) == torch.float32
