"""Decode with a cache (docs/NSA_SPEC.md, "Decode"): `init_cache`, `prefill`, `decode_step`.

The cache serves a batch of sequences that advance together (one position for the batch,
docs/DESIGN.md). `prefill` and `decode_step` write into the cache's tensors in place and return
the same object, for symmetry with the JAX API, which returns a new pytree. Both run without
autograd: decoding is inference.

Each step uses the same row helpers as the prefill kernels (`reference._*_rows`) on the cached
keys, so a step reads exactly the tokens the spec counts: the compressed blocks emitted so far,
the tokens <= t of its selected blocks and the last `w` tokens.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from nsa_common import NSAConfig, decode_read_bound, num_cmp_blocks, num_sel_blocks
from nsa_torch_ref import dispatch
from nsa_torch_ref.module import NSAAttention, combine, compress_branch_kv, nsa_forward, project
from nsa_torch_ref.reference import (_compressed_rows, _resolve_scale, _select_rows,
                                     _selected_rows, _window_rows)


@dataclasses.dataclass
class NSACache:
    """Decode state of one layer. d is d_k for keys, d_v for values;
    C_max = num_cmp_blocks(cfg, max_len).

    k_sel, v_sel:         [B, max_len, G, d]  every token so far (selection branch).
    k_win, v_win:         [B, w, G, d]        ring buffer: token t in slot t % w.
    k_cmp_raw, v_cmp_raw: [B, l, G, d]        ring of the cmp branch's last l tokens: slot t % l.
    k_cmp, v_cmp:         [B, C_max, G, d]    compressed blocks emitted so far (first n_cmp rows).
    pos:                  number of tokens already in the cache (the next token's position).
    """

    k_sel: torch.Tensor
    v_sel: torch.Tensor
    k_win: torch.Tensor
    v_win: torch.Tensor
    k_cmp_raw: torch.Tensor
    v_cmp_raw: torch.Tensor
    k_cmp: torch.Tensor
    v_cmp: torch.Tensor
    pos: int = 0

    @property
    def batch(self) -> int:
        return self.k_sel.shape[0]

    @property
    def max_len(self) -> int:
        return self.k_sel.shape[1]


def init_cache(cfg: NSAConfig, batch: int, max_len: int, dtype: torch.dtype = torch.float32,
               device=None) -> NSACache:
    """An empty cache for `batch` sequences of up to `max_len` tokens."""
    for name, value in (("batch", batch), ("max_len", max_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} ({value!r}) must be a positive int")
    G = cfg.n_kv_heads

    def zeros(length: int, dim: int) -> torch.Tensor:
        return torch.zeros(batch, length, G, dim, dtype=dtype, device=device)

    n_cmp_max = num_cmp_blocks(cfg, max_len)
    return NSACache(
        k_sel=zeros(max_len, cfg.d_k), v_sel=zeros(max_len, cfg.d_v),
        k_win=zeros(cfg.window, cfg.d_k), v_win=zeros(cfg.window, cfg.d_v),
        k_cmp_raw=zeros(cfg.cmp_block, cfg.d_k), v_cmp_raw=zeros(cfg.cmp_block, cfg.d_v),
        k_cmp=zeros(n_cmp_max, cfg.d_k), v_cmp=zeros(n_cmp_max, cfg.d_v),
    )


def _check_step_input(module: NSAAttention, x: torch.Tensor, cache: NSACache, name: str,
                      n_tokens: Optional[int] = None) -> None:
    cfg = module.cfg
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != cfg.d_model:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a [B, T, d_model={cfg.d_model}] tensor, got {shape}")
    if x.shape[0] != cache.batch:
        raise ValueError(f"{name} batch ({x.shape[0]}) must equal the cache's ({cache.batch})")
    if n_tokens is not None and x.shape[1] != n_tokens:
        raise ValueError(f"{name} must hold {n_tokens} token(s), got {x.shape[1]}")
    if cache.pos + x.shape[1] > cache.max_len:
        raise ValueError(f"cache is full: pos {cache.pos} + {x.shape[1]} new token(s) > "
                         f"max_len {cache.max_len}")


@torch.no_grad()
def prefill(module: NSAAttention, x: torch.Tensor, cache: NSACache):
    """Run the layer over a prompt and fill an empty cache.

    x: [B, T, d_model] at positions 0..T-1. Returns (y [B, T, d_model], cache) with cache.pos = T.
    """
    if cache.pos != 0:
        raise ValueError(f"cache must be empty for prefill (pos is {cache.pos})")
    _check_step_input(module, x, cache, "x")
    cfg = module.cfg
    T = x.shape[1]
    y, _, kv = nsa_forward(module.param_tree(), x, cfg, dispatch.resolve_all(module.backends))
    k, v = kv["k"], kv["v"]
    cache.k_sel[:, :T] = k["sel"]
    cache.v_sel[:, :T] = v["sel"]
    for ring_k, ring_v, branch, size in ((cache.k_win, cache.v_win, "win", cfg.window),
                                         (cache.k_cmp_raw, cache.v_cmp_raw, "cmp", cfg.cmp_block)):
        recent = torch.arange(max(0, T - size), T, device=x.device)
        ring_k[:, recent % size] = k[branch][:, recent]
        ring_v[:, recent % size] = v[branch][:, recent]
    n_cmp = kv["k_cmp"].shape[1]
    cache.k_cmp[:, :n_cmp] = kv["k_cmp"]
    cache.v_cmp[:, :n_cmp] = kv["v_cmp"]
    cache.pos = T
    return y, cache


@torch.no_grad()
def decode_step(module: NSAAttention, x_t: torch.Tensor, cache: NSACache,
                return_aux: bool = False):
    """Append token t = cache.pos and return its output.

    x_t: [B, 1, d_model]. Returns (y_t [B, 1, d_model], cache, reads) and, with `return_aux`,
    a 4th item: dict(o_cmp, o_sel, o_win [B, 1, H, d_v], gates [B, 1, H, 3],
    block_idx int32 [B, 1, G, n_sel]).

    reads (tokens whose K and V this step loads, per KV head): `cmp` compressed blocks
    available, `win` = min(w, t + 1) (ints, the same for every head); `sel` the tokens <= t of
    the valid selected blocks and `total` = cmp + sel + win (int64 [B, G], as each sequence and
    KV head selects its own blocks); `bound` = nsa_common.decode_read_bound(cfg, t).
    """
    _check_step_input(module, x_t, cache, "x_t", n_tokens=1)
    cfg = module.cfg
    params = module.param_tree()
    t = cache.pos
    device = x_t.device
    q_pos = torch.tensor([t], device=device)
    q, k, v = project(params, x_t, cfg, q_pos)

    cache.k_sel[:, t] = k["sel"][:, 0]
    cache.v_sel[:, t] = v["sel"][:, 0]
    cache.k_win[:, t % cfg.window] = k["win"][:, 0]
    cache.v_win[:, t % cfg.window] = v["win"][:, 0]
    cache.k_cmp_raw[:, t % cfg.cmp_block] = k["cmp"][:, 0]
    cache.v_cmp_raw[:, t % cfg.cmp_block] = v["cmp"][:, 0]
    emitted = t + 1 - cfg.cmp_block
    if emitted >= 0 and emitted % cfg.cmp_stride == 0:
        # Tokens t-l+1 .. t, oldest first, from the ring: the block of compressed index i.
        order = torch.arange(t - cfg.cmp_block + 1, t + 1, device=device) % cfg.cmp_block
        k_block, v_block = compress_branch_kv(params, cache.k_cmp_raw[:, order],
                                              cache.v_cmp_raw[:, order], cfg)
        i = emitted // cfg.cmp_stride
        cache.k_cmp[:, i] = k_block[:, 0]
        cache.v_cmp[:, i] = v_block[:, 0]
    cache.pos = t + 1

    scale = _resolve_scale(None, cfg.d_k)
    n_cmp = num_cmp_blocks(cfg, t + 1)
    o_cmp, p_cmp, _ = _compressed_rows(q, cache.k_cmp[:, :n_cmp], cache.v_cmp[:, :n_cmp],
                                       q_pos, cfg, scale)
    block_idx = _select_rows(p_cmp, q_pos, cfg, num_sel_blocks(cfg, t + 1))
    o_sel = _selected_rows(q, cache.k_sel[:, :t + 1], cache.v_sel[:, :t + 1], block_idx,
                           cfg.sel_block, q_pos, scale)
    n_win = min(cfg.window, t + 1)
    slot = torch.arange(n_win, device=device)
    slot_pos = t - (t - slot) % cfg.window  # the position held by each ring slot
    o_win = _window_rows(q, cache.k_win[:, :n_win], cache.v_win[:, :n_win], q_pos, slot_pos,
                         cfg.window, scale)
    o_cmp, o_sel, o_win = (o.to(x_t.dtype) for o in (o_cmp, o_sel, o_win))
    y, gates = combine(params, x_t, o_cmp, o_sel, o_win, cfg)

    starts = block_idx[:, 0].long() * cfg.sel_block  # [B, G, n_sel]
    sel_tokens = torch.where(block_idx[:, 0] >= 0,
                             (t + 1 - starts).clamp(min=0, max=cfg.sel_block), 0).sum(-1)
    n_win_reads = min(cfg.window, t + 1)
    reads = dict(cmp=n_cmp, sel=sel_tokens, win=n_win_reads,
                 total=n_cmp + sel_tokens + n_win_reads, bound=decode_read_bound(cfg, t))
    if return_aux:
        aux = dict(o_cmp=o_cmp, o_sel=o_sel, o_win=o_win, gates=gates, block_idx=block_idx)
        return y, cache, reads, aux
    return y, cache, reads
