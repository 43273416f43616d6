import os
import sys

# Tests import the packages from the checkout even when it is not installed, and import
# `bruteforce` as a plain module.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

# On a machine without a GPU, XLA compiles the suite's many small programs with LLVM's cheap
# pipeline (a third less CPU time) and with its loop emitters instead of the MLIR fusion
# emitters (about 40% less again: they compile a small fusion faster). Neither changes the
# arithmetic beyond a last bit (no fast-math; the reductions' order is XLA's, not LLVM's). Set
# before JAX starts; a GPU machine keeps its flags.
# Compiled programs are also kept in the checkout's `.jax_test_cache/` (ignored by git), so a
# program that several tests build (the same layer at the same shapes) compiles once, and a
# second run of the suite skips most compilation. A fresh clone starts cold. Set
# JAX_COMPILATION_CACHE_DIR to use another folder.
CPU_COMPILE_FLAGS = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
                     " --xla_cpu_use_fusion_emitters=false")
if not os.path.exists("/dev/nvidia0"):
    if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " "
                                   + CPU_COMPILE_FLAGS).strip()
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                          os.path.join(os.path.dirname(HERE), ".jax_test_cache"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# One thread per op in PyTorch and NumPy's BLAS: `pytest -n auto` already runs one worker per
# core, and the suite's tensors are tiny, so a second thread per op only waits for a core (on a
# 2-core machine the float64 gradcheck of test_torch_layer ran 9x slower with two). Set before
# torch is imported; an exported value wins.
for _threads in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_threads, "1")

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


def skip_above_cudnn_head_dim(d_k: int) -> None:
    """Skip a cuDNN test whose head size the architecture profile's cuDNN does not take (the
    sm89 profile's limit is 128, as an RTX 4090's)."""
    from nsa_jax.xla import cudnn

    if d_k > cudnn.max_head_dim():
        pytest.skip(f"cuDNN takes head sizes up to {cudnn.max_head_dim()} on this profile")


def jax_has_gpu() -> bool:
    """Whether JAX sees a CUDA GPU (GPU-only tests skip cleanly otherwise)."""
    import jax
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False
