"""Print the decode benchmark's table from its CSV (bench/bench_decode.py --csv ...).

One line per (B, S): the NSA step (ms), each branch-only step as a share of it, the no-attention
base step, tokens read per KV head (actual at t = S against the paper's formula and against full
attention's S + 1), the full-attention step and the speed-up.

    python bench/summarize_decode_csv.py artifacts/bench/decode.csv
"""
from __future__ import annotations

import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402

HEADER = ["B", "S", "nsa_ms", "cmp_share", "sel_share", "win_share", "base_ms", "reads",
          "formula", "full_reads", "full_ms", "baseline", "speedup", "nsa_attn_ms",
          "full_attn_ms", "attn_speedup", "status"]


def summarize(rows: list[dict]) -> str:
    """The table as text. `rows` are CSV rows (strings), as from `common.read_csv`."""
    points: dict[tuple[int, int], dict] = {}
    for row in rows:
        try:
            key = (int(row["B"]), int(row["S"]))
        except (KeyError, ValueError):
            raise ValueError(f"row {row!r} lacks integer B and S columns: is this a decode CSV?")
        points.setdefault(key, {})[(row["row"], row.get("mode", "full"))] = row
    table = []
    for (B, S), entries in sorted(points.items()):
        nsa = entries.get(("nsa_jax", "full"), {})
        ok = nsa.get("status") == common.OK

        def value(entry, column):
            return common.to_float(entry.get(column)) if entry.get("status") == common.OK else None

        baseline = nsa.get("baseline") or ""
        full = entries.get((baseline, "full"), {}) if baseline else {}
        if not full:  # no speed-up: show the first full-attention row that ran
            full = next((e for (name, _), e in sorted(entries.items())
                         if name.startswith("full_") and e.get("status") == common.OK), {})
            baseline = full.get("row", "")
        statuses = sorted({e.get("status", "") for e in entries.values()} - {""})
        reads = common.to_float(nsa.get("reads_actual")) if ok else None
        formula = common.to_float(nsa.get("reads_formula"))
        table.append([
            B, S, value(nsa, "ms"),
            *(value(entries.get(("nsa_jax", b), {}), "share_of_step") for b in ("cmp", "sel",
                                                                                   "win")),
            value(entries.get(("nsa_jax", "base"), {}), "ms"),
            None if reads is None else int(reads), None if formula is None else int(formula),
            S + 1, value(full, "ms"), baseline or "-", value(nsa, "speedup_vs_full"),
            value(nsa, "attn_ms"), value(full, "attn_ms"), value(nsa, "attn_speedup"),
            "ok" if statuses == [common.OK] else "/".join(statuses)])
    return common.format_table(table, HEADER)


def main(argv=None) -> int:
    parser = common.script_parser(__doc__)
    parser.add_argument("csv", help="the CSV written by bench_decode.py")
    args = parser.parse_args(argv)
    if not os.path.exists(args.csv):
        raise SystemExit(f"csv ({args.csv}) does not exist")
    print(summarize(common.read_csv(args.csv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
