"""PyTorch fast paths against the reference, per branch: the measurement behind the sm90 thresholds.

For each branch and each T of `--T_list`, the kernel-level function of two `dispatch` backends is
timed on the same random inputs, forward (no autograd) and forward+backward (`autograd.grad` of
the output with a fixed random cotangent, gradients of q, k, v):

  branch  reference  fast path  config key of the threshold
  sel     "sdpa"     "triton"   sel_triton_min_l   (selected_attention, random valid block_idx
                                                    with the forced first and local blocks)
  win     "sdpa"     "fa2"      fa2_min_len_win    (sliding_window_attention, window --w)
  cmp     "sdpa"     "fa2"      fa2_min_len_cmp    (compressed_attention on num_cmp_blocks(T)
                                                    random k_cmp / v_cmp)

The backends are called through `dispatch.resolve(branch, name)`, which never looks at the
thresholds or use flags (only backend "auto" does, through `routing.route`), so the named path
runs at every T. The one fallback left is inside "fa2": a call no FlashAttention kernel can take
runs the reference. A probe wraps fa2's kernel calls for the first call of each (branch, T) and
writes the kernel that really ran to the `kernel` column ("torch sdpa[flash]", "torch
varlen_attn", "flash_attn", ...); a call that ended in the reference makes the fa2 rows
"skipped" with the reason, so a reference timing is never reported as the fast path's. On CPU
the FA-2 rows are skipped for that reason (no CUDA) and Triton runs in its interpreter.

Correctness: once per (branch, T), on the first input set, each path runs one forward and one
forward+backward (untimed: this is also where Triton compiles), and its output and gradients are
compared with the reference path run on the same inputs in float32 (relative L2: `rel_err`, and
`rel_err_grad`, the worst of dq, dk, dv). The tolerance is stated against float32, and two bf16
results differ by about twice the rounding of one; the reference's own bf16 error is in its rows.

Timing (`bench/common.time_torch`: CUDA events around every call, the median): `--warmup` calls,
the last one also timed on the host to size the cell (the correctness call with `--warmup 0`):
at most `--iters` x `--repeats` timed calls, fewer when they would take longer than
`--cell_budget_s`. A path whose warm call took longer than `--max_call_s` keeps that one call as
its figure and is skipped at larger T; an OOM likewise ends the path's pass for larger T. A
failing cell is recorded (error / oom / skipped) and the run goes on.

Threshold rule (`recommend_thresholds`): per branch, the smallest T of the list from which the fast
path is at least as fast as the reference in both passes at that T and at every larger T
measured, and correct there (rel_err and rel_err_grad <= the dtype's tolerance, 1e-2 for bf16);
null if there is none. A T where neither path ran is ignored; a T where only the fast path ran
(the reference out of memory or too slow) counts for the fast path. Thresholds only fall on
points of the list: the crossover lies between the recommended T and the one before it.

Writes to --out: torch_paths.csv, torch_paths.png, torch_paths_summary.txt,
torch_paths_thresholds.json, torch_paths_env.json. Prints the summary table, then the
recommendation.

Example (GPU): python bench/bench_torch_paths.py --out artifacts/bench
CPU smoke:     python bench/bench_torch_paths.py --device cpu --T_list 8,16 --H 2 --G 1 --dk 16 \
                   --dv 16 --l 8 --d 4 --l_sel 16 --n_sel 3 --w 16 --iters 1 --repeats 1 \
                   --warmup 0 --rotate 1
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from typing import Any, Callable, Iterator, Optional

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402
from bench.common import OK, OOM, SKIPPED, TIMEOUT, Skip  # noqa: E402
from nsa_common.testing import random_block_idx, rel_err  # noqa: E402

COLUMNS = ["bench", "branch", "path", "kernel", "pass", "T", "B", "H", "G", "dk", "dv", "l", "d",
           "l_sel", "n_sel", "w", "dtype", "status", "ms", "ms_min", "ms_max", "samples",
           "rel_err", "rel_err_grad", "speedup", "note", "device"]
BRANCHES = ("sel", "win", "cmp")
BRANCH_FUNCTIONS = {"sel": "selected_attention", "win": "sliding_window_attention",
                    "cmp": "compressed_attention"}
REFERENCE_PATH = "sdpa"
FAST_PATHS = {"sel": "triton", "win": "fa2", "cmp": "fa2"}
THRESHOLD_KEYS = {"sel": "sel_triton_min_l", "win": "fa2_min_len_win", "cmp": "fa2_min_len_cmp"}
PASSES = ("fwd", "fwd_bwd")
# fa2's kernel calls, by module attribute, and the label each gets in the `kernel` column.
FA2_KERNEL_CALLS = {"_flash_attn_dense": "flash_attn", "_flash_attn_varlen": "flash_attn varlen",
                    "_torch_sdpa_flash": "torch sdpa[flash]",
                    "_torch_varlen_call": "torch varlen_attn",
                    "_window_reference": "reference", "_compressed_reference": "reference"}
SLOWER_THAN = "skipped: slower than"  # note prefix of the cells a slow path no longer runs


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Problem:
    """One call's inputs: `fn(*tensors, *extra)`; gradients flow to `tensors` (q, k, v or q,
    k_cmp, v_cmp); `cotangent` [B, T, H, d_v] is the output's."""

    tensors: tuple
    extra: tuple
    cotangent: Any


def make_problem(args, cfg, branch: str, T: int, seed: int) -> Problem:
    from nsa_common import num_cmp_blocks

    torch, device, dtype = common.torch_device(args)
    gen = torch.Generator(device=device).manual_seed(seed)

    def normal(shape, grad=True):
        x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
        return x.requires_grad_(grad)

    B, H, G = args.B, cfg.n_heads, cfg.n_kv_heads
    q = normal((B, T, H, cfg.d_k))
    kv_len = num_cmp_blocks(cfg, T) if branch == "cmp" else T
    k, v = normal((B, kv_len, G, cfg.d_k)), normal((B, kv_len, G, cfg.d_v))
    if branch == "sel":
        block_idx = random_block_idx(seed, B, T, G, cfg.n_sel, cfg.sel_block, n_init=cfg.n_init,
                                     n_local=cfg.n_local, fill=True)
        extra = (torch.from_numpy(block_idx).to(device), cfg.sel_block)
    elif branch == "win":
        extra = (cfg.window,)
    else:
        extra = (cfg,)
    return Problem((q, k, v), extra, normal((B, T, H, cfg.d_v), grad=False))


# ---------------------------------------------------------------------------------------------
# Paths and the kernel that ran
# ---------------------------------------------------------------------------------------------
def enable_triton_interpreter() -> Optional[str]:
    """Set TRITON_INTERPRET=1 (CPU runs). Returns why the interpreter cannot work in this process,
    or None.

    Triton builds its kernels, and the `@jit` functions of `triton.language`, for the interpreter
    only when the variable is set as they are defined: it has to come before the first import of
    triton, which torch may also do (its checkpointing code imports triton when first used).
    """
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    os.environ["TRITON_INTERPRET"] = "1"
    if "triton" in sys.modules:
        return "triton was imported before TRITON_INTERPRET=1 was set in this process"
    return None


def load_triton(device: str, interpreter_problem: Optional[str]) -> str:
    """Import the Triton selection kernels; returns the kernel label. Skip when they cannot run:
    on CPU only Triton's interpreter can (see `enable_triton_interpreter`)."""
    if device == "cpu" and interpreter_problem:
        raise Skip(f"Triton's interpreter is unusable: {interpreter_problem}")
    try:
        from nsa_torch_ref.fast import triton_selection
    except ImportError as exc:
        raise Skip(f"triton not importable ({exc})") from None
    if device == "cpu" and not triton_selection._interpreted():
        raise Skip("nsa_torch_ref.fast.triton_selection was imported before TRITON_INTERPRET=1 was "
                   "set: its kernels need CUDA")
    return "triton (interpreter)" if triton_selection._interpreted() else "triton"


@contextlib.contextmanager
def fa2_kernels_run() -> Iterator[list[str]]:
    """Within the block, the labels of fa2's kernel calls that returned a result, in call order.

    The calls are looked up as module globals at call time, so wrapping the attributes for the
    block sees every one; they are restored on exit. These are fa2's private functions (it says
    nothing public about the kernel that served a call): a renamed one is an error here, never a
    probe that silently sees nothing.
    """
    from nsa_torch_ref.fast import fa2

    missing = [name for name in FA2_KERNEL_CALLS if not hasattr(fa2, name)]
    if missing:
        raise RuntimeError(f"nsa_torch_ref.fast.fa2 has no {missing}: update FA2_KERNEL_CALLS")
    ran: list[str] = []
    originals = {}
    for name, label in FA2_KERNEL_CALLS.items():
        original = originals[name] = getattr(fa2, name)

        def spy(*call_args, _original=original, _label=label, **call_kwargs):
            out = _original(*call_args, **call_kwargs)
            if out is not None:
                ran.append(_label)
            return out

        setattr(fa2, name, spy)
    try:
        yield ran
    finally:
        for name, original in originals.items():
            setattr(fa2, name, original)


def _fa2_precheck(problem: Problem, args) -> None:
    """Skip before running when fa2's kernel choice already says "reference" (CPU, float32)."""
    from nsa_torch_ref.fast import fa2

    kernel, reason = fa2.kernel_choice(problem.tensors[0], max(args.cfg.d_k, args.cfg.d_v))
    if kernel == "reference":
        raise Skip(f"fa2 would run the reference: {reason}")


def _fa2_fallback_reason(problem: Problem, args) -> str:
    from nsa_torch_ref.fast import fa2

    kernel, reason = fa2.kernel_choice(problem.tensors[0], max(args.cfg.d_k, args.cfg.d_v))
    if kernel == "reference":
        return reason
    return f"the {kernel} kernel refused the call ({json.dumps(fa2.versions())})"


def path_function(branch: str, path: str) -> Callable:
    from nsa_torch_ref import dispatch

    return dispatch.resolve(BRANCH_FUNCTIONS[branch], path)


# ---------------------------------------------------------------------------------------------
# Correctness and timing
# ---------------------------------------------------------------------------------------------
def _forward(fn: Callable, problem: Problem):
    import torch

    with torch.no_grad():
        return fn(*problem.tensors, *problem.extra)


def _forward_backward(fn: Callable, problem: Problem):
    import torch

    out = fn(*problem.tensors, *problem.extra)
    return torch.autograd.grad(out, problem.tensors, problem.cotangent)


def _release(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


class _Failure(Exception):
    """A cell's recorded failure: status and note."""

    def __init__(self, status: str, note: str):
        super().__init__(note)
        self.status, self.note = status, note


def _failure(exc: BaseException) -> _Failure:
    if isinstance(exc, Skip):
        return _Failure(SKIPPED, f"skipped: {exc}")
    return _Failure(common.classify_exception(exc), common.short_error(exc))


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _host_timed(call: Callable[[], Any], device: str) -> tuple[Any, float]:
    """(call(), its wall seconds with the device synchronised on both sides)."""
    _sync(device)
    start = time.perf_counter()
    out = call()
    _sync(device)
    return out, time.perf_counter() - start


def time_cell(step: Callable[[int], Any], args, device: str,
              first_call_s: float) -> tuple[common.Timing, int, str]:
    """Warm up, size the cell, time it. Returns (timing, timed calls, note).

    The cell's size comes from the last warm call, or from `first_call_s` (the correctness
    call's seconds) with `--warmup 0`: at most iters x repeats calls, fewer when they would
    exceed `--cell_budget_s`. A call slower than `--max_call_s` is the cell's only sample.
    """
    call_s = first_call_s
    for i in range(args.warmup):
        _, call_s = _host_timed(lambda i=i: step(i), device)
    if call_s > args.max_call_s:
        ms = call_s * 1e3
        return (common.Timing(ms=ms, ms_min=ms, ms_max=ms, samples=1), 1,
                f"one call timed on the host (> --max_call_s {args.max_call_s:g} s)")
    iters = max(1, min(args.iters, int(args.cell_budget_s / max(call_s * args.repeats, 1e-9))))
    timing = common.time_torch(step, iters=iters, warmup=0, repeats=args.repeats, device=device)
    note = (f"{iters} iters x {args.repeats} repeats (--cell_budget_s {args.cell_budget_s:g})"
            if iters < args.iters else "")
    return timing, iters * args.repeats, note


def _float32_reference(args, fns, outputs, grads, problem: Problem, device: str):
    """({"out", "grads"} of the reference path in float32, note). The fast path is checked
    against it: the tolerance is stated against a float32 reference, and two bf16 results differ
    by about twice the rounding of one. In a float32 run it is the reference's own check call;
    when the float32 call fails, the reference at the run's dtype stands in (said in the note)."""
    exact = {}
    if REFERENCE_PATH in outputs:
        exact["out"] = outputs[REFERENCE_PATH]
    if REFERENCE_PATH in grads:
        exact["grads"] = grads[REFERENCE_PATH]
    if args.dtype == "float32" or not exact:
        return exact, ""
    upcast = Problem(tuple(x.detach().float().requires_grad_() for x in problem.tensors),
                     problem.extra, problem.cotangent.float())
    try:
        exact["out"] = _forward(fns[REFERENCE_PATH], upcast)
        if "grads" in exact:
            exact["grads"] = _forward_backward(fns[REFERENCE_PATH], upcast)
    except Exception as exc:
        _release(device)
        return exact, (f"checked against {REFERENCE_PATH} in {args.dtype} (float32 call failed: "
                       f"{common.short_error(exc, 80)})")
    return exact, ""


def _errors(path: str, outputs, grads, exact) -> dict[str, Optional[float]]:
    """rel_err (output) and rel_err_grad (worst of the inputs' gradients) of `path` against the
    float32 reference; none for the reference itself in a float32 run."""
    errors: dict[str, Optional[float]] = {"rel_err": None, "rel_err_grad": None}
    if path in outputs and "out" in exact and outputs[path] is not exact["out"]:
        errors["rel_err"] = rel_err(outputs[path], exact["out"], nonfinite="nan")
    if path in grads and "grads" in exact and grads[path] is not exact["grads"]:
        errors["rel_err_grad"] = max(rel_err(a, e, nonfinite="nan")
                                     for a, e in zip(grads[path], exact["grads"]))
    return errors


def _shape(args) -> dict[str, int]:
    """The B and NSA columns of every record (and of the thresholds JSON's "shape")."""
    cfg = args.cfg
    return {"B": args.B, "H": cfg.n_heads, "G": cfg.n_kv_heads, "dk": cfg.d_k, "dv": cfg.d_v,
            "l": cfg.cmp_block, "d": cfg.cmp_stride, "l_sel": cfg.sel_block, "n_sel": cfg.n_sel,
            "w": cfg.window}


def _base_record(args, branch: str, path: str, T: int, pass_name: str) -> dict[str, Any]:
    return {"bench": "torch_paths", "branch": branch, "path": path, "pass": pass_name, "T": T,
            **_shape(args), "dtype": args.dtype, "device": args.device_label}


def run_point(args, cfg, branch: str, T: int, stopped: dict) -> list[dict[str, Any]]:
    """The four records (reference and fast path, fwd and fwd_bwd) of one branch at one T.

    stopped: {(path, pass): (status, note)} of cells that no longer run at larger T; updated.
    """
    paths = (REFERENCE_PATH, FAST_PATHS[branch])
    try:
        _, device, _ = common.torch_device(args)
        problems = [make_problem(args, cfg, branch, T, seed=1000 * T + i)
                    for i in range(args.rotate)]
    except Exception as exc:
        failure = _failure(exc)
        return [dict(_base_record(args, branch, path, T, p), status=failure.status,
                     note=failure.note) for path in paths for p in PASSES]

    kernels: dict[str, str] = {REFERENCE_PATH: "reference"}
    fns: dict[str, Callable] = {}
    failures: dict[tuple[str, str], _Failure] = {}
    outputs: dict[str, Any] = {}
    grads: dict[str, Any] = {}
    # One forward and one forward+backward per path on problems[0]: correctness, the kernel that
    # ran, the compilation / first-call costs kept out of the timing, and the size of the cells.
    first_call_s: dict[tuple[str, str], float] = {}
    for path in paths:
        if all((path, p) in stopped for p in PASSES):
            continue
        try:
            fns[path] = path_function(branch, path)
            forward = lambda fn=fns[path]: _forward(fn, problems[0])  # noqa: E731
            if path == "triton":
                kernels[path] = load_triton(args.device, args.interpreter_problem)
            if path == "fa2":
                _fa2_precheck(problems[0], args)
                with fa2_kernels_run() as ran:
                    outputs[path], first_call_s[(path, "fwd")] = _host_timed(forward, device)
                kernels[path] = " + ".join(dict.fromkeys(ran)) or "unknown"
                if "reference" in ran:
                    raise Skip(f"fa2 ran the reference: {_fa2_fallback_reason(problems[0], args)}")
            else:
                outputs[path], first_call_s[(path, "fwd")] = _host_timed(forward, device)
        except Exception as exc:
            outputs.pop(path, None)
            failures[(path, "fwd")] = failures[(path, "fwd_bwd")] = _failure(exc)
            _release(device)
            continue
        if (path, "fwd_bwd") in stopped:
            continue
        try:
            grads[path], first_call_s[(path, "fwd_bwd")] = _host_timed(
                lambda fn=fns[path]: _forward_backward(fn, problems[0]), device)
        except Exception as exc:
            failures[(path, "fwd_bwd")] = _failure(exc)
            _release(device)

    exact, exact_note = _float32_reference(args, fns, outputs, grads, problems[0], device)
    errors = {path: _errors(path, outputs, grads, exact) for path in paths}
    outputs.clear()  # free the check's tensors before timing
    grads.clear()
    exact.clear()

    records = []
    for path in paths:
        for pass_name in PASSES:
            record = _base_record(args, branch, path, T, pass_name)
            record["kernel"] = kernels.get(path)
            record.update(errors[path])
            if path == FAST_PATHS[branch] and exact_note:
                record["note"] = exact_note
            try:
                if (path, pass_name) in stopped:
                    raise _Failure(*stopped[(path, pass_name)])
                if (path, pass_name) in failures:
                    raise failures[(path, pass_name)]
                fn = fns[path]
                run = _forward if pass_name == "fwd" else _forward_backward
                timing, samples, note = time_cell(
                    lambda i, fn=fn, run=run: run(fn, problems[i % len(problems)]), args, device,
                    first_call_s[(path, pass_name)])
                record.update(status=OK, ms=timing.ms, ms_min=timing.ms_min,
                              ms_max=timing.ms_max, samples=samples,
                              note="; ".join(n for n in (record.get("note"), note) if n))
                if timing.ms > args.max_call_s * 1e3:
                    stopped[(path, pass_name)] = (
                        SKIPPED, f"{SLOWER_THAN} {args.max_call_s:g} s per call at T={T}")
            except _Failure as failure:
                record.update(status=failure.status, note=failure.note)
            except Exception as exc:
                failure = _failure(exc)
                record.update(status=failure.status, note=failure.note)
                _release(device)
            if record["status"] == OOM and (path, pass_name) not in stopped:
                stopped[(path, pass_name)] = (OOM, f"not run: oom at T={T}")
            records.append(record)
    _release(device)
    return records


def add_speedups(records: list[dict]) -> None:
    """speedup = reference ms / fast-path ms, on the fast path's ok records."""
    reference = {(r["branch"], r["T"], r["pass"]): r for r in records
                 if r["path"] == REFERENCE_PATH and r.get("status") == OK}
    for record in records:
        ref = reference.get((record["branch"], record["T"], record["pass"]))
        if record["path"] != REFERENCE_PATH and record.get("status") == OK and ref:
            record["speedup"] = ref["ms"] / record["ms"]


# ---------------------------------------------------------------------------------------------
# Threshold recommendation
# ---------------------------------------------------------------------------------------------
def _number(value: Any) -> Optional[float]:
    """A record's number (a CSV string or a float; NaN stays NaN), None when empty."""
    if value is None or value == "":
        return None
    return float(value)


def describe(record: Optional[dict]) -> str:
    """`status: note` of a record that did not run ("skipped: ..." notes already say it)."""
    if record is None:
        return "no record"
    status, note = record.get("status") or "?", record.get("note") or ""
    return note if note.startswith(status) else f"{status}: {note}"


def _pass_verdict(fast: Optional[dict], ref: Optional[dict]) -> str:
    """win / lose / none for one pass: "none" when neither path ran, or only the fast path ran
    because the reference hit an error (no comparison); a reference out of memory or skipped as
    too slow counts as a win for a fast path that ran."""
    fast_ok = fast is not None and fast.get("status") == OK
    ref_ok = ref is not None and ref.get("status") == OK
    if fast_ok and ref_ok:
        return "win" if _number(fast["ms"]) <= _number(ref["ms"]) else "lose"
    if fast_ok:
        cannot_run = ref is not None and ref.get("status") in (OOM, SKIPPED, TIMEOUT)
        return "win" if cannot_run else "none"
    return "lose" if ref_ok else "none"


def point_verdict(records: list[dict], branch: str, T: int,
                  tolerance: float) -> tuple[str, str]:
    """(win | lose | none, why) of the fast path of `branch` at T, both passes together."""
    fast_path = FAST_PATHS[branch]
    found = {(r["path"], r["pass"]): r for r in records
             if r["branch"] == branch and int(r["T"]) == T}
    fast = {p: found.get((fast_path, p)) for p in PASSES}
    ref = {p: found.get((REFERENCE_PATH, p)) for p in PASSES}
    verdicts = {p: _pass_verdict(fast[p], ref[p]) for p in PASSES}
    # Correctness of each pass that ran: its output (fwd) or gradients (fwd_bwd) against the
    # reference's; unchecked only where the reference could not run.
    for p, key in (("fwd", "rel_err"), ("fwd_bwd", "rel_err_grad")):
        if fast[p] is None or fast[p].get("status") != OK:
            continue
        value = _number(fast[p].get(key))
        if value is None:
            if ref[p] is not None and ref[p].get("status") == OK:
                return "lose", f"T={T}: {fast_path} {p} not checked against {REFERENCE_PATH}"
        elif not value <= tolerance:  # NaN too
            return "lose", f"T={T}: {fast_path} wrong, {key} {value:.3g} > {tolerance:g}"
    if "lose" in verdicts.values():
        lost = [p for p in PASSES if verdicts[p] == "lose"]
        parts = []
        for p in lost:
            if fast[p] is not None and fast[p].get("status") == OK:
                speedup = _number(ref[p]["ms"]) / _number(fast[p]["ms"])
                parts.append(f"{p} speed-up {speedup:.2f}x")
            else:
                parts.append(f"{p} {describe(fast[p])}")
        return "lose", f"T={T}: {fast_path} " + "; ".join(parts)
    if "win" in verdicts.values():
        return "win", f"T={T}: {fast_path} at least as fast in " + ", ".join(
            p for p in PASSES if verdicts[p] == "win")
    return "none", f"T={T}: neither path ran"


def recommend_thresholds(records: list[dict], tolerance: float) -> dict[str, dict[str, Any]]:
    """Per branch in the records: {"key", "value", "reason", "verdicts"}.

    value: the smallest T whose verdict is "win" with no "lose" at any larger T ("none" points,
    where neither path ran, are ignored); None when the largest decided T is a loss.
    """
    result = {}
    for branch in BRANCHES:
        Ts = sorted({int(r["T"]) for r in records if r["branch"] == branch})
        if not Ts:
            continue
        verdicts = {T: point_verdict(records, branch, T, tolerance) for T in Ts}
        value, blocker = None, None
        for T in reversed(Ts):
            verdict, why = verdicts[T]
            if verdict == "lose":
                blocker = why
                break
            if verdict == "win":
                value = T
        fast_path = FAST_PATHS[branch]
        if value is not None:
            reason = (f"{fast_path} at least as fast as {REFERENCE_PATH} (fwd and fwd_bwd) and "
                      f"correct from T={value} on")
            if blocker:
                reason += f"; below: {blocker}"
        elif blocker:
            reason = f"no T from which it wins; {blocker}"
        else:
            reason = "no T where either path ran"
        result[branch] = {"key": THRESHOLD_KEYS[branch], "value": value, "reason": reason,
                          "verdicts": {str(T): verdicts[T][0] for T in Ts}}
    return result


def format_thresholds(thresholds: dict[str, dict[str, Any]], tolerance: float) -> str:
    lines = [f"recommended thresholds (fast path at least as fast as {REFERENCE_PATH} in fwd and "
             f"fwd_bwd from T on, rel_err <= {tolerance:g}):"]
    for branch, item in thresholds.items():
        value = "null" if item["value"] is None else item["value"]
        lines.append(f"  {item['key']}: {value}    # {branch}: {item['reason']}")
    if any(item["value"] is None for item in thresholds.values()):
        lines.append("  (null: no T of the list from which the fast path wins; keep the path off "
                     "or set a threshold above the largest T measured)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Summary, plot
# ---------------------------------------------------------------------------------------------
def summary_table(records: list[dict], thresholds: dict[str, dict[str, Any]]) -> str:
    by_key: dict[tuple, dict] = {}
    for r in records:
        by_key.setdefault((r["branch"], int(r["T"])), {})[(r["path"], r["pass"])] = r
    rows = []
    for (branch, T), found in sorted(by_key.items(),
                                     key=lambda kv: (BRANCHES.index(kv[0][0]), kv[0][1])):
        fast_path = FAST_PATHS[branch]

        def ms(path, p):
            r = found.get((path, p), {})
            return _number(r.get("ms")) if r.get("status") == OK else None

        def speedup(p):
            return _number(found.get((fast_path, p), {}).get("speedup"))

        fast_fwd = found.get((fast_path, "fwd"), {})
        statuses = {r.get("status") for r in found.values()}
        rows.append([branch, T, fast_path, fast_fwd.get("kernel") or "-",
                     ms(REFERENCE_PATH, "fwd"), ms(fast_path, "fwd"), speedup("fwd"),
                     ms(REFERENCE_PATH, "fwd_bwd"), ms(fast_path, "fwd_bwd"), speedup("fwd_bwd"),
                     _number(fast_fwd.get("rel_err")),
                     thresholds.get(branch, {}).get("verdicts", {}).get(str(T), "-"),
                     ",".join(sorted(s for s in statuses if s))])
    header = ["branch", "T", "fast", "kernel", "sdpa_fwd_ms", "fast_fwd_ms", "x_fwd",
              "sdpa_fwd_bwd_ms", "fast_fwd_bwd_ms", "x_fwd_bwd", "rel_err", "verdict", "status"]
    return common.format_table(rows, header)


def plot(records: list[dict], path: str, title: str, branches) -> None:
    panels = []
    for branch in branches:
        latency: dict[str, list] = {}
        speedup: dict[str, list] = {}
        for r in records:
            if r["branch"] != branch or r.get("status") != OK:
                continue
            latency.setdefault(f"{r['path']} {r['pass']}", []).append((int(r["T"]),
                                                                       _number(r["ms"])))
            if r.get("speedup") is not None:
                speedup.setdefault(f"{r['pass']}", []).append((int(r["T"]),
                                                               _number(r["speedup"])))
        fast_path = FAST_PATHS[branch]
        panels.append({"title": f"{branch}: {REFERENCE_PATH} vs {fast_path}",
                       "xlabel": "sequence length T", "ylabel": "ms (median)",
                       "series": latency, "logy": True})
        panels.append({"title": f"{branch}: {fast_path} speed-up over {REFERENCE_PATH}",
                       "xlabel": "sequence length T",
                       "ylabel": f"{REFERENCE_PATH} ms / {fast_path} ms", "series": speedup,
                       "logy": True, "hline": 1.0})
    common.plot_lines(path, panels, title)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = common.script_parser(__doc__)
    p.add_argument("--T_list", default="128,256,512,1k,2k,4k,8k,16k",
                   help="sequence lengths, comma list; 'k' = 1024")
    p.add_argument("--branches", default=",".join(BRANCHES),
                   help=f"comma subset of {','.join(BRANCHES)}")
    p.add_argument("--B", type=int, default=1, help="batch size")
    # --warmup: warm-up calls per cell, after one untimed correctness call per path;
    # --iters: timed calls per repeat, at most (--cell_budget_s).
    common.add_run_args(p, iters=10, warmup=2, repeats=3, rotate=2)
    common.add_nsa_args(p)
    p.add_argument("--cell_budget_s", type=float, default=1.0,
                   help="fewer timed calls when iters x repeats would take longer than this")
    p.add_argument("--max_call_s", type=float, default=10.0,
                   help="a path slower than this per call is not run at larger T")
    p.add_argument("--tolerance", type=float, default=None,
                   help="largest relative L2 error of a correct fast path against the float32 "
                        "reference (default: 1e-2 for bf16/fp16, 1e-4 for fp32)")
    p.add_argument("--out", default="artifacts/bench", help="directory for CSV, PNG, JSON, summary")
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    return p


def parse_args(argv=None):
    args = common.finish_args(build_parser().parse_args(argv))
    args.T = sorted(set(common.parse_int_list(args.T_list, "--T_list")))
    args.branch_list = [b.strip() for b in args.branches.split(",") if b.strip()]
    unknown = [b for b in args.branch_list if b not in BRANCHES]
    if unknown or not args.branch_list:
        raise ValueError(f"--branches ({args.branches!r}) must be a comma subset of "
                         f"{list(BRANCHES)}")
    args.branch_list = [b for b in BRANCHES if b in args.branch_list]
    if args.B <= 0:
        raise ValueError(f"--B ({args.B}) must be positive")
    for name in ("cell_budget_s", "max_call_s"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name} ({getattr(args, name)}) must be positive")
    if args.tolerance is None:
        args.tolerance = common.REL_L2_TOLERANCE[args.dtype]
    elif not args.tolerance > 0:
        raise ValueError(f"--tolerance ({args.tolerance}) must be positive")
    return args


def _fa2_versions() -> dict:
    try:
        from nsa_torch_ref.fast import fa2
        return fa2.versions()
    except Exception as exc:  # informational only
        return {"error": common.short_error(exc)}


def main(argv=None) -> int:
    argv, args = common.start(parse_args, argv, uses_jax=False)
    # Before anything imports triton (torch's checkpointing in the reference may).
    args.interpreter_problem = enable_triton_interpreter() if args.device == "cpu" else None
    cfg = args.cfg
    os.makedirs(args.out, exist_ok=True)
    env = common.write_environment(os.path.join(args.out, "torch_paths_env.json"),
                                   {"argv": argv, "device_label": args.device_label,
                                    "fa2": _fa2_versions(), "tolerance": args.tolerance})

    csv_path = os.path.join(args.out, "torch_paths.csv")
    png_path = os.path.join(args.out, "torch_paths.png")
    json_path = os.path.join(args.out, "torch_paths_thresholds.json")
    points = [(branch, T) for branch in args.branch_list for T in args.T]
    stopped: dict[str, dict] = {branch: {} for branch in args.branch_list}
    records: list[dict] = []
    reported = set()
    for branch, T in common.progress(points, desc="torch paths",
                                     enabled=not args.no_progress):
        new = run_point(args, cfg, branch, T, stopped[branch])
        for r in new:
            if r["status"] != OK and (branch, r["path"], r.get("note")) not in reported:
                reported.add((branch, r["path"], r.get("note")))
                print(f"{branch} {r['path']} {r['pass']} T={T}: {describe(r)}", file=sys.stderr,
                      flush=True)
        records += new
        common.write_csv(csv_path, records, COLUMNS)  # a run cut short keeps what finished
    add_speedups(records)
    thresholds = recommend_thresholds(records, args.tolerance)
    common.write_csv(csv_path, records, COLUMNS)
    title = (f"nsa_torch_ref fast paths vs sdpa: B={args.B} H={cfg.n_heads} G={cfg.n_kv_heads} "
             f"dk={cfg.d_k} dv={cfg.d_v} {args.dtype} on {args.device_label} (commit {env['commit'][:10]})")
    plot(records, png_path, title, args.branch_list)
    with open(json_path, "w") as f:
        json.dump({"thresholds": {item["key"]: item["value"] for item in thresholds.values()},
                   "details": thresholds, "tolerance": args.tolerance, "dtype": args.dtype,
                   "T_list": args.T, "device": args.device_label, "commit": env["commit"],
                   "shape": _shape(args)},
                  f, indent=2)
    table = summary_table(records, thresholds)
    recommendation = format_thresholds(thresholds, args.tolerance)
    with open(os.path.join(args.out, "torch_paths_summary.txt"), "w") as f:
        f.write(title + "\n\n" + table + "\n\n" + recommendation + "\n")
    print(f"wrote {csv_path}, {png_path}, {json_path}")
    print(title)
    print(table)
    print(recommendation)
    return 0


if __name__ == "__main__":
    sys.exit(main())
