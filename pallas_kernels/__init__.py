"""Pallas GPU kernels for NSA, one file per op, each with its plain-JAX reference beside it.

Kernels know nothing of the layer; `nsa_jax` reaches them through its one dispatch point.
"""
from pallas_kernels.selected_attention import (
    BlockSizes as SelectedAttentionBlockSizes,
    random_block_idx,
    selected_attention,
    selected_attention_reference,
)

__all__ = [
    "SelectedAttentionBlockSizes",
    "random_block_idx",
    "selected_attention",
    "selected_attention_reference",
]
