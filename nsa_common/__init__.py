"""Framework-free pieces of the NSA contract shared by `nsa_jax` and `nsa_torch_ref`.

Nothing here imports torch or jax, so either framework can be used without the other.
"""
from nsa_common.config import NSAConfig
from nsa_common.layout import (
    cmp_admissible,
    cmp_block_end,
    completed_cmp_block,
    completes_cmp_block,
    decode_read_bound,
    num_admissible_cmp_blocks,
    num_cmp_blocks,
    num_sel_blocks,
    overlap_by_offset,
    overlap_weights,
)

__all__ = [
    "NSAConfig",
    "cmp_admissible",
    "cmp_block_end",
    "completed_cmp_block",
    "completes_cmp_block",
    "decode_read_bound",
    "num_admissible_cmp_blocks",
    "num_cmp_blocks",
    "num_sel_blocks",
    "overlap_by_offset",
    "overlap_weights",
]
