"""Adapters that run other NSA implementations (peers) beside ours for bench/bench_peers.py.

One module per peer (`mdy666`, `fsa`, `fla`). Each imports its peer from a checkout given by
`--peer-path NAME=PATH` (or, for fla, the installed package), never from this repository, and
exposes:

  NAME, REPO                 the peer's name here and its public repository
  config(heads=None)         our NSAConfig in the peer's own configuration (head counts, block
                             sizes, compression, window); heads = (H, G) overrides the heads
  notes(cfg)                 what the adapter runs, what differs, and what stands in
  load(path, cfg) -> Peer    raises common.Skip saying why when the peer cannot run here

and a `Peer` with
  impl                       a label of the peer's kernels as run
  prefill(q, k, v, gate_logits, block_idx=None) -> o
                             the attention core on BTHD torch tensors (q [B, S, H, d_k], one
                             k / v [B, S, G, d] for the three branches, gate logits
                             [B, S, H, 3]); differentiable; block_idx (ours, [B, S, G, n_sel])
                             forces the selection, else the peer selects
  last_selection()           the blocks the last prefill used, in our form (converted on
                             request, so that a timed prefill does no extra work)
  window(q, k, v) -> o       the stand-in for its window branch alone (None: no stand-in)
  decode_case(k, v, q_last, gate_last, block_idx=None) -> DecodeCase, or raises Skip
                             one decode step for the query at position S - 1 over a cache of
                             k, v [B, S, G, d]

Our form of a selection: int32 [B, S, G, n_sel], ascending, -1 padded at the end
(`nsa_jax.native_sparse_attention`'s block_idx). The helpers below convert.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from typing import Any, Callable, Optional

PEERS = ("mdy666", "fsa", "fla")


def adapter(name: str):
    """The adapter module of peer `name`."""
    if name not in PEERS:
        raise ValueError(f"peer ({name!r}) must be one of {list(PEERS)}")
    return importlib.import_module(f"bench.peers.{name}")


def import_from(path: Optional[str], *packages: str):
    """Import `packages` from the checkout at `path` (put first on sys.path); the first module.
    Skip (bench.common) with the reason when the path is missing or an import fails."""
    from bench.common import Skip

    if path is not None:
        if not os.path.isdir(path):
            raise Skip(f"no checkout at {path} (fetch the peer and pass --peer-path)")
        path = os.path.abspath(path)
        if path not in sys.path:
            sys.path.insert(0, path)
    modules = []
    for package in packages:
        try:
            modules.append(importlib.import_module(package))
        except Exception as exc:  # ImportError, or a CUDA query at import on a machine without
            raise Skip(f"cannot import {package} from {path}: {type(exc).__name__}: "
                       f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
    return modules[0]


def ensure_pkg_resources() -> None:
    """A `pkg_resources` with `parse_version` where setuptools no longer ships one (a peer
    compares version strings with it)."""
    try:
        import pkg_resources  # noqa: F401
    except ImportError:
        import types

        from packaging.version import parse

        sys.modules["pkg_resources"] = types.SimpleNamespace(parse_version=parse)


class RecordsSelection:
    """`last_selection()` of a peer whose prefill keeps `self.used` = (its selection
    [G, B * S, m], B, S) and `self.cfg`."""

    def last_selection(self):
        """The blocks of the last prefill, in our form [B, S, G, n_sel]."""
        idx, B, S = self.used
        return from_heads_first(idx, B, S, self.cfg.n_sel, self.cfg.sel_block)


@dataclasses.dataclass
class DecodeCase:
    """One decode step of a peer, ready to be timed: `step()` -> o [B, H, d_v] (the call a
    generation loop makes each step), `block_idx()` -> the blocks the last step selected in our
    form [B, G, n_sel], `graphable`: whether the step may be captured in a CUDA graph."""

    step: Callable[[], Any]
    block_idx: Callable[[], Any]
    graphable: bool = False
    note: str = ""


def flash_window_config(heads: tuple[int, int], *, d_model: int, head_dim: int, kernel: int,
                        stride: int, block: int, top_n: int, n_init: int, n_local: int,
                        window_left: int):
    """Our NSAConfig of a peer with mean compression, one k / v for the three branches and
    flash-attn's window `window_size=(window_left, -1)`: keys t - window_left .. t, so
    w = window_left + 1 in our convention (keys t - w + 1 .. t)."""
    from nsa_common import NSAConfig

    H, G = heads
    return NSAConfig(d_model=d_model, n_heads=H, n_kv_heads=G, d_k=head_dim, d_v=head_dim,
                     cmp_block=kernel, cmp_stride=stride, sel_block=block, n_sel=top_n,
                     n_init=n_init, n_local=n_local, window=window_left + 1, compress="mean",
                     shared_kv=True)


def window_alone(q, k, v, left: int):
    """The window stand-in alone on BTHD tensors q [B, S, H, d], k / v [B, S, G, d]:
    [B, S, H, d_v] (bench/peers/window.py)."""
    from bench.peers import window

    B, S = q.shape[:2]
    o = window.attention(packed(q), packed(k), packed(v), cu_seqlens(B, S, q.device), S, left,
                         q.shape[-1] ** -0.5)
    return o.reshape(B, S, *o.shape[1:])


# ---------------------------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------------------------
def cu_seqlens(B: int, S: int, device):
    """int32 [B + 1]: B packed sequences of S tokens."""
    import torch

    return torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device=device)


def packed(x):
    """[B, S, ...] -> [B * S, ...] (a view of a contiguous tensor)."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def heads_first(block_idx, fill: int):
    """Our selection [B, S, G, n] -> a peer's [G, B * S, n] int32 (contiguous), -1 -> `fill`."""
    import torch

    idx = block_idx.to(torch.int32)
    idx = torch.where(idx < 0, torch.full_like(idx, fill), idx)
    return idx.permute(2, 0, 1, 3).reshape(idx.shape[2], -1, idx.shape[3]).contiguous()


def from_heads_first(idx, B: int, S: int, n_sel: int, block_size: int, first: int = 0):
    """A peer's selection [G, B * S, m] of the queries at positions first .. first + S - 1 of
    B sequences (any order; entries < 0 or past the query's own block mean none) -> ours
    [B, S, G, n_sel]: ascending, -1 padded at the end (m > n_sel: ValueError when a row holds
    more than n_sel blocks)."""
    import torch

    G, _, m = idx.shape
    idx = idx.reshape(G, B, S, m).permute(1, 2, 0, 3).to(torch.int64)
    own_block = ((first + torch.arange(S, device=idx.device)) // block_size)[None, :, None, None]
    big = torch.iinfo(torch.int64).max
    valid = (idx >= 0) & (idx <= own_block)
    idx = torch.where(valid, idx, torch.full_like(idx, big)).sort(dim=-1).values
    if m > n_sel:
        if (idx[..., n_sel:] != big).any():
            raise ValueError(f"a row selects more than n_sel ({n_sel}) blocks")
        idx = idx[..., :n_sel]
    elif m < n_sel:
        idx = torch.cat([idx, torch.full((*idx.shape[:-1], n_sel - m), big, dtype=idx.dtype,
                                         device=idx.device)], dim=-1)
    return torch.where(idx == big, torch.full_like(idx, -1), idx).to(torch.int32)


def mean_pool(x, block: int, stride: int):
    """Mean compression of x [B, S, G, d]: [B, (S - block) // stride + 1, G, d], each block's
    mean in float32 rounded to x's dtype (a compressed cache's content)."""
    windows = x.float().unfold(1, block, stride)          # [B, C, G, d, block]
    return windows.mean(-1).to(x.dtype)
