"""PyTorch reference implementation of Native Sparse Attention (docs/NSA_SPEC.md).

`NSAAttention` is the layer; the kernel-level functions below are the reference ("packed SDPA /
gather") path of its branches, which `dispatch` registers as backend "sdpa". The fast paths
register as "triton" (selection), "fa2" (window, compressed) and "auto" (the runtime toggles of
`routing`, docs/TORCH_RUNTIME.md); their kernels are imported only when first called.
"""
from nsa_common import NSAConfig
from nsa_torch_ref import dispatch
from nsa_torch_ref.decode import NSACache, decode_step, init_cache, prefill
from nsa_torch_ref.module import NSAAttention, nsa_forward
from nsa_torch_ref.reference import (
    apply_rope,
    compress_kv,
    compressed_attention,
    select_blocks,
    selected_attention,
    sliding_window_attention,
)
from nsa_torch_ref.routing import register_fast_paths

register_fast_paths()

__all__ = [
    "NSAAttention",
    "NSACache",
    "NSAConfig",
    "apply_rope",
    "compress_kv",
    "compressed_attention",
    "decode_step",
    "dispatch",
    "init_cache",
    "nsa_forward",
    "prefill",
    "select_blocks",
    "selected_attention",
    "sliding_window_attention",
]
