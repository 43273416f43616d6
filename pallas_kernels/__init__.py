"""Pallas GPU kernels for NSA, one file per op, each with its plain-JAX reference beside it.

Kernels know nothing of the layer; `nsa_jax` reaches them through its one dispatch point. Every
op takes `block_sizes` (its module's dataclass, exported here under the op's name), `interpret`
and `implementation` ("triton", or "xla" for its reference).

An op exported here shadows the module of the same name as an attribute of the package
(`pallas_kernels.compressed_attention` is the function): reach a module's other names with
`from pallas_kernels.compressed_attention import ...`.
"""
import types

from pallas_kernels.compressed_attention import (
    BlockSizes as CompressedAttentionBlockSizes,
    compressed_attention,
    compressed_attention_reference,
    compressed_lse,
)
from pallas_kernels.decode import (
    DecodeBlockSizes,
    append_rows,
    append_rows_packed,
    append_step_packed,
    compress_step,
    decode_attention,
    decode_compressed,
    decode_compressed_reference,
    decode_compressed_select,
    decode_compressed_select_reference,
    decode_selected_window,
    decode_selected_window_reference,
)
from pallas_kernels.select_blocks import (
    BlockSizes as SelectBlocksBlockSizes,
    select_blocks,
    select_blocks_reference,
    top_n,
)
from pallas_kernels.selected_attention import (
    BlockSizes as SelectedAttentionBlockSizes,
    random_block_idx,
    selected_attention,
    selected_attention_reference,
    selected_attention_stages,
)
from pallas_kernels.selected_block_mass import (
    selected_block_mass,
    selected_block_mass_reference,
)
from pallas_kernels.selected_importance import (
    selected_importance,
    selected_importance_reference,
)
from pallas_kernels.window_attention import (
    BlockSizes as WindowAttentionBlockSizes,
    window_attention,
    window_attention_reference,
)

# Every name imported above (the ops, their references and block-size classes), and no module.
__all__ = sorted(name for name, value in list(globals().items())
                 if not name.startswith("_") and not isinstance(value, types.ModuleType))
