"""`python -m parity`: the JAX-vs-PyTorch parity report (the project's main job)."""
from __future__ import annotations

import argparse
import os
import sys

from parity.bugs import BUGS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m parity",
        description="Run nsa_jax and nsa_torch_ref on the same weights and inputs; compare every "
                    "branch, output, gradient and decode step against the spec's tolerances.")
    parser.add_argument("--preset", default="tiny",
                        help="config preset: tiny (default), paper, or bench (the paper's with "
                             "d_k = 128, the benchmarks' configuration)")
    parser.add_argument("--T", type=int, default=80, help="prompt length (default 80)")
    parser.add_argument("--B", type=int, default=2, help="batch size (default 2)")
    parser.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu | gpu")
    parser.add_argument("--decode-steps", type=int, default=4)
    parser.add_argument("--compress", default=None, help="override the preset: mlp | mean")
    parser.add_argument("--shared-kv", action="store_true", help="one Wk, Wv for all branches")
    parser.add_argument("--no-rope", action="store_true", help="rope_theta = None")
    parser.add_argument("--jax-backend", default="xla", help="xla | pallas")
    parser.add_argument("--torch-backend", default="sdpa", help="sdpa | triton | fa2")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    parser.add_argument("--perturb", metavar="PARAM",
                        help="self-test: scale one JAX-side weight by 1.01 (e.g. wk.win); the "
                             "rows it feeds must FAIL")
    parser.add_argument("--perturb-scale", type=float, default=1.01, metavar="FACTOR",
                        help="the factor of --perturb (default 1.01)")
    parser.add_argument("--plant", metavar="BUG", choices=sorted(BUGS),
                        help="self-test: plant a bug in the JAX layer (the report must FAIL): "
                             + "; ".join(f"{k}: {v}" for k, v in BUGS.items()))
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.device == "cpu" and args.torch_backend == "triton":
        # Triton kernels run on CPU tensors only in its interpreter, which Triton reads when the
        # kernels are defined (first use), so it must be set before that.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    # Imports after parsing so that --help is instant.
    from nsa_common import NSAConfig
    from parity.report import ParitySettings, format_table, run_report, to_json

    if args.device == "cpu":
        import jax
        jax.config.update("jax_platforms", "cpu")
    changes = {}
    if args.compress is not None:
        changes["compress"] = args.compress
    if args.shared_kv:
        changes["shared_kv"] = True
    if args.no_rope:
        changes["rope_theta"] = None
    try:
        if args.preset == "bench":
            changes = {"d_k": 128, **changes}
        cfg = NSAConfig.preset("paper" if args.preset == "bench" else args.preset, **changes)
        settings = ParitySettings(cfg=cfg, batch=args.B, seq_len=args.T, dtype=args.dtype,
                                  seed=args.seed, device=args.device,
                                  jax_backend=args.jax_backend, torch_backend=args.torch_backend,
                                  decode_steps=args.decode_steps, perturb=args.perturb,
                                  perturb_scale=args.perturb_scale, plant=args.plant)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"parity: preset={args.preset} B={args.B} T={args.T} dtype={args.dtype} "
          f"device={args.device} jax={args.jax_backend} torch={args.torch_backend}")
    print(f"  {cfg}")
    import jax

    try:
        # The spec's float32 tolerances (1e-5) assume IEEE float32 matmuls: no TF32 on GPUs.
        with jax.default_matmul_precision("highest"):
            rows = run_report(settings)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_table(rows, settings))
    if args.json:
        with open(args.json, "w") as f:
            f.write(to_json(settings, rows))
        print(f"wrote {args.json}")
    return 0 if all(r.passed for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
