#!/usr/bin/env bash
# On the GPU machine, in one lease: the mixture-of-experts checks (tests/gpu/test_moe_gpu.py) and the
# traced memory estimate against real runs of MoE models cut to 4 blocks (bench/memory_vs_gpu.py with
# bench/cut_flavors.py), most important first, each under its own time limit. Writes to $OUT (or
# ./gpu-out): device.txt, pytest.log, gpu_measurements.jsonl, memory.log, moe_memory_vs_gpu.jsonl.
#   apps/gpu/moe_checks.sh            (after apps/gpu/fetch_wheels.sh here; carry .whl)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/device.txt" 2>&1
export PYTHONUNBUFFERED=1 TITAN_GPU_REPORT_DIR="$OUT"
timeout 200 apps/gpu/run.sh python3 -m pytest -m gpu tests/gpu/test_moe_gpu.py -q -rA -p no:cacheprovider \
    >"$OUT/pytest.log" 2>&1
echo "pytest exit $?" >>"$OUT/pytest.log"
CONFIGS=deepseek_v3/16B_4layers_sdpa:none=1,qwen3/30B-A3B_4layers:none=1,deepseek_v3/16B_4layers_sdpa:op=2
CONFIGS+=,qwen3/30B-A3B_4layers:op=2,deepseek_v3/16B_4layers:none=1,deepseek_v3/16B_4layers_sdpa_loop:none=1
timeout "${MEMORY_SECONDS:-330}" apps/gpu/run.sh python3 bench/memory_vs_gpu.py --seq-len 8192 --steps 5 \
    --configs "${MOE_CONFIGS:-$CONFIGS}" --out "$OUT/moe_memory_vs_gpu.jsonl" >"$OUT/memory.log" 2>&1
echo "memory_vs_gpu exit $?" >>"$OUT/memory.log"
tail -n 30 "$OUT/pytest.log" "$OUT/memory.log"
