"""parity.convert: bit-exact tensor round trips for every dtype, both directions; parity.compare."""
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from parity.compare import compare, selection_agreement, tolerance
from parity.convert import jax_to_torch, torch_to_jax

DTYPES = [
    (torch.float64, jnp.float64), (torch.float32, jnp.float32), (torch.float16, jnp.float16),
    (torch.bfloat16, jnp.bfloat16), (torch.int32, jnp.int32), (torch.int64, jnp.int64),
    (torch.bool, jnp.bool_), (torch.int8, jnp.int8), (torch.uint8, jnp.uint8),
]


def _random_torch(dtype, shape=(3, 5, 7)):
    generator = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape, generator=generator) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)
    return torch.randint(0, 100, shape, generator=generator).to(dtype)


def _bits(tensor: torch.Tensor) -> np.ndarray:
    if tensor.dtype in (torch.bfloat16, torch.float16):
        return tensor.view(torch.int16).numpy()
    return tensor.numpy()


@pytest.fixture(autouse=True)
def _float64(x64):
    yield


@pytest.mark.parametrize("torch_dtype, jax_dtype", DTYPES, ids=lambda d: str(d))
def test_torch_to_jax_round_trip_is_bit_exact(torch_dtype, jax_dtype):
    tensor = _random_torch(torch_dtype)
    array = torch_to_jax(tensor)
    assert array.dtype == jax_dtype and array.shape == tensor.shape
    back = jax_to_torch(array)
    assert back.dtype == torch_dtype
    np.testing.assert_array_equal(_bits(back), _bits(tensor))


@pytest.mark.parametrize("torch_dtype, jax_dtype", DTYPES, ids=lambda d: str(d))
def test_jax_to_torch_round_trip_is_bit_exact(torch_dtype, jax_dtype):
    array = torch_to_jax(_random_torch(torch_dtype, (4, 9)))
    tensor = jax_to_torch(array)
    assert tensor.dtype == torch_dtype
    again = torch_to_jax(tensor)
    assert again.dtype == jax_dtype
    np.testing.assert_array_equal(np.asarray(again).view(np.uint8), np.asarray(array).view(np.uint8))


def test_bfloat16_values_survive():
    tensor = torch.tensor([1.0, -2.5, 3.140625, 1e-3], dtype=torch.bfloat16)
    np.testing.assert_array_equal(np.asarray(torch_to_jax(tensor)).astype(np.float32),
                                  tensor.float().numpy())


def test_conversion_rejects_wrong_types():
    with pytest.raises(ValueError, match="tensor"):
        torch_to_jax(np.zeros(3))
    with pytest.raises(ValueError, match="array"):
        jax_to_torch(torch.zeros(3))


def test_compare_flags_nan_and_error():
    reference = np.ones(10)
    assert compare("ok", reference * (1 + 1e-7), reference, 1e-5).passed
    assert not compare("off", reference * 1.01, reference, 1e-5).passed
    broken = reference.copy()
    broken[3] = np.nan
    result = compare("nan", broken, reference, 1.0)
    assert result.nonfinite == 1 and not result.passed
    with pytest.raises(ValueError, match="shapes"):
        compare("shape", np.ones(3), np.ones(4), 1.0)


def test_tolerances_follow_the_spec():
    assert tolerance("float32", "output") == 1e-5 and tolerance("float32", "grad") == 1e-4
    assert tolerance("bfloat16", "grad") == 1e-2
    with pytest.raises(ValueError, match="dtype"):
        tolerance("int8", "output")


def test_selection_agreement_counts_whole_rows():
    a = np.zeros((1, 4, 2, 3), dtype=np.int32)
    b = a.copy()
    b[0, 1, 0, 2] = 5
    assert selection_agreement(a, b) == pytest.approx(7 / 8)
