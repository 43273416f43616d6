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
