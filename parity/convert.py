"""Tensors and parameters between PyTorch and JAX, keeping dtype (bfloat16 included) and device.

On the same GPU both directions go through DLPack, without a copy. On CPU they go through NumPy;
bfloat16, which NumPy lacks, travels as its 16-bit pattern and is reinterpreted as
`ml_dtypes.bfloat16` (what JAX uses), so every conversion is bit-exact.
"""
from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch

from nsa_torch_ref.module import flatten_params, nest_params

_TORCH_TO_NUMPY = {
    torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16,
    torch.bfloat16: ml_dtypes.bfloat16, torch.int64: np.int64, torch.int32: np.int32,
    torch.int16: np.int16, torch.int8: np.int8, torch.uint8: np.uint8, torch.bool: np.bool_,
}
_NUMPY_TO_TORCH = {np.dtype(v): k for k, v in _TORCH_TO_NUMPY.items()}


def _jax_device_of(array: jax.Array):
    return next(iter(array.devices()))


def torch_to_jax(tensor: torch.Tensor, device=None) -> jax.Array:
    """A torch tensor as a JAX array with the same dtype and values.

    A CUDA tensor goes through DLPack (no copy) when JAX runs on a GPU; a CPU tensor goes through
    NumPy and lands on `device` (default: JAX's default device).
    """
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    tensor = tensor.detach()
    if tensor.dtype not in _TORCH_TO_NUMPY:
        raise ValueError(f"tensor has dtype {tensor.dtype}, which has no JAX counterpart here")
    if tensor.is_cuda and jax.default_backend() == "gpu":
        return jax.dlpack.from_dlpack(tensor.contiguous())
    host = tensor.cpu().contiguous()
    if host.dtype == torch.bfloat16:
        array = host.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    else:
        array = host.numpy()
    return jax.device_put(array, device)


def jax_to_torch(array: jax.Array, device: str | torch.device | None = None) -> torch.Tensor:
    """A JAX array as a torch tensor with the same dtype and values.

    A GPU array goes through DLPack (no copy) unless `device` asks for another place; otherwise the
    values go through NumPy to `device` (default: CPU).
    """
    if not isinstance(array, jax.Array):
        raise ValueError(f"array must be a jax.Array, got {type(array).__name__}")
    if np.dtype(array.dtype) not in _NUMPY_TO_TORCH:
        raise ValueError(f"array has dtype {array.dtype}, which has no torch counterpart here")
    on_gpu = _jax_device_of(array).platform == "gpu"
    if on_gpu and (device is None or torch.device(device).type == "cuda"):
        tensor = torch.from_dlpack(array)
        return tensor if device is None else tensor.to(device)
    host = np.asarray(jax.device_get(array))
    if host.dtype == ml_dtypes.bfloat16:
        tensor = torch.from_numpy(host.view(np.int16).copy()).view(torch.bfloat16)
    else:
        tensor = torch.from_numpy(host.copy())
    return tensor if device is None else tensor.to(device)


def module_to_params(module: torch.nn.Module, device=None) -> dict:
    """An `nsa_torch_ref.NSAAttention`'s parameters as the `nsa_jax` pytree (same names, shapes)."""
    return nest_params({name: torch_to_jax(p, device) for name, p in module.named_parameters()})


def params_to_module(params: Mapping[str, Any], module: torch.nn.Module) -> torch.nn.Module:
    """Copy an `nsa_jax` pytree into `module` in place (names and shapes must match exactly)."""
    flat = flatten_params(params)
    own = dict(module.named_parameters())
    if set(flat) != set(own):
        missing, extra = sorted(set(own) - set(flat)), sorted(set(flat) - set(own))
        raise ValueError(f"params do not match the module: missing {missing}, unexpected {extra}")
    with torch.no_grad():
        for name, value in flat.items():
            tensor = jax_to_torch(value, device=own[name].device)
            if tuple(tensor.shape) != tuple(own[name].shape):
                raise ValueError(f"params[{name!r}] has shape {tuple(tensor.shape)}, the module "
                                 f"expects {tuple(own[name].shape)}")
            own[name].copy_(tensor.to(own[name].dtype))
    return module
