"""Decode: `init_cache`, `prefill`, `decode_step` as pure functions on a fixed-shape cache.

Every array of the cache has a shape fixed by `(cfg, batch, max_len, dtype)`, and each sequence
has its own length (`cache.lengths`, int32 `[B]`, flash-attn's `cache_seqlens`), so prompts of
different lengths prefill in one call, each sequence decodes from its own position, and a jitted
`decode_step` compiles once for a whole generation. The branch math is the XLA path's own chunk
functions called with the new queries, so a decode step computes what a prefill over tokens
`0..t` of that sequence computes at position t.

A sequence whose cache has no room left is never written past `max_len`: with concrete lengths
(eager calls) `prefill` / `decode_step` raise a `ValueError` naming the sequence; under `jit`
(traced lengths) the call leaves that sequence's cache untouched, returns NaN as its outputs and
sets `cache.overflow[b]` (sticky), which the caller checks after the loop.

Attention over the cache runs through the decode entries of `nsa_jax.dispatch`
(`decode_attention` for a step with the three branches, `decode_compressed_select` for the
compressed branch with the selection,
`decode_compressed_attention` for the compressed branch alone, `decode_selected_window_attention`)
on the caller's backend, in the same forms as the layer's (`"xla"`, `"pallas"`, a sequence of names
tried in order); block compression through its `compress_kv`.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import nsa_common
from nsa_common import (NSAConfig, cmp_admissible, num_admissible_cmp_blocks, num_cmp_blocks,
                        num_sel_blocks)
from nsa_jax import checks, core, dispatch
from nsa_jax.core import mix_branches
from nsa_jax.layer import (check_layer_inputs, check_params, combine, dense, forward_unchecked,
                           gate_values, gates_from_logits, kv_names, output, project)
from nsa_jax.rope import apply_rope
from nsa_jax.xla.decode import put_rows

BRANCHES = ("cmp", "sel", "win")


class DecodeCache(NamedTuple):
    """Per-layer decode state (a pytree). `d` is d_k for keys and d_v for values.

    k_sel, v_sel: `[B, max_len, G, d]` every past token (selected branch), token s at index s.
    k_win, v_win: `[B, W, G, d]` ring buffer of the last `W = min(w, max_len)` tokens; token s
        sits in slot `s % W`.
    k_raw, v_raw: `[B, l, G, d]` ring buffer of the last `l` RoPE'd cmp-branch tokens, the
        input of the next compressed block; token s sits in slot `s % l`.
    k_cmp, v_cmp: `[B, C_max, G, d]` compressed blocks emitted so far, in block order
        (`C_max = max(1, num_cmp_blocks(cfg, max_len))`).
    lengths: int32 `[B]`, tokens held per sequence (each sequence's next position).
    overflow: bool `[B]`, set (and kept) when a traced call found no room for a sequence's
        tokens; that call wrote nothing for it and returned NaN as its outputs.
    """

    k_sel: jax.Array
    v_sel: jax.Array
    k_win: jax.Array
    v_win: jax.Array
    k_raw: jax.Array
    v_raw: jax.Array
    k_cmp: jax.Array
    v_cmp: jax.Array
    lengths: jax.Array
    overflow: jax.Array

    @property
    def max_len(self) -> int:
        return self.k_sel.shape[1]

    @property
    def batch(self) -> int:
        return self.k_sel.shape[0]


def init_cache(cfg: NSAConfig, batch: int, max_len: int, dtype=jnp.float32) -> DecodeCache:
    """An empty cache for `batch` sequences of up to `max_len` tokens each."""
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
                       lengths=jnp.zeros((batch,), jnp.int32),
                       overflow=jnp.zeros((batch,), bool))


def _check_cache(cache, cfg: NSAConfig, batch: int) -> None:
    if not isinstance(cache, DecodeCache):
        raise ValueError(f"cache must be a DecodeCache from init_cache, got {type(cache).__name__}")
    expected = jax.eval_shape(lambda: init_cache(cfg, batch, cache.max_len, cache.k_sel.dtype))
    for name, want, got in zip(DecodeCache._fields, expected, cache):
        if want.shape != got.shape:
            raise ValueError(f"cache.{name} has shape {got.shape}, expected {want.shape} "
                             f"(cache built for another cfg or batch size?)")


def _check_room(cache: DecodeCache, new_tokens, what: str) -> None:
    """ValueError naming the first sequence that `new_tokens` `[B]` would push past max_len
    (only when the lengths are concrete: under jit the overflow flag takes over)."""
    lengths, new = checks.concrete(cache.lengths), checks.concrete(new_tokens)
    if lengths is None or new is None:
        return
    over = np.nonzero(lengths + new > cache.max_len)[0]
    if over.size:
        b = int(over[0])
        raise ValueError(f"cache is full for sequence {b}: {what} adds {int(new[b])} token(s) "
                         f"to its {int(lengths[b])}, over max_len {cache.max_len}")


# ----------------------------------------------------------------------------------------------
# Prefill


def prefill(params, x: jax.Array, cfg: NSAConfig, cache: DecodeCache, *, lengths=None,
            backend: dispatch.Backend = "xla", options=None, return_aux: bool = False,
            block_idx=None):
    """Append a chunk of tokens to each sequence and attend: prompts, chunked prefill, or the
    continuation of a conversation.

    x `[B, T, d_model]`: row b holds `lengths[b]` new tokens (int `[B]`, default T; the rest of
    the row is padding), at positions `cache.lengths[b] ..`. -> `(y [B, T, d_model], cache)`
    (and `aux` as in `nsa_attention` last when `return_aux`); y is 0 at padding positions.

    On a cache known to be empty (concrete `cache.lengths` all 0) this is the layer itself
    (`nsa_attention` on `backend`); otherwise the new queries attend to the cache through the
    decode entries of `backend` (kernels that take one query per sequence, such as Pallas',
    pass a longer chunk to the next backend, XLA's chunk functions: memory `O(B T H C)`, so
    feed long continuations in chunks).
    block_idx: int `[B, T, G, n_sel]` selection blocks for the new tokens instead of their own
    selection (the parity report's shared selection); None selects as usual.
    """
    check_layer_inputs(params, x, cfg)
    B, T, _ = x.shape
    _check_cache(cache, cfg, B)
    if lengths is None:
        lengths = jnp.full((B,), T, jnp.int32)
    checks.array("lengths", lengths, 1, floating=False, integer=True)
    if lengths.shape[0] != B:
        raise ValueError(f"lengths has {lengths.shape[0]} entries, x has B = {B} sequences")
    new = checks.concrete(lengths)
    if new is not None and (np.any(new < 0) or np.any(new > T)):
        raise ValueError(f"lengths ({new.tolist()}) must lie in [0, T = {T}]")
    _check_room(cache, lengths, "prefill")
    held = checks.concrete(cache.lengths)
    fresh = held is not None and not np.any(held)
    block_idx = core.check_block_idx(block_idx, (B, T), cfg.n_kv_heads, cfg)
    y, cache, aux = _prefill_jit(params, x, cache, jnp.asarray(lengths, jnp.int32), block_idx,
                                 cfg=cfg,
                                 backend=dispatch.static_backend(backend),
                                 options=dispatch.static_options(options), fresh=fresh)
    chex.assert_shape(y, x.shape)
    return (y, cache, aux) if return_aux else (y, cache)


def _ordered_ring(ring: jax.Array, first: jax.Array) -> jax.Array:
    """ring `[B, R, G, d]` (token s in slot s % R) -> `[B, R, G, d]`, tokens `first[b] ..
    first[b] + R - 1` in token order."""
    R = ring.shape[1]
    slot = (first[:, None] + jnp.arange(R, dtype=jnp.int32)) % R
    return jnp.take_along_axis(ring, slot[:, :, None, None], axis=1)


def _append_tokens(cache: DecodeCache, proj: dict, pos, new, cfg: NSAConfig, backend,
                   options, *, step: bool = False) -> DecodeCache:
    """Write the projected tokens `proj["k_*"] [B, T, G, d]` at positions `pos [B, T]`, of which
    the first `new [B]` per row are real, into the token buffers and the two rings, through the
    dispatch's `decode_append` (Pallas: one kernel for the six appends of a step). Only the
    last `R` tokens of a row go to a ring of R slots, so no two writes share a slot.
    step: a decode step's append (T = 1, `new` = 1 where the token fits, else 0), whose rows
    a backend may work out from `pos` alone."""
    B, T = pos.shape
    i = jnp.arange(T, dtype=jnp.int32)[None]
    real = i < new[:, None]

    def ring_index(size):
        return jnp.where(real & (i >= new[:, None] - size), pos % size, size)

    sel_index = jnp.where(real, pos, cache.max_len)
    win, raw = ring_index(cache.k_win.shape[1]), ring_index(cache.k_raw.shape[1])
    names = ("k_sel", "v_sel", "k_win", "v_win", "k_raw", "v_raw")
    sources = tuple(n.replace("raw", "cmp") for n in names)
    tokens = tuple(proj[n] for n in sources)
    index = (sel_index, sel_index, win, win, raw, raw)
    packed = None
    if PACKED in proj and T == 1:
        # The same tokens as columns of the projections, and the rows as one [B, 3] array (a
        # step's: the positions, each buffer's row `pos % S` where `pos < max_len`): a kernel
        # that reads them leaves the slices and the rows above unused (no kernels of their own).
        arrays, columns = proj[PACKED]
        packed = {"sources": tuple(a[:, 0] for a in arrays),
                  "columns": tuple(columns[n] for n in sources)}
        if step:
            packed.update(positions=pos[:, 0], limit=cache.max_len)
        else:
            packed.update(rows=jnp.stack([sel_index[:, 0], win[:, 0], raw[:, 0]], axis=-1),
                          row_columns=(0, 0, 1, 1, 2, 2))
    buffers = dispatch.call("decode_append", backend, tuple(getattr(cache, n) for n in names),
                            tokens, index, cfg, positions=pos, packed=packed, options=options)
    return cache._replace(**dict(zip(names, buffers)))


def _room(cache: DecodeCache, new) -> tuple[jax.Array, jax.Array]:
    """(fits [B] bool, new tokens actually appended [B]): a sequence without room gets none."""
    fits = cache.lengths + new <= cache.max_len
    return fits, jnp.where(fits, new, 0).astype(jnp.int32)


def _refuse(y: jax.Array, fits: jax.Array) -> jax.Array:
    """NaN outputs for the sequences that had no room (never silent garbage)."""
    return jnp.where(fits.reshape((-1,) + (1,) * (y.ndim - 1)), y, jnp.nan).astype(y.dtype)


@functools.partial(jax.jit, static_argnames=("cfg", "backend", "options", "fresh"))
def _prefill_jit(params, x, cache: DecodeCache, lengths, block_idx, *, cfg: NSAConfig, backend,
                 options, fresh: bool):
    B, T, _ = x.shape
    l, d = cfg.cmp_block, cfg.cmp_stride
    run_options = dict(options) if options else None
    fits, new = _room(cache, lengths)
    start = cache.lengths
    pos = start[:, None] + jnp.arange(T, dtype=jnp.int32)                  # [B, T]
    end = start + new                                                      # [B]
    mlp = cfg.compress == "mlp"
    n_slots = cache.k_cmp.shape[1]
    if fresh:
        # Causal: the layer's outputs at a row's real tokens ignore the padding after them.
        y, aux, proj, parts = forward_unchecked(params, x, None, block_idx, cfg=cfg,
                                                backend=backend,
                                                options=options, internals=True)
        cache = _append_tokens(cache, proj, pos, new, cfg, backend, run_options)
        n_blocks = parts["k_cmp"].shape[1]
        block = jnp.arange(n_blocks, dtype=jnp.int32)[None]
        cmp_index = jnp.where(cmp_admissible(block, end[:, None] - 1, l, d), block, n_slots)
        k_blocks, v_blocks = parts["k_cmp"], parts["v_cmp"]
    else:
        proj = project(params, x, cfg, pos)
        # Blocks ending inside this chunk read up to l - 1 tokens before it: those are the raw
        # ring's, so block j is the window [j*d, j*d + l) of (ring in token order ++ chunk).
        def extended(ring, chunk):
            return jnp.concatenate([_ordered_ring(ring, start - l), chunk.astype(ring.dtype)], 1)

        k_ext = extended(cache.k_raw, proj["k_cmp"])                       # [B, l + T, G, d]
        v_ext = extended(cache.v_raw, proj["v_cmp"])
        first = num_admissible_cmp_blocks(start - 1, l, d)                 # not emitted yet
        block = first[:, None] + jnp.arange(-(-T // d), dtype=jnp.int32)   # [B, K]
        token = block[..., None] * d - (start - l)[:, None, None] + jnp.arange(l, dtype=jnp.int32)
        token = jnp.clip(token, 0, l + T - 1)                              # [B, K, l]

        def blocks(ext, cmp_params):
            gathered = jnp.take_along_axis(ext[:, None], token[..., None, None], axis=2)
            return _compress(gathered, cmp_params, cfg, backend, run_options)  # [B, K, G, d]

        k_blocks = blocks(k_ext, params["cmp_k"] if mlp else None)
        v_blocks = blocks(v_ext, params["cmp_v"] if mlp else None)
        emitted = cmp_admissible(block, end[:, None] - 1, l, d)
        cmp_index = jnp.where(emitted & (block < n_slots), block, n_slots)
        # The window of the chunk's queries: the ring before the appends, then the chunk.
        ring = cache.k_win.shape[1]
        window = (
            jnp.concatenate([_ordered_ring(cache.k_win, start - ring),
                             proj["k_win"].astype(cache.k_win.dtype)], 1),
            jnp.concatenate([_ordered_ring(cache.v_win, start - ring),
                             proj["v_win"].astype(cache.v_win.dtype)], 1),
            (start - ring)[:, None] + jnp.arange(ring + T, dtype=jnp.int32))  # [B, ring + T]
        cache = _append_tokens(cache, proj, pos, new, cfg, backend, run_options)
    cache = cache._replace(k_cmp=put_rows(cache.k_cmp, k_blocks, cmp_index),
                           v_cmp=put_rows(cache.v_cmp, v_blocks, cmp_index))
    if not fresh:
        o_cmp, o_sel, o_win, block_idx, _ = _attend(proj["q"], cache, cfg, pos, BRANCHES, backend,
                                                 run_options, window=window, block_idx=block_idx)
        y, gates = combine(params, x, cfg, o_cmp, o_sel, o_win)
        aux = dict(o_cmp=o_cmp, o_sel=o_sel, o_win=o_win, gates=gates, block_idx=block_idx)
    real = jnp.arange(T, dtype=jnp.int32)[None] < new[:, None]
    y = _refuse(jnp.where(real[..., None], y, 0), fits)
    cache = cache._replace(lengths=end, overflow=cache.overflow | ~fits)
    return y, cache, aux


# ----------------------------------------------------------------------------------------------
# One decode step


def decode_read_bound(cfg: NSAConfig, t: jax.Array) -> jax.Array:
    """`nsa_common.decode_read_bound` of positions t as int32 (a jnp array, may be traced)."""
    return nsa_common.decode_read_bound(cfg, jnp.asarray(t, jnp.int32)).astype(jnp.int32)


def decode_step(params, x_t: jax.Array, cfg: NSAConfig, cache: DecodeCache, *,
                return_aux: bool = False, backend: dispatch.Backend = "xla", options=None,
                block_idx=None):
    """Append one token per sequence and attend. x_t `[B, 1, d_model]`; sequence b's token sits
    at position `t_b = cache.lengths[b]`.

    backend: as in `nsa_attention` (a name, or a sequence of names tried in order for each
    decode entry of `nsa_jax.dispatch`; "pallas" is ("pallas", "xla")): "xla" (the XLA path's
    chunk functions) or "pallas" (`pallas_kernels.decode`: one kernel for the compressed branch
    and the selection probabilities, one for the selected and window branches).
    options: `{"pallas": PallasOptions(...)}` (interpret mode, decode tiles).
    Jit it with the cache donated (`donate_argnames="cache"`) so that the appends are in place,
    and pass `prepare_decode_params(params, cfg)` for one projection GEMM per step.

    -> `(y_t [B, 1, d_model], cache, reads)`, plus `aux` (o_cmp, o_sel, o_win `[B, 1, H, d_v]`,
    gates `[B, 1, H, 3]`, block_idx int32 `[B, 1, G, n_sel]`) when `return_aux`.
    reads: int32 `[B]` per sequence, tokens whose K and V this step loads per KV head: `cmp`
    (compressed blocks available), `sel` (tokens <= t of the valid selected blocks; the largest
    over the KV heads), `win` (`min(w, t + 1)`), `total`, and `bound` (the paper's formula).
    A full sequence raises (concrete lengths) or gets NaN and `cache.overflow` (traced).
    block_idx: int `[B, 1, G, n_sel]` selection blocks instead of the step's own selection (the
    parity report's shared selection); None selects as usual.
    """
    return decode_step_branches(params, x_t, cfg, cache, branches=BRANCHES,
                                return_aux=return_aux, backend=backend, options=options,
                                block_idx=block_idx)


def decode_step_branches(params, x_t: jax.Array, cfg: NSAConfig, cache: DecodeCache, *,
                         branches: Sequence[str], return_aux: bool = False,
                         backend: dispatch.Backend = "xla", options=None, block_idx=None):
    """`decode_step` attending with only `branches` (a subset of ("cmp", "sel", "win"); the
    others' outputs are 0): the benchmark's per-branch breakdown. The appends, the compression
    MLP, the gates and the output projection run as in the full step; "sel" also runs the
    compressed scores it selects with. `branches=()` times the step without attention."""
    check_layer_inputs(params, x_t, cfg)
    B = x_t.shape[0]
    if x_t.shape[1] != 1:
        raise ValueError(f"x_t must hold one token per sequence ([B, 1, d_model]), got "
                         f"{x_t.shape}")
    branches = tuple(branches)
    if any(b not in BRANCHES for b in branches):
        raise ValueError(f"branches ({branches!r}) must be a subset of {BRANCHES}")
    backend = dispatch.static_backend(backend)
    _check_cache(cache, cfg, B)
    _check_room(cache, np.ones((B,), np.int32), "decode_step")
    block_idx = core.check_block_idx(block_idx, (B, 1), cfg.n_kv_heads, cfg)
    out = _decode_step_jit(params, x_t, cache, block_idx, cfg=cfg, backend=backend,
                           options=dispatch.static_options(options), branches=branches)
    chex.assert_shape(out[0], x_t.shape)
    return out if return_aux else out[:3]


STEP_WEIGHTS = "decode_w_qkv"


def prepare_decode_params(params, cfg: NSAConfig) -> dict:
    """`params` plus `params["decode_w_qkv"]`: wq, every wk / wv and the gate weight wg side by
    side (`[d_model, H*d_k + n_kv*G*(d_k + d_v) + 3H]`), concatenated once, so that a decode step
    computes all its projections and its gate logits in one GEMM instead of one small GEMM per
    weight. `decode_step` uses it when present (prepare again after changing the weights); the
    layer ignores it."""
    plain = {key: value for key, value in params.items() if key != STEP_WEIGHTS}
    check_params(plain, cfg)
    names = kv_names(cfg)
    parts = ([params["wq"]] + [params["wk"][n] for n in names] + [params["wv"][n] for n in names]
             + [params["wg"]])
    return {**plain, STEP_WEIGHTS: jnp.concatenate(parts, axis=1)}


PACKED = "packed"  # _project_step's key: the arrays the step's keys / values are columns of
GATE_LOGITS = "gate_columns"  # and: (the GEMM's output [B, W], the gate logits' first column)


def _project_step(params, x_t, cfg: NSAConfig, positions) -> dict:
    """`layer.project` of one token per sequence; one GEMM when the params are prepared."""
    if STEP_WEIGHTS not in params:
        return project(params, x_t, cfg, positions)
    B, T, _ = x_t.shape
    H, G, dk, dv = cfg.n_heads, cfg.n_kv_heads, cfg.d_k, cfg.d_v
    names = kv_names(cfg)
    fused = dense(x_t, params[STEP_WEIGHTS])
    # q and every key are side by side in the GEMM's output: RoPE turns them as one array of
    # H + n_kv*G heads (one fusion instead of one per projection).
    n_rope = H + len(names) * G
    heads = fused[..., :n_rope * dk].reshape(B, T, n_rope, dk)
    if cfg.rope_theta is not None:
        heads = apply_rope(heads, positions, cfg.rope_theta)
    widths = [G * dv] * len(names) + [3 * H]
    pieces = jnp.split(fused[..., n_rope * dk:], np.cumsum(widths)[:-1], axis=-1)
    out = {"q": heads[:, :, :H]}
    keys = {n: heads[:, :, H + i * G:H + (i + 1) * G] for i, n in enumerate(names)}
    values = {n: p.reshape(B, T, G, dv) for n, p in zip(names, pieces[:len(names)])}
    out["gate_logits"] = pieces[-1]
    # The gate logits' place in the GEMM's output, for an entry that mixes the branches.
    out[GATE_LOGITS] = (fused[:, 0], n_rope * dk + sum(widths[:-1]))
    # Where each key and value sits: (0, column) of the RoPE'd heads `[B, T, n_rope * dk]`,
    # (1, column) of the GEMM's output (`_append_tokens`' packed form).
    columns = {}
    for c in BRANCHES:
        name = "shared" if cfg.shared_kv else c
        i = names.index(name)
        out[f"k_{c}"], out[f"v_{c}"] = keys[name], values[name]
        columns[f"k_{c}"] = (0, (H + i * G) * dk)
        columns[f"v_{c}"] = (1, n_rope * dk + i * G * dv)
    out[PACKED] = ((heads.reshape(B, T, n_rope * dk), fused), columns)
    return out


def _compress(blocks: jax.Array, cmp_params, cfg: NSAConfig, backend, options) -> jax.Array:
    """blocks `[..., l, G, d]` in token order -> their summaries `[..., G, d]` in blocks' dtype,
    through the dispatch's `compress_kv` (l tokens are a sequence of one compressed block)."""
    lead, tail = blocks.shape[:-3], blocks.shape[-3:]
    flat = blocks.reshape((math.prod(lead),) + tail)
    out = dispatch.call("compress_kv", backend, flat, cmp_params, cfg, options=options)
    return out.reshape(lead + out.shape[-2:])


def _emit_blocks(cache: DecodeCache, params, cfg: NSAConfig, t, emit, backend,
                 options) -> DecodeCache:
    """Compress the raw rings (tokens `t-l+1 .. t` of each sequence) into slot `(t+1-l)/d` of
    the sequences that `emit` (`t < max_len` and t completes a block): through the dispatch's
    `decode_compress` (Pallas: one kernel that writes only there, no `cond`) where the backend
    has it and compresses with the library's own `compress_kv`; otherwise under a `cond`, so
    that the compression MLP runs only on steps where a sequence emits."""
    l, d = cfg.cmp_block, cfg.cmp_stride
    mlp = cfg.compress == "mlp"
    if dispatch.library_only("compress_kv", backend):
        try:
            k_cmp, v_cmp = dispatch.call(
                "decode_compress", backend, (cache.k_raw, cache.v_raw), (cache.k_cmp, cache.v_cmp),
                (params["cmp_k"], params["cmp_v"]) if mlp else None, cfg, positions=t,
                limit=cache.max_len, options=options)
            return cache._replace(k_cmp=k_cmp, v_cmp=v_cmp)
        except dispatch.NoBackendError:
            pass
    n_slots = cache.k_cmp.shape[1]
    slot = jnp.where(emit, nsa_common.completed_cmp_block(t, l, d), n_slots)[:, None]  # [B, 1]

    def write(cache):
        k_block = _compress(_ordered_ring(cache.k_raw, t - l + 1),
                            params["cmp_k"] if mlp else None, cfg, backend, options)
        v_block = _compress(_ordered_ring(cache.v_raw, t - l + 1),
                            params["cmp_v"] if mlp else None, cfg, backend, options)
        return cache._replace(k_cmp=put_rows(cache.k_cmp, k_block[:, None], slot),
                              v_cmp=put_rows(cache.v_cmp, v_block[:, None], slot))

    return lax.cond(jnp.any(emit), write, lambda cache: cache, cache)


@functools.partial(jax.jit, static_argnames=("cfg", "backend", "options", "branches"))
def _decode_step_jit(params, x_t, cache: DecodeCache, block_idx, *, cfg: NSAConfig, backend,
                     options, branches: tuple):
    l, d = cfg.cmp_block, cfg.cmp_stride
    options = dict(options) if options else None
    fits, new = _room(cache, jnp.ones_like(cache.lengths))
    t = cache.lengths                                                      # [B]
    proj = _project_step(params, x_t, cfg, t[:, None])
    cache = _append_tokens(cache, proj, t[:, None], new, cfg, backend, options, step=True)
    emit = fits & nsa_common.completes_cmp_block(t, l, d)
    cache = _emit_blocks(cache, params, cfg, t, emit, backend, options)
    o_cmp, o_sel, o_win, block_idx, o = _attend(
        proj["q"], cache, cfg, t[:, None], branches, backend, options, block_idx=block_idx,
        gate=(*proj[GATE_LOGITS], params["bg"]) if GATE_LOGITS in proj else None,
        q_rows=proj[PACKED][0][0][:, 0] if PACKED in proj else None)
    # Prepared params: the gate logits came out of the projection GEMM.
    gates = (gates_from_logits(params, proj["gate_logits"], cfg) if "gate_logits" in proj
             else gate_values(params, x_t, cfg))
    # o: the branches mixed by the entry that attended (Pallas: its combine kernel), or None.
    y = output(params, x_t, cfg, mix_branches(gates, o_cmp, o_sel, o_win) if o is None else o)
    reads = step_reads(cfg, t, block_idx)
    aux = dict(o_cmp=o_cmp, o_sel=o_sel, o_win=o_win, gates=gates, block_idx=block_idx)
    cache = cache._replace(lengths=t + new, overflow=cache.overflow | ~fits)
    return _refuse(y, fits), cache, reads, aux


def step_reads(cfg: NSAConfig, t: jax.Array, block_idx: jax.Array) -> dict:
    """Tokens a step at positions t `[B]` loads per KV head (int32 `[B]` each), with the
    selected blocks block_idx `[B, 1, G, n_sel]` (-1 = none)."""
    l, d, l_sel = cfg.cmp_block, cfg.cmp_stride, cfg.sel_block
    t_b = t[:, None, None, None]
    block_tokens = jnp.minimum(l_sel, t_b - block_idx * l_sel + 1)
    sel = jnp.max(jnp.sum(jnp.where(block_idx >= 0, block_tokens, 0), axis=-1), axis=(1, 2))
    cmp = num_admissible_cmp_blocks(t, l, d)
    win = jnp.minimum(cfg.window, t + 1)
    reads = dict(cmp=cmp, sel=sel, win=win, total=cmp + sel + win,
                 bound=decode_read_bound(cfg, t))
    return {k: v.astype(jnp.int32) for k, v in reads.items()}


def _attend(q, cache: DecodeCache, cfg: NSAConfig, positions, branches, backend, options, *,
            window=None, block_idx=None, gate=None, q_rows=None):
    """The branch outputs `[B, Q, H, d_v]` (0 for branches not asked for) and block_idx
    `[B, Q, G, n_sel]` (-1 without "sel") of queries q `[B, Q, H, d_k]` at positions `[B, Q]`,
    on a cache that already holds them, through the decode entries of `backend`.

    window: None, the cache's ring (a decode step's query is its newest token); or, for a chunk
    of several queries, `(k [B, K, G, d_k], v [B, K, G, d_v], tokens int [B, K])`: the window's
    keys (the ring before the chunk, then the chunk) and the token each row holds.
    block_idx: `[B, Q, G, n_sel]` blocks the selected branch reads instead of the selection's.
    gate: `(the projection GEMM's output [B, W], the first gate logit's column, bg)`, offered
    to the entry of a step with the three branches, which may mix them; q_rows: the step's
    RoPE'd heads `[B, W]` (q first), which that entry may read q from.
    -> `(o_cmp, o_sel, o_win, block_idx, o)`: o `[B, Q, H, d_v]` the branches mixed by the
    gates, or None where the entry did not mix them (the caller does).
    """
    B, Q = positions.shape
    o_zero = jnp.zeros(q.shape[:3] + (cfg.d_v,), q.dtype)
    o_cmp = o_sel = o_win = o_zero
    forced = block_idx
    block_idx = jnp.full((B, Q, cfg.n_kv_heads, cfg.n_sel), -1, jnp.int32)

    def run(entry, *args, **kwargs):
        return dispatch.call(entry, backend, *args, options=options, positions=positions,
                             **kwargs)

    parts = ("decode_compressed_select", "decode_selected_window_attention")
    if (window is None and all(b in branches for b in BRANCHES)
            and all(dispatch.library_only(entry, backend) for entry in parts)):
        # One entry for the three (Pallas: one combine kernel for their splits); not where a
        # backend registered from outside would run one of the two entries it replaces.
        return run("decode_attention", q, cache.k_cmp, cache.v_cmp, cache.k_sel, cache.v_sel,
                   cache.k_win, cache.v_win, cfg, scale=cfg.scale,
                   n_sel_blocks=num_sel_blocks(cfg, cache.max_len), block_idx=forced, gate=gate,
                   q_rows=q_rows)
    if "sel" in branches:
        # One entry for both (Pallas: the selection reads the compressed kernel's scores).
        o, block_idx = run("decode_compressed_select", q, cache.k_cmp, cache.v_cmp, cfg,
                           scale=cfg.scale, n_sel_blocks=num_sel_blocks(cfg, cache.max_len))
        block_idx = block_idx if forced is None else forced
        if "cmp" in branches:
            o_cmp = o
    elif "cmp" in branches:
        o_cmp, _ = run("decode_compressed_attention", q, cache.k_cmp, cache.v_cmp, cfg,
                       scale=cfg.scale)
    if "sel" in branches or "win" in branches:
        # One entry runs both (Pallas: one kernel); without "sel" it gets no blocks.
        k_win, v_win, tokens = window if window is not None else (cache.k_win, cache.v_win, None)
        o_s, o_w = run("decode_selected_window_attention", q, cache.k_sel, cache.v_sel, block_idx,
                       k_win, v_win, cfg, scale=cfg.scale, window_tokens=tokens)
        o_sel = o_s if "sel" in branches else o_zero
        o_win = o_w if "win" in branches else o_zero
    return o_cmp, o_sel, o_win, block_idx, None
