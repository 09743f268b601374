#!/usr/bin/env bash
# On the GPU machine, in one lease: Titan against torchtitan 0.2.2 (bench/gpu_throughput.py), most important
# first, under one time limit: dense 3B compiled, the two MoE cuts (DeepSeek-V2-Lite and Qwen3-30B-A3B at 4
# blocks), dense 1B compiled at batch 6, 3B float8. Each run's record is appended to
# $OUT/titan_vs_torchtitan.jsonl as it ends, so a run cut off by the limit keeps the ones before it; the logs
# of every run go to $OUT/logs.tar.gz.
#   apps/gpu/compare_torchtitan.sh        (after apps/gpu/fetch_wheels.sh here; carry .whl)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/device.txt" 2>&1
export PYTHONUNBUFFERED=1
CONFIGS=3B:compiled:selective=1,deepseek_v3/16B_4layers:eager:none=1,qwen3/30B-A3B_4layers:eager:none=1
CONFIGS+=,1B:compiled:selective=6,3B:float8:selective=1
timeout "${BENCH_SECONDS:-480}" apps/gpu/run.sh python3 bench/gpu_throughput.py --configs "${GPU_CONFIGS:-$CONFIGS}" \
    --steps 10 --log-freq 5 --keep "$OUT/keep" --out "$OUT/titan_vs_torchtitan.jsonl" >"$OUT/bench.log" 2>&1
echo "gpu_throughput exit $?" >>"$OUT/bench.log"
tar -czf "$OUT/logs.tar.gz" -C "$OUT" keep 2>/dev/null && rm -rf "$OUT/keep"
tail -n 40 "$OUT/bench.log"
