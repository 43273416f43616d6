"""Benchmark of one layer's selection-alignment loss, whole and in its pieces (forward+backward).

Per T of --T_list, one NSA layer (the preset's attention, --d_model), its own selection
(`nsa_attention(..., return_aux=True)`'s `block_idx`), bf16 by default, times:

  loss        jax.value_and_grad of `selection_alignment_loss` (--mode) in the layer's params,
              as a training step adds it
  target      `alignment.target_log_probs` alone (no gradient: the target is held fixed);
              sparse mode: the `selected_block_mass` dispatch entry (a Pallas kernel on
              backend "pallas")
  lse         sparse mode: `alignment.compressed_lse` and its gradient in q and k_cmp
  kl          `alignment.kl_rows` and its gradient in q and k_cmp: the importance (dense: every
              block; sparse: the selected ones) and the KL

on the layer's projected, RoPE'd and compressed tensors (computed once, outside the timing).
The pieces are the loss's main parts; the loss also repeats the layer's projections and
compression. Prints a table and writes alignment.csv, alignment_summary.txt and
alignment_env.json into --out.

Example (GPU): python bench/bench_alignment.py --T_list 8k,32k --out artifacts/alignment
CPU smoke:     python bench/bench_alignment.py --device cpu --preset tiny --T_list 128 \
                   --dtype float32 --iters 1 --repeats 1 --warmup 0 --out /tmp/alignment
"""
from __future__ import annotations

import os
import sys
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402  (sets the allocator environment before jax loads)

PIECES = ("loss", "target", "lse", "kl")
COLUMNS = ["T", "mode", "query_stride", "piece", "status", "ms", "ms_min", "ms_max",
           "share_of_loss", "note", "backend", "dtype", "device", "commit"]


def prepare(args, T: int) -> dict[str, Any]:
    """The layer's parameters and input, its selection, and the tensors the pieces read."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import nsa_jax
    from nsa_jax import layer

    cfg, dtype = args.cfg, common.jnp_dtype(args.dtype)
    params = jax.tree_util.tree_map(lambda a: a.astype(dtype),
                                    nsa_jax.init_params(jax.random.PRNGKey(0), cfg))
    x = jnp.asarray(np.random.default_rng(T).standard_normal((args.B, T, cfg.d_model)), dtype)
    _, aux = jax.jit(lambda p, x: nsa_jax.nsa_attention(
        p, x, cfg, backend=args.backend, return_aux=True))(params, x)
    proj = jax.jit(lambda p, x: layer.project(p, x, cfg, jnp.arange(T, dtype=jnp.int32)))(
        params, x)
    k_cmp = jax.jit(lambda p, k: nsa_jax.compress_kv(
        k, p["cmp_k"] if cfg.compress == "mlp" else None, cfg, backend=args.backend))(
        params, proj["k_cmp"])
    return dict(params=params, x=x, block_idx=aux["block_idx"], q=proj["q"],
                k_sel=proj["k_sel"], k_cmp=k_cmp)


def piece_functions(args, arrays: dict[str, Any]) -> dict[str, tuple]:
    """piece -> (jitted function, its arguments)."""
    import jax
    import jax.numpy as jnp

    import nsa_jax
    from nsa_jax import alignment as al

    cfg, backend = args.cfg, args.backend
    options = nsa_jax.AlignmentOptions(mode=args.mode, query_stride=args.query_stride)
    sparse = args.mode == "sparse"
    block_idx = arrays["block_idx"] if sparse else None
    rows = al.query_rows(arrays["x"].shape[1], args.query_stride)  # None: every query

    def loss(params, x):
        return nsa_jax.selection_alignment_loss(params, x, cfg, alignment=options,
                                                backend=backend, block_idx=block_idx)

    def target(q, k_sel):
        return al.target_log_probs(q, k_sel, cfg, segments=None, block_idx=block_idx,
                                   alignment=options, backend=backend, rows=rows)

    def lse(q, k_cmp):
        value = al.compressed_lse(q, k_cmp, cfg, segments=None, backend=backend)
        return jnp.sum(jnp.where(jnp.isfinite(value), value, 0.0))

    target = jax.jit(target)
    log_target = target(arrays["q"], arrays["k_sel"])

    def kl(q, k_cmp):
        kl_q, counted = al.kl_rows(q, k_cmp, log_target, cfg, segments=None,
                                   block_idx=block_idx, alignment=options, backend=backend,
                                   rows=rows)
        return jnp.sum(jnp.where(counted, kl_q, 0.0))

    q, k_cmp = arrays["q"], arrays["k_cmp"]
    pieces = {"loss": (jax.jit(jax.value_and_grad(loss)), (arrays["params"], arrays["x"])),
              "target": (target, (q, arrays["k_sel"])),
              "kl": (jax.jit(jax.value_and_grad(kl, argnums=(0, 1))), (q, k_cmp))}
    if sparse and rows is None:   # with a stride the lse is computed inside the kl piece
        pieces["lse"] = (jax.jit(jax.value_and_grad(lse, argnums=(0, 1))), (q, k_cmp))
    return pieces


def run(args) -> list[dict[str, Any]]:
    commit = common.git_commit()[:12]
    records = []
    for T in common.progress(args.T, desc="T", enabled=not args.no_progress):
        base = dict(T=T, mode=args.mode, query_stride=args.query_stride,
                    backend=",".join(args.backend), dtype=args.dtype,
                    device=args.device_label, commit=commit)
        try:
            pieces = piece_functions(args, prepare(args, T))
        except Exception as exc:  # a size that does not fit is a row, not a crash
            records.append(dict(base, piece="prepare", status=common.classify_exception(exc),
                                note=common.short_error(exc)))
            continue
        for name in PIECES:
            if name not in pieces:
                continue
            fn, inputs = pieces[name]
            try:
                timing, _ = common.time_jax_fn(fn, [inputs], iters=args.iters,
                                               warmup=args.warmup, repeats=args.repeats)
                records.append(dict(base, piece=name, status=common.OK, **timing.fields()))
            except Exception as exc:
                records.append(dict(base, piece=name, status=common.classify_exception(exc),
                                    note=common.short_error(exc)))
        whole = next((r["ms"] for r in records if r["T"] == T and r["piece"] == "loss"
                      and r.get("ms")), None)
        for r in records:
            if r["T"] == T and r.get("ms") and whole:
                r["share_of_loss"] = r["ms"] / whole
    return records


def build_parser():
    p = common.script_parser(__doc__)
    p.add_argument("--T_list", default="8k,32k", help="sequence lengths; 'k' = 1024")
    p.add_argument("--B", type=int, default=1, help="sequences")
    p.add_argument("--mode", default="sparse", choices=("sparse", "dense"),
                   help="AlignmentOptions.mode")
    p.add_argument("--query_stride", type=int, default=1,
                   help="AlignmentOptions.query_stride (every s-th query enters the loss)")
    p.add_argument("--backend", default=None,
                   help="NSA dispatch backends in order (default: pallas,xla on a GPU, xla on "
                        "a CPU)")
    common.add_run_args(p, iters=5, warmup=1, repeats=3)
    common.add_nsa_args(p)
    p.add_argument("--out", default="artifacts/alignment", help="directory for the outputs")
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    return p


def parse_args(argv=None):
    args = common.finish_args(build_parser().parse_args(argv))
    args.T = common.parse_int_list(args.T_list, "--T_list")
    if args.B <= 0:
        raise ValueError(f"--B ({args.B}) must be positive")
    args.backend = tuple((args.backend or ("pallas,xla" if args.device == "gpu" else "xla"))
                         .split(","))
    return args


def main(argv=None) -> int:
    _, args = common.start(parse_args, argv)
    records = run(args)
    os.makedirs(args.out, exist_ok=True)
    common.write_csv(os.path.join(args.out, "alignment.csv"), records, COLUMNS)
    common.write_environment(os.path.join(args.out, "alignment_env.json"),
                             {"argv": sys.argv, "cfg": str(args.cfg)})
    cfg = args.cfg
    title = (f"Selection-alignment loss, mode={args.mode}, one layer (d_model {cfg.d_model}, "
             f"H {cfg.n_heads}, G {cfg.n_kv_heads}, d_k {cfg.d_k}), B {args.B}, {args.dtype} "
             f"on {args.device_label}, backend {','.join(args.backend)}")
    table = common.format_table(
        [(r["T"], r["piece"], r.get("ms"), r.get("share_of_loss"), r["status"])
         for r in records], ["T", "piece", "ms", "share_of_loss", "status"])
    with open(os.path.join(args.out, "alignment_summary.txt"), "w") as f:
        f.write(title + "\n\n" + table + "\n")
    print(title)
    print(table)
    return 0 if all(r["status"] == common.OK for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
