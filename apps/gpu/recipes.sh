#!/usr/bin/env bash
# On the GPU machine, in one lease: the fine-tuning and RL recipes (bench/gpu_recipes.py), most important
# first, under one time limit: SFT packed against padded, LoRA and QLoRA on Llama 3.1 8B's blocks cut to 4
# against the dry run, DPO packed against padded, Muon against AdamW, GRPO's titan engine, MTP's cost. Each
# run's record is appended to $OUT/recipes.jsonl as it ends, so a run cut off by the limit keeps the ones
# before it; every run's log goes to $OUT/logs.tar.gz.
#   apps/gpu/recipes.sh        (after apps/gpu/fetch_wheels.sh here; carry .whl)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/device.txt" 2>&1
export PYTHONUNBUFFERED=1
timeout "${RECIPES_SECONDS:-480}" apps/gpu/run.sh python3 bench/gpu_recipes.py --cases "${RECIPES:-sft,lora,dpo,muon,grpo,mtp}" \
    --keep "$OUT/keep" --out "$OUT/recipes.jsonl" >"$OUT/recipes.log" 2>&1
echo "gpu_recipes exit $?" >>"$OUT/recipes.log"
tar -czf "$OUT/logs.tar.gz" -C "$OUT" keep 2>/dev/null && rm -rf "$OUT/keep"
[ -f "$OUT/recipes.jsonl" ] && apps/gpu/run.sh python3 bench/gpu_recipes.py --table-from "$OUT/recipes.jsonl"
tail -n 20 "$OUT/recipes.log"
