"""Compression of keys / values into block summaries (spec step 4), XLA path."""
from __future__ import annotations

from typing import Mapping, Optional

import jax
import jax.numpy as jnp

from nsa_common import NSAConfig, num_cmp_blocks
from nsa_jax.segments import Segments
from nsa_jax.xla.common import compute_dtype, einsum
from nsa_jax.xla.options import XlaOptions


def compress_blocks(blocks: jax.Array, cmp_params: Optional[Mapping[str, jax.Array]],
                    cfg: NSAConfig) -> jax.Array:
    """`[..., l, G, D]` token-ordered blocks -> `[..., G, D]` summaries, in the compute dtype.

    `cmp_params` None is `compress="mean"`; otherwise the phi MLP of the spec per KV head g:
    `gelu(flatten(block + pos[g]) @ w1[g] + b1[g]) @ w2[g] + b2[g]`, exact GELU, token-major
    flatten. Shared by prefill (all blocks at once) and decode (one block at a time).
    """
    if cmp_params is None:
        return jnp.mean(blocks.astype(compute_dtype(blocks.dtype)), axis=-3)
    dtype = compute_dtype(blocks.dtype, *(p.dtype for p in cmp_params.values()))
    l, G, D = blocks.shape[-3:]
    blocks = jnp.swapaxes(blocks, -3, -2).astype(dtype)                   # [..., G, l, D]
    flat = (blocks + cmp_params["pos"].astype(dtype)).reshape(*blocks.shape[:-2], l * D)
    hidden = einsum("...gi,gio->...go", flat, cmp_params["w1"], dtype) + cmp_params["b1"]
    hidden = jax.nn.gelu(hidden, approximate=False)
    return einsum("...gi,gio->...go", hidden, cmp_params["w2"], dtype) + cmp_params["b2"]


def compress_kv(k: jax.Array, cmp_params: Optional[Mapping[str, jax.Array]], cfg: NSAConfig, *,
                segments: Optional[Segments] = None,
                options: Optional[XlaOptions] = None) -> jax.Array:
    """k: `[B, T, G, D]` -> `[B, C, G, D]` in k's dtype.

    Unpacked: `C = num_cmp_blocks(cfg, T)`, block i covers tokens `[i*d, i*d + l)`. Packed: one
    summary per slot of `segments` (unused slots are zero). Gathering the blocks costs `l / d`
    times the size of k, which the 16k-token target affords.
    """
    del options  # nothing to tune: one gather and two batched matmuls
    T = k.shape[1]
    if segments is None:
        block_start = jnp.arange(num_cmp_blocks(cfg, T), dtype=jnp.int32) * cfg.cmp_stride
    else:
        block_start = segments.cmp_start
    token = jnp.clip(block_start[:, None] + jnp.arange(cfg.cmp_block), 0, max(T - 1, 0))
    out = compress_blocks(k[:, token], cmp_params, cfg)                    # [B, C, G, D]
    if segments is not None:
        out = jnp.where((segments.cmp_seg >= 0)[None, :, None, None], out, 0)
    return out.astype(k.dtype)
