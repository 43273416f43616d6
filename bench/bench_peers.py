"""Peers side by side: our NSA core and other NSA implementations, each in the peer's own
configuration, checked against each other and then timed on one GPU in one call.

Peers (adapters in bench/peers/, each importing its peer from a checkout, never from here):
  mdy666  mdy666/Scalable-Flash-Native-Sparse-Attention: H 64, G 4, d 128, mean compression
          32 / 16, blocks of 64, top 16, window 512 (513 keys); prefill and decode
  fsa     Relaxed-System-Lab/Flash-Sparse-Attention: H 4, G 4 (its GQA group 1), the same
          block sizes; prefill, and decode of one sequence (its beta)
  fla     fla-org's parallel_nsa: H 64, G 4, mean compression with l = d = l_sel = 64; prefill
Each adapter's docstring gives the configuration, what runs and what stands in; our side runs
the same configuration (`config()`: mean compression, one k / v for the three branches, the
peer's window in our convention). `--heads NAME=H/G` changes a peer's head counts.

Per peer and S, in this order:
1. The check, before any timing. One set of random inputs (fla_agreement.make_inputs), our core
   (`nsa_jax.native_sparse_attention`; backend pallas on a GPU) forward and backward, the peer
   forward and backward on the same values, twice:
     own     each side selects its blocks: the share of our (b, t, kv head) rows whose block
             sets the peer matches, and of our selected blocks it selects too;
     shared  the peer is forced onto our blocks: relative L2 and max |error| of o, dq, dk, dv
             and the gate logits' gradient, against fla_agreement's tolerances (bf16: 1e-2).
   fwd is timed only if the shared o is within tolerance and the blocks agree on at least
   --min_block_agreement (near-ties in bf16 flip a few tenths of a percent; another selection
   rule differs on most rows); fwd_bwd also needs the gradients. Otherwise the row is written
   with status "mismatch" and its errors, untimed. Every comparison goes to peers_check.csv.
2. Prefill times, through the harness of bench/common.py as bench_prefill.py uses it: the
   peer's fwd and fwd_bwd (CUDA events around each call); the stand-in of its window branch
   alone where that branch needs the flash-attn package (row window_standin: subtract it to
   see the peer with a free window); ours (bench_prefill's core rows, shared k / v) and our
   window branch alone (row ours_window, for the comparison with both windows taken out).
3. Decode at each --decode_B and --decode_S_list (default: --S_list) where the peer has one:
   the check on min(B, 2) sequences (the peer's step for the query at S - 1 against our
   core's output there: own and shared as above, output only), then the peer's step eager
   and, where it can be captured, replayed from a CUDA graph (decode_graph); ours:
   bench_decode's jitted loop of `decode_step` and of the same step without attention; our
   row `ours` is the difference (attention alone, as the peer's call is), `ours_step` the
   whole step (projections, appends, gates, output).

Each peer runs in two processes (the peer with its check, then ours), so the JAX and torch
allocators never share one heap and a crash loses half a peer; a peer that cannot load (no
checkout, an import error) is skipped with its reason, and so is our side of it.

Outputs in --out: peers.csv (one row per peer, side, pass, S, B), peers_check.csv, the
environment, and peers_summary.txt with the table printed last: per peer, pass, S and B, our
time, the peer's, speedup = peer / ours (ours is that many times faster), the stand-in's time
and the speedup with it taken out of the peer's, our window's time and the speedup with both
window branches taken out.

GPU:  python bench/bench_peers.py --peer-path mdy666=.peers/mdy666 --peer-path fsa=.peers/fsa \\
          --S_list 8k,16k,32k,64k,128k --out artifacts/peers
CPU:  python bench/bench_peers.py --device cpu ...  (the adapters' peers need CUDA: skipped)
"""
from __future__ import annotations

import argparse
import copy
import functools
import os
import sys
import tempfile
from typing import Any, Optional

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402  (sets the allocator environment before jax loads)
from bench.common import OK, SKIPPED, Skip  # noqa: E402
from bench.peers import PEERS, adapter  # noqa: E402

MISMATCH = "mismatch"
PREFILL_PASSES = ("fwd", "fwd_bwd")
DECODE_PASSES = ("decode", "decode_graph")
PASS_CHOICES = ("fwd", "fwd_bwd", "decode")
SIDES = ("peer", "ours")
QUANTITIES = ("o", "dq", "dk", "dv", "dgate_logits")
DEFAULT_PATHS = {"mdy666": ".peers/mdy666", "fsa": ".peers/fsa", "fla": None}
COLUMNS = ["bench", "peer", "row", "impl", "pass", "S", "B", "H", "G", "dk", "dv", "compress",
           "l", "d", "l_sel", "n_sel", "w", "dtype", "status", "ms", "ms_min", "ms_max",
           "peak_mb", "check", "rel_l2", "max_err", "blocks_agree", "rows_agree", "note",
           "device"]
CHECK_COLUMNS = ["peer", "kind", "S", "B", "selection", "what", "rel_l2", "max_abs", "tol",
                 "verdict", "blocks_agree", "rows_agree", "device", "commit"]


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = common.script_parser(__doc__)
    p.add_argument("--peers", default=",".join(PEERS), help=f"comma subset of {','.join(PEERS)}")
    p.add_argument("--peer-path", dest="peer_path", action="append", default=[],
                   metavar="NAME=PATH", help="a peer's checkout (default: "
                   + ", ".join(f"{n}={p}" for n, p in DEFAULT_PATHS.items() if p) + ")")
    p.add_argument("--heads", action="append", default=[], metavar="NAME=H/G",
                   help="a peer's head counts instead of its own")
    p.add_argument("--S_list", default="8k,16k,32k,64k,128k",
                   help="prefill context lengths ('k' = 1024)")
    p.add_argument("--decode_S_list", default=None,
                   help="decode context lengths (default: --S_list)")
    p.add_argument("--passes", default=",".join(PASS_CHOICES),
                   help=f"comma subset of {','.join(PASS_CHOICES)}")
    p.add_argument("--decode_B", default="1,32", help="decode batch sizes")
    common.add_run_args(p, iters=20, warmup=3, repeats=5, rotate=3,
                        dtypes=("bfloat16", "bf16", "float16", "fp16"))
    p.add_argument("--backend", default=None, choices=("pallas", "xla"),
                   help="our backend (default: pallas on a GPU, xla on a CPU)")
    p.add_argument("--loop_steps", type=int, default=50, help="our decode: steps per jitted call")
    p.add_argument("--min_block_agreement", type=float, default=0.95,
                   help="share of our selected blocks the peer must select too (own check)")
    p.add_argument("--seed", type=int, default=0, help="the check's inputs")
    p.add_argument("--out", default="artifacts/peers", help="directory of the CSVs and summary")
    p.add_argument("--isolate", default="job", choices=("job", "none"),
                   help="each peer's two sides in their own processes (default) or all here")
    p.add_argument("--job_timeout", type=float, default=3600.0, help="seconds per process")
    p.add_argument("--no_progress", action="store_true")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker_out", default=None, help=argparse.SUPPRESS)
    return p


def _pairs(items: list[str], flag: str) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not value.strip():
            raise ValueError(f"{flag} ({item!r}) must look like NAME=VALUE")
        if name not in PEERS:
            raise ValueError(f"{flag} ({item!r}) names no peer; peers: {list(PEERS)}")
        out[name] = value.strip()
    return out


def parse_heads(text: str) -> tuple[int, int]:
    """'16/4' -> (16, 4)."""
    try:
        H, G = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--heads value ({text!r}) must look like H/G, e.g. 16/4") from None
    if H <= 0 or G <= 0 or H % G:
        raise ValueError(f"--heads ({text}): H and G must be positive, H a multiple of G")
    return H, G


def parse_args(argv=None):
    args = common.finish_args(build_parser().parse_args(argv))
    args.peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = [p for p in args.peers if p not in PEERS]
    if unknown or not args.peers:
        raise ValueError(f"--peers ({args.peers}) must be a comma subset of {list(PEERS)}")
    # Given paths are the caller's (relative to the working directory), the defaults the
    # repository's; absolute either way, so the job processes find them too.
    defaults = {name: os.path.join(common.REPO_ROOT, path) if path else None
                for name, path in DEFAULT_PATHS.items()}
    given = {name: os.path.abspath(path)
             for name, path in _pairs(args.peer_path, "--peer-path").items()}
    args.paths = {**defaults, **given}
    args.heads = {name: parse_heads(value) for name, value in _pairs(args.heads,
                                                                       "--heads").items()}
    args.S = common.parse_int_list(args.S_list, "--S_list")
    args.decode_S = (common.parse_int_list(args.decode_S_list, "--decode_S_list")
                     if args.decode_S_list else list(args.S))
    args.decode_B = common.parse_int_list(args.decode_B, "--decode_B")
    args.passes = [p.strip() for p in args.passes.split(",") if p.strip()]
    if not args.passes or any(p not in PASS_CHOICES for p in args.passes):
        raise ValueError(f"--passes ({args.passes}) must be a comma subset of {PASS_CHOICES}")
    if not 0 <= args.min_block_agreement <= 1:
        raise ValueError(f"--min_block_agreement ({args.min_block_agreement}) must lie in [0, 1]")
    if args.loop_steps < 1:
        raise ValueError(f"--loop_steps ({args.loop_steps}) must be >= 1")
    args.backend = args.backend or ("pallas" if args.device == "gpu" else "xla")
    return args


def peer_config(args, name: str):
    """Our NSAConfig in peer `name`'s configuration (with --heads applied)."""
    return adapter(name).config(args.heads.get(name))


# ---------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------
def base_record(args, name: str, row: str, cfg, S: int, B: int = 1, **extra) -> dict[str, Any]:
    record = {"bench": "peers", "peer": name, "row": row, "S": S, "B": B, "H": cfg.n_heads,
              "G": cfg.n_kv_heads, "dk": cfg.d_k, "dv": cfg.d_v, "compress": cfg.compress,
              "l": cfg.cmp_block, "d": cfg.cmp_stride, "l_sel": cfg.sel_block,
              "n_sel": cfg.n_sel, "w": cfg.window, "dtype": args.dtype,
              "device": args.device_label}
    record.update(extra)
    return record


def _points(args) -> list[tuple[str, int, int]]:
    """(pass, S, B) of every row a side writes."""
    points = []
    for S in all_lengths(args):
        if S in args.S:
            points += [(p, S, 1) for p in PREFILL_PASSES if p in args.passes]
        if "decode" in args.passes and S in args.decode_S:
            points += [(p, S, B) for B in args.decode_B for p in DECODE_PASSES]
    return points


def all_lengths(args) -> list[int]:
    """Every S of the run, prefill's and decode's, smallest first."""
    return sorted(set(args.S) | set(args.decode_S if "decode" in args.passes else []))


def skipped(args, name: str, row: str, cfg, why, points) -> list[dict]:
    """Records of `row` at `points` ((pass, S, B) each) skipped for `why`."""
    return [base_record(args, name, row, cfg, S, B, **{"pass": p}, status=SKIPPED,
                        note=f"skipped: {why}") for p, S, B in points]


def skipped_records(args, name: str, side: str, why: str) -> list[dict]:
    """Every record of a side that does not run."""
    return skipped(args, name, side, peer_config(args, name), why,
                   [pt for pt in _points(args) if side == "peer" or pt[0] != "decode_graph"])


def _keep(record: dict) -> dict:
    return {key: value for key, value in record.items() if key in COLUMNS}


# ---------------------------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------------------------
def _torch_setup(args):
    import torch

    if args.device == "gpu" and not torch.cuda.is_available():
        raise Skip("torch sees no CUDA device")
    return torch, ("cuda" if args.device == "gpu" else "cpu")


def ours_forward(inputs: dict, cfg, backend: str):
    """Our core's output [B, S, H, d_v] and block_idx [B, S, G, n_sel] (JAX arrays)."""
    import jax
    import nsa_jax

    @jax.jit
    def run(q, k, v, gate_logits):
        o, aux = nsa_jax.native_sparse_attention(q, k, v, gate_logits, cfg,
                                                 gates_are_logits=True, scale=cfg.scale,
                                                 backend=backend, return_aux=True)
        return o, aux["block_idx"]

    return run(inputs["q"], inputs["k"], inputs["v"], inputs["gate_logits"])


def _compare(ours: dict, theirs: dict, names, tol: tuple[float, float]) -> list[dict]:
    """One comparison record per quantity: rel_l2, max_abs, tol, within."""
    from bench.fla_agreement import rel_l2

    out = []
    for what in names:
        rel, max_abs = rel_l2(theirs[what], ours[what])
        limit = tol[0] if what == "o" else tol[1]
        out.append({"what": what, "rel_l2": rel, "max_abs": max_abs, "tol": limit,
                    "within": rel <= limit})  # NaN compares False
    return out


def _verdicts(comparisons: list[dict], blocks: float, minimum: float, names) -> tuple[bool, str]:
    """(judged within, the check column's text) of the shared comparisons of `names`."""
    bad = [c for c in comparisons if c["what"] in names and not c["within"]]
    problems = [f"{c['what']} {c['rel_l2']:.2e} > {c['tol']:.0e}" for c in bad]
    if blocks < minimum:
        problems.append(f"blocks agree {blocks:.3f} < {minimum}")
    return not problems, ("pass" if not problems else "fail: " + "; ".join(problems))


def prefill_check(args, peer, cfg, name: str, S: int) -> dict[str, Any]:
    """The own and shared comparisons at S: {"fwd" / "fwd_bwd": (timed?, the check's text),
    "fwd_rel" / "fwd_max" and "fwd_bwd_rel" / "fwd_bwd_max" (the worst shared quantity of the
    pass: relative L2, max |error|), "blocks", "rows" (own agreement), "records"
    (peers_check.csv lines)}."""
    torch, device = _torch_setup(args)
    from bench.fla_agreement import TOLERANCES, make_inputs, run_ours, selection_agreement
    from parity.convert import jax_to_torch

    inputs = make_inputs(cfg, 1, S, args.dtype, args.seed)
    o, grads, block_idx = run_ours(inputs, cfg, args.backend, None)
    ours = {"o": jax_to_torch(o, device),
            **{n: jax_to_torch(g, device) for n, g in grads.items()}}
    ours_idx = jax_to_torch(block_idx, device)
    t_in = {n: jax_to_torch(x, device) for n, x in inputs.items()}
    del inputs, o, grads, block_idx
    tol = TOLERANCES.get(args.dtype, TOLERANCES["bfloat16"])
    result: dict[str, Any] = {"records": []}
    shared: list[dict] = []
    for selection in ("own", "shared"):
        leaves = [t_in[n].detach().clone().requires_grad_(True)
                  for n in ("q", "k", "v", "gate_logits")]
        forced = ours_idx if selection == "shared" else None
        out = peer.prefill(*leaves, block_idx=forced)
        used = peer.last_selection()
        grads = torch.autograd.grad(out, leaves, t_in["cotangent"])
        theirs = {"o": out.detach(), **dict(zip(QUANTITIES[1:], grads))}
        comparisons = _compare(ours, theirs, QUANTITIES, tol)
        rows = blocks = None
        if selection == "own":
            rows, blocks = selection_agreement(ours_idx, used)
            result.update(rows=rows, blocks=blocks)
        else:
            shared = comparisons
        for c in comparisons:
            judged = selection == "shared" or rows == 1.0
            verdict = ("pass" if c["within"] else "fail") if judged else "n/a (selection differs)"
            result["records"].append(dict(
                peer=name, kind="prefill", S=S, B=1, selection=selection, what=c["what"],
                rel_l2=c["rel_l2"], max_abs=c["max_abs"], tol=c["tol"], verdict=verdict,
                blocks_agree=blocks, rows_agree=rows, device=args.device_label,
                commit=args.commit[:12]))
        del out, grads, theirs
    for pass_name, names in (("fwd", ("o",)), ("fwd_bwd", QUANTITIES)):
        result[pass_name] = _verdicts(shared, result["blocks"], args.min_block_agreement, names)
        judged = [c for c in shared if c["what"] in names]
        result[f"{pass_name}_rel"] = max(c["rel_l2"] for c in judged)
        result[f"{pass_name}_max"] = max(c["max_abs"] for c in judged)
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def decode_check(args, peer, cfg, name: str, S: int, B: int) -> dict[str, Any]:
    """The own and shared comparisons of the peer's decode step for the query at S - 1 of
    min(B, 2) sequences against our core's output there: {"ok", "check", "rel_l2", "max_err",
    "blocks", "rows", "records"}."""
    torch, device = _torch_setup(args)
    from bench.fla_agreement import TOLERANCES, make_inputs, selection_agreement
    from parity.convert import jax_to_torch

    Bc = min(B, 2)
    inputs = make_inputs(cfg, Bc, S, args.dtype, args.seed + 1)
    o, block_idx = ours_forward(inputs, cfg, args.backend)
    ours = {"o": jax_to_torch(o[:, S - 1], device)}
    ours_idx = jax_to_torch(block_idx[:, S - 1], device)                 # [Bc, G, n_sel]
    t_in = {n: jax_to_torch(x, device) for n, x in inputs.items()}
    del inputs, o, block_idx
    tol = TOLERANCES.get(args.dtype, TOLERANCES["bfloat16"])
    q_last, gate_last = t_in["q"][:, S - 1], t_in["gate_logits"][:, S - 1]
    result: dict[str, Any] = {"records": []}
    with torch.no_grad():
        own = peer.decode_case(t_in["k"], t_in["v"], q_last, gate_last)
        own_o = own.step()
        rows, blocks = selection_agreement(ours_idx[:, None], own.block_idx()[:, None])
        forced = peer.decode_case(t_in["k"], t_in["v"], q_last, gate_last, block_idx=ours_idx)
        shared_o = forced.step()
    for selection, out in (("own", own_o), ("shared", shared_o)):
        (c,) = _compare(ours, {"o": out}, ("o",), tol)
        judged = selection == "shared" or rows == 1.0
        result["records"].append(dict(
            peer=name, kind="decode", S=S, B=Bc, selection=selection, what="o",
            rel_l2=c["rel_l2"], max_abs=c["max_abs"], tol=c["tol"],
            verdict=("pass" if c["within"] else "fail") if judged else "n/a (selection differs)",
            blocks_agree=blocks if selection == "own" else None,
            rows_agree=rows if selection == "own" else None, device=args.device_label,
            commit=args.commit[:12]))
        if selection == "shared":
            ok, text = _verdicts([c], blocks, args.min_block_agreement, ("o",))
            result.update(ok=ok, check=text, rel_l2=c["rel_l2"], max_err=c["max_abs"],
                          blocks=blocks, rows=rows)
    del own, forced
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


# ---------------------------------------------------------------------------------------------
# The peer's side: check, then time
# ---------------------------------------------------------------------------------------------
def _timed_args(args, cfg):
    """A copy of args with the peer's configuration and B 1, for bench_prefill's helpers."""
    timed = copy.copy(args)
    timed.cfg, timed.B, timed.workload = cfg, 1, "random"
    return timed


def _failed(record: dict, exc: BaseException) -> dict:
    record.update(status=common.classify_exception(exc), note=common.short_error(exc))
    return record


def peer_prefill(args, peer, cfg, name: str, S: int, check_out: list) -> list[dict]:
    """The check at S, then the peer's timed passes and its window stand-in's."""
    from bench import bench_prefill

    torch, device = _torch_setup(args)
    passes = [p for p in PREFILL_PASSES if p in args.passes]
    base = base_record(args, name, "peer", cfg, S, impl=peer.impl)
    try:
        check = prefill_check(args, peer, cfg, name, S)
    except Skip:
        raise
    except Exception as exc:
        if device == "cuda":
            torch.cuda.empty_cache()
        return [_failed(dict(base, **{"pass": p}), exc) for p in passes]
    check_out += check["records"]
    timed = _timed_args(args, cfg)

    def make(seed):
        return bench_prefill._torch_qkv(timed, S, device, args.dtype_torch, seed, gates=True)

    records = []
    runnable = tuple(p for p in passes if check[p][0])
    timed_records = {}
    if runnable:
        timed_records = {r["pass"]: r for r in bench_prefill._torch_time_passes(
            peer.prefill, make, timed, dict(base), device, runnable)}
    for p in passes:
        ok, text = check[p]
        record = timed_records.get(p, dict(base, **{"pass": p}))
        if not ok:
            record.update(status=MISMATCH, note="not timed: the check failed")
        record.update(check=text, rel_l2=check[f"{p}_rel"], max_err=check[f"{p}_max"],
                      blocks_agree=check["blocks"], rows_agree=check["rows"])
        records.append(record)
    # The stand-in of the window branch alone.
    from bench.peers import window

    def make_qkv(seed):
        return bench_prefill._torch_qkv(timed, S, device, args.dtype_torch, seed)

    wbase = base_record(args, name, "window_standin", cfg, S,
                        note="the stand-in of its flash-attn window branch, timed alone")
    try:
        probe = make_qkv(0)[0]
        label = window.label(probe[0]) if peer.window(*probe) is not None else None
        del probe
    except Exception as exc:
        return records + [_failed(dict(wbase, **{"pass": p}), exc) for p in passes]
    if label is not None:
        wbase["impl"] = label
        records += bench_prefill._torch_time_passes(peer.window, make_qkv, timed, wbase, device,
                                                    tuple(passes))
    return records


def _graph_step(step):
    """step captured in a CUDA graph (after warm-up calls on a side stream): the replay."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def peer_decode(args, peer, cfg, name: str, S: int, B: int, check_out: list) -> list[dict]:
    """The decode check at (S, B), then the peer's step eager and from a CUDA graph."""
    torch, device = _torch_setup(args)
    base = base_record(args, name, "peer", cfg, S, B, impl=peer.impl)
    records = {p: dict(base, **{"pass": p}) for p in DECODE_PASSES}
    try:
        check = decode_check(args, peer, cfg, name, S, B)
    except Skip:
        raise
    except Exception as exc:
        return [_failed(r, exc) for r in records.values()]
    check_out += check["records"]
    for record in records.values():
        record.update(check=check["check"], rel_l2=check["rel_l2"], max_err=check["max_err"],
                      blocks_agree=check["blocks"], rows_agree=check["rows"])
    if not check["ok"]:
        for record in records.values():
            record.update(status=MISMATCH, note="not timed: the check failed")
        return list(records.values())
    gen = torch.Generator(device=device).manual_seed(args.seed + 2)
    G, H, dk, dv = cfg.n_kv_heads, cfg.n_heads, cfg.d_k, cfg.d_v

    def normal(*shape):
        return torch.randn(shape, generator=gen, device=device).to(args.dtype_torch)

    try:
        with torch.no_grad():
            case = peer.decode_case(normal(B, S, G, dk), normal(B, S, G, dv), normal(B, H, dk),
                                    normal(B, H, 3))
            timing = common.time_torch(lambda i: case.step(), iters=args.iters,
                                       warmup=args.warmup, repeats=args.repeats, device=device)
            records["decode"].update(status=OK, **timing.fields(), note=case.note)
            if case.graphable and device == "cuda":
                replay = _graph_step(case.step)
                timing = common.time_torch(lambda i: replay(), iters=args.iters,
                                           warmup=args.warmup, repeats=args.repeats,
                                           device=device)
                records["decode_graph"].update(status=OK, **timing.fields(),
                                               note=f"CUDA graph replay; {case.note}")
            else:
                records["decode_graph"].update(status=SKIPPED,
                                               note="skipped: the step is not captured in a "
                                                    "CUDA graph here")
    except Skip as why:
        for record in records.values():
            if record.get("status") is None:
                record.update(status=SKIPPED, note=f"skipped: {why}")
    except Exception as exc:
        for record in records.values():
            if record.get("status") is None:
                _failed(record, exc)
    if device == "cuda":
        torch.cuda.empty_cache()
    return list(records.values())


def run_peer_side(args, name: str, on_record=None) -> tuple[list[dict], list[dict]]:
    """(records, check records) of peer `name`'s side."""
    cfg = peer_config(args, name)
    module = adapter(name)
    try:
        _torch_setup(args)
        peer = module.load(args.paths[name], cfg)
    except Skip as why:
        print(f"{name}: skipped: {why}", flush=True)
        return skipped_records(args, name, "peer", str(why)), []
    print(f"{name}: {peer.impl}; {module.notes(cfg)}", flush=True)
    records, checks = [], []
    for S in all_lengths(args):
        if S in args.S and any(p in args.passes for p in PREFILL_PASSES):
            try:
                records += peer_prefill(args, peer, cfg, name, S, checks)
            except Skip as why:
                records += skipped(args, name, "peer", cfg, why, [
                    (p, S, 1) for p in PREFILL_PASSES if p in args.passes])
        if "decode" in args.passes and S in args.decode_S:
            for B in args.decode_B:
                try:
                    records += peer_decode(args, peer, cfg, name, S, B, checks)
                except Skip as why:
                    records += skipped(args, name, "peer", cfg, why,
                                       [(p, S, B) for p in DECODE_PASSES])
        if on_record:
            on_record(records, checks)
    return records, checks


# ---------------------------------------------------------------------------------------------
# Our side, in the peer's configuration
# ---------------------------------------------------------------------------------------------
def ours_prefill(args, cfg, name: str, S: int) -> list[dict]:
    from bench import bench_prefill

    timed = _timed_args(args, cfg)
    core, label = bench_prefill.nsa_jax_core(cfg, args.backend)
    base = base_record(args, name, "ours", cfg, S, impl=label)
    make = bench_prefill.nsa_jax_inputs(cfg, timed, S, shared_kv=True)
    passes = tuple(p for p in PREFILL_PASSES if p in args.passes)
    records = bench_prefill._jax_time_passes(core, make, timed, base, passes=passes)
    # Our window branch alone, on the path the core sends it (FA-3 / cuDNN / Pallas), so that
    # both sides can be compared with their window branches taken out.
    import nsa_jax

    def window(q, k, v):
        return nsa_jax.sliding_window_attention(q, k, v, cfg.window, backend=args.backend)

    def make_window(seed):
        (q, *kv, _gates, _cmp), cotangent = make(seed)
        return (q, kv[4], kv[5]), cotangent

    wbase = base_record(args, name, "ours_window", cfg, S,
                        impl=f"nsa_jax.sliding_window_attention backend={args.backend}",
                        note="our window branch, timed alone")
    return records + bench_prefill._jax_time_passes(window, make_window, timed, wbase,
                                                    passes=passes)


def decode_args(args, cfg, B: int, S: int):
    """bench_decode's arguments for our decode step in `cfg` at (B, S)."""
    from bench import bench_decode

    flags = ["--device", args.device, "--dtype", args.dtype, "--B", str(B), "--S_list", str(S),
             "--d_model", str(cfg.d_model), "--H", str(cfg.n_heads), "--G", str(cfg.n_kv_heads),
             "--dk", str(cfg.d_k), "--dv", str(cfg.d_v), "--l", str(cfg.cmp_block),
             "--d", str(cfg.cmp_stride), "--l_sel", str(cfg.sel_block), "--n_sel",
             str(cfg.n_sel), "--n_init", str(cfg.n_init), "--n_local", str(cfg.n_local),
             "--w", str(cfg.window), "--compress", cfg.compress, "--iters", str(args.iters),
             "--warmup", str(args.warmup), "--repeats", str(args.repeats), "--rotate",
             str(args.rotate), "--loop_steps", str(args.loop_steps), "--backend", args.backend,
             "--latest_csv", "", "--no_breakdown"]
    dargs = bench_decode.parse_args(flags)
    dargs.cfg = cfg  # shared_kv has no flag
    dargs.device_label = args.device_label
    return dargs


def ours_decode(args, cfg, name: str, S: int, B: int) -> list[dict]:
    """Our decode step at (B, S) and the step without attention: `ours` = the difference."""
    import nsa_jax

    from bench import bench_decode

    dargs = decode_args(args, cfg, B, S)
    step = functools.partial(nsa_jax.decode_step, backend=dargs.backend)
    label = f"nsa_jax.decode_step ({dargs.backend}), jitted loop of {dargs.loop_steps}"
    whole = base_record(args, name, "ours_step", cfg, S, B, impl=label, **{"pass": "decode"})
    attention = base_record(args, name, "ours", cfg, S, B, impl=label, **{"pass": "decode"})
    try:
        params, xs, fresh_cache = bench_decode.nsa_setup(dargs, B, S)
        step_t, _ = bench_decode._timed_decode(step, params, cfg, fresh_cache(), xs, dargs)
        base_t, _ = bench_decode._timed_decode(bench_decode.branch_only_step("base",
                                                                             dargs.backend),
                                               params, cfg, fresh_cache(), xs, dargs)
    except Exception as exc:
        return [_failed(whole, exc), _failed(attention, exc)]
    whole.update(status=OK, **step_t.fields(),
                 note="the whole step: projections, appends, attention, gates, output")
    attention.update(status=OK, ms=max(0.0, step_t.ms - base_t.ms),
                     note=f"attention alone: step {step_t.ms:.4g} ms - the step without "
                          f"attention {base_t.ms:.4g} ms")
    return [attention, whole]


def run_ours_side(args, name: str, on_record=None) -> tuple[list[dict], list[dict]]:
    cfg = peer_config(args, name)
    records = []
    for S in all_lengths(args):
        if S in args.S and any(p in args.passes for p in PREFILL_PASSES):
            try:
                records += ours_prefill(args, cfg, name, S)
            except Skip as why:
                records += skipped(args, name, "ours", cfg, why, [
                    (p, S, 1) for p in PREFILL_PASSES if p in args.passes])
        if "decode" in args.passes and S in args.decode_S:
            for B in args.decode_B:
                records += ours_decode(args, cfg, name, S, B)
        if on_record:
            on_record(records, [])
    return records, []


# ---------------------------------------------------------------------------------------------
# Jobs, outputs
# ---------------------------------------------------------------------------------------------
def setup_job(args, side: str) -> None:
    """Before jax / triton load in a job's process: the platforms, Triton's interpreter on a
    CPU, and on the peer's side JAX memory returned when freed (its check's arrays must not
    hold the GPU the peer then runs on)."""
    common.setup_device(args.device)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if side == "peer":
        os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")


def run_job(args, job: str, on_record=None) -> tuple[list[dict], list[dict]]:
    name, side = job.rsplit("-", 1)
    setup_job(args, side)
    import torch

    args.dtype_torch = {"bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    runner = run_peer_side if side == "peer" else run_ours_side
    return runner(args, name, on_record)


def ms_of(record: Optional[dict]) -> Optional[float]:
    return (common.to_float(record.get("ms")) if record and record.get("status") == OK
            else None)


def ours_passes(args, records: list[dict], name: str) -> list[str]:
    """The passes our side runs for peer `name`: those the peer ran or tried (not skipped)."""
    kept = []
    for p in args.passes:
        kinds = DECODE_PASSES if p == "decode" else (p,)
        rows = [r for r in records
                if r["peer"] == name and r["row"] == "peer" and r["pass"] in kinds]
        if any(r.get("status") != SKIPPED for r in rows):
            kept.append(p)
    return kept


def summary_table(records: list[dict]) -> str:
    """Per peer, pass, S and B: ours, the peer, peer / ours, the stand-in, the same ratio with
    the stand-in taken out of the peer's time, our window branch alone, and the ratio with both
    sides' window branches taken out."""
    by_key: dict[tuple, dict] = {}
    for r in records:
        key = (r["peer"], r["pass"], int(r["S"]), int(r["B"]))
        by_key.setdefault(key, {})[r["row"]] = r
    order = {p: i for i, p in enumerate(PEERS)}
    passes = PREFILL_PASSES + DECODE_PASSES
    rows = []
    for (peer, pass_name, S, B), entries in sorted(
            by_key.items(), key=lambda kv: (order.get(kv[0][0], 99), passes.index(kv[0][1]),
                                            kv[0][2], kv[0][3])):
        def ms(row):
            r = entries.get(row)
            return common.to_float(r.get("ms")) if r and r.get("status") == OK else None

        # Our decode figure (attention alone) serves both the eager and the graph rows.
        ours = ms("ours") if pass_name != "decode_graph" else ms_of(
            by_key.get((peer, "decode", S, B), {}).get("ours"))
        theirs, standin, own_window = ms("peer"), ms("window_standin"), ms("ours_window")
        speedup = theirs / ours if theirs and ours else None
        without = (theirs - standin) / ours if theirs and ours and standin is not None else None
        neither = ((theirs - standin) / (ours - own_window)
                   if theirs and ours and standin is not None and own_window is not None
                   and ours > own_window else None)
        peer_r = entries.get("peer", {})
        status, note = peer_r.get("status") or "-", peer_r.get("note") or ""
        if status not in (OK, "-") and note:
            status = (note if note.startswith(status) else f"{status}: {note}")[:60]
        check = peer_r.get("check") or "-"
        rows.append([peer, pass_name, S, B, ours, theirs, speedup, standin, without,
                     own_window, neither, common.to_float(peer_r.get("blocks_agree")),
                     check[:40], status])
    header = ["peer", "pass", "S", "B", "ours_ms", "peer_ms", "speedup", "standin_ms",
              "speedup_wo_standin", "ours_window_ms", "speedup_wo_windows", "blocks_agree",
              "check", "peer_status"]
    return common.format_table(rows, header)


def write_outputs(args, records: list[dict], checks: list[dict], env: dict) -> tuple[str, str]:
    os.makedirs(args.out, exist_ok=True)
    csv_path = os.path.join(args.out, "peers.csv")
    common.write_csv(csv_path, [_keep(r) for r in records], COLUMNS)
    common.write_csv(os.path.join(args.out, "peers_check.csv"), checks, CHECK_COLUMNS)
    title = (f"NSA peers side by side, {args.dtype}, ours backend {args.backend}, on "
             f"{args.device_label} (commit {env['commit'][:10]}); speedup = peer ms / our ms")
    table = summary_table(records)
    with open(os.path.join(args.out, "peers_summary.txt"), "w") as f:
        f.write(title + "\n\n" + table + "\n")
    return csv_path, title + "\n" + table


def report(job: str, records: list[dict]) -> None:
    """One line per job: its statuses, then each distinct reason a row did not run."""
    counts: dict[str, int] = {}
    for r in records:
        counts[r.get("status") or "?"] = counts.get(r.get("status") or "?", 0) + 1
    print(f"{job}: " + ", ".join(f"{n} {status}" for status, n in counts.items()), flush=True)
    for note in dict.fromkeys(r.get("note") or "" for r in records if r.get("status") != OK):
        if note:
            print(f"  {note}", flush=True)


def main(argv=None) -> int:
    argv, args = common.start(parse_args, argv, uses_jax=False)
    args.commit = common.git_commit()
    if args.worker:
        def save(records, checks):
            common.save_records(args.worker_out, [{"record": r} for r in records]
                                + [{"check": c} for c in checks])

        records, checks = run_job(args, args.worker, save)
        save(records, checks)
        return 0

    env = common.write_environment(os.path.join(args.out, "peers_env.json"),
                                   {"argv": argv, "device_label": args.device_label})
    records: list[dict] = []
    checks: list[dict] = []
    script = os.path.abspath(__file__)
    jobs = [(name, side) for name in args.peers for side in SIDES]
    with tempfile.TemporaryDirectory(prefix="bench_peers_") as tmp_dir:
        for name, side in common.progress(jobs, desc="peers", enabled=not args.no_progress):
            job_args, job_argv = args, argv
            if side == "ours":
                passes = ours_passes(args, records, name)
                if not passes:
                    peer_rows = [r for r in records if r["peer"] == name and r["row"] == "peer"]
                    why = (peer_rows[0].get("note") or "").removeprefix("skipped: ")
                    new = skipped_records(args, name, "ours", f"the peer did not run ({why})")
                    records += new
                    report(f"{name}-ours", new)
                    write_outputs(args, records, checks, env)
                    continue
                job_args = copy.copy(args)
                job_args.passes = passes
                job_argv = argv + ["--passes", ",".join(passes)]
                if "decode" in passes:  # the batch sizes the peer's decode ran at
                    job_args.decode_B = sorted({
                        int(r["B"]) for r in records if r["peer"] == name
                        and r["row"] == "peer" and r["pass"] in DECODE_PASSES
                        and r.get("status") != SKIPPED})
                    job_argv += ["--decode_B", ",".join(map(str, job_args.decode_B))]
            job = f"{name}-{side}"
            if args.isolate == "job":
                out, failure = common.run_row_subprocess(script, job_argv, job,
                                                         args.job_timeout, tmp_dir)
                new = [item["record"] for item in out if "record" in item]
                checks += [item["check"] for item in out if "check" in item]
                if failure:
                    print(f"{job}: {failure}", file=sys.stderr, flush=True)
                    done = {(r["row"], r["pass"], r["S"], r["B"]) for r in new}
                    cfg = peer_config(args, name)
                    new += [base_record(args, name, side, cfg, S, B, **{"pass": p},
                                        status=common.failure_status(failure), note=failure)
                            for p, S, B in _points(job_args)
                            if (side, p, S, B) not in done and
                            (side == "peer" or p != "decode_graph")]
            else:
                new, new_checks = run_job(job_args, job)
                checks += new_checks
            records += new
            report(job, new)
            write_outputs(args, records, checks, env)
    csv_path, text = write_outputs(args, records, checks, env)
    print(f"wrote {csv_path}, peers_check.csv and peers_summary.txt beside it")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
