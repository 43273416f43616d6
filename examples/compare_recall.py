"""Compare `train_recall.py` runs: learning curves of several runs (seeds, variants) on one plot.

Each input is a `*_curves.csv` that `train_recall.py` wrote, optionally labelled `path:label`
(default label: the file's name without `_curves.csv`). One panel per metric against the
training step; one colour per model, one line style per label (inputs with one label, e.g.
one seed's runs split over several files, share a style). Prints each run's last point.

    python examples/compare_recall.py bench/results/recall_cpu_mqar/mqar_s3_curves.csv:seed3 \\
        bench/results/recall_cpu_mqar/mqar_s0_curves.csv:seed0 --out /tmp/mqar_compare.png
"""
from __future__ import annotations

import argparse
import csv
import os
import sys

STYLES = ("-", "--", ":", "-.")


def read_curves(path: str) -> dict[tuple[str, str], list[dict]]:
    """-> {(task, model): rows sorted by step}, numeric fields as floats (empty ones dropped)."""
    if not os.path.isfile(path):
        raise ValueError(f"curves: no file {path!r}")
    runs: dict[tuple[str, str], list[dict]] = {}
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = {"task", "model", "step"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"curves: {path!r} is not a train_recall curves CSV "
                             f"(no column {', '.join(sorted(missing))})")
        for row in reader:
            point = {k: float(v) for k, v in row.items() if k not in ("task", "model") and v}
            runs.setdefault((row["task"], row["model"]), []).append(point)
    for points in runs.values():
        points.sort(key=lambda p: p["step"])
    return runs


def parse_input(spec: str) -> tuple[str, str]:
    """'path[:label]' -> (path, label)."""
    path, sep, label = spec.rpartition(":")
    if not sep or not path.endswith(".csv"):
        path, label = spec, os.path.basename(spec).removesuffix(".csv").removesuffix("_curves")
    return path, label


def last_points(inputs: list[tuple[str, dict]], metrics: list[str]) -> list[list[str]]:
    """One row per (input, task, model): its last step and the metrics there."""
    rows = []
    for label, runs in inputs:
        for (task, model), points in sorted(runs.items()):
            last = points[-1]
            rows.append([label, task, model, f"{last['step']:.0f}"]
                        + [f"{last[m]:.3f}" if m in last else "-" for m in metrics])
    return rows


def plot(path: str, inputs: list[tuple[str, dict]], metrics: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({model for _, runs in inputs for _, model in runs})
    colours = {m: f"C{i % 10}" for i, m in enumerate(models)}
    labels = list(dict.fromkeys(label for label, _ in inputs))
    styles = {label: STYLES[i % len(STYLES)] for i, label in enumerate(labels)}
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.0 * len(metrics), 3.8), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for label, runs in inputs:
            for (task, model), points in sorted(runs.items()):
                shown = [p for p in points if metric in p]
                if shown:
                    ax.plot([p["step"] for p in shown], [p[metric] for p in shown],
                            styles[label], color=colours[model], marker=".",
                            markersize=3, label=f"{model} ({label}, {task})")
        ax.set_title(metric, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("curves", nargs="+", help="train_recall *_curves.csv files, each path[:label]")
    p.add_argument("--metrics", default="eval_acc,l1_hit",
                   help="comma list of curve columns, one panel each")
    p.add_argument("--out", required=True, help="the PNG to write")
    args = p.parse_args(argv)
    metrics = [m for m in args.metrics.split(",") if m]
    if not metrics:
        raise ValueError("--metrics: name at least one column")
    inputs = [(label, read_curves(path)) for path, label in map(parse_input, args.curves)]
    columns = {k for _, runs in inputs for points in runs.values() for p in points for k in p}
    unknown = [m for m in metrics if m not in columns]
    if unknown:
        raise ValueError(f"--metrics: no input has {', '.join(unknown)} "
                         f"(columns: {', '.join(sorted(columns))})")
    header = ["run", "task", "model", "step", *metrics]
    rows = last_points(inputs, metrics)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    plot(args.out, inputs, metrics)
    print(f"plot -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
