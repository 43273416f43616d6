"""NSA sharded over a `jax.sharding.Mesh` with `shard_map` (docs/SHARDING.md).

Three mesh axes, each optional (`MeshAxes`):
  - data: the batch. Every shard runs the whole layer on its rows.
  - model: the KV heads. Each shard holds `G / m` whole GQA groups (their `H / m` query heads,
    their K/V projections, compression MLPs and gates) and the matching rows of `wo`; the
    output projection gives partial sums that one `psum` over the model axis adds up (an
    all-reduce, as Megatron's row-parallel linear: the output stays replicated over the axis).
  - context: the sequence (prefill and training). Compressed K/V are all-gathered (T/d long),
    the compression reads a halo of `l - d` tokens from the next shard and the sliding window
    one of `w - 1` tokens from the previous one (`ppermute`), and the selected branch
    all-gathers its K/V. XLA path only: the Pallas kernels assume queries start at token 0.

GSPMD does not partition a Pallas call, so every branch runs inside `shard_map` on local arrays
with a local config (`H / m`, `G / m`); parameters and the decode cache have the specs of
`param_specs` / `cache_specs`, and gradients come out sharded like the parameters.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from nsa_common import NSAConfig, cmp_block_end, num_cmp_blocks, num_sel_blocks
from nsa_jax import checks, dispatch
from nsa_jax.decode import DecodeCache, decode_step, prefill
from nsa_jax.pallas_backend import DEFAULT_OPTIONS as PALLAS_DEFAULTS
from nsa_jax.layer import (check_layer_inputs, combine, nsa_attention, param_shapes,
                           project)
from nsa_jax.segments import Segments
from nsa_jax.xla import cudnn
from nsa_jax.xla.common import map_query_chunks
from nsa_jax.xla.compressed_attention import cmp_probabilities
from nsa_jax.xla.options import DEFAULT_OPTIONS as XLA_DEFAULTS
from nsa_jax.xla.select_blocks import band_scores, top_blocks


@dataclasses.dataclass(frozen=True)
class MeshAxes:
    """Names of the mesh axes NSA is sharded over; None: not sharded that way.

    A mesh axis that is named by none of these replicates the computation.
    """

    data: Optional[str] = "data"
    model: Optional[str] = "model"
    context: Optional[str] = None

    def named(self) -> dict[str, str]:
        return {role: name for role, name in dataclasses.asdict(self).items()
                if name is not None}


def shard_map(fn, mesh: Mesh, in_specs, out_specs, *, check: bool = True):
    """`jax.shard_map` (jax >= 0.7), or `jax.experimental.shard_map` on older releases.

    check: JAX's tracking of which values vary over which mesh axes (`check_vma`, formerly
    `check_rep`). A `pallas_call` does not declare how its outputs vary, so it needs it off.
    """
    if hasattr(jax, "shard_map"):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=check)
    from jax.experimental.shard_map import shard_map as experimental_shard_map
    return experimental_shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                  check_rep=check)


def _xla_only(backend) -> bool:
    """Whether every backend in the choice is "xla" (so `shard_map` can check replication)."""
    names = (backend,) if isinstance(backend, str) else dispatch.backend_names(backend)
    return all(name == "xla" for name in names)


# -----------------------------------------------------------------------------------------------
# Specs
# -----------------------------------------------------------------------------------------------
def param_specs(cfg: NSAConfig, axes: MeshAxes = MeshAxes()) -> dict:
    """The `PartitionSpec` of every parameter (the pytree of `init_params`).

    Head-major columns (`wq`, `wk.*`, `wv.*`, `wg`, `bg`) and the per-KV-head leading axis of
    `cmp_k` / `cmp_v` split over the model axis, as do the rows of `wo`; since query head i
    belongs to group `i // h`, a contiguous slice of heads is a slice of whole groups. Nothing
    splits over the data or context axes (replicated; their gradients are summed over them).
    """
    m = axes.model
    shapes = param_shapes(cfg)

    def spec(path, shape):
        name = path[0].key
        if name in ("cmp_k", "cmp_v"):
            return P(m, *(None,) * (len(shape) - 1))
        if name == "wo":
            return P(m, None)
        if name == "bg":
            return P(m)
        return P(None, m)                                  # wq, wk.*, wv.*, wg: [in, out]

    return jax.tree_util.tree_map_with_path(spec, shapes,
                                            is_leaf=lambda s: isinstance(s, tuple))


def input_spec(axes: MeshAxes = MeshAxes()) -> P:
    """x `[B, T, d_model]` and y: batch over data, tokens over context."""
    return P(axes.data, axes.context, None)


def head_spec(axes: MeshAxes = MeshAxes()) -> P:
    """Per-head arrays `[B, T, H or G, ...]` (aux outputs): heads over the model axis."""
    return P(axes.data, axes.context, axes.model, None)


def cache_specs(cfg: NSAConfig, axes: MeshAxes = MeshAxes()) -> DecodeCache:
    """The `PartitionSpec` of every `DecodeCache` field: `[B, len, G, d]` arrays split the batch
    over data and the KV heads over model; the per-sequence `lengths` and `overflow` `[B]` split
    over data. Decode is not context-sharded (one token per step): the cache is replicated over
    a context axis."""
    del cfg  # every field has the same layout; kept for symmetry with param_specs
    kv = P(axes.data, None, axes.model, None)
    per_sequence = ("lengths", "overflow")
    return DecodeCache(**{name: kv for name in DecodeCache._fields if name not in per_sequence},
                       **{name: P(axes.data) for name in per_sequence})


def _aux_specs(axes: MeshAxes) -> dict:
    return {name: head_spec(axes) for name in ("o_cmp", "o_sel", "o_win", "gates", "block_idx")}


def _put(tree, specs, mesh: Mesh):
    return jax.tree_util.tree_map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)),
                                  tree, specs)


def shard_params(params, cfg: NSAConfig, mesh: Mesh, axes: MeshAxes = MeshAxes()):
    """`params` placed on `mesh` with `param_specs`."""
    check_mesh(mesh, cfg, axes)
    return _put(params, param_specs(cfg, axes), mesh)


def shard_cache(cache: DecodeCache, cfg: NSAConfig, mesh: Mesh,
                axes: MeshAxes = MeshAxes()) -> DecodeCache:
    """`cache` placed on `mesh` with `cache_specs`."""
    check_mesh(mesh, cfg, axes, batch=cache.k_sel.shape[0])
    return _put(cache, cache_specs(cfg, axes), mesh)


# -----------------------------------------------------------------------------------------------
# Checks
# -----------------------------------------------------------------------------------------------
def axis_size(mesh: Mesh, name: Optional[str]) -> int:
    return 1 if name is None else int(mesh.shape[name])


def current_mesh(mesh: Optional[Mesh]) -> Mesh:
    """`mesh`, or when None the one set by `jax.set_mesh` (ValueError when there is none)."""
    if mesh is not None:
        return mesh
    get_mesh = getattr(jax.sharding, "get_mesh", None)   # jax >= 0.7
    mesh = get_mesh() if get_mesh is not None else None
    if mesh is None or mesh.empty:
        raise ValueError("mesh is None and no mesh is set: pass mesh= or run under "
                         "jax.set_mesh(mesh)")
    return mesh


def check_mesh(mesh: Mesh, cfg: NSAConfig, axes: MeshAxes, *, batch: Optional[int] = None,
               seq_len: Optional[int] = None) -> None:
    """ValueError naming the mesh axis that does not fit the config or the shapes."""
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if not isinstance(axes, MeshAxes):
        raise ValueError(f"axes must be a MeshAxes, got {type(axes).__name__}")
    named = axes.named()
    for role, name in named.items():
        if name not in mesh.axis_names:
            raise ValueError(f"axes.{role} ({name!r}) is not an axis of the mesh "
                             f"{tuple(mesh.axis_names)}")
    if len(set(named.values())) != len(named):
        raise ValueError(f"axes ({named}) must name distinct mesh axes")
    m = axis_size(mesh, axes.model)
    if cfg.n_kv_heads % m:
        raise ValueError(f"n_kv_heads G ({cfg.n_kv_heads}) must be divisible by the size of mesh "
                         f"axis {axes.model!r} ({m}): each model shard holds whole GQA groups")
    n = axis_size(mesh, axes.data)
    if batch is not None and batch % n:
        raise ValueError(f"batch size B ({batch}) must be divisible by the size of mesh axis "
                         f"{axes.data!r} ({n})")
    c = axis_size(mesh, axes.context)
    if seq_len is not None and c > 1:
        if seq_len % c:
            raise ValueError(f"sequence length T ({seq_len}) must be divisible by the size of "
                             f"mesh axis {axes.context!r} ({c})")
        local = seq_len // c
        if local % cfg.cmp_stride:
            raise ValueError(f"tokens per shard of mesh axis {axes.context!r} ({local}) must be "
                             f"a multiple of cmp_stride ({cfg.cmp_stride})")
        halo = max(cfg.window - 1, cfg.cmp_block - cfg.cmp_stride)
        if local < halo:
            raise ValueError(f"tokens per shard of mesh axis {axes.context!r} ({local}) must be "
                             f">= {halo} (the window's halo w - 1 and the compression's l - d "
                             f"come from one neighbour)")


def local_config(cfg: NSAConfig, mesh: Mesh, axes: MeshAxes) -> NSAConfig:
    """The config one model shard sees: `H / m` query heads and `G / m` KV heads."""
    m = axis_size(mesh, axes.model)
    return cfg.replace(n_heads=cfg.n_heads // m, n_kv_heads=cfg.n_kv_heads // m)


def body_options(options: Optional[Mapping[str, Any]], mesh: Mesh) -> Optional[dict]:
    """The options the branches get inside `shard_map`: as given, where cuDNN's attention can be
    bound below jax's `custom_partitioning` (`cudnn.unpartitioned_ready`, jax 0.10.2 to 0.11.2:
    inside a multi-device `shard_map` the cuDNN calls take that form, `cudnn.in_manual_region`).
    Elsewhere, with more than one device, cuDNN's own fused kernel is off (`cudnn_kernel` of
    both backends' options): the window and compressed branches run on FlashAttention-3 where it
    takes them, else on the Pallas kernels (backend "pallas") or XLA's chunked paths ("xla").
    Through jax's wrapper, XLA's compilation of the layer's *gradient* segfaults whenever cuDNN's
    kernel runs either branch inside a `shard_map` over several devices (jax 0.11.2, in its
    Shardy-to-HLO conversion; scripts/repro_cudnn_shard_map.py)."""
    if mesh.size == 1 or cudnn.unpartitioned_ready():
        return dict(options) if options else None
    options = dict(options or {})
    options["xla"] = dataclasses.replace(options.get("xla") or XLA_DEFAULTS, cudnn_kernel=False)
    options["pallas"] = dataclasses.replace(options.get("pallas") or PALLAS_DEFAULTS,
                                            cudnn_kernel=False)
    return options


def _sum_over_model(y: jax.Array, axes: MeshAxes) -> jax.Array:
    """Each model shard projected only its own heads through its rows of `wo`: add them up."""
    return y if axes.model is None else lax.psum(y, axes.model)


# -----------------------------------------------------------------------------------------------
# The layer
# -----------------------------------------------------------------------------------------------
def sharded_nsa_attention(params, x: jax.Array, cfg: NSAConfig, mesh: Optional[Mesh] = None,
                          *,
                          axes: MeshAxes = MeshAxes(), cu_seqlens=None,
                          backend: dispatch.Backend = "xla",
                          options: Optional[Mapping[str, Any]] = None,
                          return_aux: bool = False):
    """`nsa_attention` sharded over `mesh`. x `[B, T, d_model]` -> y `[B, T, d_model]` with
    spec `input_spec(axes)`; `aux` (with `return_aux`) has `head_spec(axes)`.

    Inputs may live anywhere (they are resharded to the specs); pass `shard_params(...)` to
    avoid the copy. mesh: None means the one set by `jax.set_mesh`. cu_seqlens (packed) is
    replicated, so it needs data and context axes of size 1. With a context axis of size > 1
    `backend` must include "xla" (the only path that takes query positions other than 0..T-1).
    """
    check_layer_inputs(params, x, cfg)
    mesh = current_mesh(mesh)
    check_mesh(mesh, cfg, axes, batch=x.shape[0], seq_len=x.shape[1])
    context = axis_size(mesh, axes.context) > 1
    if cu_seqlens is not None and (context or axis_size(mesh, axes.data) > 1):
        raise ValueError("cu_seqlens (packed sequences, B = 1) needs mesh axes data and context "
                         "of size 1")
    if context and "xla" not in dispatch.backend_names(backend):
        raise ValueError(f"backend ({backend!r}) must include 'xla' with a context axis "
                         f"({axes.context!r}): the other kernels assume queries start at token 0")
    y, aux = _sharded_forward(params, x, cu_seqlens, cfg=cfg, mesh=mesh, axes=axes,
                              backend=dispatch.static_backend(backend),
                              options=dispatch.static_options(options))
    return (y, aux) if return_aux else y


@functools.partial(jax.jit, static_argnames=("cfg", "mesh", "axes", "backend", "options"))
def _sharded_forward(params, x, cu_seqlens, *, cfg, mesh, axes, backend, options):
    local_cfg = local_config(cfg, mesh, axes)
    context = axis_size(mesh, axes.context) > 1
    options = body_options(options, mesh)

    def body(params, x, cu_seqlens):
        if context:
            y, aux = _context_forward(params, x, local_cfg, axes, backend, options)
        else:
            y, aux = nsa_attention(params, x, local_cfg, cu_seqlens=cu_seqlens, backend=backend,
                                   options=options, return_aux=True)
        return _sum_over_model(y, axes), aux

    return shard_map(body, mesh, in_specs=(param_specs(cfg, axes), input_spec(axes), P()),
                     out_specs=(input_spec(axes), _aux_specs(axes)),
                     check=_xla_only(backend))(params, x, cu_seqlens)


# -----------------------------------------------------------------------------------------------
# Context parallelism (inside shard_map: local arrays, collectives over axes.context)
# -----------------------------------------------------------------------------------------------
def _from_next(a: jax.Array, axis: str) -> jax.Array:
    """Shard s receives shard s + 1's `a` (the last shard receives zeros)."""
    n = lax.axis_size(axis)
    return lax.ppermute(a, axis, [(s + 1, s) for s in range(n - 1)])


def _from_previous(a: jax.Array, axis: str) -> jax.Array:
    """Shard s receives shard s - 1's `a` (the first shard receives zeros)."""
    n = lax.axis_size(axis)
    return lax.ppermute(a, axis, [(s, s + 1) for s in range(n - 1)])


def _gather_tokens(a: jax.Array, axis: str) -> jax.Array:
    """`[B, T_local, ...]` -> `[B, T, ...]` in token order (its transpose, a reduce-scatter,
    sends each shard's keys their gradient)."""
    return lax.all_gather(a, axis, axis=1, tiled=True)


def _segments(positions: jax.Array, n_cmp: int, cfg: NSAConfig) -> Segments:
    """One sequence seen from a shard: queries at global `positions [T_local]`, compressed block
    i in slot i, the sequence starting at token 0 (the packed path's masks then do the rest)."""
    zeros = jnp.zeros_like(positions)
    c = jnp.arange(n_cmp, dtype=jnp.int32)
    return Segments(pos=positions, seg=zeros, start=zeros, cmp_offset=zeros,
                    cmp_seg=jnp.zeros_like(c), cmp_local=c, cmp_start=c * cfg.cmp_stride)


def _context_compress(k: jax.Array, cmp_params, cfg: NSAConfig, axis: str, seq_len: int, run):
    """Local `[B, T_local, G, d]` -> all compressed blocks `[B, C, G, d]`, C of the whole T.

    Shard s compresses the `T_local / d` blocks that start in its tokens; they run `l - d`
    tokens into shard s + 1 (the halo). Blocks past the end of the sequence are dropped.
    """
    halo = cfg.cmp_block - cfg.cmp_stride
    k_ext = jnp.concatenate([k, _from_next(k[:, :halo], axis)], axis=1) if halo else k
    own = run("compress_kv", k_ext, cmp_params, cfg)                       # [B, T_local/d, G, d]
    return _gather_tokens(own, axis)[:, :num_cmp_blocks(cfg, seq_len)]


def _context_select(q, k_cmp, positions, cfg: NSAConfig, seq_len: int, options):
    """Top-n_sel blocks of queries at global `positions`, over the selection blocks of the whole
    sequence (the XLA `select_blocks` sizes them from its own T, which here is local)."""
    q, k_cmp = lax.stop_gradient(q), lax.stop_gradient(k_cmp)
    B, T_local = q.shape[:2]
    C = k_cmp.shape[1]
    cmp_last = cmp_block_end(jnp.arange(C, dtype=jnp.int32), cfg.cmp_block, cfg.cmp_stride)
    n_blocks = num_sel_blocks(cfg, seq_len)
    chunk = ((options or {}).get("xla") or XLA_DEFAULTS).select_q_chunk

    def body(chunk_start, q_c, pos_c):
        del chunk_start
        zeros = jnp.zeros_like(pos_c)
        p, _ = cmp_probabilities(q_c, k_cmp, pos_c, zeros, cmp_last, jnp.zeros_like(cmp_last),
                                 cfg.scale)
        # band_scores: no dense [C, S] overlap matrix (4 GB at 1M tokens).
        return top_blocks(band_scores(jnp.sum(p, axis=-2), cfg, n_blocks), pos_c[..., None], cfg)

    return map_query_chunks(body, chunk, q, jnp.broadcast_to(positions, (B, T_local)))


def _context_window(q, k, v, cfg: NSAConfig, axis: str, run):
    """Sliding window over a halo of `w - 1` tokens from the previous shard: queries padded in
    front by as many rows (cut off after), the first shard's halo masked as before its start."""
    halo = cfg.window - 1
    if not halo:
        return run("sliding_window_attention", q, k, v, window=cfg.window, scale=cfg.scale)
    k_ext = jnp.concatenate([_from_previous(k[:, -halo:], axis), k], axis=1)
    v_ext = jnp.concatenate([_from_previous(v[:, -halo:], axis), v], axis=1)
    q_ext = jnp.pad(q, [(0, 0), (halo, 0), (0, 0), (0, 0)])
    first = lax.axis_index(axis) == 0
    token = jnp.arange(k_ext.shape[1], dtype=jnp.int32)
    segments = _segments(token, 0, cfg)._replace(
        start=jnp.where(first, halo, 0) + jnp.zeros_like(token))
    out = run("sliding_window_attention", q_ext, k_ext, v_ext, window=cfg.window,
              scale=cfg.scale, segments=segments)
    return out[:, halo:]


def _context_forward(params, x, cfg: NSAConfig, axes: MeshAxes, backend, options):
    """The layer on one context shard x `[B, T_local, d_model]` (cfg is the model-local one).
    Same steps as `nsa_attention` (project, branches, combine) with the collectives between;
    the branches go through the dispatch with `segments` carrying global query positions, which
    the XLA path honours (Pallas branches are not packed-capable, so the dispatch skips them)."""
    axis = axes.context
    T_local = x.shape[1]
    seq_len = T_local * lax.axis_size(axis)
    positions = lax.axis_index(axis) * T_local + jnp.arange(T_local, dtype=jnp.int32)

    def run(branch, *args, segments=None, **kwargs):
        return dispatch.call(branch, backend, *args, segments=segments, options=options,
                             **kwargs)

    proj = project(params, x, cfg, positions)
    q = proj["q"]
    mlp = cfg.compress == "mlp"
    k_cmp = _context_compress(proj["k_cmp"], params["cmp_k"] if mlp else None, cfg, axis,
                              seq_len, run)
    v_cmp = _context_compress(proj["v_cmp"], params["cmp_v"] if mlp else None, cfg, axis,
                              seq_len, run)
    segments = _segments(positions, k_cmp.shape[1], cfg)
    o_cmp = run("compressed_attention", q, k_cmp, v_cmp, cfg, scale=cfg.scale,
                return_lse=False, segments=segments)
    block_idx = _context_select(q, k_cmp, positions, cfg, seq_len, options)
    # All-gather the selected branch's K/V (T x G_local x (d_k + d_v) per device): simplest
    # correct choice while it fits; docs/SHARDING.md weighs gathering blocks and a ring.
    o_sel = run("selected_attention", q, _gather_tokens(proj["k_sel"], axis),
                _gather_tokens(proj["v_sel"], axis), block_idx, block_size=cfg.sel_block,
                scale=cfg.scale, segments=segments)
    o_win = _context_window(q, proj["k_win"], proj["v_win"], cfg, axis, run)
    y, gates = combine(params, x, cfg, o_cmp, o_sel, o_win)
    return y, dict(o_cmp=o_cmp, o_sel=o_sel, o_win=o_win, gates=gates, block_idx=block_idx)


# -----------------------------------------------------------------------------------------------
# Decode
# -----------------------------------------------------------------------------------------------
def sharded_prefill(params, x: jax.Array, cfg: NSAConfig, cache: DecodeCache,
                    mesh: Optional[Mesh] = None, *,
                    axes: MeshAxes = MeshAxes(), backend: dispatch.Backend = "xla",
                    options: Optional[Mapping[str, Any]] = None):
    """`prefill` sharded over data and model (replicated over a context axis). -> `(y, cache)`
    with `input_spec` / `cache_specs`."""
    check_layer_inputs(params, x, cfg)
    axes, mesh = _decode_axes(axes), current_mesh(mesh)
    check_mesh(mesh, cfg, axes, batch=x.shape[0])
    return _sharded_prefill(params, x, cache, cfg=cfg, mesh=mesh, axes=axes,
                            backend=dispatch.static_backend(backend),
                            options=dispatch.static_options(options))


@functools.partial(jax.jit, static_argnames=("cfg", "mesh", "axes", "backend", "options"))
def _sharded_prefill(params, x, cache, *, cfg, mesh, axes, backend, options):
    local_cfg = local_config(cfg, mesh, axes)

    def body(params, x, cache):
        y, cache = prefill(params, x, local_cfg, cache, backend=backend,
                           options=dict(options) if options else None)
        return _sum_over_model(y, axes), cache

    specs = cache_specs(cfg, axes)
    return shard_map(body, mesh, in_specs=(param_specs(cfg, axes), input_spec(axes), specs),
                     out_specs=(input_spec(axes), specs), check=_xla_only(backend))(
                         params, x, cache)


def sharded_decode_step(params, x_t: jax.Array, cfg: NSAConfig, cache: DecodeCache,
                        mesh: Optional[Mesh] = None, *, axes: MeshAxes = MeshAxes(),
                        backend: dispatch.Backend = "xla",
                        options: Optional[Mapping[str, Any]] = None,
                        return_aux: bool = False):
    """`decode_step` sharded over data and model. -> `(y_t, cache, reads)` (+ `aux`): reads are
    the same scalars as unsharded (`sel` the largest over every shard's rows and heads)."""
    check_layer_inputs(params, x_t, cfg)
    axes, mesh = _decode_axes(axes), current_mesh(mesh)
    check_mesh(mesh, cfg, axes, batch=x_t.shape[0])
    out = _sharded_decode_step(params, x_t, cache, cfg=cfg, mesh=mesh, axes=axes,
                               backend=dispatch.static_backend(backend),
                               options=dispatch.static_options(options))
    return out if return_aux else out[:3]


@functools.partial(jax.jit, static_argnames=("cfg", "mesh", "axes", "backend", "options"))
def _sharded_decode_step(params, x_t, cache, *, cfg, mesh, axes, backend, options):
    local_cfg = local_config(cfg, mesh, axes)

    def body(params, x_t, cache):
        y, cache, reads, aux = decode_step(params, x_t, local_cfg, cache, return_aux=True,
                                           backend=backend,
                                           options=dict(options) if options else None)
        # Reads are per sequence `[B]`; a model shard holds some of the groups, and the count
        # is the most any group of the sequence read.
        sel = lax.pmax(reads["sel"], axes.model) if axes.model else reads["sel"]
        reads = dict(reads, sel=sel, total=reads["cmp"] + sel + reads["win"])
        return _sum_over_model(y, axes), cache, reads, aux

    specs = cache_specs(cfg, axes)
    reads_specs = {name: P(axes.data) for name in ("cmp", "sel", "win", "total", "bound")}
    return shard_map(body, mesh, in_specs=(param_specs(cfg, axes), input_spec(axes), specs),
                     out_specs=(input_spec(axes), specs, reads_specs, _aux_specs(axes)),
                     check=_xla_only(backend))(params, x_t, cache)


def _decode_axes(axes: MeshAxes) -> MeshAxes:
    """Decode runs one token: a context axis only replicates it."""
    if not isinstance(axes, MeshAxes):
        raise ValueError(f"axes must be a MeshAxes, got {type(axes).__name__}")
    return dataclasses.replace(axes, context=None)


# -----------------------------------------------------------------------------------------------
# Cost model (docs/SHARDING.md)
# -----------------------------------------------------------------------------------------------
def context_bytes_per_layer(cfg: NSAConfig, seq_len: int, context: int, *, batch: int = 1,
                            model: int = 1, itemsize: int = 2) -> dict[str, float]:
    """Bytes one device receives in one layer's forward under context parallelism, as
    implemented (the backward moves as much again: each all-gather's transpose is a
    reduce-scatter of the K/V gradients, each halo's a reversed `ppermute`).

    A token of one branch carries `d_k + d_v` values per KV head; a device holds `G / model`
    heads and `batch` rows. `sel_causal_mean` is what a causality-aware gather of the selected
    K/V would move on average (shard s needs only shards < s); `out_allreduce` is the model
    axis' all-reduce of y (ring: `2 (m - 1) / m` of it), for scale.
    """
    checks.positive_int("context", context)
    checks.positive_int("model", model)
    token = batch * (cfg.n_kv_heads // model) * (cfg.d_k + cfg.d_v) * itemsize
    remote = (context - 1) / context
    halo = 1 if context > 1 else 0
    cost = {
        "cmp_allgather": remote * num_cmp_blocks(cfg, seq_len) * token,
        "cmp_halo": halo * (cfg.cmp_block - cfg.cmp_stride) * token,
        "win_halo": halo * (cfg.window - 1) * token,
        "sel_allgather": remote * seq_len * token,
    }
    cost["total"] = sum(cost.values())
    cost["sel_causal_mean"] = remote / 2 * seq_len * token
    cost["out_allreduce"] = (2 * (model - 1) / model * batch * seq_len / context * cfg.d_model
                             * itemsize)
    return cost


__all__ = [
    "MeshAxes",
    "cache_specs",
    "check_mesh",
    "current_mesh",
    "context_bytes_per_layer",
    "head_spec",
    "input_spec",
    "local_config",
    "param_specs",
    "shard_cache",
    "shard_map",
    "shard_params",
    "sharded_decode_step",
    "sharded_nsa_attention",
    "sharded_prefill",
]
