"""The `"xla"` backend: exact, chunked over queries, plain `jax.numpy` / `lax`.

One module per branch, and `decode` for the decode entries; `nsa_jax.dispatch` registers them.
Runtime knobs live in `XlaOptions`.
"""
from nsa_jax.xla.compress import compress_blocks, compress_kv
from nsa_jax.xla.compressed_attention import compressed_attention
from nsa_jax.xla.importance import selected_importance
from nsa_jax.xla.decode import (decode_append, decode_attention, decode_compressed_attention,
                                decode_compressed_select, decode_select_blocks,
                                decode_selected_window_attention)
from nsa_jax.xla.options import DEFAULT_OPTIONS, XlaOptions
from nsa_jax.xla.select_blocks import select_blocks, top_blocks
from nsa_jax.xla.selected_attention import selected_attention, selected_block_mass
from nsa_jax.xla.sliding_window import sliding_window_attention

__all__ = [
    "DEFAULT_OPTIONS",
    "XlaOptions",
    "compress_blocks",
    "compress_kv",
    "compressed_attention",
    "decode_append",
    "decode_attention",
    "decode_compressed_attention",
    "decode_compressed_select",
    "decode_select_blocks",
    "decode_selected_window_attention",
    "select_blocks",
    "selected_attention",
    "selected_block_mass",
    "selected_importance",
    "sliding_window_attention",
    "top_blocks",
]
