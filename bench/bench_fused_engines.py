"""cuDNN against FlashAttention-3 on the two forms NSA hands to fused attention.

The window branch (`nsa_jax.xla.cudnn.window_attention`, window w) and the compressed branch
folded into a causal square (`cudnn.compressed_attention`, its fold and lse included, on
`causal_attention` or `fa3_causal_attention`), forward and forward+backward, timed with
`bench.common.time_jax_fn`. These are the calls the layer makes where `XlaOptions.fa3` /
`PallasOptions.fa3` pick the engine; this script is the evidence for that default. Engines:
`cudnn` (as the layer calls it: v unpadded where `cudnn.cudnn_mla()`), `cudnn_padded` (d_v <
d_k only: v zero-padded to d_k, the form before the MLA one) and `fa3` (where
`cudnn.fa3_takes`: this flash_attn3_jax build takes heads <= 128). `max_abs_diff_o` is each
engine's output against `cudnn`'s. Prints a table and writes `<out>/fused_engines.csv`; rows
that cannot run here (no GPU, no package) are written with status `skip`.

    python bench/bench_fused_engines.py --S_list 8k,64k --out artifacts/fused
    python bench/bench_fused_engines.py --S_list 64k --dk 192 --dv 128 --out artifacts/fused192
"""
from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402
from bench.common import Skip  # noqa: E402

COLUMNS = ["S", "form", "engine", "pass", "status", "ms", "ms_min", "ms_max", "max_abs_diff_o",
           "device", "commit"]


def build_parser():
    p = common.script_parser(__doc__)
    p.add_argument("--S_list", default="8k,64k", help="sequence lengths, comma list; 'k' = 1024")
    p.add_argument("--H", type=int, default=64)
    p.add_argument("--G", type=int, default=4)
    p.add_argument("--d", type=int, default=128, help="head size (d_k = d_v)")
    p.add_argument("--dk", type=int, default=None, help="query/key head size (default --d)")
    p.add_argument("--dv", type=int, default=None, help="value head size (default --d)")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--cmp_block", type=int, default=32)
    p.add_argument("--cmp_stride", type=int, default=16)
    common.add_run_args(p, iters=10, warmup=3, repeats=5, dtypes=("bfloat16", "bf16"))
    p.add_argument("--out", default="artifacts/fused")
    p.add_argument("--no_progress", action="store_true")
    return p


def forms(args, S: int):
    """{form: (q shape, k shape, {engine: f(q, k, v)})} for one S: the library's own calls
    (`nsa_jax.xla.cudnn`), the compressed one with its fold and lse."""
    import jax.numpy as jnp

    from nsa_common import NSAConfig, num_cmp_blocks
    from nsa_jax.xla import cudnn

    dk, dv = args.dk, args.dv
    scale = 1 / math.sqrt(dk)
    cfg = NSAConfig.tiny().replace(n_heads=args.H, n_kv_heads=args.G, d_k=dk, d_v=dv,
                                   cmp_block=args.cmp_block, cmp_stride=args.cmp_stride,
                                   sel_block=2 * args.cmp_block, window=args.window)
    # What the engines take: head sizes, dtype.
    x, y = jnp.zeros((1, 8, 1, dk), jnp.bfloat16), jnp.zeros((1, 8, 1, dv), jnp.bfloat16)
    if not cudnn.takes(x, x, y):
        raise Skip("cuDNN's fused attention does not take these shapes here")

    def window(fa3, mla=None):
        return lambda q, k, v: cudnn.window_attention(q, k, v, window=args.window, scale=scale,
                                                      fa3=fa3, mla=mla)

    def compressed(attend):
        return lambda q, k, v: cudnn.compressed_attention(q, k, v, cfg, scale=scale,
                                                          attend=attend)[0]

    padded = lambda q, k, v, scale: cudnn.causal_attention(q, k, v, scale, mla=False)
    window_engines = {"cudnn": window(False)}
    compressed_engines = {"cudnn": compressed(cudnn.causal_attention)}
    if dv < dk:
        window_engines["cudnn_padded"] = window(False, mla=False)
        compressed_engines["cudnn_padded"] = compressed(padded)
    if cudnn.fa3_takes(x, x, y):
        window_engines["fa3"] = window(True)
        compressed_engines["fa3"] = compressed(cudnn.fa3_causal_attention)
    C = num_cmp_blocks(cfg, S)
    return {
        "window": ((1, S, args.H, dk), (1, S, args.G, dk), (1, S, args.G, dv), window_engines),
        "compressed": ((1, S, args.H, dk), (1, C, args.G, dk), (1, C, args.G, dv),
                       compressed_engines),
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
    except Skip as exc:
        return [dict(base, form="-", engine="-", status=f"skip: {exc}")]
    rows = []
    for form, (q_shape, k_shape, v_shape, engines) in table.items():
        key = jax.random.PRNGKey(S)
        do_shape = q_shape[:3] + v_shape[3:]
        q, k, v, do = (jax.random.normal(jax.random.fold_in(key, i), shape, jnp.bfloat16)
                       for i, shape in enumerate((q_shape, k_shape, v_shape, do_shape)))
        outs = {name: jax.jit(f)(q, k, v).astype(jnp.float32) for name, f in engines.items()}
        for name, f in engines.items():
            diff = float(jnp.max(jnp.abs(outs[name] - outs["cudnn"])))
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
    args.dk = args.d if args.dk is None else args.dk
    args.dv = args.d if args.dv is None else args.dv
    if args.dv > args.dk:
        raise ValueError(f"--dv ({args.dv}) must be at most --dk ({args.dk})")
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
