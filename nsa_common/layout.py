"""Block layout arithmetic of the spec, shared by both frameworks and the kernels' wrappers.

The rules take Python ints or integer arrays alike (NumPy, JAX, PyTorch: only `+ - * // <=`),
so every framework computes them with the same expression, traced or not.
"""
from __future__ import annotations

import numpy as np

from nsa_common.config import NSAConfig


def cmp_block_end(block, cmp_block: int, cmp_stride: int):
    """Position of the last token of compressed block `block` (it covers `[i*d, i*d + l)`):
    `i*d + l - 1`."""
    return block * cmp_stride + cmp_block - 1


def cmp_admissible(block, t, cmp_block: int, cmp_stride: int):
    """Whether query position `t` may attend compressed block `block` (spec step 5): the block's
    last token exists, `i*d + l - 1 <= t`."""
    return cmp_block_end(block, cmp_block, cmp_stride) <= t


def num_admissible_cmp_blocks(t, cmp_block: int, cmp_stride: int):
    """How many compressed blocks query position `t` may attend: blocks `0 .. n-1` with
    `n = max(0, (t + 1 - l) // d + 1)` (0 while `t < l - 1`)."""
    count = (t + 1 - cmp_block) // cmp_stride + 1
    return count * (count > 0)  # max(count, 0) for ints and every array type alike


def completes_cmp_block(t, cmp_block: int, cmp_stride: int):
    """Whether the token at position `t` is the last token of a compressed block (decode emits
    that block at t): `t = i*d + l - 1` for some i >= 0."""
    return (t + 1 >= cmp_block) & ((t + 1 - cmp_block) % cmp_stride == 0)


def completed_cmp_block(t, cmp_block: int, cmp_stride: int):
    """The index `i = (t + 1 - l) // d` of the block that ends at position `t` (meaningful where
    `completes_cmp_block(t, ...)`)."""
    return (t + 1 - cmp_block) // cmp_stride


def num_cmp_blocks(cfg: NSAConfig, seq_len: int) -> int:
    """Compressed blocks of a sequence of `seq_len` tokens: i in [0, (T - l) // d], none if T < l
    (the blocks admissible to its last token)."""
    return num_admissible_cmp_blocks(seq_len - 1, cfg.cmp_block, cfg.cmp_stride)


def num_sel_blocks(cfg: NSAConfig, seq_len: int) -> int:
    """Selection blocks touched by a sequence of `seq_len` tokens (the last may be partial)."""
    return -(-seq_len // cfg.sel_block)


def overlap_weights(cfg: NSAConfig, n_cmp: int, n_sel_blocks: int) -> np.ndarray:
    """`[n_cmp, n_sel_blocks]` float32 matrix M with p_sel = p_cmp @ M (spec step 6).

    M[i, j] = |[i*d, i*d + l) & [j*l_sel, (j+1)*l_sel)| / d. With the defaults, column j weights
    compressed blocks 4j-1 .. 4j+3 by [1, 2, 2, 2, 1]; with l = d = l_sel it is the identity.
    """
    l, d, l_sel = cfg.cmp_block, cfg.cmp_stride, cfg.sel_block
    cmp_start = np.arange(n_cmp)[:, None] * d
    sel_start = np.arange(n_sel_blocks)[None, :] * l_sel
    overlap = (np.minimum(cmp_start + l, sel_start + l_sel)
               - np.maximum(cmp_start, sel_start)).clip(min=0)
    return (overlap / d).astype(np.float32)


def overlap_by_offset(cfg) -> tuple:
    """The nonzero weights of `overlap_weights` by slot offset: `((m, weight), ...)`, m
    ascending, where selection block j weighs compressed block `j*r + m` (r = l_sel / d; m from
    -(l/d - 1)). The same for every j: one column of the matrix, read far enough from block 0
    that every earlier slot exists. `cfg` needs only cmp_block, cmp_stride and sel_block."""
    r = cfg.sel_block // cfg.cmp_stride
    j = -(-(cfg.cmp_block // cfg.cmp_stride) // r)
    column = overlap_weights(cfg, (j + 1) * r, j + 1)[:, j]
    return tuple((int(i) - j * r, float(column[i])) for i in np.flatnonzero(column))


def decode_read_bound(cfg: NSAConfig, t):
    """The paper's per-step memory-access formula for the token at position t (0-based; an int
    or an integer array): `max(0, (t + 1 - l) // d + 1) + n_sel * l_sel + w` (Table 4: 5,632
    at 64k with the defaults). The compressed term is clamped at zero because no block exists
    before t = l - 1."""
    cmp_blocks = num_admissible_cmp_blocks(t, cfg.cmp_block, cfg.cmp_stride)
    return cmp_blocks + cfg.n_sel * cfg.sel_block + cfg.window
