"""Prefill benchmark: the NSA attention core against full causal attention and peer kernels.

Times forward and forward+backward, and records peak memory, of the *attention core*: given
q [B, S, H, d_k], per-branch k/v [B, S, G, d_k|d_v] and gate logits [B, S, H, 3], it runs
compression (mlp or mean), compressed attention, block selection, selected attention, the sliding
window and the gate combine. The projections (x @ W for q, k, v, gates and the output projection)
are the separate `projections` row, so the kernels are compared on the work they share with full
attention.

Rows (`--rows`, default: every row that can run on the device):
  nsa_jax_pallas       nsa_jax kernel-level functions, backend="pallas", compress="mlp"
  nsa_jax_pallas_window  the same with the Pallas window kernel forced on the window branch
                       (`PallasOptions(window_kernel=True, window_cudnn=False)`; not a default row)
  nsa_jax_xla          the same with backend="xla" (OOM rows are written as "oom")
  nsa_jax_layer        the whole layer, `nsa_attention` with projections (d_model), Pallas
  nsa_jax_pallas_fla   backend="pallas" in fla-org's configuration (below), shared k/v
  nsa_jax_xla_fla      backend="xla" in fla-org's configuration, shared k/v
  nsa_torch            nsa_torch_ref with its fastest registered kernels (Triton selection, FA-2)
  nsa_torch_fla        nsa_torch_ref in fla-org's configuration
  fla_parallel_nsa     fla-org's `parallel_nsa` (peer; needs h = H/G a power of two >= 16)
  cudnn_full           full causal attention, jax.nn.dot_product_attention(implementation="cudnn")
  fa3_full             full causal attention, flash_attn3_jax.flash_mha (FlashAttention-3)
  torch_sdpa_flash     full causal attention, torch SDPA, flash backend
  torch_sdpa_cudnn     full causal attention, torch SDPA, cuDNN backend
  xla_full             full causal attention, jax.nn.dot_product_attention(implementation="xla")
                       (CPU smoke and small S only: it materialises [B, H, S, S])
  projections          x @ [Wq | Wk | Wv | Wg] and o @ Wo at d_model (matmuls only)

fla-org's configuration ("*_fla" rows): mean compression with l = d = l_sel (its
`parallel_nsa` pools non-overlapping blocks of the selection size), one k/v shared by the three
branches, and the forced first block and two local blocks, as ours. That makes its row and ours
the same algorithm, so their times compare like for like.

Each row runs in its own process by default (`--isolate row`): a fresh allocator for the peak
memory figures, and JAX's memory cannot starve the torch rows. After an OOM the row's larger S
are recorded as "oom" without running. Speed-ups are against the first full-attention row that
ran at that S and pass: fa3_full, cudnn_full, torch_sdpa_flash, torch_sdpa_cudnn, xla_full
(`--baseline` picks one).

Selection workloads (`--workload`, bench/workloads.py): random (default; the core's own
selection of the random inputs), coherent (a synthetic selection whose consecutive queries
share `--overlap` of their blocks; `--working-set`, `--drift`), trained_fit (the synthetic
selection fitted to a trained model's statistics) or trained (a saved selection,
`--workload-file`). The NSA
rows pass a forced workload's block_idx to the call a user makes (`block_idx=`, which skips the
selection stage: their note says so); the full-attention rows do not depend on it. Records
carry the workload and the overlap statistics of the blocks (sel_shared, sel_jaccard,
sel_tile_union; for random, those the row's core selects), printed before the table; speed-ups
compare rows of one workload.

A row that needs a call of its own (fla_parallel_nsa's Triton autotuning) runs with its own
--out; `--combine DIR_A,DIR_B --out DIR` then merges runs of one commit on one machine into one
CSV, plot and summary (the first directory's figure wins where two runs measured the same).

Example (GPU): python bench/bench_prefill.py --S_list 8k,16k,32k,64k --out artifacts/bench
CPU smoke:     python bench/bench_prefill.py --device cpu --S_list 64,128 --H 4 --G 2 --dk 16 \
                   --dv 16 --l 8 --d 4 --l_sel 16 --n_sel 4 --w 16 --d_model 32 --dtype float32
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from typing import Any, Callable, Optional

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402  (sets the allocator environment before jax loads)
from bench.common import ERROR, OK, OOM, SKIPPED, Skip  # noqa: E402
from bench.fla_setup import (FLA_MIN_HEADS_PER_GROUP, fla_config,  # noqa: E402
                             install_window_shim)
from bench import workloads  # noqa: E402

COLUMNS = ["bench", "row", "impl", "pass", "S", "B", "H", "G", "dk", "dv", "dtype", "compress",
           "l", "d", "l_sel", "n_sel", "w", "status", "ms", "ms_min", "ms_max", "peak_mb",
           "peak_source", "device_peak_mb", "speedup", "baseline", "note", "device", "workload",
           "sel_shared", "sel_jaccard", "sel_tile_union"]
PASSES = ("fwd", "fwd_bwd")
ROWS = ("nsa_jax_pallas", "nsa_jax_pallas_window", "nsa_jax_xla", "nsa_jax_layer",
        "nsa_jax_pallas_fla", "nsa_jax_xla_fla", "nsa_torch",
        "nsa_torch_fla", "fla_parallel_nsa", "cudnn_full", "fa3_full", "torch_sdpa_flash",
        "torch_sdpa_cudnn", "xla_full", "projections")
DEFAULT_ROWS = {
    "gpu": tuple(r for r in ROWS if r not in ("xla_full", "nsa_jax_pallas_window")),
    "cpu": ("nsa_jax_xla", "nsa_jax_xla_fla", "nsa_torch", "xla_full", "projections"),
}
BASELINES = ("fa3_full", "cudnn_full", "torch_sdpa_flash", "torch_sdpa_cudnn", "xla_full")
# The NSA columns of the full-attention and projection rows, which have none.
NO_NSA = dict(compress="", l="", d="", l_sel="", n_sel="", w="")


# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------
def _base_record(args, row: str, S: int, cfg=None) -> dict[str, Any]:
    cfg = cfg or args.cfg
    return {"bench": "prefill", "row": row, "S": S, "B": args.B, "H": cfg.n_heads,
            "G": cfg.n_kv_heads, "dk": cfg.d_k, "dv": cfg.d_v, "dtype": args.dtype,
            "compress": cfg.compress, "l": cfg.cmp_block, "d": cfg.cmp_stride,
            "l_sel": cfg.sel_block, "n_sel": cfg.n_sel, "w": cfg.window,
            "device": args.device_label, "workload": args.workload}


def _jitted_maker(arrays: Callable) -> Callable[[int], Any]:
    """seed -> arrays(PRNGKey(seed)) as one jitted program (eager jax.random compiles per shape)."""
    import jax

    jitted = jax.jit(arrays)
    return lambda seed: jitted(jax.random.PRNGKey(seed))


def _jax_time_passes(fn: Callable, make_inputs: Callable[[int], tuple], args,
                     base: dict[str, Any], fixed: tuple = (),
                     passes: tuple = PASSES) -> list[dict[str, Any]]:
    """Forward and forward+backward records (those of `passes`) of
    `fn(*inputs, *fixed) -> array [..]`.

    make_inputs(seed) -> (inputs tuple, cotangent); `args.rotate` sets are built and cycled.
    The backward pass differentiates with respect to every input; `fixed` (a workload's
    block_idx) is passed as an argument and not differentiated.
    """
    import jax

    sets = [make_inputs(seed) for seed in range(args.rotate)]
    records = []
    if fixed:
        sets = [(inputs + tuple(fixed), cot) for inputs, cot in sets]
    n_diff = len(sets[0][0]) - len(fixed)

    def fwd_bwd(inputs, cotangent):
        rest = inputs[n_diff:]
        _, pullback = jax.vjp(lambda *diff: fn(*diff, *rest), *inputs[:n_diff])
        return pullback(cotangent)

    # Per pass: the function and, per input set, its positional arguments.
    programs = {"fwd": (fn, [inputs for inputs, _ in sets]),
                "fwd_bwd": (fwd_bwd, [(inputs, cot) for inputs, cot in sets])}
    # forward+backward first: its scratch block is the largest, and once the forward's buffers
    # had come and gone a 24 GB card's allocator found no free run long enough for it (the
    # layer at 64k, paper heads) although the program alone fits.
    # The device's peak is the process's: it belongs to the first pass timed only.
    for i, pass_name in enumerate(sorted(passes, key=lambda name: name != "fwd_bwd")):
        record = dict(base, **{"pass": pass_name})
        try:
            timing, compiled = common.time_jax_fn(*programs[pass_name], iters=args.iters,
                                                  warmup=args.warmup, repeats=args.repeats)
            peak = common.jax_compiled_peak_bytes(compiled)
            record.update(status=OK, **timing.fields(),
                          peak_mb=common.mb(peak), peak_source="xla_memory_analysis",
                          device_peak_mb=common.mb(common.jax_device_peak_bytes()) if i == 0
                          else None)
        except Skip:
            raise
        except Exception as exc:  # OOM and kernel failures become records, not crashes
            record.update(status=common.classify_exception(exc), note=common.short_error(exc))
        records.append(record)
    return sorted(records, key=lambda record: passes.index(record["pass"]))


def nsa_jax_core(cfg, backend: str, options=None):
    """The attention core as a function of (q, k, v per branch, gate logits, compression params),
    and a label of the path each branch takes: `nsa_jax.native_sparse_attention`, the function
    the layer itself calls between its projections (it hands the compressed branch's lse to
    selection). backend="pallas" runs the Pallas kernels where they exist and XLA for the rest
    (compression; the window goes to cuDNN there)."""
    try:
        import nsa_jax
    except ImportError as exc:
        raise Skip(f"nsa_jax not importable ({exc})") from None
    if backend == "pallas":
        label = "nsa_jax.native_sparse_attention backend=pallas (xla where no kernel)"
        if options:
            label += f", options {options['pallas']}"
    else:
        label = f"nsa_jax backend={backend}"

    def core(q, k_cmp_in, v_cmp_in, k_sel, v_sel, k_win, v_win, gate_logits, cmp_params,
             block_idx=None):
        return nsa_jax.native_sparse_attention(
            q, {"cmp": k_cmp_in, "sel": k_sel, "win": k_win},
            {"cmp": v_cmp_in, "sel": v_sel, "win": v_win}, gate_logits, cfg,
            cmp_params=cmp_params or None, gates_are_logits=True, backend=backend,
            options=options, block_idx=block_idx)

    return core, label


def branch_kv(normal, B: int, S: int, G: int, dk: int, dv: int, shared: bool) -> tuple:
    """(k_cmp, v_cmp, k_sel, v_sel, k_win, v_win) drawn with `normal(shape)` (either framework):
    one k / v pair for every branch when `shared`, else a pair per branch."""
    if shared:
        k, v = normal((B, S, G, dk)), normal((B, S, G, dv))
        return (k, v) * 3
    return tuple(normal((B, S, G, dim)) for _ in range(3) for dim in (dk, dv))


def nsa_jax_inputs(cfg, args, S: int, shared_kv: bool):
    """seed -> ((q, k/v per branch, gate logits, compression params), cotangent) of the core."""
    import jax
    import jax.numpy as jnp

    dtype = common.jnp_dtype(args.dtype)
    B, H, G, dk, dv, l = args.B, cfg.n_heads, cfg.n_kv_heads, cfg.d_k, cfg.d_v, cfg.cmp_block

    def arrays(key):
        keys = iter(jax.random.split(key, 20))

        def normal(shape, scale=1.0):
            return (scale * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

        q = normal((B, S, H, dk))
        kv = branch_kv(normal, B, S, G, dk, dv, shared_kv)
        gate_logits = normal((B, S, H, 3))
        cmp_params = {}
        if cfg.compress == "mlp":
            for name, dim in (("cmp_k", dk), ("cmp_v", dv)):
                cmp_params[name] = {"pos": normal((G, l, dim), 0.02),
                                    "w1": normal((G, l * dim, dim), 1 / math.sqrt(l * dim)),
                                    "b1": jnp.zeros((G, dim), dtype),
                                    "w2": normal((G, dim, dim), 1 / math.sqrt(dim)),
                                    "b2": jnp.zeros((G, dim), dtype)}
        cotangent = normal((B, S, H, dv))
        return (q, *kv, gate_logits, cmp_params), cotangent

    return _jitted_maker(arrays)


FORCED_NOTE = "block_idx forced: no selection stage"


def workload_fields(args, cfg, B: int, S: int, selection=None) -> tuple[dict[str, Any], Any]:
    """(the records' workload fields, the workload's block_idx or None) of a row at S: the
    overlap statistics of the forced block_idx, or of `selection()` (the blocks the row selects
    itself, computed on request) for the random workload; empty when neither is given."""
    block_idx = workloads.prefill_block_idx(args, cfg, B, S)
    fields: dict[str, Any] = {"workload": args.workload}
    blocks = block_idx if block_idx is not None else (selection() if selection else None)
    if blocks is not None:
        stats = workloads.overlap_stats(blocks)
        fields.update(sel_shared=stats["shared"], sel_jaccard=stats["jaccard"],
                      sel_tile_union=stats["tile_union"])
    if block_idx is not None:
        fields["note"] = FORCED_NOTE
    return fields, block_idx


def run_nsa_jax(args, S: int, backend: str, fla_like: bool, row: str, options=None):
    if backend == "pallas" and args.device != "gpu":
        raise Skip("Pallas kernels need a GPU (interpret mode is not a timing)")
    import jax.numpy as jnp

    cfg = fla_config(args.cfg) if fla_like else args.cfg
    core, label = nsa_jax_core(cfg, backend, options)
    make = nsa_jax_inputs(cfg, args, S, shared_kv=fla_like)

    def own_selection():
        inputs, _ = make(0)
        q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gate_logits, cmp_params = inputs
        return workloads.core_selection(
            q, {"cmp": k_cmp, "sel": k_sel, "win": k_win},
            {"cmp": v_cmp, "sel": v_sel, "win": v_win}, gate_logits, cfg,
            cmp_params=cmp_params, backend=backend)

    fields, block_idx = workload_fields(args, cfg, args.B, S, own_selection)
    base = dict(_base_record(args, row, S, cfg), impl=label, **fields)
    fixed = () if block_idx is None else (jnp.asarray(block_idx),)
    return _jax_time_passes(core, make, args, base, fixed)


def run_nsa_layer(args, S: int, row: str):
    """The whole layer as a user calls it: `nsa_attention(params, x, cfg, backend=...)` with
    its projections, RoPE, gates and output projection; forward+backward differentiates with
    respect to the parameters and x."""
    if args.device != "gpu":
        raise Skip("the layer row times the Pallas kernels: GPU only")
    import jax
    import jax.numpy as jnp
    import nsa_jax

    cfg = args.cfg
    dtype = common.jnp_dtype(args.dtype)

    def arrays(key):
        k_params, k_x, k_cot = jax.random.split(key, 3)
        params = nsa_jax.init_params(k_params, cfg, dtype=dtype)
        x = jax.random.normal(k_x, (args.B, S, cfg.d_model), jnp.float32).astype(dtype)
        cotangent = jax.random.normal(k_cot, (args.B, S, cfg.d_model), jnp.float32).astype(dtype)
        return (params, x), cotangent

    def layer(params, x, block_idx=None):
        return nsa_jax.nsa_attention(params, x, cfg, backend=("pallas", "xla"),
                                     block_idx=block_idx)

    fields, block_idx = workload_fields(args, cfg, args.B, S)
    base = dict(_base_record(args, row, S, cfg),
                impl=f"nsa_jax.nsa_attention backend=(pallas,xla) d_model={cfg.d_model}",
                **fields)
    fixed = () if block_idx is None else (jnp.asarray(block_idx),)
    return _jax_time_passes(layer, _jitted_maker(arrays), args, base, fixed)


def _full_jax_inputs(args, S: int):
    import jax
    import jax.numpy as jnp

    dtype = common.jnp_dtype(args.dtype)
    B, H, G, dk, dv = args.B, args.cfg.n_heads, args.cfg.n_kv_heads, args.cfg.d_k, args.cfg.d_v

    def arrays(key):
        kq, kk, kv, kc = jax.random.split(key, 4)
        q = jax.random.normal(kq, (B, S, H, dk), jnp.float32).astype(dtype)
        k = jax.random.normal(kk, (B, S, G, dk), jnp.float32).astype(dtype)
        v = jax.random.normal(kv, (B, S, G, dv), jnp.float32).astype(dtype)
        cotangent = jax.random.normal(kc, (B, S, H, dv), jnp.float32).astype(dtype)
        return (q, k, v), cotangent

    return _jitted_maker(arrays)


def _pad_values(full, args, framework: str = "jax"):
    """Full attention with d_v < d_k through kernels that need one head size (cuDNN via
    jax.nn.dot_product_attention, FlashAttention-3, torch's SDPA flash): v is zero-padded to d_k
    and the output cut back to d_v, the usual way of running the paper's 192/128 heads on them.
    Exact, and the padding's cost stays in the baseline's time (it does d_k instead of d_v work
    on P @ V). `framework`: "jax" or "torch" (the arrays `full` takes). Returns (fn, note)."""
    dk, dv = args.cfg.d_k, args.cfg.d_v
    if dv == dk:
        return full, ""
    if dv > dk:
        raise Skip(f"d_v ({dv}) > d_k ({dk}): no padding scheme for this baseline")
    if framework == "torch":
        import torch.nn.functional as F

        def pad(v):
            return F.pad(v, (0, dk - dv))
    else:
        import jax.numpy as jnp

        def pad(v):
            return jnp.pad(v, [(0, 0)] * 3 + [(0, dk - dv)])

    def padded(q, k, v):
        return full(q, k, pad(v))[..., :dv]

    return padded, f"v zero-padded from d_v {dv} to d_k {dk}"


def run_dot_product_attention(args, S: int, implementation: str, row: str):
    import jax

    if implementation == "cudnn" and args.device != "gpu":
        raise Skip("cuDNN needs a GPU")
    if implementation == "cudnn" and args.dtype == "float32":
        raise Skip("cuDNN flash attention takes bf16/fp16 only")

    def full(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                            implementation=implementation)

    full, note = _pad_values(full, args)
    base = dict(_base_record(args, row, S), impl=f"jax.nn.dot_product_attention[{implementation}]",
                **NO_NSA, note=note)
    return _jax_time_passes(full, _full_jax_inputs(args, S), args, base)


def run_fa3(args, S: int, row: str):
    if args.device != "gpu":
        raise Skip("FlashAttention-3 needs a Hopper GPU")
    if args.dtype == "float32":
        raise Skip("FlashAttention-3 takes bf16/fp16 only")
    try:
        from flash_attn3_jax import flash_mha
    except ImportError as exc:
        raise Skip(f"flash_attn3_jax not importable ({exc})") from None

    def full(q, k, v):
        return flash_mha(q, k, v, is_causal=True)

    full, note = _pad_values(full, args)
    base = dict(_base_record(args, row, S), impl="flash_attn3_jax.flash_mha", **NO_NSA,
                note=note)
    return _jax_time_passes(full, _full_jax_inputs(args, S), args, base)


def run_projections(args, S: int, row: str):
    """x @ [Wq | Wk (3 branches) | Wv (3 branches) | Wg] and o @ Wo: the layer's matmuls."""
    import jax
    import jax.numpy as jnp

    dtype = common.jnp_dtype(args.dtype)
    cfg = args.cfg
    H, G, dk, dv, D = cfg.n_heads, cfg.n_kv_heads, cfg.d_k, cfg.d_v, cfg.d_model
    width_in = H * dk + 3 * G * (dk + dv) + 3 * H

    def projections(x, w_in, o, w_out):
        return (x @ w_in).sum(axis=-1) + (o @ w_out).sum(axis=-1)

    def arrays(key):
        keys = jax.random.split(key, 5)
        x = jax.random.normal(keys[0], (args.B, S, D), jnp.float32).astype(dtype)
        w_in = (jax.random.normal(keys[1], (D, width_in), jnp.float32) / math.sqrt(D)).astype(dtype)
        o = jax.random.normal(keys[2], (args.B, S, H * dv), jnp.float32).astype(dtype)
        w_out = (jax.random.normal(keys[3], (H * dv, D), jnp.float32)
                 / math.sqrt(H * dv)).astype(dtype)
        cotangent = jax.random.normal(keys[4], (args.B, S), jnp.float32).astype(dtype)
        return (x, w_in, o, w_out), cotangent

    make = _jitted_maker(arrays)
    base = dict(_base_record(args, row, S), impl=f"jnp matmuls d_model={D}", **NO_NSA,
                note="RoPE and reshapes not included")
    return _jax_time_passes(projections, make, args, base)


# ---------------------------------------------------------------------------------------------
# torch rows
# ---------------------------------------------------------------------------------------------
def _torch_time_passes(fn: Callable, make_inputs: Callable[[int], tuple], args,
                       base: dict[str, Any], device: str,
                       passes: tuple = PASSES) -> list[dict[str, Any]]:
    """Forward (no autograd) and forward+backward records (those of `passes`) of
    `fn(*inputs) -> tensor`."""
    import torch

    sets = [make_inputs(seed) for seed in range(args.rotate)]
    cuda = device == "cuda"
    records = []

    def forward(i):
        with torch.no_grad():
            return fn(*sets[i % len(sets)][0])

    def forward_backward(i):
        inputs, cotangent = sets[i % len(sets)]
        out = fn(*inputs)
        return torch.autograd.grad(out, [x for x in inputs if x.requires_grad], cotangent)

    for pass_name, step in (("fwd", forward), ("fwd_bwd", forward_backward)):
        if pass_name not in passes:
            continue
        record = dict(base, **{"pass": pass_name})
        try:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            timing = common.time_torch(step, iters=args.iters, warmup=args.warmup,
                                       repeats=args.repeats, device=device)
            record.update(status=OK, **timing.fields())
            if cuda:
                record.update(peak_mb=common.mb(torch.cuda.max_memory_allocated()),
                              peak_source="torch.cuda.max_memory_allocated")
        except Skip:
            raise
        except Exception as exc:
            record.update(status=common.classify_exception(exc), note=common.short_error(exc))
            if cuda:
                torch.cuda.empty_cache()
        records.append(record)
    return records


def _torch_normal(torch, shape, dtype, device, generator, scale=1.0, grad=True):
    x = (torch.randn(shape, generator=generator, device=device, dtype=torch.float32) * scale)
    return x.to(dtype).requires_grad_(grad)


def _torch_qkv(args, S: int, device, dtype, seed: int, gates: bool = False):
    """(q, k, v[, gate logits]) and the output's cotangent, as torch tensors of the run's shapes."""
    import torch

    B, H, G, dk, dv = args.B, args.cfg.n_heads, args.cfg.n_kv_heads, args.cfg.d_k, args.cfg.d_v
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = [(B, S, H, dk), (B, S, G, dk), (B, S, G, dv)] + ([(B, S, H, 3)] if gates else [])
    inputs = tuple(_torch_normal(torch, shape, dtype, device, gen) for shape in shapes)
    return inputs, torch.randn((B, S, H, dv), generator=gen, device=device).to(dtype)


# The nsa_torch row's kernel per branch on a GPU: the fast paths nsa_torch_ref registers
# (`nsa_torch_ref.fast.routing`); "sdpa", the reference, elsewhere. `--torch_backends` overrides.
TORCH_BRANCH_KEYS = {"cmp": "compressed_attention", "sel": "selected_attention",
                     "win": "sliding_window_attention"}
TORCH_FAST_BACKENDS = {"cmp": "fa2", "sel": "triton", "win": "fa2"}


def torch_backends(args) -> dict[str, str]:
    """{branch key (cmp, sel, win): nsa_torch_ref dispatch backend name}."""
    default = TORCH_FAST_BACKENDS if args.device == "gpu" else {}
    chosen = {key: default.get(key, "sdpa") for key in TORCH_BRANCH_KEYS}
    if args.torch_backends:
        for item in args.torch_backends.split(","):
            key, _, name = item.partition("=")
            if key.strip() not in TORCH_BRANCH_KEYS or not name.strip():
                raise ValueError(f"--torch_backends ({args.torch_backends!r}) must look like "
                                 f"cmp=fa2,sel=triton,win=fa2")
            chosen[key.strip()] = name.strip()
    return chosen


def run_nsa_torch(args, S: int, fla_like: bool, row: str):
    """nsa_torch_ref's attention core (`nsa_torch_ref.native_sparse_attention`: compression,
    selection and the three branches through its dispatch, then the gates), the counterpart of
    the nsa_jax core rows."""
    torch, device, dtype = common.torch_device(args)
    try:
        from nsa_torch_ref import dispatch, native_sparse_attention
    except ImportError as exc:
        raise Skip(f"nsa_torch_ref not importable ({exc})") from None
    cfg = fla_config(args.cfg) if fla_like else args.cfg
    backends = torch_backends(args)
    kernels = dispatch.resolve_all({TORCH_BRANCH_KEYS[k]: name for k, name in backends.items()})
    mlp = cfg.compress == "mlp"
    names = ("pos", "w1", "b1", "w2", "b2")
    fields, block_idx = workload_fields(args, cfg, args.B, S)
    forced = None if block_idx is None else torch.as_tensor(block_idx, device=device)

    def core(q, k_cmp_in, v_cmp_in, k_sel, v_sel, k_win, v_win, gate_logits, *cmp_tensors):
        cmp_params = ({"cmp_k": dict(zip(names, cmp_tensors[:5])),
                       "cmp_v": dict(zip(names, cmp_tensors[5:]))} if mlp else None)
        return native_sparse_attention(q, {"cmp": k_cmp_in, "sel": k_sel, "win": k_win},
                                       {"cmp": v_cmp_in, "sel": v_sel, "win": v_win},
                                       gate_logits, cfg, cmp_params=cmp_params,
                                       gates_are_logits=True, kernels=kernels,
                                       block_idx=forced)

    B, H, G, dk, dv, l = args.B, cfg.n_heads, cfg.n_kv_heads, cfg.d_k, cfg.d_v, cfg.cmp_block

    def make(seed: int):
        gen = torch.Generator(device=device).manual_seed(seed)
        normal = lambda shape, scale=1.0: _torch_normal(torch, shape, dtype, device, gen, scale)  # noqa: E731
        q = normal((B, S, H, dk))
        kv = branch_kv(normal, B, S, G, dk, dv, fla_like)
        cmp_tensors = []
        if mlp:
            for dim in (dk, dv):
                cmp_tensors += [normal((G, l, dim), 0.02),
                                normal((G, l * dim, dim), 1 / math.sqrt(l * dim)),
                                normal((G, dim), 0.0), normal((G, dim, dim), 1 / math.sqrt(dim)),
                                normal((G, dim), 0.0)]
        inputs = (q, *kv, normal((B, S, H, 3)), *cmp_tensors)
        cotangent = torch.randn((B, S, H, dv), generator=gen, device=device).to(dtype)
        return inputs, cotangent

    base = dict(_base_record(args, row, S, cfg), **fields)
    base["impl"] = "nsa_torch_ref " + " ".join(f"{key}={name}" for key, name in backends.items())
    return _torch_time_passes(core, make, args, base, device)


def run_torch_sdpa(args, S: int, backend: str, row: str):
    torch, device, dtype = common.torch_device(args)
    if device != "cuda":
        raise Skip(f"SDPA {backend} backend needs a GPU")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    sdp_backend = {"flash": SDPBackend.FLASH_ATTENTION,
                   "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    h = args.cfg.heads_per_group
    expand = {"gqa": True}

    def full(q, k, v):
        q_, k_, v_ = (t.transpose(1, 2) for t in (q, k, v))  # BTHD -> BHTD (views)
        with sdpa_kernel(sdp_backend):
            if expand["gqa"]:
                o = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, enable_gqa=h > 1)
            else:
                o = F.scaled_dot_product_attention(q_, k_.repeat_interleave(h, dim=1),
                                                   v_.repeat_interleave(h, dim=1), is_causal=True)
        return o.transpose(1, 2)

    def make(seed: int):
        return _torch_qkv(args, S, device, dtype, seed)

    # The flash backend takes one head size: the paper's d_v 128 < d_k 192 runs with v padded.
    full, pad_note = _pad_values(full, args, "torch") if backend == "flash" else (full, "")
    note = ""
    try:  # some backends refuse enable_gqa: fall back to expanded K/V (counted in the timing)
        inputs, _ = make(0)
        with torch.no_grad():
            full(*inputs)
        del inputs
    except RuntimeError:
        expand["gqa"] = False
        note = "K/V expanded to H heads inside the timed call (backend refused enable_gqa)"
    note = "; ".join(n for n in (pad_note, note) if n)
    base = dict(_base_record(args, row, S), impl=f"torch SDPA[{backend}]", **NO_NSA, note=note)
    return _torch_time_passes(full, make, args, base, device)


def run_fla(args, S: int, row: str):
    torch, device, dtype = common.torch_device(args)
    if device != "cuda":
        raise Skip("fla-org parallel_nsa is Triton on a GPU")
    h = args.cfg.heads_per_group
    if h < FLA_MIN_HEADS_PER_GROUP or h & (h - 1):
        raise Skip(f"fla-org parallel_nsa needs h = H/G a power of two >= "
                   f"{FLA_MIN_HEADS_PER_GROUP} (h = {h})")
    try:
        from fla.ops.nsa import parallel as fla_parallel
        from fla.ops.nsa import parallel_nsa
    except ImportError as exc:
        raise Skip(f"fla not importable ({exc})") from None
    cfg = fla_config(args.cfg)
    impl = f"fla.ops.nsa.parallel_nsa (window: {install_window_shim(fla_parallel)})"
    fields, block_idx = workload_fields(args, cfg, args.B, S)
    forced = (None if block_idx is None
              else torch.as_tensor(block_idx, device=device, dtype=torch.int32))

    def nsa(q, k, v, gate_logits):
        gates = torch.sigmoid(gate_logits.float()).to(q.dtype)
        return parallel_nsa(q, k, v, g_cmp=gates[..., 0], g_slc=gates[..., 1],
                            g_swa=gates[..., 2], block_indices=forced, block_counts=cfg.n_sel,
                            block_size=cfg.sel_block, window_size=cfg.window)

    def make(seed: int):
        return _torch_qkv(args, S, device, dtype, seed, gates=True)

    base = dict(_base_record(args, row, S, cfg), impl=impl, **fields)
    return _torch_time_passes(nsa, make, args, base, device)


def _window_kernel_options():
    """The Pallas window kernel, run even where FA-3 or cuDNN would take the window."""
    import nsa_jax
    return {"pallas": nsa_jax.PallasOptions(window_kernel=True, window_cudnn=False)}


ROW_RUNNERS: dict[str, Callable] = {
    "nsa_jax_pallas": lambda a, S, r: run_nsa_jax(a, S, "pallas", False, r),
    "nsa_jax_pallas_window": lambda a, S, r: run_nsa_jax(a, S, "pallas", False, r,
                                                         _window_kernel_options()),
    "nsa_jax_xla": lambda a, S, r: run_nsa_jax(a, S, "xla", False, r),
    "nsa_jax_layer": run_nsa_layer,
    "nsa_jax_pallas_fla": lambda a, S, r: run_nsa_jax(a, S, "pallas", True, r),
    "nsa_jax_xla_fla": lambda a, S, r: run_nsa_jax(a, S, "xla", True, r),
    "nsa_torch": lambda a, S, r: run_nsa_torch(a, S, False, r),
    "nsa_torch_fla": lambda a, S, r: run_nsa_torch(a, S, True, r),
    "fla_parallel_nsa": run_fla,
    "cudnn_full": lambda a, S, r: run_dot_product_attention(a, S, "cudnn", r),
    "fa3_full": run_fa3,
    "torch_sdpa_flash": lambda a, S, r: run_torch_sdpa(a, S, "flash", r),
    "torch_sdpa_cudnn": lambda a, S, r: run_torch_sdpa(a, S, "cudnn", r),
    "xla_full": lambda a, S, r: run_dot_product_attention(a, S, "xla", r),
    "projections": run_projections,
}
assert set(ROW_RUNNERS) == set(ROWS)


def run_row(args, row: str, on_record: Optional[Callable[[list], None]] = None) -> list[dict]:
    """Every S of one row, smallest first; an OOM marks the larger S "oom" without running them."""
    records: list[dict] = []
    oom_from: Optional[int] = None
    for S in sorted(args.S):
        if oom_from is not None:
            records += [dict(_base_record(args, row, S), **{"pass": p}, status=OOM,
                             note=f"not run: oom at S={oom_from}") for p in PASSES]
            continue
        try:
            new = ROW_RUNNERS[row](args, S, row)
        except Skip as why:
            new = [dict(_base_record(args, row, S), **{"pass": p}, status=SKIPPED,
                        note=f"skipped: {why}") for p in PASSES]
        except Exception as exc:
            status = common.classify_exception(exc)
            new = [dict(_base_record(args, row, S), **{"pass": p}, status=status,
                        note=common.short_error(exc)) for p in PASSES]
        if any(r["status"] == OOM for r in new) and all(r["status"] != OK for r in new):
            oom_from = S
        for note in dict.fromkeys(r["note"] for r in new if r["status"] == SKIPPED):
            print(f"{row} S={S}: {note}", flush=True)
        records += new
        if on_record:
            on_record(records)
        if all(r["status"] == SKIPPED for r in new):
            # A skip does not depend on S: record the rest without trying again.
            for S_rest in [s for s in sorted(args.S) if s > S]:
                records += [dict(r, S=S_rest) for r in new]
            break
    return records


# ---------------------------------------------------------------------------------------------
# Summary, CSV, plot
# ---------------------------------------------------------------------------------------------
def workload_of(record: dict) -> str:
    """A record's workload; "random" for records written before the column existed."""
    return record.get("workload") or "random"


def add_speedups(records: list[dict], baseline: Optional[str]) -> None:
    """Fill `speedup` (baseline ms / row ms) and `baseline` for every ok record, against the
    baseline row of the same run's workload."""
    ok = {(r["row"], r["S"], r["pass"], workload_of(r)): r for r in records
          if r.get("status") == OK}
    for record in records:
        if record.get("status") != OK or record["row"] == "projections":
            continue
        candidates = [baseline] if baseline else BASELINES
        for name in candidates:
            ref = ok.get((name, record["S"], record["pass"], workload_of(record)))
            if ref and ref.get("ms"):
                record["speedup"] = ref["ms"] / record["ms"]
                record["baseline"] = name
                break


LATEST_COLUMNS = ["row", "S", "fwd_ms", "fwd_bwd_ms", "peak_mb", "device", "commit", "status",
                  "workload"]


WORKLOAD_ORDER = workloads.WORKLOADS


def _row_order(key: tuple) -> tuple:
    """Sort key of (row, S, workload): the ROWS order, then S, then the workload."""
    row, S, workload = key
    return (ROWS.index(row) if row in ROWS else len(ROWS), S,
            WORKLOAD_ORDER.index(workload) if workload in WORKLOAD_ORDER else len(WORKLOAD_ORDER))


def latest_rows(records: list[dict], commit: str) -> list[dict]:
    """One line per (row, S, workload) for `bench/results/prefill_latest.csv`: both passes'
    times, the larger peak, and in `status` why a pass did not run (empty when both ran)."""
    by_key: dict[tuple, dict] = {}
    for r in records:
        by_key.setdefault((r["row"], int(r["S"]), workload_of(r)), {})[r["pass"]] = r
    lines = []
    for (row, S, workload), passes in sorted(by_key.items(), key=lambda kv: _row_order(kv[0])):
        ms = {p: (common.to_float(passes[p].get("ms")) if p in passes
                  and passes[p].get("status") == OK else None) for p in PASSES}
        peaks = [common.to_float(r.get("peak_mb")) for r in passes.values()]
        peaks = [p for p in peaks if p is not None]
        problems = [f"{p}: {passes[p].get('status')} {passes[p].get('note') or ''}".strip()
                    for p in PASSES if p in passes and passes[p].get("status") != OK]
        device = next((r.get("device") for r in passes.values() if r.get("device")), "")
        lines.append({"row": row, "S": S, "fwd_ms": ms["fwd"], "fwd_bwd_ms": ms["fwd_bwd"],
                      "peak_mb": max(peaks) if peaks else None, "device": device,
                      "commit": commit[:12], "status": "; ".join(problems),
                      "workload": workload})
    return lines


def workload_lines(records: list[dict]) -> list[str]:
    """One line per (workload, S, row) whose records carry overlap statistics."""
    lines, seen = [], set()
    for r in records:
        if common.to_float(r.get("sel_shared")) is None:
            continue
        key = (workload_of(r), int(r["S"]), r["row"])
        if key in seen:
            continue
        seen.add(key)
        stats = {name: common.to_float(r.get(f"sel_{name}"))
                 for name in ("shared", "jaccard", "tile_union")}
        lines.append(f"workload {key[0]}, S={key[1]}, {key[2]}: "
                     f"{workloads.format_stats(stats)}")
    return lines


def summary_table(records: list[dict]) -> str:
    by_key: dict[tuple, dict] = {}
    for r in records:
        by_key.setdefault((r["row"], int(r["S"]), workload_of(r)), {})[r["pass"]] = r
    rows = []
    for (row, S, workload), passes in sorted(by_key.items(), key=lambda kv: _row_order(kv[0])):
        fwd, both = passes.get("fwd", {}), passes.get("fwd_bwd", {})

        def value(r, key):
            return common.to_float(r.get(key)) if r.get("status") == OK else None

        statuses = {r.get("status") for r in (fwd, both) if r}
        status = OK if statuses == {OK} else ",".join(sorted(s for s in statuses if s))
        rows.append([row, S, value(fwd, "ms"), value(both, "ms"), value(both, "peak_mb"),
                     value(fwd, "speedup"), value(both, "speedup"),
                     fwd.get("baseline") or both.get("baseline") or "-", status, workload])
    header = ["row", "S", "fwd_ms", "fwd_bwd_ms", "fwd_bwd_peak_mb", "speedup_fwd",
              "speedup_fwd_bwd", "baseline", "status", "workload"]
    return common.format_table(rows, header)


def plot(records: list[dict], path: str, title: str) -> None:
    panels = []
    for pass_name in PASSES:
        latency: dict[str, list] = {}
        speedup: dict[str, list] = {}
        for r in records:
            if r["pass"] != pass_name or r.get("status") != OK:
                continue
            label = (r["row"] if workload_of(r) == "random"
                     else f"{r['row']} ({workload_of(r)})")
            latency.setdefault(label, []).append((int(r["S"]), common.to_float(r["ms"])))
            if r.get("speedup") is not None and r["row"] not in (*BASELINES, "projections"):
                speedup.setdefault(label, []).append((int(r["S"]),
                                                      common.to_float(r["speedup"])))
        label = "forward" if pass_name == "fwd" else "forward + backward"
        panels.append({"title": f"{label}: latency", "xlabel": "context length S",
                       "ylabel": "ms (median)", "series": latency, "logy": True})
        panels.append({"title": f"{label}: speed-up over full attention",
                       "xlabel": "context length S", "ylabel": "x faster", "series": speedup,
                       "logy": False, "hline": 1.0})
    common.plot_lines(path, panels, title)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = common.script_parser(__doc__)
    p.add_argument("--S_list", default="8k,16k,32k,64k",
                   help="context lengths, comma list; 'k' = 1024 (add 128k when memory allows)")
    p.add_argument("--B", type=int, default=1, help="batch size")
    common.add_run_args(p, iters=20, warmup=3, repeats=5, rotate=3)
    common.add_nsa_args(p)
    p.add_argument("--rows", default=None,
                   help=f"comma subset of: {','.join(ROWS)} (default: all for the device)")
    p.add_argument("--out", default="artifacts/bench", help="directory for CSV, PNG, env, summary")
    p.add_argument("--torch_backends", default=None,
                   help="nsa_torch backends, e.g. cmp=fa2,sel=triton,win=fa2 (default: fastest)")
    p.add_argument("--baseline", default=None, choices=BASELINES,
                   help="full-attention row for the speed-ups (default: first that ran)")
    p.add_argument("--isolate", default="row", choices=("row", "none"),
                   help="run each row in its own process (default) or all in this one")
    p.add_argument("--row_timeout", type=float, default=900.0, help="seconds per isolated row")
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    p.add_argument("--combine", default=None,
                   help="comma list of earlier --out directories: merge their results into --out "
                        "instead of running (the first directory wins where two measured the same)")
    workloads.add_workload_args(p)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker_out", default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv=None):
    parser = build_parser()
    args = common.finish_args(parser.parse_args(argv))
    workloads.check_workload_args(args)
    args.S = common.parse_int_list(args.S_list, "--S_list")
    if args.B <= 0:
        raise ValueError(f"--B ({args.B}) must be positive")
    args.rows = common.parse_rows(args.rows, ROWS, DEFAULT_ROWS[args.device])
    return args


def main(argv=None) -> int:
    argv, args = common.start(parse_args, argv)

    if args.combine:
        csv_path, table, title = combine_runs(
            [d.strip() for d in args.combine.split(",") if d.strip()], args.out, args.baseline)
        print(f"wrote {csv_path} and the plot, summary beside it")
        print(title)
        print(table)
        return 0

    if args.worker:  # one isolated row: write its records and leave
        records = run_row(args, args.worker,
                          on_record=lambda recs: common.save_records(args.worker_out, recs))
        common.save_records(args.worker_out, records)
        return 0

    os.makedirs(args.out, exist_ok=True)
    env = common.write_environment(os.path.join(args.out, "prefill_env.json"),
                                   {"argv": argv, "device_label": args.device_label})
    records: list[dict] = []
    script = os.path.abspath(__file__)
    with tempfile.TemporaryDirectory(prefix="bench_prefill_") as tmp_dir:
        for row in common.progress(args.rows, desc="prefill rows", enabled=not args.no_progress):
            if args.isolate == "row":
                new, failure = common.run_row_subprocess(script, argv, row, args.row_timeout,
                                                         tmp_dir)
                done = {(r["S"], r["pass"]) for r in new}
                for S in args.S:
                    for p in PASSES:
                        if (S, p) not in done:
                            status = common.failure_status(failure)
                            new.append(dict(_base_record(args, row, S), **{"pass": p},
                                            status=status, note=failure or "no result"))
                records += new
            else:
                records += run_row(args, row)
            write_outputs(args, records, env)
    csv_path, table, title = write_outputs(args, records, env)
    for line in workload_lines(records):
        print(line)
    print(f"wrote {csv_path} and the plot, summary beside it")
    print(title)
    print(table)
    return 0


def _title(B, H, G, dk, dv, dtype, device_label, commit: str) -> str:
    return (f"NSA prefill: B={B} H={H} G={G} dk={dk} dv={dv} {dtype} on {device_label} "
            f"(commit {commit[:10]})")


def write_outputs(args, records: list[dict], env: dict) -> tuple[str, str, str]:
    """Write the CSV, the latest-figures CSV, the plot and the summary of `records` (called after
    every row, so a run cut short keeps what it measured); returns the CSV path, table, title."""
    cfg = args.cfg
    title = _title(args.B, cfg.n_heads, cfg.n_kv_heads, cfg.d_k, cfg.d_v, args.dtype,
                   args.device_label, env["commit"])
    return _write_records(args.out, records, env["commit"], title, args.baseline)


def _write_records(out: str, records: list[dict], commit: str, title: str,
                   baseline: Optional[str]) -> tuple[str, str, str]:
    records = [dict(r) for r in records]
    add_speedups(records, baseline)
    csv_path = os.path.join(out, "prefill.csv")
    common.write_csv(csv_path, records, COLUMNS)
    common.write_csv(os.path.join(out, "prefill_latest.csv"), latest_rows(records, commit),
                     LATEST_COLUMNS)
    plot(records, os.path.join(out, "prefill.png"), title)
    table = summary_table(records)
    with open(os.path.join(out, "prefill_summary.txt"), "w") as f:
        f.write(title + "\n\n" + "".join(line + "\n" for line in workload_lines(records))
                + "\n" + table + "\n")
    return csv_path, table, title


# The fields that every row of one combined table must share (the NSA fields may differ: the
# "*_fla" rows run fla-org's configuration).
SHARED_FIELDS = ("B", "H", "G", "dk", "dv", "dtype", "device")


def combine_runs(dirs: list[str], out: str, baseline: Optional[str] = None
                 ) -> tuple[str, str, str]:
    """One set of outputs (CSV, latest CSV, plot, summary) in `out` from several runs of this
    script, given their --out directories: for rows that need a call of their own on the same
    machine (fla_parallel_nsa's autotuning). Where runs measured the same (row, S,
    pass), the first directory's record is kept. The runs must share the commit and the
    SHARED_FIELDS; anything else is a ValueError naming --combine."""
    if len(dirs) < 2:
        raise ValueError(f"--combine needs two or more run directories, got {dirs}")
    commits, records, seen, shared = set(), [], set(), {f: set() for f in SHARED_FIELDS}
    for d in dirs:
        env_path, csv_path = (os.path.join(d, "prefill_env.json"), os.path.join(d, "prefill.csv"))
        for path in (env_path, csv_path):
            if not os.path.isfile(path):
                raise ValueError(f"--combine: {path} does not exist (not a bench_prefill --out?)")
        with open(env_path) as f:
            commits.add(json.load(f).get("commit"))
        for r in common.read_csv(csv_path):
            for field in SHARED_FIELDS:
                shared[field].add(r.get(field))
            r["workload"] = workload_of(r)
            key = (r["row"], r["S"], r["pass"], r["workload"])
            if key in seen:
                continue
            seen.add(key)
            for field in ("ms", "ms_min", "ms_max", "peak_mb", "device_peak_mb", "sel_shared",
                          "sel_jaccard", "sel_tile_union"):
                r[field] = common.to_float(r.get(field))
            r["speedup"], r["baseline"] = None, None
            records.append(r)
    if len(commits) != 1:
        raise ValueError("--combine: the runs are of different commits "
                         f"{sorted(map(str, commits))}")
    for field, values in shared.items():
        if len(values) > 1:
            raise ValueError(f"--combine: the runs differ in {field}: {sorted(map(str, values))}")
    first = records[0] if records else {f: "?" for f in SHARED_FIELDS}
    commit = commits.pop() or "unknown"
    title = _title(*(first[f] for f in SHARED_FIELDS), commit)
    os.makedirs(out, exist_ok=True)
    return _write_records(out, records, commit, title, baseline)


if __name__ == "__main__":
    sys.exit(main())
