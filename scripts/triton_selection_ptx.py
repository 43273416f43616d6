"""The PTX of the Triton selection kernels (`nsa_torch_ref.fast.triton_selection`) for an sm80,
sm86, sm89 or sm90 GPU, compiled on a host without one: evidence that a refactor of the
kernels' Python leaves the machine code as it was (the stride tuples gave byte-identical PTX on
Triton 3.6 and 3.9), and of what each architecture's launch parameters compile to.

A stand-in driver reports the `--arch` target (default sm90), and `JITFunction.run` is forced
into warm-up, so the library's own launch code (`_forward`, `_backward`) specializes and
compiles each kernel exactly as on a GPU of that architecture, and nothing launches. The PTX is
written without its debug sections (they carry source line numbers), one file per compilation,
in launch order, with the shared memory of each compilation in `shared.csv`.

    python scripts/triton_selection_ptx.py /tmp/ptx_before      # on the old tree
    python scripts/triton_selection_ptx.py /tmp/ptx_after --compare /tmp/ptx_before
    python scripts/triton_selection_ptx.py /tmp/ptx_sm89 --arch sm89
"""
from __future__ import annotations

import argparse
import filecmp
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (B, T, H, G, d_k, d_v, block_size, n_sel, dtype name), each also packed when B = 1.
SHAPES = ((1, 256, 16, 2, 64, 64, 32, 4, "bfloat16"), (1, 256, 64, 4, 192, 128, 64, 8, "bfloat16"),
          (2, 100, 4, 2, 24, 8, 16, 3, "float32"))
# Debug lines, and the `$L__tmp` labels that mark inlined helpers' scopes for the debug sections
# (no branch targets them: a helper's extraction renumbers them and nothing else).
_DEBUG_LINE = re.compile(r"\s*(\.loc|\.file|//|\$L__tmp\d+:)")


# Architecture name -> (compute capability as Triton numbers it, ptxas's --gpu-name).
ARCHS = {"sm80": (80, "sm_80"), "sm86": (86, "sm_86"), "sm89": (89, "sm_89"),
         "sm90": (90, "sm_90a")}


def capability(arch: str) -> int:
    return ARCHS[arch][0]


def ptxas_name(arch: str) -> str:
    return ARCHS[arch][1]


class StandInDriver:
    """The part of Triton's driver that compilation asks for, with the target of `arch`."""

    def __init__(self, arch: str = "sm90"):
        self.arch = arch

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", capability(self.arch), 32)

    def get_active_torch_device(self):
        import torch
        return torch.device("cpu")


def compile_kernels(arch: str = "sm90") -> list[tuple[str, str, int]]:
    """(kernel name, PTX without debug sections, shared bytes) of every compilation, in launch
    order, for `arch`."""
    import torch
    from triton.runtime import driver
    from triton.runtime import jit

    sys.path.insert(0, ROOT)
    from nsa_torch_ref.fast import triton_selection as ts

    compiled = []
    real_run = jit.JITFunction.run

    def warm_up_only(self, *args, grid, warmup, **kwargs):
        kernel = real_run(self, *args, grid=grid, warmup=True, **kwargs)
        ptx = kernel.asm["ptx"]
        ptx = ptx[:ptx.find(".section")] if ".section" in ptx else ptx
        compiled.append((self.fn.__name__, "\n".join(
            line for line in ptx.splitlines() if not _DEBUG_LINE.match(line)),
            kernel.metadata.shared))
        return kernel

    previous = driver._active   # None until a real driver was asked for (none on a CPU host)
    driver.set_active(StandInDriver(arch))
    jit.JITFunction.run = warm_up_only
    try:
        torch.manual_seed(0)
        for B, T, H, G, d_k, d_v, block, n_sel, dtype in SHAPES:
            dtype = getattr(torch, dtype)
            q = torch.randn(B, T, H, d_k, dtype=dtype)
            k = torch.randn(B, T, G, d_k, dtype=dtype)
            v = torch.randn(B, T, G, d_v, dtype=dtype)
            idx = torch.randint(0, T // block, (B, T, G, n_sel), dtype=torch.int32)
            packings = [None] + ([torch.tensor([0, T // 2, T], dtype=torch.int32)] if B == 1
                                 else [])
            for cu_seqlens in packings:
                segments = ts._segments(T, block, cu_seqlens, q.device)
                o, lse = ts._forward(q, k, v, idx, block, 0.1, segments[0])
                ts._backward(q, k, v, idx, block, 0.1, o, lse, torch.randn_like(o), segments,
                             cu_seqlens)
    finally:
        jit.JITFunction.run = real_run
        driver._active = previous
    return compiled


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", help="directory for the PTX files")
    parser.add_argument("--arch", default="sm90", choices=sorted(ARCHS),
                        help="the GPU architecture compiled for")
    parser.add_argument("--compare", default=None,
                        help="a directory written before: exit 1 unless every file is identical")
    args = parser.parse_args(argv)
    import triton

    os.makedirs(args.out, exist_ok=True)
    names, shared = [], []
    for i, (name, ptx, shared_bytes) in enumerate(compile_kernels(args.arch)):
        names.append(f"{i:02d}_{name}.ptx")
        shared.append(f"{names[-1]},{shared_bytes}")
        with open(os.path.join(args.out, names[-1]), "w") as f:
            f.write(ptx)
    with open(os.path.join(args.out, "shared.csv"), "w") as f:
        f.write("file,shared_bytes\n" + "\n".join(shared) + "\n")
    print(f"{len(names)} compilations, Triton {triton.__version__}, {args.arch} -> {args.out}")
    if args.compare is None:
        return 0
    _, differ, missing = filecmp.cmpfiles(args.out, args.compare, names, shallow=False)
    for name in differ + missing:
        print(f"differs: {name}")
    print("identical" if not differ and not missing else "NOT identical")
    return 0 if not differ and not missing else 1


if __name__ == "__main__":
    sys.exit(main())
