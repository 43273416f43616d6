"""Brute-force NSA in NumPy float64 with explicit dense masks: the independent reference of the tests.

Written straight from docs/NSA_SPEC.md, loop by loop where that is clearer than speed. It shares
nothing with `nsa_torch_ref` or `nsa_jax` except `nsa_common` (config and the overlap matrix,
which has its own test). Arrays are NumPy, layout BTHD; every result is float64.
"""
from __future__ import annotations

import math

import numpy as np

from nsa_common import NSAConfig, num_cmp_blocks, num_sel_blocks, overlap_weights

BRANCHES = ("cmp", "sel", "win")


def _f64(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


def _scale(q, scale):
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


def _masked_attention(q, k, v, mask, scale):
    """q [B,T,H,dk], k [B,S,G,dk], v [B,S,G,dv], mask bool [B,T,H,S] -> (o [B,T,H,dv], p [B,T,H,S]).

    Rows without any allowed key get p = 0 and o = 0."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    if k.shape[1] == 0:  # no keys at all (no compressed block yet): every row is empty
        return np.zeros(q.shape[:3] + (v.shape[-1],)), np.zeros(q.shape[:3] + (0,))
    h = q.shape[2] // k.shape[2]
    k = np.repeat(k, h, axis=2)
    v = np.repeat(v, h, axis=2)
    s = np.einsum("bthd,bshd->bths", q, k) * scale
    s = np.where(mask, s, -np.inf)
    row_max = s.max(axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    e = np.where(mask, np.exp(s - row_max), 0.0)
    denom = e.sum(axis=-1, keepdims=True)
    p = np.where(denom > 0, e / np.where(denom > 0, denom, 1.0), 0.0)
    return np.einsum("bths,bshd->bthd", p, v), p


def bf_rope(x, positions, theta: float) -> np.ndarray:
    """Rotate-half RoPE over the whole head dim. x [B,T,n,D], positions [T] or [B,T]."""
    x = _f64(x)
    half = x.shape[-1] // 2
    pos = np.broadcast_to(np.asarray(positions, np.float64), x.shape[:2])
    inv_freq = theta ** (-2.0 * np.arange(half) / x.shape[-1])
    angle = pos[:, :, None, None] * inv_freq
    cos, sin = np.cos(angle), np.sin(angle)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _gelu(x):
    erf = np.vectorize(math.erf)
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def bf_compress(k, cmp_params, cfg: NSAConfig) -> np.ndarray:
    """k [B,T,G,D] -> [B,C,G,D]; block i covers tokens [i*d, i*d + l). `cmp_params` None = mean."""
    k = _f64(k)
    B, T, G, D = k.shape
    l, d = cfg.cmp_block, cfg.cmp_stride
    n_blocks = num_cmp_blocks(cfg, T)
    out = np.zeros((B, n_blocks, G, D))
    for i in range(n_blocks):
        block = k[:, i * d: i * d + l]  # [B, l, G, D]
        if cmp_params is None:
            out[:, i] = block.mean(axis=1)
            continue
        for g in range(G):
            flat = (block[:, :, g] + _f64(cmp_params["pos"][g])).reshape(B, l * D)
            hidden = _gelu(flat @ _f64(cmp_params["w1"][g]) + _f64(cmp_params["b1"][g]))
            out[:, i, g] = hidden @ _f64(cmp_params["w2"][g]) + _f64(cmp_params["b2"][g])
    return out


def cmp_mask(cfg: NSAConfig, T: int, n_blocks: int) -> np.ndarray:
    """[T, C] bool: query t sees compressed block i iff i*d + l - 1 <= t."""
    t = np.arange(T)[:, None]
    i = np.arange(n_blocks)[None, :]
    return i * cfg.cmp_stride + cfg.cmp_block - 1 <= t


def bf_compressed_attention(q, k_cmp, v_cmp, cfg: NSAConfig, scale=None):
    """-> (o_cmp [B,T,H,dv], p_cmp [B,T,H,C]); rows with no admissible block are zero."""
    B, T, H, _ = q.shape
    mask = np.broadcast_to(cmp_mask(cfg, T, k_cmp.shape[1])[None, :, None, :],
                           (B, T, H, k_cmp.shape[1]))
    return _masked_attention(q, k_cmp, v_cmp, mask, _scale(q, scale))


def bf_select_blocks(q, k_cmp, cfg: NSAConfig, scale=None) -> np.ndarray:
    """-> block_idx int32 [B,T,G,n_sel], ascending, -1 padded (spec step 6)."""
    B, T, H, _ = q.shape
    G = k_cmp.shape[2]
    h = H // G
    _, p_cmp = bf_compressed_attention(q, k_cmp, k_cmp[..., :1], cfg, scale)
    n_sel_blocks = num_sel_blocks(cfg, T)
    p_sel = p_cmp @ overlap_weights(cfg, k_cmp.shape[1], n_sel_blocks).astype(np.float64)
    group_score = p_sel.reshape(B, T, G, h, n_sel_blocks).sum(axis=3)
    block_idx = np.full((B, T, G, cfg.n_sel), -1, dtype=np.int32)
    for b in range(B):
        for t in range(T):
            last = t // cfg.sel_block
            forced = set(range(min(cfg.n_init, last + 1)))
            forced |= set(range(max(0, last - cfg.n_local + 1), last + 1))
            for g in range(G):
                score = [math.inf if j in forced else group_score[b, t, g, j]
                         for j in range(last + 1)]
                chosen = bf_top_n(score, cfg.n_sel)
                block_idx[b, t, g, : len(chosen)] = chosen
    return block_idx


def bf_top_n(score, n_sel: int) -> list:
    """The `n_sel` best indices of the scores `score[j]` (higher first, the lower index on
    equal scores; -inf and NaN never), ascending (spec step 6's ranking)."""
    eligible = [j for j in range(len(score)) if score[j] > -math.inf]
    return sorted(sorted(eligible, key=lambda j: (-score[j], j))[:n_sel])


def bf_selected_attention(q, k, v, block_idx, block_size: int, scale=None) -> np.ndarray:
    """Query t, group g attends the tokens of blocks block_idx[b,t,g] (not -1) that are <= t."""
    B, T, H, _ = q.shape
    S, G = k.shape[1], k.shape[2]
    h = H // G
    block_idx = np.asarray(block_idx)
    mask = np.zeros((B, T, G, S), dtype=bool)
    key_block = np.arange(S) // block_size
    for b in range(B):
        for t in range(T):
            for g in range(G):
                chosen = block_idx[b, t, g]
                chosen = chosen[chosen >= 0]
                mask[b, t, g] = np.isin(key_block, chosen) & (np.arange(S) <= t)
    mask = np.repeat(mask, h, axis=2)
    return _masked_attention(q, k, v, mask, _scale(q, scale))[0]


def bf_sliding_window_attention(q, k, v, window: int, scale=None) -> np.ndarray:
    """Query t attends keys max(0, t - w + 1) .. t."""
    B, T, H, _ = q.shape
    t = np.arange(T)[:, None]
    s = np.arange(k.shape[1])[None, :]
    mask = (s <= t) & (s > t - window)
    mask = np.broadcast_to(mask[None, :, None, :], (B, T, H, k.shape[1]))
    return _masked_attention(q, k, v, mask, _scale(q, scale))[0]


def nest_params(params) -> dict:
    """Accept a nested dict (JAX pytree) or a flat dotted dict (torch state_dict) of arrays."""
    nested: dict = {}
    for key, value in params.items():
        if isinstance(value, dict):
            nested[key] = {sub: np.asarray(v) for sub, v in value.items()}
        elif "." in key:
            outer, inner = key.split(".", 1)
            nested.setdefault(outer, {})[inner] = np.asarray(value)
        else:
            nested[key] = np.asarray(value)
    return nested


def bf_nsa_layer(params, x, cfg: NSAConfig, cu_seqlens=None):
    """The whole layer. x [B,T,d_model] -> (y [B,T,d_model], aux dict of o_cmp/o_sel/o_win/gates/block_idx)."""
    params = nest_params(params)
    x = _f64(x)
    if cu_seqlens is not None:
        parts = [bf_nsa_layer(params, x[:, s:e], cfg) for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:])]
        y = np.concatenate([p[0] for p in parts], axis=1)
        aux = {name: np.concatenate([p[1][name] for p in parts], axis=1) for name in parts[0][1]}
        return y, aux
    B, T, _ = x.shape
    H, G = cfg.n_heads, cfg.n_kv_heads
    q = (x @ _f64(params["wq"])).reshape(B, T, H, cfg.d_k)
    keys, values = {}, {}
    for c in BRANCHES:
        name = "shared" if cfg.shared_kv else c
        keys[c] = (x @ _f64(params["wk"][name])).reshape(B, T, G, cfg.d_k)
        values[c] = (x @ _f64(params["wv"][name])).reshape(B, T, G, cfg.d_v)
    if cfg.rope_theta is not None:
        q = bf_rope(q, np.arange(T), cfg.rope_theta)
        keys = {c: bf_rope(k, np.arange(T), cfg.rope_theta) for c, k in keys.items()}
    mlp = cfg.compress == "mlp"
    k_cmp = bf_compress(keys["cmp"], params["cmp_k"] if mlp else None, cfg)
    v_cmp = bf_compress(values["cmp"], params["cmp_v"] if mlp else None, cfg)
    o_cmp, _ = bf_compressed_attention(q, k_cmp, v_cmp, cfg)
    block_idx = bf_select_blocks(q, k_cmp, cfg)
    o_sel = bf_selected_attention(q, keys["sel"], values["sel"], block_idx, cfg.sel_block)
    o_win = bf_sliding_window_attention(q, keys["win"], values["win"], cfg.window)
    gates = 1.0 / (1.0 + np.exp(-(x @ _f64(params["wg"]) + _f64(params["bg"]))))
    gates = gates.reshape(B, T, H, 3)
    o = gates[..., 0:1] * o_cmp + gates[..., 1:2] * o_sel + gates[..., 2:3] * o_win
    y = o.reshape(B, T, H * cfg.d_v) @ _f64(params["wo"])
    aux = dict(o_cmp=o_cmp, o_sel=o_sel, o_win=o_win, gates=gates, block_idx=block_idx)
    return y, aux
