"""The `"pallas"` backend: adapters from the dispatch conventions to `pallas_kernels`.

The kernels take plain hyperparameters (`cmp_block=`, `sel_block=`, ...) and know nothing of
`NSAConfig`; this module is the only place where the two meet. The branch without a Pallas
kernel (`compress_kv`) is not registered; `"pallas"` is registered with `"xla"` as its fallback,
so `backend="pallas"` (the same as `("pallas", "xla")`) runs it on XLA. Packed sequences are not
supported by the kernels (registered with `packed=False`): they go to XLA too, as does a shape a
kernel declines (float64, heads wider than its architecture's tiles).

The two branches that fused attention can run (compressed and window) take, in order:
FlashAttention-3 where it takes the shapes (sm90 profile, head dims <= 128, `flash_attn3_jax`
installed), else cuDNN's kernel where it is allowed (`cudnn_kernel`; `nsa_jax.sharding` keeps
it inside a multi-device `shard_map` where `cudnn.unpartitioned_ready()`) and takes them (its
head-size limit is 128 off sm90), else the Pallas kernel.
XLA's chunked paths run only where a kernel declines. The window follows the same order on a
GPU (`PallasOptions.window_kernel`, default on there); in interpret mode, or with
`window_kernel=False`, this adapter declines it and backend `"xla"` runs it (FA-3, cuDNN or its
chunked path, by `options["xla"]`). The selected branch runs `pallas_kernels.selected_attention`
with the architecture's tiles (`PallasOptions.selected_blocks` None; on sm90, tiles of 4 queries
stacked where their blocks' union is small, chosen per tile on the GPU).

Decode (`pallas_kernels.decode`): a decode step runs `decode_attention`: the compressed kernel,
a selection kernel that turns its scores into the blocks' scores (head sums, overlap weights,
forced blocks), the top-n kernel, one kernel for the selected and window branches, and one
combine kernel for the three branches' splits. `decode_compressed_select` and
`decode_selected_window_attention` serve a step asked for some branches only. The
unfused entries stay registered (`decode_compressed_attention` alone; `decode_select_blocks`:
`band_scores` in XLA and the top-n kernel). The kernels take one query per sequence over the
cache's window ring; a chunk of queries (chunked prefill) goes to XLA.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax

from nsa_common import NSAConfig, overlap_by_offset
from nsa_jax.xla import cudnn
from nsa_jax.xla.select_blocks import band_scores, rank_scores
import pallas_kernels as kernels
from pallas_kernels import profiles


@dataclasses.dataclass(frozen=True)
class PallasOptions:
    """Options of the `"pallas"` backend (pass as `options={"pallas": PallasOptions(...)}`).

    interpret: run the kernels in Pallas' interpreter; None (default) means "when JAX's default
    backend is not a GPU", so the same code runs, slowly but exactly, on a CPU.
    *_blocks: each kernel's tile sizes (None: those of the GPU architecture the call is traced
    on, `pallas_kernels.profiles`: NSA_PROFILE, else the device's compute capability; sm90's
    are the ones tuned on an H100 / H200); decode_blocks: those of
    `decode_step(..., backend="pallas")`. A kernel whose architecture has no tiles for the
    head dims declines (NotImplementedError) and the branch runs on XLA.
    compressed_cudnn: run the compressed branch on cuDNN's fused attention where it takes the
    shapes (a GPU, bf16 / fp16, d_v <= d_k): the queries folded in chunks of `d` turn its mask
    into cuDNN's causal square (`nsa_jax.xla.cudnn`). On an H100 at 64k it is faster than the
    Pallas kernel, forward and backward (bench/RESULTS.md). Its lse carries no gradient (the
    layer's lse only feeds the selection); False runs the Pallas kernel, whose lse does.
    fa3: on that path, FlashAttention-3 instead of cuDNN where `flash_attn3_jax` is installed
    on a Hopper GPU (`nsa_jax.xla.cudnn.fa3_takes`; faster on an H200) and the architecture
    profile is sm90 (`NSA_PROFILE=sm89` turns it off on any GPU, as it limits cuDNN's heads to
    the 128 it takes on an RTX 4090).
    cudnn_kernel: cuDNN's own kernel may run that path where FA-3 does not (off: FA-3 or the
    Pallas kernel; `nsa_jax.sharding` turns it off inside a multi-device `shard_map` where
    jax's cuDNN primitives cannot be bound below their `custom_partitioning`).
    window_kernel: run the window branch on this backend: FA-3 or cuDNN as below, else the
    Pallas window kernel (`pallas_kernels.window_attention`, O(T w) time and memory). None
    (default): on a GPU, on; in interpret mode, off. Off, the adapter declines the window and
    backend `"xla"` runs it as it would alone (FA-3 / cuDNN where `options["xla"]` allows them
    and they take the shapes, else its chunked path). On, the kernel replaces only XLA's chunked
    window: where FA-3 or cuDNN take the window they still run it (on an H100, d 128, 64k: the
    core with FA-3's window 38.00 / 111.3 ms, with the kernel forced 39.86 / 120.0;
    bench/RESULTS.md, "The Pallas window kernel"). Where neither does (d_k 192 off sm90, where
    cuDNN takes heads up to 128; a multi-device `shard_map` where cuDNN's kernel is off),
    the kernel is faster and holds O(T w) memory: on an H100 with `NSA_PROFILE=sm89`, d_k 192,
    32k, the window took 6.45 / 50.1 ms against 19.6 / 56.7 on XLA's chunked path, and the core
    35.2 / 224.4 against 48.2 / 253.5 (bench/RESULTS.md, "An RTX 4090's path").
    window_cudnn: with `window_kernel`, the same choice as `compressed_cudnn` for the window
    branch: FA-3 (`fa3`) or cuDNN's `local_window_size` (`cudnn_kernel`) where they take the
    shapes, else the Pallas window kernel; False runs the kernel (whose lse is available to
    callers of `pallas_kernels.window_attention`).
    window_blocks: the window kernel's tiles (None: the architecture's).
    """

    interpret: Optional[bool] = None
    compressed_blocks: Optional[kernels.CompressedAttentionBlockSizes] = None
    select_blocks: Optional[kernels.SelectBlocksBlockSizes] = None
    selected_blocks: Optional[kernels.SelectedAttentionBlockSizes] = None
    decode_blocks: Optional[kernels.DecodeBlockSizes] = None
    window_blocks: Optional[kernels.WindowAttentionBlockSizes] = None
    compressed_cudnn: bool = True
    window_kernel: Optional[bool] = None
    window_cudnn: bool = True
    fa3: bool = True
    cudnn_kernel: bool = True

    def __post_init__(self) -> None:
        if self.window_kernel is not None and not isinstance(self.window_kernel, bool):
            raise ValueError(f"window_kernel ({self.window_kernel!r}) must be None or a bool")

    def resolve_interpret(self) -> bool:
        if self.interpret is not None:
            return self.interpret
        return jax.default_backend() != "gpu"

    def resolve_window_kernel(self) -> bool:
        """`window_kernel`, None resolved: on unless in interpret mode."""
        if self.window_kernel is not None:
            return self.window_kernel
        return not self.resolve_interpret()


DEFAULT_OPTIONS = PallasOptions()
# The shortest sequence on which the alignment loss's `selected_importance` runs the Pallas
# kernels; shorter ones decline to XLA. On an H200 (bench preset, one layer, the sparse loss's
# KL part forward+backward) the kernels took 9.78 ms at 8k against XLA's 7.07, and 45.9 at 32k
# against 66.0 (bench/RESULTS.md, "Training step with the alignment loss"); 16k not measured.
IMPORTANCE_MIN_T = 32768


def _fused_takes(options: PallasOptions, q, k, v) -> bool:
    """Whether FA-3 or cuDNN's kernel runs a fused branch here (see the module docstring)."""
    arch = profiles.current()
    return (not options.resolve_interpret() and q.shape[-1] <= arch.cudnn_max_head_dim
            and cudnn.fused_takes(q, k, v, fa3=options.fa3 and arch.fa3,
                                  cudnn_kernel=options.cudnn_kernel))


def compressed_attention(q, k_cmp, v_cmp, cfg: NSAConfig, *, scale, return_lse,
                         options: Optional[PallasOptions] = None):
    options = options or DEFAULT_OPTIONS
    fa3 = options.fa3 and profiles.current().fa3
    if options.compressed_cudnn and _fused_takes(options, q, k_cmp, v_cmp):
        try:
            o, lse = cudnn.compressed_attention(
                q, k_cmp, v_cmp, cfg, scale=scale,
                attend=cudnn.fused_causal(fa3, q, k_cmp, v_cmp))
            return (o, lse) if return_lse else o
        except (ValueError, NotImplementedError, RuntimeError):
            pass  # cuDNN refuses the shapes (or T < l): the kernel takes them
    o, lse = kernels.compressed_attention(
        q, k_cmp, v_cmp, cmp_block=cfg.cmp_block, cmp_stride=cfg.cmp_stride, scale=scale,
        block_sizes=options.compressed_blocks, interpret=options.resolve_interpret())
    return (o, lse) if return_lse else o


def select_blocks(q, k_cmp, cfg: NSAConfig, *, scale, lse=None,
                  options: Optional[PallasOptions] = None):
    options = options or DEFAULT_OPTIONS
    if lse is None:  # kernel-level call without the compressed branch's statistics
        lse = kernels.compressed_lse(
            q, k_cmp, cmp_block=cfg.cmp_block, cmp_stride=cfg.cmp_stride, scale=scale,
            block_sizes=options.compressed_blocks, interpret=options.resolve_interpret())
    return kernels.select_blocks(
        q, k_cmp, lse, cmp_block=cfg.cmp_block, cmp_stride=cfg.cmp_stride,
        sel_block=cfg.sel_block, n_sel=cfg.n_sel, n_init=cfg.n_init, n_local=cfg.n_local,
        scale=scale, block_sizes=options.select_blocks, interpret=options.resolve_interpret())


def sliding_window_attention(q, k, v, *, window, scale,
                             options: Optional[PallasOptions] = None):
    options = options or DEFAULT_OPTIONS
    if not options.resolve_window_kernel():
        raise NotImplementedError("the Pallas window kernel is off (PallasOptions.window_kernel "
                                  "False, or None in interpret mode): the window runs on "
                                  "backend 'xla'")
    if options.window_cudnn and _fused_takes(options, q, k, v):
        try:
            return cudnn.window_attention(q, k, v, window=window, scale=scale,
                                          fa3=options.fa3 and profiles.current().fa3)
        except (ValueError, NotImplementedError, RuntimeError):
            pass  # this cuDNN build refuses the shapes: the kernel takes them
    return kernels.window_attention(q, k, v, window=window, scale=scale,
                                    block_sizes=options.window_blocks,
                                    interpret=options.resolve_interpret())


def selected_attention(q, k, v, block_idx, *, block_size, scale,
                       options: Optional[PallasOptions] = None):
    options = options or DEFAULT_OPTIONS
    return kernels.selected_attention(
        q, k, v, block_idx, block_size, scale, block_sizes=options.selected_blocks,
        interpret=options.resolve_interpret())


def selected_block_mass(q, k, block_idx, *, block_size, scale, q_chunk, kv_blocks,
                        options: Optional[PallasOptions] = None):
    del q_chunk, kv_blocks  # the XLA path's chunks; the kernel runs one program per token
    options = options or DEFAULT_OPTIONS
    return kernels.selected_block_mass(
        q, k, block_idx, block_size, scale, block_sizes=options.selected_blocks,
        interpret=options.resolve_interpret())


def selected_importance(q, k_cmp, lse, blocks, cfg: NSAConfig, *, scale, q_chunk,
                        options: Optional[PallasOptions] = None):
    del q_chunk  # the XLA path's chunks; the kernels run one program per token
    options = options or DEFAULT_OPTIONS
    if not options.resolve_interpret() and q.shape[1] < IMPORTANCE_MIN_T:
        raise NotImplementedError(f"the importance kernels run from T = {IMPORTANCE_MIN_T} "
                                  f"(shorter, XLA's product is faster), got {q.shape[1]}")
    return kernels.selected_importance(
        q, k_cmp, lse, blocks, cmp_block=cfg.cmp_block, cmp_stride=cfg.cmp_stride,
        sel_block=cfg.sel_block, weights=overlap_by_offset(cfg), scale=scale,
        interpret=options.resolve_interpret())


def _one_query(q, what: str) -> None:
    if q.shape[1] != 1:
        raise NotImplementedError(f"the Pallas {what} kernel takes one query per sequence, "
                                  f"got {q.shape[1]}")


def decode_compressed_attention(q, k_cmp, v_cmp, cfg: NSAConfig, *, positions, scale,
                                options: Optional[PallasOptions] = None):
    _one_query(q, "decode_compressed")
    options = options or DEFAULT_OPTIONS
    o_cmp, _, p_group = kernels.decode_compressed(
        q[:, 0], k_cmp, v_cmp, positions[:, 0], cmp_block=cfg.cmp_block,
        cmp_stride=cfg.cmp_stride, scale=scale, block_sizes=options.decode_blocks,
        interpret=options.resolve_interpret())
    return o_cmp[:, None], p_group[:, None]


def decode_select_blocks(p_group, cfg: NSAConfig, *, positions, n_sel_blocks: int,
                         options: Optional[PallasOptions] = None):
    """The overlap sums in XLA (`band_scores`), the ranking on the top-n kernel of the prefill
    selection (`pallas_kernels.top_n`: n_sel argmax rounds per row)."""
    options = options or DEFAULT_OPTIONS
    value = rank_scores(band_scores(p_group, cfg, n_sel_blocks), positions[..., None], cfg)
    return kernels.top_n(value, cfg.n_sel, block_sizes=options.select_blocks,
                         interpret=options.resolve_interpret())


def decode_append(buffers, tokens, index, cfg: NSAConfig, *, positions, packed=None,
                  options: Optional[PallasOptions] = None):
    """A decode step's appends (one token per sequence) in one kernel, in place
    (`pallas_kernels.append_rows`; with `packed`, `append_rows_packed` reads the tokens and rows
    out of the projections, or `append_step_packed` the tokens and a step's positions, and
    `tokens` / `index` go unused); a chunk, or G*d neither a power of two nor the sum of two,
    goes to XLA."""
    del cfg, positions
    if any(t.shape[1] != 1 for t in tokens):
        raise NotImplementedError("the Pallas append kernel writes one token per sequence")
    options = options or DEFAULT_OPTIONS
    widest = max(buffer.shape[-1] for buffer in buffers)
    blocks = options.decode_blocks or profiles.block_sizes("decode", buffers[0].dtype, widest,
                                                           widest)
    if not blocks.append_kernel:
        raise NotImplementedError("decode_blocks.append_kernel is off")
    if packed is not None and blocks.append_packed:
        interpret = options.resolve_interpret()
        if "positions" in packed:
            return kernels.append_step_packed(buffers, packed["sources"], packed["columns"],
                                              packed["positions"], limit=packed["limit"],
                                              interpret=interpret)
        return kernels.append_rows_packed(buffers, packed["sources"], packed["columns"],
                                          packed["rows"], packed["row_columns"],
                                          interpret=interpret)
    return kernels.append_rows(buffers, tuple(t[:, 0] for t in tokens),
                               tuple(i[:, 0] for i in index),
                               interpret=options.resolve_interpret())


def decode_compressed_select(q, k_cmp, v_cmp, cfg: NSAConfig, *, positions, scale,
                             n_sel_blocks: int, options: Optional[PallasOptions] = None):
    """The compressed branch and the selection in two kernels, with no probabilities in between
    (`pallas_kernels.decode_compressed_select`)."""
    _one_query(q, "decode_compressed_select")
    options = options or DEFAULT_OPTIONS
    o_cmp, _, block_idx = kernels.decode_compressed_select(
        q[:, 0], k_cmp, v_cmp, positions[:, 0], cmp_block=cfg.cmp_block,
        cmp_stride=cfg.cmp_stride, sel_block=cfg.sel_block, n_sel=cfg.n_sel, n_init=cfg.n_init,
        n_local=cfg.n_local, n_blocks=n_sel_blocks, scale=scale,
        block_sizes=options.decode_blocks, interpret=options.resolve_interpret())
    return o_cmp[:, None], block_idx[:, None]


def decode_selected_window_attention(q, k_sel, v_sel, block_idx, k_win, v_win, cfg: NSAConfig,
                                     *, positions, scale, window_tokens=None,
                                     options: Optional[PallasOptions] = None):
    _one_query(q, "decode_selected_window")
    if window_tokens is not None:
        raise NotImplementedError("the Pallas decode_selected_window kernel reads the window "
                                  "from the cache's ring only (window_tokens=None)")
    options = options or DEFAULT_OPTIONS
    o_sel, o_win = kernels.decode_selected_window(
        q[:, 0], k_sel, v_sel, block_idx[:, 0], k_win, v_win, positions[:, 0],
        sel_block=cfg.sel_block, window=cfg.window, scale=scale,
        block_sizes=options.decode_blocks, interpret=options.resolve_interpret())
    return o_sel[:, None], o_win[:, None]


def decode_attention(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, cfg: NSAConfig, *, positions,
                     scale, n_sel_blocks: int, block_idx=None, gate=None, q_rows=None,
                     options: Optional[PallasOptions] = None):
    """The three branches in five kernels, one combine for all, which also mixes them by the
    gates where it can (`pallas_kernels.decode_attention`)."""
    _one_query(q, "decode_attention")
    options = options or DEFAULT_OPTIONS
    o_cmp, o_sel, o_win, idx, o = kernels.decode_attention(
        q[:, 0], k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, positions[:, 0],
        cmp_block=cfg.cmp_block, cmp_stride=cfg.cmp_stride, sel_block=cfg.sel_block,
        n_sel=cfg.n_sel, n_init=cfg.n_init, n_local=cfg.n_local, n_blocks=n_sel_blocks,
        window=cfg.window, scale=scale, block_idx=None if block_idx is None else block_idx[:, 0],
        gate=gate, q_rows=q_rows, block_sizes=options.decode_blocks,
        interpret=options.resolve_interpret())
    return (o_cmp[:, None], o_sel[:, None], o_win[:, None], idx[:, None],
            None if o is None else o[:, None])


def decode_compress(rings, buffers, cmp_params, cfg: NSAConfig, *, positions, limit: int,
                    options: Optional[PallasOptions] = None):
    """A step's block compression in one kernel, no `cond` (`pallas_kernels.compress_step`);
    D not a power of two >= 16 declines (the step's `cond` in XLA compresses)."""
    options = options or DEFAULT_OPTIONS
    return kernels.compress_step(rings, buffers, positions, cmp_params, cmp_block=cfg.cmp_block,
                                 cmp_stride=cfg.cmp_stride, limit=limit,
                                 interpret=options.resolve_interpret())


def register() -> None:
    """Register the Pallas branches and decode entries with `nsa_jax.dispatch` under the name
    "pallas", with "xla" for the rest."""
    from nsa_jax.dispatch import register_backend, register_fallback

    register_backend("compressed_attention", "pallas", compressed_attention)
    register_backend("select_blocks", "pallas", select_blocks)
    register_backend("selected_attention", "pallas", selected_attention)
    register_backend("selected_block_mass", "pallas", selected_block_mass)
    register_backend("selected_importance", "pallas", selected_importance)
    register_backend("sliding_window_attention", "pallas", sliding_window_attention)
    register_backend("decode_compressed_attention", "pallas", decode_compressed_attention)
    register_backend("decode_select_blocks", "pallas", decode_select_blocks)
    register_backend("decode_compressed_select", "pallas", decode_compressed_select)
    register_backend("decode_append", "pallas", decode_append)
    register_backend("decode_selected_window_attention", "pallas",
                     decode_selected_window_attention)
    register_backend("decode_attention", "pallas", decode_attention)
    register_backend("decode_compress", "pallas", decode_compress)
    register_fallback("pallas", "xla")
