"""`python -m parity.sweep`: the parity report over presets, lengths, dtypes and backends.

Each cell runs `python -m parity ... --json` in its own process (a fresh JAX and PyTorch, a
timeout of its own) and the sweep writes one CSV and one Markdown table: the verdict, the
selection counts (equal / near-tie / wrong rows, layer and decode), and the worst ratio of an
error to its limit over all the cell's rows (< 1 passes).

    python -m parity.sweep --device gpu --out artifacts/parity_sweep
    python -m parity.sweep --device cpu --cells 0,1 --out /tmp/sweep      # a quick look
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from typing import Optional


@dataclasses.dataclass(frozen=True)
class Cell:
    preset: str
    T: int
    dtype: str
    jax: str
    torch: str
    B: int = 1

    def args(self) -> list[str]:
        return ["--preset", self.preset, "--T", str(self.T), "--B", str(self.B),
                "--dtype", self.dtype, "--jax-backend", self.jax, "--torch-backend", self.torch]

    def label(self) -> str:
        return (f"{self.preset} T={self.T} B={self.B} {self.dtype} jax={self.jax} "
                f"torch={self.torch}")


# The GPU matrix: every preset at a long length in bfloat16 on the fast paths, each dtype and each
# torch path at least once per preset, the XLA path at the short length and in float32.
GPU_CELLS = (
    Cell("tiny", 80, "float32", "xla", "sdpa", 2),
    Cell("tiny", 80, "bfloat16", "pallas", "triton", 2),
    Cell("tiny", 2048, "bfloat16", "pallas", "triton", 2),
    Cell("tiny", 2048, "float16", "pallas", "triton", 2),
    Cell("tiny", 2048, "float32", "pallas", "triton", 2),
    Cell("tiny", 2048, "bfloat16", "xla", "fa2", 2),
    Cell("tiny", 8192, "bfloat16", "pallas", "triton", 1),
    Cell("tiny", 8192, "float32", "xla", "sdpa", 1),
    Cell("paper", 80, "bfloat16", "pallas", "sdpa"),
    Cell("paper", 2048, "bfloat16", "pallas", "triton"),
    Cell("paper", 2048, "float32", "pallas", "sdpa"),
    Cell("paper", 2048, "float16", "pallas", "fa2"),
    Cell("paper", 8192, "bfloat16", "pallas", "triton"),
    Cell("bench", 80, "float32", "xla", "triton"),
    Cell("bench", 2048, "bfloat16", "pallas", "fa2"),
    Cell("bench", 2048, "float16", "xla", "sdpa"),
    Cell("bench", 8192, "bfloat16", "pallas", "triton"),
)
CPU_CELLS = (
    Cell("tiny", 80, "float32", "xla", "sdpa", 2),
    Cell("tiny", 1024, "bfloat16", "xla", "sdpa", 2),
    Cell("tiny", 1024, "float16", "xla", "sdpa", 2),
    Cell("tiny", 1024, "float32", "xla", "sdpa", 2),
)
COLUMNS = ("cell", "preset", "T", "B", "dtype", "jax", "torch", "verdict", "rows", "failing",
           "worst_ratio", "worst_row", "layer_equal", "layer_near_tie", "layer_wrong",
           "decode_near_tie", "decode_wrong", "seconds", "device", "commit")


def current_commit() -> str:
    """$COMMIT (a machine without the git history exports it), else the checkout's short hash."""
    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=os.path.dirname(os.path.abspath(__file__)),
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def worst_ratio(rows: list[dict]) -> tuple[float, str]:
    """The largest error / limit over every judged row (a count row: wrong rows, as is)."""
    worst, name = 0.0, ""
    for r in rows:
        pairs = [(r["jax"], r["limit"]), (r["torch"], r["limit"]),
                 (r.get("cross"), r.get("cross_limit"))]
        for error, bound in pairs:
            if error is None or bound is None or not math.isfinite(float(bound)):
                continue
            ratio = float(error) / float(bound) if float(bound) > 0 else float(error)
            if math.isfinite(ratio) and ratio > worst:
                worst, name = ratio, f"{r['section']}/{r['name']}"
    return worst, name


def _counts(detail: str, side: str) -> dict:
    """'jax: 4073 equal, 23 near-tie, 0 wrong of ...' -> {'equal': 4073, ...} of that side."""
    part = next((p for p in detail.split("; ") if p.startswith(f"{side}: ")), "")
    words = part.replace(",", "").split()
    return {words[i + 1]: int(words[i]) for i in range(1, len(words) - 1)
            if words[i].isdigit() and words[i + 1] in ("equal", "near-tie", "wrong")}


def summarise(index: int, cell: Cell, report: Optional[dict], seconds: float,
              error: str = "") -> dict:
    record = {"cell": index, **{k: v for k, v in dataclasses.asdict(cell).items()},
              "seconds": round(seconds, 1)}
    if report is None:
        return dict(record, verdict=f"ERROR: {error}"[:200])
    rows = report["rows"]
    failing = [f"{r['section']}/{r['name']}" for r in rows if not r["passed"]]
    ratio, name = worst_ratio(rows)
    layer = next(r for r in rows if r["name"] == "prefill block_idx: wrong rows")
    decode = [r for r in rows if r["section"] == "selection" and "decode" in r["name"]]
    record.update(verdict="PASS" if report["passed"] else "FAIL", rows=len(rows),
                  failing=" ".join(failing), worst_ratio=round(ratio, 3), worst_row=name,
                  device=report["devices"]["jax"])
    counts = [_counts(layer["detail"], side) for side in ("jax", "torch")]
    record.update(layer_equal=min(c.get("equal", 0) for c in counts),
                  layer_near_tie=max(c.get("near-tie", 0) for c in counts),
                  layer_wrong=max(c.get("wrong", 0) for c in counts))
    dec = [_counts(r["detail"], side) for r in decode for side in ("jax", "torch")]
    record.update(decode_near_tie=sum(c.get("near-tie", 0) for c in dec),
                  decode_wrong=sum(c.get("wrong", 0) for c in dec))
    return record


def run_cell(index: int, cell: Cell, device: str, out: str, timeout: float) -> dict:
    path = os.path.join(out, f"cell{index:02d}.json")
    command = [sys.executable, "-m", "parity", *cell.args(), "--device", device, "--json", path]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return summarise(index, cell, None, time.perf_counter() - start, f"timeout {timeout} s")
    seconds = time.perf_counter() - start
    with open(os.path.join(out, f"cell{index:02d}.log"), "w") as f:
        f.write(done.stdout + done.stderr)
    if not os.path.exists(path):
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return summarise(index, cell, None, seconds, f"exit {done.returncode}: {tail[0]}")
    with open(path) as f:
        return summarise(index, cell, json.load(f), seconds)


def markdown(records: list[dict]) -> str:
    head = ("| preset | T | B | dtype | JAX | torch | verdict | worst error / limit | layer rows: "
            "near-tie / wrong | decode rows: near-tie / wrong |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in records:
        lines.append(f"| {r['preset']} | {r['T']} | {r['B']} | {r['dtype']} | {r['jax']} | "
                     f"{r['torch']} | {r['verdict']} | {r.get('worst_ratio', '-')} | "
                     f"{r.get('layer_near_tie', '-')} / {r.get('layer_wrong', '-')} | "
                     f"{r.get('decode_near_tie', '-')} / {r.get('decode_wrong', '-')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parity.sweep", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "gpu"))
    parser.add_argument("--cells", default=None,
                        help="comma list of cell indices to run (default: all of the device's)")
    parser.add_argument("--out", default="artifacts/parity_sweep")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per cell")
    parser.add_argument("--list", action="store_true", help="print the cells and exit")
    args = parser.parse_args(argv)
    cells = GPU_CELLS if args.device == "gpu" else CPU_CELLS
    if args.list:
        for i, cell in enumerate(cells):
            print(f"{i:3d}  {cell.label()}")
        return 0
    chosen = (range(len(cells)) if args.cells is None
              else [int(c) for c in args.cells.split(",")])
    if any(not 0 <= i < len(cells) for i in chosen):
        print(f"error: --cells must lie in 0..{len(cells) - 1}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    try:
        from tqdm import tqdm
    except ImportError:  # the progress bar is a nicety
        def tqdm(items, **_):
            return items
    records, commit = [], current_commit()
    bar = tqdm(list(chosen), desc="parity sweep", unit="cell")
    for i in bar:
        if hasattr(bar, "set_postfix_str"):
            bar.set_postfix_str(cells[i].label())
        records.append(dict(run_cell(i, cells[i], args.device, args.out, args.timeout),
                            commit=commit))
        print(f"  {cells[i].label():<60} {records[-1]['verdict']:<6} "
              f"{records[-1]['seconds']:7.1f} s", flush=True)
        with open(os.path.join(args.out, "parity_sweep.csv"), "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(records)
    with open(os.path.join(args.out, "parity_sweep.md"), "w") as f:
        f.write(markdown(records) + "\n")
    print(markdown(records))
    return 0 if all(r["verdict"] == "PASS" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
