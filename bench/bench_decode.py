"""Decode benchmark: per-step time of nsa_jax's jitted `decode_step` at context S, its per-branch
breakdown, the tokens it reads against the paper's formula, and a full-attention decode baseline.

Per point (B, S):
  nsa_jax / full   `decode_step` (donated cache, so the appends are in place) for the token at
                   position S, with the cache carried from step to step; x_t cycles over
                   `--rotate` buffers. Reads come from decode_step's `reads` at t = S, against
                   `nsa_common.decode_read_bound` (the paper's Table 4 formula).
  nsa_jax / cmp|sel|win
                   the same step with only that branch's attention (same projections, cache
                   appends and output projection; the other branch outputs are zeros): its time
                   as a share of the full step is the breakdown. `sel` includes the compressed
                   scores it ranks (selection cannot run without them). With --backend pallas
                   (the GPU default) the selected and window branches share one kernel: `sel`
                   includes the window's reads, `win` runs that kernel with no blocks selected.
                   These are `nsa_jax.decode.decode_step_branches`, the library's own hook.
  nsa_jax / base   the step with no attention at all (projections, appends, gates, output), so
                   `attn_ms = ms - base_ms` isolates each branch's attention.
  full_<impl>      a full-attention layer step at the same B and S: one q/k/v projection GEMM,
                   in-place cache append, single-query attention over the S + 1 cached tokens, output
                   projection. impl: fa3 (flash_attn3_jax.flash_mha_with_kvcache; needs bf16/fp16
                   and d_k <= 128), cudnn (jax.nn.dot_product_attention with
                   key_value_seq_lengths), xla (the same, XLA), fa2 (the same step in torch,
                   attention by torch's FlashAttention-2 kernel, SDPA's flash backend, over the
                   live part of the cache; `--loop_steps` steps captured in one CUDA graph, as a
                   torch server graphs its generation loop, the replay's time / loop_steps: the
                   full attention an RTX 4090 or an A100 has); with d_v < d_k the v cache holds
                   d_k columns, zeros past d_v, since each takes d_v = d_k only. The same step
                   with q in place of the attention's output is timed too: its `attn_ms` is the
                   attention's own cost, and `attn_speedup` (on the NSA row) compares the two
                   attentions alone.

Timing (--timing): "loop" (default) runs --loop_steps steps per jitted call in a `lax.scan` that
carries the cache, as a jitted generation loop does, and reports the call's time per step: the
device's time. "dispatch" calls the jitted step once per step from Python:
at B 1 and 8 that measures the host's dispatch of ~30 arguments (0.15-0.45 ms, falling as S
grew), not the GPU. Both the NSA rows and the full-attention baselines use the same method.
With "loop", a point runs (--warmup + --repeats) calls of --loop_steps steps; --iters is the
calls per repeat of "dispatch" only.

The cache of length S is filled with random K/V (and compressed blocks) directly and its
position set to S, instead of running prefill over S tokens: a decode step's cost depends on the
shapes and the position, not on the values, and a 64k prefill at B = 64 would dominate the run.
The cache's max_len is S plus the steps timed, so the compressed branch (which scans the cache's
compressed slots) sees the context it would in a real generation.

--branch_force_mode none|cmp|sel|win: with a branch named, the gates are forced to it (wg = 0,
bg = +30 for it, -30 for the others; the layer output is then that branch's output) and the
breakdown times that branch only. The decode step computes all three branches whatever the gates
say, so forcing changes the output, not the full step's cost.

Selection workloads (`--workload`, bench/workloads.py): random (default; each step's own
selection), coherent (`--overlap`, `--working-set`, `--drift`), trained_fit (fitted to a trained
model's statistics) or trained (`--workload-file`). A forced workload's rows of
positions S, S + 1, ... go to `decode_step(block_idx=)` step by step (the step does not rank
the blocks: a forced workload's step leaves out the selection kernels, which its record's note
says, so its time is not comparable with the random workload's); with --timing loop every call
replays the rows of its --loop_steps steps. Records carry the workload and the overlap
statistics of the blocks of consecutive steps (sel_shared, sel_jaccard; for random, those of
16 steps of the step's own selection), printed before the table; the latest CSVs gain a
`workload` column and keep the lines of the other workloads.

Outputs: the full CSV (--csv), and on the GPU the two summary files of bench/results/
(--latest_csv): `decode_latest.csv` (B,S,nsa_ms,fa3_ms,cudnn_ms,speedup,reads,formula,device,
commit,workload,nsa_attn_ms,fa3_attn_ms,attn_speedup; speedup = the first full-attention baseline
that ran, FA-3 first, over the NSA step; the attention-alone figures need the breakdown) and
`decode_latest_breakdown.csv` beside it (each branch-only step and the base step).

Example (GPU): python bench/bench_decode.py --csv artifacts/bench/decode.csv
               (defaults: B 1,8,32, S 16k,64k,128k, paper sizes, bf16, pallas)
CPU smoke:     python bench/bench_decode.py --device cpu --B 2 --S_list 128 --d_model 32 --H 4 \
                   --G 2 --dk 16 --dv 16 --l 8 --d 4 --l_sel 16 --n_sel 4 --w 16 --dtype float32
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys
from typing import Any, Callable, Optional

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402  (sets the allocator environment before jax loads)
from bench.common import OK, SKIPPED, Skip  # noqa: E402
from bench.summarize_decode_csv import summarize  # noqa: E402
from bench import workloads  # noqa: E402

COLUMNS = ["bench", "row", "impl", "mode", "B", "S", "dim", "H", "G", "dk", "dv", "l", "d",
           "l_sel", "n_sel", "w", "dtype", "force", "timing", "status", "ms", "ms_min", "ms_max",
           "attn_ms", "share_of_step", "reads_cmp", "reads_sel", "reads_win", "reads_actual",
           "reads_formula", "reads_full", "cache_mb", "speedup_vs_full", "baseline", "note",
           "device", "workload", "sel_shared", "sel_jaccard", "sel_tile_union", "attn_speedup"]
BRANCHES = ("cmp", "sel", "win")
FULL_IMPLS = ("fa3", "cudnn", "xla", "fa2")
FORCED_GATE_LOGIT = 30.0  # sigmoid(30) = 1 - 1e-13, sigmoid(-30) = 1e-13


def _base(args, row: str, B: int, S: int, **extra) -> dict[str, Any]:
    cfg = args.cfg
    record = {"bench": "decode", "row": row, "B": B, "S": S, "dim": cfg.d_model,
              "H": cfg.n_heads, "G": cfg.n_kv_heads, "dk": cfg.d_k, "dv": cfg.d_v,
              "l": cfg.cmp_block, "d": cfg.cmp_stride, "l_sel": cfg.sel_block, "n_sel": cfg.n_sel,
              "w": cfg.window, "dtype": args.dtype, "force": args.branch_force_mode,
              "timing": (f"loop of {args.loop_steps}" if args.timing == "loop" else "dispatch"),
              "device": args.device_label, "workload": args.workload}
    record.update(extra)
    return record


def force_gates(params, cfg, branch: str):
    """Params whose gates are (numerically) one for `branch` and zero for the other two."""
    import jax.numpy as jnp

    if branch not in BRANCHES:
        raise ValueError(f"branch_force_mode ({branch!r}) must be one of none, cmp, sel, win")
    logits = jnp.full((cfg.n_heads, 3), -FORCED_GATE_LOGIT).at[:, BRANCHES.index(branch)].set(
        FORCED_GATE_LOGIT)
    params = dict(params)
    params["wg"] = jnp.zeros_like(params["wg"])
    params["bg"] = logits.reshape(-1).astype(params["bg"].dtype)
    return params


def random_cache(cache, S: int, key):
    """`cache` (from init_cache) with every float array random and every sequence's length S.

    One jitted program fills every leaf (eager jax.random would compile once per shape).
    """
    import jax
    import jax.numpy as jnp

    @jax.jit
    def fill(cache, key):
        keys = jax.random.split(key, len(cache))
        filled = [jax.random.normal(k, leaf.shape, leaf.dtype)
                  if jnp.issubdtype(leaf.dtype, jnp.floating) else leaf
                  for leaf, k in zip(cache, keys)]
        return type(cache)(*filled)._replace(lengths=jnp.full_like(cache.lengths, S))

    return fill(cache, key)


def init_params(cfg, dtype):
    """nsa_jax.init_params as one jitted program (eagerly it compiles once per weight shape)."""
    import jax
    import nsa_jax

    return jax.jit(functools.partial(nsa_jax.init_params, cfg=cfg, dtype=dtype))(
        jax.random.PRNGKey(0))


def cache_bytes(cache) -> int:
    import jax

    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(cache))


def branch_only_step(mode: str, backend: str = "xla", options=None):
    """The decode step with only branch `mode`'s attention (cmp, sel, win) or none ("base"):
    `nsa_jax.decode.decode_step_branches`, as fn(params, x_t, cfg, cache) -> (y_t, cache,
    reads)."""
    from nsa_jax.decode import decode_step_branches

    if mode not in (*BRANCHES, "base"):
        raise ValueError(f"mode ({mode!r}) must be one of cmp, sel, win, base")
    return functools.partial(decode_step_branches, backend=backend, options=options,
                             branches=() if mode == "base" else (mode,))


def decode_options(args, dtype):
    """The step's backend options: None, or with `--decode_set` the Pallas decode kernels' block
    sizes of this device's architecture (`pallas_kernels.profiles`) with those fields replaced."""
    if not args.decode_set:
        return None
    import nsa_jax
    from pallas_kernels import profiles

    blocks = profiles.block_sizes("decode", dtype, args.cfg.d_k, args.cfg.d_v)
    return {"pallas": nsa_jax.PallasOptions(
        decode_blocks=dataclasses.replace(blocks, **args.decode_set))}


def steps_needed(args) -> int:
    """Decode steps one timed point runs (warm-up included): the cache holds S plus these."""
    if args.timing == "loop":
        return (max(1, args.warmup) + args.repeats) * args.loop_steps
    return max(1, args.warmup) + args.iters * args.repeats


def decode_loop(step_fn: Callable, cfg, xs, n: int, block_idx=None):
    """(jitted loop(params, stacked, cache) -> (ys [n, ...], cache, extra), stacked): n steps of
    `step_fn(params, x_t, cfg, cache)` in one jitted call carrying the (donated) cache, the
    first step as is and the other n - 1 in a `lax.scan`; step i takes x number i % len(xs)
    and, with `block_idx` ([n, B, 1, G, n_sel], a workload's rows), `block_idx=block_idx[i]`.
    Every step's output is returned, so none of the steps' work can be dropped; `extra` is the
    first step's third output (decode_step's reads: a user's generation loop would not compute
    them every step, so the loop does not either), or None."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    stacked = jnp.stack([xs[i % len(xs)] for i in range(n)])
    forced = None if block_idx is None else jnp.asarray(block_idx, jnp.int32)

    def call(params, x_t, cache, idx):
        if idx is None:
            return step_fn(params, x_t, cfg, cache)
        return step_fn(params, x_t, cfg, cache, block_idx=idx)

    def loop(params, stacked, cache):
        first = call(params, stacked[0], cache, None if forced is None else forced[0])

        def body(cache, step_in):
            x_t, idx = step_in
            out = call(params, x_t, cache, idx)
            return out[1], out[0]

        cache, ys = lax.scan(body, first[1],
                             (stacked[1:], None if forced is None else forced[1:]))
        ys = jnp.concatenate([first[0][None], ys])
        return ys, cache, (first[2] if len(first) > 2 else None)

    return jax.jit(loop, donate_argnums=(2,)), stacked


def _timed_decode(step_fn: Callable, params, cfg, cache, xs, args,
                  block_idx=None) -> tuple[common.Timing, Any]:
    """Time a jitted, cache-donating step; returns (timing per step, the first call's third
    output, e.g. decode_step's reads, or None). The caller's `cache` is donated: do not use it
    afterwards. `block_idx` ([workload_steps(args), B, 1, G, n_sel] or None): a workload's
    rows, step i forced onto row i (in the loop, row i of each call's steps).

    --timing loop (the default): one jitted call runs `loop_steps` steps in a `lax.scan` that
    carries the cache (a generation loop as a JAX server jits it) and returns every step's
    output; the figure is the call's time / loop_steps, so it is the device's time per step.
    --timing dispatch: one jitted call per step from Python, as an eager loop would run it; at
    small B this measures the host's dispatch of the step (its ~30 arguments), not the device.
    """
    import jax

    first = {}
    if args.timing == "dispatch":
        jitted = jax.jit(step_fn, static_argnums=(2,), donate_argnums=(3,))
        state = {"cache": cache}

        def step(i):
            forced = {} if block_idx is None else {"block_idx": block_idx[i % len(block_idx)]}
            out = jitted(params, xs[i % len(xs)], cfg, state["cache"], **forced)
            state["cache"] = out[1]
            if not first:  # keep no reference to the cache, whose buffers the next call donates
                first["out"] = out[2] if len(out) > 2 else None
            return out[0]

        timing = common.time_jax(step, iters=args.iters, warmup=max(1, args.warmup),
                                 repeats=args.repeats)
        return timing, first["out"]

    n = args.loop_steps
    jitted, stacked = decode_loop(step_fn, cfg, xs, n,
                                  None if block_idx is None else block_idx[:n])
    state = {"cache": cache}

    def call(i):
        ys, state["cache"], extra = jitted(params, stacked, state["cache"])
        if not first:  # the first step of the first call: the cache at position S
            first["out"] = extra
        return ys

    timing = common.time_jax(call, iters=1, warmup=max(1, args.warmup), repeats=args.repeats)
    per_step = common.Timing(ms=timing.ms / n, ms_min=timing.ms_min / n, ms_max=timing.ms_max / n,
                             samples=timing.samples)
    return per_step, first.get("out")


def workload_steps(args) -> int:
    """Rows of a forced workload one point needs: the loop's steps (every call replays the rows
    of positions S .. S + loop_steps - 1, each still causal at the later positions the cache
    reaches) or, with --timing dispatch, every step the point runs."""
    return args.loop_steps if args.timing == "loop" else steps_needed(args)


def workload_rows(args, B: int, S: int):
    """(the workload's decode rows [workload_steps, B, 1, G, n_sel] or None, the records'
    workload fields with the forced rows' overlap statistics over consecutive steps)."""
    rows = workloads.decode_block_idx(args, args.cfg, B, S, workload_steps(args))
    fields = {}
    if rows is not None:
        fields = selection_fields(rows[:, :, 0].transpose(1, 0, 2, 3))
    return rows, fields


def selection_fields(block_idx) -> dict[str, float]:
    """The sel_* record fields of a selection [B, steps, G, n_sel] (consecutive steps)."""
    stats = workloads.overlap_stats(block_idx)
    return {"sel_shared": stats["shared"], "sel_jaccard": stats["jaccard"],
            "sel_tile_union": stats["tile_union"]}


def own_selection(params, cfg, cache, xs, args, steps: int = 16):
    """The blocks `decode_step` selects itself over `steps` consecutive steps from `cache`:
    [B, steps, G, n_sel] (the random workload's statistics)."""
    import jax
    import jax.numpy as jnp
    import nsa_jax
    from jax import lax

    stacked = jnp.stack([xs[i % len(xs)] for i in range(steps)])

    @jax.jit
    def run(cache, stacked):
        def body(cache, x_t):
            _, cache, _, aux = nsa_jax.decode_step(params, x_t, cfg, cache, backend=args.backend,
                                                   return_aux=True,
                                                   options=decode_options(args, x_t.dtype))
            return cache, aux["block_idx"][:, 0]

        return lax.scan(body, cache, stacked)[1]

    return jnp.transpose(run(cache, stacked), (1, 0, 2, 3))


def nsa_setup(args, B: int, S: int):
    """(params prepared for decode, the rotating x_t list, fresh_cache() -> a cache at S) of an
    NSA point."""
    import jax
    import nsa_jax

    cfg = args.cfg
    dtype = common.jnp_dtype(args.dtype)
    max_len = S + steps_needed(args) + 1
    params = init_params(cfg, dtype)
    if args.branch_force_mode != "none":
        params = force_gates(params, cfg, args.branch_force_mode)
    # As a server would: the step's projection weights concatenated once (one GEMM per step).
    params = nsa_jax.decode.prepare_decode_params(params, cfg)
    xs = [jax.random.normal(jax.random.PRNGKey(100 + i), (B, 1, cfg.d_model), dtype)
          for i in range(args.rotate)]

    def fresh_cache():
        return random_cache(nsa_jax.init_cache(cfg, B, max_len, dtype), S,
                            jax.random.PRNGKey(7))

    return params, xs, fresh_cache


def run_nsa_point(args, B: int, S: int) -> list[dict]:
    try:
        import nsa_jax
    except ImportError as exc:
        raise Skip(f"nsa_jax not importable ({exc})") from None
    cfg = args.cfg
    params, xs, fresh_cache = nsa_setup(args, B, S)

    from nsa_common import decode_read_bound

    formula = decode_read_bound(cfg, S)
    records = []
    block_idx, fields = workload_rows(args, B, S)
    if block_idx is None:
        fields = selection_fields(own_selection(params, cfg, fresh_cache(), xs, args))
    cache = fresh_cache()
    size_mb = common.mb(cache_bytes(cache))
    options = decode_options(args, xs[0].dtype)
    full = _base(args, "nsa_jax", B, S, mode="full",
                 impl=f"nsa_jax.decode_step ({args.backend}{_decode_set_label(args)})",
                 cache_mb=size_mb, reads_formula=formula, reads_full=S + 1, **fields)
    decode_step = functools.partial(nsa_jax.decode_step, backend=args.backend, options=options)
    try:
        timing, first_reads = _timed_decode(decode_step, params, cfg, cache, xs, args,
                                            block_idx)
        del cache
        # Every sequence sits at position S: the counts are the same for each (take the max).
        reads = {k: int(v.max()) for k, v in first_reads.items()}
        full.update(status=OK, **timing.fields(), share_of_step=1.0, reads_cmp=reads.get("cmp"), reads_sel=reads.get("sel"),
                    reads_win=reads.get("win"), reads_actual=reads.get("total"))
        notes = [] if block_idx is None else ["the workload's blocks: no selection kernels"]
        if "bound" in reads and reads["bound"] != formula:
            notes.append(f"decode_step bound {reads['bound']} != "
                         f"nsa_common.decode_read_bound {formula}")
        if notes:
            full["note"] = "; ".join(notes)
    except Exception as exc:
        full.update(status=common.classify_exception(exc), note=common.short_error(exc))
    records.append(full)
    if full["status"] != OK or not args.breakdown:
        return records

    modes = (BRANCHES if args.branch_force_mode == "none" else (args.branch_force_mode,))
    timings = {}
    for mode in (*modes, "base"):
        record = _base(args, "nsa_jax", B, S, mode=mode,
                       impl=f"nsa_jax decode ({args.backend}), {mode} only", cache_mb=size_mb)
        try:
            step = branch_only_step(mode, args.backend, options)
            timing, _ = _timed_decode(step, params, cfg, fresh_cache(), xs, args, block_idx)
            timings[mode] = timing.ms
            record.update(status=OK, **timing.fields(), share_of_step=timing.ms / full["ms"])
            if mode in BRANCHES:
                record["reads_actual"] = full.get(f"reads_{mode}")
        except Skip as why:
            record.update(status=SKIPPED, note=f"skipped: {why}")
        except Exception as exc:
            record.update(status=common.classify_exception(exc), note=common.short_error(exc))
        records.append(record)
    if "base" in timings:
        for record in records:
            if record["status"] == OK:
                record["attn_ms"] = max(0.0, record["ms"] - timings["base"])
    return records


def _full_attention_fn(impl: str, args, num_splits: int = 1):
    """attend(q [B,1,H,dk], k_cache, v_cache [B,L,G,d], lengths [B]) -> [B,1,H,dv]."""
    import jax

    if impl == "fa3":
        if args.device != "gpu":
            raise Skip("FlashAttention-3 needs a Hopper GPU")
        if args.dtype == "float32":
            raise Skip("FlashAttention-3 takes bf16/fp16 only")
        if args.cfg.d_k > 128:
            raise Skip("flash_attn3_jax has no kernel above head dim 128")
        try:
            from flash_attn3_jax import flash_mha_with_kvcache
        except ImportError as exc:
            raise Skip(f"flash_attn3_jax not importable ({exc})") from None

        def attend(q, k, v, lengths):
            return flash_mha_with_kvcache(q, k, v, cache_seqlens=lengths, num_splits=num_splits)

        return attend
    if impl == "cudnn":
        if args.device != "gpu":
            raise Skip("cuDNN needs a GPU")
        if args.dtype == "float32":
            raise Skip("cuDNN flash attention takes bf16/fp16 only")
    elif impl != "xla":
        raise ValueError(f"--full_impls has unknown impl {impl!r}; known: {list(FULL_IMPLS)}")

    def attend(q, k, v, lengths):
        return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths,
                                            implementation=impl)

    return attend


def full_setup(args, impl: str, B: int, S: int, num_splits: int = 1, attention: bool = True):
    """(step, params, the rotating x_t list, make_cache() -> a cache at S) of a full-attention
    layer step: one q/k/v projection GEMM (as the NSA step gets, `prepare_decode_params`),
    in-place cache append, single-query attention over the S + 1 cached tokens, output
    projection. `attention=False`: the same step with q's first d_v columns in place of the
    attention's output (the step's cost without attention, as NSA's "base" step)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    dtype = common.jnp_dtype(args.dtype)
    cfg = args.cfg
    H, G, dk, dv, D = cfg.n_heads, cfg.n_kv_heads, cfg.d_k, cfg.d_v, cfg.d_model
    max_len = S + steps_needed(args) + 1
    keys = jax.random.split(jax.random.PRNGKey(1), 8)

    def weight(k, shape):
        return (jax.random.normal(k, shape, jnp.float32) / math.sqrt(shape[0])).astype(dtype)

    params = {"w_qkv": weight(keys[0], (D, H * dk + G * (dk + dv))),
              "wo": weight(keys[3], (H * dv, D))}
    xs = [jax.random.normal(jax.random.PRNGKey(100 + i), (B, 1, D), dtype)
          for i in range(args.rotate)]
    attend = _full_attention_fn(impl, args, num_splits)
    # Every full-attention call here takes d_v = d_k only: with d_v < d_k the v cache holds d_k
    # columns, zeros past d_v (what a model on these kernels stores), and o keeps the first d_v.
    dv_cache = max(dk, dv)

    def step(params, x_t, cfg, cache):
        k_cache, v_cache, pos = cache
        q, k_new, v_new = jnp.split(x_t @ params["w_qkv"], [H * dk, H * dk + G * dk], axis=-1)
        q = q.reshape(B, 1, H, dk)
        v_new = jnp.pad(v_new.reshape(B, 1, G, dv), [(0, 0)] * 3 + [(0, dv_cache - dv)])
        k_cache = lax.dynamic_update_slice_in_dim(k_cache, k_new.reshape(B, 1, G, dk), pos, 1)
        v_cache = lax.dynamic_update_slice_in_dim(v_cache, v_new, pos, 1)
        lengths = jnp.full((B,), pos + 1, jnp.int32)
        if attention:
            o = attend(q, k_cache, v_cache, lengths)[..., :dv]
        else:
            o = jnp.pad(q, [(0, 0)] * 3 + [(0, max(0, dv - dk))])[..., :dv]
        y = o.reshape(B, 1, H * dv) @ params["wo"]
        return y, (k_cache, v_cache, pos + 1)

    def make_cache():
        return (jax.random.normal(keys[4], (B, max_len, G, dk), dtype),
                jnp.pad(jax.random.normal(keys[5], (B, max_len, G, dv), dtype),
                        [(0, 0)] * 3 + [(0, dv_cache - dv)]),
                jnp.asarray(S, jnp.int32))

    return step, params, xs, make_cache


def torch_full_setup(args, B: int, S: int, *, attention: bool = True, backend: str = "flash",
                     gqa: bool = True):
    """(step(i, pos) -> y [B, 1, D], state) of `full_setup`'s layer step in torch: the QKV GEMM,
    the token's K/V written in place at row `pos` of caches `[B, G, max_len, d]` (v padded to
    d_k when d_v < d_k), on `--device` in `--dtype`, SDPA over rows 0..pos on `backend` ("flash": torch's FlashAttention-2;
    "math" on a CPU), the output GEMM. `pos` is a Python int, so the shapes of a captured step
    are static. `gqa=False` expands K/V to H heads inside the step (for a backend that refuses
    `enable_gqa`). `attention=False`: q's first d_v columns in place of the attention's output.
    state holds the weights, inputs and caches (for tests)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch, device, dtype = common.torch_device(args)
    cfg = args.cfg
    H, G, dk, dv, D = cfg.n_heads, cfg.n_kv_heads, cfg.d_k, cfg.d_v, cfg.d_model
    h, dv_cache = H // G, max(dk, dv)
    max_len = S + steps_needed(args) + 1
    gen = torch.Generator().manual_seed(1)

    def normal(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)

    state = {"w_qkv": normal(D, H * dk + G * (dk + dv), scale=D ** -0.5),
             "wo": normal(H * dv, D, scale=(H * dv) ** -0.5),
             "xs": [normal(B, 1, D) for _ in range(args.rotate)],
             "k_cache": normal(B, G, max_len, dk),
             "v_cache": torch.zeros(B, G, max_len, dv_cache, device=device, dtype=dtype)}
    state["v_cache"][..., :dv] = normal(B, G, max_len, dv)
    kernel = {"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}[backend]

    def step(i: int, pos: int):
        x_t, kc, vc = state["xs"][i % len(state["xs"])], state["k_cache"], state["v_cache"]
        q, k_new, v_new = (x_t @ state["w_qkv"]).split([H * dk, G * dk, G * dv], dim=-1)
        q = q.view(B, 1, H, dk).transpose(1, 2)
        kc[:, :, pos] = k_new.view(B, G, dk)
        vc[:, :, pos, :dv] = v_new.view(B, G, dv)
        if attention:
            k, v = kc[:, :, :pos + 1], vc[:, :, :pos + 1]
            if not gqa and h > 1:
                k, v = k.repeat_interleave(h, dim=1), v.repeat_interleave(h, dim=1)
            with sdpa_kernel(kernel):
                o = F.scaled_dot_product_attention(q, k, v, scale=dk ** -0.5,
                                                   enable_gqa=gqa and h > 1)
            o = o[..., :dv]
        else:
            o = F.pad(q, (0, max(0, dv - dk)))[..., :dv]
        return o.transpose(1, 2).reshape(B, 1, H * dv) @ state["wo"]

    return step, state


def _time_torch_graph(step, S: int, args) -> common.Timing:
    """`--loop_steps` steps (positions S, S + 1, ...) captured in one CUDA graph; each replay
    timed with CUDA events; the figure per step."""
    import torch

    n = args.loop_steps
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # kernels chosen and workspaces made before the capture
        for i in range(2):
            step(i, S + i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n):
            step(i, S + i)
    timing = common.time_torch(lambda i: graph.replay(), iters=1, warmup=max(1, args.warmup),
                               repeats=args.repeats)
    del graph
    return common.Timing(ms=timing.ms / n, ms_min=timing.ms_min / n, ms_max=timing.ms_max / n,
                         samples=timing.samples)


def run_fa2_point(args, record: dict, B: int, S: int) -> dict:
    """`full_fa2`: the torch step of `torch_full_setup` on FlashAttention-2, and without its
    attention (attn_ms)."""
    if args.device != "gpu":
        raise Skip("torch's FlashAttention-2 kernel needs a GPU")
    if args.dtype == "float32":
        raise Skip("FlashAttention-2 takes bf16/fp16 only")
    torch = common.torch_device(args)[0]   # Skip where torch sees no CUDA device
    notes = ["RoPE not applied (elementwise; negligible)"]
    fraction = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    if fraction:  # the cap a JAX run is under (e.g. a 24 GB card's), for torch's allocator too
        torch.cuda.set_per_process_memory_fraction(float(fraction))
        notes.append(f"torch capped at {float(fraction):g} of the GPU's memory")
    gqa = True
    try:
        step, state = torch_full_setup(args, B, S)
        step(0, S)
    except RuntimeError:  # a kernel that refuses enable_gqa: K/V expanded, inside the timing
        gqa = False
        notes.append("K/V expanded to H heads in the step (enable_gqa refused)")
        step, state = torch_full_setup(args, B, S, gqa=False)
    record["cache_mb"] = common.mb(state["k_cache"].nbytes + state["v_cache"].nbytes)
    try:
        timing = _time_torch_graph(step, S, args)
    except Exception as exc:  # noqa: BLE001 - a row's failure is reported, not raised
        record.update(status=common.classify_exception(exc), note=common.short_error(exc))
        return record
    del step, state
    record.update(status=OK, impl="torch SDPA[flash] (FlashAttention-2), CUDA graph",
                  **timing.fields())
    base_step, _ = torch_full_setup(args, B, S, attention=False)
    try:
        base = _time_torch_graph(base_step, S, args)
        record["attn_ms"] = max(0.0, timing.ms - base.ms)
        notes.append(f"the step without attention {base.ms:.4g} ms")
    except Exception as exc:  # noqa: BLE001
        notes.append(f"the step without attention failed: {common.short_error(exc)}")
    record["note"] = "; ".join(notes)
    torch.cuda.empty_cache()
    return record


def run_full_point(args, impl: str, B: int, S: int) -> dict:
    """A full-attention layer step at context S (see the module docstring and `full_setup`)."""
    record = _base(args, f"full_{impl}", B, S, mode="full", reads_full=S + 1, reads_actual=S + 1,
                   l="", d="", l_sel="", n_sel="", w="")
    if impl == "fa2":
        return run_fa2_point(args, record, B, S)
    splits = args.fa3_num_splits if impl == "fa3" else [1]
    best: Optional[tuple] = None
    errors = []
    for num_splits in splits:
        step, params, xs, make_cache = full_setup(args, impl, B, S, num_splits)
        cache = make_cache()
        record["cache_mb"] = common.mb(cache_bytes(cache))
        try:
            timing, _ = _timed_decode(step, params, None, cache, xs, args)
            if best is None or timing.ms < best[0].ms:
                best = (timing, num_splits)
        except Skip:
            raise
        except Exception as exc:
            errors.append(exc)
        del cache
    if best is None:
        exc = errors[-1]
        record.update(status=common.classify_exception(exc), note=common.short_error(exc))
        return record
    timing, num_splits = best
    impl_label = {"fa3": f"flash_attn3_jax.flash_mha_with_kvcache num_splits={num_splits}",
                  "cudnn": "jax.nn.dot_product_attention[cudnn]",
                  "xla": "jax.nn.dot_product_attention[xla]"}[impl]
    record.update(status=OK, impl=impl_label, **timing.fields(),
                  note="RoPE not applied (elementwise; negligible)")
    # The same step without attention: attn_ms, the attention's own cost, as NSA's rows have it.
    step, params, xs, make_cache = full_setup(args, impl, B, S, attention=False)
    try:
        base, _ = _timed_decode(step, params, None, make_cache(), xs, args)
        record["attn_ms"] = max(0.0, timing.ms - base.ms)
        record["note"] += f"; the step without attention {base.ms:.4g} ms"
    except Exception as exc:
        record["note"] += f"; the step without attention failed: {common.short_error(exc)}"
    return record


def add_speedups(records: list[dict], full_order: list[str]) -> None:
    """speedup_vs_full = full-attention step ms / NSA full step ms, per (B, S); attn_speedup =
    the same for the attention alone (each step less its step without attention), where both
    were timed."""
    ok_full = {}
    for r in records:
        if r["row"].startswith("full_") and r.get("status") == OK:
            ok_full.setdefault((r["B"], r["S"]), {})[r["row"][5:]] = r
    for r in records:
        if r["row"] != "nsa_jax" or r.get("mode") != "full" or r.get("status") != OK:
            continue
        for impl in full_order:
            ref = ok_full.get((r["B"], r["S"]), {}).get(impl)
            if ref:
                r["speedup_vs_full"] = ref["ms"] / r["ms"]
                r["baseline"] = f"full_{impl}"
                if ref.get("attn_ms") is not None and r.get("attn_ms"):
                    r["attn_speedup"] = ref["attn_ms"] / r["attn_ms"]
                break


LATEST_COLUMNS = ["B", "S", "nsa_ms", "fa3_ms", "cudnn_ms", "speedup", "reads", "formula",
                  "device", "commit", "workload", "nsa_attn_ms", "fa3_attn_ms", "attn_speedup"]
BREAKDOWN_COLUMNS = ["B", "S", "mode", "ms", "share_of_step", "attn_ms", "status", "device",
                     "commit", "workload"]


def _merged(path: str, lines: list[dict], columns: list[str], workload: str) -> list[dict]:
    """`lines` (this run's, all of `workload`) after the lines of `path` that hold another
    workload (a file written before the column existed holds the random workload): a run
    replaces its own workload's figures and keeps the others'."""
    kept = []
    if os.path.isfile(path):
        for line in common.read_csv(path):
            line["workload"] = line.get("workload") or "random"
            if line["workload"] != workload:
                kept.append({key: line.get(key) for key in columns})
    return kept + lines


def write_latest(records: list[dict], path: str, device: str, commit: str,
                 workload: str = "random") -> None:
    """The one-line-per-(B, S) summary at `path` and the per-branch breakdown beside it
    (`*_breakdown.csv`) of `records` (one workload); a value that did not run is left empty.
    Lines of the files' other workloads are kept (`_merged`)."""
    points: dict[tuple, dict] = {}
    for r in records:
        points.setdefault((r["B"], r["S"]), {})[(r["row"], r.get("mode"))] = r

    def ms(entry):
        return entry.get("ms") if entry and entry.get("status") == OK else None

    latest, breakdown = [], []
    for (B, S), entries in sorted(points.items()):
        nsa = entries.get(("nsa_jax", "full"), {})
        latest.append(dict(B=B, S=S, nsa_ms=ms(nsa), fa3_ms=ms(entries.get(("full_fa3", "full"))),
                           cudnn_ms=ms(entries.get(("full_cudnn", "full"))),
                           speedup=nsa.get("speedup_vs_full"), reads=nsa.get("reads_actual"),
                           formula=nsa.get("reads_formula"), device=device, commit=commit,
                           workload=workload, nsa_attn_ms=nsa.get("attn_ms"),
                           fa3_attn_ms=(entries.get(("full_fa3", "full")) or {}).get("attn_ms"),
                           attn_speedup=nsa.get("attn_speedup")))
        for mode in (*BRANCHES, "base"):
            r = entries.get(("nsa_jax", mode))
            if r:
                breakdown.append(dict(B=B, S=S, mode=mode, ms=ms(r),
                                      share_of_step=r.get("share_of_step"),
                                      attn_ms=r.get("attn_ms"), status=r.get("status"),
                                      device=device, commit=commit, workload=workload))
    breakdown_path = os.path.splitext(path)[0] + "_breakdown.csv"
    common.write_csv(path, _merged(path, latest, LATEST_COLUMNS, workload), LATEST_COLUMNS)
    common.write_csv(breakdown_path, _merged(breakdown_path, breakdown, BREAKDOWN_COLUMNS,
                                             workload), BREAKDOWN_COLUMNS)


def plot(records: list[dict], path: str, title: str) -> None:
    latency: dict[str, list] = {}
    speedup: dict[str, list] = {}
    shares: dict[str, list] = {}
    for r in records:
        if r.get("status") != OK:
            continue
        B, S = int(r["B"]), int(r["S"])
        if r.get("mode") == "full":
            latency.setdefault(f"{r['row']} B={B}", []).append((S, r["ms"]))
        if r.get("speedup_vs_full") is not None:
            speedup.setdefault(f"B={B} vs {r['baseline']}", []).append((S, r["speedup_vs_full"]))
        if r["row"] == "nsa_jax" and r.get("mode") in BRANCHES:
            shares.setdefault(f"{r['mode']} B={B}", []).append((S, r["share_of_step"]))
    panels = [{"title": "decode step latency", "xlabel": "context length S",
               "ylabel": "ms per step (median)", "series": latency, "logy": True},
              {"title": "NSA speed-up over full-attention decode", "xlabel": "context length S",
               "ylabel": "x faster", "series": speedup, "hline": 1.0},
              {"title": "branch-only step as a share of the full NSA step",
               "xlabel": "context length S", "ylabel": "share", "series": shares}]
    common.plot_lines(path, panels, title)


def workload_lines(records: list[dict]) -> list[str]:
    """One line per (B, S): the overlap statistics of the blocks the NSA step attended over
    consecutive steps (the forced workload's, or the step's own selection for random)."""
    lines = []
    for r in records:
        if r["row"] == "nsa_jax" and r.get("mode") == "full" and r.get("sel_shared") is not None:
            stats = {name: r[f"sel_{name}"] for name in ("shared", "jaccard", "tile_union")}
            lines.append(f"workload {r['workload']}, B={r['B']}, S={r['S']}: "
                         f"{workloads.format_stats(stats)} (consecutive steps)")
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = common.script_parser(__doc__)
    p.add_argument("--B", default="1,8,32", help="batch sizes, comma list (up to 64)")
    p.add_argument("--S_list", default="16k,64k,128k", help="context lengths ('k' = 1024)")
    common.add_run_args(p, iters=50, warmup=5, repeats=5, rotate=3)
    common.add_nsa_args(p)
    p.add_argument("--csv", default="artifacts/bench/decode.csv",
                   help="CSV path; the PNG, summary and env JSON go beside it")
    p.add_argument("--latest_csv", default="auto",
                   help="the summary CSV (breakdown beside it, *_breakdown.csv); auto: "
                        "bench/results/decode_latest.csv on gpu, none on cpu; '' for none")
    p.add_argument("--branch_force_mode", default="none", choices=("none", *BRANCHES))
    p.add_argument("--backend", default=None, choices=("xla", "pallas"),
                   help="nsa_jax decode_step backend (default: pallas on gpu, xla on cpu)")
    p.add_argument("--no_breakdown", dest="breakdown", action="store_false",
                   help="skip the per-branch steps")
    p.add_argument("--decode_set", default="",
                   help="with --backend pallas: DecodeBlockSizes fields replaced in the "
                        "architecture's, field=value,... (e.g. split_dk=False)")
    p.add_argument("--full_impls", default="auto",
                   help="full-attention baselines, comma list of fa3,cudnn,xla,fa2 "
                        "(auto: fa3,cudnn on gpu, xla on cpu)")
    p.add_argument("--fa3_num_splits", default="1,4,16",
                   help="FA3 split-KV counts tried; the fastest is reported")
    p.add_argument("--timing", default="loop", choices=("loop", "dispatch"),
                   help="loop: --loop_steps steps in one jitted lax.scan per call (device time "
                        "per step); dispatch: one jitted call per step from Python")
    p.add_argument("--loop_steps", type=int, default=50,
                   help="steps per jitted call with --timing loop")
    p.add_argument("--no_progress", action="store_true")
    workloads.add_workload_args(p)
    return p


def _parse_decode_set(text: str) -> dict:
    """`field=value,...` -> {field: value}, each a field of `DecodeBlockSizes`."""
    if not text.strip():
        return {}
    from pallas_kernels.decode import DecodeBlockSizes

    defaults = DecodeBlockSizes()
    fields = common.parse_assignments(text, "--decode_set",
                                      {f.name for f in dataclasses.fields(DecodeBlockSizes)},
                                      "DecodeBlockSizes")
    for key, value in fields.items():
        kind = type(getattr(defaults, key))     # bool or int: what the field holds
        if type(value) is not kind:
            raise ValueError(f"--decode_set: {key}={value!r} must be {kind.__name__} "
                             f"({'True or False' if kind is bool else 'an integer'})")
    return fields


def _decode_set_label(args) -> str:
    return "".join(f" {k}={v}" for k, v in args.decode_set.items())


def parse_args(argv=None):
    args = common.finish_args(build_parser().parse_args(argv))
    workloads.check_workload_args(args)
    args.B_list = common.parse_int_list(args.B, "--B")
    if args.loop_steps < 1:
        raise ValueError(f"--loop_steps ({args.loop_steps}) must be >= 1")
    if max(args.B_list) > 64:
        raise ValueError(f"--B ({args.B}) goes up to 64")
    args.S = common.parse_int_list(args.S_list, "--S_list")
    args.fa3_num_splits = common.parse_int_list(args.fa3_num_splits, "--fa3_num_splits")
    if args.backend is None:
        args.backend = "pallas" if args.device == "gpu" else "xla"
    args.decode_set = _parse_decode_set(args.decode_set)
    if args.decode_set and args.backend != "pallas":
        raise ValueError("--decode_set sets the Pallas decode kernels' block sizes: it needs "
                         "--backend pallas")
    if args.latest_csv == "auto":
        args.latest_csv = (os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                        "decode_latest.csv") if args.device == "gpu" else "")
    if args.full_impls == "auto":
        args.full_order = ["fa3", "cudnn"] if args.device == "gpu" else ["xla"]
    else:
        args.full_order = [s.strip() for s in args.full_impls.split(",") if s.strip()]
        unknown = [s for s in args.full_order if s not in FULL_IMPLS]
        if unknown:
            raise ValueError(f"--full_impls has unknown impls {unknown}; known: {list(FULL_IMPLS)}")
    return args


def main(argv=None) -> int:
    argv, args = common.start(parse_args, argv)
    stem = os.path.splitext(args.csv)[0]
    env = common.write_environment(stem + "_env.json",
                                   {"argv": argv, "device_label": args.device_label})
    points = [(B, S) for B in args.B_list for S in sorted(args.S)]
    records: list[dict] = []
    for B, S in common.progress(points, desc="decode points", enabled=not args.no_progress):
        new = []
        try:
            new += run_nsa_point(args, B, S)
        except Skip as why:
            new.append(_base(args, "nsa_jax", B, S, mode="full", status=SKIPPED,
                             note=f"skipped: {why}"))
        except Exception as exc:
            new.append(_base(args, "nsa_jax", B, S, mode="full",
                             status=common.classify_exception(exc), note=common.short_error(exc)))
        for impl in args.full_order:
            try:
                new.append(run_full_point(args, impl, B, S))
            except Skip as why:
                new.append(_base(args, f"full_{impl}", B, S, mode="full", status=SKIPPED,
                                 note=f"skipped: {why}"))
            except Exception as exc:
                new.append(_base(args, f"full_{impl}", B, S, mode="full",
                                 status=common.classify_exception(exc),
                                 note=common.short_error(exc)))
        for r in new:
            if r.get("status") != OK:
                print(f"{r['row']} {r.get('mode')} B={B} S={S}: {r.get('status')}: "
                      f"{r.get('note')}", file=sys.stderr, flush=True)
        records += new
        # Written after every point, so a run cut short keeps the points it finished.
        add_speedups(records, args.full_order)
        common.write_csv(args.csv, records, COLUMNS)
        if args.latest_csv:
            write_latest(records, args.latest_csv, args.device_label, env["commit"],
                         args.workload)
    cfg = args.cfg
    title = (f"NSA decode ({args.backend}): H={cfg.n_heads} G={cfg.n_kv_heads} dk={cfg.d_k} "
             f"dv={cfg.d_v} {args.dtype} force={args.branch_force_mode} "
             f"workload={args.workload} on {args.device_label} (commit {env['commit'][:10]})")
    png = stem + ".png"
    plot(records, png, title)
    table = summarize(common.read_csv(args.csv))
    stats = workload_lines(records)
    with open(stem + "_summary.txt", "w") as f:
        f.write(title + "\n\n" + "".join(line + "\n" for line in stats) + "\n" + table + "\n")
    for line in stats:
        print(line)
    print(f"wrote {args.csv}, {png}")
    print(title)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
