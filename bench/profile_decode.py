"""Where a decode step's time goes on the device: kernels per step, their summed time, the idle
time between them, and the costliest kernels, from a JAX profiler trace of the jitted decode
loop that `bench_decode.py` times.

Per row (B, S, what): `bench_decode.decode_loop` runs --loop_steps steps in one jitted call; after
warm-up one call is timed (wall clock, as bench_decode does) and one call is traced with
`jax.profiler`. From the trace's GPU streams:
  kernels/step   kernels launched per step (every kernel and copy on the device's streams)
  busy ms/step   the union of their intervals / steps: the time the GPU had work
  wall ms/step   the timed call / steps
  idle share     1 - busy / wall: the step waits on launches, not on the GPU, when this is large
and the --top kernels by summed time (name, launches per step, us per step) go to the kernel CSV.

what: nsa (decode_step, --backend), nsa_base (the step with no attention), fa3 / cudnn (the
full-attention layer step of bench_decode). XLA flags are read once per process: compare flag
sets by running the script once per set (XLA_FLAGS=... python bench/profile_decode.py --label X).

Example (GPU): python bench/profile_decode.py --B 1,32 --S_list 64k --rows nsa,nsa_base,fa3 \\
                   --csv artifacts/bench/profile_decode.csv
CPU smoke:     python bench/profile_decode.py --device cpu --B 2 --S_list 128 --d_model 32 --H 4 \\
                   --G 2 --dk 16 --dv 16 --l 8 --d 4 --l_sel 16 --n_sel 4 --w 16 --dtype float32 \\
                   --rows nsa,nsa_base
"""
from __future__ import annotations

import collections
import glob
import os
import sys
import tempfile
import time

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import bench_decode, common  # noqa: E402
from bench.common import OK, Skip  # noqa: E402

ROWS = ("nsa", "nsa_base", "fa3", "cudnn", "xla")
COLUMNS = ["B", "S", "what", "label", "status", "wall_ms", "busy_ms", "idle_share",
           "kernels_per_step", "trace_plane", "note", "device", "commit"]
KERNEL_COLUMNS = ["B", "S", "what", "label", "rank", "kernel", "per_step", "us_per_step",
                  "share_of_busy", "device", "commit", "us_median", "us_max"]


def device_events(trace_dir: str) -> tuple[str, list[tuple[str, int, int]]]:
    """(plane name, [(name, start_ns, end_ns)]) of the first GPU plane's stream events in the
    trace under trace_dir; where there is no GPU (CPU runs), the events of XLA's CPU client threads
    (thunks and the functions they run, which nest: a smoke of the script, not a profile)."""
    from jax.profiler import ProfileData

    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        raise RuntimeError(f"no .xplane.pb under {trace_dir}")
    data = ProfileData.from_file(max(paths, key=os.path.getmtime))
    planes = list(data.planes)
    gpu = [p for p in planes if p.name.startswith("/device:GPU")]
    if gpu:
        plane = sorted(gpu, key=lambda p: p.name)[0]
        lines = [ln for ln in plane.lines if ln.name.startswith("Stream")]
    else:
        plane = next((p for p in planes if p.name.startswith("/host:CPU")), None)
        if plane is None:
            raise RuntimeError(f"no GPU or host plane in the trace: {[p.name for p in planes]}")
        lines = [ln for ln in plane.lines if ln.name.startswith("tf_XLA")]  # XLA's CPU threads
    events = [(ev.name, int(ev.start_ns), int(ev.end_ns)) for ln in lines for ev in ln.events]
    return plane.name, events


def busy_ns(events) -> int:
    """The length of the union of the events' intervals."""
    total, end = 0, None
    for _, a, b in sorted(events, key=lambda e: e[1]):
        if end is None or a >= end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def trace_kernels(run, steps: int, top: int) -> tuple[str, float, float, list[dict]]:
    """Trace one call of `run` (which does `steps` steps and blocks until they finish) with
    `jax.profiler`. -> (trace plane, busy ms per step, kernels per step, the `top` kernels by
    summed time: [{kernel, per_step, us_per_step, share_of_busy, us_median, us_max}]; the
    median and the longest of a kernel's calls tell a kernel that works on every step from one
    whose work lands on a few, as the compression's does)."""
    import jax

    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        try:
            run()
        finally:
            jax.profiler.stop_trace()
        plane, events = device_events(trace_dir)
    busy = busy_ns(events) / 1e6 / steps
    return plane, busy, len(events) / steps, rank_kernels(events, steps, busy, top)


def rank_kernels(events, steps: int, busy_ms: float, top: int) -> list[dict]:
    """The `top` kernels of `events` [(name, start_ns, end_ns)] by summed time, as
    `trace_kernels` returns them (busy_ms: the busy time per step)."""
    calls = collections.defaultdict(list)
    for name, a, b in events:
        calls[name].append(b - a)
    ranked = sorted(calls.items(), key=lambda kv: -sum(kv[1]))[:top]
    return [dict(kernel=name[:120], per_step=len(ns) / steps, us_per_step=sum(ns) / 1e3 / steps,
                 share_of_busy=sum(ns) / 1e6 / steps / busy_ms if busy_ms else None,
                 us_median=float(np.median(ns)) / 1e3, us_max=max(ns) / 1e3)
            for name, ns in ranked]


def _step_and_cache(args, what: str, B: int, S: int):
    if what in ("nsa", "nsa_base"):
        import functools

        import nsa_jax

        params, xs, fresh_cache = bench_decode.nsa_setup(args, B, S)
        options = None
        if args.decode_blocks:
            from nsa_jax.pallas_backend import PallasOptions

            options = {"pallas": PallasOptions(decode_blocks=args.decode_blocks)}
        step = (functools.partial(nsa_jax.decode_step, backend=args.backend, options=options)
                if what == "nsa" else
                functools.partial(bench_decode.branch_only_step("base", args.backend),
                                  options=options))
        return step, params, args.cfg, xs, fresh_cache()
    step, params, xs, make_cache = bench_decode.full_setup(args, what, B, S, args.fa3_num_splits)
    return step, params, None, xs, make_cache()


def profile_point(args, what: str, B: int, S: int) -> tuple[dict, list[dict]]:
    import jax

    record = dict(B=B, S=S, what=what, label=args.label, device=args.device_label,
                  commit=args.commit)
    step, params, cfg, xs, cache = _step_and_cache(args, what, B, S)
    n = args.loop_steps
    loop, stacked = bench_decode.decode_loop(step, cfg, xs, n)
    if args.hlo_dir:
        os.makedirs(args.hlo_dir, exist_ok=True)
        text = loop.lower(params, stacked, cache).compile().as_text()
        with open(os.path.join(args.hlo_dir, f"{what}_B{B}_S{S}.hlo.txt"), "w") as f:
            f.write(text)
    for _ in range(max(1, args.warmup)):
        ys, cache, _ = loop(params, stacked, cache)
    jax.block_until_ready(ys)
    start = time.perf_counter()
    ys, cache, _ = loop(params, stacked, cache)
    jax.block_until_ready(ys)
    wall_ms = (time.perf_counter() - start) * 1e3 / n
    def run():
        nonlocal cache
        ys, cache, _ = loop(params, stacked, cache)
        jax.block_until_ready(ys)

    plane, busy, per_step, ranked = trace_kernels(run, n, args.top)
    record.update(status=OK, wall_ms=wall_ms, busy_ms=busy, trace_plane=plane,
                  idle_share=max(0.0, 1 - busy / wall_ms), kernels_per_step=per_step)
    kernels = [dict(B=B, S=S, what=what, label=args.label, rank=i + 1, **k,
                    device=args.device_label, commit=args.commit)
               for i, k in enumerate(ranked)]
    return record, kernels


def parse_decode_blocks(text: str):
    """'field=int,...' -> pallas_kernels.DecodeBlockSizes (None for ''); ValueError naming the
    flag on a bad field or value."""
    if not text.strip():
        return None
    import dataclasses

    from pallas_kernels import DecodeBlockSizes

    types = {f.name: f.type for f in dataclasses.fields(DecodeBlockSizes)}
    values = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        name, value = name.strip(), value.strip().lower()
        if types.get(name) in (bool, "bool") and value in ("true", "false"):
            values[name] = value == "true"
        elif name in types and value.lstrip("-").isdigit():
            values[name] = int(value)
        else:
            raise ValueError(f"--decode_blocks ({text!r}): {item!r} is not field=int (or "
                             f"field=true|false) with a field of {sorted(types)}")
    try:
        return DecodeBlockSizes(**values)
    except ValueError as err:
        raise ValueError(f"--decode_blocks ({text!r}): {err}") from None


def build_parser():
    p = common.script_parser(__doc__)
    p.add_argument("--B", default="1,32", help="batch sizes, comma list")
    p.add_argument("--S_list", default="64k", help="context lengths ('k' = 1024)")
    p.add_argument("--rows", default="nsa,nsa_base,fa3",
                   help=f"comma list of {','.join(ROWS)}")
    common.add_run_args(p, warmup=2, rotate=3)
    common.add_nsa_args(p)
    p.add_argument("--backend", default=None, choices=("xla", "pallas"),
                   help="nsa_jax decode backend (default: pallas on gpu, xla on cpu)")
    p.add_argument("--loop_steps", type=int, default=32, help="steps per jitted call")
    p.add_argument("--fa3_num_splits", type=int, default=4,
                   help="FA-3 num_splits (>= 1; bench_decode reports the best of 1, 4, 16)")
    p.add_argument("--decode_blocks", default="",
                   help="Pallas decode tiles, e.g. 'block_cmp=128,num_stages=3,append_kernel=false' "
                        "(pallas_kernels.DecodeBlockSizes fields; empty: the defaults)")
    p.add_argument("--hlo_dir", default="",
                   help="write each row's optimized HLO (the compiled loop) here")
    p.add_argument("--top", type=int, default=12, help="kernels listed per row")
    p.add_argument("--label", default=None,
                   help="names this run's settings in the CSV (default: $XLA_FLAGS or 'default')")
    p.add_argument("--no_progress", action="store_true")
    p.add_argument("--csv", default="artifacts/bench/profile_decode.csv",
                   help="summary CSV; the kernel CSV goes beside it (*_kernels.csv)")
    return p


def parse_args(argv=None):
    args = common.finish_args(build_parser().parse_args(argv))
    args.B_list = common.parse_int_list(args.B, "--B")
    args.S = common.parse_int_list(args.S_list, "--S_list")
    args.what = [s.strip() for s in args.rows.split(",") if s.strip()]
    unknown = [s for s in args.what if s not in ROWS]
    if unknown or not args.what:
        raise ValueError(f"--rows ({args.rows!r}) must name some of {list(ROWS)}")
    if args.loop_steps < 1:
        raise ValueError(f"--loop_steps ({args.loop_steps}) must be >= 1")
    if args.backend is None:
        args.backend = "pallas" if args.device == "gpu" else "xla"
    args.decode_blocks = parse_decode_blocks(args.decode_blocks)
    if args.label is None:
        args.label = os.environ.get("XLA_FLAGS") or "default"
    # bench_decode's setup helpers read these.
    args.timing, args.iters, args.repeats, args.branch_force_mode = "loop", 1, 2, "none"
    return args


def main(argv=None) -> int:
    argv, args = common.start(parse_args, argv)
    args.commit = common.git_commit()
    records, kernels = [], []
    kernel_csv = os.path.splitext(args.csv)[0] + "_kernels.csv"
    points = [(B, S, w) for B in args.B_list for S in sorted(args.S) for w in args.what]
    for B, S, what in common.progress(points, desc="profile points",
                                        enabled=not args.no_progress):
        try:
            record, top = profile_point(args, what, B, S)
        except Skip as why:
            record, top = dict(B=B, S=S, what=what, label=args.label, status="skipped",
                               note=str(why), device=args.device_label, commit=args.commit), []
        except Exception as exc:
            record, top = dict(B=B, S=S, what=what, label=args.label,
                               status=common.classify_exception(exc),
                               note=common.short_error(exc), device=args.device_label,
                               commit=args.commit), []
        records.append(record)
        kernels += top
        common.write_csv(args.csv, records, COLUMNS)
        common.write_csv(kernel_csv, kernels, KERNEL_COLUMNS)
    print(f"wrote {args.csv}, {kernel_csv} (label {args.label})")
    print(common.format_table(
        [[r["B"], r["S"], r["what"], r["status"], r.get("wall_ms"), r.get("busy_ms"),
          r.get("idle_share"), r.get("kernels_per_step")] for r in records],
        ["B", "S", "what", "status", "wall ms/step", "busy ms/step", "idle share",
         "kernels/step"]))
    for r in records:
        top = [k for k in kernels if (k["B"], k["S"], k["what"]) == (r["B"], r["S"], r["what"])]
        if top:
            print(f"\nB={r['B']} S={r['S']} {r['what']}: top kernels")
            print(common.format_table([[k["kernel"][:70], k["per_step"], k["us_per_step"],
                                        k["us_median"], k["us_max"]] for k in top[:8]],
                                      ["kernel", "per step", "us/step", "median us", "max us"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
