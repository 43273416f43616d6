"""Scaling benchmark: the sharded NSA layer (`nsa_jax.sharding`) over data x model x context meshes.

Times the whole layer (projections, three branches, gates, output projection and its all-reduce)
forward and forward+backward (gradients of every parameter and of x) on meshes written
`DATAxMODELxCONTEXT` (e.g. `1x1x8`: the sequence split over 8 devices).

  strong  the same problem on every mesh: B = --batch, T = each of --tokens.
  weak    the work per device fixed along data and context: B = --batch * data and
          T = tokens * context / (the largest context of --meshes), so T reaches each of
          --tokens on the widest context axis (the model axis splits the same problem's heads).

`efficiency` is against the first mesh of --meshes at the same pass (and, for strong scaling,
the same T): strong `ms_base * devices_base / (ms * devices)`, weak `ms_base / ms` (1 is
perfect). `peak_mb_per_device` is XLA's compile-time peak of the step on one device (arguments,
outputs and temporaries; the SPMD program is the same on every device). `context_mib` is what one device receives per forward through the context axis
(`nsa_jax.sharding.context_bytes_per_layer`, MiB; as much again in the backward). Rows shared
by both modes (same mesh, B and T) run once. The CSV is rewritten after every point, so a run
cut short keeps the rows it finished. A row that does not fit (mesh vs shapes, Pallas
with a context axis) is "skipped" with the reason; an OOM is "oom".

Memory: an OOM inside a multi-device program leaves its peers waiting in NCCL (the run hangs
until its time limit), and a long run's allocator state can make a large point fail that fits
alone: 1M tokens on 4 H200s failed in a long run and fit in a process of its own with
`TF_GPU_ALLOCATOR=cuda_malloc_async` (bench/RESULTS.md, the scaling section). `--isolate` runs each pass
of each point in a fresh process and kills one that outlives `--point_timeout` (a "timeout"
row); it costs a start-up and a compile per pass.

Example (8 GPUs): python bench/bench_scaling.py --meshes 1x1x1,1x1x2,1x1x4,1x1x8,1x4x2,2x2x2
CPU smoke:        XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
                      python bench/bench_scaling.py --device cpu --preset tiny --tokens 64 \\
                      --meshes 1x1x1,2x2x2 --dtype float32
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402  (sets XLA_PYTHON_CLIENT_PREALLOCATE before JAX starts)

PASSES = ("fwd", "fwd_bwd")
SCALINGS = ("strong", "weak")
COLUMNS = ["bench", "scaling", "mesh", "data", "model", "context", "devices", "pass", "backend",
           "preset", "dtype", "B", "T", "tokens_per_device", "ms", "ms_min", "ms_max",
           "tokens_per_s", "efficiency", "context_mib", "peak_mb_per_device", "status", "note",
           "device", "commit"]


def parse_meshes(text: str) -> list[tuple[int, int, int]]:
    """'1x1x8,2x2x2' -> [(1, 1, 8), (2, 2, 2)] (data, model, context)."""
    meshes = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        try:
            sizes = tuple(int(p) for p in parts)
        except ValueError:
            sizes = ()
        if len(sizes) != 3 or min(sizes) < 1:
            raise ValueError(f"--meshes ({text!r}) must be a comma list of DATAxMODELxCONTEXT "
                             f"with positive sizes, e.g. 1x1x8")
        meshes.append(sizes)
    return meshes


def widest_context(meshes: list[tuple[int, int, int]]) -> int:
    """The largest context axis of the meshes: weak scaling reaches each --tokens value on it."""
    return max(context for _, _, context in meshes)


def points(args) -> list[dict[str, Any]]:
    """Every (scaling, mesh, T) point with its shapes; shared shapes point at one run."""
    out = []
    widest = widest_context(args.meshes)
    for scaling in args.scaling:
        for tokens in args.tokens:
            for data, model, context in args.meshes:
                weak = scaling == "weak"
                out.append(dict(scaling=scaling, data=data, model=model, context=context,
                                B=args.batch * (data if weak else 1),
                                T=tokens * context // widest if weak else tokens))
    return out


def _layer_step(cfg, mesh, axes, backend: str, pass_name: str, fa3: bool = True):
    import jax
    import jax.numpy as jnp

    from nsa_jax import PallasOptions, sharding

    # FA-3 off: the fused branches run where a GPU without it runs them (cuDNN where it takes
    # the heads, else the Pallas kernels).
    options = None if fa3 else {"pallas": PallasOptions(fa3=False)}

    def forward(params, x):
        return sharding.sharded_nsa_attention(params, x, cfg, mesh, axes=axes, backend=backend,
                                              options=options)

    if pass_name == "fwd":
        return jax.jit(forward)
    # A loss of every output (as training's), so no part of the backward is dead code.
    return jax.jit(jax.grad(lambda p, x: jnp.sum(forward(p, x).astype(jnp.float32) ** 2),
                            argnums=(0, 1)))


def run_point(args, cfg, point: dict) -> list[dict[str, Any]]:
    """Time each pass of one point; returns one record per pass (with its status: a pass that
    fails or runs out of memory is a row of its own)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding

    import nsa_jax
    from nsa_jax import sharding

    data, model, context = point["data"], point["model"], point["context"]
    devices = data * model * context
    if devices > jax.device_count():
        raise common.Skip(f"needs {devices} devices, {jax.device_count()} present")
    if args.backend != "xla" and context > 1:
        raise common.Skip("Pallas kernels take no context axis (queries start at token 0)")
    mesh = Mesh(np.array(jax.devices()[:devices]).reshape(data, model, context),
                ("data", "model", "context"))
    axes = sharding.MeshAxes("data", "model", "context")
    B, T = point["B"], point["T"]
    try:
        sharding.check_mesh(mesh, cfg, axes, batch=B, seq_len=T)
    except ValueError as err:
        raise common.Skip(str(err)) from None
    dtype = jnp.dtype(args.dtype)
    params = sharding.shard_params(nsa_jax.init_params(jax.random.PRNGKey(0), cfg, dtype), cfg,
                                   mesh, axes)
    x_sharding = NamedSharding(mesh, sharding.input_spec(axes))
    xs = [jax.device_put(jax.random.normal(jax.random.PRNGKey(1 + i), (B, T, cfg.d_model),
                                           dtype), x_sharding) for i in range(args.rotate)]
    records = []
    moved = sharding.context_bytes_per_layer(cfg, T, context, batch=B // data, model=model,
                                             itemsize=dtype.itemsize)["total"] / 2**20
    for pass_name in args.passes:
        try:
            compiled = _layer_step(cfg, mesh, axes, args.backend, pass_name, args.fa3).lower(
                params, xs[0]).compile()
            timing = common.time_jax(lambda i: compiled(params, xs[i % len(xs)]),
                                     iters=args.iters, warmup=args.warmup, repeats=args.repeats)
        except Exception as exc:  # an OOM of the backward keeps the forward's row
            records.append(dict(pass_=pass_name, status=common.classify_exception(exc),
                                note=common.short_error(exc) + common.debug_traceback()))
            continue
        records.append(dict(pass_=pass_name, status=common.OK, note="", ms=timing.ms,
                            ms_min=timing.ms_min, ms_max=timing.ms_max,
                            tokens_per_s=B * T / (timing.ms * 1e-3), context_mib=moved,
                            peak_mb_per_device=common.mb(common.jax_compiled_peak_bytes(compiled))))
    return records


def add_efficiency(rows: list[dict[str, Any]], first_mesh: tuple[int, int, int],
                   widest: int) -> None:
    """Efficiency against the first mesh's row of the same scaling, pass and --tokens value
    (strong: T itself; weak: T * widest / context, the T that the widest context axis reaches)."""
    def key(row):
        tokens = row["T"] if row["scaling"] == "strong" else row["T"] * widest // row["context"]
        return (row["scaling"], row["pass"], tokens)

    base = {key(r): r for r in rows if r["status"] == common.OK
            and (r["data"], r["model"], r["context"]) == first_mesh}
    for row in rows:
        ref = base.get(key(row))
        if ref is None or row["status"] != common.OK:
            continue
        ratio = ref["ms"] / row["ms"]
        row["efficiency"] = (ratio * ref["devices"] / row["devices"]
                             if row["scaling"] == "strong" else ratio)


def build_parser() -> argparse.ArgumentParser:
    p = common.script_parser(__doc__)
    common.add_run_args(p, iters=5, warmup=2, repeats=3, rotate=2,
                        dtypes=("bfloat16", "float32"))
    common.add_nsa_args(p, preset="paper")
    p.add_argument("--tokens", default="64k,128k,256k,512k,1024k",
                   help="T (strong; weak: on the widest context axis); 'k' = 1024")
    p.add_argument("--batch", type=int, default=1, help="B (strong) or rows per data shard (weak)")
    p.add_argument("--meshes", default="1x1x1,1x1x2,1x1x4,1x1x8,2x1x4,1x4x2,2x2x2",
                   help="DATAxMODELxCONTEXT list; the first is the efficiency baseline")
    p.add_argument("--scaling", default="strong,weak", help=f"comma list of {SCALINGS}")
    p.add_argument("--passes", default="fwd,fwd_bwd", help=f"comma list of {PASSES}")
    p.add_argument("--backend", default="xla", choices=("xla", "pallas"),
                   help="pallas: Pallas kernels with XLA fallback (meshes without context)")
    p.add_argument("--no_fa3", dest="fa3", action="store_false",
                   help="with --backend pallas: FlashAttention-3 off (PallasOptions.fa3), so the "
                        "fused branches run as on a GPU without it")
    p.add_argument("--csv", default=os.path.join(common.REPO_ROOT, "bench", "results",
                                                 "scaling_latest.csv"))
    p.add_argument("--isolate", action="store_true",
                   help="run each point's each pass in a fresh process (its own allocator); one "
                        "that outlives --point_timeout (an OOM on one device leaves the others "
                        "waiting in NCCL) is killed and written as a 'timeout' row")
    p.add_argument("--point_timeout", type=float, default=1200.0,
                   help="seconds per isolated pass, compile included (with --isolate)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker_out", default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv=None):
    args = common.finish_args(build_parser().parse_args(argv))
    args.tokens = common.parse_int_list(args.tokens, "--tokens")
    args.meshes = parse_meshes(args.meshes)
    for name, allowed in (("scaling", SCALINGS), ("passes", PASSES)):
        values = [v.strip() for v in getattr(args, name).split(",") if v.strip()]
        if not values or any(v not in allowed for v in values):
            raise ValueError(f"--{name} ({getattr(args, name)!r}) must be a comma list of "
                             f"{allowed}")
        setattr(args, name, values)
    return args


def measure(args, cfg, point: dict, passes: list[str]) -> list[dict[str, Any]]:
    """`run_point` for `passes` in this process; a skip or a failure before the passes gives
    one record per pass with its status."""
    try:
        return run_point(argparse.Namespace(**{**vars(args), "passes": passes}), cfg, point)
    except common.Skip as why:
        return [dict(pass_=p, status=common.SKIPPED, note=f"skipped: {why}") for p in passes]
    except Exception as exc:  # a failure before the passes is a row, not the end
        status = common.classify_exception(exc)
        note = common.short_error(exc) + common.debug_traceback()
        return [dict(pass_=p, status=status, note=note) for p in passes]


def worker_key(point: dict, pass_name: str) -> str:
    """One isolated pass of a point, as `--worker` takes it: `DxMxC-B<B>-T<T>-<pass>`."""
    return (f"{point['data']}x{point['model']}x{point['context']}-B{point['B']}-T{point['T']}"
            f"-{pass_name}")


def parse_worker_key(key: str) -> tuple[dict, str]:
    mesh, batch, tokens, pass_name = key.split("-")
    (data, model, context), = parse_meshes(mesh)
    return dict(data=data, model=model, context=context, B=int(batch[1:]),
                T=int(tokens[1:])), pass_name


def measure_isolated(args, argv, point: dict, tmp_dir: str) -> list[dict[str, Any]]:
    """Each pass of `point` in its own process (`common.run_row_subprocess`)."""
    records = []
    for pass_name in args.passes:
        got, failure = common.run_row_subprocess(os.path.abspath(__file__), argv,
                                                 worker_key(point, pass_name),
                                                 args.point_timeout, tmp_dir)
        records += got or [dict(pass_=pass_name, note=failure or "no result",
                                status=common.failure_status(failure))]
    return records


def main(argv=None) -> int:
    argv, args = common.start(parse_args, argv)
    cfg = args.cfg
    if args.worker:  # one isolated pass of one point: write its record and leave
        point, pass_name = parse_worker_key(args.worker)
        common.save_records(args.worker_out, measure(args, cfg, point, [pass_name]))
        return 0
    device, commit = args.device_label, common.git_commit()
    widest = widest_context(args.meshes)
    done: dict[tuple, list[dict[str, Any]]] = {}
    rows = []
    tmp = tempfile.TemporaryDirectory(prefix="bench_scaling_") if args.isolate else None
    for point in points(args):
        shape = (point["data"], point["model"], point["context"], point["B"], point["T"])
        if shape not in done:
            done[shape] = (measure_isolated(args, argv, point, tmp.name) if args.isolate
                           else measure(args, cfg, point, args.passes))
        by_pass = {r["pass_"]: r for r in done[shape]}
        devices = point["data"] * point["model"] * point["context"]
        for pass_name in args.passes:
            record = {k: v for k, v in by_pass[pass_name].items() if k != "pass_"}
            rows.append(dict(
                bench="scaling", scaling=point["scaling"],
                mesh=f"{point['data']}x{point['model']}x{point['context']}", data=point["data"],
                model=point["model"], context=point["context"], devices=devices,
                **{"pass": pass_name}, preset=args.preset,
                backend=args.backend + ("" if args.fa3 else " (fa3 off)"),
                dtype=args.dtype, B=point["B"], T=point["T"],
                tokens_per_device=point["B"] * point["T"] // devices, device=device,
                commit=commit, **record))
        print(f"{point['scaling']:6s} {rows[-1]['mesh']:7s} B={point['B']} T={point['T']}: "
              + "; ".join(f"{r['pass']} " + (f"{r['ms']:.2f} ms" if r.get("ms") else
                                            f"{r['status']} {r['note']}")
                          for r in rows[-len(args.passes):]),
              file=sys.stderr, flush=True)
        add_efficiency(rows, args.meshes[0], widest)
        common.write_csv(args.csv, rows, COLUMNS)
    print(common.format_table(
        [[r["scaling"], r["mesh"], r["pass"], r["B"], r["T"], r.get("ms"), r.get("efficiency"),
          r["status"]] for r in rows],
        ["scaling", "mesh", "pass", "B", "T", "ms", "efficiency", "status"]))
    if tmp is not None:
        tmp.cleanup()
    print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
