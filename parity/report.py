"""The parity report (`python -m parity`): one config, the same weights and inputs in both
frameworks, every branch, output, gradient and decode step compared with a float64 reference.

What is compared, and how (docs/NSA_SPEC.md, "Tolerances"):

- **selection**: each framework's `block_idx` against the float64 reference's, for the layer,
  decode and ragged decode; a differing row is a near-tie or wrong (`parity.selection`); any
  wrong row fails.
- **shared selection**: both frameworks forced onto the reference's `block_idx` (the layer's
  `block_idx=` argument), so every branch output, y, every gradient and every decode output
  measures numerics alone; each is judged by `parity.compare.judge`: both frameworks' distance to
  the float64 reference at most twice the plain same-dtype implementation's.
- **own selection**: each framework with its own selection, judged by the same limits outside
  the near-tie rows (gradients: with the cotangent of those rows zeroed); the report says how
  much of the own-selection error the near-tie rows carry.
- **kernel**: each kernel-level function on the same projected inputs, with the same limits.
"""
from __future__ import annotations

import contextlib
import copy
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
from nsa_torch_ref.module import project as torch_project
from parity.bugs import BUGS, planted
from parity.compare import AGREEMENT, AGREEMENT_EXACT, MULTIPLE, Judged, as_float64, judge
from parity.convert import jax_to_torch, module_to_params, torch_to_jax
from nsa_torch_ref.reference import plain_arithmetic
from parity.selection import MARGIN_FACTOR, Importance, SelectionVerdict, classify, importance

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
JAX_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
FORWARD = ("o_cmp", "o_sel", "o_win", "gates", "y")
BIAS_STD = 0.5


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the report: a judged quantity (errors of jax, torch and the plain
    implementation against float64, and the limit), or a count (selection, decode reads)."""
    section: str
    name: str
    jax: float
    torch: float
    plain: float
    limit: float
    passed: bool
    detail: str = ""
    cross: float = float("nan")        # ||jax - torch|| in the same units
    cross_limit: float = float("nan")


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
    perturb_scale: float = 1.01
    plant: Optional[str] = None  # self-test: a bug of parity.bugs.BUGS planted in JAX's layer

    def __post_init__(self):
        if self.dtype not in TORCH_DTYPES:
            raise ValueError(f"dtype ({self.dtype!r}) must be one of {sorted(TORCH_DTYPES)}")
        if self.device not in ("cpu", "gpu"):
            raise ValueError(f"device ({self.device!r}) must be 'cpu' or 'gpu'")
        if self.plant is not None and self.plant not in BUGS:
            raise ValueError(f"plant ({self.plant!r}) must be one of {sorted(BUGS)}")
        if self.seq_len < 1 or self.batch < 1 or self.decode_steps < 0:
            raise ValueError("seq_len and batch must be >= 1 and decode_steps >= 0")


def _judged_row(section: str, j: Judged, detail: str = "") -> Row:
    if j.nonfinite:
        detail = f"{j.nonfinite} non-finite; " + detail
    if j.zero:
        detail = "zero in exact arithmetic: error vs the gradient scale; " + detail
    return Row(section, j.name, j.jax, j.torch, j.plain, j.limit, j.passed, detail.rstrip("; "),
               j.cross, j.cross_limit)


def _selection_row(section: str, name: str, verdicts: dict[str, SelectionVerdict]) -> Row:
    wrong = {side: v.wrong for side, v in verdicts.items()}
    detail = "; ".join(f"{side}: {v.describe()}" for side, v in verdicts.items())
    return Row(section, name, wrong["jax"], wrong["torch"], float("nan"), 0.0,
               all(v.passed for v in verdicts.values()), detail)


def _torch_backends(name: str) -> dict:
    """{branch: backend} for nsa_torch_ref; a path that does not exist fails clearly."""
    branches = nsa_torch_ref.dispatch.BRANCHES
    unknown = [b for b in branches if name not in nsa_torch_ref.dispatch.available(b)]
    if len(unknown) == len(branches):
        names = set().union(*(nsa_torch_ref.dispatch.available(b) for b in branches))
        raise ValueError(f"torch backend {name!r} does not exist; available: {sorted(names)}")
    # A fast path may cover only some branches (e.g. triton: selection); the rest stay on sdpa.
    return {b: (name if b not in unknown else "sdpa") for b in branches}


def _jax_backend(name: str):
    if name not in nsa_jax.known_backends():
        raise ValueError(f"jax backend {name!r} does not exist; known: "
                         f"{list(nsa_jax.known_backends())}")
    return name if name == "xla" else (name, "xla")


def _rows_mask(mask: np.ndarray, shape: tuple) -> np.ndarray:
    """A `[B, T]` row mask broadcast over a quantity's trailing axes."""
    return np.broadcast_to(mask.reshape(mask.shape + (1,) * (len(shape) - 2)), shape)


class _Runner:
    """Holds every copy of the weights and inputs of one report, and the float64 reference."""

    def __init__(self, s: ParitySettings):
        self.s = s
        cfg = s.cfg
        self.torch_device = torch.device("cuda" if s.device == "gpu" else "cpu")
        self.jax_device = jax.devices("gpu" if s.device == "gpu" else "cpu")[0]
        dtype = TORCH_DTYPES[s.dtype]
        torch.manual_seed(s.seed)
        self.module = nsa_torch_ref.NSAAttention(cfg, backends=_torch_backends(s.torch_backend))
        with torch.no_grad():
            # The layer starts its biases at zero and its block positions near it; drawn at the
            # size of the other inputs here, the report exercises them too (a 1% error in one
            # of them must show).
            for name, p in self.module.named_parameters():
                leaf = name.rpartition(".")[2]
                if leaf.startswith("b") or leaf == "pos":
                    p.normal_(0.0, BIAS_STD)
        self.module.to(device=self.torch_device, dtype=dtype)
        # The plain implementation (the reference on SDPA, run in `plain_arithmetic`) and the
        # float64 reference hold the same weights,
        # the latter as the float64 values of the dtype-rounded ones.
        self.plain = copy.deepcopy(self.module)
        self.plain.backends = {b: ("sdpa",) for b in self.plain.backends}
        self.reference = copy.deepcopy(self.plain).double()
        self.params = module_to_params(self.module, self.jax_device)
        if s.perturb is not None:
            self._perturb(s.perturb, s.perturb_scale)
        rng = np.random.default_rng(s.seed)
        total = s.seq_len + s.decode_steps
        x = rng.standard_normal((s.batch, total, cfg.d_model)).astype(np.float32)
        self.x_torch = torch.from_numpy(x).to(self.torch_device, dtype)
        self.x_jax = torch_to_jax(self.x_torch, self.jax_device)
        cotangent = rng.standard_normal((s.batch, s.seq_len, cfg.d_model)).astype(np.float32)
        self.dy_torch = torch.from_numpy(cotangent).to(self.torch_device, dtype)
        self.jax_backend = _jax_backend(s.jax_backend)
        # One compiled function per selection mode gives the outputs and the gradients.
        self._outputs_and_grads = jax.jit(jax.value_and_grad(self._jax_loss, argnums=(0, 1),
                                                             has_aux=True))
        self._run_reference()

    def _perturb(self, name: str, factor: float) -> None:
        flat = flatten_params(self.params)
        if name not in flat:
            raise ValueError(f"perturb ({name!r}) must name a parameter: {sorted(flat)}")
        outer, _, inner = name.partition(".")
        holder = self.params[outer] if inner else self.params
        key = inner or outer
        holder[key] = holder[key] * factor

    # -- the float64 reference --------------------------------------------------------------------
    def _run_reference(self) -> None:
        """The reference layer over all T + decode_steps tokens (decode's rows are its rows: the
        layer is causal), its gradients kept for later, its block importance."""
        s, cfg = self.s, self.s.cfg
        x = self.x_torch.double()
        self.ref_x = x.clone().requires_grad_(True)
        self.reference.zero_grad(set_to_none=True)
        self.ref_y, ref_aux = self.reference(self.ref_x, return_aux=True)
        self.ref_aux = {k: v.detach() for k, v in ref_aux.items()}
        self.ref_block_idx = ref_aux["block_idx"].cpu().numpy()
        with torch.no_grad():
            params = self.reference.param_tree()
            q, k, v = torch_project(params, x, cfg, torch.arange(x.shape[1], device=x.device))
            k_cmp, _ = torch_compress(params, k["cmp"], v["cmp"], cfg)
        self.importance: Importance = importance(q, k_cmp, cfg)
        self._ref_grads: dict[bytes, dict] = {}

    def reference_grads(self, row_mask: Optional[np.ndarray]) -> dict:
        """The reference's gradients for the cotangent dy (zero on `row_mask` rows, and on the
        decode tokens past T)."""
        key = b"" if row_mask is None else row_mask.tobytes()
        if key not in self._ref_grads:
            dy = self._cotangent(row_mask, torch.float64)
            full = torch.zeros_like(self.ref_y)
            full[:, : self.s.seq_len] = dy
            params = [p for _, p in self.reference.named_parameters()]
            grads = torch.autograd.grad(self.ref_y, [self.ref_x] + params, full,
                                        retain_graph=True, allow_unused=True)
            names = ["d x"] + [f"d {n}" for n, _ in self.reference.named_parameters()]
            out = {n: (g if g is not None else torch.zeros_like(p))
                   for n, g, p in zip(names, grads, [self.ref_x] + params)}
            out["d x"] = out["d x"][:, : self.s.seq_len]
            self._ref_grads[key] = out
        return self._ref_grads[key]

    def _cotangent(self, row_mask: Optional[np.ndarray], dtype: torch.dtype) -> torch.Tensor:
        dy = self.dy_torch.to(dtype)
        if row_mask is not None:
            keep = torch.from_numpy(~row_mask).to(dy.device)[..., None]
            dy = dy * keep
        return dy

    def gradient_scale(self) -> float:
        """The RMS of all the reference's parameter gradients: the absolute scale against which
        a gradient that is zero in exact arithmetic is judged."""
        grads = [g for n, g in self.reference_grads(None).items() if n != "d x"]
        flat = torch.cat([g.reshape(-1) for g in grads])
        return float(flat.pow(2).mean().sqrt())

    # -- each framework ------------------------------------------------------------------------------
    def _jax_loss(self, params, x, dy, block_idx):
        y, aux = nsa_jax.nsa_attention(params, x, self.s.cfg, backend=self.jax_backend,
                                       block_idx=block_idx, return_aux=True)
        return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), (y, aux)

    def run_jax(self, block_idx: Optional[np.ndarray], row_mask: Optional[np.ndarray] = None,
                gradients: bool = True) -> dict:
        """JAX's forward quantities, block_idx and (optionally) gradients."""
        s = self.s
        x = self.x_jax[:, : s.seq_len]
        forced = None if block_idx is None else jnp.asarray(block_idx[:, : s.seq_len])
        dy = torch_to_jax(self._cotangent(row_mask, self.dy_torch.dtype), self.jax_device)
        (_, (y, aux)), (grad_p, grad_x) = self._outputs_and_grads(self.params, x, dy, forced)
        out = {name: aux[name] for name in FORWARD[:-1]}
        out["y"], out["block_idx"] = y, np.asarray(aux["block_idx"])
        if gradients:
            out["d x"] = grad_x
            out.update({f"d {n}": g for n, g in flatten_params(grad_p).items()})
        return out

    def _arithmetic(self, module):
        """The plain implementation computes in the dtype throughout (`plain_arithmetic`)."""
        return plain_arithmetic() if module is self.plain else contextlib.nullcontext()

    def run_torch(self, module, block_idx: Optional[np.ndarray],
                  row_mask: Optional[np.ndarray] = None, gradients: bool = True) -> dict:
        with self._arithmetic(module):
            return self._run_torch(module, block_idx, row_mask, gradients)

    def _run_torch(self, module, block_idx, row_mask, gradients) -> dict:
        s = self.s
        x = self.x_torch[:, : s.seq_len].clone().requires_grad_(gradients)
        forced = (None if block_idx is None
                  else torch.from_numpy(block_idx[:, : s.seq_len]).to(self.torch_device))
        module.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(gradients):
            y, aux = module(x, return_aux=True, block_idx=forced)
        out = {name: aux[name].detach() for name in FORWARD[:-1]}
        out["y"], out["block_idx"] = y.detach(), aux["block_idx"].cpu().numpy()
        if gradients:
            dy = self._cotangent(row_mask, torch.float32)
            (y.float() * dy).sum().backward()
            out["d x"] = x.grad
            out.update({f"d {n}": (p.grad if p.grad is not None else torch.zeros_like(p))
                        for n, p in module.named_parameters()})
        return out

    # -- the report's sections ------------------------------------------------------------------------
    def verdict(self, block_idx: np.ndarray, rows: slice = slice(None)) -> SelectionVerdict:
        imp = Importance(self.importance.score[:, rows], self.importance.z_scale[:, rows])
        return classify(block_idx, self.ref_block_idx[:, rows], imp, self.s.dtype)

    def reference_forward(self) -> dict:
        T = self.s.seq_len
        ref = {name: self.ref_aux[name][:, :T] for name in FORWARD[:-1]}
        ref["y"] = self.ref_y.detach()[:, :T]
        return ref

    def torch_shared(self) -> tuple[dict, dict]:
        """PyTorch's and the plain implementation's runs on the reference's selection (computed
        once: a perturbed or planted JAX side is judged against the same ones)."""
        if not hasattr(self, "_torch_shared"):
            torch_b = self.run_torch(self.module, self.ref_block_idx)
            plain_b = self.run_torch(self.plain, self.ref_block_idx)
            self._torch_shared = (torch_b, plain_b)
        return self._torch_shared

    def shared_judgements(self) -> dict[str, Judged]:
        """Every forward quantity and gradient with both frameworks on the reference's
        selection: numerics alone."""
        s = self.s
        jax_b = self.run_jax(self.ref_block_idx)
        torch_b, plain_b = self.torch_shared()
        out = {name: judge(name, jax_b[name], torch_b[name], plain_b[name], ref, s.dtype)
               for name, ref in self.reference_forward().items()}
        scale = self.gradient_scale()
        for name, ref in self.reference_grads(None).items():
            out[name] = judge(name, jax_b[name], torch_b[name], plain_b[name], ref, s.dtype,
                              scale=scale * np.sqrt(ref.numel()))
        return out

    def jax_rows(self) -> list[Row]:
        """The rows that move with the JAX side alone (its own selection, and both frameworks on
        the shared selection), the PyTorch runs reused: for judging a perturbed or planted JAX
        layer against one reference."""
        T = self.s.seq_len
        verdict = self.verdict(self.run_jax(None, gradients=False)["block_idx"], slice(0, T))
        rows = [Row("selection", "prefill block_idx: wrong rows", verdict.wrong, float("nan"),
                    float("nan"), 0.0, verdict.passed, verdict.describe())]
        rows += [_judged_row("shared", j) for j in self.shared_judgements().values()]
        return rows + self.stage_rows()

    def layer_rows(self) -> list[Row]:
        s = self.s
        T = s.seq_len
        shared = self.shared_judgements()
        rows = [_judged_row("shared", j) for j in shared.values()]
        ref_fwd = self.reference_forward()
        _, plain_b = self.torch_shared()

        # Own selection: judged by the shared limits outside the near-tie rows.
        jax_a = self.run_jax(None, gradients=False)
        torch_a = self.run_torch(self.module, None, gradients=False)
        verdicts = {"jax": self.verdict(jax_a["block_idx"], slice(0, T)),
                    "torch": self.verdict(torch_a["block_idx"], slice(0, T))}
        selection = [_selection_row("selection", "prefill block_idx: wrong rows", verdicts)]
        tie_rows = verdicts["jax"].tie_mask | verdicts["torch"].tie_mask
        for name in FORWARD:
            kept = judge(name, jax_a[name], torch_a[name], plain_b[name], ref_fwd[name], s.dtype,
                         rows=~tie_rows)
            full = judge(name, jax_a[name], torch_a[name], plain_b[name], ref_fwd[name],
                         s.dtype)
            rows.append(self._own_row(kept, full, shared[name], tie_rows, jax_a[name],
                                      torch_a[name], ref_fwd[name]))
        mask = tie_rows if tie_rows.any() else None
        jax_m = self.run_jax(None, row_mask=mask)
        torch_m = self.run_torch(self.module, None, row_mask=mask)
        detail = (f"cotangent zero on the {int(tie_rows.sum())} near-tie rows" if mask is not None
                  else "no near-tie rows")
        scale = self.gradient_scale()
        for name, ref in self.reference_grads(mask).items():
            j = judge(name, jax_m[name], torch_m[name], plain_b[name], ref, s.dtype,
                      scale=scale * np.sqrt(ref.numel()))
            j = dataclasses.replace(j, plain=shared[name].plain, limit=shared[name].limit,
                                    cross_limit=shared[name].cross_limit)
            rows.append(_judged_row("own", j, detail))
        return selection + rows

    def _own_row(self, kept: Judged, full: Judged, shared: Judged, tie_rows: np.ndarray,
                 jax_value, torch_value, reference) -> Row:
        kept = dataclasses.replace(kept, plain=shared.plain, limit=shared.limit,
                                   cross_limit=shared.cross_limit)
        ref = as_float64(reference)
        mask = _rows_mask(tie_rows, ref.shape)
        shares = []
        for value in (jax_value, torch_value):
            diff = (as_float64(value) - ref) ** 2
            total = diff.sum()
            shares.append(diff[mask].sum() / total if total > 0 else 0.0)
        detail = (f"all rows: jax {full.jax:.2e} torch {full.torch:.2e}; the near-tie rows "
                  f"carry {shares[0]:.0%} / {shares[1]:.0%} of it")
        return _judged_row("own", kept, detail)

    # -- stage by stage ------------------------------------------------------------------------
    def _stage_inputs(self) -> dict:
        """The inputs every stage shares: the reference's own inputs of that stage rounded to the
        dtype (projections, compressed keys and values, branch outputs, gates)."""
        if not hasattr(self, "_stage_in"):
            s, cfg = self.s, self.s.cfg
            T = s.seq_len
            dtype = TORCH_DTYPES[s.dtype]
            with torch.no_grad():
                params64 = self.reference.param_tree()
                x64 = self.x_torch[:, :T].double()
                q, k, v = torch_project(params64, x64, cfg, torch.arange(T, device=x64.device))
                k_cmp, v_cmp = torch_compress(params64, k["cmp"], v["cmp"], cfg)
            inputs = {"x": self.x_torch[:, :T], "q": q, "k_cmp_raw": k["cmp"],
                      "v_cmp_raw": v["cmp"], "k_cmp": k_cmp, "v_cmp": v_cmp,
                      **{f"k_{c}": k[c] for c in ("sel", "win")},
                      **{f"v_{c}": v[c] for c in ("sel", "win")},
                      **{name: self.ref_aux[name][:, :T] for name in FORWARD[:-1]}}
            self._stage_in = {n: t.to(dtype) for n, t in inputs.items()}
        return self._stage_in

    def _torch_stages(self, module, p: dict, params) -> dict:
        """Every stage of the layer on the shared inputs p, in PyTorch (module's backends)."""
        cfg = self.s.cfg
        T = p["q"].shape[1]
        kernels = nsa_torch_ref.dispatch.resolve_all(module.backends)
        block_idx = torch.from_numpy(self.ref_block_idx[:, :T]).to(p["q"].device)
        with torch.no_grad():
            q, k, v = torch_project(params, p["x"], cfg, torch.arange(T, device=p["x"].device))
            k_cmp, v_cmp = torch_compress(params, p["k_cmp_raw"], p["v_cmp_raw"], cfg, kernels)
            y, gates = nsa_torch_ref.module.combine(params, p["x"], p["o_cmp"], p["o_sel"],
                                                    p["o_win"], cfg)
            out = dict(
                q=q, **{f"k {c}": k[c] for c in k}, **{f"v {c}": v[c] for c in v},
                **{"gates (stage)": gates, "compress k": k_cmp, "compress v": v_cmp},
                compressed_attention=kernels["compressed_attention"](p["q"], p["k_cmp"],
                                                                     p["v_cmp"], cfg),
                selected_attention=kernels["selected_attention"](p["q"], p["k_sel"], p["v_sel"],
                                                                 block_idx, cfg.sel_block),
                sliding_window_attention=kernels["sliding_window_attention"](
                    p["q"], p["k_win"], p["v_win"], cfg.window),
                **{"output (gated sum, wo)": y})
            out["select_blocks"] = kernels["select_blocks"](p["q"], p["k_cmp"], cfg).cpu().numpy()
        return out

    def _plain_stages(self, p: dict) -> dict:
        with plain_arithmetic():
            return self._torch_stages(self.plain, p, self.plain.param_tree())

    def _jax_stages(self) -> dict:
        """The same stages in JAX, with JAX's own weights."""
        cfg, backend = self.s.cfg, self.jax_backend
        p = {n: torch_to_jax(t, self.jax_device) for n, t in self._stage_inputs().items()}
        T = p["q"].shape[1]
        params = self.params
        mlp = cfg.compress == "mlp"
        proj = jax_project(params, p["x"], cfg, jnp.arange(T, dtype=jnp.int32))
        y, gates = nsa_jax.layer.combine(params, p["x"], cfg, p["o_cmp"], p["o_sel"], p["o_win"])
        block_idx = jnp.asarray(self.ref_block_idx[:, :T])
        out = dict(
            q=proj["q"], **{f"k {c}": proj[f"k_{c}"] for c in ("cmp", "sel", "win")},
            **{f"v {c}": proj[f"v_{c}"] for c in ("cmp", "sel", "win")},
            **{"gates (stage)": gates,
               "compress k": nsa_jax.compress_kv(p["k_cmp_raw"], params["cmp_k"] if mlp else None,
                                                 cfg, backend=backend),
               "compress v": nsa_jax.compress_kv(p["v_cmp_raw"], params["cmp_v"] if mlp else None,
                                                 cfg, backend=backend)},
            compressed_attention=nsa_jax.compressed_attention(p["q"], p["k_cmp"], p["v_cmp"],
                                                              cfg, backend=backend),
            selected_attention=nsa_jax.selected_attention(p["q"], p["k_sel"], p["v_sel"],
                                                          block_idx, cfg.sel_block,
                                                          backend=backend),
            sliding_window_attention=nsa_jax.sliding_window_attention(
                p["q"], p["k_win"], p["v_win"], cfg.window, backend=backend),
            **{"output (gated sum, wo)": y})
        out["select_blocks"] = np.asarray(nsa_jax.select_blocks(p["q"], p["k_cmp"], cfg,
                                                                backend=backend))
        return out

    def stage_rows(self) -> list[Row]:
        """Each stage of the layer (projections, compression, the three branches, selection,
        gates and output projection) on the same dtype-rounded inputs in both frameworks: one
        stage's rounding is all that separates them, so a fault of a few ulps shows here."""
        s = self.s
        T = s.seq_len
        if not hasattr(self, "_torch_stage_out"):
            p = self._stage_inputs()
            p64 = {n: t.double() for n, t in p.items()}
            self._torch_stage_out = (
                self._torch_stages(self.reference, p64, self.reference.param_tree()),
                self._torch_stages(self.module, p, self.module.param_tree()),
                self._plain_stages(p))
        ref, tor, pla = self._torch_stage_out
        jx = self._jax_stages()
        kernels = ("compressed_attention", "selected_attention", "sliding_window_attention")
        exact = AGREEMENT_EXACT if s.dtype in ("bfloat16", "float16") else AGREEMENT
        rows = [_judged_row("stage", judge(name, jx[name], tor[name], pla[name], ref[name],
                                           s.dtype, agreement=(AGREEMENT if name in kernels
                                                               else exact)))
                for name in ref if name != "select_blocks"]
        verdicts = {"jax": self.verdict(jx["select_blocks"], slice(0, T)),
                    "torch": self.verdict(tor["select_blocks"], slice(0, T))}
        rows.append(_selection_row("stage", "select_blocks: wrong rows", verdicts))
        return rows

    # -- decode --------------------------------------------------------------------------------
    def decode_rows(self) -> list[Row]:
        """A uniform batch (every prompt seq_len tokens), then a ragged one (prompts of
        different lengths in one prefill, a ragged chunked prefill on the non-empty cache),
        each followed by `decode_steps` steps; JAX on the report's backend. Every output row is
        the reference layer's row at the same position."""
        s = self.s
        if s.decode_steps == 0:
            return []
        B = s.batch
        uniform = self._decode_run("", [s.seq_len] * B, None)
        chunk = [1 + b % 3 for b in range(B)]
        prompt = [max(1, s.seq_len - chunk[b] - (b * s.seq_len) // (2 * B)) for b in range(B)]
        return uniform + self._decode_run("ragged ", prompt, chunk)

    def _decode_run(self, label: str, prompt: list[int], chunk: Optional[list[int]]) -> list[Row]:
        s = self.s
        runs = {}
        for forced in (False, True):
            runs[forced] = {"jax": self._decode_jax(prompt, chunk, forced),
                            "torch": self._decode_torch(self.module, prompt, chunk, forced)}
        with plain_arithmetic():
            plain = self._decode_torch(self.plain, prompt, chunk, True)
        b_index, t_index = runs[True]["jax"]["positions"]
        ref_y = as_float64(self.ref_y)[b_index, t_index]
        n_prompt = runs[True]["jax"]["prefill_rows"]
        # Every row's selection (prompts, the ragged chunk, the steps) against the reference's.
        imp = Importance(self.importance.score[b_index, t_index][None],
                         self.importance.z_scale[b_index, t_index][None])
        verdicts = {side: classify(runs[False][side]["block_idx"][None],
                                   self.ref_block_idx[b_index, t_index][None], imp, s.dtype)
                    for side in ("jax", "torch")}
        tie = (verdicts["jax"].tie_mask | verdicts["torch"].tie_mask)[0]
        rows = [_selection_row("selection", f"{label}decode block_idx: wrong rows", verdicts)]
        for name, part in (("prefill y", slice(0, n_prompt)),
                           (f"decode y ({s.decode_steps} steps)", slice(n_prompt, None))):
            y = {forced: {side: runs[forced][side]["y"][part] for side in ("jax", "torch")}
                 for forced in (False, True)}
            shared = judge(f"{label}{name}", y[True]["jax"], y[True]["torch"], plain["y"][part],
                           ref_y[part], s.dtype)
            rows.append(_judged_row("shared", shared))
            keep = ~tie[part]
            own = judge(f"{label}{name}", y[False]["jax"][keep], y[False]["torch"][keep],
                        plain["y"][part][keep], ref_y[part][keep], s.dtype)
            own = dataclasses.replace(own, plain=shared.plain, limit=shared.limit,
                                      cross_limit=shared.cross_limit)
            rows.append(_judged_row("own", own, f"{int((~keep).sum())} near-tie rows left out"))
        rows.append(self._reads_row(label, runs[False]))
        return rows

    def _decode_step_fn(self):
        if not hasattr(self, "_step"):
            cfg, backend = self.s.cfg, self.jax_backend
            self._step = jax.jit(lambda p, x, c, b: nsa_jax.decode_step(
                p, x, cfg, c, return_aux=True, backend=backend, block_idx=b), donate_argnums=2)
        return self._step

    def _decode_inputs(self, prompt, chunk):
        """(x rows, lengths, the positions they hold) of each prefill call."""
        s = self.s
        B, total = s.batch, s.seq_len + s.decode_steps
        start = np.zeros(B, np.int64)
        for lengths in (prompt, chunk):
            if lengths is None:
                continue
            # Prompts are padded to seq_len, so the uniform and ragged ones share a compile.
            width = s.seq_len if start.sum() == 0 else max(lengths)
            index = np.minimum(start[:, None] + np.arange(width), total - 1)
            yield index, lengths
            start = start + np.asarray(lengths)

    def _decode_jax(self, prompt, chunk, forced: bool) -> dict:
        """JAX's prefill(s) and steps: y and block_idx of every real row `[N, ...]`, in the
        order of `positions` ((b, t) index arrays), prompt rows first."""
        s, cfg = self.s, self.s.cfg
        B, total = s.batch, s.seq_len + s.decode_steps
        cache = nsa_jax.init_cache(cfg, B, total, JAX_DTYPES[s.dtype])
        ys, idx, b_pos, t_pos, reads = [], [], [], [], []
        start = np.zeros(B, np.int64)
        for index, lengths in self._decode_inputs(prompt, chunk):
            x = self.x_jax[np.arange(B)[:, None], index]
            given = (jnp.asarray(self.ref_block_idx[np.arange(B)[:, None], index]) if forced
                     else None)
            y, cache, aux = nsa_jax.prefill(self.params, x, cfg, cache,
                                            lengths=jnp.asarray(lengths, jnp.int32),
                                            backend=self.jax_backend, block_idx=given,
                                            return_aux=True)
            for b, n in enumerate(lengths):
                ys.append(as_float64(y[b, :n]))
                idx.append(np.asarray(aux["block_idx"][b, :n]))
                b_pos += [b] * n
                t_pos += list(range(int(start[b]), int(start[b]) + n))
            start = start + np.asarray(lengths)
        prefill_rows = len(b_pos)
        step = self._decode_step_fn()
        for i in range(s.decode_steps):
            t = start + i
            x = self.x_jax[np.arange(B), t][:, None]
            given = jnp.asarray(self.ref_block_idx[np.arange(B), t][:, None]) if forced else None
            y, cache, step_reads, aux = step(self.params, x, cache, given)
            ys.append(as_float64(y[:, 0]))
            idx.append(np.asarray(aux["block_idx"])[:, 0])
            b_pos += list(range(B))
            t_pos += t.tolist()
            reads.append((t, {k: np.asarray(v) for k, v in step_reads.items()}))
        return dict(y=np.concatenate(ys), block_idx=np.concatenate(idx),
                    positions=(np.array(b_pos), np.array(t_pos)), prefill_rows=prefill_rows,
                    reads=reads)

    def _decode_torch(self, module, prompt, chunk, forced: bool) -> dict:
        s, cfg = self.s, self.s.cfg
        B, total = s.batch, s.seq_len + s.decode_steps
        cache = nsa_torch_ref.init_cache(cfg, B, total, TORCH_DTYPES[s.dtype], self.torch_device)
        ys, idx, reads = [], [], []
        start = np.zeros(B, np.int64)
        for index, lengths in self._decode_inputs(prompt, chunk):
            x = self.x_torch[torch.arange(B)[:, None], torch.as_tensor(index)]
            given = (torch.from_numpy(self.ref_block_idx[np.arange(B)[:, None], index])
                     if forced else None)
            y, cache, aux = nsa_torch_ref.prefill(module, x, cache, lengths=lengths,
                                                  block_idx=given, return_aux=True)
            ys += [as_float64(y[b, :n]) for b, n in enumerate(lengths)]
            idx += [aux["block_idx"][b, :n].cpu().numpy() for b, n in enumerate(lengths)]
            start = start + np.asarray(lengths)
        for i in range(s.decode_steps):
            t = start + i
            x = self.x_torch[torch.arange(B), torch.as_tensor(t)][:, None]
            given = (torch.from_numpy(self.ref_block_idx[np.arange(B), t][:, None]) if forced
                     else None)
            y, cache, step_reads, aux = nsa_torch_ref.decode_step(module, x, cache,
                                                                   return_aux=True,
                                                                   block_idx=given)
            ys.append(as_float64(y[:, 0]))
            idx.append(aux["block_idx"][:, 0].cpu().numpy())
            reads.append(step_reads)
        return dict(y=np.concatenate(ys), block_idx=np.concatenate(idx), reads=reads)

    def _reads_row(self, label: str, run: dict) -> Row:
        """The tokens each step reads: equal in both frameworks and within the paper's bound."""
        B = self.s.batch
        ok, detail = True, ""
        for (t, reads_j), reads_t in zip(run["jax"]["reads"], run["torch"]["reads"]):
            # Per sequence; torch counts `sel` per KV head, JAX the largest over them.
            counts_t = {k: torch.as_tensor(reads_t[k]).reshape(B, -1).max(-1).values.tolist()
                        for k in ("cmp", "sel", "win", "bound")}
            counts_j = {k: reads_j[k].tolist() for k in ("cmp", "sel", "win", "bound")}
            if counts_t != counts_j or (reads_j["total"] > reads_j["bound"]).any():
                ok, detail = False, f"t={t.tolist()}: jax {counts_j} torch {counts_t}"
                break
            detail = f"t={t.tolist()}: " + str({k: v[0] for k, v in counts_j.items()})
        return Row("decode", f"{label}decode reads (equal, <= bound)", 0.0 if ok else 1.0,
                   float("nan"), float("nan"), 0.0, ok, detail)


def run_report(settings: ParitySettings, progress: bool = True) -> list[Row]:
    with planted(settings.plant) if settings.plant else contextlib.nullcontext():
        return _run_report(settings, progress)


def _run_report(settings: ParitySettings, progress: bool) -> list[Row]:
    start = time.perf_counter()
    runner = _Runner(settings)
    if progress:
        print(f"  {'reference':<10} {time.perf_counter() - start:6.1f} s", flush=True)
    rows: list[Row] = []
    stages = (("layer", runner.layer_rows), ("stages", runner.stage_rows),
              ("decode", runner.decode_rows))
    for label, stage in stages:
        start = time.perf_counter()
        rows += stage()
        if progress:
            print(f"  {label:<10} {time.perf_counter() - start:6.1f} s", flush=True)
    return rows


SECTION_TITLES = {
    "selection": "Selection against the float64 reference (wrong rows must be 0)",
    "shared": "Both frameworks on the reference's selection (numerics alone)",
    "own": "Each framework on its own selection, outside the near-tie rows",
    "stage": "Each stage on the same dtype-rounded inputs (the two frameworks must agree)",
    "decode": "Decode bookkeeping",
}


def format_table(rows: Sequence[Row], settings: Optional[ParitySettings] = None) -> str:
    """The report as text: a legend, one block per section, one verdict line."""
    lines = []
    if settings is not None:
        lines += [
            f"Errors: distance to a float64 reference on the same weights and inputs "
            f"(relative L2). Limits: each framework within {MULTIPLE[settings.dtype]:g}x the "
            f"error of the plain "
            f"{settings.dtype} implementation (the PyTorch reference computing in that dtype "
            f"throughout); on one stage's "
            f"shared inputs, the two within {AGREEMENT:g}x it of each other ({AGREEMENT_EXACT:g}x "
            f"for stages without an attention kernel). Near-tie: the blocks that differ score "
            f"within {MARGIN_FACTOR:g} u Z of the n-th best. Reasoning: docs/NSA_SPEC.md, "
            f"\"Tolerances\".", ""]
    header = (f"{'quantity':<34} {'jax':>9} {'torch':>9} {'plain':>9} {'limit':>9} "
              f"{'jax-torch':>9} {'limit':>9}  {'result':<6} detail")
    for section, title in SECTION_TITLES.items():
        part = [r for r in rows if r.section == section]
        if not part:
            continue
        lines += [title, header, "-" * len(header)]
        for r in part:
            if section in ("selection", "decode"):
                numbers = f"{r.jax:>9g} {r.torch:>9g} {'':>9} {r.limit:>9g} {'':>9} {'':>9}"
            else:
                numbers = (f"{r.jax:>9.2e} {r.torch:>9.2e} {r.plain:>9.2e} {r.limit:>9.2e} "
                           f"{r.cross:>9.2e} {r.cross_limit:>9.2e}")
            lines.append(f"{r.name:<34} {numbers}  {'PASS' if r.passed else 'FAIL':<6} "
                         f"{r.detail}")
        lines.append("")
    failed = [r for r in rows if not r.passed]
    verdict = "PASS" if not failed else "FAIL"
    lines.append(f"{verdict}: {len(rows) - len(failed)} / {len(rows)} rows pass"
                 + (f"; failing: {', '.join(f'{r.section}/{r.name}' for r in failed)}"
                    if failed else ""))
    return "\n".join(lines)


def to_json(settings: ParitySettings, rows: Sequence[Row]) -> str:
    return json.dumps({
        "config": dataclasses.asdict(settings.cfg),
        "settings": {k: v for k, v in dataclasses.asdict(settings).items() if k != "cfg"},
        "rule": {"multiple": MULTIPLE[settings.dtype], "agreement": AGREEMENT,
                 "agreement_exact": AGREEMENT_EXACT, "margin_factor": MARGIN_FACTOR},
        "versions": {"jax": jax.__version__, "torch": torch.__version__},
        "devices": {"jax": str(jax.devices()[0]), "torch": (torch.cuda.get_device_name()
                                                           if settings.device == "gpu" else "cpu")},
        "rows": [dataclasses.asdict(r) for r in rows],
        "passed": all(r.passed for r in rows),
    }, indent=2, default=float)
