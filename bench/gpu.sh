#!/usr/bin/env bash
# On a CUDA machine: the CUDA tests (tests/runtime/test_runtime_cuda.py), then eager vs rpcompile gpus=1 and gpus=4
# (four workers sharing the GPU) on a ~1.1B Llama in bf16 at seq 2048; each row prints as soon as it is measured.
#   bash bench/gpu.sh            # < 8 min; installs nothing
# Without a GPU it exits 0 saying so. When nvidia-smi lists a GPU that torch cannot use (a driver too old
# for the wheel, a CPU-only wheel, the wrong interpreter: set PYTHON=...), it exits 1 saying why: a run
# that tested nothing must not look like a pass.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}

cuda=0  # one interpreter start: 0 torch sees a GPU, 1 it does not, 2 it cannot import torch
"$PY" -c "import sys
try:
    import torch
except Exception:
    sys.exit(2)
sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null || cuda=$?
if [ "$cuda" -ne 0 ] && [ "$cuda" -ne 1 ]; then
    echo "bench/gpu.sh: '$PY' could not import torch or query CUDA (exit $cuda); nothing was run" \
         "(set PYTHON to the project's interpreter)." >&2
    exit 1
fi
if [ "$cuda" -eq 1 ]; then
    listed=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
    if [ "${listed:-0}" -gt 0 ]; then
        echo "bench/gpu.sh: nvidia-smi lists ${listed} GPU(s) but torch cannot use CUDA; nothing was run." >&2
        nvidia-smi -L 2>&1 | sed 's/^/  nvidia-smi: /' >&2 || true
        "$PY" - >&2 2>&1 <<'EOF' || true
import torch
print(f"  torch {torch.__version__} (built for CUDA {torch.version.cuda}) at {torch.__file__}")
try:
    torch.cuda.init()
except Exception as e:  # the reason torch gives
    print(f"  torch.cuda.init(): {type(e).__name__}: {e}")
EOF
        echo "bench/gpu.sh: use a torch wheel built for this driver's CUDA, or set PYTHON to the right interpreter." >&2
        exit 1
    fi
    echo "bench/gpu.sh: no CUDA GPU visible to torch; nothing to run."
    exit 0
fi
"$PY" -c "import torch; print('GPU:', torch.cuda.get_device_name(), '| torch', torch.__version__)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true

echo "== CUDA tests: tests/runtime/test_runtime_cuda.py (timeout 240 s)"
status=0  # by path: an import error in another test module cannot abort it, and nothing else is collected
timeout --signal=INT --kill-after=10 240 "$PY" -m pytest -q -rs -p no:cacheprovider tests/runtime/test_runtime_cuda.py \
    || status=$?
if [ "$status" -ne 0 ]; then echo "CUDA tests: exit status $status (124 = timed out)"; fi

echo "== eager vs rpcompile on 1 GPU: gpus=1 and gpus=4 workers (timeout 210 s)"
cstatus=0
PYTHONUNBUFFERED=1 timeout --signal=INT --kill-after=10 210 "$PY" bench/gpu_compare.py --seq 2048 --batch 4 \
    --microbatches 4 --steps 3 --workers 1 4 || cstatus=$?
if [ "$cstatus" -ne 0 ]; then echo "gpu_compare: exit status $cstatus (124 = timed out)"; fi

[ "$status" -eq 0 ] && [ "$cstatus" -eq 0 ]
