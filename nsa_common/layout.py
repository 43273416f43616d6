"""Block layout arithmetic of the spec, shared by both frameworks (plain Python and NumPy)."""
from __future__ import annotations

import numpy as np

from nsa_common.config import NSAConfig


def num_cmp_blocks(cfg: NSAConfig, seq_len: int) -> int:
    """Compressed blocks of a sequence of `seq_len` tokens: i in [0, (T - l) // d], none if T < l."""
    if seq_len < cfg.cmp_block:
        return 0
    return (seq_len - cfg.cmp_block) // cfg.cmp_stride + 1


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


def decode_read_bound(cfg: NSAConfig, t: int) -> int:
    """The paper's per-step memory-access formula for the token at position t (0-based):
    `max(0, (t + 1 - l) // d + 1) + n_sel * l_sel + w` (Table 4: 5,632 at 64k with the defaults).
    The compressed term is clamped at zero because no block exists before t = l - 1."""
    cmp_blocks = max(0, (t + 1 - cfg.cmp_block) // cfg.cmp_stride + 1)
    return cmp_blocks + cfg.n_sel * cfg.sel_block + cfg.window
