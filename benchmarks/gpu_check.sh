#!/usr/bin/env bash
# The GPU check: on a machine with one GPU and this project installed (a CUDA or ROCm build
# of torch), run the trainer benchmark in bf16, a two-step micro pipeline on the GPU and the
# rehearsal of its plan beside the run's real peak memory; one JSON file,
# benchmarks/results/gpu_check.json, records every step (failures included) and nvidia-smi.
# Under 8 minutes. What each step does: benchmarks/gpu_check.py.
#
#   bash benchmarks/gpu_check.sh                 # on the GPU machine
#   GPU_CHECK_DRY=1 bash benchmarks/gpu_check.sh # the same steps on the CPU, tiny (tests)
#
# The interpreter: $PYTHON, else the checkout's .venv, else python3.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then
  py="$PYTHON"
elif [ -x .venv/bin/python ]; then
  py=.venv/bin/python
else
  py=python3
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" MLFLOW_DISABLE_TELEMETRY=true
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# The driver's own limit: its steps' timeouts add up to 8 minutes on a GPU.
exec timeout --kill-after=10 "${GPU_CHECK_TIMEOUT:-600}" "$py" benchmarks/gpu_check.py "$@"
