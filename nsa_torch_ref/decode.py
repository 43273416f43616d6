"""Decode with a cache (docs/NSA_SPEC.md, "Decode"): `init_cache`, `prefill`, `decode_step`.

Each sequence of the cache has its own length (`cache.lengths`, int64 `[B]`, as flash-attn's
`cache_seqlens` and `nsa_jax.decode`): prompts of different lengths prefill in one call, a
prefill appends to a non-empty cache (chunked prefill), and each sequence decodes from its own
position. `prefill` and `decode_step` write into the cache's tensors in place and return the
same object, for symmetry with the JAX API, which returns a new pytree. Both run without
autograd: decoding is inference. A call that would push a sequence past `max_len` raises a
`ValueError` naming it, before writing anything.

The reference favours clarity over speed: it works sequence by sequence. Each step uses the
same row helpers as the prefill kernels (`reference._*_rows`) on the cached keys, so a step
reads exactly the tokens the spec counts: the compressed blocks emitted so far, the tokens
<= t of its selected blocks and the last `w` tokens. A prefill on an empty sequence is the
layer's forward; on a non-empty one it appends token by token through the decode step, which
computes what the forward would (the tests check both).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from nsa_common import (NSAConfig, completed_cmp_block, completes_cmp_block, decode_read_bound,
                        num_cmp_blocks, num_sel_blocks)
from nsa_torch_ref import dispatch
from nsa_torch_ref.module import (NSAAttention, check_block_idx, combine, compress_branch_kv,
                                  nsa_forward, project)
from nsa_torch_ref.reference import (_acc_dtype, _compressed_rows, _resolve_scale, _select_rows,
                                     _selected_rows, _window_rows)


@dataclasses.dataclass
class NSACache:
    """Decode state of one layer. d is d_k for keys, d_v for values;
    C_max = num_cmp_blocks(cfg, max_len).

    k_sel, v_sel:         [B, max_len, G, d]  every token so far (selection branch).
    k_win, v_win:         [B, w, G, d]        ring buffer: token t in slot t % w.
    k_cmp_raw, v_cmp_raw: [B, l, G, d]        ring of the cmp branch's last l tokens: slot t % l.
    k_cmp, v_cmp:         [B, C_max, G, d]    compressed blocks emitted so far (first n_cmp rows).
    lengths:              int64 [B]           tokens held per sequence (its next position).
    """

    k_sel: torch.Tensor
    v_sel: torch.Tensor
    k_win: torch.Tensor
    v_win: torch.Tensor
    k_cmp_raw: torch.Tensor
    v_cmp_raw: torch.Tensor
    k_cmp: torch.Tensor
    v_cmp: torch.Tensor
    lengths: torch.Tensor

    @property
    def batch(self) -> int:
        return self.k_sel.shape[0]

    @property
    def max_len(self) -> int:
        return self.k_sel.shape[1]


def init_cache(cfg: NSAConfig, batch: int, max_len: int, dtype: torch.dtype = torch.float32,
               device=None) -> NSACache:
    """An empty cache for `batch` sequences of up to `max_len` tokens each."""
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
        lengths=torch.zeros(batch, dtype=torch.long, device=device),
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


def _check_room(cache: NSACache, new: Sequence[int], what: str) -> None:
    for b, (held, n) in enumerate(zip(cache.lengths.tolist(), new)):
        if held + n > cache.max_len:
            raise ValueError(f"cache is full for sequence {b}: {what} adds {n} token(s) to its "
                             f"{held}, over max_len {cache.max_len}")


@torch.no_grad()
def prefill(module: NSAAttention, x: torch.Tensor, cache: NSACache, lengths=None,
            block_idx: Optional[torch.Tensor] = None, return_aux: bool = False):
    """Append a chunk of tokens to each sequence and attend (prompt or continuation).

    x: [B, T, d_model]; row b holds `lengths[b]` new tokens (ints [B], default T; the rest is
    padding) at positions cache.lengths[b]... Returns (y [B, T, d_model], cache), y 0 at padding.
    block_idx: int [B, T, G, n_sel] selection blocks for the new tokens instead of their own
    selection (the parity report's shared selection); None selects as usual.
    return_aux: also return dict(block_idx int32 [B, T, G, n_sel]), -1 at padding.
    """
    _check_step_input(module, x, cache, "x")
    B, T = x.shape[:2]
    new = [T] * B if lengths is None else [int(n) for n in torch.as_tensor(lengths).tolist()]
    if len(new) != B or any(n < 0 or n > T for n in new):
        raise ValueError(f"lengths ({new}) must hold B = {B} entries in [0, T = {T}]")
    _check_room(cache, new, "prefill")
    if block_idx is not None:
        block_idx = check_block_idx(block_idx, (B, T), module.cfg.n_kv_heads, module.cfg)
    y = torch.zeros_like(x)
    cfg = module.cfg
    chosen = torch.full((B, T, cfg.n_kv_heads, cfg.n_sel), -1, dtype=torch.int32,
                        device=x.device)
    params = module.param_tree()
    for b, n in enumerate(new):
        forced = None if block_idx is None else block_idx[b:b + 1]
        if n and int(cache.lengths[b]) == 0:
            y[b:b + 1, :n], chosen[b:b + 1, :n] = _prefill_row(
                module, params, x[b:b + 1, :n], cache, b, None if forced is None else forced[:, :n])
        else:
            for i in range(n):
                y_i, _, aux = _step_row(module.cfg, params, x[b:b + 1, i:i + 1], cache, b,
                                        None if forced is None else forced[:, i:i + 1])
                chosen[b:b + 1, i:i + 1] = aux["block_idx"]
                y[b:b + 1, i:i + 1] = y_i
    return (y, cache, {"block_idx": chosen}) if return_aux else (y, cache)


def _prefill_row(module: NSAAttention, params, x: torch.Tensor, cache: NSACache, b: int,
                 block_idx: Optional[torch.Tensor] = None):
    """The layer over sequence b's first tokens x [1, T, d_model], written into its rows.
    -> (y [1, T, d_model], block_idx [1, T, G, n_sel])."""
    cfg = module.cfg
    T = x.shape[1]
    y, aux, kv = nsa_forward(params, x, cfg, dispatch.resolve_all(module.backends), block_idx)
    k, v = kv["k"], kv["v"]
    cache.k_sel[b, :T] = k["sel"][0]
    cache.v_sel[b, :T] = v["sel"][0]
    for ring_k, ring_v, branch, size in ((cache.k_win, cache.v_win, "win", cfg.window),
                                         (cache.k_cmp_raw, cache.v_cmp_raw, "cmp", cfg.cmp_block)):
        recent = torch.arange(max(0, T - size), T, device=x.device)
        ring_k[b, recent % size] = k[branch][0, recent]
        ring_v[b, recent % size] = v[branch][0, recent]
    n_cmp = kv["k_cmp"].shape[1]
    cache.k_cmp[b, :n_cmp] = kv["k_cmp"][0]
    cache.v_cmp[b, :n_cmp] = kv["v_cmp"][0]
    cache.lengths[b] = T
    return y, aux["block_idx"]


@torch.no_grad()
def decode_step(module: NSAAttention, x_t: torch.Tensor, cache: NSACache,
                return_aux: bool = False, block_idx: Optional[torch.Tensor] = None):
    """Append one token per sequence, at its own position t_b = cache.lengths[b], and attend.

    x_t: [B, 1, d_model]. Returns (y_t [B, 1, d_model], cache, reads) and, with `return_aux`,
    a 4th item: dict(o_cmp, o_sel, o_win [B, 1, H, d_v], gates [B, 1, H, 3],
    block_idx int32 [B, 1, G, n_sel]).

    reads (tokens whose K and V this step loads, per KV head; int64 tensors): `cmp` compressed
    blocks available and `win` = min(w, t + 1) ([B]); `sel` the tokens <= t of the valid
    selected blocks and `total` = cmp + sel + win ([B, G], as each sequence and KV head selects
    its own blocks); `bound` = nsa_common.decode_read_bound(cfg, t) ([B]).
    block_idx: int [B, 1, G, n_sel] selection blocks instead of the step's own selection (the
    parity report's shared selection); None selects as usual.
    """
    _check_step_input(module, x_t, cache, "x_t", n_tokens=1)
    _check_room(cache, [1] * cache.batch, "decode_step")
    if block_idx is not None:
        block_idx = check_block_idx(block_idx, (cache.batch, 1), module.cfg.n_kv_heads,
                                    module.cfg)
    params = module.param_tree()
    rows = [_step_row(module.cfg, params, x_t[b:b + 1], cache, b,
                      None if block_idx is None else block_idx[b:b + 1])
            for b in range(cache.batch)]
    y = torch.cat([row[0] for row in rows])
    reads = {key: torch.cat([row[1][key] for row in rows]) for key in rows[0][1]}
    if return_aux:
        aux = {key: torch.cat([row[2][key] for row in rows]) for key in rows[0][2]}
        return y, cache, reads, aux
    return y, cache, reads


def _step_row(cfg: NSAConfig, params, x_t: torch.Tensor, cache: NSACache, b: int,
              block_idx: Optional[torch.Tensor] = None):
    """Append sequence b's token x_t [1, 1, d_model] at t = cache.lengths[b] and attend.
    -> (y [1, 1, d_model], reads of this row ([1] / [1, G]), aux of this row)."""
    t = int(cache.lengths[b])
    device = x_t.device
    q_pos = torch.tensor([t], device=device)
    q, k, v = project(params, x_t, cfg, q_pos)

    cache.k_sel[b, t] = k["sel"][0, 0]
    cache.v_sel[b, t] = v["sel"][0, 0]
    cache.k_win[b, t % cfg.window] = k["win"][0, 0]
    cache.v_win[b, t % cfg.window] = v["win"][0, 0]
    cache.k_cmp_raw[b, t % cfg.cmp_block] = k["cmp"][0, 0]
    cache.v_cmp_raw[b, t % cfg.cmp_block] = v["cmp"][0, 0]
    if completes_cmp_block(t, cfg.cmp_block, cfg.cmp_stride):
        # Tokens t-l+1 .. t, oldest first, from the ring: the block of compressed index i.
        order = torch.arange(t - cfg.cmp_block + 1, t + 1, device=device) % cfg.cmp_block
        k_block, v_block = compress_branch_kv(params, cache.k_cmp_raw[b:b + 1, order],
                                              cache.v_cmp_raw[b:b + 1, order], cfg)
        i = completed_cmp_block(t, cfg.cmp_block, cfg.cmp_stride)
        cache.k_cmp[b, i] = k_block[0, 0]
        cache.v_cmp[b, i] = v_block[0, 0]
    cache.lengths[b] = t + 1

    row = slice(b, b + 1)
    scale = _resolve_scale(None, cfg.d_k)
    n_cmp = num_cmp_blocks(cfg, t + 1)
    o_cmp, p_cmp, _ = _compressed_rows(q, cache.k_cmp[row, :n_cmp], cache.v_cmp[row, :n_cmp],
                                       q_pos, cfg, scale)
    if block_idx is None:
        block_idx = _select_rows(p_cmp, q_pos, cfg, num_sel_blocks(cfg, t + 1))
    else:
        block_idx = block_idx.to(device=device, dtype=torch.int32)
    acc = _acc_dtype(q.dtype)
    o_sel = _selected_rows(q, cache.k_sel[row, :t + 1].to(acc), cache.v_sel[row, :t + 1].to(acc),
                           block_idx, cfg.sel_block, q_pos, scale)
    n_win = min(cfg.window, t + 1)
    slot = torch.arange(n_win, device=device)
    slot_pos = t - (t - slot) % cfg.window  # the position held by each ring slot
    o_win = _window_rows(q, cache.k_win[row, :n_win], cache.v_win[row, :n_win], q_pos,
                         slot_pos, cfg.window, scale)
    o_cmp, o_sel, o_win = (o.to(x_t.dtype) for o in (o_cmp, o_sel, o_win))
    y, gates = combine(params, x_t, o_cmp, o_sel, o_win, cfg)

    starts = block_idx[:, 0].long() * cfg.sel_block  # [1, G, n_sel]
    sel_tokens = torch.where(block_idx[:, 0] >= 0,
                             (t + 1 - starts).clamp(min=0, max=cfg.sel_block), 0).sum(-1)
    per_row = lambda value: torch.tensor([value], dtype=torch.long, device=device)  # noqa: E731
    n_win_reads = min(cfg.window, t + 1)
    reads = dict(cmp=per_row(n_cmp), sel=sel_tokens, win=per_row(n_win_reads),
                 total=n_cmp + sel_tokens + n_win_reads, bound=per_row(decode_read_bound(cfg, t)))
    aux = dict(o_cmp=o_cmp, o_sel=o_sel, o_win=o_win, gates=gates, block_idx=block_idx)
    return y, reads, aux
