"""Compiled memory of the whole NSA layer (forward + backward) per backend, and a scan of the
optimised HLO for any `[T, T/d]`-sized array (the layer must hold no O(T^2/d) memory).

Compiles only (`jax.jit(...).lower(...).compile().memory_analysis()`); nothing is timed. Writes
memory_layer.csv and memory_layer_env.json to --out and prints a table.

Example (GPU): python bench/memory_layer.py --S_list 64k --backends pallas,xla --out bench/results
CPU smoke:     python bench/memory_layer.py --device cpu --preset tiny --S_list 256 \\
                   --backends xla --dtype float32 --out /tmp/memory_layer
"""
from __future__ import annotations

import argparse
import os
import re
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402

SHAPE = re.compile(r"\[([0-9,]+)\]")
GIB = 1024 ** 3


def quadratic_shapes(hlo_text: str, T: int, C: int) -> list[str]:
    """Array shapes in the HLO that hold both a T-sized and a C-sized axis (the `[T, T/d]`
    pattern: compressed-attention probabilities or scores over the whole sequence)."""
    c_sizes = {C, 1 << (C - 1).bit_length()}  # exact, or padded to a power of two
    found = set()
    for match in SHAPE.finditer(hlo_text):
        dims = [int(x) for x in match.group(1).split(",") if x]
        if T in dims and c_sizes & set(dims):
            found.add(match.group(0))
    return sorted(found)


def analyse(cfg, T: int, backend, dtype) -> dict:
    import jax
    import jax.numpy as jnp

    import nsa_jax
    from nsa_common import num_cmp_blocks

    params = jax.eval_shape(lambda: nsa_jax.init_params(jax.random.PRNGKey(0), cfg, dtype))
    x = jax.ShapeDtypeStruct((1, T, cfg.d_model), dtype)

    def loss(p, x):
        return jnp.sum(nsa_jax.nsa_attention(p, x, cfg, backend=backend).astype(jnp.float32))

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile()
    memory = compiled.memory_analysis()
    C = num_cmp_blocks(cfg, T)
    suspicious = quadratic_shapes(compiled.as_text(), T, C)
    return {
        "T": T, "backend": "+".join(backend) if isinstance(backend, tuple) else backend,
        "temp_GiB": memory.temp_size_in_bytes / GIB,
        "argument_GiB": memory.argument_size_in_bytes / GIB,
        "output_GiB": memory.output_size_in_bytes / GIB,
        "T_by_C_arrays": len(suspicious), "examples": " ".join(suspicious[:4]),
        "naive_p_cmp_GiB": T * cfg.n_heads * C * 4 / GIB,
    }


def build_parser() -> argparse.ArgumentParser:
    p = common.script_parser(__doc__)
    p.add_argument("--S_list", default="64k", help="sequence lengths, comma list; 'k' = 1024")
    p.add_argument("--backends", default="pallas,xla",
                   help="comma list; a backend other than xla falls back to xla")
    common.add_run_args(p)
    common.add_nsa_args(p)
    p.add_argument("--out", default="bench/results")
    return p


def parse_args(argv=None):
    args = common.finish_args(build_parser().parse_args(argv))
    args.S = common.parse_int_list(args.S_list, "--S_list")
    return args


def main(argv=None) -> int:
    argv, args = common.start(parse_args, argv)
    dtype = common.jnp_dtype(args.dtype)
    os.makedirs(args.out, exist_ok=True)
    common.write_environment(os.path.join(args.out, "memory_layer_env.json"), {"argv": argv})
    rows = []
    for T in args.S:
        for name in args.backends.split(","):
            backend = (name, "xla") if name != "xla" else "xla"
            try:
                row = analyse(args.cfg, T, backend, dtype)
            except Exception as exc:  # a failed compile is a result too
                row = {"T": T, "backend": name, "error": common.short_error(exc, 300)}
            rows.append(row)
            print(row, flush=True)
    path = os.path.join(args.out, "memory_layer.csv")
    common.write_csv(path, rows, sorted({key for row in rows for key in row}))
    header = ["T", "backend", "temp_GiB", "argument_GiB", "T_by_C_arrays", "naive_p_cmp_GiB",
              "error"]
    print(common.format_table([[row.get(key) for key in header] for row in rows], header))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
