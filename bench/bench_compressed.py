"""Benchmark of the compressed-attention and block-selection Pallas kernels.

1. Correctness at --check_S tokens against the plain-jnp references, evaluated a chunk of queries
   at a time so that the dense `[T, C]` probabilities fit in memory: relative L2 error of o, lse
   and the three gradients, and the share of (t, g) rows whose `block_idx` agree.
2. Timing (`common.time_jax`) of the forward, forward+backward and `select_blocks` at each of
   --S_list, and the scratch memory XLA reports for the compiled forward+backward (no `[T, T/d]`
   array: it stays O(T)).

--sweep first times a few tile choices at --sweep_S, then the lengths with the fastest. With
--device cpu the kernels run in Pallas' interpreter (a smoke run of the script, not a timing).
Prints tables and writes compressed_check.csv, compressed_timing.csv (compressed_sweep.csv) and
compressed_env.json into --out.

Example (GPU): python bench/bench_compressed.py --out bench/results
CPU smoke:     python bench/bench_compressed.py --device cpu --preset tiny --dv 16 --S_list 128 \
                   --check_S 128 --check_chunk 64 --dtype float32 --iters 1 --repeats 1 \
                   --warmup 0 --out /tmp/bench_compressed
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import traceback

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402  (sets the allocator environment before jax loads)
from nsa_common.testing import rel_err  # noqa: E402

CHECK_COLUMNS = ["T", "dtype", "o", "lse", "lse_inf_match", "dq", "dk", "dv",
                 "block_idx_rows_equal"]
TIMING_COLUMNS = ["T", "fwd_ms", "fwd_tflops", "fwd_bwd_ms", "fwd_bwd_temp_MiB", "select_ms"]
SWEEP_COLUMNS = ["kernel", "T", "config", "ms"]

FWD_SWEEP = [(64, 64, 4), (128, 32, 4), (128, 64, 8), (256, 64, 8), (128, 32, 8), (256, 32, 8)]
# (block_q_dq, block_kv_dq, block_q_dkv, block_kv_dkv, num_warps, dkv_programs)
BWD_SWEEP = [(64, 32, 64, 32, 4, 1024), (128, 32, 64, 32, 4, 1024), (128, 64, 128, 64, 8, 1024),
             (64, 64, 64, 64, 4, 1024), (128, 32, 128, 32, 8, 2048), (64, 32, 64, 32, 4, 4096)]
# (block_q, block_sel, num_warps)
SELECT_SWEEP = [(64, 16, 4), (128, 16, 4), (256, 16, 8), (64, 32, 4), (128, 32, 8), (256, 32, 8)]


def inputs(args, T, seed=0):
    """q [B, T, H, d_k], compressed k/v [B, C, G, d], the output cotangent do."""
    import jax
    import jax.numpy as jnp

    from nsa_common import num_cmp_blocks

    cfg, B, dtype = args.cfg, args.B, common.jnp_dtype(args.dtype)
    C, H, G = num_cmp_blocks(cfg, T), cfg.n_heads, cfg.n_kv_heads
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(keys[0], (B, T, H, cfg.d_k), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (B, C, G, cfg.d_k), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (B, C, G, cfg.d_v), jnp.float32).astype(dtype)
    do = jax.random.normal(keys[3], (B, T, H, cfg.d_v), jnp.float32).astype(dtype)
    return q, k, v, do


def block_sizes(args, **over):
    """The compressed-attention tiles: the kernel's defaults, the flags, then `over`."""
    from pallas_kernels.compressed_attention import BlockSizes

    changes = {"block_q": args.block_q, "block_kv": args.block_kv, "num_warps": args.num_warps}
    changes.update(over)
    return dataclasses.replace(BlockSizes(), **{k: v for k, v in changes.items()
                                                if v is not None})


def select_sizes(args, **over):
    from pallas_kernels.select_blocks import BlockSizes

    changes = {"block_q": args.select_block_q, "num_warps": args.select_num_warps}
    changes.update(over)
    return dataclasses.replace(BlockSizes(), **{k: v for k, v in changes.items()
                                                if v is not None})


def cmp_kw(cfg):
    return dict(cmp_block=cfg.cmp_block, cmp_stride=cfg.cmp_stride)


def sel_kw(cfg):
    return dict(cmp_block=cfg.cmp_block, cmp_stride=cfg.cmp_stride, sel_block=cfg.sel_block,
                n_sel=cfg.n_sel, n_init=cfg.n_init, n_local=cfg.n_local)


def attention_flops(args, T):
    """Matmul FLOPs of the forward: 2 (d_k + d_v) per admissible (query, head, block)."""
    import numpy as np

    cfg = args.cfg
    t = np.arange(T)
    seen = np.clip((t - cfg.cmp_block + 1) // cfg.cmp_stride + 1, 0, None).sum()
    return 2.0 * args.B * cfg.n_heads * seen * (cfg.d_k + cfg.d_v)


def functions(args, sizes=None, sel_sizes=None):
    """(forward(q, k, v) -> (o, lse), forward_backward(q, k, v, do) -> (dq, dk, dv),
    select(q, k, lse) -> block_idx) of the kernels."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.compressed_attention import compressed_attention
    from pallas_kernels.select_blocks import select_blocks

    cfg = args.cfg
    sizes = sizes or block_sizes(args)
    sel_sizes = sel_sizes or select_sizes(args)

    def forward(q, k, v):
        return compressed_attention(q, k, v, block_sizes=sizes, interpret=args.interpret,
                                    **cmp_kw(cfg))

    def forward_backward(q, k, v, do):
        def loss(q, k, v):
            o, _ = forward(q, k, v)
            return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    def select(q, k, lse):
        return select_blocks(q, k, lse, block_sizes=sel_sizes, interpret=args.interpret,
                             **sel_kw(cfg))

    return forward, forward_backward, select


def check(args):
    """Kernels against the chunked float32 references at --check_S tokens."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.compressed_attention import compressed_attention_reference
    from pallas_kernels.select_blocks import select_blocks_reference

    cfg, T, chunk = args.cfg, args.check_S, args.check_chunk
    q, k, v, do = inputs(args, T, seed=1)
    dlse = jnp.zeros(q.shape[:3], jnp.float32)
    forward, forward_backward, select = (jax.jit(f) for f in functions(args))
    o, lse = forward(q, k, v)
    dq, dk, dv = forward_backward(q, k, v, do)
    block_idx = np.asarray(select(q, k, lse))

    def f32(x):
        return x.astype(jnp.float32)

    def reference(t0):
        q_chunk = f32(q[:, t0:t0 + chunk])

        def attend(q_chunk, k, v):
            return compressed_attention_reference(q_chunk, k, v, q_offset=t0, **cmp_kw(cfg))

        (o_ref, lse_ref), vjp = jax.vjp(attend, q_chunk, f32(k), f32(v))
        grads = vjp((f32(do[:, t0:t0 + chunk]), dlse[:, t0:t0 + chunk]))
        idx_ref = select_blocks_reference(q[:, t0:t0 + chunk], k, lse[:, t0:t0 + chunk],
                                          q_offset=t0, **sel_kw(cfg))
        return o_ref, lse_ref, grads, idx_ref

    reference = jax.jit(reference, static_argnums=0)
    o_ref, lse_ref, dq_ref, idx_ref = [], [], [], []
    dk_ref = jnp.zeros(k.shape, jnp.float32)
    dv_ref = jnp.zeros(v.shape, jnp.float32)
    for t0 in range(0, T, chunk):
        o_c, lse_c, (dq_c, dk_c, dv_c), idx_c = reference(t0)
        o_ref.append(np.asarray(o_c))
        lse_ref.append(np.asarray(lse_c))
        dq_ref.append(np.asarray(dq_c))
        idx_ref.append(np.asarray(idx_c))
        dk_ref, dv_ref = dk_ref + dk_c, dv_ref + dv_c
    o_ref, lse_ref = np.concatenate(o_ref, 1), np.concatenate(lse_ref, 1)
    dq_ref, idx_ref = np.concatenate(dq_ref, 1), np.concatenate(idx_ref, 1)
    finite = np.isfinite(lse_ref)
    lse = np.asarray(lse)
    return {
        "T": T, "dtype": args.dtype,
        "o": rel_err(o, o_ref, nonfinite="nan"),
        "lse": rel_err(lse[finite], lse_ref[finite], nonfinite="nan"),
        "lse_inf_match": bool((np.isfinite(lse) == finite).all()),
        **{name: rel_err(grad, ref, nonfinite="nan")
           for name, grad, ref in (("dq", dq, dq_ref), ("dk", dk, dk_ref), ("dv", dv, dv_ref))},
        "block_idx_rows_equal": float((block_idx == idx_ref).all(axis=-1).mean()),
    }


def time_one(args, T, sizes=None, sel_sizes=None):
    import jax

    q, k, v, do = inputs(args, T)
    forward, forward_backward, select = functions(args, sizes, sel_sizes)
    row = {"T": T}

    def timed(fn, *xs):
        return common.time_jax_fn(fn, [xs], iters=args.iters, warmup=args.warmup,
                                  repeats=args.repeats)

    try:
        row["fwd_ms"] = timed(forward, q, k, v)[0].ms
        row["fwd_tflops"] = attention_flops(args, T) / row["fwd_ms"] / 1e9
    except Exception as exc:  # keep going: report what failed
        row["fwd_ms"] = f"error: {common.short_error(exc, 300)}"
    try:
        timing, compiled = timed(forward_backward, q, k, v, do)
        row["fwd_bwd_ms"] = timing.ms
        memory = compiled.memory_analysis()
        row["fwd_bwd_temp_MiB"] = (None if memory is None
                                   else round(memory.temp_size_in_bytes / 2 ** 20, 1))
    except Exception as exc:
        row["fwd_bwd_ms"] = f"error: {common.short_error(exc, 300)}"
    try:
        _, lse = jax.jit(forward)(q, k, v)
        row["select_ms"] = timed(select, q, k, lse)[0].ms
    except Exception as exc:
        row["select_ms"] = f"error: {common.short_error(exc, 300)}"
    return row


def sweep(args):
    """Time a few tile choices at --sweep_S; return the fastest forward+backward and select
    tiles (the forward's own tiles first, then the backward's with them)."""
    import jax

    T = args.sweep_S
    q, k, v, do = inputs(args, T)
    rows, best = [], {}

    def attempt(kind, label, config, fn, *xs):
        try:
            ms = common.time_jax_fn(fn, [xs], iters=args.iters, warmup=2,
                                    repeats=args.repeats)[0].ms
        except Exception as exc:  # report, keep sweeping
            ms = f"error: {common.short_error(exc, 200)}"
        rows.append({"kernel": kind, "T": T, "config": label, "ms": ms})
        print(rows[-1], flush=True)
        if isinstance(ms, float) and (kind not in best or ms < best[kind][0]):
            best[kind] = (ms, config)

    for block_q, block_kv, warps in FWD_SWEEP:
        sizes = block_sizes(args, block_q=block_q, block_kv=block_kv, num_warps=warps)
        attempt("fwd", f"q{block_q} kv{block_kv} w{warps}", sizes, functions(args, sizes)[0],
                q, k, v)
    fwd_sizes = best["fwd"][1] if "fwd" in best else block_sizes(args)
    for q_dq, kv_dq, q_dkv, kv_dkv, warps, programs in BWD_SWEEP:
        sizes = dataclasses.replace(fwd_sizes, block_q_dq=q_dq, block_kv_dq=kv_dq,
                                    block_q_dkv=q_dkv, block_kv_dkv=kv_dkv, num_warps_bwd=warps,
                                    dkv_programs=programs)
        attempt("fwd_bwd", f"dq {q_dq}x{kv_dq} dkv {q_dkv}x{kv_dkv} w{warps} p{programs}", sizes,
                functions(args, sizes)[1], q, k, v, do)
    _, lse = jax.jit(functions(args, fwd_sizes)[0])(q, k, v)
    for block_q, block_sel, warps in SELECT_SWEEP:
        sel_sizes = select_sizes(args, block_q=block_q, block_sel=block_sel, num_warps=warps)
        attempt("select", f"q{block_q} sel{block_sel} w{warps}", sel_sizes,
                functions(args, None, sel_sizes)[2], q, k, lse)
    print_table(rows, SWEEP_COLUMNS, f"tile sweep at T={T}")
    common.write_csv(os.path.join(args.out, "compressed_sweep.csv"), rows, SWEEP_COLUMNS)
    sizes = best["fwd_bwd"][1] if "fwd_bwd" in best else fwd_sizes
    sel_sizes = best["select"][1] if "select" in best else select_sizes(args)
    print(f"chosen: fwd {fwd_sizes}\n        fwd+bwd {sizes}\n        select {sel_sizes}")
    return sizes, sel_sizes


def print_table(rows, columns, title):
    print(f"\n{title}")
    print(common.format_table([[row.get(key) for key in columns] for row in rows], columns))


def build_parser() -> argparse.ArgumentParser:
    p = common.script_parser(__doc__)
    p.add_argument("--S_list", default="8k,16k,32k,64k", help="lengths timed; 'k' = 1024")
    p.add_argument("--check_S", type=int, default=16384,
                   help="sequence length of the correctness check (0 skips it)")
    p.add_argument("--check_chunk", type=int, default=4096, help="queries per reference chunk")
    p.add_argument("--B", type=int, default=1, help="batch size")
    common.add_run_args(p, iters=10, warmup=3, repeats=5)
    common.add_nsa_args(p)
    p.add_argument("--block_q", type=int, default=None, help="forward query-tile rows")
    p.add_argument("--block_kv", type=int, default=None, help="forward key tile")
    p.add_argument("--num_warps", type=int, default=None)
    p.add_argument("--select_block_q", type=int, default=None)
    p.add_argument("--select_num_warps", type=int, default=None)
    p.add_argument("--sweep", action="store_true",
                   help="first time a few tile choices at --sweep_S, then time the lengths "
                        "with the fastest")
    p.add_argument("--sweep_S", type=int, default=16384)
    p.add_argument("--out", default="bench/results", help="folder for the CSV files")
    return p


def parse_args(argv=None):
    args = common.finish_args(build_parser().parse_args(argv))
    args.S = common.parse_int_list(args.S_list, "--S_list")
    args.interpret = args.device == "cpu"
    return args


def main(argv=None):
    argv, args = common.start(parse_args, argv)
    os.makedirs(args.out, exist_ok=True)
    common.write_environment(os.path.join(args.out, "compressed_env.json"), {"argv": argv})
    cfg = args.cfg
    print(f"B {args.B} H {cfg.n_heads} G {cfg.n_kv_heads} d_k {cfg.d_k} d_v {cfg.d_v} "
          f"l {cfg.cmp_block} d {cfg.cmp_stride} l_sel {cfg.sel_block} n_sel {cfg.n_sel} "
          f"{args.dtype}; fwd {block_sizes(args)}; select {select_sizes(args)}")

    if args.check_S:
        try:
            rows = [check(args)]
        except Exception:
            traceback.print_exc()
            rows = []
        print_table(rows, CHECK_COLUMNS,
                    f"correctness at T={args.check_S} (relative L2 vs float32 reference)")
        common.write_csv(os.path.join(args.out, "compressed_check.csv"), rows, CHECK_COLUMNS)

    sizes, sel_sizes = sweep(args) if args.sweep else (None, None)
    rows = []
    path = os.path.join(args.out, "compressed_timing.csv")
    for T in args.S:
        rows.append(time_one(args, T, sizes, sel_sizes))
        print_table(rows[-1:], TIMING_COLUMNS, f"T={T}")
        common.write_csv(path, rows, TIMING_COLUMNS)  # a timeout keeps what ran
    print_table(rows, TIMING_COLUMNS, f"timing (median ms); fwd/bwd {sizes or block_sizes(args)}; "
                                      f"select {sel_sizes or select_sizes(args)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
