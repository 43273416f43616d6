"""The one harness of the benchmark scripts: device setup, the shared flags, timing, memory, CSV,
plots, the environment record.

Every script takes the NSA settings from `add_nsa_args` (a preset, then one override flag per
NSAConfig field: --d_model --H --G --dk --dv --l --d --l_sel --n_sel --n_init --n_local --w
--compress) and the run settings from `add_run_args` (--device --dtype --iters --warmup
--repeats --rotate); `finish_args` checks them and puts the NSAConfig on `args.cfg`.

Importing this module sets `XLA_PYTHON_CLIENT_PREALLOCATE=false` (unless the caller set it): JAX
would otherwise reserve 75% of the GPU at start-up, and the torch rows that follow in the same
process, or the peak-memory figures, would measure JAX's reservation instead of the work.

Timing is device-side in the sense that matters for a queue-fed accelerator:
- JAX: one jitted callable, warmed up (compilation excluded), then `iters` calls dispatched back
  to back over `rotate` distinct input buffers and one `block_until_ready` on the last output;
  a repeat's per-iteration time is its wall time / iters. The figure is the median over repeats.
  The device runs the calls in order on one stream, so the host only waits once per repeat and
  dispatch overlaps execution.
- torch on CUDA: a `torch.cuda.Event` pair around every call, one synchronize at the end, the
  median of the per-call times. On CPU, `time.perf_counter` around every call.
"""
from __future__ import annotations

import csv
import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Row statuses written to the CSV.
OK, OOM, SKIPPED, ERROR, TIMEOUT = "ok", "oom", "skipped", "error", "timeout"

_OOM_MARKERS = ("RESOURCE_EXHAUSTED", "out of memory", "Out of memory", "OutOfMemory",
                "CUDA_ERROR_OUT_OF_MEMORY", "Failed to allocate")


class Skip(Exception):
    """Raised by a row that cannot run here (missing package, no GPU, unsupported shape)."""


# ---------------------------------------------------------------------------------------------
# Device and argument helpers
# ---------------------------------------------------------------------------------------------
def script_parser(doc: str):
    """A script's ArgumentParser: its docstring's first line, then the rest as the epilog."""
    import argparse

    return argparse.ArgumentParser(description=doc.split("\n")[0], epilog=doc.split("\n", 1)[1],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def start(parse_args: Callable, argv: Optional[Sequence[str]] = None, *, uses_jax: bool = True):
    """(argv, args): `argv` (the command line's by default) parsed by `parse_args`, JAX pinned to
    `--device` before it loads (`uses_jax`), and `args.device_label` for the CSV."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if uses_jax:
        setup_device(args.device)
    args.device_label = device_name(args.device)
    return argv, args


def setup_device(device: str) -> None:
    """Pin JAX to the requested platform before it is imported. `device` is "gpu" or "cpu"."""
    if device not in ("gpu", "cpu"):
        raise ValueError(f"device ({device!r}) must be 'gpu' or 'cpu'")
    if device == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
    else:
        os.environ.setdefault("JAX_PLATFORMS", "cuda,cpu")


DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
          "float32": "float32", "fp32": "float32"}


# Largest relative L2 error of a kernel's output or gradients against a float32 reference.
REL_L2_TOLERANCE = {"bfloat16": 1e-2, "float16": 1e-2, "float32": 1e-4}


def jnp_dtype(name: str):
    """A canonical dtype name of DTYPES' values -> the jnp dtype."""
    import jax.numpy as jnp

    return {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}[name]


def torch_device(args):
    """(torch, "cuda" | "cpu", torch dtype) of `--device` and `--dtype`; Skip when a GPU run's
    torch sees no CUDA device."""
    import torch

    if args.device == "gpu" and not torch.cuda.is_available():
        raise Skip("torch sees no CUDA device")
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16,
             "float32": torch.float32}[args.dtype]
    return torch, ("cuda" if args.device == "gpu" else "cpu"), dtype


def parse_rows(text, known, default) -> list[str]:
    """--rows: a comma subset of `known` in the order given, or `default` when empty;
    ValueError naming the unknown ones."""
    if not text:
        return list(default)
    rows = [r.strip() for r in text.split(",") if r.strip()]
    unknown = [r for r in rows if r not in known]
    if unknown:
        raise ValueError(f"--rows has unknown rows {unknown}; known: {list(known)}")
    return rows


def parse_int_list(text: str, name: str) -> list[int]:
    """'8k,16k,65536' -> [8192, 16384, 65536]; a 'k' suffix multiplies by 1024."""
    values = []
    for item in str(text).split(","):
        item = item.strip().lower()
        if not item:
            continue
        try:
            value = int(item[:-1]) * 1024 if item.endswith("k") else int(item)
        except ValueError:
            raise ValueError(f"{name} ({text!r}) must be a comma list of ints (8k = 8192)") from None
        if value <= 0:
            raise ValueError(f"{name} ({text!r}) must hold positive ints")
        values.append(value)
    if not values:
        raise ValueError(f"{name} ({text!r}) is empty")
    return values


def parse_literal(value: str):
    """A command-line setting's value: True / False / None, else an int or a float where it is
    one, else the string (`breakdown_prefill.py --variants`, `scripts/pallas_ptxas.py --set`)."""
    if value in ("True", "False"):
        return value == "True"
    if value == "None":
        return None
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def parse_assignments(text: Optional[str], option: str, known=None, owner: str = "") -> dict:
    """`field=value,...` -> {field: `parse_literal(value)`}; a ValueError names `option` and the
    item, and with `known` (the field names of `owner`) any other field."""
    fields = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key or not value or (known is not None and key not in known):
            where = f" with a field of {owner} ({sorted(known)})" if known is not None else ""
            raise ValueError(f"{option}: {item!r} must be field=value{where}")
        fields[key] = parse_literal(value)
    return fields


# ---------------------------------------------------------------------------------------------
# Shared flags: the NSA settings (a preset, then per-field overrides) and the run settings
# ---------------------------------------------------------------------------------------------
# flag -> (NSAConfig field, help). One spelling in every script.
NSA_FLAGS = {
    "d_model": ("d_model", "hidden size (the layer's projections)"),
    "H": ("n_heads", "query heads"),
    "G": ("n_kv_heads", "KV heads"),
    "dk": ("d_k", "query/key head dim"),
    "dv": ("d_v", "value head dim"),
    "l": ("cmp_block", "compression block"),
    "d": ("cmp_stride", "compression stride"),
    "l_sel": ("sel_block", "selection block"),
    "n_sel": ("n_sel", "selected blocks"),
    "n_init": ("n_init", "forced initial blocks"),
    "n_local": ("n_local", "forced local blocks"),
    "w": ("window", "sliding window"),
}
NSA_PRESETS = ("bench", "paper", "tiny")


def nsa_preset(name: str):
    """The NSAConfig of a preset name. "bench" is the paper's attention with d_k = 128 instead of
    192 (d_k = d_v, which FA-3's decode baseline needs; the figures of bench/RESULTS.md)."""
    from nsa_common import NSAConfig

    if name == "bench":
        return NSAConfig.paper(d_k=128)
    if name not in NSA_PRESETS:
        raise ValueError(f"--preset ({name!r}) must be one of {list(NSA_PRESETS)}")
    return NSAConfig.preset(name)


def add_nsa_args(parser, preset: str = "bench") -> None:
    """--preset and one override flag per NSAConfig field (NSA_FLAGS, --compress)."""
    group = parser.add_argument_group(
        "NSA settings", "a preset, then per-field overrides (unset flags keep the preset's value)")
    group.add_argument("--preset", default=preset, choices=NSA_PRESETS,
                       help=f"NSAConfig preset (default {preset}; bench = paper with d_k 128)")
    for flag, (field, text) in NSA_FLAGS.items():
        group.add_argument(f"--{flag}", type=int, default=None, help=f"{text} ({field})")
    group.add_argument("--compress", default=None, choices=("mlp", "mean"),
                       help="compression (compress)")


def nsa_config(args, **pinned):
    """The NSAConfig of `add_nsa_args`' flags: the preset with the flags that were set, then
    `pinned` (fields a script fixes, applied before the config is checked). ValueError naming
    the field on a bad combination."""
    changes = {field: getattr(args, flag) for flag, (field, _) in NSA_FLAGS.items()
               if getattr(args, flag) is not None}
    if args.compress is not None:
        changes["compress"] = args.compress
    return nsa_preset(args.preset).replace(**{**changes, **pinned})


def add_run_args(parser, *, iters: Optional[int] = None, warmup: Optional[int] = None,
                 repeats: Optional[int] = None, rotate: Optional[int] = None,
                 dtypes: Sequence[str] = tuple(sorted(DTYPES))) -> None:
    """--device, --dtype and, with their defaults given, the timing counts (`time_jax`,
    `time_torch`): --iters, --warmup, --repeats, --rotate."""
    parser.add_argument("--device", default="gpu", choices=("gpu", "cpu"))
    parser.add_argument("--dtype", default="bfloat16", choices=dtypes)
    if iters is not None:
        parser.add_argument("--iters", type=int, default=iters, help="timed calls per repeat")
    if warmup is not None:
        parser.add_argument("--warmup", type=int, default=warmup, help="untimed calls first")
    if repeats is not None:
        parser.add_argument("--repeats", type=int, default=repeats,
                            help="repeats; the median is reported")
    if rotate is not None:
        parser.add_argument("--rotate", type=int, default=rotate,
                            help="distinct input buffers cycled")


def finish_args(args):
    """After parsing: the canonical dtype name, the counts checked, `args.cfg` (the NSAConfig)
    when the script takes the NSA settings. Returns args."""
    if getattr(args, "dtype", None) is not None:
        args.dtype = DTYPES[args.dtype]
    for name in ("iters", "repeats", "rotate"):
        if hasattr(args, name) and getattr(args, name) <= 0:
            raise ValueError(f"--{name} ({getattr(args, name)}) must be positive")
    if hasattr(args, "warmup") and args.warmup < 0:
        raise ValueError(f"--warmup ({args.warmup}) must be >= 0")
    if hasattr(args, "preset"):
        args.cfg = nsa_config(args)
    return args


def classify_exception(exc: BaseException) -> str:
    """OOM when the message or type says the device ran out of memory, else ERROR."""
    text = f"{type(exc).__name__}: {exc}"
    if any(marker in text for marker in _OOM_MARKERS):
        return OOM
    return ERROR


def short_error(exc: BaseException, limit: int = 160) -> str:
    """One line, for the CSV's note column."""
    line = f"{type(exc).__name__}: {exc}".replace("\n", " ").replace(",", ";")
    return line if len(line) <= limit else line[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Timing:
    """Per-iteration milliseconds: the median over repeats, and the fastest and slowest repeat."""

    ms: float
    ms_min: float
    ms_max: float
    samples: int

    def fields(self) -> dict[str, float]:
        """The CSV columns every bench writes: ms, ms_min, ms_max."""
        return {"ms": self.ms, "ms_min": self.ms_min, "ms_max": self.ms_max}


def _summarise(per_iter_ms: Sequence[float]) -> Timing:
    return Timing(ms=statistics.median(per_iter_ms), ms_min=min(per_iter_ms),
                  ms_max=max(per_iter_ms), samples=len(per_iter_ms))


def _check_counts(iters: int, warmup: int, repeats: int) -> None:
    for name, value, low in (("iters", iters, 1), ("warmup", warmup, 0), ("repeats", repeats, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} ({value!r}) must be an int >= {low}")


def time_jax(step: Callable[[int], Any], *, iters: int, warmup: int, repeats: int = 5) -> Timing:
    """Time `step(i)` (launches iteration i, returns its output pytree) on a JAX device.

    `step` should pick its inputs by `i % rotate` so consecutive calls read different buffers.
    A step that carries state (decode) keeps it in a closure; the last output is what we block on.
    """
    import jax

    _check_counts(iters, warmup, repeats)
    out = None
    for i in range(warmup):
        out = step(i)
    jax.block_until_ready(out)
    per_iter = []
    count = warmup
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            out = step(count)
            count += 1
        jax.block_until_ready(out)
        per_iter.append((time.perf_counter() - start) * 1e3 / iters)
    return _summarise(per_iter)


def time_jax_fn(fn: Callable, inputs: Sequence[tuple], *, iters: int, warmup: int,
                repeats: int = 5) -> tuple[Timing, Any]:
    """Compile `fn` once for `inputs[0]` (compilation excluded), then `time_jax` it over the
    input tuples in turn. Returns (timing, the compiled program: `jax_compiled_peak_bytes`)."""
    import jax

    compiled = jax.jit(fn).lower(*inputs[0]).compile()
    timing = time_jax(lambda i: compiled(*inputs[i % len(inputs)]), iters=iters, warmup=warmup,
                      repeats=repeats)
    return timing, compiled


def time_torch(step: Callable[[int], Any], *, iters: int, warmup: int, repeats: int = 5,
               device: str = "cuda") -> Timing:
    """Time `step(i)` with CUDA events around every call (perf_counter on CPU).

    `iters * repeats` calls are timed one by one; the figure is their median.
    """
    import torch

    _check_counts(iters, warmup, repeats)
    cuda = device.startswith("cuda")
    for i in range(warmup):
        step(i)
    if cuda:
        torch.cuda.synchronize()
    total = iters * repeats
    if cuda:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(total)]
        for i, (start, end) in enumerate(events):
            start.record()
            step(warmup + i)
            end.record()
        torch.cuda.synchronize()
        per_iter = [start.elapsed_time(end) for start, end in events]
    else:
        per_iter = []
        for i in range(total):
            start = time.perf_counter()
            step(warmup + i)
            per_iter.append((time.perf_counter() - start) * 1e3)
    return _summarise(per_iter)


# ---------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------
def jax_compiled_peak_bytes(compiled) -> Optional[int]:
    """Peak bytes of one compiled JAX program from XLA's static memory analysis.

    Arguments + outputs + temporaries - aliased (donated) bytes; `peak_memory_in_bytes` when the
    backend reports it. None when the backend gives no analysis.
    """
    try:
        analysis = compiled.memory_analysis()
    except Exception:  # some backends raise instead of returning None
        return None
    if analysis is None:
        return None
    peak = getattr(analysis, "peak_memory_in_bytes", None)
    if peak:
        return int(peak)
    total = 0
    for field in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes"):
        total += int(getattr(analysis, field, 0) or 0)
    total -= int(getattr(analysis, "alias_size_in_bytes", 0) or 0)
    return total if total > 0 else None


def jax_device_peak_bytes() -> Optional[int]:
    """The device allocator's high-water mark since process start (None on CPU).

    JAX cannot reset it, so it is only per-row when each row runs in its own process
    (`--isolate row`, the default) and S grows along the row.
    """
    import jax

    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:
        return None
    if not stats:
        return None
    value = stats.get("peak_bytes_in_use")
    return int(value) if value is not None else None


def mb(value: Optional[int]) -> Optional[float]:
    return None if value is None else round(value / 2**20, 1)


# ---------------------------------------------------------------------------------------------
# Environment
# ---------------------------------------------------------------------------------------------
def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit() -> str:
    """The commit label: the COMMIT environment variable when set (the runner exports it), else
    `git rev-parse HEAD` with "-dirty" appended when tracked files differ from that commit, else
    "unknown". A copy of the tree sent to a remote GPU machine can carry a `.git` whose HEAD is
    older than the files that travelled (benches there once recorded an earlier commit than the
    code that ran), so a label without "-dirty" is the code that ran, and one with it is not a
    commit at all."""
    if os.environ.get("COMMIT") and os.environ["COMMIT"] != "unknown":
        return os.environ["COMMIT"]

    def git(*argv):
        return subprocess.run(["git", *argv], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=10)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0 or not head.stdout.strip():
            return "unknown"
        dirty = git("diff", "--quiet", "HEAD", "--").returncode == 1
        return head.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def nvidia_smi() -> Optional[str]:
    """`name, driver, memory` of each GPU, or None without nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def environment() -> dict[str, Any]:
    """Versions, device and commit: what a figure needs to be reproducible. Imports nothing heavy."""
    packages = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "torch", "triton",
                "flash_attn3_jax", "fla-core", "flash-linear-attention", "flash-attn", "numpy",
                "matplotlib")
    return {
        "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "gpu": nvidia_smi(),
        "versions": {name: _version(name) for name in packages if _version(name)},
        "env": {key: os.environ[key] for key in sorted(os.environ)
                if key.startswith(("NSA_", "XLA_", "JAX_", "CUDA_VISIBLE"))},
    }


def device_name(device: str) -> str:
    """A short device label for the CSV: the GPU's name from nvidia-smi, or 'cpu'."""
    if device == "cpu":
        return "cpu"
    smi = nvidia_smi()
    return smi.splitlines()[0].split(",")[0].strip() if smi else "gpu"


def write_environment(path: str, extra: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    env = environment()
    if extra:
        env.update(extra)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(env, f, indent=2, sort_keys=True)
    return env


# ---------------------------------------------------------------------------------------------
# CSV
# ---------------------------------------------------------------------------------------------
def write_csv(path: str, rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> None:
    """Write `rows` with exactly `columns` (missing values empty; unknown keys are an error)."""
    for row in rows:
        unknown = sorted(set(row) - set(columns))
        if unknown:
            raise ValueError(f"rows have columns {unknown} not in columns {list(columns)}")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns))
        writer.writeheader()
        for row in rows:
            writer.writerow({key: _csv_value(row.get(key)) for key in columns})


def _csv_value(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return value


def read_csv(path: str) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def to_float(value: Any) -> Optional[float]:
    """CSV cell -> float, or None when empty / not a number."""
    if value is None or value == "":
        return None
    try:
        result = float(value)
    except (TypeError, ValueError):
        return None
    return result if math.isfinite(result) else None


# ---------------------------------------------------------------------------------------------
# Tables and plots
# ---------------------------------------------------------------------------------------------
def format_table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    """A plain fixed-width table (numbers right-aligned)."""
    cells = [[_cell(value) for value in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)),
             "  ".join("-" * w for w in widths)]
    for row, raw in zip(cells, rows):
        lines.append("  ".join(c.rjust(w) if isinstance(v, (int, float)) and not isinstance(v, bool)
                               else c.ljust(w) for c, w, v in zip(row, widths, raw)))
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if 0 < abs(value) < 1e-3:  # errors and tolerances
            return f"{value:.2e}"
        if value >= 100:
            return f"{value:.1f}"
        if value >= 1:
            return f"{value:.2f}"
        return f"{value:.3f}"
    return str(value)


def plot_lines(path: str, panels: Sequence[Mapping[str, Any]], title: str) -> None:
    """One PNG with one panel per entry of `panels`.

    A panel: {"title", "xlabel", "ylabel", "series": {label: [(x, y), ...]}, "logy": bool,
    "hline": optional y}. x is plotted on a log2 axis (context lengths).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(1, len(panels))
    cols = 2 if n > 1 else 1
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.2 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        drawn = False
        for label, points in sorted(panel["series"].items()):
            points = sorted((x, y) for x, y in points if y is not None)
            if not points:
                continue
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", label=label)
            drawn = True
        ax.set_xscale("log", base=2)
        if panel.get("logy") and drawn:
            ax.set_yscale("log")
        if panel.get("hline") is not None:
            ax.axhline(panel["hline"], color="grey", linestyle="--", linewidth=0.8)
        ax.set_title(panel["title"])
        ax.set_xlabel(panel["xlabel"])
        ax.set_ylabel(panel["ylabel"])
        ax.grid(True, which="both", alpha=0.3)
        if drawn:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save_panels(fig, axes, path: str, *, legend_fontsize: float = 7, dpi: int = 100) -> None:
    """Finish a figure of line panels: a grid on each panel, a legend where lines were drawn;
    then write the PNG (its folder made) and close the figure."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=legend_fontsize)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Row isolation: each row in its own process
# ---------------------------------------------------------------------------------------------
def run_row_subprocess(script: str, argv: Sequence[str], row: str, timeout_s: float,
                       tmp_dir: str) -> tuple[list[dict[str, Any]], Optional[str]]:
    """Run `script --worker ROW --worker_out FILE <argv>` and return (records, failure note).

    A row in its own process starts with an empty allocator (fair peak memory; JAX's memory
    does not block the torch rows) and cannot take the whole run down when it crashes or hangs.
    """
    os.makedirs(tmp_dir, exist_ok=True)
    out_path = os.path.join(tmp_dir, f"worker_{row}.json")
    if os.path.exists(out_path):
        os.remove(out_path)
    command = [sys.executable, script, *argv, "--worker", row, "--worker_out", out_path]
    log_path = os.path.join(tmp_dir, f"worker_{row}.log")
    try:
        with open(log_path, "w") as log:
            proc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s,
                                  cwd=REPO_ROOT)
        failure = None if proc.returncode == 0 else f"worker exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        failure = TIMEOUT
    records = []
    if os.path.exists(out_path):
        with open(out_path) as f:
            records = json.load(f)
    if failure and not records:
        with open(log_path) as f:
            tail = f.read()[-400:]
        failure = f"{failure}: {tail}".replace("\n", " ").replace(",", ";")
    return records, failure


def failure_status(failure: Optional[str]) -> str:
    """The status of a row that `run_row_subprocess` returned no record for: TIMEOUT when the
    worker was killed at its time limit (the note starts with it), else ERROR."""
    return TIMEOUT if failure and failure.startswith(TIMEOUT) else ERROR


def save_records(path: str, records: Iterable[Mapping[str, Any]]) -> None:
    """The worker's partial results, rewritten after every point so a crash keeps what finished."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(list(records), f)
    os.replace(tmp, path)


def debug_traceback() -> str:
    return traceback.format_exc() if os.environ.get("NSA_BENCH_DEBUG") else ""


def progress(iterable, total: Optional[int] = None, desc: str = "", enabled: bool = True):
    """tqdm over the rows on stderr (a plain iterator without tqdm or when disabled)."""
    if not enabled:
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, total=total, desc=desc, file=sys.stderr, dynamic_ncols=True)
