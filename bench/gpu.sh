#!/usr/bin/env bash
# On a CUDA machine: the CUDA tests, then eager vs rpcompile gpus=1 and gpus=4 (four workers sharing the
# GPU) on a ~1.1B Llama in bf16 at seq 2048; each row prints as soon as it is measured.
#   bash bench/gpu.sh            # < 8 min; installs nothing; exits 0 with a message without a GPU
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}

if ! "$PY" -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "bench/gpu.sh: no CUDA GPU visible to torch; nothing to run."
    exit 0
fi
"$PY" -c "import torch; print('GPU:', torch.cuda.get_device_name(), '| torch', torch.__version__)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true

echo "== CUDA tests (timeout 240 s)"
status=0
timeout --signal=INT --kill-after=10 240 "$PY" -m pytest -q -m cuda tests/ || status=$?
if [ "$status" -ne 0 ]; then echo "CUDA tests: exit status $status (124 = timed out)"; fi

echo "== eager vs rpcompile on 1 GPU: gpus=1 and gpus=4 workers (timeout 210 s)"
cstatus=0
PYTHONUNBUFFERED=1 timeout --signal=INT --kill-after=10 210 "$PY" bench/gpu_compare.py --seq 2048 --batch 4 \
    --microbatches 4 --steps 3 --workers 1 4 || cstatus=$?
if [ "$cstatus" -ne 0 ]; then echo "gpu_compare: exit status $cstatus (124 = timed out)"; fi

[ "$status" -eq 0 ] && [ "$cstatus" -eq 0 ]
