"""Registers, spills and shared memory of the Pallas Triton kernels, compiled for sm90 on a host
without a GPU: a kernel's register pressure can be followed on a CPU between GPU runs.

jax lowers one call for CUDA (`lowering_platforms=("cuda",)`, no GPU needed). Each Pallas
Triton module of it is captured as TTIR text, compiled by the installed `triton` package for
sm90 (the stand-in driver of `scripts/triton_selection_ptx.py`) in a subprocess, and `ptxas -v`
reports on the PTX. On the GPU, XLA compiles the same TTIR with its own Triton, so these
figures are a proxy. For the selection kernel at the defaults, Nsight Compute saw 255
registers and local-memory spills (bench/RESULTS.md, R63); Triton 3.6's ptxas gives 255
registers and 468 / 428 bytes of spill stores / loads for it.

    python scripts/pallas_ptxas.py select
    python scripts/pallas_ptxas.py select --set block_sel=64,num_warps=8,num_stages=2
    python scripts/pallas_ptxas.py selected --dk 192 --csv /tmp/selected.csv

Kernels: `select` (select_blocks, fused top-n), `selected` (selected attention: forward, dq,
dk/dv, the dk/dv reduction), `compressed` (the Pallas compressed attention, forward and
backward). `--set` overrides fields of that kernel's `BlockSizes`.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.common import parse_literal  # noqa: E402
from nsa_common.layout import num_admissible_cmp_blocks  # noqa: E402
COLUMNS = ["kernel", "num_warps", "num_stages", "registers", "spill_stores", "spill_loads",
           "shared_bytes", "triton", "status"]

# Runs in a subprocess that imports triton only (jaxlib's and triton's LLVM stay apart):
# compile one TTIR file for sm90, run ptxas -v on its PTX, print one JSON line.
_WORKER = r"""
import json, os, re, subprocess, sys
sys.path.insert(0, os.path.join(sys.argv[1], "scripts"))
from triton_selection_ptx import _Sm90Driver
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
path, warps, stages = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
driver.set_active(_Sm90Driver())
kernel = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                        options=dict(num_warps=warps, num_stages=stages))
with open(path + ".ptx", "w") as f:
    f.write(kernel.asm["ptx"])
bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
report = ""
for name in ("ptxas", "ptxas-blackwell"):  # the second takes newer PTX versions (Triton 3.9)
    run = subprocess.run([os.path.join(bin_dir, name), "-v", "--gpu-name", "sm_90a",
                          path + ".ptx", "-o", os.devnull], capture_output=True, text=True)
    report = run.stderr + run.stdout
    if run.returncode == 0:
        break
registers = re.search(r"Used (\d+) registers", report)
spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
print(json.dumps(dict(
    registers=int(registers.group(1)) if registers else None,
    spill_stores=int(spills.group(1)) if spills else None,
    spill_loads=int(spills.group(2)) if spills else None,
    shared_bytes=kernel.metadata.shared, triton=triton.__version__,
    status="ok" if registers else "ptxas: " + report.strip()[-300:])))
"""


def parse_sets(text: str | None) -> dict:
    """`field=value,...` -> {field: int | bool | str}."""
    fields = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise ValueError(f"--set: {item!r} must be field=value")
        fields[key] = parse_literal(value)
    return fields


def block_sizes(cls, fields: dict):
    """`cls(**fields)`, with a ValueError that names an unknown field."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"--set: {unknown} are not fields of {cls.__module__}.{cls.__name__} "
                         f"({sorted(known)})")
    return cls(**fields)


def lowered_call(kernel: str, args, fields: dict):
    """(function, abstract arguments) of one call that lowers the named kernel(s)."""
    import jax
    import jax.numpy as jnp

    S, H, G, dk, dv = args.S, args.H, args.G, args.dk, args.dv
    l, d, l_sel = 32, 16, 64
    C = num_admissible_cmp_blocks(S - 1, l, d)      # compressed blocks of the sequence
    bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    if kernel == "select":
        from pallas_kernels.select_blocks import BlockSizes, select_blocks
        sizes = block_sizes(BlockSizes, fields)
        fn = lambda q, k_cmp, lse: select_blocks(
            q, k_cmp, lse, cmp_block=l, cmp_stride=d, sel_block=l_sel, n_sel=16, n_init=1,
            n_local=2, block_sizes=sizes)
        return fn, (bf16(1, S, H, dk), bf16(1, C, G, dk),
                    jax.ShapeDtypeStruct((1, S, H), jnp.float32))
    if kernel == "selected":
        from pallas_kernels.selected_attention import BlockSizes, selected_attention
        sizes = block_sizes(BlockSizes, fields)

        def fn(q, k, v, block_idx):
            loss = lambda q, k, v: selected_attention(q, k, v, block_idx, l_sel,
                                                      block_sizes=sizes).astype(jnp.float32).sum()
            return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
        return fn, (bf16(1, S, H, dk), bf16(1, S, G, dk), bf16(1, S, G, dv),
                    jax.ShapeDtypeStruct((1, S, G, 16), jnp.int32))
    if kernel == "compressed":
        from pallas_kernels.compressed_attention import BlockSizes, compressed_attention
        sizes = block_sizes(BlockSizes, fields)

        def fn(q, k_cmp, v_cmp):
            def loss(q, k, v):
                out = compressed_attention(q, k, v, cmp_block=l, cmp_stride=d, block_sizes=sizes)
                return (out[0] if isinstance(out, tuple) else out).astype(jnp.float32).sum()
            return jax.grad(loss, argnums=(0, 1, 2))(q, k_cmp, v_cmp)
        return fn, (bf16(1, S, H, dk), bf16(1, C, G, dk), bf16(1, C, G, dv))
    raise ValueError(f"unknown kernel {kernel!r}")


def capture(kernel: str, args, fields: dict) -> list[tuple[str, int, int, str]]:
    """(name, num_warps, num_stages, TTIR text) of every Pallas Triton module of the call, in
    lowering order."""
    import jax
    import jax._src.pallas.triton.pallas_call_registration as registration

    modules = []
    lower = registration.lowering.lower_jaxpr_to_triton_module

    def recording(*a, **kw):
        result = lower(*a, **kw)
        modules.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    fn, shapes = lowered_call(kernel, args, fields)
    registration.lowering.lower_jaxpr_to_triton_module = recording
    try:
        text = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = lower
    launches = {}   # name -> [(warps, stages)] in the order of the text's custom calls
    for line in text.splitlines():
        if "xla.gpu.triton" not in line:
            continue
        name = re.search(r'name = "([^"]+)"', line)
        warps, stages = re.search(r"num_warps = (\d+)", line), re.search(r"num_stages = (\d+)",
                                                                        line)
        if name and warps and stages:
            launches.setdefault(name.group(1), []).append((int(warps.group(1)),
                                                           int(stages.group(1))))
    out = []
    for ttir in modules:
        name = re.search(r"module @([\w$.]+)", ttir).group(1)
        warps, stages = launches[name].pop(0) if launches.get(name) else (4, 3)
        out.append((name, warps, stages, ttir))
    return out


def compile_module(name: str, warps: int, stages: int, ttir: str, workdir: str) -> dict:
    path = os.path.join(workdir, f"{name}_{warps}_{stages}.ttir")
    with open(path, "w") as f:
        f.write(ttir)
    env = dict(os.environ, TRITON_DEFAULT_FP_FUSION=os.environ.get("TRITON_DEFAULT_FP_FUSION",
                                                                   "1"))
    run = subprocess.run([sys.executable, "-c", _WORKER, ROOT, path, str(warps), str(stages)],
                         capture_output=True, text=True, env=env, timeout=900)
    row = dict(kernel=name, num_warps=warps, num_stages=stages)
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    if run.returncode != 0 or not lines:
        return dict(row, status="compile failed: " + (run.stderr.strip()[-300:] or "no output"))
    return dict(row, **json.loads(lines[-1]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("kernel", choices=("select", "selected", "compressed"))
    parser.add_argument("--S", type=int, default=8192, help="tokens (the code is the same for "
                                                            "any S the kernel takes)")
    parser.add_argument("--H", type=int, default=64)
    parser.add_argument("--G", type=int, default=4)
    parser.add_argument("--dk", type=int, default=128)
    parser.add_argument("--dv", type=int, default=128)
    parser.add_argument("--set", default=None, help="BlockSizes fields: field=value,...")
    parser.add_argument("--csv", default=None, help="write the rows to this CSV file too")
    args = parser.parse_args(argv)
    try:
        fields = parse_sets(args.set)
        modules = capture(args.kernel, args, fields)
    except ValueError as exc:
        parser.error(str(exc))
    with tempfile.TemporaryDirectory() as workdir:
        rows = [compile_module(*module, workdir) for module in modules]
    for row in rows:
        print(" ".join(f"{c}={row.get(c)}" for c in COLUMNS))
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
    return 0 if rows and all(r.get("status") == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
