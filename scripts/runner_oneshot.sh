#!/usr/bin/env bash
# One-shot GPU runner: everything the project measures on a GPU, in one run of under 10 minutes.
#
#   bash scripts/runner_oneshot.sh
#
# Steps (each with its own log under $ARTIFACTS_DIR/logs/ and its own time limit; a failing or
# timed-out step is recorded in the summary and the run goes on):
#   wheels      install the carried wheels of .whl/ (flash_attn3_jax, fla-core, ...) into
#               /tmp/site without network and put it on PYTHONPATH
#   env         nvidia-smi, versions, commit -> env.json, nvidia-smi.txt, pip_freeze.txt
#   routing     python -m nsa_torch_ref.fast -> routing.json
#   sanity      python scripts/gpu_sanity.py
#   parity_*    python -m parity --device gpu (XLA vs SDPA, then Pallas vs Triton/FA-2, bf16)
#   pytest_gpu  python -m pytest -m gpu tests (the GPU test matrix) -> pytest_gpu.xml
#   fla_agreement  bench/fla_agreement.py: our fla-configuration core and fla's parallel_nsa on
#               the same inputs (outputs, gradients, selections) -> bench/fla_agreement.csv
#   prefill     bench/bench_prefill.py at a short S list -> bench/prefill.{csv,png}
#   decode      bench/bench_decode.py at a short S list -> bench/decode.{csv,png}
#   multi_gpu   with 2 or more GPUs (nvidia-smi -L): tests/gpu/test_gpu_sharding.py (the sharded
#               layer against one GPU) -> pytest_multi_gpu.xml, then bench/bench_scaling.py
#               (Pallas path, data and model axes, MULTI_GPU_TOKENS) -> bench/scaling.csv;
#               with one GPU "skipped". pytest_gpu leaves that test file to this step.
#   showcase    examples/train_recall.py at a reduced size (T 1024, its own time budget) ->
#               showcase/{results.md,curves.csv,summary.csv,curves.png,stats.json}
#   summaries   the benches' tables -> bench/*_summary.txt
# then summary.txt / summary.json (one line per step: status, exit code, seconds).
#
# Budget (seconds seen on an H100/H200, bench/RESULTS.md): setup, routing, sanity and both parity
# reports ~105, the GPU test matrix ~185 (these five run concurrently: RUNNER_PARALLEL), one
# prefill row at 8k ~20-60 (its own process), one decode point ~25 plus start-up. The default S
# lists are short so that all steps fit in 10 minutes; the 32k/64k figures come from running the
# benches directly.
#
# Environment (all optional):
#   ARTIFACTS_DIR   where everything goes (default artifacts/runner/<commit>)
#   RUNNER_TAR      also pack ARTIFACTS_DIR into this one .tar.gz (the device tool returns at most
#                   8 files, 2 folders deep: point RUNNER_TAR at $OUT and ARTIFACTS_DIR elsewhere)
#   COMMIT          commit label (default: git's HEAD, "-dirty" when tracked files differ from it;
#                   export it on the device, whose .git can be older than the files)
#   RUNNER_BUDGET_S total seconds for all steps (default 570); a step gets at most what is left
#   RUNNER_STEPS    comma list of steps to run (default: all, in the order above)
#   RUNNER_PARALLEL 1 (default): routing, sanity, parity_* and pytest_gpu run concurrently;
#                   0: one after the other
#   PYTHON          interpreter (default python3)
#   PREFILL_S, PREFILL_ROWS, PREFILL_ITERS, PREFILL_ARGS   bench_prefill settings
#   DECODE_S, DECODE_B, DECODE_ITERS, DECODE_ARGS          bench_decode settings
#                   (*_ARGS: more flags, spelled as every bench spells them, bench/common.py:
#                   e.g. "--preset paper" or "--dk 192 --dv 128", "--H 64 --G 4", "--l_sel 64")
#   SHOWCASE_BUDGET_S, SHOWCASE_ARGS                       train_recall's budget and arguments
#   MULTI_GPU_TOKENS, MULTI_GPU_ARGS                       bench_scaling's T list and more flags
#   PYTEST_ARGS     extra pytest arguments
#   FLA_AGREEMENT_S, FLA_AGREEMENT_DTYPES, FLA_AGREEMENT_ARGS  fla_agreement settings
set -u
cd "$(dirname "$0")/.."
REPO=$(pwd)
PY=${PYTHON:-python3}
START=$(date +%s)
BUDGET=${RUNNER_BUDGET_S:-570}

# bench.common.git_commit: HEAD, "-dirty" when tracked files differ from it, else "unknown"
COMMIT=${COMMIT:-$("$PY" -c "from bench import common; print(common.git_commit())" 2>/dev/null)}
COMMIT=${COMMIT:-unknown}
export COMMIT
ART=${ARTIFACTS_DIR:-artifacts/runner/$COMMIT}
mkdir -p "$ART/logs" "$ART/bench"
ART=$(cd "$ART" && pwd)
SUMMARY_TSV="$ART/logs/.steps.tsv"
: >"$SUMMARY_TSV"

PREFILL_S=${PREFILL_S:-8k}
# fla_parallel_nsa is not a default row: its Triton autotuning alone outlasts a row's 90 s share;
# add it with PREFILL_ROWS=...,fla_parallel_nsa and a larger RUNNER_BUDGET_S, or run
# bench/bench_prefill.py directly.
PREFILL_ROWS=${PREFILL_ROWS:-nsa_jax_pallas,nsa_jax_pallas_fla,nsa_torch,fa3_full,cudnn_full}
PREFILL_ITERS=${PREFILL_ITERS:-5}
DECODE_S=${DECODE_S:-16k}
DECODE_B=${DECODE_B:-32}
DECODE_ITERS=${DECODE_ITERS:-20}
SHOWCASE_BUDGET_S=${SHOWCASE_BUDGET_S:-100}
FLA_AGREEMENT_S=${FLA_AGREEMENT_S:-8k}
FLA_AGREEMENT_DTYPES=${FLA_AGREEMENT_DTYPES:-bfloat16,float32}
MULTI_GPU_TOKENS=${MULTI_GPU_TOKENS:-64k}
STEPS=${RUNNER_STEPS:-wheels,env,routing,sanity,parity_xla,parity_fast,pytest_gpu,fla_agreement,prefill,decode,multi_gpu,showcase,summaries}

export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}

wanted() { case ",$STEPS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

# run_step NAME LIMIT_S COMMAND...: run with a time limit, log to logs/NAME.log, record status.
run_step() {
  local name=$1 limit=$2
  shift 2
  wanted "$name" || return 0
  local now left status rc t0 t1
  now=$(date +%s)
  left=$((BUDGET - (now - START) - 15))
  if [ "$left" -lt 20 ]; then
    printf '%s\tskipped\t-\t0\tbudget spent\n' "$name" >>"$SUMMARY_TSV"
    echo "[runner] $name: skipped (budget spent)"
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "[runner] $name (limit ${limit}s)"
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >"$ART/logs/$name.log" 2>&1
  rc=$?
  t1=$(date +%s)
  case $rc in
    0) status=ok ;;
    124 | 137) status=timeout ;;
    *) status=failed ;;
  esac
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$((t1 - t0))" "logs/$name.log" >>"$SUMMARY_TSV"
  echo "[runner] $name: $status (rc $rc, $((t1 - t0))s)"
  return 0
}

install_wheels() {
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "no .whl/ here: peer rows that need flash_attn3_jax / fla will print 'skipped'"
    return 0
  fi
  "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || return 1
  ls /tmp/site
}
if wanted wheels; then
  run_step wheels 120 bash -c "$(declare -f install_wheels); PY='$PY' install_wheels"
  [ -d /tmp/site ] && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

collect_env() {
  nvidia-smi >"$ART/nvidia-smi.txt" 2>&1 || echo "nvidia-smi failed" >>"$ART/nvidia-smi.txt"
  "$PY" -m pip freeze >"$ART/pip_freeze.txt" 2>&1 || true
  "$PY" - "$ART/env.json" <<'EOF'
import json, sys
from bench import common
env = common.environment()
try:
    import jax
    env["jax_devices"] = [str(d) for d in jax.devices()]
except Exception as exc:
    env["jax_devices"] = f"error: {exc}"
try:
    import torch
    env["torch_cuda"] = {"available": torch.cuda.is_available(), "cuda": torch.version.cuda,
                         "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
except Exception as exc:
    env["torch_cuda"] = f"error: {exc}"
with open(sys.argv[1], "w") as f:
    json.dump(env, f, indent=2, sort_keys=True)
print(json.dumps(env, indent=2, sort_keys=True))
EOF
}
run_step env 90 bash -c "$(declare -f collect_env); ART='$ART' PY='$PY' collect_env"

# The correctness steps are not timings: with RUNNER_PARALLEL=1 (default) they share the GPU and
# run at once, which takes the run from ~12 to under 10 minutes. The benchmarks run afterwards,
# alone on the GPU, one after the other.
correctness_step() { if [ "${RUNNER_PARALLEL:-1}" = 1 ]; then run_step "$@" & else run_step "$@"; fi; }
correctness_step routing 60 bash -c "set -o pipefail; '$PY' -m nsa_torch_ref.fast | tee '$ART/routing.json'"
correctness_step sanity 120 "$PY" scripts/gpu_sanity.py
correctness_step parity_xla 150 "$PY" -m parity --device gpu --json "$ART/parity_xla_sdpa.json"
correctness_step parity_fast 150 "$PY" -m parity --device gpu --dtype bfloat16 \
  --jax-backend pallas --torch-backend triton --json "$ART/parity_pallas_triton_bf16.json"
# shellcheck disable=SC2086
correctness_step pytest_gpu 300 "$PY" -m pytest -m gpu tests -q -rs -p no:cacheprovider \
  --ignore=tests/gpu/test_gpu_sharding.py --junitxml="$ART/pytest_gpu.xml" ${PYTEST_ARGS:-}
# A correctness check, not a timing (fla's row is timed by the prefill step). fla's kernels run at their first Triton
# configuration: autotuning them (some 80 configurations, each compiled, per dtype) would take
# minutes and changes no figure beyond rounding; FLA_AGREEMENT_ARGS="--fla_configs autotune"
# runs them as shipped.
# shellcheck disable=SC2086
correctness_step fla_agreement 240 "$PY" bench/fla_agreement.py --S_list "$FLA_AGREEMENT_S" \
  --dtypes "$FLA_AGREEMENT_DTYPES" --fla_configs first --out "$ART/bench" \
  ${FLA_AGREEMENT_ARGS:-}
wait
# shellcheck disable=SC2086
run_step prefill 200 "$PY" bench/bench_prefill.py --S_list "$PREFILL_S" --rows "$PREFILL_ROWS" \
  --iters "$PREFILL_ITERS" --warmup 1 --repeats 3 --row_timeout 90 --no_progress \
  --out "$ART/bench" ${PREFILL_ARGS:-}
# shellcheck disable=SC2086
run_step decode 100 "$PY" bench/bench_decode.py --S_list "$DECODE_S" --B "$DECODE_B" \
  --iters "$DECODE_ITERS" --warmup 2 --repeats 3 --no_progress --csv "$ART/bench/decode.csv" \
  ${DECODE_ARGS:-}

# Several GPUs: the sharded layer's correctness against one GPU, then its scaling (each point
# compiles the layer, ~60 s a mesh at 64k on 2 H100s, bench/RESULTS.md).
multi_gpu() {
  set -o pipefail
  "$PY" -m pytest tests/gpu/test_gpu_sharding.py -q -rs -p no:cacheprovider \
    --junitxml="$ART/pytest_multi_gpu.xml" || return 1
  # shellcheck disable=SC2086
  "$PY" bench/bench_scaling.py --preset bench --dtype bfloat16 --backend pallas \
    --meshes 1x1x1,1x2x1,2x1x1,1x4x1,4x1x1 --tokens "$MULTI_GPU_TOKENS" --iters 3 --warmup 1 --repeats 2 --isolate \
    --csv "$ART/bench/scaling.csv" ${MULTI_GPU_ARGS:-}
}
gpus=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU" || true)
if wanted multi_gpu && [ "${gpus:-0}" -lt 2 ]; then
  printf '%s\tskipped\t-\t0\t%s GPU(s): needs 2 or more\n' multi_gpu "${gpus:-0}" >>"$SUMMARY_TSV"
  echo "[runner] multi_gpu: skipped (${gpus:-0} GPU(s))"
else
  run_step multi_gpu 900 bash -c "$(declare -f multi_gpu); ART='$ART' PY='$PY' \
    MULTI_GPU_TOKENS='$MULTI_GPU_TOKENS' MULTI_GPU_ARGS='${MULTI_GPU_ARGS:-}' multi_gpu"
fi

# The training showcase: full / window / NSA on needle and MQAR at T 1024. The script shares its
# own budget among its runs (compiles included); that budget shrinks to what the runner has left
# (less 75 s for the last run's decode check, the outputs and the summaries), so the step's limit
# is only a backstop. With the default RUNNER_BUDGET_S the earlier steps may leave it little:
# RUNNER_STEPS=env,showcase,summaries runs it alone.
showcase_budget=$((BUDGET - ($(date +%s) - START) - 75))
[ "$showcase_budget" -gt "$SHOWCASE_BUDGET_S" ] && showcase_budget=$SHOWCASE_BUDGET_S
[ "$showcase_budget" -lt 30 ] && showcase_budget=30
# shellcheck disable=SC2086
run_step showcase $((showcase_budget + 60)) "$PY" examples/train_recall.py --T 1024 \
  --steps 400 --eval_every 50 --budget_s "$showcase_budget" --out "$ART/showcase" \
  ${SHOWCASE_ARGS:-}

make_summaries() {
  [ -f "$ART/bench/prefill_summary.txt" ] && cat "$ART/bench/prefill_summary.txt"
  echo
  if [ -f "$ART/bench/decode.csv" ]; then
    "$PY" bench/summarize_decode_csv.py "$ART/bench/decode.csv" | tee "$ART/bench/decode_table.txt"
  fi
}
run_step summaries 30 bash -c "$(declare -f make_summaries); ART='$ART' PY='$PY' make_summaries"

# Final summary: one line per step; also JSON for tools.
{
  echo "runner: commit $COMMIT, $(date -u +%Y-%m-%dT%H:%M:%SZ), $(( $(date +%s) - START ))s"
  echo "gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null \
    | head -n 1 || true)"
  printf '%-12s %-8s %-4s %6s  %s\n' step status rc secs log
  while IFS=$'\t' read -r name status rc secs log; do
    printf '%-12s %-8s %-4s %6s  %s\n' "$name" "$status" "$rc" "$secs" "$log"
  done <"$SUMMARY_TSV"
} >"$ART/summary.txt"
"$PY" - "$SUMMARY_TSV" "$ART/summary.json" "$COMMIT" <<'EOF'
import json, sys
steps = []
with open(sys.argv[1]) as f:
    for line in f:
        name, status, rc, secs, log = line.rstrip("\n").split("\t")
        steps.append({"step": name, "status": status, "rc": rc, "seconds": secs, "log": log})
with open(sys.argv[2], "w") as f:
    json.dump({"commit": sys.argv[3], "steps": steps}, f, indent=2)
EOF
rm -f "$SUMMARY_TSV"

echo
cat "$ART/summary.txt"
for table in "$ART/bench/fla_agreement_summary.txt" "$ART/bench/prefill_summary.txt" \
  "$ART/bench/decode_table.txt" "$ART/showcase/results.md"; do
  [ -f "$table" ] && { echo; cat "$table"; }
done

if [ -n "${RUNNER_TAR:-}" ]; then
  mkdir -p "$(dirname "$RUNNER_TAR")"
  tar -czf "$RUNNER_TAR" -C "$(dirname "$ART")" "$(basename "$ART")" && echo "packed $ART into $RUNNER_TAR"
fi
exit 0
