"""The parity report: one config, the same weights and inputs in both frameworks, every branch,
output and gradient compared against the spec's tolerances (`python -m parity`)."""
from __future__ import annotations

import dataclasses
import json
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch

import nsa_jax
import nsa_torch_ref
from nsa_common import NSAConfig
from nsa_jax.layer import project as jax_project
from nsa_torch_ref.module import compress_branch_kv as torch_compress
from nsa_torch_ref.module import flatten_params
from parity.compare import (SELECTION_AGREEMENT_MIN, Comparison, as_float64, compare,
                            selection_agreement, tolerance)
from parity.convert import jax_to_torch, module_to_params, params_to_module, torch_to_jax

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
JAX_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the report: a compared quantity, or an exact check (agreement, counters)."""
    section: str
    name: str
    error: float
    limit: float
    passed: bool
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class ParitySettings:
    cfg: NSAConfig
    batch: int = 2
    seq_len: int = 80
    dtype: str = "float32"
    seed: int = 0
    device: str = "cpu"
    jax_backend: str = "xla"
    torch_backend: str = "sdpa"
    decode_steps: int = 4
    perturb: Optional[str] = None  # self-test: scale one JAX-side weight so rows must FAIL

    def __post_init__(self):
        if self.dtype not in TORCH_DTYPES:
            raise ValueError(f"dtype ({self.dtype!r}) must be one of {sorted(TORCH_DTYPES)}")
        if self.device not in ("cpu", "gpu"):
            raise ValueError(f"device ({self.device!r}) must be 'cpu' or 'gpu'")
        if self.seq_len < 1 or self.batch < 1 or self.decode_steps < 0:
            raise ValueError("seq_len and batch must be >= 1 and decode_steps >= 0")


def _row(section: str, c: Comparison) -> Row:
    detail = f"max|d|={c.max_abs:.2e}" if not c.nonfinite else f"{c.nonfinite} non-finite"
    if c.floored:
        detail += " (near-zero reference: error vs the RMS of all gradients)"
    return Row(section, c.name, c.rel_err, c.tol, c.passed, detail)


def _torch_backends(name: str) -> dict:
    """{branch: backend} for nsa_torch_ref; a path that does not exist fails clearly."""
    branches = nsa_torch_ref.dispatch.BRANCHES
    unknown = [b for b in branches if name not in nsa_torch_ref.dispatch.available(b)]
    if len(unknown) == len(branches):
        raise ValueError(f"torch backend {name!r} does not exist; available: "
                         f"{sorted(set().union(*(nsa_torch_ref.dispatch.available(b) for b in branches)))}")
    # A fast path may cover only some branches (e.g. triton: selection); the rest stay on sdpa.
    return {b: (name if b not in unknown else "sdpa") for b in branches}


def _jax_backend(name: str):
    if name not in nsa_jax.known_backends():
        raise ValueError(f"jax backend {name!r} does not exist; known: "
                         f"{list(nsa_jax.known_backends())}")
    return name if name == "xla" else (name, "xla")


class _Runner:
    """Holds both frameworks' copies of the weights and inputs for one report."""

    def __init__(self, s: ParitySettings):
        self.s = s
        cfg = s.cfg
        self.torch_device = torch.device("cuda" if s.device == "gpu" else "cpu")
        self.jax_device = jax.devices("gpu" if s.device == "gpu" else "cpu")[0]
        torch.manual_seed(s.seed)
        self.module = nsa_torch_ref.NSAAttention(cfg, backends=_torch_backends(s.torch_backend))
        self.module.to(device=self.torch_device, dtype=TORCH_DTYPES[s.dtype])
        self.params = module_to_params(self.module, self.jax_device)
        if s.perturb is not None:
            self._perturb(s.perturb)
        rng = np.random.default_rng(s.seed)
        total = s.seq_len + s.decode_steps
        x = rng.standard_normal((s.batch, total, cfg.d_model)).astype(np.float32)
        self.x_torch = torch.from_numpy(x).to(self.torch_device, TORCH_DTYPES[s.dtype])
        self.x_jax = torch_to_jax(self.x_torch, self.jax_device)
        cotangent = rng.standard_normal((s.batch, s.seq_len, cfg.d_model)).astype(np.float32)
        self.dy_torch = torch.from_numpy(cotangent).to(self.torch_device, TORCH_DTYPES[s.dtype])
        self.dy_jax = torch_to_jax(self.dy_torch, self.jax_device)
        self.jax_backend = _jax_backend(s.jax_backend)

    def _perturb(self, name: str) -> None:
        flat = flatten_params(self.params)
        if name not in flat:
            raise ValueError(f"perturb ({name!r}) must name a parameter: {sorted(flat)}")
        outer, _, inner = name.partition(".")
        holder = self.params[outer] if inner else self.params
        key = inner or outer
        holder[key] = holder[key] * (1 + 1e-2)

    def tol(self, kind: str) -> float:
        return tolerance(self.s.dtype, kind)

    # -- forward and branches ----------------------------------------------------------------
    def forward_rows(self) -> list[Row]:
        s, cfg = self.s, self.s.cfg
        x_t, x_j = self.x_torch[:, : s.seq_len], self.x_jax[:, : s.seq_len]
        with torch.no_grad():
            y_t, aux_t = self.module(x_t, return_aux=True)
        layer = jax.jit(lambda p, x: nsa_jax.nsa_attention(
            p, x, cfg, backend=self.jax_backend, return_aux=True))
        y_j, aux_j = layer(self.params, x_j)
        rows = [_row("layer", compare(name, aux_j[name], aux_t[name], self.tol("output")))
                for name in ("o_cmp", "o_sel", "o_win", "gates")]
        rows.append(_row("layer", compare("y", y_j, y_t, self.tol("output"))))
        rows.append(self._agreement("layer", "block_idx", aux_j["block_idx"], aux_t["block_idx"]))
        return rows + self.branch_rows(x_j)

    def _agreement(self, section: str, name: str, a, b) -> Row:
        share = selection_agreement(np.asarray(a), b.cpu().numpy())
        floor = SELECTION_AGREEMENT_MIN.get(self.s.dtype, 0.99)
        return Row(section, f"{name} agreement", share, floor, share >= floor,
                   f"{share:.2%} of (b, t, g) rows equal")

    def branch_rows(self, x_j) -> list[Row]:
        """Each kernel-level function on the SAME inputs (JAX's projections, carried to torch),
        and selected attention on the SAME block_idx, so a flipped near-tie hides nothing."""
        cfg = self.s.cfg
        positions = jnp.arange(x_j.shape[1], dtype=jnp.int32)
        proj = jax_project(self.params, x_j, cfg, positions)
        tp = {name: jax_to_torch(value, self.torch_device) for name, value in proj.items()}
        params_t = self.module.param_tree()
        kernels = nsa_torch_ref.dispatch.resolve_all(self.module.backends)
        with torch.no_grad():
            k_cmp_t, v_cmp_t = torch_compress(params_t, tp["k_cmp"], tp["v_cmp"], cfg, kernels)
        mlp = cfg.compress == "mlp"
        k_cmp_j = nsa_jax.compress_kv(proj["k_cmp"], self.params["cmp_k"] if mlp else None, cfg)
        v_cmp_j = nsa_jax.compress_kv(proj["v_cmp"], self.params["cmp_v"] if mlp else None, cfg)
        rows = [_row("kernel", compare("compress k", k_cmp_j, k_cmp_t, self.tol("output"))),
                _row("kernel", compare("compress v", v_cmp_j, v_cmp_t, self.tol("output")))]
        # From here both sides take torch's compressed keys, so each row isolates one kernel.
        k_cmp_shared, v_cmp_shared = (torch_to_jax(k_cmp_t, self.jax_device),
                                      torch_to_jax(v_cmp_t, self.jax_device))
        backend = self.jax_backend
        with torch.no_grad():
            o_cmp_t = kernels["compressed_attention"](tp["q"], k_cmp_t, v_cmp_t, cfg)
            block_idx_t = kernels["select_blocks"](tp["q"], k_cmp_t, cfg)
            o_sel_t = kernels["selected_attention"](tp["q"], tp["k_sel"], tp["v_sel"],
                                                    block_idx_t, cfg.sel_block)
            o_win_t = kernels["sliding_window_attention"](tp["q"], tp["k_win"], tp["v_win"],
                                                          cfg.window)
        o_cmp_j = nsa_jax.compressed_attention(proj["q"], k_cmp_shared, v_cmp_shared, cfg,
                                               backend=backend)
        block_idx_j = nsa_jax.select_blocks(proj["q"], k_cmp_shared, cfg, backend=backend)
        o_sel_j = nsa_jax.selected_attention(proj["q"], proj["k_sel"], proj["v_sel"],
                                             torch_to_jax(block_idx_t, self.jax_device),
                                             cfg.sel_block, backend=backend)
        o_win_j = nsa_jax.sliding_window_attention(proj["q"], proj["k_win"], proj["v_win"],
                                                   cfg.window, backend=backend)
        rows += [_row("kernel", compare("compressed_attention", o_cmp_j, o_cmp_t, self.tol("output"))),
                 self._agreement("kernel", "select_blocks", block_idx_j, block_idx_t),
                 _row("kernel", compare("selected_attention (shared block_idx)", o_sel_j, o_sel_t,
                                        self.tol("output"))),
                 _row("kernel", compare("sliding_window_attention", o_win_j, o_win_t,
                                        self.tol("output")))]
        return rows

    # -- gradients ---------------------------------------------------------------------------
    def gradient_rows(self) -> list[Row]:
        s, cfg = self.s, self.s.cfg
        x_t = self.x_torch[:, : s.seq_len].clone().requires_grad_(True)
        self.module.zero_grad(set_to_none=True)
        y_t = self.module(x_t)
        (y_t.float() * self.dy_torch.float()).sum().backward()

        def loss(params, x):
            y = nsa_jax.nsa_attention(params, x, cfg, backend=self.jax_backend)
            return jnp.sum(y.astype(jnp.float32) * self.dy_jax.astype(jnp.float32))

        grad_p, grad_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(self.params,
                                                                 self.x_jax[:, : s.seq_len])
        rows = [_row("grad", compare("d x", grad_x, x_t.grad, self.tol("grad")))]
        flat = flatten_params(grad_p)
        references = {name: as_float64(p.grad if p.grad is not None else torch.zeros_like(p))
                      for name, p in self.module.named_parameters()}
        everything = np.concatenate([g.ravel() for g in references.values()])
        rms = float(np.sqrt(np.mean(everything ** 2)))
        for name, reference in references.items():
            # A gradient far below the typical size is analytically zero up to rounding:
            # measured against the typical size (the RMS of all gradients) instead.
            rows.append(_row("grad", compare(f"d {name}", flat[name], reference, self.tol("grad"),
                                             typical_norm=rms * np.sqrt(reference.size))))
        return rows

    # -- decode ------------------------------------------------------------------------------
    def decode_rows(self) -> list[Row]:
        """A uniform batch (every prompt seq_len tokens), then a ragged one (prompts of
        different lengths in one prefill, a ragged chunked prefill on the non-empty cache),
        each followed by `decode_steps` steps; JAX on the report's backend."""
        s = self.s
        if s.decode_steps == 0:
            return []
        B = s.batch
        uniform = self._decode_run("", [s.seq_len] * B, None)
        chunk = [1 + b % 3 for b in range(B)]
        prompt = [max(1, s.seq_len - chunk[b] - (b * s.seq_len) // (2 * B)) for b in range(B)]
        return uniform + self._decode_run("ragged ", prompt, chunk)

    def _decode_run(self, label: str, prompt: list[int], chunk: Optional[list[int]]) -> list[Row]:
        s, cfg = self.s, self.s.cfg
        B, total = s.batch, s.seq_len + s.decode_steps
        backend = self.jax_backend
        cache_t = nsa_torch_ref.init_cache(cfg, B, total, TORCH_DTYPES[s.dtype],
                                           self.torch_device)
        cache_j = nsa_jax.init_cache(cfg, B, total, JAX_DTYPES[s.dtype])
        start = np.zeros(B, np.int64)
        ys_j, ys_t = [], []
        for lengths in (prompt, chunk):
            if lengths is None:
                continue
            # Row b's next lengths[b] tokens, padded to the longest with the row's last token.
            index = np.minimum(start[:, None] + np.arange(max(lengths)), total - 1)
            x_t = self.x_torch[torch.arange(B)[:, None], torch.as_tensor(index)]
            with torch.no_grad():
                y_t, cache_t = nsa_torch_ref.prefill(self.module, x_t, cache_t, lengths=lengths)
            y_j, cache_j = nsa_jax.prefill(self.params, torch_to_jax(x_t, self.jax_device), cfg,
                                           cache_j, lengths=jnp.asarray(lengths, jnp.int32),
                                           backend=backend)
            ys_j += [np.asarray(y_j[b, :n]) for b, n in enumerate(lengths)]
            ys_t += [as_float64(y_t[b, :n]) for b, n in enumerate(lengths)]
            start += np.asarray(lengths)
        rows = [_row("decode", compare(f"{label}prefill y", np.concatenate(ys_j),
                                       np.concatenate(ys_t), self.tol("output")))]
        step_j = jax.jit(lambda p, x, c: nsa_jax.decode_step(p, x, cfg, c, return_aux=True,
                                                             backend=backend),
                         donate_argnums=2)
        worst: Optional[Comparison] = None
        agree, reads_ok, reads_detail = [], True, ""
        for i in range(s.decode_steps):
            t = torch.as_tensor(start + i)
            x_t = self.x_torch[torch.arange(B), t][:, None]
            y_t, cache_t, reads_t, aux_t = nsa_torch_ref.decode_step(
                self.module, x_t, cache_t, return_aux=True)
            y_j, cache_j, reads_j, aux_j = step_j(self.params, torch_to_jax(x_t, self.jax_device),
                                                  cache_j)
            c = compare(f"{label}decode y ({s.decode_steps} steps, worst)", y_j, y_t,
                        self.tol("output"))
            if worst is None or not (c.rel_err <= worst.rel_err):
                worst = c
            agree.append(selection_agreement(np.asarray(aux_j["block_idx"]),
                                             aux_t["block_idx"].cpu().numpy()))
            # Per sequence; torch counts `sel` per KV head, JAX the largest over them.
            counts_t = {k: torch.as_tensor(reads_t[k]).reshape(B, -1).max(-1).values.tolist()
                        for k in ("cmp", "sel", "win", "bound")}
            counts_j = {k: np.asarray(reads_j[k]).tolist() for k in ("cmp", "sel", "win", "bound")}
            over = np.asarray(reads_j["total"]) > np.asarray(reads_j["bound"])
            if counts_t != counts_j or over.any():
                reads_ok, reads_detail = False, f"t={t.tolist()}: jax {counts_j} torch {counts_t}"
            elif not reads_detail or i == s.decode_steps - 1:
                reads_detail = f"t={t.tolist()}: " + str({k: v[0] for k, v in counts_j.items()})
        rows.append(_row("decode", worst))
        share = float(np.mean(agree))
        floor = SELECTION_AGREEMENT_MIN.get(s.dtype, 0.99)
        rows.append(Row("decode", f"{label}decode block_idx agreement", share, floor,
                        share >= floor, f"{share:.2%} of rows equal"))
        rows.append(Row("decode", f"{label}decode reads (equal, <= bound)",
                        0.0 if reads_ok else 1.0, 0.0, reads_ok, reads_detail))
        return rows


def run_report(settings: ParitySettings, progress: bool = True) -> list[Row]:
    runner = _Runner(settings)
    rows: list[Row] = []
    stages = (("forward", runner.forward_rows), ("gradients", runner.gradient_rows),
              ("decode", runner.decode_rows))
    for label, stage in stages:
        start = time.perf_counter()
        rows += stage()
        if progress:
            print(f"  {label:<10} {time.perf_counter() - start:6.1f} s", flush=True)
    return rows


def format_table(rows: Sequence[Row]) -> str:
    header = f"{'section':<8} {'quantity':<40} {'error':>10} {'limit':>10}  {'result':<6} detail"
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r.section:<8} {r.name:<40} {r.error:>10.2e} {r.limit:>10.1e}  "
                     f"{'PASS' if r.passed else 'FAIL':<6} {r.detail}")
    failed = [r for r in rows if not r.passed]
    lines.append("-" * len(header))
    lines.append(f"{len(rows) - len(failed)} / {len(rows)} PASS"
                 + (f"; FAIL: {', '.join(r.name for r in failed)}" if failed else ""))
    return "\n".join(lines)


def to_json(settings: ParitySettings, rows: Sequence[Row]) -> str:
    return json.dumps({
        "config": dataclasses.asdict(settings.cfg),
        "settings": {k: v for k, v in dataclasses.asdict(settings).items() if k != "cfg"},
        "versions": {"jax": jax.__version__, "torch": torch.__version__},
        "devices": {"jax": str(jax.devices()[0]), "torch": (torch.cuda.get_device_name()
                                                           if settings.device == "gpu" else "cpu")},
        "rows": [dataclasses.asdict(r) for r in rows],
        "passed": all(r.passed for r in rows),
    }, indent=2, default=float)
