"""Decode: `init_cache`, `prefill`, `decode_step` as pure functions on a fixed-shape cache.

Every array of the cache has a shape fixed by `(cfg, batch, max_len, dtype)` and the position is
a traced int32 scalar, so a jitted `decode_step` compiles once for a whole generation. The
branch math is the XLA path's own chunk functions called with one query, so a decode step
computes what a prefill over tokens `0..t` computes at position t.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from nsa_common import NSAConfig, num_cmp_blocks, num_sel_blocks, overlap_weights
from nsa_jax import checks, dispatch
from nsa_jax.layer import check_layer_inputs, combine, forward_unchecked, project
from nsa_jax.xla.common import einsum, merge_heads
from nsa_jax.xla.compress import compress_blocks
from nsa_jax.xla.compressed_attention import cmp_probabilities
from nsa_jax.xla.select_blocks import band_scores, sel_scores, top_blocks
from nsa_jax.xla.selected_attention import selected_chunk
from nsa_jax.xla.sliding_window import window_chunk


class DecodeCache(NamedTuple):
    """Per-layer decode state (a pytree). `d` is d_k for keys and d_v for values.

    k_sel, v_sel: `[B, max_len, G, d]` every past token (selected branch).
    k_win, v_win: `[B, W, G, d]` ring buffer of the last `W = min(w, max_len)` tokens; token s
        sits in slot `s % W`.
    k_raw, v_raw: `[B, l, G, d]` ring buffer of the last `l` RoPE'd cmp-branch tokens, the
        input of the next compressed block; token s sits in slot `s % l`.
    k_cmp, v_cmp: `[B, C_max, G, d]` compressed blocks emitted so far, in block order
        (`C_max = max(1, num_cmp_blocks(cfg, max_len))`).
    pos: int32 scalar, the number of tokens seen (the next token's position).
    """

    k_sel: jax.Array
    v_sel: jax.Array
    k_win: jax.Array
    v_win: jax.Array
    k_raw: jax.Array
    v_raw: jax.Array
    k_cmp: jax.Array
    v_cmp: jax.Array
    pos: jax.Array

    @property
    def max_len(self) -> int:
        return self.k_sel.shape[1]


def init_cache(cfg: NSAConfig, batch: int, max_len: int, dtype=jnp.float32) -> DecodeCache:
    """An empty cache for `batch` sequences of up to `max_len` tokens."""
    checks.config(cfg)
    checks.positive_int("batch", batch)
    checks.positive_int("max_len", max_len)
    G, dk, dv = cfg.n_kv_heads, cfg.d_k, cfg.d_v
    ring = min(cfg.window, max_len)
    n_cmp = max(1, num_cmp_blocks(cfg, max_len))

    def zeros(length, dim):
        return jnp.zeros((batch, length, G, dim), dtype)

    return DecodeCache(k_sel=zeros(max_len, dk), v_sel=zeros(max_len, dv),
                       k_win=zeros(ring, dk), v_win=zeros(ring, dv),
                       k_raw=zeros(cfg.cmp_block, dk), v_raw=zeros(cfg.cmp_block, dv),
                       k_cmp=zeros(n_cmp, dk), v_cmp=zeros(n_cmp, dv),
                       pos=jnp.zeros((), jnp.int32))


def _check_cache(cache, cfg: NSAConfig, batch: int) -> None:
    if not isinstance(cache, DecodeCache):
        raise ValueError(f"cache must be a DecodeCache from init_cache, got {type(cache).__name__}")
    expected = init_cache(cfg, batch, cache.max_len, cache.k_sel.dtype)
    for name, want, got in zip(DecodeCache._fields, expected, cache):
        if want.shape != got.shape:
            raise ValueError(f"cache.{name} has shape {got.shape}, expected {want.shape} "
                             f"(cache built for another cfg or batch size?)")


def prefill(params, x: jax.Array, cfg: NSAConfig, cache: DecodeCache, *,
            backend: dispatch.Backend = "xla", options=None, return_aux: bool = False):
    """Run the layer over a prompt x `[B, T, d_model]` and fill an empty cache.

    -> `(y [B, T, d_model], cache)` with `cache.pos = T`, and `aux` (as in `nsa_attention`) last
    when `return_aux`. The cache must be fresh (`pos = 0`) and `T <= max_len`.
    """
    check_layer_inputs(params, x, cfg)
    B, T, _ = x.shape
    _check_cache(cache, cfg, B)
    if T > cache.max_len:
        raise ValueError(f"x has {T} tokens, more than the cache's max_len {cache.max_len}")
    pos = checks.concrete(cache.pos)
    if pos is not None and int(pos) != 0:
        raise ValueError(f"prefill needs a fresh cache (cache.pos = {int(pos)})")
    y, cache, aux = _prefill_jit(params, x, cache, cfg=cfg,
                                 backend=dispatch.static_backend(backend),
                                 options=dispatch.static_options(options))
    chex.assert_shape(y, x.shape)
    return (y, cache, aux) if return_aux else (y, cache)


@functools.partial(jax.jit, static_argnames=("cfg", "backend", "options"))
def _prefill_jit(params, x, cache: DecodeCache, *, cfg: NSAConfig, backend, options):
    T = x.shape[1]
    y, aux, proj, parts = forward_unchecked(params, x, None, cfg=cfg, backend=backend,
                                            options=options, internals=True)

    def ring_fill(buf, values):
        """Write the last buf.shape[1] tokens of values `[B, T, G, d]` at slot token % size."""
        size = buf.shape[1]
        token = np.arange(max(0, T - size), T)
        return buf.at[:, token % size].set(values[:, token].astype(buf.dtype))

    dt = cache.k_sel.dtype
    n_cmp = parts["k_cmp"].shape[1]
    cache = DecodeCache(
        k_sel=cache.k_sel.at[:, :T].set(proj["k_sel"].astype(dt)),
        v_sel=cache.v_sel.at[:, :T].set(proj["v_sel"].astype(dt)),
        k_win=ring_fill(cache.k_win, proj["k_win"]), v_win=ring_fill(cache.v_win, proj["v_win"]),
        k_raw=ring_fill(cache.k_raw, proj["k_cmp"]), v_raw=ring_fill(cache.v_raw, proj["v_cmp"]),
        k_cmp=cache.k_cmp.at[:, :n_cmp].set(parts["k_cmp"].astype(dt)),
        v_cmp=cache.v_cmp.at[:, :n_cmp].set(parts["v_cmp"].astype(dt)),
        pos=jnp.asarray(T, jnp.int32))
    return y, cache, aux


def _ring_write(buf: jax.Array, values: jax.Array, slot) -> jax.Array:
    """buf `[B, S, G, d]`, values `[B, 1, G, d]` -> buf with slot `slot` replaced."""
    return lax.dynamic_update_slice_in_dim(buf, values.astype(buf.dtype), slot, axis=1)


def _emit_block(cmp_buf: jax.Array, raw: jax.Array, cmp_params, cfg: NSAConfig, t, emit):
    """Compress the ring `raw [B, l, G, d]` (tokens t-l+1..t) into slot (t+1-l)/d if `emit`."""
    l = cfg.cmp_block
    ordered = raw[:, (t - l + 1 + jnp.arange(l)) % l]                      # token order
    block = compress_blocks(ordered, cmp_params, cfg).astype(cmp_buf.dtype)  # [B, G, d]
    slot = jnp.clip((t + 1 - l) // cfg.cmp_stride, 0, cmp_buf.shape[1] - 1)
    old = lax.dynamic_index_in_dim(cmp_buf, slot, axis=1, keepdims=False)
    return lax.dynamic_update_index_in_dim(cmp_buf, jnp.where(emit, block, old), slot, axis=1)


def decode_read_bound(cfg: NSAConfig, t: jax.Array) -> jax.Array:
    """`nsa_common.decode_read_bound` in jnp: `max(0, (t+1-l)//d + 1) + n_sel*l_sel + w`."""
    cmp_blocks = jnp.maximum(0, (t + 1 - cfg.cmp_block) // cfg.cmp_stride + 1)
    return (cmp_blocks + cfg.n_sel * cfg.sel_block + cfg.window).astype(jnp.int32)


DECODE_BACKENDS = ("xla", "pallas")


def decode_step(params, x_t: jax.Array, cfg: NSAConfig, cache: DecodeCache, *,
                return_aux: bool = False, backend: str = "xla", options=None):
    """Append one token per sequence and attend. x_t `[B, 1, d_model]`, token t = cache.pos.

    backend: "xla" (the XLA path's chunk functions) or "pallas" (`pallas_kernels.decode`: one
    kernel for the compressed branch and the selection probabilities, one for the selected and
    window branches; the block ranking stays in XLA). options: `{"pallas": PallasOptions(...)}`
    (interpret mode, decode tile sizes).

    -> `(y_t [B, 1, d_model], cache, reads)`, plus `aux` (o_cmp, o_sel, o_win `[B, 1, H, d_v]`,
    gates `[B, 1, H, 3]`, block_idx int32 `[B, 1, G, n_sel]`) when `return_aux`.
    reads: int32 scalars, tokens whose K and V this step loads per KV head: `cmp` (compressed
    blocks available), `sel` (tokens <= t of the valid selected blocks; the largest over batch
    rows and KV heads), `win` (`min(w, t + 1)`), `total`, and `bound` (the paper's formula).
    `t` must stay below `max_len` (not checked under jit).
    """
    check_layer_inputs(params, x_t, cfg)
    B = x_t.shape[0]
    if x_t.shape[1] != 1:
        raise ValueError(f"x_t must hold one token per sequence ([B, 1, d_model]), got "
                         f"{x_t.shape}")
    if backend not in DECODE_BACKENDS:
        raise ValueError(f"backend ({backend!r}) must be one of {DECODE_BACKENDS}")
    _check_cache(cache, cfg, B)
    out = _decode_step_jit(params, x_t, cache, cfg=cfg, backend=backend,
                           options=dispatch.static_options(options))
    chex.assert_shape(out[0], x_t.shape)
    return out if return_aux else out[:3]


@functools.partial(jax.jit, static_argnames=("cfg", "backend", "options"))
def _decode_step_jit(params, x_t, cache: DecodeCache, *, cfg: NSAConfig, backend: str = "xla",
                     options=None):
    B = x_t.shape[0]
    l, d, l_sel = cfg.cmp_block, cfg.cmp_stride, cfg.sel_block
    t = cache.pos
    proj = project(params, x_t, cfg, t[None])

    # Append token t everywhere, emitting compressed block (t+1-l)/d when it completes.
    emit = (t + 1 >= l) & ((t + 1 - l) % d == 0)
    mlp = cfg.compress == "mlp"
    k_raw = _ring_write(cache.k_raw, proj["k_cmp"], t % l)
    v_raw = _ring_write(cache.v_raw, proj["v_cmp"], t % l)
    ring = cache.k_win.shape[1]
    cache = DecodeCache(
        k_sel=_ring_write(cache.k_sel, proj["k_sel"], t),
        v_sel=_ring_write(cache.v_sel, proj["v_sel"], t),
        k_win=_ring_write(cache.k_win, proj["k_win"], t % ring),
        v_win=_ring_write(cache.v_win, proj["v_win"], t % ring),
        k_raw=k_raw, v_raw=v_raw,
        k_cmp=_emit_block(cache.k_cmp, k_raw, params["cmp_k"] if mlp else None, cfg, t, emit),
        v_cmp=_emit_block(cache.v_cmp, v_raw, params["cmp_v"] if mlp else None, cfg, t, emit),
        pos=t + 1)

    q, scale = proj["q"], cfg.scale
    q_pos = jnp.full((B, 1), t, jnp.int32)
    zeros = jnp.zeros((B, 1), jnp.int32)

    if backend == "pallas":
        o_cmp, o_sel, o_win, block_idx = _attend_pallas(q, cache, cfg, t, dict(options or ()))
        return _finish_step(params, x_t, cfg, cache, t, q, o_cmp, o_sel, o_win, block_idx)

    # Compressed branch and selection scores: block i is admissible iff i*d + l - 1 <= t.
    n_slots = cache.k_cmp.shape[1]
    cmp_last = jnp.arange(n_slots, dtype=jnp.int32) * d + l - 1
    p_cmp, _ = cmp_probabilities(q, cache.k_cmp, q_pos, zeros, cmp_last,
                                 jnp.zeros((n_slots,), jnp.int32), scale)
    o_cmp = merge_heads(einsum("bqghc,bcgd->bqghd", p_cmp, cache.v_cmp, p_cmp.dtype))
    overlap = jnp.asarray(overlap_weights(cfg, n_slots, num_sel_blocks(cfg, cache.max_len)))
    block_idx = top_blocks(sel_scores(lax.stop_gradient(p_cmp), overlap.astype(p_cmp.dtype)),
                           q_pos[..., None], cfg)                          # [B, 1, G, n_sel]

    o_sel = selected_chunk(q, cache.k_sel, cache.v_sel, block_idx, q_pos, zeros, l_sel, scale)
    ring_token = t - (t - jnp.arange(ring, dtype=jnp.int32)) % ring       # token in each slot
    o_win = window_chunk(q, cache.k_win, cache.v_win, ring_token, q_pos, zeros, cfg.window,
                         scale)
    return _finish_step(params, x_t, cfg, cache, t, q, o_cmp.astype(q.dtype), o_sel, o_win,
                        block_idx)


def _attend_pallas(q, cache: DecodeCache, cfg: NSAConfig, t, options: dict):
    """The three branch outputs `[B, 1, H, d_v]` and block_idx `[B, 1, G, n_sel]` of token t
    through `pallas_kernels.decode`."""
    o_cmp, p_group = pallas_compressed(q, cache, cfg, t, options)
    block_idx, o_sel, o_win = pallas_selected_window(q, cache, cfg, t, p_group, options)
    return o_cmp, o_sel, o_win, block_idx


def _pallas_run_options(options: dict) -> dict:
    from nsa_jax.pallas_backend import DEFAULT_OPTIONS

    opts = dict(options or ()).get("pallas", DEFAULT_OPTIONS)
    return dict(block_sizes=opts.decode_blocks, interpret=opts.resolve_interpret())


def pallas_compressed(q, cache: DecodeCache, cfg: NSAConfig, t, options=None):
    """Decode's compressed branch on the Pallas kernel: `(o_cmp [B, 1, H, d_v], p_group
    [B, G, C])`, p_group being the selection probabilities summed over each group's heads."""
    from pallas_kernels import decode as kernels

    o_cmp, _, p_group = kernels.decode_compressed(
        q[:, 0], cache.k_cmp, cache.v_cmp, t, cmp_block=cfg.cmp_block,
        cmp_stride=cfg.cmp_stride, scale=cfg.scale, **_pallas_run_options(options))
    return o_cmp[:, None], p_group


def pallas_selected_window(q, cache: DecodeCache, cfg: NSAConfig, t, p_group, options=None):
    """Rank the blocks from `p_group` and run the selected + window kernel:
    `(block_idx [B, 1, G, n_sel], o_sel, o_win [B, 1, H, d_v])`."""
    from pallas_kernels import decode as kernels

    scores = band_scores(p_group, cfg, num_sel_blocks(cfg, cache.max_len))     # [B, G, S]
    q_pos = jnp.full((q.shape[0], 1), t, jnp.int32)
    block_idx = top_blocks(scores[:, None], q_pos[..., None], cfg)            # [B, 1, G, n_sel]
    o_sel, o_win = kernels.decode_selected_window(
        q[:, 0], cache.k_sel, cache.v_sel, block_idx[:, 0], cache.k_win, cache.v_win, t,
        sel_block=cfg.sel_block, window=cfg.window, scale=cfg.scale,
        **_pallas_run_options(options))
    return block_idx, o_sel[:, None], o_win[:, None]


def _finish_step(params, x_t, cfg: NSAConfig, cache: DecodeCache, t, q, o_cmp, o_sel, o_win,
                 block_idx):
    """Gate and project the branch outputs; count the tokens read."""
    l, d, l_sel = cfg.cmp_block, cfg.cmp_stride, cfg.sel_block
    y, gates = combine(params, x_t, cfg, o_cmp, o_sel, o_win)

    block_tokens = jnp.minimum(l_sel, t - block_idx * l_sel + 1)
    sel_reads = jnp.max(jnp.sum(jnp.where(block_idx >= 0, block_tokens, 0), axis=-1))
    cmp_reads = jnp.maximum(0, (t + 1 - l) // d + 1)
    win_reads = jnp.minimum(cfg.window, t + 1)
    reads = dict(cmp=cmp_reads, sel=sel_reads, win=win_reads,
                 total=cmp_reads + sel_reads + win_reads, bound=decode_read_bound(cfg, t))
    reads = {k: v.astype(jnp.int32) for k, v in reads.items()}
    aux = dict(o_cmp=o_cmp, o_sel=o_sel, o_win=o_win, gates=gates, block_idx=block_idx)
    return y, cache, reads, aux
