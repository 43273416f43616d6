"""Benchmark of the Pallas selected-attention kernel (NSA spec step 7).

1. Correctness against the XLA reference (`selected_attention_reference`, gathered in query
   chunks so it fits in memory) at each of --check_S, forward and (dq, dk, dv); fla-org's output
   too when it runs.
2. Timing (`common.time_jax`) of forward and forward+backward at each of --S_list, with random
   valid block_idx holding the forced blocks (the first and the two local ones).
3. The peer: fla-org's `parallel_nsa` selection branch (torch + Triton) on the same inputs and
   block_idx (`common.time_torch`); skipped with a message without fla or torch-CUDA (--no_peer).

--breakdown times the kernel's stages apart (forward, dq, inverse index, dk/dv) at the largest
S; --sweep times BlockSizes variants at --sweep_S. With --device cpu the kernels run in Pallas'
interpreter (a smoke run of the script, not a timing).

Writes to --out: env.json, correctness.csv, timing.csv, timing.png (breakdown.csv, sweep.csv).

Example (GPU): python bench/bench_selection.py --out bench/results [--breakdown] [--sweep]
CPU smoke:     python bench/bench_selection.py --device cpu --H 16 --G 1 --dk 32 --dv 32 \
                   --S_list 256 --check_S 200 --iters 1 --repeats 2 --warmup 0 \
                   --out /tmp/bench_selection   (add --breakdown, --sweep --sweep_S 256)
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402  (sets the allocator environment before jax loads)
from bench.common import Skip  # noqa: E402
from nsa_common.testing import rel_err  # noqa: E402

CORRECTNESS_COLUMNS = ["T", "quantity", "rel_err", "tolerance", "pass"]
TIMING_COLUMNS = ["impl", "T", "pass", "median_ms", "min_ms", "tflops"]
BREAKDOWN_COLUMNS = ["T", "piece", "median_ms"]
SWEEP_COLUMNS = ["variant", "T", "fwd_ms", "fwd_bwd_ms", "max_rel_diff_vs_default"]
PASSES = ("fwd", "fwd+bwd")


def make_inputs(T: int, args, seed: int = 0):
    """q, k, v, the output cotangent do, and a random valid block_idx at length T."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.selected_attention import random_block_idx

    cfg, B, dtype = args.cfg, args.B, common.jnp_dtype(args.dtype)
    H, G = cfg.n_heads, cfg.n_kv_heads
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(keys[0], (B, T, H, cfg.d_k), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (B, T, G, cfg.d_k), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (B, T, G, cfg.d_v), jnp.float32).astype(dtype)
    do = jax.random.normal(keys[3], (B, T, H, cfg.d_v), jnp.float32).astype(dtype)
    block_idx = random_block_idx(keys[4], B, T, G, cfg.n_sel, cfg.sel_block, n_init=cfg.n_init,
                                 n_local=cfg.n_local)
    return q, k, v, do, jax.block_until_ready(block_idx)


def attended_keys(block_idx, l_sel) -> int:
    """Sum over (b, t, g) of the keys query t reads: the FLOP count's key term."""
    import numpy as np

    idx = np.asarray(block_idx).astype(np.int64)
    t = np.arange(idx.shape[1])[None, :, None, None]
    keys = np.clip(t - idx * l_sel + 1, 0, l_sel) * (idx >= 0)
    return int(keys.sum())


def kernel_functions(block_idx, args, block_sizes=None):
    """(forward(q, k, v), forward_backward(q, k, v, do) -> (dq, dk, dv)) of the kernel."""
    import jax

    from pallas_kernels.selected_attention import selected_attention

    def forward(q, k, v):
        return selected_attention(q, k, v, block_idx, args.cfg.sel_block,
                                  block_sizes=block_sizes, interpret=args.interpret)

    def forward_backward(q, k, v, do):
        _, pullback = jax.vjp(forward, q, k, v)
        return pullback(do)

    return forward, forward_backward


def _ms(fn, fn_args, args) -> common.Timing:
    timing, _ = common.time_jax_fn(fn, [fn_args], iters=args.iters, warmup=args.warmup,
                                   repeats=args.repeats)
    return timing


# ------------------------------------------------------------------------------------------------
# The peer: fla-org's selection branch
# ------------------------------------------------------------------------------------------------
def fla_selection(cfg):
    """fla-org's selection branch alone (no compression gate, no window) as
    fn(q, k, v, block_idx) on torch CUDA tensors. Skip without fla or torch-CUDA."""
    try:
        import torch
        from fla.ops.nsa import parallel_nsa
    except ImportError as exc:
        raise Skip(f"fla-org parallel_nsa not importable ({exc})") from None
    if not torch.cuda.is_available():
        raise Skip("torch sees no CUDA device")

    def call(q, k, v, block_idx):
        return parallel_nsa(q=q, k=k, v=v, block_indices=block_idx, block_counts=cfg.n_sel,
                            block_size=cfg.sel_block, scale=cfg.scale)

    return call


def peer_problem(block_idx, *arrays):
    """block_idx (int32) and `arrays` (in their dtype) as torch CUDA tensors."""
    import torch

    from parity.convert import jax_to_torch

    return (jax_to_torch(block_idx, "cuda").to(torch.int32),
            *(jax_to_torch(x, "cuda") for x in arrays))


def peer_output(peer, q, k, v, block_idx):
    import jax.numpy as jnp
    import torch

    idx, tq, tk, tv = peer_problem(block_idx, q, k, v)
    with torch.no_grad():
        return jnp.asarray(peer(tq, tk, tv, idx).float().cpu().numpy())


def time_peer(peer, q, k, v, do, block_idx, args) -> dict[str, common.Timing]:
    import torch

    idx, tq, tk, tv, tdo = peer_problem(block_idx, q, k, v, do)
    for x in (tq, tk, tv):
        x.requires_grad_(True)

    def forward(i):
        with torch.no_grad():
            return peer(tq, tk, tv, idx)

    def forward_backward(i):
        return torch.autograd.grad(peer(tq, tk, tv, idx), (tq, tk, tv), tdo)

    timings = {name: common.time_torch(step, iters=args.iters, warmup=1 + args.warmup,
                                       repeats=args.repeats)
               for name, step in zip(PASSES, (forward, forward_backward))}
    torch.cuda.empty_cache()
    return timings


# ------------------------------------------------------------------------------------------------
# Sections
# ------------------------------------------------------------------------------------------------
def correctness(args, peer) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.selected_attention import selected_attention_reference

    rows = []
    l_sel, tolerance = args.cfg.sel_block, common.REL_L2_TOLERANCE[args.dtype]

    def row(T, quantity, err):
        return {"T": T, "quantity": quantity, "rel_err": err, "tolerance": tolerance,
                "pass": bool(err <= tolerance)}

    for T in args.check_S:
        q, k, v, do, block_idx = make_inputs(T, args, seed=T)
        forward, forward_backward = kernel_functions(block_idx, args)

        def reference(q, k, v):
            return selected_attention_reference(q, k, v, block_idx, l_sel,
                                                query_chunk=args.ref_chunk)

        @jax.jit
        def reference_vjp(q, k, v, do):
            o, pullback = jax.vjp(reference, q, k, v)
            return o, pullback(do)

        start = time.perf_counter()
        got = jax.block_until_ready((jax.jit(forward)(q, k, v),
                                     *jax.jit(forward_backward)(q, k, v, do)))
        o_ref, grads_ref = jax.block_until_ready(
            reference_vjp(*(x.astype(jnp.float32) for x in (q, k, v, do))))
        for name, value, want in zip(("o", "dq", "dk", "dv"), got, (o_ref, *grads_ref)):
            rows.append(row(T, name, rel_err(value, want, nonfinite="nan")))
        print(f"  T={T}: checked in {time.perf_counter() - start:.1f} s", flush=True)
        if peer is not None:
            try:
                rows.append(row(T, "peer o", rel_err(peer_output(peer, q, k, v, block_idx),
                                                     o_ref, nonfinite="nan")))
            except Exception:  # the peer's failure is reported, not ours
                print("  peer forward failed:\n" + traceback.format_exc())
    return rows


def timing(args, peer) -> list[dict]:
    rows = []
    cfg = args.cfg
    for T in args.S:
        q, k, v, do, block_idx = make_inputs(T, args, seed=T + 1)
        # Forward: q k^T and p v over every (query head, attended key); the backward recomputes
        # q k^T and d(p v) in both kernels and forms dq, dk, dv.
        fwd_flops = 2 * (cfg.d_k + cfg.d_v) * cfg.heads_per_group * attended_keys(
            block_idx, cfg.sel_block)
        flops = {"fwd": fwd_flops, "fwd+bwd": fwd_flops * (1 + 7 / 2)}
        forward, forward_backward = kernel_functions(block_idx, args)
        timings = {}
        for name, fn, fn_args in zip(PASSES, (forward, forward_backward),
                                     ((q, k, v), (q, k, v, do))):
            try:
                timings[("pallas", name)] = _ms(fn, fn_args, args)
            except Exception:  # report and go on with the other rows
                print(f"  pallas {name} T={T} failed:\n" + traceback.format_exc())
        if peer is not None:
            try:
                for name, t in time_peer(peer, q, k, v, do, block_idx, args).items():
                    timings[("fla parallel_nsa", name)] = t
            except Exception:
                print(f"  peer T={T} failed:\n" + traceback.format_exc())
        for (impl, name), t in timings.items():
            rows.append({"impl": impl, "T": T, "pass": name, "median_ms": t.ms,
                         "min_ms": t.ms_min, "tflops": flops[name] / t.ms / 1e9})
            print(f"  {impl:>18} T={T:>6} {name:>8}: {t.ms:8.3f} ms (min {t.ms_min:.3f}, "
                  f"{rows[-1]['tflops']:.0f} TFLOP/s)", flush=True)
    return rows


def sweep(args) -> list[dict]:
    """Launch-parameter variants at one T, each checked against the default's outputs."""
    import jax

    from pallas_kernels.selected_attention import BlockSizes

    T = args.sweep_S
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
    for name, block_sizes in variants.items():
        forward, forward_backward = kernel_functions(block_idx, args, block_sizes)
        try:
            outs = jax.block_until_ready((jax.jit(forward)(q, k, v),
                                          *jax.jit(forward_backward)(q, k, v, do)))
            base = outs if base is None else base
            err = max(rel_err(a, b, nonfinite="nan") for a, b in zip(outs, base))
            fwd_ms = _ms(forward, (q, k, v), args).ms
            fwd_bwd_ms = _ms(forward_backward, (q, k, v, do), args).ms
            rows.append({"variant": name, "T": T, "fwd_ms": fwd_ms, "fwd_bwd_ms": fwd_bwd_ms,
                         "max_rel_diff_vs_default": err})
            print(f"  {name:>24}: fwd {fwd_ms:8.3f} ms, fwd+bwd {fwd_bwd_ms:8.3f} ms, "
                  f"diff vs default {err:.1e}", flush=True)
            # A timeout keeps what ran.
            common.write_csv(os.path.join(args.out, "sweep.csv"), rows, SWEEP_COLUMNS)
        except Exception:
            print(f"  {name} failed:\n" + traceback.format_exc())
    return rows


def breakdown(args) -> list[dict]:
    """The stages of forward+backward timed apart at the largest S, through the kernel's
    `selected_attention_stages` (the functions `selected_attention` runs)."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.selected_attention import selected_attention_stages

    T = max(args.S)
    q, k, v, do, block_idx = make_inputs(T, args, seed=T + 1)
    stages = selected_attention_stages(q, k, v, block_idx, args.cfg.sel_block, args.cfg.scale,
                                       interpret=args.interpret)
    o, lse = jax.block_until_ready(jax.jit(stages.forward)(q, k, v))
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
    pieces = (
        ("forward kernel", stages.forward, (q, k, v)),
        ("dq kernel", lambda q, k, v: stages.backward_dq(q, k, v, do, lse, delta), (q, k, v)),
        ("inverse index (XLA)", stages.inverse_index, (block_idx,)),
        ("dk/dv kernels + reduce (incl. index)",
         lambda q, k, v: stages.backward_dkv(q, k, v, do, lse, delta), (q, k, v)),
    )
    rows = []
    for name, fn, fn_args in pieces:
        ms = _ms(fn, fn_args, args).ms
        rows.append({"T": T, "piece": name, "median_ms": ms})
        print(f"  {name:>38}: {ms:8.3f} ms", flush=True)
    print(f"  dk/dv work items per (b, g): {stages.dkv_work_items}")
    return rows


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = common.script_parser(__doc__)
    p.add_argument("--S_list", default="8k,16k,32k,64k", help="lengths timed; 'k' = 1024")
    p.add_argument("--check_S", default="4k,16k", help="lengths of the correctness check")
    p.add_argument("--B", type=int, default=1, help="batch size")
    common.add_run_args(p, iters=3, warmup=3, repeats=15)
    common.add_nsa_args(p)
    p.add_argument("--ref_chunk", type=int, default=256, help="reference query chunk")
    p.add_argument("--no_peer", action="store_true", help="skip fla-org parallel_nsa")
    p.add_argument("--no_check", action="store_true", help="skip the correctness section")
    p.add_argument("--breakdown", action="store_true", help="time fwd, dq, index, dk/dv apart")
    p.add_argument("--sweep", action="store_true", help="also time BlockSizes variants")
    p.add_argument("--sweep_S", type=int, default=65536, help="length of the sweep")
    p.add_argument("--out", default="bench/results", help="directory for the CSV/JSON/PNG files")
    return p


def parse_args(argv=None):
    args = common.finish_args(build_parser().parse_args(argv))
    args.S = common.parse_int_list(args.S_list, "--S_list")
    args.check_S = [] if args.no_check else common.parse_int_list(args.check_S, "--check_S")
    args.interpret = args.device == "cpu"
    return args


def main(argv=None) -> int:
    argv, args = common.start(parse_args, argv)
    os.makedirs(args.out, exist_ok=True)
    env = common.write_environment(os.path.join(args.out, "env.json"),
                                   {"argv": argv, "device_label": args.device_label})
    peer = None
    if not args.no_peer:
        try:
            peer = fla_selection(args.cfg)
        except Skip as why:
            print(f"  peer skipped: {why}")
    cfg = args.cfg
    shape = (f"{args.dtype}, B {args.B}, H {cfg.n_heads}, G {cfg.n_kv_heads}, d_k {cfg.d_k}, "
             f"d_v {cfg.d_v}, l_sel {cfg.sel_block}, n_sel {cfg.n_sel}")

    print(f"\n== correctness vs XLA reference ({shape})")
    check = correctness(args, peer)
    common.write_csv(os.path.join(args.out, "correctness.csv"), check, CORRECTNESS_COLUMNS)
    print(common.format_table([[r[c] for c in CORRECTNESS_COLUMNS] for r in check],
                              CORRECTNESS_COLUMNS))

    print("\n== timing (median ms)")
    rows = timing(args, peer)
    common.write_csv(os.path.join(args.out, "timing.csv"), rows, TIMING_COLUMNS)
    if args.breakdown:
        print("\n== breakdown (median ms)")
        common.write_csv(os.path.join(args.out, "breakdown.csv"), breakdown(args),
                         BREAKDOWN_COLUMNS)
    if args.sweep:
        print(f"\n== BlockSizes sweep at T={args.sweep_S}")
        sweep(args)

    title = (f"selected attention ({shape}) on {args.device_label} "
             f"(commit {env['commit'][:10]})")
    series: dict[str, list] = {}
    for r in rows:
        series.setdefault(f"{r['impl']} {r['pass']}", []).append((r["T"], r["median_ms"]))
    common.plot_lines(os.path.join(args.out, "timing.png"),
                      [{"title": "latency", "xlabel": "sequence length T",
                        "ylabel": "ms (median)", "series": series, "logy": True}], title)
    impls = sorted({r["impl"] for r in rows}, reverse=True)
    by = {(r["impl"], r["T"], r["pass"]): r["median_ms"] for r in rows}
    print(f"\n== summary: {title}")
    print(common.format_table([[T] + [by.get((impl, T, p)) for impl in impls for p in PASSES]
                               for T in args.S],
                              ["T"] + [f"{impl} {p}" for impl in impls for p in PASSES]))
    ok = all(r["pass"] for r in check if r["quantity"] != "peer o")
    print(f"correctness: {'PASS' if ok else 'FAIL'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
