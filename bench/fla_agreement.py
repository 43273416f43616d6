"""Agreement of our fla-configuration core with fla-org's `parallel_nsa` on the same inputs.

The `nsa_jax_*_fla` rows of bench_prefill.py are timed against `fla_parallel_nsa` as a
like-for-like pair. This script shows that the pair computes the same function: one set of
random inputs per (S, dtype), our core (`nsa_jax.native_sparse_attention`, backend "pallas" on
a GPU, "xla" on a CPU) and fla's `parallel_nsa` (torch) on the same values, the relative L2
error of the output and of the gradients with respect to q, k, v and the gate logits, and the
share of (b, t, kv head) rows whose selected blocks agree. Two comparisons per case:
  own     each side selects its own blocks (the rows as benchmarked); near-ties, which bf16
          makes common, can flip a block, so these numbers mix the selection with the math;
  shared  fla is fed our `block_idx` through its `block_indices=` argument (it still runs its
          compressed branch): the check of the attention math and gradients, selection aside.
Relative L2 = ||ours - fla|| / ||fla||; tolerances are the spec's (docs/NSA_SPEC.md): float32
1e-5 outputs and 1e-4 gradients, bfloat16 1e-2. An "own" row is judged only where every
selection agrees.

What fla 0.6.0 computes (fla/ops/nsa/parallel.py, compression.py, utils/pooling.py), against
our core in the configuration of `fla_config` (`bench/fla_setup.py`, as bench_prefill's `*_fla`
rows):
- Compression: `mean_pooling(k, block_size)`, the mean of non-overlapping blocks of
  `block_size` tokens, taken in float32 and rounded to the input dtype; the same k and v feed
  all three branches. Ours: compress="mean", l = d = l_sel, shared_kv. (fla also pools a
  trailing partial block, which no query can attend.)
- Compressed attention: query t attends blocks c with (c + 1) * l_sel - 1 <= t; a query that
  sees none gets o_cmp = 0 (fla's lse is 0 there, ours -inf; used by nothing but forced blocks).
  Same as spec step 5.
- Selection scores: per head exp(q.k_cmp * scale - lse_cmp), i.e. the compressed-attention
  probabilities normalised with that branch's lse, summed over the h heads of the kv group.
  Ours with l = d = l_sel: p_sel = p_cmp, summed over the group (spec step 6). The same.
- Forced blocks: fla sets the per-head probability of block 0 and of blocks i_t - 1 and i_t
  (i_t = t // l_sel, the query's own block) to 1, a group score of h that no other block
  reaches (each head's probabilities sum to 1 and include block 0). Ours: n_init = 1,
  n_local = 2, score +inf. The same set; blocks after the query's own are never eligible.
- Top-k: fla sorts with a bitonic network and keeps S = next_power_of_2(block_counts) slots
  in score order, -1 where fewer blocks are eligible; exact ties go where the network puts
  them. Ours: n_sel blocks, lower index first on ties, ascending, -1 padded. The sets are equal
  but for exact ties at the cut, so the selection agreement compares sets. fla's forward runs
  all S slots when block_counts is an int, so with n_sel not a power of two it would select
  more blocks than we do: n_sel must be a power of two here (and l_sel >= 2 * n_sel, fla's
  own bound).
- Selected attention: the selected blocks' tokens <= t, blocks -1 skipped. The same.
- Sliding window: `flash_attn_func(causal=True, window_size=(w - 1, 0))`: keys t - w + 1 .. t,
  spec step 8. Without the flash_attn package fla has no window kernel; `install_window_shim`
  gives it nsa_torch_ref.fa2's (same mask; torch's own FA-2 kernel on a GPU, its reference on a
  CPU), as the `fla_parallel_nsa` row does.
- Gates: fla takes gate values (g_cmp, g_slc, g_swa, [B, T, HQ]); it is fed
  sigmoid(logits) computed in float32 and rounded to the dtype (as the bench row feeds it),
  ours gets the logits (gates_are_logits=True). fla combines in the input dtype, one rounding
  per branch (`o_slc * g_slc`, then two `addcmul`); ours sums the three products, then rounds
  once. Rounding only.
- Scale: both 1/sqrt(d_k). fla multiplies q by the scale and rounds to the input dtype before
  its dots; ours scales the float32 scores. Exact when d_k is a power of 4 (16, 64, 256); a
  bf16 rounding of q (relative 2^-9) with d_k = 128. Rounding only.
- Gradients: neither side differentiates through the selection; the compressed branch passes
  gradients through the mean pooling to k and v on both.
- Precision: Triton's float32 `tl.dot` is TF32 by default; for float32 runs this script sets
  TRITON_F32_DEFAULT=ieee (before triton is imported) and runs ours at precision "highest",
  so the float32 comparison is IEEE on both sides. On a CPU, fla's kernels run in Triton's
  interpreter (TRITON_INTERPRET=1, set here) with each autotuned kernel pinned to its first
  configuration (the interpreter has no benchmarker); the interpreter's bf16 `tl.dot` is
  wrong, so a CPU run compares float32 only (bf16 cases are recorded as skipped).
fla's constraints: h = H/G a power of two >= 16, d_k <= 256 (checked by `check_fla_shapes`).
Nothing had to be changed in the library: every difference above is configuration or rounding.

Example (GPU):  python bench/fla_agreement.py --S_list 8k,64k --dtypes bfloat16,float32
CPU (tiny):     python bench/fla_agreement.py --device cpu --S_list 64 --H 16 --G 1 --dk 16 \\
                    --dv 16 --l_sel 8 --n_sel 4 --w 16 --dtypes float32
Writes <out>/fla_agreement.csv and <out>/fla_agreement_summary.txt (the table it prints); exits
1 when a judged comparison is outside its tolerance.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import warnings
from typing import Any, Optional

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402  (sets the allocator environment before jax loads)
from bench.fla_setup import (FLA_MIN_HEADS_PER_GROUP, fla_fields,  # noqa: E402
                             install_window_shim)

COLUMNS = ["S", "dtype", "selection", "what", "rel_l2", "max_abs", "tol", "verdict",
           "selection_agreement", "block_agreement", "B", "H", "G", "dk", "dv", "l_sel", "n_sel",
           "w", "backend", "status", "note", "device", "commit"]
QUANTITIES = ("o", "dq", "dk", "dv", "dgate_logits")
SELECTIONS = ("own", "shared")
DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32"}
# The spec's tolerances (docs/NSA_SPEC.md): (output, gradients) relative L2 per dtype.
TOLERANCES = {"float32": (1e-5, 1e-4), "bfloat16": (1e-2, 1e-2)}
# Triton's interpreter (3.9) multiplies bf16 tiles wrongly (a 16x16 bf16 `tl.dot` is off by
# ~1e10): the CPU check is float32 only.
INTERPRETER_HALF_NOTE = "Triton's interpreter computes bf16 tl.dot wrongly (CPU: float32 only)"
FLA_MAX_HEAD_DIM = 256


# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------
def fla_config(args):
    """Our NSAConfig in fla-org's configuration: the NSA flags (`common.add_nsa_args`), then
    mean compression with l = d = l_sel and one k/v shared by the three branches
    (`bench.fla_setup.fla_fields`); --l, --d and --compress are overridden."""
    l_sel = args.l_sel if args.l_sel is not None else common.nsa_preset(args.preset).sel_block
    return common.nsa_config(args, **fla_fields(l_sel))


def check_fla_shapes(cfg) -> None:
    """The shapes fla's `parallel_nsa` accepts, and the ones where it selects what we select."""
    h = cfg.heads_per_group
    if h < FLA_MIN_HEADS_PER_GROUP or h & (h - 1):
        raise ValueError(f"fla's parallel_nsa needs h = H/G a power of two >= "
                         f"{FLA_MIN_HEADS_PER_GROUP} (H {cfg.n_heads}, G {cfg.n_kv_heads}: h {h})")
    if (cfg.n_init, cfg.n_local) != (1, 2):
        raise ValueError(f"fla forces the first block and two local ones: n_init ({cfg.n_init}) "
                         f"must be 1 and n_local ({cfg.n_local}) 2")
    if max(cfg.d_k, cfg.d_v) > FLA_MAX_HEAD_DIM:
        raise ValueError(f"fla's parallel_nsa needs d_k, d_v <= {FLA_MAX_HEAD_DIM} "
                         f"(d_k {cfg.d_k}, d_v {cfg.d_v})")
    if cfg.n_sel & (cfg.n_sel - 1):
        raise ValueError(f"n_sel ({cfg.n_sel}) must be a power of two: fla selects "
                         f"next_power_of_2(n_sel) blocks")
    if cfg.sel_block < 2 * cfg.n_sel:
        raise ValueError(f"l_sel ({cfg.sel_block}) must be >= 2 * n_sel ({2 * cfg.n_sel}) "
                         f"(fla's top-k bound)")


# ---------------------------------------------------------------------------------------------
# Inputs and our side (JAX)
# ---------------------------------------------------------------------------------------------
def make_inputs(cfg, B: int, S: int, dtype: str, seed: int) -> dict[str, Any]:
    """q [B, S, H, d_k], k [B, S, G, d_k], v [B, S, G, d_v], gate_logits [B, S, H, 3] and the
    output cotangent [B, S, H, d_v]: standard normal, rounded to `dtype` (JAX arrays)."""
    import jax
    import jax.numpy as jnp

    shapes = {"q": (B, S, cfg.n_heads, cfg.d_k), "k": (B, S, cfg.n_kv_heads, cfg.d_k),
              "v": (B, S, cfg.n_kv_heads, cfg.d_v), "gate_logits": (B, S, cfg.n_heads, 3),
              "cotangent": (B, S, cfg.n_heads, cfg.d_v)}
    keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
    return {name: jax.random.normal(key, shape, jnp.float32).astype(dtype)
            for key, (name, shape) in zip(keys, shapes.items())}


def run_ours(inputs: dict, cfg, backend: str, precision: Optional[str]):
    """Our core forward and backward:
    (o, {dq, dk, dv, dgate_logits}, block_idx [B, S, G, n_sel])."""
    import jax
    import nsa_jax

    def core(q, k, v, gate_logits):
        o, aux = nsa_jax.native_sparse_attention(q, k, v, gate_logits, cfg,
                                                 gates_are_logits=True, scale=cfg.scale,
                                                 backend=backend, precision=precision,
                                                 return_aux=True)
        return o, aux["block_idx"]

    @jax.jit
    def forward_backward(q, k, v, gate_logits, cotangent):
        o, pullback, block_idx = jax.vjp(core, q, k, v, gate_logits, has_aux=True)
        return o, pullback(cotangent), block_idx

    o, grads, block_idx = forward_backward(*(inputs[n] for n in
                                             ("q", "k", "v", "gate_logits", "cotangent")))
    jax.block_until_ready((o, grads, block_idx))
    return o, dict(zip(QUANTITIES[1:], grads)), block_idx


# ---------------------------------------------------------------------------------------------
# fla's side (torch)
# ---------------------------------------------------------------------------------------------
def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def pin_first_configs(module_prefix: str = "fla") -> int:
    """Every autotuned Triton kernel of the loaded `module_prefix` modules keeps only its first
    configuration: Triton's interpreter cannot benchmark the others. Returns how many."""
    from triton.runtime.autotuner import Autotuner

    pinned = 0
    for name, module in list(sys.modules.items()):
        if module is None or not (name == module_prefix or name.startswith(module_prefix + ".")):
            continue
        for value in list(vars(module).values()):
            while value is not None and not isinstance(value, Autotuner):
                value = getattr(value, "fn", None)  # through @triton.heuristics
            if isinstance(value, Autotuner) and len(value.configs) > 1:
                value.configs = value.configs[:1]
                pinned += 1
    return pinned


def import_fla(first_configs: bool = False):
    """fla's `parallel` module, ready to run here: the window shim installed and, under the
    interpreter or with `first_configs`, every autotuner pinned to its first configuration.
    Raises ImportError when fla cannot be imported."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fla warns that flash_attn is missing: the shim serves
        from fla.ops.nsa import parallel as fla_parallel
    install_window_shim(fla_parallel)
    if first_configs or interpreter_on():
        pin_first_configs()
    return fla_parallel


def run_fla(fla_parallel, inputs: dict, cfg, block_indices=None):
    """fla's `parallel_nsa` forward and backward on torch tensors:
    (o, {dq, dk, dv, dgate_logits}, the block_indices it used [B, S, G, S_slots])."""
    import torch

    leaves = [inputs[n].detach().clone().requires_grad_(True)
              for n in ("q", "k", "v", "gate_logits")]
    q, k, v, gate_logits = leaves
    gates = torch.sigmoid(gate_logits.float()).to(q.dtype)
    recorded = {}
    topk = fla_parallel.parallel_nsa_topk

    def recording_topk(*args, **kwargs):
        recorded["block_indices"] = topk(*args, **kwargs)
        return recorded["block_indices"]

    fla_parallel.parallel_nsa_topk = recording_topk
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "block_indices is provided, overriding ..."
            o = fla_parallel.parallel_nsa(q, k, v, g_cmp=gates[..., 0], g_slc=gates[..., 1],
                                          g_swa=gates[..., 2], block_indices=block_indices,
                                          block_counts=cfg.n_sel, block_size=cfg.sel_block,
                                          window_size=cfg.window, scale=cfg.scale)
    finally:
        fla_parallel.parallel_nsa_topk = topk
    grads = torch.autograd.grad(o, leaves, inputs["cotangent"])
    used = block_indices if block_indices is not None else recorded["block_indices"]
    return o.detach(), dict(zip(QUANTITIES[1:], grads)), used


# ---------------------------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------------------------
def rel_l2(ours, ref) -> tuple[float, float]:
    """(||ours - ref|| / ||ref||, max |ours - ref|), in float32 (NaN when either is not finite)."""
    import torch

    ours, ref = ours.float(), ref.float()
    if not (torch.isfinite(ours).all() and torch.isfinite(ref).all()):
        return math.nan, math.nan
    diff = ours - ref
    norm = float(torch.linalg.vector_norm(ref))
    error = float(torch.linalg.vector_norm(diff))
    return (error / norm if norm > 0 else error), float(diff.abs().max()) if diff.numel() else 0.0


def selection_agreement(ours_idx, fla_idx) -> tuple[float, float]:
    """ours_idx [B, S, G, n] and fla_idx [B, S, G, m] (-1: no block) -> (share of rows whose
    sets of blocks are equal, share of our selected blocks that fla selected too)."""
    import torch

    big = torch.iinfo(torch.int32).max
    ours = torch.where(ours_idx < 0, big, ours_idx.to(torch.int32)).sort(dim=-1).values
    fla = torch.where(fla_idx < 0, big, fla_idx.to(torch.int32)).sort(dim=-1).values
    width = max(ours.shape[-1], fla.shape[-1])
    pad = lambda x: torch.nn.functional.pad(x, (0, width - x.shape[-1]), value=big)  # noqa: E731
    ours, fla = pad(ours), pad(fla)
    rows = float((ours == fla).all(dim=-1).float().mean())
    valid = ours != big
    found = ((ours[..., :, None] == fla[..., None, :]).any(dim=-1) & valid).sum()
    blocks = float(found) / max(int(valid.sum()), 1)
    return rows, blocks


def verdict(rel: float, tol: float, judged: bool) -> str:
    if math.isnan(rel):
        return "fail (non-finite)"
    if not judged:
        return "n/a (selection differs)"
    return "pass" if rel <= tol else "fail"


def compare_case(args, cfg, fla_parallel, S: int, dtype: str) -> list[dict[str, Any]]:
    """Both comparisons ("own", "shared") of one (S, dtype): one record per quantity."""
    import torch

    from parity.convert import jax_to_torch

    device = "cuda" if args.device == "gpu" else "cpu"
    inputs = make_inputs(cfg, args.B, S, dtype, args.seed)
    precision = "highest" if dtype == "float32" else None
    o, grads, block_idx = run_ours(inputs, cfg, args.backend, precision)
    ours = {"o": jax_to_torch(o, device),
            **{n: jax_to_torch(g, device) for n, g in grads.items()}}
    ours_idx = jax_to_torch(block_idx, device)
    torch_inputs = {n: jax_to_torch(x, device) for n, x in inputs.items()}
    del inputs, o, grads, block_idx

    tol_out, tol_grad = TOLERANCES[dtype]
    records = []
    for selection in SELECTIONS:
        feed = ours_idx.to(torch.int32).contiguous() if selection == "shared" else None
        fla_o, fla_grads, fla_idx = run_fla(fla_parallel, torch_inputs, cfg, block_indices=feed)
        theirs = {"o": fla_o, **fla_grads}
        if selection == "own":
            rows, blocks = selection_agreement(ours_idx, fla_idx)
            judged = rows == 1.0
        else:
            rows = blocks = None
            judged = True
        for what in QUANTITIES:
            rel, max_abs = rel_l2(ours[what], theirs[what])
            tol = tol_out if what == "o" else tol_grad
            records.append({"S": S, "dtype": dtype, "selection": selection, "what": what,
                            "rel_l2": rel, "max_abs": max_abs, "tol": tol,
                            "verdict": verdict(rel, tol, judged),
                            "selection_agreement": rows, "block_agreement": blocks,
                            "status": common.OK})
        del fla_o, fla_grads, theirs
        if device == "cuda":
            torch.cuda.empty_cache()
    return records


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = common.script_parser(__doc__)
    p.add_argument("--S_list", default="8k,64k", help="context lengths, comma list; 'k' = 1024")
    p.add_argument("--dtypes", default="bfloat16,float32", help="comma list of bfloat16, float32")
    p.add_argument("--device", default="gpu", choices=("gpu", "cpu"))
    p.add_argument("--backend", default=None,
                   help="our backend (default: pallas on a GPU, xla on a CPU)")
    p.add_argument("--B", type=int, default=1)
    # --l_sel is also the compression block and stride (fla's block_size); --n_sel a power of two
    common.add_nsa_args(p)
    p.add_argument("--fla_configs", default="autotune", choices=("autotune", "first"),
                   help="fla's Triton kernels: autotuned as shipped, or each at its first "
                        "configuration (no autotuning time; always so under the interpreter)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="artifacts/bench", help="directory of fla_agreement.csv")
    return p


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    args.S = common.parse_int_list(args.S_list, "--S_list")
    names = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    unknown = [d for d in names if d not in DTYPES]
    if unknown or not names:
        raise ValueError(f"--dtypes ({args.dtypes!r}) must be a comma list of {sorted(DTYPES)}")
    args.dtypes = list(dict.fromkeys(DTYPES[d] for d in names))
    args.backend = args.backend or ("pallas" if args.device == "gpu" else "xla")
    if args.B <= 0:
        raise ValueError(f"--B ({args.B}) must be positive")
    args.cfg = fla_config(args)
    check_fla_shapes(args.cfg)
    return args


def setup_environment(device: str, dtypes) -> None:
    """Before jax and triton are imported: JAX's platform, Triton's interpreter on a CPU, and
    IEEE float32 dots in Triton when float32 is compared."""
    common.setup_device(device)
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    if "float32" in dtypes:
        os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")


def run(args) -> list[dict[str, Any]]:
    """Every (dtype, S) case; a case that fails becomes one record with its status."""
    cfg = args.cfg
    base = {"B": args.B, "H": cfg.n_heads, "G": cfg.n_kv_heads, "dk": cfg.d_k, "dv": cfg.d_v,
            "l_sel": cfg.sel_block, "n_sel": cfg.n_sel, "w": cfg.window,
            "backend": args.backend, "device": args.device_label, "commit": args.commit[:12]}
    try:
        fla_parallel = import_fla(first_configs=args.fla_configs == "first")
    except ImportError as exc:
        note = f"fla not importable ({exc})"
        print(note, flush=True)
        return [dict(base, S=S, dtype=dtype, status=common.SKIPPED, note=note)
                for dtype in args.dtypes for S in args.S]
    note = f"fla window: {install_window_shim(fla_parallel)}"
    if args.device == "gpu":
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("--device gpu but torch sees no CUDA device")
    records = []
    for dtype in args.dtypes:
        for S in args.S:
            if interpreter_on() and dtype != "float32":
                records.append({**base, "S": S, "dtype": dtype, "status": common.SKIPPED,
                                "note": INTERPRETER_HALF_NOTE})
                continue
            try:
                case = compare_case(args, cfg, fla_parallel, S, dtype)
            except Exception as exc:  # OOM or a kernel failure: record it, go on
                case = [{"S": S, "dtype": dtype, "status": common.classify_exception(exc),
                         "note": common.short_error(exc)}]
            records += [{**base, "note": note, **r} for r in case]
            print(f"S={S} {dtype}: done", flush=True)
    return records


def summary_table(records: list[dict]) -> str:
    header = ["S", "dtype", "selection", "what", "rel_l2", "tol", "verdict", "sel_rows",
              "sel_blocks", "status"]
    rows = [[r["S"], r["dtype"], r.get("selection", "-"), r.get("what", "-"),
             _sci(r.get("rel_l2")), _sci(r.get("tol")), r.get("verdict", "-"),
             _pct(r.get("selection_agreement")), _pct(r.get("block_agreement")),
             r["status"] if r["status"] == common.OK else f"{r['status']}: {r.get('note', '')}"]
            for r in records]
    return common.format_table(rows, header)


def _sci(value) -> str:
    return "-" if value is None else f"{value:.2e}"


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.3f}%"


def main(argv=None) -> int:
    args = parse_args(argv)
    setup_environment(args.device, args.dtypes)
    args.device_label = common.device_name(args.device)
    args.commit = common.git_commit()
    records = run(args)
    os.makedirs(args.out, exist_ok=True)
    csv_path = os.path.join(args.out, "fla_agreement.csv")
    common.write_csv(csv_path, records, COLUMNS)
    cfg = args.cfg
    title = (f"ours ({args.backend}, fla configuration) vs fla parallel_nsa: B={args.B} "
             f"H={cfg.n_heads} G={cfg.n_kv_heads} dk={cfg.d_k} dv={cfg.d_v} "
             f"l_sel={cfg.sel_block} n_sel={cfg.n_sel} w={cfg.window} on {args.device_label} "
             f"(commit {args.commit[:10]}); rel_l2 = ||ours - fla|| / ||fla||")
    text = title + "\n\n" + summary_table(records) + "\n"
    summary_path = os.path.join(args.out, "fla_agreement_summary.txt")
    with open(summary_path, "w") as f:
        f.write(text)
    print("\n" + text + f"wrote {csv_path}, {summary_path}")
    failed = [r for r in records if str(r.get("verdict", "")).startswith("fail")]
    if failed:
        print(f"{len(failed)} comparisons outside the tolerance", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
