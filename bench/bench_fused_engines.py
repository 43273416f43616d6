"""cuDNN against FlashAttention-3 on the two forms NSA hands to fused attention.

The window branch (causal, window w: `local_window_size=(w - 1, 0)` / `window_size=(w - 1, 0)`)
and the compressed branch folded into a causal square (`nsa_jax.xla.cudnn`: q
`[B, C, G * d * h, d_k]` against the C compressed keys), forward and forward+backward, timed
with `bench.common.time_jax_fn`. The layer picks FA-3 where `flash_attn3_jax` is installed
(`XlaOptions.fa3`, `PallasOptions.fa3`); this script is the evidence for that default (R45).
Prints a table and writes `<out>/fused_engines.csv`; rows that cannot run here (no GPU, no
package) are written with status `skip`.

    python bench/bench_fused_engines.py --S_list 8k,64k --out artifacts/fused
"""
from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402

COLUMNS = ["S", "form", "engine", "pass", "status", "ms", "ms_min", "ms_max", "max_abs_diff_o",
           "device", "commit"]


def build_parser():
    p = common.script_parser(__doc__)
    p.add_argument("--S_list", default="8k,64k", help="sequence lengths, comma list; 'k' = 1024")
    p.add_argument("--H", type=int, default=64)
    p.add_argument("--G", type=int, default=4)
    p.add_argument("--d", type=int, default=128, help="head size (d_k = d_v)")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--cmp_block", type=int, default=32)
    p.add_argument("--cmp_stride", type=int, default=16)
    common.add_run_args(p, iters=10, warmup=3, repeats=5, dtypes=("bfloat16", "bf16"))
    p.add_argument("--out", default="artifacts/fused")
    p.add_argument("--no_progress", action="store_true")
    return p


def forms(args, S: int):
    """{form: (q shape, k shape, {engine: f(q, k, v)})} for one S."""
    import jax

    from flash_attn3_jax import flash_mha  # noqa: F401  (Skip below when absent)

    scale = 1 / math.sqrt(args.d)
    w = args.window
    n = (S - args.cmp_block) // args.cmp_stride + 1
    n += n % 2  # the fold's even square (cuDNN's backward)
    heads = args.G * args.cmp_stride * (args.H // args.G)
    dpa = jax.nn.dot_product_attention
    return {
        "window": ((1, S, args.H, args.d), (1, S, args.G, args.d), {
            "cudnn": lambda q, k, v: dpa(q, k, v, scale=scale, is_causal=True,
                                         local_window_size=(w - 1, 0), implementation="cudnn"),
            "fa3": lambda q, k, v: flash_mha(q, k, v, softmax_scale=scale, is_causal=True,
                                             window_size=(w - 1, 0))}),
        "compressed": ((1, n, heads, args.d), (1, n, args.G, args.d), {
            "cudnn": lambda q, k, v: dpa(q, k, v, scale=scale, is_causal=True,
                                         implementation="cudnn"),
            "fa3": lambda q, k, v: flash_mha(q, k, v, softmax_scale=scale, is_causal=True)}),
    }


def with_backward(f):
    import jax

    def step(q, k, v, do):
        _, pullback = jax.vjp(f, q, k, v)
        return pullback(do)
    return step


def run_S(args, S: int) -> list[dict]:
    import jax
    import jax.numpy as jnp

    base = dict(S=S, device=args.device_label, commit=common.git_commit())
    if args.device != "gpu" or jax.default_backend() != "gpu":
        return [dict(base, form="-", engine="-", status="skip: needs a GPU")]
    try:
        table = forms(args, S)
    except ImportError as exc:
        return [dict(base, form="-", engine="-", status=f"skip: {exc}")]
    rows = []
    for form, (q_shape, k_shape, engines) in table.items():
        key = jax.random.PRNGKey(S)
        q, k, v, do = (jax.random.normal(jax.random.fold_in(key, i), shape, jnp.bfloat16)
                       for i, shape in enumerate((q_shape, k_shape, k_shape, q_shape)))
        outs = {name: jax.jit(f)(q, k, v).astype(jnp.float32) for name, f in engines.items()}
        diff = float(jnp.max(jnp.abs(outs["cudnn"] - outs["fa3"])))
        for name, f in engines.items():
            for pass_name, fn, inputs in (("fwd", f, (q, k, v)),
                                          ("fwd_bwd", with_backward(f), (q, k, v, do))):
                row = dict(base, form=form, engine=name, max_abs_diff_o=diff, **{"pass": pass_name})
                try:
                    timing, _ = common.time_jax_fn(fn, [inputs], iters=args.iters,
                                                   warmup=args.warmup, repeats=args.repeats)
                    row.update(status="ok", **timing.fields())
                except Exception as exc:  # a row that fails is reported, the others still run
                    row.update(status=f"{common.classify_exception(exc)}: "
                                      f"{common.short_error(exc)}")
                rows.append(row)
    return rows


def main(argv=None) -> list[dict]:
    _, args = common.start(lambda a: common.finish_args(build_parser().parse_args(a)), argv)
    sizes = common.parse_int_list(args.S_list, "--S_list")
    rows = []
    for S in common.progress(sizes, desc="S", enabled=not args.no_progress):
        rows += run_S(args, S)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "fused_engines.csv")
    common.write_csv(path, rows, COLUMNS)
    print(common.format_table([[r.get(c, "") for c in COLUMNS[:7]] for r in rows], COLUMNS[:7]))
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
