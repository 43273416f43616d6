"""GPU sanity check of the PyTorch fast paths: a tiny prefill + decode per branch.

For each branch (cmp, sel, win) the layer runs with only that branch's fast path forced
(NSA_FA2_FORCE_DENSE for cmp / win, NSA_TRITON_SEL_FORCE for sel, through the "auto" backends)
and with the gates pinned so that only that branch reaches the output (wg = 0, bg = +30 for the
branch and -30 for the others): a wrong kernel cannot hide behind the other two branches.
Checks, in bfloat16 (relative error <= 1e-2):
  1. prefill output of the fast path == the reference ("sdpa") layer's;
  2. decode_step for the next token == the fast-path prefill over all tokens at that position;
  3. the routing actually chose the fast path (no silent fallback).
Prints `branch cmp: OK`, `branch sel: OK`, `branch win: OK` and `sanity: OK`; exits 1 otherwise.

    python scripts/gpu_sanity.py [--seq-len 384] [--device cuda]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nsa_common import NSAConfig  # noqa: E402
from nsa_common.testing import rel_err  # noqa: E402
from nsa_torch_ref import NSAAttention, decode_step, init_cache, prefill  # noqa: E402
from nsa_torch_ref.fast import routing, runtime  # noqa: E402

TOL = 1e-2
BRANCHES = {  # short name: (gate column, dispatch branch, environment that forces its path)
    "cmp": (0, "compressed_attention", {"NSA_FA2_FORCE_DENSE": "1"}),
    "sel": (1, "selected_attention", {"NSA_TRITON_SEL_FORCE": "1"}),
    "win": (2, "sliding_window_attention", {"NSA_FA2_FORCE_DENSE": "1"}),
}
CFG = NSAConfig(d_model=256, n_heads=8, n_kv_heads=2, d_k=64, d_v=64, cmp_block=32,
                cmp_stride=16, sel_block=32, n_sel=4, n_init=1, n_local=2, window=96)


def isolate(layer: NSAAttention, column: int) -> None:
    """Pin the gates: branch `column` ~1, the other two ~0, for every head."""
    with torch.no_grad():
        layer.wg.zero_()
        bias = torch.full((CFG.n_heads, 3), -30.0)
        bias[:, column] = 30.0
        layer.bg.copy_(bias.reshape(-1))


def check_branch(short: str, seq_len: int, device: str) -> list[str]:
    column, branch, forcing = BRANCHES[short]
    for toggle in runtime.TOGGLES:
        os.environ.pop(toggle.env, None)
    os.environ.update(forcing)
    problems = []
    name, reason = routing.route(branch, seq_len=seq_len, requires_grad=False, device=device,
                                 dtype=torch.bfloat16)
    if name == routing.REFERENCE:
        problems.append(f"routing kept the reference: {reason}")

    torch.manual_seed(0)
    fast = NSAAttention(CFG, backends={b: routing.AUTO for b in routing.BRANCHES},
                        device=device, dtype=torch.bfloat16)
    isolate(fast, column)
    plain = NSAAttention(CFG, device=device, dtype=torch.bfloat16)
    plain.load_state_dict(fast.state_dict())
    x = torch.randn(2, seq_len + 1, CFG.d_model, device=device, dtype=torch.bfloat16)

    with torch.no_grad():
        y_fast = fast(x)
        y_plain = plain(x)
    err = rel_err(y_fast, y_plain, nonfinite="inf")
    if not err <= TOL:
        problems.append(f"prefill fast vs reference: rel err {err:.2e} > {TOL}")

    cache = init_cache(CFG, batch=2, max_len=seq_len + 1, dtype=torch.bfloat16, device=device)
    _, cache = prefill(fast, x[:, :seq_len], cache)
    y_step = decode_step(fast, x[:, seq_len:], cache)[0]
    err = rel_err(y_step[:, 0], y_fast[:, seq_len], nonfinite="inf")
    if not err <= TOL:
        problems.append(f"decode step vs prefill at t={seq_len}: rel err {err:.2e} > {TOL}")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=384)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print("sanity: FAILED (no CUDA device)")
        return 1
    routing.register_fast_paths()
    saved = dict(os.environ)
    all_ok = True
    try:
        for short in BRANCHES:
            try:
                problems = check_branch(short, args.seq_len, args.device)
            except Exception as error:  # report every branch, not only the first failure
                problems = [f"{type(error).__name__}: {error}"]
            all_ok &= not problems
            print(f"branch {short}: {'OK' if not problems else 'FAILED'}")
            for problem in problems:
                print(f"    {problem}")
    finally:
        os.environ.clear()
        os.environ.update(saved)
    print(f"sanity: {'OK' if all_ok else 'FAILED'}")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
