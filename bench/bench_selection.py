"""Benchmark of the Pallas selected-attention kernel (NSA spec step 7) on one GPU.

1. Correctness against the XLA reference (`selected_attention_reference`, gathered in query
   chunks so it fits in memory) at T = 4k and 16k, bfloat16, forward and (dq, dk, dv).
2. Timing of forward and forward+backward at T = 8k .. 64k, B 1, H 64, G 4, d 128, l_sel 64,
   n_sel 16, random valid block_idx with the forced blocks (block 0 and the two local ones):
   median over samples of back-to-back calls, each sample closed by block_until_ready.
3. The peer: fla-org's `parallel_nsa` selection branch (torch + Triton) on the same inputs and
   block_idx, timed with torch.cuda.Event. Skipped with a message when fla or torch-CUDA is missing.

Prints tables and writes env.json, correctness.csv, timing.csv (and sweep.csv with --sweep) to
--out. Usage: python bench/bench_selection.py --out bench/results [--breakdown] [--sweep]
[--no-peer] [--quick]; --interpret runs a tiny CPU smoke version.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

# JAX must not take 75% of the GPU up front: the peer (torch) shares the device.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.selected_attention import (  # noqa: E402
    BlockSizes,
    random_block_idx,
    selected_attention,
    selected_attention_reference,
)

BF16_TOLERANCE = 1e-2  # spec: bfloat16 outputs and gradients, relative L2 error
KERNEL_KW: dict = {}   # {"interpret": True} for a CPU smoke run (--interpret)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench/results", help="directory for the CSV/JSON files")
    p.add_argument("--check-lens", default="4096,16384", help="T values of the correctness check")
    p.add_argument("--seq-lens", default="8192,16384,32768,65536", help="T values timed")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--sel-block", type=int, default=64)
    p.add_argument("--n-sel", type=int, default=16)
    p.add_argument("--samples", type=int, default=15, help="timing samples (median reported)")
    p.add_argument("--inner", type=int, default=3, help="back-to-back calls per sample")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--ref-chunk", type=int, default=256, help="reference query chunk")
    p.add_argument("--no-peer", action="store_true", help="skip fla-org parallel_nsa")
    p.add_argument("--sweep", action="store_true", help="also time BlockSizes variants")
    p.add_argument("--sweep-len", type=int, default=65536)
    p.add_argument("--breakdown", action="store_true", help="time fwd, dq, index, dk/dv apart")
    p.add_argument("--no-check", action="store_true", help="skip the correctness section")
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    p.add_argument("--interpret", action="store_true",
                   help="Pallas interpret mode (CPU smoke run of this script; implies --quick)")
    return p.parse_args()


def rel_err(actual, expected) -> float:
    a = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    e = np.asarray(jnp.asarray(expected, jnp.float32), np.float64)
    if not np.all(np.isfinite(a)):
        return float("nan")
    return float(np.linalg.norm(a - e) / np.linalg.norm(e))


def make_inputs(T, args, seed=0, dtype=jnp.bfloat16):
    B, H, G, d = args.batch, args.heads, args.kv_heads, args.head_dim
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(keys[0], (B, T, H, d), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (B, T, G, d), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (B, T, G, d), jnp.float32).astype(dtype)
    do = jax.random.normal(keys[3], (B, T, H, d), jnp.float32).astype(dtype)
    block_idx = random_block_idx(keys[4], B, T, G, args.n_sel, args.sel_block)
    return q, k, v, do, jax.block_until_ready(block_idx)


def attended_keys(block_idx, l_sel) -> int:
    """Sum over (b, t, g) of the keys query t reads: the FLOP count's key term."""
    idx = np.asarray(block_idx).astype(np.int64)
    t = np.arange(idx.shape[1])[None, :, None, None]
    keys = np.clip(t - idx * l_sel + 1, 0, l_sel) * (idx >= 0)
    return int(keys.sum())


# ------------------------------------------------------------------------------------------------
def environment() -> dict:
    env = {"device": str(jax.devices()[0].device_kind), "platform": jax.devices()[0].platform,
           "jax": jax.__version__}
    try:
        import jaxlib
        env["jaxlib"] = jaxlib.__version__
    except Exception:  # noqa: BLE001 - informational only
        pass
    try:
        env["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True, check=True).stdout.strip()
    except Exception:  # noqa: BLE001
        env["commit"] = "unknown"
    try:
        import torch
        env["torch"] = torch.__version__
        import fla
        env["fla"] = getattr(fla, "__version__", "unknown")
    except Exception as exc:  # noqa: BLE001
        env["peer_import"] = f"{type(exc).__name__}: {exc}"
    return env


def correctness(args, lens) -> list[dict]:
    rows = []
    l_sel = args.sel_block
    for T in lens:
        q, k, v, do, block_idx = make_inputs(T, args, seed=T)

        @jax.jit
        def kernel_vjp(q, k, v, do):
            o, pullback = jax.vjp(lambda q, k, v: selected_attention(q, k, v, block_idx, l_sel,
                                                                   **KERNEL_KW), q, k, v)
            return o, pullback(do)

        @jax.jit
        def reference_vjp(q, k, v, do):
            f = lambda q, k, v: selected_attention_reference(q, k, v, block_idx, l_sel,
                                                             query_chunk=args.ref_chunk)
            o, pullback = jax.vjp(f, q, k, v)
            return o, pullback(do)

        t0 = time.perf_counter()
        o, grads = jax.block_until_ready(kernel_vjp(q, k, v, do))
        up = [x.astype(jnp.float32) for x in (q, k, v, do)]
        o_ref, grads_ref = jax.block_until_ready(reference_vjp(*up))
        for name, got, want in zip(("o", "dq", "dk", "dv"), (o, *grads), (o_ref, *grads_ref)):
            err = rel_err(got, want)
            rows.append({"T": T, "quantity": name, "rel_err": err, "tolerance": BF16_TOLERANCE,
                         "pass": bool(err <= BF16_TOLERANCE)})
        print(f"  T={T}: checked in {time.perf_counter() - t0:.1f} s", flush=True)
        peer = peer_output(q, k, v, block_idx, args) if not args.no_peer else None
        if peer is not None:
            err = rel_err(peer, o_ref)
            rows.append({"T": T, "quantity": "peer o", "rel_err": err,
                         "tolerance": BF16_TOLERANCE, "pass": bool(err <= BF16_TOLERANCE)})
        del q, k, v, do, o, grads, o_ref, grads_ref
    return rows


# ------------------------------------------------------------------------------------------------
def time_jax(fn, fn_args, args) -> tuple[float, float]:
    jax.block_until_ready(fn(*fn_args))  # compile
    for _ in range(args.warmup):
        jax.block_until_ready(fn(*fn_args))
    samples = []
    for _ in range(args.samples):
        t0 = time.perf_counter()
        for _ in range(args.inner):
            out = fn(*fn_args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / args.inner * 1e3)
    return statistics.median(samples), min(samples)


def jax_fns(block_idx, args, block_sizes=None):
    l_sel = args.sel_block
    fwd = jax.jit(lambda q, k, v: selected_attention(q, k, v, block_idx, l_sel,
                                                     block_sizes=block_sizes, **KERNEL_KW))

    @jax.jit
    def fwd_bwd(q, k, v, do):
        o, pullback = jax.vjp(lambda q, k, v: selected_attention(
            q, k, v, block_idx, l_sel, block_sizes=block_sizes, **KERNEL_KW), q, k, v)
        return pullback(do)

    return fwd, fwd_bwd


_PEER = {}


def load_peer():
    if "fn" not in _PEER:
        try:
            import torch
            if not torch.cuda.is_available():
                raise RuntimeError("torch sees no CUDA device")
            from fla.ops.nsa import parallel_nsa
            _PEER["fn"], _PEER["torch"] = parallel_nsa, torch
        except Exception as exc:  # noqa: BLE001 - any failure means: no peer rows
            _PEER["fn"] = None
            _PEER["why"] = f"{type(exc).__name__}: {exc}"
            print(f"  peer skipped: fla-org parallel_nsa unavailable ({_PEER['why']})")
    return _PEER["fn"]


def to_torch(x, dtype=None):
    torch = _PEER["torch"]
    t = torch.from_numpy(np.asarray(jnp.asarray(x, jnp.float32) if dtype is not None else x))
    return t.to("cuda", dtype=dtype) if dtype is not None else t.to("cuda")


def peer_call(q, k, v, block_idx, args):
    """fla-org's selection branch alone: no compression gate, no window."""
    return _PEER["fn"](q=q, k=k, v=v, block_indices=block_idx, block_counts=args.n_sel,
                       block_size=args.sel_block, scale=args.head_dim ** -0.5)


def peer_output(q, k, v, block_idx, args):
    if load_peer() is None:
        return None
    torch = _PEER["torch"]
    try:
        tq, tk, tv = (to_torch(x, torch.bfloat16) for x in (q, k, v))
        idx = to_torch(np.asarray(block_idx)).to(torch.int32)
        with torch.no_grad():
            o = peer_call(tq, tk, tv, idx, args)
        return jnp.asarray(o.float().cpu().numpy())
    except Exception:  # noqa: BLE001
        print("  peer forward failed:\n" + traceback.format_exc())
        return None


def time_peer(q, k, v, do, block_idx, args):
    torch = _PEER["torch"]
    tq, tk, tv, tdo = (to_torch(x, torch.bfloat16) for x in (q, k, v, do))
    idx = to_torch(np.asarray(block_idx)).to(torch.int32)
    for x in (tq, tk, tv):
        x.requires_grad_(True)

    def fwd():
        with torch.no_grad():
            return peer_call(tq, tk, tv, idx, args)

    def fwd_bwd():
        o = peer_call(tq, tk, tv, idx, args)
        o.backward(tdo)
        return o

    results = []
    for fn in (fwd, fwd_bwd):
        for _ in range(1 + args.warmup):
            fn()
        torch.cuda.synchronize()
        samples = []
        for _ in range(args.samples):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.inner):
                fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / args.inner)
        results.append((statistics.median(samples), min(samples)))
    torch.cuda.empty_cache()
    return results


def timing(args, lens) -> list[dict]:
    rows = []
    H, d = args.heads, args.head_dim
    for T in lens:
        q, k, v, do, block_idx = make_inputs(T, args, seed=T + 1)
        fwd_flops = 2 * 2 * d * (H // args.kv_heads) * attended_keys(block_idx, args.sel_block)
        # Backward: dq recomputes s, dp and forms dq; dk/dv recompute s, dp and form dv, dk.
        total_flops = fwd_flops * (1 + 7 / 2)
        fwd, fwd_bwd = jax_fns(block_idx, args)
        for label, fn, fn_args, flops in (("fwd", fwd, (q, k, v), fwd_flops),
                                          ("fwd+bwd", fwd_bwd, (q, k, v, do), total_flops)):
            try:
                med, best = time_jax(fn, fn_args, args)
                rows.append({"impl": "pallas", "T": T, "pass": label, "median_ms": med,
                             "min_ms": best, "tflops": flops / med / 1e9})
            except Exception:  # noqa: BLE001 - report and go on with the other rows
                print(f"  pallas {label} T={T} failed:\n" + traceback.format_exc())
        del fwd, fwd_bwd
        if not args.no_peer and load_peer() is not None:
            try:
                (fm, fb), (bm, bb) = time_peer(q, k, v, do, block_idx, args)
                rows.append({"impl": "fla parallel_nsa", "T": T, "pass": "fwd", "median_ms": fm,
                             "min_ms": fb, "tflops": fwd_flops / fm / 1e9})
                rows.append({"impl": "fla parallel_nsa", "T": T, "pass": "fwd+bwd",
                             "median_ms": bm, "min_ms": bb, "tflops": total_flops / bm / 1e9})
            except Exception:  # noqa: BLE001
                print(f"  peer T={T} failed:\n" + traceback.format_exc())
        for row in rows[-4:]:
            if row["T"] == T:
                print(f"  {row['impl']:>18} T={T:>6} {row['pass']:>8}: {row['median_ms']:8.3f} ms"
                      f" (min {row['min_ms']:.3f}, {row['tflops']:.0f} TFLOP/s)", flush=True)
        del q, k, v, do
    return rows


def sweep(args) -> list[dict]:
    """Launch-parameter variants at one T, each checked against the default's outputs."""
    T = args.sweep_len
    q, k, v, do, block_idx = make_inputs(T, args, seed=7)
    variants = {
        "default": BlockSizes(),
        "fwd/dq 2 warps": BlockSizes(num_warps_fwd=2, num_warps_dq=2),
        "fwd/dq 8 warps": BlockSizes(num_warps_fwd=8, num_warps_dq=8),
        "fwd/dq 1 stage": BlockSizes(num_stages_fwd=1, num_stages_dq=1),
        "fwd/dq 3 stages": BlockSizes(num_stages_fwd=3, num_stages_dq=3),
        "fwd/dq 2 warps 1 stage": BlockSizes(num_warps_fwd=2, num_warps_dq=2, num_stages_fwd=1,
                                             num_stages_dq=1),
        "dkv rows 128": BlockSizes(dkv_rows=128),
        "dkv rows 128, 8 warps": BlockSizes(dkv_rows=128, num_warps_dkv=8),
        "dkv rows 32": BlockSizes(dkv_rows=32),
        "dkv 1 stage": BlockSizes(num_stages_dkv=1),
        "dkv 3 stages": BlockSizes(num_stages_dkv=3),
        "dkv chunk 1024": BlockSizes(dkv_chunk=1024),
        "dkv chunk 8192": BlockSizes(dkv_chunk=8192),
    }
    rows, base = [], None
    for name, bs in variants.items():
        fwd, fwd_bwd = jax_fns(block_idx, args, bs)
        try:
            outs = jax.block_until_ready((fwd(q, k, v), *fwd_bwd(q, k, v, do)))
            base = outs if base is None else base
            err = max(rel_err(a, b) for a, b in zip(outs, base))
            fm, _ = time_jax(fwd, (q, k, v), args)
            bm, _ = time_jax(fwd_bwd, (q, k, v, do), args)
            rows.append({"variant": name, "T": T, "fwd_ms": fm, "fwd_bwd_ms": bm,
                         "max_rel_diff_vs_default": err})
            print(f"  {name:>24}: fwd {fm:8.3f} ms, fwd+bwd {bm:8.3f} ms, "
                  f"diff vs default {err:.1e}", flush=True)
            write_csv(os.path.join(args.out, "sweep.csv"), rows)  # a timeout keeps what ran
        except Exception:  # noqa: BLE001
            print(f"  {name} failed:\n" + traceback.format_exc())
    return rows


def breakdown(args) -> list[dict]:
    """Time the pieces of forward+backward separately at the largest timed T."""
    import importlib
    sa = importlib.import_module("pallas_kernels.selected_attention")
    T = max(int(x) for x in args.seq_lens.split(","))
    q, k, v, do, block_idx = make_inputs(T, args, seed=T + 1)
    geo = sa._validate(q, k, v, block_idx, args.sel_block)
    scale, bs = args.head_dim ** -0.5, BlockSizes()
    interpret = KERNEL_KW.get("interpret", False)
    fwd = jax.jit(lambda q, k, v: sa._forward(q, k, v, block_idx, geo, scale, bs, interpret,
                                              False))
    o, lse = jax.block_until_ready(fwd(q, k, v))
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
    rest = (geo, scale, bs, interpret, False)
    dq = jax.jit(lambda q, k, v: sa._backward_dq(q, k, v, block_idx, do, lse, delta, *rest))
    dkv = jax.jit(lambda q, k, v: sa._backward_dkv(q, k, v, block_idx, do, lse, delta, *rest))
    rows_per_step = max(bs.dkv_rows, 16)
    chunk = sa._dkv_chunk(geo, bs)
    inv = jax.jit(lambda idx: sa._inverse_index(idx, geo, chunk, pad=rows_per_step))
    n_items = geo.n_blocks + -(-T * geo.n_sel // chunk)
    rows = []
    for name, fn, fn_args in (("forward kernel", fwd, (q, k, v)),
                              ("dq kernel", dq, (q, k, v)),
                              ("inverse index (XLA)", inv, (block_idx,)),
                              ("dk/dv kernels + reduce (incl. index)", dkv, (q, k, v))):
        med, _ = time_jax(fn, fn_args, args)
        rows.append({"T": T, "piece": name, "median_ms": med})
        print(f"  {name:>38}: {med:8.3f} ms", flush=True)
    print(f"  dk/dv work items per (b, g): {n_items} (chunk {chunk})")
    return rows


def write_csv(path, rows):
    if not rows:
        return
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        writer.writeheader()
        writer.writerows(rows)


def main():
    args = parse_args()
    if args.interpret:
        KERNEL_KW["interpret"] = True
        args.quick = True
    if args.quick:
        args.check_lens, args.seq_lens, args.heads = "1024", "2048,4096", 32
        args.samples, args.sweep_len = 5, 4096
        if args.interpret:
            args.check_lens, args.seq_lens, args.heads, args.kv_heads = "200", "256", 16, 1
            args.head_dim, args.samples, args.warmup, args.inner, args.sweep_len = 32, 2, 0, 1, 256
    os.makedirs(args.out, exist_ok=True)
    env = environment()
    print("environment:", json.dumps(env))
    with open(os.path.join(args.out, "env.json"), "w") as f:
        json.dump({**env, "args": vars(args)}, f, indent=2)
    lens = lambda s: [int(x) for x in s.split(",") if x]

    print(f"\n== correctness vs XLA reference (bf16, B {args.batch}, H {args.heads}, "
          f"G {args.kv_heads}, d {args.head_dim}, l_sel {args.sel_block}, n_sel {args.n_sel})")
    check = [] if args.no_check else correctness(args, lens(args.check_lens))
    write_csv(os.path.join(args.out, "correctness.csv"), check)
    print(f"{'T':>7} {'quantity':>9} {'rel err':>10} {'pass':>5}")
    for r in check:
        print(f"{r['T']:>7} {r['quantity']:>9} {r['rel_err']:10.2e} {str(r['pass']):>5}")

    print("\n== timing (median ms)")
    rows = timing(args, lens(args.seq_lens))
    write_csv(os.path.join(args.out, "timing.csv"), rows)

    if args.breakdown:
        print("\n== breakdown (median ms)")
        write_csv(os.path.join(args.out, "breakdown.csv"), breakdown(args))

    if args.sweep:
        print(f"\n== BlockSizes sweep at T={args.sweep_len}")
        sweep(args)

    print(f"\n== summary ({env['device']}, jax {env['jax']}, commit {env.get('commit')})")
    impls = sorted({r["impl"] for r in rows}, reverse=True)
    header = f"{'T':>7} " + " ".join(f"{impl + ' ' + p:>26}" for impl in impls
                                        for p in ("fwd", "fwd+bwd"))
    print(header)
    for T in lens(args.seq_lens):
        cells = []
        for impl in impls:
            for p in ("fwd", "fwd+bwd"):
                hit = [r for r in rows if r["impl"] == impl and r["T"] == T and r["pass"] == p]
                cells.append(f"{hit[0]['median_ms']:23.3f} ms" if hit else f"{'-':>26}")
        print(f"{T:>7} " + " ".join(cells))
    ok = all(r["pass"] for r in check if r["quantity"] != "peer o")
    print(f"correctness: {'PASS' if ok else 'FAIL'}")


if __name__ == "__main__":
    main()
