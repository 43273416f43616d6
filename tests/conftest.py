import os
import sys

# Tests import the packages from the checkout even when it is not installed, and import
# `bruteforce` as a plain module.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import contextlib

import pytest


@contextlib.contextmanager
def enable_x64():
    """float64 in JAX for the duration (jax >= 0.10 has `jax.enable_x64`; older, `experimental`)."""
    import jax
    context = jax.enable_x64 if hasattr(jax, "enable_x64") else jax.experimental.enable_x64
    with context(True):
        yield


@pytest.fixture(autouse=True, scope="session")
def highest_matmul_precision():
    """The suite's float32 tolerances (1e-5) are IEEE float32's. nsa_jax leaves matmuls at JAX's
    default precision (TF32 for float32 on recent GPUs), so the suite asks for "highest", as
    the parity report does; on a CPU it changes nothing. test_jax_core checks the default."""
    import jax
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture
def x64():
    with enable_x64():
        yield


def jax_has_gpu() -> bool:
    """Whether JAX sees a CUDA GPU (GPU-only tests skip cleanly otherwise)."""
    import jax
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False
