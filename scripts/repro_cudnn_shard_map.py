"""Reproducer: XLA's compilation of the sharded layer's gradient segfaults on 2 GPUs
when cuDNN's fused attention runs inside the `shard_map` through jax's `custom_partitioning`
wrapper (jax 0.11.2, 2 x H100 and 2 x H200; the crash is in XLA's Shardy-to-HLO conversion,
the pass after the SPMD partitioner's simplification).

`nsa_jax.xla.cudnn` binds jax's cuDNN primitives below that wrapper inside a multi-device
`shard_map` (`cudnn.in_manual_region`, `cudnn._unpartitioned_attention`), where the arrays are
local and nothing needs partitioning; `nsa_jax.sharding.body_options` turns cuDNN off there
only where that form is not available. The script bypasses `body_options`, one case per
subprocess (a segfault ends only its case), and prints a line per case: `ok`, or the signal
that ended it.

Cases (bf16, B 2, T 2048, H 16, G 8, d 64; mesh of 2 devices unless said):
  layer_fwd         the layer's forward, data axis                     (compiles)
  layer_grad        its gradient, cuDNN bound below the wrapper         (compiles)
  layer_grad_partitioned  the same through jax's wrapper               (segfault)
  layer_grad_one    the wrapper on a mesh of one device                 (compiles)
  layer_grad_nowin  the wrapper, cuDNN only on the compressed branch    (segfault)
  layer_grad_nocmp  the wrapper, cuDNN only on the window branch        (segfault)
  layer_grad_nocudnn  neither                                           (compiles)
  layer_grad_fa3    both fused branches on FlashAttention-3 instead of cuDNN (needs
                    flash_attn3_jax)
  raw_win_grad      jax.nn.dot_product_attention(cudnn, window) alone in shard_map (compiles)

    python scripts/repro_cudnn_shard_map.py            # every case
    python scripts/repro_cudnn_shard_map.py layer_grad # one case, in this process
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = ("layer_fwd", "layer_grad", "layer_grad_partitioned", "layer_grad_one", "layer_grad_nowin",
         "layer_grad_nocmp",
         "layer_grad_nocudnn", "layer_grad_fa3", "raw_win_grad")


def run_case(case: str) -> None:
    """Compile and run one case in this process, `sharding.body_options` bypassed meanwhile."""
    sys.path.insert(0, ROOT)
    from nsa_jax import sharding
    from nsa_jax.xla import cudnn

    keep, keep_manual = sharding.body_options, cudnn.in_manual_region
    sharding.body_options = lambda options, mesh: dict(options) if options else None
    if case in ("layer_grad_one", "layer_grad_nowin", "layer_grad_nocmp", "layer_grad_partitioned"):
        cudnn.in_manual_region = lambda: False      # through jax's custom_partitioning wrapper
    try:
        _compile_and_run(case)
    finally:
        sharding.body_options, cudnn.in_manual_region = keep, keep_manual


def _compile_and_run(case: str) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P

    import nsa_jax
    from nsa_common import NSAConfig
    from nsa_jax import sharding
    from nsa_jax.xla import cudnn

    devices = jax.devices()[:1 if case.endswith("_one") else 2]
    mesh = Mesh(np.array(devices), ("data",))
    if case.startswith("raw"):
        q = jax.random.normal(jax.random.PRNGKey(0), (2, 2048, 16, 64), jnp.bfloat16)
        attend = sharding.shard_map(
            lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, implementation="cudnn", is_causal=True, local_window_size=(255, 0)),
            mesh, in_specs=(P("data"),) * 3, out_specs=P("data"))
        fn = jax.grad(lambda q: jnp.sum(attend(q, q, q).astype(jnp.float32)))
        args = (q,)
    else:
        cfg = NSAConfig(d_model=512, n_heads=16, n_kv_heads=8, d_k=64, d_v=64, cmp_block=32,
                        cmp_stride=16, sel_block=64, n_sel=8, window=256)
        params = nsa_jax.init_params(jax.random.PRNGKey(0), cfg, jnp.bfloat16)
        x = jax.random.normal(jax.random.PRNGKey(1), (2, 2048, cfg.d_model), jnp.bfloat16)
        fa3 = case.endswith("fa3")
        q = jnp.zeros((1, 8, cfg.n_heads, cfg.d_k), jnp.bfloat16)   # the branches' shapes
        if fa3 and not cudnn.fa3_takes(q, q, q):
            raise RuntimeError("layer_grad_fa3 needs flash_attn3_jax on a Hopper GPU")
        options = {"xla": nsa_jax.XlaOptions(
            window_cudnn=not case.endswith(("nowin", "nocudnn")),
            compressed_cudnn=not case.endswith(("nocmp", "nocudnn")),
            fa3=fa3, cudnn_kernel=not fa3)}

        def layer(params, x):
            return sharding.sharded_nsa_attention(params, x, cfg, mesh,
                                                  axes=sharding.MeshAxes("data", None, None),
                                                  options=options)

        fn = layer if case == "layer_fwd" else jax.grad(
            lambda p, x: jnp.sum(layer(p, x).astype(jnp.float32)), argnums=(0, 1))
        args = (params, x)
    start = time.perf_counter()
    jax.block_until_ready(jax.jit(fn)(*args))
    print(f"{case}: ok ({time.perf_counter() - start:.1f} s)", flush=True)


def main(argv: list[str]) -> int:
    if argv:
        if argv[0] not in CASES:
            raise ValueError(f"case ({argv[0]!r}) must be one of {list(CASES)}")
        run_case(argv[0])
        return 0
    for case in CASES:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), case],
                              capture_output=True, text=True)
        if proc.returncode == 0:
            print(proc.stdout.strip().splitlines()[-1], flush=True)
        else:
            errors = [line for line in proc.stderr.splitlines() if "Error" in line]
            why = (f"signal {-proc.returncode}" if proc.returncode < 0
                   else f"exit {proc.returncode}: {(errors or ['?'])[-1][:200]}")
            print(f"{case}: FAILED ({why})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
