"""`NSAAttention`: the NSA layer (docs/NSA_SPEC.md, "The layer") as a thin `nn.Module`.

The work is done by functions on a parameter tree (`params["wk"]["cmp"]`, the same nesting as
the JAX pytree; `nest_params` / `flatten_params` convert from / to the module's dotted names):
`project`, `compress_branch_kv`, `native_sparse_attention` (the attention core on projected
tensors, as `nsa_jax.native_sparse_attention`), `combine` and `nsa_forward`. The module holds the
parameters, validates its inputs and loops over packed sequences; every piece of work between the
projections and the gates (compression, selection, the three branches) runs through `dispatch`.
`decode.py` reuses `project`, `compress_branch_kv` and `combine`.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Optional

import torch
from torch import nn

from nsa_common import NSAConfig
from nsa_torch_ref import dispatch
from nsa_torch_ref.reference import apply_rope, check_cu_seqlens

KV_BRANCHES = ("cmp", "sel", "win")
AUX_KEYS = ("o_cmp", "o_sel", "o_win", "gates", "block_idx")

Params = Mapping[str, Any]  # {"wq": T, "wk": {"cmp": T, ...}, "cmp_k": {"pos": T, ...}, ...}


def nest_params(flat: Mapping[str, Any]) -> dict:
    """{"wq": T, "wk.cmp": T, ...} (`named_parameters` names) -> {"wq": T, "wk": {"cmp": T}, ...}."""
    nested: dict = {}
    for name, value in flat.items():
        outer, _, inner = name.partition(".")
        if inner:
            nested.setdefault(outer, {})[inner] = value
        else:
            nested[outer] = value
    return nested


def flatten_params(nested: Mapping[str, Any]) -> dict:
    """The inverse of `nest_params`: {"wk": {"cmp": T}, ...} -> {"wk.cmp": T, ...}."""
    flat = {}
    for outer, value in nested.items():
        if isinstance(value, Mapping):
            for inner, leaf in value.items():
                flat[f"{outer}.{inner}"] = leaf
        else:
            flat[outer] = value
    return flat


# ---------------------------------------------------------------------------------------------
# Functional core
# ---------------------------------------------------------------------------------------------
def project(params: Params, x: torch.Tensor, cfg: NSAConfig, positions: torch.Tensor):
    """Projections and RoPE (spec steps 1-3).

    x: [B, T, d_model]; positions: [T] (RoPE angles). Returns q [B, T, H, d_k] and dicts
    k {branch: [B, T, G, d_k]}, v {branch: [B, T, G, d_v]} over the branches cmp, sel, win
    (the same tensors for all three when cfg.shared_kv).
    """
    B, T, _ = x.shape
    H, G = cfg.n_heads, cfg.n_kv_heads
    q = (x @ params["wq"]).reshape(B, T, H, cfg.d_k)
    sources = {c: "shared" if cfg.shared_kv else c for c in KV_BRANCHES}
    k_src = {s: (x @ params["wk"][s]).reshape(B, T, G, cfg.d_k) for s in set(sources.values())}
    v_src = {s: (x @ params["wv"][s]).reshape(B, T, G, cfg.d_v) for s in set(sources.values())}
    if cfg.rope_theta is not None:
        q = apply_rope(q, positions, cfg.rope_theta)
        k_src = {s: apply_rope(k, positions, cfg.rope_theta) for s, k in k_src.items()}
    k = {c: k_src[sources[c]] for c in KV_BRANCHES}
    v = {c: v_src[sources[c]] for c in KV_BRANCHES}
    return q, k, v


def compress_branch_kv(params: Params, k: torch.Tensor, v: torch.Tensor, cfg: NSAConfig,
                       kernels: Optional[Mapping[str, Callable]] = None):
    """Compressed keys/values of the cmp branch (spec step 4): [B, T, G, d] -> [B, C, G, d].

    params: holds `cmp_k` / `cmp_v` with compress="mlp" (any mapping, e.g. the core's
    `cmp_params`); kernels: as from `dispatch.resolve_all` (default: all "sdpa")."""
    compress = (kernels or dispatch.resolve_all())["compress_kv"]
    mlp = cfg.compress == "mlp"
    return (compress(k, params["cmp_k"] if mlp else None, cfg),
            compress(v, params["cmp_v"] if mlp else None, cfg))


def gate_sum(gates: torch.Tensor, o_cmp: torch.Tensor, o_sel: torch.Tensor,
             o_win: torch.Tensor) -> torch.Tensor:
    """sum_c gates[..., c] * o_c (spec step 9); gates [B, T, H, 3], o_* [B, T, H, d_v]. The
    `c:c+1` slices broadcast the same way for T = 1 (decode)."""
    return gates[..., 0:1] * o_cmp + gates[..., 1:2] * o_sel + gates[..., 2:3] * o_win


def native_sparse_attention(q: torch.Tensor, k, v, gates: torch.Tensor, cfg: NSAConfig, *,
                            cmp_params: Optional[Params] = None, gates_are_logits: bool = False,
                            kernels: Optional[Mapping[str, Callable]] = None,
                            block_idx: Optional[torch.Tensor] = None, return_aux: bool = False):
    """NSA attention on projected (and already RoPE'd) tensors: `o = sum_c gates[..., c] * o_c`
    (spec steps 4-9; the counterpart of `nsa_jax.native_sparse_attention`, one unpacked problem
    at positions 0..T-1).

    q: [B, T, H, d_k]; k, v: [B, T, G, d_k] / [B, T, G, d_v] shared by the branches, or dicts
    {"cmp", "sel", "win"} of such tensors; gates: [B, T, H, 3] (cmp, sel, win) in [0, 1], or
    logits with `gates_are_logits`; cmp_params: {"cmp_k": {...}, "cmp_v": {...}} with
    compress="mlp"; kernels: as from `dispatch.resolve_all` (default: all "sdpa");
    block_idx: int [B, T, G, n_sel] selection blocks to use instead of the selection's own
    (ascending, -1 padded, as `select_blocks` returns them): the parity report forces both
    frameworks onto one selection this way.
    -> o [B, T, H, d_v] (and, with return_aux, dict(o_cmp, o_sel, o_win, gates, block_idx,
    k_cmp, v_cmp)).
    """
    kernels = kernels if kernels is not None else dispatch.resolve_all()
    k = k if isinstance(k, Mapping) else {c: k for c in KV_BRANCHES}
    v = v if isinstance(v, Mapping) else {c: v for c in KV_BRANCHES}
    if cfg.compress == "mlp" and cmp_params is None:
        raise ValueError('cmp_params ({"cmp_k": ..., "cmp_v": ...}) is needed with '
                         'compress="mlp"')
    k_cmp, v_cmp = compress_branch_kv(cmp_params or {}, k["cmp"], v["cmp"], cfg, kernels)
    o_cmp = kernels["compressed_attention"](q, k_cmp, v_cmp, cfg)
    if block_idx is None:
        block_idx = kernels["select_blocks"](q, k_cmp, cfg)
    else:
        block_idx = check_block_idx(block_idx, q.shape[:2], k_cmp.shape[2], cfg).to(q.device)
    o_sel = kernels["selected_attention"](q, k["sel"], v["sel"], block_idx, cfg.sel_block)
    o_win = kernels["sliding_window_attention"](q, k["win"], v["win"], cfg.window)
    gates = torch.sigmoid(gates) if gates_are_logits else gates
    o = gate_sum(gates, o_cmp, o_sel, o_win)
    if not return_aux:
        return o
    return o, dict(o_cmp=o_cmp, o_sel=o_sel, o_win=o_win, gates=gates, block_idx=block_idx,
                   k_cmp=k_cmp, v_cmp=v_cmp)


def check_block_idx(block_idx, rows: tuple[int, int], n_kv_heads: int,
                    cfg: NSAConfig) -> torch.Tensor:
    """A given `block_idx` as int32 after a ValueError check of its shape and values; rows is
    (B, T) of the queries."""
    if not isinstance(block_idx, torch.Tensor) or block_idx.is_floating_point():
        raise ValueError("block_idx must be an integer tensor [B, T, G, n_sel]")
    expected = (*rows, n_kv_heads, cfg.n_sel)
    if tuple(block_idx.shape) != expected:
        raise ValueError(f"block_idx has shape {tuple(block_idx.shape)}, expected {expected} "
                         f"[B, T, G, n_sel]")
    if block_idx.numel() and int(block_idx.min()) < -1:
        raise ValueError(f"block_idx holds {int(block_idx.min())}; entries are block indices "
                         f"or -1 (none)")
    return block_idx.to(torch.int32)


def combine(params: Params, x: torch.Tensor, o_cmp: torch.Tensor, o_sel: torch.Tensor,
            o_win: torch.Tensor, cfg: NSAConfig):
    """Gates and output projection (spec steps 9-10).

    x: [B, T, d_model]; o_*: [B, T, H, d_v]. Returns y [B, T, d_model] and gates [B, T, H, 3]
    (cmp, sel, win).
    """
    gates = gate_values(params, x, cfg)
    return output(params, gate_sum(gates, o_cmp, o_sel, o_win), cfg), gates


def gate_values(params: Params, x: torch.Tensor, cfg: NSAConfig) -> torch.Tensor:
    """The gates (spec step 9): x [B, T, d_model] -> [B, T, H, 3] in [0, 1] (cmp, sel, win)."""
    B, T, _ = x.shape
    logits = x @ params["wg"]
    # In float32 (as the JAX layer): the bias's gradient sums B*T cotangents.
    acc = torch.promote_types(logits.dtype, torch.float32)
    gates = torch.sigmoid(logits.to(acc) + params["bg"].to(acc)).to(logits.dtype)
    return gates.reshape(B, T, cfg.n_heads, 3)


def output(params: Params, o: torch.Tensor, cfg: NSAConfig) -> torch.Tensor:
    """The output projection (spec step 10): o [B, T, H, d_v] -> [B, T, d_model]."""
    B, T = o.shape[:2]
    return o.reshape(B, T, cfg.n_heads * cfg.d_v) @ params["wo"]


def nsa_forward(params: Params, x: torch.Tensor, cfg: NSAConfig,
                kernels: Optional[Mapping[str, Callable]] = None,
                block_idx: Optional[torch.Tensor] = None):
    """One (unpacked) NSA problem: x [B, T, d_model] at positions 0..T-1.

    kernels: {branch: function} as from `dispatch.resolve_all` (default: all "sdpa");
    block_idx: as in `native_sparse_attention` (None: the layer's own selection).
    Returns (y [B, T, d_model], aux, kv): aux holds o_cmp / o_sel / o_win [B, T, H, d_v],
    gates [B, T, H, 3] and block_idx int32 [B, T, G, n_sel]; kv holds what a decode cache needs
    (k, v dicts per branch [B, T, G, d] and k_cmp, v_cmp [B, C, G, d]).
    """
    positions = torch.arange(x.shape[1], device=x.device)
    q, k, v = project(params, x, cfg, positions)
    o, core = native_sparse_attention(q, k, v, gate_values(params, x, cfg), cfg,
                                      cmp_params=params, kernels=kernels, block_idx=block_idx,
                                      return_aux=True)
    aux = {key: core[key] for key in AUX_KEYS}
    kv = dict(k=k, v=v, k_cmp=core["k_cmp"], v_cmp=core["v_cmp"])
    return output(params, o, cfg), aux, kv


# ---------------------------------------------------------------------------------------------
# Module
# ---------------------------------------------------------------------------------------------
def _normal(shape, std: float, **factory) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape, **factory) * std)


def _compressor(cfg: NSAConfig, dim: int, **factory) -> nn.ParameterDict:
    """The per-KV-head MLP phi of spec step 4 for head dim `dim`."""
    G, l = cfg.n_kv_heads, cfg.cmp_block
    return nn.ParameterDict({
        "pos": _normal((G, l, dim), 0.02, **factory),
        "w1": _normal((G, l * dim, dim), 1 / math.sqrt(l * dim), **factory),
        "b1": nn.Parameter(torch.zeros(G, dim, **factory)),
        "w2": _normal((G, dim, dim), 1 / math.sqrt(dim), **factory),
        "b2": nn.Parameter(torch.zeros(G, dim, **factory)),
    })


class NSAAttention(nn.Module):
    """Native Sparse Attention layer.

    Parameters (docs/DESIGN.md; matrices are `[in, out]`): `wq [d_model, H*d_k]`,
    `wk.{cmp,sel,win}` `[d_model, G*d_k]` (`wk.shared` with shared_kv), `wv.*` `[d_model, G*d_v]`,
    `cmp_k.{pos,w1,b1,w2,b2}` / `cmp_v.*` (compress="mlp" only), `wg [d_model, H*3]`, `bg [H*3]`,
    `wo [H*d_v, d_model]`.

    backends: {branch: backend} for the branches (and stages) of `dispatch.ENTRIES`, a backend
    being one name or names tried in order (`("triton", "sdpa")`); default "sdpa".
    """

    def __init__(self, cfg: NSAConfig, backends: Optional[Mapping[str, str]] = None, *,
                 device=None, dtype=None):
        super().__init__()
        if not isinstance(cfg, NSAConfig):
            raise ValueError(f"cfg must be an NSAConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        dispatch.resolve_all(backends)  # unknown branch or backend fails here, not mid-forward
        self.backends = {b: dispatch.backend_names(b, dict(backends or {}).get(
            b, dispatch.DEFAULT_BACKEND)) for b in dispatch.ENTRIES}
        factory = dict(device=device, dtype=dtype)
        D, H, G = cfg.d_model, cfg.n_heads, cfg.n_kv_heads
        kv_names = ("shared",) if cfg.shared_kv else KV_BRANCHES
        self.wq = _normal((D, H * cfg.d_k), 1 / math.sqrt(D), **factory)
        self.wk = nn.ParameterDict({n: _normal((D, G * cfg.d_k), 1 / math.sqrt(D), **factory)
                                    for n in kv_names})
        self.wv = nn.ParameterDict({n: _normal((D, G * cfg.d_v), 1 / math.sqrt(D), **factory)
                                    for n in kv_names})
        if cfg.compress == "mlp":
            self.cmp_k = _compressor(cfg, cfg.d_k, **factory)
            self.cmp_v = _compressor(cfg, cfg.d_v, **factory)
        self.wg = _normal((D, H * 3), 1 / math.sqrt(D), **factory)
        self.bg = nn.Parameter(torch.zeros(H * 3, **factory))
        self.wo = _normal((H * cfg.d_v, D), 1 / math.sqrt(H * cfg.d_v), **factory)

    def param_tree(self) -> dict:
        """The parameters nested as the JAX pytree: {"wq": T, "wk": {"cmp": T, ...}, ...}."""
        return nest_params(dict(self.named_parameters()))

    def _check_inputs(self, x: torch.Tensor,
                      cu_seqlens: Optional[torch.Tensor]) -> Optional[list[int]]:
        """ValueError on a bad input; the packed sequences' bounds (None without cu_seqlens)."""
        cfg = self.cfg
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != cfg.d_model:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must be a [B, T, d_model={cfg.d_model}] tensor, got {shape}")
        if x.shape[1] == 0:
            raise ValueError("x must hold at least one token (T >= 1)")
        # Caught here rather than as a dtype mismatch deep inside the first projection.
        if not x.is_floating_point():
            raise ValueError(f"x must be a floating-point tensor, got {x.dtype}")
        # Under autocast the matmuls cast both sides, so mixed dtypes are the normal case there.
        if x.dtype != self.wq.dtype and not torch.is_autocast_enabled(x.device.type):
            raise ValueError(f"x has dtype {x.dtype} but the layer's parameters are "
                             f"{self.wq.dtype} (convert one of them, e.g. layer.to(x.dtype))")
        if cu_seqlens is None:
            return None
        return check_cu_seqlens(cu_seqlens, x.shape[0], x.shape[1], require_int32=True)

    def forward(self, x: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None,
                return_aux: bool = False, block_idx: Optional[torch.Tensor] = None):
        """x: [B, T, d_model] -> y [B, T, d_model] (and aux with return_aux).

        cu_seqlens: int32 [N + 1] with B = 1 packs N independent sequences (positions, blocks
        and windows restart at each start). aux: o_cmp, o_sel, o_win [B, T, H, d_v],
        gates [B, T, H, 3], block_idx int32 [B, T, G, n_sel].
        block_idx: int [B, T, G, n_sel] selection blocks used instead of the layer's own
        selection (the parity report's shared selection; local block indices per packed
        sequence). Equal to the layer's own, it changes nothing.
        """
        bounds = self._check_inputs(x, cu_seqlens)
        params = self.param_tree()
        kernels = dispatch.resolve_all(self.backends)
        if bounds is None:
            y, aux, _ = nsa_forward(params, x, self.cfg, kernels, block_idx)
        else:
            parts = [nsa_forward(params, x[:, start:stop], self.cfg, kernels,
                                 None if block_idx is None else block_idx[:, start:stop])[:2]
                     for start, stop in zip(bounds[:-1], bounds[1:]) if stop > start]
            y = torch.cat([part[0] for part in parts], dim=1)
            aux = {key: torch.cat([part[1][key] for part in parts], dim=1) for key in AUX_KEYS}
        return (y, aux) if return_aux else y

    def extra_repr(self) -> str:
        return f"cfg={self.cfg}, backends={self.backends}"
