"""parity.convert: bit-exact tensor round trips for every dtype, both directions; parity.compare:
the rule that judges a quantity."""
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from parity.compare import MULTIPLE, judge, limit
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


def test_judge_against_float64_and_the_plain_error():
    """A framework passes within MULTIPLE times the plain implementation's distance to the
    reference; NaN fails; a zero-in-exact-arithmetic reference is measured against the scale."""
    rng = np.random.default_rng(0)
    reference = rng.standard_normal(1000)
    noise = 1e-3 * rng.standard_normal(1000)
    plain = reference + noise
    close = judge("q", reference + 1.5 * noise, plain, plain, reference, "bfloat16")
    assert close.passed and close.limit == pytest.approx(MULTIPLE["bfloat16"] * close.plain)
    far = judge("q", reference + 3 * noise, plain, plain, reference, "bfloat16")
    assert not far.passed
    # float32 allows its accumulation order four times the plain error, and no more
    assert judge("q", reference + 3 * noise, plain, plain, reference, "float32").passed
    assert not judge("q", reference + 5 * noise, plain, plain, reference, "float32").passed
    broken = reference.copy()
    broken[3] = np.nan
    assert judge("q", broken, plain, plain, reference, "bfloat16").nonfinite == 1
    with pytest.raises(ValueError, match="shapes"):
        judge("q", np.ones(3), np.ones(4), np.ones(4), np.ones(4), "float32")
    zero = judge("d b", noise, noise, noise, 1e-18 * noise, "bfloat16", scale=10.0)
    assert zero.zero and zero.plain == pytest.approx(np.linalg.norm(noise) / 10.0, rel=1e-6)


def test_agreement_limits_the_distance_between_frameworks():
    rng = np.random.default_rng(1)
    reference = rng.standard_normal(1000)
    plain = reference + 1e-3 * rng.standard_normal(1000)
    same = judge("k", plain, plain, plain, reference, "bfloat16", agreement=0.25)
    assert same.passed and same.cross == 0.0
    shifted = judge("k", plain * 1.001, plain, plain, reference, "bfloat16", agreement=0.25)
    assert not shifted.passed and shifted.jax <= shifted.limit  # only the agreement catches it
    assert np.isinf(judge("k", plain, plain, plain, reference, "bfloat16").cross_limit)


def test_limits_follow_the_dtype():
    assert limit(0.0, "bfloat16") == pytest.approx(MULTIPLE["bfloat16"] * 0.25 * 2.0 ** -8)
    assert limit(0.0, "float32") == pytest.approx(MULTIPLE["float32"] * 4 * 2.0 ** -24)
    assert limit(1e-2, "bfloat16") == pytest.approx(MULTIPLE["bfloat16"] * 1e-2)
    with pytest.raises(ValueError, match="dtype"):
        limit(1e-3, "int8")
