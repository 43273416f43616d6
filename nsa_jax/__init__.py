"""Native Sparse Attention (DeepSeek NSA) for JAX: pure functions over parameter pytrees.

Layer: `init_params`, `nsa_attention`. Core over projected tensors (q, k, v, gates):
`native_sparse_attention`. Decode: `init_cache`, `prefill`, `decode_step`. Training the
selection: `selection_alignment_loss` (options in `AlignmentOptions`) and the dense warm-up's
`dense_warmup_config` (`nsa_jax.alignment`).
Kernel-level (BTHD): `compress_kv`, `compressed_attention`, `select_blocks`,
`selected_attention`, `sliding_window_attention`. A Flax NNX module: `nsa_jax.nnx.NSAAttention`
(needs the `flax` extra; not imported here). Backends plug in through `register_backend`
(`nsa_jax.dispatch`); `"xla"` is built in, `"pallas"` (selection, compressed attention,
selected attention, XLA for the rest; interpret mode off a GPU) comes from `pallas_kernels`.
"""
# The one place the version is written; pyproject.toml reads it.
__version__ = "0.1.0"

from nsa_common import NSAConfig
from nsa_jax.alignment import (ALIGNMENT_MODES, AlignmentOptions, dense_warmup_config,
                               selection_alignment_loss)
from nsa_jax.core import native_sparse_attention
from nsa_jax.checks import check_cu_seqlens, cu_seqlens_valid
from nsa_jax.decode import DecodeCache, decode_step, init_cache, prefill
from nsa_jax.dispatch import known_backends, register_backend
from nsa_jax.kernels import (compress_kv, compressed_attention, select_blocks,
                             selected_attention, sliding_window_attention)
from nsa_jax.layer import init_params, nsa_attention, param_shapes
from nsa_jax.rope import apply_rope
from nsa_jax.pallas_backend import PallasOptions
from nsa_jax.pallas_backend import register as _register_pallas
from nsa_jax.xla.options import XlaOptions
from nsa_jax.sharding import MeshAxes, sharded_nsa_attention  # the rest: nsa_jax.sharding

_register_pallas()

__all__ = [
    "ALIGNMENT_MODES",
    "AlignmentOptions",
    "DecodeCache",
    "MeshAxes",
    "NSAConfig",
    "PallasOptions",
    "XlaOptions",
    "apply_rope",
    "check_cu_seqlens",
    "compress_kv",
    "compressed_attention",
    "cu_seqlens_valid",
    "decode_step",
    "dense_warmup_config",
    "init_cache",
    "init_params",
    "known_backends",
    "native_sparse_attention",
    "nsa_attention",
    "param_shapes",
    "prefill",
    "register_backend",
    "select_blocks",
    "selection_alignment_loss",
    "selected_attention",
    "sharded_nsa_attention",
    "sliding_window_attention",
]
