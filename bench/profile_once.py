"""One call of a kernel under test, compiled and warmed up first, between cudaProfilerStart and
cudaProfilerStop, for Nsight Compute's counters (`ncu --profile-from-start off`).

what:
  selected   the selected-attention branch's forward and backward: the inputs and call of
             breakdown_prefill.py's `selected` stage (the --workload's blocks; random: the
             core's own selection of random inputs), with --tiles: the architecture's
             (default), one query a program (per_token), or tiles of 4 stacked on every tile
  fa3        FlashAttention-3's causal forward and backward on the same q / k / v shapes
  decode     a jitted loop of two decode steps (`bench_decode.decode_loop`) at S, batch --B

Nsight Compute attaches to JAX's kernels only when JAX does not preallocate device memory, and
command buffers (CUDA graphs) hide kernels from it; with these settings it profiled the selected
kernels, FA-3 and the decode loop on an H200 (jax 0.11.2):

  XLA_PYTHON_CLIENT_PREALLOCATE=false \\
  XLA_FLAGS="--xla_gpu_enable_command_buffer= --xla_gpu_autotune_level=0" \\
  ncu --profile-from-start off --clock-control none --csv --section SpeedOfLight \\
      --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section Occupancy \\
      --section WarpStateStats python bench/profile_once.py selected --S 8k --workload trained_fit

(FA-3's kernels are named `device_kernel`, ours `nsa_*`.) On a CPU it runs the same calls
without the profiler (a smoke test: `--device cpu` with small shapes).
"""
from __future__ import annotations

import ctypes
import functools
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common, workloads  # noqa: E402

WHAT = ("selected", "fa3", "decode")
TILES = ("default", "per_token", "stacked")


def build_parser():
    p = common.script_parser(__doc__)
    p.add_argument("what", choices=WHAT)
    p.add_argument("--S", default="8k", help="tokens ('k' = 1024)")
    p.add_argument("--B", type=int, default=1, help="batch size")
    p.add_argument("--tiles", default="default", choices=TILES,
                   help="selected: the kernel's tiles")
    common.add_run_args(p)
    common.add_nsa_args(p)
    workloads.add_workload_args(p)
    return p


def parse_args(argv=None):
    args = common.finish_args(build_parser().parse_args(argv))
    workloads.check_workload_args(args)
    (args.S,) = common.parse_int_list(args.S, "--S")
    if args.B < 1:
        raise ValueError(f"--B ({args.B}) must be >= 1")
    if args.tiles != "default" and args.what != "selected":
        raise ValueError(f"--tiles ({args.tiles}) applies to 'selected' only")
    return args


# --tiles -> the selected kernel's BlockSizes fields (`breakdown_prefill.pallas_options`).
TILE_FIELDS = {
    "default": {},
    "per_token": {"selected": {}},
    "stacked": {"selected": dict(tokens_fwd=4, tokens_dq=4, stack_tokens=True, num_warps_fwd=4,
                                 num_warps_dq=4)},
}


def prefill_call(args):
    """(jitted call, its arguments) of 'selected' or 'fa3': forward and backward in one. The
    selected branch takes the inputs and the call of breakdown_prefill.py's `selected` stage."""
    import jax

    from bench import breakdown_prefill

    cfg, B, S = args.cfg, args.B, args.S
    dtype = common.jnp_dtype(args.dtype)
    do = jax.random.normal(jax.random.PRNGKey(1), (B, S, cfg.n_heads, cfg.d_v), dtype)
    if args.what == "fa3":
        try:
            from flash_attn3_jax import flash_mha
        except ImportError as exc:
            raise common.Skip(f"flash_attn3_jax not importable ({exc})") from None
        keys = jax.random.split(jax.random.PRNGKey(0), 3)
        inputs = (jax.random.normal(keys[0], (B, S, cfg.n_heads, cfg.d_k), dtype),
                  jax.random.normal(keys[1], (B, S, cfg.n_kv_heads, cfg.d_k), dtype),
                  jax.random.normal(keys[2], (B, S, cfg.n_kv_heads, cfg.d_v), dtype))
        attend = functools.partial(flash_mha, is_causal=True)
    else:
        options = breakdown_prefill.pallas_options(TILE_FIELDS[args.tiles])
        forced = workloads.prefill_block_idx(args, cfg, B, S)
        prepared = breakdown_prefill.prepare(cfg, args, S, 0, options, forced)
        fn, pick, _ = breakdown_prefill.stage_functions(cfg, options)["selected"]
        q, k, v, block_idx = pick(prepared)
        inputs = (q, k, v)
        attend = lambda q, k, v: fn(q, k, v, block_idx)  # noqa: E731
    call = jax.jit(lambda q, k, v, do: jax.vjp(attend, q, k, v)[1](do))
    return call, (*inputs, do)


def decode_call(args):
    """(jitted two-step decode loop, its arguments) at S, batch B."""
    import nsa_jax
    from bench import bench_decode

    argv = ["--B", str(args.B), "--S_list", str(args.S), "--rotate", "1", "--loop_steps", "2",
            "--latest_csv", "", "--no_progress", "--device", args.device, "--dtype", args.dtype]
    dargs = bench_decode.parse_args(argv)
    dargs.cfg = args.cfg
    params, xs, fresh_cache = bench_decode.nsa_setup(dargs, args.B, args.S)
    options = bench_decode.decode_options(dargs, xs[0].dtype)
    step = functools.partial(nsa_jax.decode_step, backend=dargs.backend, options=options)
    loop, stacked = bench_decode.decode_loop(step, args.cfg, xs, 2)
    state = {"cache": fresh_cache()}

    def call(params, stacked):  # the cache is donated: carry it across calls
        ys, state["cache"], _ = loop(params, stacked, state["cache"])
        return ys

    return call, (params, stacked)


class CudaProfiler:
    """cudaProfilerStart / Stop through the CUDA runtime; a no-op off a GPU."""

    def __init__(self, on: bool):
        self.lib = None
        if on:
            for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12"):
                try:
                    self.lib = ctypes.CDLL(name)
                    break
                except OSError:
                    continue
            if self.lib is None:
                raise RuntimeError("the CUDA runtime (libcudart) is not loadable here: "
                                   "cudaProfilerStart cannot mark the profiled call")

    def __enter__(self):
        if self.lib is not None:
            self.lib.cudaProfilerStart()

    def __exit__(self, *exc):
        if self.lib is not None:
            self.lib.cudaProfilerStop()


def main(argv=None) -> int:
    _, args = common.start(parse_args, argv)
    import jax

    try:
        call, inputs = decode_call(args) if args.what == "decode" else prefill_call(args)
    except common.Skip as why:
        print(f"skipped: {why}", flush=True)
        return 0
    for _ in range(2):  # compile, then one warm call
        jax.block_until_ready(call(*inputs))
    with CudaProfiler(args.device == "gpu"):
        jax.block_until_ready(call(*inputs))
    print(f"profiled one call of {args.what} (S {args.S}, B {args.B}, tiles {args.tiles}, "
          f"workload {args.workload}) on {args.device_label}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
