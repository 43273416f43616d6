"""Benchmark of the compressed-attention and block-selection Pallas kernels (GPU).

1. Correctness at `--check-len` tokens against the plain-jnp references, evaluated a chunk of
   queries at a time so that the dense `[T, C]` probabilities fit in memory: relative L2 error of
   o, lse and the three gradients, and the share of (t, g) rows whose `block_idx` agree.
2. Timing (median of `--iters` runs after `--warmup`) of the forward, forward+backward and
   `select_blocks` at each of `--seq-lens`, with the paper's shapes by default
   (B 1, H 64, G 4, d 128, l 32, d 16, l_sel 64, n_sel 16), and the scratch memory XLA reports for
   the compiled forward+backward (no `[T, T/d]` array: it stays O(T)).

Prints a table and writes CSV files into `--out`.

    python bench/bench_compressed.py --out bench/results
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pallas_kernels.compressed_attention import (  # noqa: E402
    BlockSizes,
    compressed_attention,
    compressed_attention_reference,
)
from pallas_kernels.select_blocks import BlockSizes as SelectBlockSizes  # noqa: E402
from pallas_kernels.select_blocks import select_blocks, select_blocks_reference  # noqa: E402

DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    p.add_argument("--check-len", type=int, default=16384,
                   help="sequence length of the correctness check (0 skips it)")
    p.add_argument("--check-chunk", type=int, default=4096, help="queries per reference chunk")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--d-k", type=int, default=128)
    p.add_argument("--d-v", type=int, default=128)
    p.add_argument("--cmp-block", type=int, default=32)
    p.add_argument("--cmp-stride", type=int, default=16)
    p.add_argument("--sel-block", type=int, default=64)
    p.add_argument("--n-sel", type=int, default=16)
    p.add_argument("--n-init", type=int, default=1)
    p.add_argument("--n-local", type=int, default=2)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--block-q", type=int, default=None, help="forward query-tile rows")
    p.add_argument("--block-kv", type=int, default=None, help="forward key tile")
    p.add_argument("--num-warps", type=int, default=None)
    p.add_argument("--select-block-q", type=int, default=None)
    p.add_argument("--select-num-warps", type=int, default=None)
    p.add_argument("--sweep", action="store_true",
                   help="first time a few tile choices at --sweep-len, then time the lengths "
                        "with the fastest")
    p.add_argument("--sweep-len", type=int, default=16384)
    p.add_argument("--out", default="bench/results", help="folder for the CSV files")
    p.add_argument("--interpret", action="store_true",
                   help="run the kernels in Pallas' interpreter (a CPU smoke test of the script)")
    return p.parse_args(argv)


def inputs(args, T, seed=0):
    C = max(0, (T - args.cmp_block) // args.cmp_stride + 1)
    dtype = DTYPES[args.dtype]
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    B, H, G = args.batch, args.heads, args.kv_heads
    q = jax.random.normal(keys[0], (B, T, H, args.d_k), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (B, C, G, args.d_k), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (B, C, G, args.d_v), jnp.float32).astype(dtype)
    do = jax.random.normal(keys[3], (B, T, H, args.d_v), jnp.float32).astype(dtype)
    return q, k, v, do


def block_sizes(args, **over):
    base = BlockSizes()
    changes = {"block_q": args.block_q, "block_kv": args.block_kv, "num_warps": args.num_warps}
    changes.update(over)
    return BlockSizes(**{**base.__dict__, **{k: v for k, v in changes.items() if v is not None}})


def select_sizes(args, **over):
    base = SelectBlockSizes()
    changes = {"block_q": args.select_block_q, "num_warps": args.select_num_warps}
    changes.update(over)
    return SelectBlockSizes(**{**base.__dict__,
                               **{k: v for k, v in changes.items() if v is not None}})


def cmp_kw(args):
    return dict(cmp_block=args.cmp_block, cmp_stride=args.cmp_stride)


def sel_kw(args):
    return dict(cmp_block=args.cmp_block, cmp_stride=args.cmp_stride, sel_block=args.sel_block,
                n_sel=args.n_sel, n_init=args.n_init, n_local=args.n_local)


def median_ms(fn, *xs, warmup, iters):
    for _ in range(warmup):
        jax.block_until_ready(fn(*xs))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*xs))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def rel_err(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    if not np.isfinite(x).all():
        return float("nan")
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def attention_flops(args, T):
    """Matmul FLOPs of the forward: 2 (d_k + d_v) per admissible (query, head, block)."""
    t = np.arange(T)
    seen = np.clip((t - args.cmp_block + 1) // args.cmp_stride + 1, 0, None).sum()
    return 2.0 * args.batch * args.heads * seen * (args.d_k + args.d_v)


def functions(args, sizes=None, sel_sizes=None):
    kw = cmp_kw(args)
    sizes = sizes or block_sizes(args)
    sel_sizes = sel_sizes or select_sizes(args)

    @jax.jit
    def forward(q, k, v):
        return compressed_attention(q, k, v, block_sizes=sizes, interpret=args.interpret, **kw)

    @jax.jit
    def forward_backward(q, k, v, do):
        def loss(q, k, v):
            o, _ = compressed_attention(q, k, v, block_sizes=sizes, interpret=args.interpret,
                                        **kw)
            return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    @jax.jit
    def select(q, k, lse):
        return select_blocks(q, k, lse, block_sizes=sel_sizes, interpret=args.interpret,
                             **sel_kw(args))

    return forward, forward_backward, select


def check(args):
    """Kernels against the chunked float32 references at `--check-len` tokens."""
    T, chunk = args.check_len, args.check_chunk
    q, k, v, do = inputs(args, T, seed=1)
    dlse = jnp.zeros(q.shape[:3], jnp.float32)
    forward, forward_backward, select = functions(args)
    o, lse = forward(q, k, v)
    dq, dk, dv = forward_backward(q, k, v, do)
    block_idx = np.asarray(select(q, k, lse))

    f32 = lambda x: x.astype(jnp.float32)
    kw = cmp_kw(args)

    def reference(t0):
        q_chunk = f32(q[:, t0:t0 + chunk])

        def attend(q_chunk, k, v):
            return compressed_attention_reference(q_chunk, k, v, q_offset=t0, **kw)

        (o_ref, lse_ref), vjp = jax.vjp(attend, q_chunk, f32(k), f32(v))
        grads = vjp((f32(do[:, t0:t0 + chunk]), dlse[:, t0:t0 + chunk]))
        idx_ref = select_blocks_reference(q[:, t0:t0 + chunk], k, lse[:, t0:t0 + chunk],
                                          q_offset=t0, **sel_kw(args))
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
    row = {
        "T": T, "dtype": args.dtype,
        "o": rel_err(o, o_ref),
        "lse": rel_err(lse[finite], lse_ref[finite]),
        "lse_inf_match": bool((np.isfinite(lse) == finite).all()),
        "dq": rel_err(dq, dq_ref), "dk": rel_err(dk, dk_ref), "dv": rel_err(dv, dv_ref),
        "block_idx_rows_equal": float((block_idx == idx_ref).all(axis=-1).mean()),
    }
    return row


def time_one(args, T, sizes=None, sel_sizes=None):
    q, k, v, do = inputs(args, T)
    forward, forward_backward, select = functions(args, sizes, sel_sizes)
    row = {"T": T}
    ms = lambda fn, *xs: median_ms(fn, *xs, warmup=args.warmup, iters=args.iters)
    try:
        row["fwd_ms"] = ms(forward, q, k, v)
        row["fwd_tflops"] = attention_flops(args, T) / row["fwd_ms"] / 1e9
    except Exception as e:  # keep going: report what failed
        row["fwd_ms"] = f"error: {type(e).__name__}: {str(e)[:300]}"
    try:
        row["fwd_bwd_ms"] = ms(forward_backward, q, k, v, do)
        memory = forward_backward.lower(q, k, v, do).compile().memory_analysis()
        row["fwd_bwd_temp_MiB"] = (None if memory is None
                                   else round(memory.temp_size_in_bytes / 2 ** 20, 1))
    except Exception as e:
        row["fwd_bwd_ms"] = f"error: {type(e).__name__}: {str(e)[:300]}"
    try:
        _, lse = forward(q, k, v)
        row["select_ms"] = ms(select, q, k, lse)
    except Exception as e:
        row["select_ms"] = f"error: {type(e).__name__}: {str(e)[:300]}"
    return row


FWD_SWEEP = [(64, 64, 4), (128, 32, 4), (128, 64, 8), (256, 64, 8), (128, 32, 8), (256, 32, 8)]
# (block_q_dq, block_kv_dq, block_q_dkv, block_kv_dkv, num_warps, dkv_programs)
BWD_SWEEP = [(64, 32, 64, 32, 4, 1024), (128, 32, 64, 32, 4, 1024), (128, 64, 128, 64, 8, 1024),
             (64, 64, 64, 64, 4, 1024), (128, 32, 128, 32, 8, 2048), (64, 32, 64, 32, 4, 4096)]
# (block_q, block_sel, num_warps)
SELECT_SWEEP = [(64, 16, 4), (128, 16, 4), (256, 16, 8), (64, 32, 4), (128, 32, 8), (256, 32, 8)]


def sweep(args):
    """Time a few tile choices at `--sweep-len`; return the fastest forward+backward and select
    tiles (the forward's own tiles first, then the backward's with them)."""
    T = args.sweep_len
    q, k, v, do = inputs(args, T)
    timed = lambda fn, *xs: median_ms(fn, *xs, warmup=2, iters=args.iters)
    rows, best = [], {}

    def attempt(kind, config, fn, *xs):
        try:
            ms = timed(fn, *xs)
        except Exception as e:  # report, keep sweeping
            ms = f"error: {type(e).__name__}: {str(e)[:200]}"
        if kind == "fwd":
            label = f"q{config.block_q} kv{config.block_kv} w{config.num_warps}"
        elif kind == "fwd_bwd":
            label = (f"dq {config.block_q_dq}x{config.block_kv_dq} dkv {config.block_q_dkv}x"
                     f"{config.block_kv_dkv} w{config.num_warps_bwd} p{config.dkv_programs}")
        else:
            label = f"q{config.block_q} sel{config.block_sel} w{config.num_warps}"
        rows.append({"kernel": kind, "T": T, "config": label, "ms": ms})
        print(rows[-1], flush=True)
        if isinstance(ms, float) and (kind not in best or ms < best[kind][0]):
            best[kind] = (ms, config)

    for block_q, block_kv, warps in FWD_SWEEP:
        sizes = block_sizes(args, block_q=block_q, block_kv=block_kv, num_warps=warps)
        attempt("fwd", sizes, functions(args, sizes)[0], q, k, v)
    fwd_sizes = best["fwd"][1] if "fwd" in best else block_sizes(args)
    for q_dq, kv_dq, q_dkv, kv_dkv, warps, programs in BWD_SWEEP:
        sizes = BlockSizes(**{**fwd_sizes.__dict__, "block_q_dq": q_dq, "block_kv_dq": kv_dq,
                              "block_q_dkv": q_dkv, "block_kv_dkv": kv_dkv,
                              "num_warps_bwd": warps, "dkv_programs": programs})
        attempt("fwd_bwd", sizes, functions(args, sizes)[1], q, k, v, do)
    _, lse = functions(args, fwd_sizes)[0](q, k, v)
    for block_q, block_sel, warps in SELECT_SWEEP:
        sel_sizes = select_sizes(args, block_q=block_q, block_sel=block_sel, num_warps=warps)
        attempt("select", sel_sizes, functions(args, None, sel_sizes)[2], q, k, lse)
    print_table(rows, f"tile sweep at T={T}")
    write_csv(rows, os.path.join(args.out, "compressed_sweep.csv"))
    sizes = best["fwd_bwd"][1] if "fwd_bwd" in best else fwd_sizes
    sel_sizes = best["select"][1] if "select" in best else select_sizes(args)
    print(f"chosen: fwd {fwd_sizes}\n        fwd+bwd {sizes}\n        select {sel_sizes}")
    return sizes, sel_sizes


def print_table(rows, title):
    if not rows:
        return
    keys = list(dict.fromkeys(key for row in rows for key in row))
    fmt = lambda x: f"{x:.4g}" if isinstance(x, float) else str(x)
    widths = {key: max(len(key), *(len(fmt(row.get(key, ""))) for row in rows)) for key in keys}
    print(f"\n{title}")
    print("  ".join(key.rjust(widths[key]) for key in keys))
    for row in rows:
        print("  ".join(fmt(row.get(key, "")).rjust(widths[key]) for key in keys))


def write_csv(rows, path):
    if not rows:
        return
    keys = list(dict.fromkeys(key for row in rows for key in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    print(f"jax {jax.__version__}, devices {jax.devices()}")
    print(f"B {args.batch} H {args.heads} G {args.kv_heads} d_k {args.d_k} d_v {args.d_v} "
          f"l {args.cmp_block} d {args.cmp_stride} l_sel {args.sel_block} n_sel {args.n_sel} "
          f"{args.dtype}; fwd {block_sizes(args)}; select {select_sizes(args)}")

    if args.check_len:
        try:
            rows = [check(args)]
        except Exception:
            traceback.print_exc()
            rows = []
        print_table(rows, f"correctness at T={args.check_len} (relative L2 vs float32 reference)")
        write_csv(rows, os.path.join(args.out, "compressed_check.csv"))

    sizes, sel_sizes = None, None
    if args.sweep:
        sizes, sel_sizes = sweep(args)

    rows = []
    for T in args.seq_lens:
        rows.append(time_one(args, T, sizes, sel_sizes))
        print_table(rows[-1:], f"T={T}")
        write_csv(rows, os.path.join(args.out, "compressed_timing.csv"))
    print_table(rows, f"timing (median ms); fwd/bwd {sizes or block_sizes(args)}; "
                      f"select {sel_sizes or select_sizes(args)}")


if __name__ == "__main__":
    main()
