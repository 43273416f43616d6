"""PyTorch implementation of Native Sparse Attention (docs/NSA_SPEC.md): the reference here,
the fast paths in `nsa_torch_ref.fast`.

Top level, plain torch (float64-exact, any device): `reference` (the kernel-level functions, the
"packed SDPA / gather" path that `dispatch` registers as backend "sdpa"), `module`
(`NSAAttention`), `decode` (cache, prefill, decode step) and `dispatch` (ordered fallbacks over
the backends of each branch). `fast`: the Triton selection kernel ("triton"), the FlashAttention-2
paths ("fa2"), and the runtime toggles with the routing that follows them ("auto";
docs/TORCH_RUNTIME.md). They are registered with `dispatch` on import; their kernels are
imported only when first called.
"""
from nsa_common import NSAConfig
from nsa_torch_ref import dispatch
from nsa_torch_ref.decode import NSACache, decode_step, init_cache, prefill
from nsa_torch_ref.module import NSAAttention, native_sparse_attention, nsa_forward
from nsa_torch_ref.reference import (
    apply_rope,
    compress_kv,
    compressed_attention,
    select_blocks,
    selected_attention,
    sliding_window_attention,
)
from nsa_torch_ref.fast import register_fast_paths

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
    "native_sparse_attention",
    "nsa_forward",
    "prefill",
    "select_blocks",
    "selected_attention",
    "sliding_window_attention",
]
