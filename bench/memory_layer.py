"""Compiled memory of the whole NSA layer (forward + backward) per backend, and a scan of the
optimised HLO for any `[T, T/d]`-sized array (issue 6: no O(T^2/d) memory).

    python bench/memory_layer.py --T 65536 --backends pallas,xla --out bench/results

Compiles only (`jax.jit(...).lower(...).compile().memory_analysis()`); nothing is timed.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import nsa_jax  # noqa: E402
from nsa_common import NSAConfig, num_cmp_blocks  # noqa: E402

SHAPE = re.compile(r"\[([0-9,]+)\]")


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


def analyse(cfg: NSAConfig, T: int, backend, dtype) -> dict:
    params = jax.eval_shape(lambda: nsa_jax.init_params(jax.random.PRNGKey(0), cfg, dtype))
    x = jax.ShapeDtypeStruct((1, T, cfg.d_model), dtype)

    def loss(p, x):
        return jnp.sum(nsa_jax.nsa_attention(p, x, cfg, backend=backend).astype(jnp.float32))

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile()
    memory = compiled.memory_analysis()
    C = num_cmp_blocks(cfg, T)
    suspicious = quadratic_shapes(compiled.as_text(), T, C)
    gib = 1024 ** 3
    return {
        "T": T, "backend": "+".join(backend) if isinstance(backend, tuple) else backend,
        "temp_GiB": memory.temp_size_in_bytes / gib,
        "argument_GiB": memory.argument_size_in_bytes / gib,
        "output_GiB": memory.output_size_in_bytes / gib,
        "T_by_C_arrays": len(suspicious), "examples": " ".join(suspicious[:4]),
        "naive_p_cmp_GiB": T * cfg.n_heads * C * 4 / gib,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--T", default="65536", help="comma list of sequence lengths")
    parser.add_argument("--backends", default="pallas,xla")
    parser.add_argument("--dk", type=int, default=128)
    parser.add_argument("--dv", type=int, default=128)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    cfg = NSAConfig.paper(d_k=args.dk, d_v=args.dv)
    rows = []
    for T in [int(t) for t in args.T.split(",")]:
        for name in args.backends.split(","):
            backend = (name, "xla") if name != "xla" else "xla"
            try:
                row = analyse(cfg, T, backend, jnp.bfloat16)
            except Exception as error:  # noqa: BLE001 - a failed compile is a result too
                row = {"T": T, "backend": name, "error": f"{type(error).__name__}: {error}"[:300]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "memory_layer.csv")
    keys = sorted({k for r in rows for k in r})
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    print(f"\n{'T':>7} {'backend':<12} {'temp GiB':>9} {'args GiB':>9} {'[T,C] arrays':>12} "
          f"{'naive p_cmp GiB':>15}")
    for r in rows:
        if "error" in r:
            print(f"{r['T']:>7} {r['backend']:<12} error: {r['error']}")
            continue
        print(f"{r['T']:>7} {r['backend']:<12} {r['temp_GiB']:>9.2f} {r['argument_GiB']:>9.2f} "
              f"{r['T_by_C_arrays']:>12} {r['naive_p_cmp_GiB']:>15.1f}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
