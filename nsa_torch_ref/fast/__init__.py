"""The PyTorch fast paths of NSA's branches, beside the reference of the package's top level.

- `triton_selection`: Triton selected attention, forward and backward (backend "triton").
- `fa2`: FlashAttention-2 for the sliding-window and compressed branches (backend "fa2").
- `runtime`: the toggles (`configs/base.yaml`, device profiles, environment) and debug logging.
- `routing`: which backend each branch takes under the toggles and why (backend "auto"), the
  registration of the three backends with `nsa_torch_ref.dispatch`, and the summary that
  `python -m nsa_torch_ref.fast` prints (docs/TORCH_RUNTIME.md).

Importing this package needs neither Triton nor a GPU: the Triton kernels are imported when
first called.
"""
from nsa_torch_ref.fast.routing import register_fast_paths

__all__ = ["register_fast_paths"]
