"""Training-step benchmark: the example LM's step with NSA, NSA plus the alignment loss, and full
attention (cuDNN, FlashAttention-3), at long T.

The step is the training examples' own, imported: `examples/train_recall.py`'s `train_step`
(jitted `value_and_grad` of the task loss, then the optax update) and, with the alignment loss,
`examples/train_aligned.py`'s (task loss + --kl_weight x the layers' mean
`nsa_jax.selection_alignment_loss`). The model is the examples' decoder LM (embeddings,
[RMSNorm, attention, RMSNorm, GELU MLP x4] x --layers, RMSNorm, head) on the needle task's
data (a 192-token vocabulary; the loss reads the last tokens only), one batch of --B sequences
of T tokens. Its attention comes from the NSA flags (bench/common.py; default the `bench`
preset of the prefill figures: d_model 2560, H 64, G 4, d_k = d_v 128, l 32, d 16, l_sel 64,
n_sel 16, w 512): with 2 layers, 195M parameters (215M with NSA's branch projections and
compression MLPs), and causal attention is 41% of a full-attention step's FLOPs at 8k, 58% at
16k and 73% at 32k. Parameters, optimizer state and activations are in --dtype (bfloat16:
cuDNN and FA-3 take bf16 / fp16 only).

Rows (`--rows`, default: every row that can run on the device):
  cudnn_full     full causal attention, jax.nn.dot_product_attention(implementation="cudnn")
  fa3_full       full causal attention, flash_attn3_jax.flash_mha
  xla_full       full causal attention, implementation="xla" (CPU and small T: [T, T] scores)
  nsa            NSA (`nsa_jax.nsa_attention`, --backend: pallas then xla on a GPU), no
                 alignment loss
  nsa_kl_sparse  the same layers and the alignment loss, mode="sparse" (target: the selected
                 branch's own attention, over the forward's block_idx)
  nsa_kl_dense   the same, mode="dense" (target: the full causal attention; the recipe's
                 sparse stage where it is affordable)
  nsa_warmup     the recipe's dense warm-up step (`examples/train_aligned.py`'s first stage):
                 the layers with `nsa_jax.dense_warmup_config` (every block selected, so the
                 selected branch is causal attention) and the loss in mode="dense"

Columns: ms (the median step over --repeats of --iters steps, compilation excluded),
compile_s, peak_mb (XLA's compile-time peak of the step: arguments + outputs + temporaries),
device_peak_mb (the allocator's high-water mark in the row's own process, where T ascends, so
it is the point's own; empty with --isolate none), kl_share ((ms - nsa's ms) / ms at the
same T: the alignment loss's share of its step; empty for nsa_warmup, whose step also selects
every block), speedup (the full-attention baseline's ms / ms; baseline fa3_full, else
cudnn_full, else xla_full). After an OOM a row's
larger T are recorded "oom" without running; with --budget_s each row's process gets the
budget left less ROW_RESERVE_S per row still to run, and what it did not finish is "timeout".
With --profile_top N, each point's step is also traced once (`jax.profiler`, as
bench/profile_decode.py does): busy_ms (the union of the kernels' intervals) and kernels (launches
per step) join its record, and its N costliest kernels (name, launches, us, share of busy) go to
train_step_kernels.csv.
Writes train_step.csv, train_step_latest.csv (one line per row and T, with the commit),
train_step_summary.txt and train_step_env.json to --out after every row.

Example (GPU): python bench/bench_train_step.py --T_list 8k,16k,32k --out artifacts/train_step
CPU smoke:     python bench/bench_train_step.py --device cpu --preset tiny --dv 16 \\
                   --T_list 128 --dtype float32 --iters 1 --repeats 1 --out /tmp/train_step
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402  (sets the allocator environment before jax loads)
from bench.common import OK, OOM, SKIPPED, Skip  # noqa: E402

COLUMNS = ["bench", "row", "impl", "T", "B", "layers", "d_model", "H", "G", "dk", "dv", "l",
           "d", "l_sel", "n_sel", "w", "dtype", "backend", "kl_mode", "kl_weight", "query_stride",
           "status",
           "ms", "ms_min", "ms_max", "compile_s", "peak_mb", "device_peak_mb", "kl_share",
           "speedup", "baseline", "note", "device", "busy_ms", "kernels"]
KERNEL_COLUMNS = ["row", "T", "rank", "kernel", "per_step", "us_per_step", "share_of_busy",
                  "device", "commit", "us_median", "us_max"]
LATEST_COLUMNS = ["row", "T", "ms", "kl_share", "speedup", "peak_mb", "device_peak_mb",
                  "device", "commit", "status"]
# Run order: the full-attention rows first, the most expensive step last (under --budget_s, a
# shortfall costs the last rows' largest T).
ROWS = ("cudnn_full", "fa3_full", "xla_full", "nsa", "nsa_kl_sparse", "nsa_kl_dense",
        "nsa_warmup")
DEFAULT_ROWS = {"gpu": tuple(r for r in ROWS if r != "xla_full"), "cpu": ROWS}
BASELINES = ("fa3_full", "cudnn_full", "xla_full")
DENSE_KERNELS = {"cudnn_full": "cudnn", "fa3_full": "fa3", "xla_full": "xla"}
KL_MODES = {"nsa_kl_sparse": "sparse", "nsa_kl_dense": "dense"}
# The rows whose step is train_aligned's, and the loss's mode in each.
ALIGNED_MODES = dict(KL_MODES, nsa_warmup="dense")
# Under --budget_s, the seconds kept back for each row still to run: a row that overruns takes
# the time from the last rows' largest T, not from every row's.
ROW_RESERVE_S = 20.0


def _base_record(args, row: str, T: int) -> dict[str, Any]:
    cfg = args.cfg
    nsa = row.startswith("nsa")
    return {"bench": "train_step", "row": row, "T": T, "B": args.B, "layers": args.layers,
            "d_model": cfg.d_model, "H": cfg.n_heads, "G": cfg.n_kv_heads, "dk": cfg.d_k,
            "dv": cfg.d_v, "l": cfg.cmp_block if nsa else "", "d": cfg.cmp_stride if nsa else "",
            "l_sel": cfg.sel_block if nsa else "", "n_sel": cfg.n_sel if nsa else "",
            "w": cfg.window if nsa else "", "dtype": args.dtype,
            "backend": ",".join(args.backend) if nsa else DENSE_KERNELS[row],
            "kl_mode": ALIGNED_MODES.get(row, ""),
            "kl_weight": args.kl_weight if row in ALIGNED_MODES else "",
            "query_stride": args.query_stride if row in ALIGNED_MODES else "",
            "device": args.device_label}


def _check_row(args, row: str) -> None:
    """Skip a row this device or dtype cannot run."""
    low_precision = args.dtype in ("bfloat16", "float16")
    if row in ("cudnn_full", "fa3_full"):
        if args.device != "gpu":
            raise Skip(f"{row} needs a GPU")
        if not low_precision:
            raise Skip(f"{row} takes bf16 / fp16 only")
        if args.cfg.d_v != args.cfg.d_k:
            raise Skip(f"{row} takes d_v = d_k only (d_k {args.cfg.d_k}, d_v {args.cfg.d_v})")
    if row == "fa3_full":
        try:
            import flash_attn3_jax  # noqa: F401
        except ImportError as exc:
            raise Skip(f"flash_attn3_jax not importable ({exc})") from None
    if row.startswith("nsa") and "pallas" in args.backend and args.device != "gpu":
        raise Skip("the Pallas backend needs a GPU (--backend xla on a CPU)")


def build_row(args, row: str):
    """The row's step: (the example's jitted train_step, its static kwargs, the initial state
    (params, opt_state) in --dtype, its arguments after (tokens, answers), vocab, task)."""
    import jax

    import nsa_jax
    from examples import train_aligned, train_recall

    dtype = common.jnp_dtype(args.dtype)
    vocab = train_recall.Vocab()
    task = train_recall.make_tasks(1)["needle"]
    attention = "nsa" if row.startswith("nsa") else "full"
    mc = train_recall.ModelConfig(attention, args.cfg, vocab.size, n_layers=args.layers,
                                  backend=args.backend, dense_kernel=DENSE_KERNELS.get(row))

    def cast(tree):
        return jax.tree_util.tree_map(lambda a: a.astype(dtype), tree)

    params = cast(train_recall.init_model(jax.random.PRNGKey(0), mc))
    state = (params, train_recall.OPTIMIZER.init(params))
    # Python floats: weakly typed, so the update keeps the parameters' dtype.
    lr, kl_weight = 1e-4, args.kl_weight
    if row in ALIGNED_MODES:
        alignment = nsa_jax.AlignmentOptions(mode=ALIGNED_MODES[row],
                                             query_stride=args.query_stride)
        static = dict(mc=mc, task=task, alignment=alignment)
        return train_aligned.train_step, static, state, (lr, kl_weight), vocab, task
    mults = cast(train_recall.lr_multipliers(params, train_recall.Variant()))
    return train_recall.train_step, dict(mc=mc, task=task), state, (lr, mults), vocab, task


def impl_label(args, row: str) -> str:
    if row in DENSE_KERNELS:
        kernel = {"fa3": "flash_attn3_jax.flash_mha"}.get(
            DENSE_KERNELS[row], f"jax.nn.dot_product_attention[{DENSE_KERNELS[row]}]")
        return f"train_recall.train_step, full attention {kernel}"
    backend = ",".join(args.backend)
    if row in ALIGNED_MODES:
        warmup = ", dense_warmup_config" if row == "nsa_warmup" else ""
        return (f"train_aligned.train_step, nsa_attention backend={backend}{warmup} + "
                f"selection_alignment_loss mode={ALIGNED_MODES[row]}")
    return f"train_recall.train_step, nsa_attention backend={backend}"


def run_point(args, row: str, T: int, built) -> dict[str, Any]:
    """One (row, T): compile the step, time it from the row's initial state, read the memory."""
    import jax
    import numpy as np

    import nsa_jax
    from examples import train_recall

    step_fn, static, initial, extra, vocab, task = built
    if row == "nsa_warmup":  # every block of this T selected
        mc = static["mc"]
        static = dict(static, mc=dataclasses.replace(
            mc, nsa=nsa_jax.dense_warmup_config(mc.nsa, T)))
    rng = np.random.default_rng(T)
    batches = []
    for _ in range(args.rotate):
        batch = train_recall.make_batch(rng, task, vocab, args.B, T, args.cfg)
        batches.append((jax.device_put(batch["tokens"]), jax.device_put(batch["answers"])))
    start = time.perf_counter()
    compiled = step_fn.lower(*initial, *batches[0], *extra, **static).compile()
    compile_s = time.perf_counter() - start
    state = {"out": initial}

    def step(i):
        state["out"] = compiled(*state["out"][:2], *batches[i % len(batches)], *extra)
        return state["out"]

    timing = common.time_jax(step, iters=args.iters, warmup=args.warmup, repeats=args.repeats)
    # The task loss: train_recall's step returns it third, train_aligned's first of a tuple.
    loss = jax.tree_util.tree_leaves(state["out"][2])[0]
    loss = float(np.asarray(loss, np.float32))
    record = dict(status=OK, **timing.fields(), compile_s=compile_s,
                  peak_mb=common.mb(common.jax_compiled_peak_bytes(compiled)))
    if args.worker:  # the process's high-water mark is this point's only in a row's own process
        record["device_peak_mb"] = common.mb(common.jax_device_peak_bytes())
    if not np.isfinite(loss):
        record["note"] = f"loss not finite ({loss})"
    if args.profile_top:
        from bench import profile_decode

        _, busy, per_step, ranked = profile_decode.trace_kernels(
            lambda: jax.block_until_ready(step(0)), 1, args.profile_top)
        record.update(busy_ms=busy, kernels=per_step, top_kernels=ranked)
    return record


def run_row(args, row: str, on_record=None) -> list[dict[str, Any]]:
    """Every T of one row, smallest first; an OOM marks the larger T "oom" without running."""
    records: list[dict[str, Any]] = []
    built, oom_from = None, None
    for T in sorted(args.T):
        base = dict(_base_record(args, row, T), impl=impl_label(args, row))
        if oom_from is not None:
            records.append(dict(base, status=OOM, note=f"not run: oom at T={oom_from}"))
            continue
        try:
            _check_row(args, row)
            built = built or build_row(args, row)
            records.append(dict(base, **run_point(args, row, T, built)))
        except Skip as why:
            print(f"{row}: skipped: {why}", flush=True)
            records += [dict(base, T=t, status=SKIPPED, note=f"skipped: {why}")
                        for t in sorted(args.T) if t >= T]
            break
        except Exception as exc:  # OOM and kernel failures become records, not crashes
            records.append(dict(base, status=common.classify_exception(exc),
                                note=common.short_error(exc) + common.debug_traceback()))
            if records[-1]["status"] == OOM:
                oom_from = T
        if on_record:
            on_record(records)
    return records


# ---------------------------------------------------------------------------------------------
# Derived columns, table, CSV
# ---------------------------------------------------------------------------------------------
def add_derived(records: list[dict]) -> None:
    """kl_share of the alignment rows against `nsa`, speedup against the first baseline that
    ran at the same T."""
    ok = {(r["row"], int(r["T"])): common.to_float(r.get("ms")) for r in records
          if r.get("status") == OK}
    for record in records:
        ms, T = ok.get((record["row"], int(record["T"]))), int(record["T"])
        if ms is None:
            continue
        nsa_ms = ok.get(("nsa", T))
        if record["row"] in KL_MODES and nsa_ms is not None:
            record["kl_share"] = (ms - nsa_ms) / ms
        baseline = next((b for b in BASELINES if ok.get((b, T)) is not None), None)
        if baseline is not None:
            record["speedup"], record["baseline"] = ok[(baseline, T)] / ms, baseline


def _order(record: dict) -> tuple:
    return (ROWS.index(record["row"]), int(record["T"]))


def summary_table(records: list[dict]) -> str:
    header = ["row", "T", "ms", "kl_share", "speedup", "baseline", "peak_mb", "device_peak_mb",
              "compile_s", "status"]
    rows = [[r["row"], int(r["T"])] + [common.to_float(r.get(k)) for k in header[2:5]]
            + [r.get("baseline") or "-"]
            + [common.to_float(r.get(k)) for k in header[6:9]] + [r.get("status")]
            for r in sorted(records, key=_order)]
    return common.format_table(rows, header)


def _problem(record: dict) -> str:
    """Why a point has no figure ("" when it has one): the status, then the note."""
    status, note = record.get("status"), record.get("note") or ""
    if status == OK:
        return ""
    return note if note.startswith(status) else f"{status}: {note}".rstrip(": ")


def write_outputs(args, records: list[dict], env: dict) -> tuple[str, str, str]:
    """The CSV, the latest CSV and the summary (after every row: a run cut short keeps what it
    measured). Returns (CSV path, table, title)."""
    records = sorted((dict(r) for r in records), key=_order)
    add_derived(records)
    kernels = [dict(row=r["row"], T=r["T"], rank=i + 1, **k, device=r.get("device"),
                    commit=env["commit"][:12])
               for r in records for i, k in enumerate(r.pop("top_kernels", None) or [])]
    if kernels:
        common.write_csv(os.path.join(args.out, "train_step_kernels.csv"), kernels,
                         KERNEL_COLUMNS)
    cfg = args.cfg
    title = (f"NSA training step: {args.layers} layers, d_model {cfg.d_model}, H {cfg.n_heads}, "
             f"G {cfg.n_kv_heads}, d_k {cfg.d_k}, d_v {cfg.d_v}, B {args.B}, {args.dtype} on "
             f"{args.device_label} (commit {env['commit'][:10]})")
    csv_path = os.path.join(args.out, "train_step.csv")
    common.write_csv(csv_path, records, COLUMNS)
    latest = [dict({k: r.get(k) for k in LATEST_COLUMNS}, commit=env["commit"][:12],
                   status=_problem(r)) for r in records]
    common.write_csv(os.path.join(args.out, "train_step_latest.csv"), latest, LATEST_COLUMNS)
    table = summary_table(records)
    with open(os.path.join(args.out, "train_step_summary.txt"), "w") as f:
        f.write(title + "\n\n" + table + "\n")
    return csv_path, table, title


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = common.script_parser(__doc__)
    p.add_argument("--T_list", default="8k,16k,32k", help="sequence lengths; 'k' = 1024")
    p.add_argument("--B", type=int, default=1, help="sequences per step")
    p.add_argument("--layers", type=int, default=2, help="decoder layers")
    p.add_argument("--kl_weight", type=float, default=1.0, help="the alignment loss's weight")
    p.add_argument("--query_stride", type=int, default=1,
                   help="AlignmentOptions.query_stride of the alignment rows (every s-th query)")
    p.add_argument("--backend", default=None,
                   help="NSA dispatch backends in order (default: pallas,xla on a GPU, xla on "
                        "a CPU)")
    common.add_run_args(p, iters=3, warmup=1, repeats=3, rotate=2)
    common.add_nsa_args(p)
    p.add_argument("--rows", default=None,
                   help=f"comma subset of: {','.join(ROWS)} (default: all for the device)")
    p.add_argument("--profile_top", type=int, default=0,
                   help="trace each point's step once and list its N costliest kernels in "
                        "train_step_kernels.csv (0: no trace)")
    p.add_argument("--out", default="artifacts/train_step", help="directory for the outputs")
    p.add_argument("--isolate", default="row", choices=("row", "none"),
                   help="run each row in its own process (default: per-row device peak) or all "
                        "in this one")
    p.add_argument("--row_timeout", type=float, default=600.0, help="seconds per isolated row")
    p.add_argument("--budget_s", type=float, default=None,
                   help="wall-clock limit of the isolated rows together: each row's process "
                        f"gets the time left less {ROW_RESERVE_S:.0f} s per row after it (at "
                        "most --row_timeout)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker_out", default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv=None):
    args = common.finish_args(build_parser().parse_args(argv))
    args.T = common.parse_int_list(args.T_list, "--T_list")
    for name in ("B", "layers"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name} ({getattr(args, name)}) must be positive")
    if args.profile_top < 0:
        raise ValueError(f"--profile_top ({args.profile_top}) must be >= 0")
    args.backend = tuple((args.backend or ("pallas,xla" if args.device == "gpu" else "xla"))
                         .split(","))
    chosen = common.parse_rows(args.rows, ROWS, DEFAULT_ROWS[args.device])
    args.rows = [r for r in ROWS if r in chosen]  # the table's order
    return args


def main(argv=None) -> int:
    argv, args = common.start(parse_args, argv)
    if args.worker:  # one isolated row: write its records and leave
        # The rows' processes share XLA's autotuning results (the MLP's matmuls are the same in
        # every row) through JAX's compilation cache in the run's temporary folder, set before
        # jax loads; no executable is written there.
        os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                              os.path.join(os.path.dirname(args.worker_out), "jax_cache"))
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1e9")
        records = run_row(args, args.worker,
                          on_record=lambda recs: common.save_records(args.worker_out, recs))
        common.save_records(args.worker_out, records)
        return 0

    os.makedirs(args.out, exist_ok=True)
    env = common.write_environment(os.path.join(args.out, "train_step_env.json"),
                                   {"argv": argv, "device_label": args.device_label})
    records: list[dict] = []
    script, begin = os.path.abspath(__file__), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_train_step_") as tmp_dir:
        for i, row in enumerate(args.rows):
            if args.isolate == "none":
                records += run_row(args, row)
            else:
                timeout = args.row_timeout
                if args.budget_s is not None:
                    left = args.budget_s - (time.perf_counter() - begin)
                    rows_after = len(args.rows) - i - 1
                    timeout = min(timeout, max(1.0, left - ROW_RESERVE_S * rows_after))
                new, failure = common.run_row_subprocess(script, argv, row, timeout, tmp_dir)
                done = {int(r["T"]) for r in new}
                new += [dict(_base_record(args, row, T), impl=impl_label(args, row),
                             status=common.failure_status(failure), note=failure or "no result")
                        for T in sorted(args.T) if T not in done]
                records += new
            write_outputs(args, records, env)
    csv_path, table, title = write_outputs(args, records, env)
    print(f"wrote {csv_path}, train_step_latest.csv and the summary beside it")
    print(title)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
