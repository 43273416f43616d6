"""fla-org's `parallel_nsa` (the flash-linear-attention package), as bench/fla_setup.py and
bench/fla_agreement.py run it: installed, or from a checkout given by --peer-path fla=PATH.

Its configuration (`bench.fla_setup.fla_config` of the bench preset): H 64, G 4, d 128, mean
compression with l = d = l_sel = 64, top 16 with the first block and 2 local ones forced,
window 512 (flash-attn's `window_size=(511, 0)`: 512 keys, ours w = 512), one k / v for the
three branches, sigmoid gates per head. fla_agreement.py's docstring details the match. Without
flash-attn its window runs through `install_window_shim` (nsa_torch_ref's FA-2 path), timed
alone as window_standin. A forced selection goes through its `block_indices=` argument. It has
no decode kernel.
"""
from __future__ import annotations

import warnings
from typing import Optional

from bench.peers import from_heads_first, import_from

NAME = "fla"
REPO = "fla-org/flash-linear-attention"


def config(heads: Optional[tuple[int, int]] = None):
    """Our NSAConfig in fla's configuration (bench/fla_setup.py)."""
    from bench import common
    from bench.fla_setup import fla_config

    cfg = fla_config(common.nsa_preset("bench"))
    if heads:
        cfg = cfg.replace(n_heads=heads[0], n_kv_heads=heads[1])
    return cfg


def notes(cfg) -> str:
    return "fla.ops.nsa.parallel_nsa; window: flash-attn or nsa_torch_ref's FA-2 shim"


def load(path: Optional[str], cfg) -> "Peer":
    return Peer(path, cfg)


def _blocks(idx, B: int, S: int, n_sel: int, block_size: int):
    """fla's block_indices [B, S, G, slots] (-1 unused) -> our form."""
    G, m = idx.shape[2], idx.shape[3]
    return from_heads_first(idx.permute(2, 0, 1, 3).reshape(G, B * S, m), B, S, n_sel,
                            block_size)


class Peer:
    def __init__(self, path: Optional[str], cfg):
        self.cfg = cfg
        from bench.fla_agreement import import_fla

        if path is not None:
            import_from(path, "fla")
        try:
            self.fla_parallel = import_fla()
        except ImportError as exc:
            from bench.common import Skip

            raise Skip(f"fla not importable ({exc})") from None
        from bench.fla_setup import install_window_shim

        self.window_label = install_window_shim(self.fla_parallel)
        self.impl = f"fla.ops.nsa.parallel_nsa (window: {self.window_label})"
        from bench.common import Skip
        from bench.fla_agreement import check_fla_shapes

        try:
            check_fla_shapes(cfg)
        except ValueError as exc:
            raise Skip(str(exc)) from None

    def window(self, q, k, v):
        """Its window branch alone (the shim when flash-attn is missing), [B, S, H, d_v]."""
        if self.window_label == "flash_attn":
            return None
        w = self.cfg.window
        return self.fla_parallel.flash_attn_func(q, k, v, causal=True, window_size=(w - 1, 0))

    def prefill(self, q, k, v, gate_logits, block_idx=None):
        import torch

        cfg = self.cfg
        B, S = q.shape[:2]
        gates = torch.sigmoid(gate_logits.float()).to(q.dtype)
        forced = None if block_idx is None else block_idx.to(q.device, torch.int32).contiguous()
        self.used = (forced, B, S)
        topk = self.fla_parallel.parallel_nsa_topk

        def recording_topk(*args, **kwargs):
            idx = topk(*args, **kwargs)
            self.used = (idx, B, S)
            return idx

        self.fla_parallel.parallel_nsa_topk = recording_topk
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "block_indices is provided, overriding ..."
                o = self.fla_parallel.parallel_nsa(
                    q, k, v, g_cmp=gates[..., 0], g_slc=gates[..., 1], g_swa=gates[..., 2],
                    block_indices=forced, block_counts=cfg.n_sel, block_size=cfg.sel_block,
                    window_size=cfg.window, scale=cfg.scale)
        finally:
            self.fla_parallel.parallel_nsa_topk = topk
        return o

    def last_selection(self):
        """The blocks of the last prefill, in our form [B, S, G, n_sel]."""
        idx, B, S = self.used
        return _blocks(idx, B, S, self.cfg.n_sel, self.cfg.sel_block)

    def decode_case(self, k, v, q_last, gate_last, block_idx=None):
        from bench.common import Skip

        raise Skip("fla-org's parallel_nsa has no decode kernel")
