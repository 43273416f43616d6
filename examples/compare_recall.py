"""Compare `train_recall.py` runs: learning curves of several runs (seeds, variants) on one plot.

Each input is a `*_curves.csv` that `train_recall.py` wrote, optionally labelled `path:label`
(default label: the file's name without `_curves.csv`). One panel per metric (two a row) against
the training step; one colour per model, one line style per label (inputs with one label, e.g.
one seed's runs split over several files, share a style). Prints each run's last point.

    python examples/compare_recall.py bench/results/recall_cpu_mqar/mqar_s3_curves.csv:seed3 \\
        bench/results/recall_cpu_mqar/mqar_s0_curves.csv:seed0 --out /tmp/mqar_compare.png
"""
from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):
    # Run as a file: the repository's own `bench` package must import without PYTHONPATH=.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402

STYLES = ("-", "--", ":", "-.")


def read_curves(path: str) -> dict[tuple[str, str], list[dict]]:
    """-> {(task, model): points sorted by step}, each point its numeric fields (empty ones
    dropped)."""
    if not os.path.isfile(path):
        raise ValueError(f"curves: no file {path!r}")
    rows = common.read_csv(path)
    missing = {"task", "model", "step"} - set(rows[0] if rows else ())
    if missing:
        raise ValueError(f"curves: {path!r} is not a train_recall curves CSV "
                         f"(no column {', '.join(sorted(missing))})")
    runs: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        point = {k: common.to_float(v) for k, v in row.items() if k not in ("task", "model")}
        runs.setdefault((row["task"], row["model"]), []).append(
            {k: v for k, v in point.items() if v is not None})
    for points in runs.values():
        points.sort(key=lambda p: p["step"])
    return runs


def parse_input(spec: str) -> tuple[str, str]:
    """'path[:label]' -> (path, label)."""
    path, sep, label = spec.rpartition(":")
    if not sep or not path.endswith(".csv"):
        path, label = spec, os.path.basename(spec).removesuffix(".csv").removesuffix("_curves")
    return path, label


def last_points(inputs: list[tuple[str, dict]], metrics: list[str]) -> list[list]:
    """One row per (input, task, model): its last step and the metrics there (None: absent)."""
    return [[label, task, model, int(points[-1]["step"]), *(points[-1].get(m) for m in metrics)]
            for label, runs in inputs for (task, model), points in sorted(runs.items())]


def plot(path: str, inputs: list[tuple[str, dict]], metrics: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({model for _, runs in inputs for _, model in runs})
    colours = {m: f"C{i % 10}" for i, m in enumerate(models)}
    labels = list(dict.fromkeys(label for label, _ in inputs))
    styles = {label: STYLES[i % len(STYLES)] for i, label in enumerate(labels)}
    cols = min(2, len(metrics))
    rows = -(-len(metrics) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.0 * cols, 4.0 * rows), squeeze=False)
    for ax in axes.flat[len(metrics):]:
        ax.axis("off")
    for ax, metric in zip(axes.flat, metrics):
        for label, runs in inputs:
            for (task, model), points in sorted(runs.items()):
                shown = [p for p in points if metric in p]
                if shown:
                    ax.plot([p["step"] for p in shown], [p[metric] for p in shown],
                            styles[label], color=colours[model], marker=".",
                            markersize=3, label=f"{model} ({label}, {task})")
        ax.set_title(metric, fontsize=9)
        ax.set_xlabel("step")
    common.save_panels(fig, axes.flat, path, legend_fontsize=6)


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
    print(common.format_table(last_points(inputs, metrics), ["run", "task", "model", "step",
                                                             *metrics]))
    plot(args.out, inputs, metrics)
    print(f"plot -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
