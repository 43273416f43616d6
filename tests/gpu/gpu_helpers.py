"""Shared pieces of the GPU test matrix (tests/gpu/): marks, tolerances, errors."""
from __future__ import annotations

import pytest
import torch

# Every GPU test module sets `pytestmark = GPU`: marked `gpu`, skipped cleanly without CUDA.
GPU = [pytest.mark.gpu,
       pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOL_F32 = 1e-5       # float32 outputs (relative error against a float32/float64 reference)
TOL_F32_GRAD = 1e-4
TOL_16 = 1e-2        # bfloat16 / float16 outputs and gradients


def tol_for(dtype: torch.dtype, grad: bool = False) -> float:
    if dtype == torch.float32:
        return TOL_F32_GRAD if grad else TOL_F32
    return TOL_16
