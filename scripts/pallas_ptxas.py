"""Registers, spills and shared memory of the Pallas Triton kernels, compiled for an sm80, sm86,
sm89 or sm90 GPU on a host without one: a kernel's register pressure and its fit in the
architecture's shared memory can be followed on a CPU between GPU runs.

jax lowers one call for CUDA (`lowering_platforms=("cuda",)`, no GPU needed) with the block
sizes of the `--arch` profile (`pallas_kernels.profiles`, the tiles a GPU of that architecture
runs). Each Pallas Triton module of it is captured as TTIR text, compiled by the installed
`triton` package for that architecture (the stand-in driver of
`scripts/triton_selection_ptx.py`) in a subprocess, and `ptxas -v` reports on the PTX. On the
GPU, XLA compiles the same TTIR with its own Triton, so these figures are a proxy. For the
selection kernel at sm90's tiles, Nsight Compute saw 255 registers and local-memory spills on
an H100 (bench/RESULTS.md); Triton 3.6's ptxas gives 255 registers and 468 / 428 bytes of spill
stores / loads for it.

    python scripts/pallas_ptxas.py select
    python scripts/pallas_ptxas.py select --set block_sel=64,num_warps=8,num_stages=2
    python scripts/pallas_ptxas.py selected --dk 192 --csv /tmp/selected.csv
    python scripts/pallas_ptxas.py all --arch sm80,sm89,sm90 --heads 128/128,192/128,256/256 \
        --csv /tmp/pallas_ptxas.csv

Kernels: `select` (select_blocks, fused top-n), `selected` (selected attention: forward, dq,
dk/dv, the dk/dv reduction), `compressed` (the Pallas compressed attention, forward and
backward), `window` (sliding-window attention: forward, dq, dk/dv), `decode` (the decode
step's kernels: compressed, the split combine, selection, top-n, selected + window, the cache
append, the block compression), `all` (every one). `--set` overrides fields of that kernel's
block sizes (the `--arch` profile's tiles otherwise). A row fits when its shared memory is at most the
architecture's per-block limit; the exit status is 0 when every row compiled and fits. A
shape the profile has no tiles for (the Pallas backend then runs XLA) is a row with status
`no tiles: ...`, which counts as neither a failure nor a fit.
"""
from __future__ import annotations

import argparse
import concurrent.futures
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
from bench.common import parse_assignments  # noqa: E402
from nsa_common.layout import num_admissible_cmp_blocks  # noqa: E402
from pallas_kernels import profiles  # noqa: E402

COLUMNS = ["arch", "dtype", "d_k", "d_v", "kernel", "num_warps", "num_stages", "registers",
           "spill_stores", "spill_loads", "shared_bytes", "shared_limit", "fits", "triton",
           "status"]
KERNELS = ("select", "selected", "compressed", "window", "decode", "block_mass", "importance")
# Kernels that take another kernel's tiles: the block-mass kernel runs on the selected ones; the
# importance kernels have fixed launch parameters (the selected ones' are looked up, unused).
PROFILE_OF = {"block_mass": "selected", "importance": "selected"}

# Runs in a subprocess that imports triton only (jaxlib's and triton's LLVM stay apart):
# compile one TTIR file for one architecture, run ptxas -v on its PTX, print one JSON line.
_WORKER = r"""
import json, os, re, subprocess, sys
sys.path.insert(0, os.path.join(sys.argv[1], "scripts"))
from triton_selection_ptx import StandInDriver, capability, ptxas_name
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
path, warps, stages, arch = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
driver.set_active(StandInDriver(arch))
kernel = triton.compile(path, target=GPUTarget("cuda", capability(arch), 32),
                        options=dict(num_warps=warps, num_stages=stages))
with open(path + ".ptx", "w") as f:
    f.write(kernel.asm["ptx"])
bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
report = ""
for name in ("ptxas", "ptxas-blackwell"):  # the second takes newer PTX versions (Triton 3.9)
    run = subprocess.run([os.path.join(bin_dir, name), "-v", "--gpu-name", ptxas_name(arch),
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
    return parse_assignments(text, "--set")


def block_sizes(kernel: str, arch: str, d_k: int, d_v: int, fields: dict, dtype: str):
    """The `arch` profile's block sizes of `kernel` at these head dims and dtype, with `fields`
    replaced; a ValueError names an unknown field, NotImplementedError a shape without tiles."""
    sizes = profiles.PROFILES[arch].block_sizes(PROFILE_OF.get(kernel, kernel), dtype, d_k, d_v)
    known = {f.name for f in dataclasses.fields(sizes)}
    unknown = sorted(set(fields) - known)
    if unknown:
        cls = type(sizes)
        raise ValueError(f"--set: {unknown} are not fields of {cls.__module__}.{cls.__name__} "
                         f"({sorted(known)})")
    return dataclasses.replace(sizes, **fields)


def lowered_call(kernel: str, args, d_k: int, d_v: int, sizes):
    """(function, abstract arguments) of one call that lowers the named kernel(s)."""
    import jax
    import jax.numpy as jnp

    S, H, G = args.S, args.H, args.G
    l, d, l_sel, n_sel, window = 32, 16, 64, 16, 512
    C = num_admissible_cmp_blocks(S - 1, l, d)      # compressed blocks of the sequence
    bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, args.dtype)  # noqa: E731 (--dtype)
    if kernel == "select":
        from pallas_kernels.select_blocks import select_blocks
        fn = lambda q, k_cmp, lse: select_blocks(  # noqa: E731
            q, k_cmp, lse, cmp_block=l, cmp_stride=d, sel_block=l_sel, n_sel=n_sel, n_init=1,
            n_local=2, block_sizes=sizes)
        return fn, (bf16(1, S, H, d_k), bf16(1, C, G, d_k),
                    jax.ShapeDtypeStruct((1, S, H), jnp.float32))
    if kernel == "selected":
        from pallas_kernels.selected_attention import selected_attention

        def fn(q, k, v, block_idx):
            loss = lambda q, k, v: selected_attention(  # noqa: E731
                q, k, v, block_idx, l_sel, block_sizes=sizes).astype(jnp.float32).sum()
            return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
        return fn, (bf16(1, S, H, d_k), bf16(1, S, G, d_k), bf16(1, S, G, d_v),
                    jax.ShapeDtypeStruct((1, S, G, n_sel), jnp.int32))
    if kernel == "block_mass":
        from pallas_kernels.selected_block_mass import selected_block_mass
        fn = lambda q, k, block_idx: selected_block_mass(  # noqa: E731
            q, k, block_idx, l_sel, block_sizes=sizes)
        return fn, (bf16(1, S, H, d_k), bf16(1, S, G, d_k),
                    jax.ShapeDtypeStruct((1, S, G, n_sel), jnp.int32))
    if kernel == "importance":
        from nsa_common import NSAConfig, overlap_by_offset
        from pallas_kernels.selected_importance import selected_importance
        del sizes
        weights = overlap_by_offset(NSAConfig(cmp_block=l, cmp_stride=d, sel_block=l_sel))

        def fn(q, k_cmp, lse, block_idx):
            loss = lambda q, k, lse: selected_importance(  # noqa: E731
                q, k, lse, block_idx, cmp_block=l, cmp_stride=d, sel_block=l_sel,
                weights=weights, scale=d_k ** -0.5).sum()
            return jax.grad(loss, argnums=(0, 1, 2))(q, k_cmp, lse)
        return fn, (bf16(1, S, H, d_k), bf16(1, C, G, d_k),
                    jax.ShapeDtypeStruct((1, S, H), jnp.float32),
                    jax.ShapeDtypeStruct((1, S, G, n_sel), jnp.int32))
    if kernel == "compressed":
        from pallas_kernels.compressed_attention import compressed_attention

        def fn(q, k_cmp, v_cmp):
            def loss(q, k, v):
                out = compressed_attention(q, k, v, cmp_block=l, cmp_stride=d, block_sizes=sizes)
                return (out[0] if isinstance(out, tuple) else out).astype(jnp.float32).sum()
            return jax.grad(loss, argnums=(0, 1, 2))(q, k_cmp, v_cmp)
        return fn, (bf16(1, S, H, d_k), bf16(1, C, G, d_k), bf16(1, C, G, d_v))
    if kernel == "window":
        from pallas_kernels.window_attention import window_attention

        def fn(q, k, v):
            loss = lambda q, k, v: window_attention(  # noqa: E731
                q, k, v, window=window, block_sizes=sizes).astype(jnp.float32).sum()
            return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
        return fn, (bf16(1, S, H, d_k), bf16(1, S, G, d_k), bf16(1, S, G, d_v))
    if kernel == "decode":
        from pallas_kernels import decode

        B = args.decode_batch

        def mlp(D):
            return {"pos": bf16(G, l, D), "w1": bf16(G, l * D, D), "b1": bf16(G, D),
                    "w2": bf16(G, D, D), "b2": bf16(G, D)}

        def fn(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, t, projections, k_raw, v_raw,
               cmp_k, cmp_v, heads):
            # The step's attention: five kernels, the combine mixing the branches by the gate
            # logits, which sit in the projections after q and the keys (as in a decode step).
            gate = (projections, projections.shape[1] - 3 * H, jnp.zeros((3 * H,), jnp.float32))
            out = decode.decode_attention(
                q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, t, cmp_block=l, cmp_stride=d,
                sel_block=l_sel, n_sel=n_sel, n_init=1, n_local=2, n_blocks=-(-S // l_sel),
                window=window, scale=d_k ** -0.5, gate=gate, q_rows=heads, block_sizes=sizes)
            # The step's append kernel takes rows of G*d a power of two (XLA appends the others).
            caches = [x for x in (k_sel, v_sel) if (G * x.shape[3]) & (G * x.shape[3] - 1) == 0]
            columns = [(0, 0)] * len(caches)
            appended = decode.append_step_packed(tuple(caches), (projections,), columns, t,
                                                 limit=S) if caches else ()
            # The step's compression (the MLP of each ring), where D is a power of two.
            rings = [(r, b, p) for r, b, p in ((k_raw, k_cmp, cmp_k), (v_raw, v_cmp, cmp_v))
                     if r.shape[3] & (r.shape[3] - 1) == 0]
            compressed = decode.compress_step(
                tuple(r for r, _, _ in rings), tuple(b for _, b, _ in rings), t,
                [p for _, _, p in rings], cmp_block=l, cmp_stride=d, limit=S) if rings else ()
            return out, appended, compressed
        width = H * d_k + 2 * G * (d_k + d_v) + 3 * H
        return fn, (bf16(B, H, d_k), bf16(B, C, G, d_k), bf16(B, C, G, d_v),
                    bf16(B, S, G, d_k), bf16(B, S, G, d_v), bf16(B, window, G, d_k),
                    bf16(B, window, G, d_v), jax.ShapeDtypeStruct((B,), jnp.int32),
                    bf16(B, width), bf16(B, l, G, d_k), bf16(B, l, G, d_v), mlp(d_k), mlp(d_v),
                    bf16(B, (H + 2 * G) * d_k))
    raise ValueError(f"unknown kernel {kernel!r}")


def capture(kernel: str, args, d_k: int, d_v: int, sizes) -> list[tuple[str, int, int, str]]:
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

    fn, shapes = lowered_call(kernel, args, d_k, d_v, sizes)
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


def compile_module(name: str, warps: int, stages: int, ttir: str, workdir: str,
                   arch: str) -> dict:
    path = os.path.join(workdir, f"{arch}_{name}_{warps}_{stages}_{abs(hash(ttir))}.ttir")
    with open(path, "w") as f:
        f.write(ttir)
    env = dict(os.environ, TRITON_DEFAULT_FP_FUSION=os.environ.get("TRITON_DEFAULT_FP_FUSION",
                                                                   "1"))
    run = subprocess.run([sys.executable, "-c", _WORKER, ROOT, path, str(warps), str(stages),
                          arch], capture_output=True, text=True, env=env, timeout=900)
    row = dict(kernel=name, num_warps=warps, num_stages=stages)
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    if run.returncode != 0 or not lines:
        return dict(row, status="compile failed: " + (run.stderr.strip()[-300:] or "no output"))
    return dict(row, **json.loads(lines[-1]))


def parse_heads(args) -> list[tuple[int, int]]:
    """`--heads 128/128,192/128` (else `--dk`, `--dv`) -> [(d_k, d_v), ...]."""
    if not args.heads:
        return [(args.dk, args.dv)]
    pairs = []
    for item in args.heads.split(","):
        d_k, sep, d_v = item.strip().partition("/")
        if not sep or not d_k.isdigit() or not d_v.isdigit():
            raise ValueError(f"--heads: {item!r} must be d_k/d_v")
        pairs.append((int(d_k), int(d_v)))
    return pairs


def run(kernels, archs, heads, args, fields: dict) -> list[dict]:
    """Every (arch, head dims, kernel) captured here and compiled in `args.jobs` processes."""
    jobs = []   # (row header, module) in the order of the rows
    rows = []
    for arch in archs:
        limit = profiles.PROFILES[arch].shared_memory
        for d_k, d_v in heads:
            for kernel in kernels:
                head = dict(arch=arch, dtype=args.dtype, d_k=d_k, d_v=d_v, shared_limit=limit)
                try:
                    sizes = block_sizes(kernel, arch, d_k, d_v, fields, args.dtype)
                except NotImplementedError as exc:
                    rows.append(dict(head, kernel=kernel, status=f"no tiles: {exc}"))
                    continue
                for module in capture(kernel, args, d_k, d_v, sizes):
                    jobs.append((len(rows), head, module))
                    rows.append(None)
    with tempfile.TemporaryDirectory() as workdir, \
            concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        futures = {pool.submit(compile_module, *module, workdir, head["arch"]): (i, head)
                   for i, head, module in jobs}
        for future in concurrent.futures.as_completed(futures):
            i, head = futures[future]
            row = dict(head, **future.result())
            shared = row.get("shared_bytes")
            row["fits"] = shared is not None and shared <= row["shared_limit"]
            rows[i] = row
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("kernel", choices=KERNELS + ("all",))
    parser.add_argument("--arch", default="sm90",
                        help=f"one or more of {', '.join(profiles.names())}, comma-separated")
    parser.add_argument("--S", type=int, default=8192, help="tokens (the code is the same for "
                                                            "any S the kernel takes)")
    parser.add_argument("--H", type=int, default=64)
    parser.add_argument("--G", type=int, default=4)
    parser.add_argument("--dk", type=int, default=128)
    parser.add_argument("--dv", type=int, default=128)
    parser.add_argument("--heads", default=None,
                        help="head dims d_k/d_v, comma-separated (instead of --dk, --dv)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="the inputs' dtype")
    parser.add_argument("--decode-batch", type=int, default=4, help="decode: batch rows")
    parser.add_argument("--set", default=None, help="BlockSizes fields: field=value,...")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="compilations run at once")
    parser.add_argument("--csv", default=None, help="write the rows to this CSV file too")
    args = parser.parse_args(argv)
    kernels = KERNELS if args.kernel == "all" else (args.kernel,)
    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    try:
        unknown = [a for a in archs if a not in profiles.PROFILES]
        if unknown or not archs:
            raise ValueError(f"--arch: {unknown or args.arch!r} must be among "
                             f"{list(profiles.names())}")
        fields = parse_sets(args.set)
        heads = parse_heads(args)
        for arch in archs:   # fields checked before anything compiles
            for d_k, d_v in heads:
                for kernel in kernels:
                    try:
                        block_sizes(kernel, arch, d_k, d_v, fields, args.dtype)
                    except NotImplementedError:
                        pass
        rows = run(kernels, archs, heads, args, fields)
    except ValueError as exc:
        parser.error(str(exc))
    for row in rows:
        print(" ".join(f"{c}={row.get(c)}" for c in COLUMNS))
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
    compiled = [r for r in rows if not str(r.get("status", "")).startswith("no tiles")]
    return 0 if compiled and all(r.get("status") == "ok" and r["fits"] for r in compiled) else 1


if __name__ == "__main__":
    sys.exit(main())
