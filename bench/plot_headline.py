"""The README's headline plot: the NSA attention core against full causal attention
(FlashAttention-3, cuDNN) over the sequence length, forward and forward+backward, from the
prefill CSV (`bench/bench_prefill.py`'s `prefill_latest.csv`). Prints the table it plots.
Reads bench/results/prefill_latest.csv and writes docs/img/prefill_headline.png by default:

    python bench/plot_headline.py
"""
from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402

# CSV row -> legend label, in the table's column order.
ROWS = {"nsa_jax_pallas": "NSA core (Pallas)", "fa3_full": "FlashAttention-3 (full)",
        "cudnn_full": "cuDNN (full)"}
PASSES = {"fwd_ms": "forward", "fwd_bwd_ms": "forward+backward"}   # CSV column -> panel title


def headline(rows: list[dict]) -> tuple[dict, str]:
    """(panels' series {pass column: {label: [(S, ms), ...]}}, device), from prefill CSV rows of
    the random selection workload (a line without a `workload` column holds it)."""
    series = {column: {label: [] for label in ROWS.values()} for column in PASSES}
    devices = set()
    for row in rows:
        if row["row"] not in ROWS or row.get("status", "") not in ("", common.OK):
            continue
        if (row.get("workload") or "random") != "random":
            continue
        devices.add(row["device"])
        for column in PASSES:
            series[column][ROWS[row["row"]]].append((int(row["S"]), common.to_float(row[column])))
    if len(devices) != 1:
        raise ValueError(f"the CSV's rows come from {len(devices)} devices ({sorted(devices)}); "
                         "the plot compares rows of one device")
    return series, devices.pop()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", default=os.path.join(common.REPO_ROOT, "bench", "results",
                                                      "prefill_latest.csv"))
    parser.add_argument("--out", default=os.path.join(common.REPO_ROOT, "docs", "img",
                                                      "prefill_headline.png"))
    args = parser.parse_args(argv)

    series, device = headline(common.read_csv(args.csv))
    panels = [{"title": title, "xlabel": "sequence length S", "ylabel": "ms", "logy": True,
               "series": series[column]} for column, title in PASSES.items()]
    common.plot_lines(args.out, panels, f"{device}, bf16, B 1, H 64, G 4, d 128: NSA attention "
                                        "core against full causal attention")

    lengths = sorted({s for points in series["fwd_ms"].values() for s, _ in points})
    table = [[s] + [dict(series[column][label]).get(s) for label in ROWS.values()
                    for column in PASSES] for s in lengths]
    header = ["S"] + [f"{row} {column}" for row in ROWS for column in PASSES]
    print(common.format_table(table, header))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
