#!/usr/bin/env bash
# Launch titan-train with torchrun on this node.
#   NGPU=8 CONFIG_FILE=apps/configs/llama3_8b.toml ./apps/run_train.sh --training.steps 100
#   DRY_RUN=1 NGPU=64 CONFIG_FILE=apps/configs/llama3_8b.toml ./apps/run_train.sh
# NGPU: processes (GPUs, or CPU processes with gloo where there is no GPU); LOG_RANK: comma-separated
# ranks whose output is shown (default 0); DRY_RUN=1: check the config and the layout for NGPU ranks
# in one process without GPUs (a fake process group), print the mesh and the memory per rank, and stop.
# Extra arguments are passed on as config overrides. Before torchrun starts, `titan-train check` checks
# the config and the layout for NGPU ranks: a mistake is one line and exit status 2 (not the same line
# from every rank and torchrun's traceback); SKIP_CHECK=1 skips it. COMM_BACKEND: nccl (default) or
# nvshmem, the library behind collectives on symmetric memory (async tensor parallelism; needs CUDA and
# NVSHMEM, see docs/performance.md); a value that cannot work stops the launch in that check.
# Fault tolerance (torchft; docs/fault_tolerance.md): FT_REPLICA_GROUPS=N starts N replica groups of NGPU
# ranks on this node, one torchrun each with its --fault_tolerance.replica_id (with GPUs, each group its
# own NGPU devices), and a torchft lighthouse for them unless TORCHFT_LIGHTHOUSE names one
# (FT_LIGHTHOUSE_PORT, default 29510; FT_LIGHTHOUSE_MIN_REPLICAS, default 1: the groups a quorum waits for
# before it forms, so that a group that starts first does not train steps alone); the status is the highest a group exits with. torchtitan's way,
# one group per call with TORCHFT_LIGHTHOUSE set and the --fault_tolerance flags, works unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."

NGPU=${NGPU:-1}
LOG_RANK=${LOG_RANK:-0}
CONFIG_FILE=${CONFIG_FILE:-./apps/configs/debug_model.toml}
DRY_RUN=${DRY_RUN:-0}
export COMM_BACKEND=${COMM_BACKEND:-nccl}  # read by titan-train (titan_train.comm_backend) on every rank
case "${COMM_BACKEND}" in  # the name at once, even for a dry run; whether it can work: titan-train check
    nccl | nvshmem) ;;
    *) echo "COMM_BACKEND=${COMM_BACKEND} is not one of nccl, nvshmem; unset COMM_BACKEND (or set COMM_BACKEND=nccl)" >&2; exit 2 ;;
esac

if command -v torchrun >/dev/null 2>&1; then
    TORCHRUN=(torchrun)
    PYTHON=(python)
else
    TORCHRUN=(uv run torchrun)
    PYTHON=(uv run python)
fi

export PYTHONUNBUFFERED=1
# The caching allocator grows one segment per stream instead of caching fixed segments: less reserved
# memory lost to fragmentation (the dry run prints both). A value the user set is kept.
if [ -z "${PYTORCH_CUDA_ALLOC_CONF:-}" ] && [ -z "${PYTORCH_ALLOC_CONF:-}" ]; then
    export PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"
fi
# Restarted workers (torchrun --max-restarts) must not read a dead rank's address from a shared store.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
if [ "${DRY_RUN}" = "1" ]; then
    exec "${PYTHON[@]}" -m titan_train.cli dry-run --ngpu "${NGPU}" --job.config_file "${CONFIG_FILE}" "$@"
fi
FT_REPLICA_GROUPS=${FT_REPLICA_GROUPS:-0}
if [ "${FT_REPLICA_GROUPS}" != "0" ]; then
    case "${FT_REPLICA_GROUPS}" in
        *[!0-9]*) echo "FT_REPLICA_GROUPS=${FT_REPLICA_GROUPS} is not a number of replica groups" >&2; exit 2 ;;
    esac
    set -- "$@" --fault_tolerance.enable --fault_tolerance.group_size "${FT_REPLICA_GROUPS}"
fi
if [ "${SKIP_CHECK:-0}" != "1" ]; then
    "${PYTHON[@]}" -m titan_train.cli check --ngpu "${NGPU}" --job.config_file "${CONFIG_FILE}" "$@" || exit $?
fi
if [ "${FT_REPLICA_GROUPS}" != "0" ]; then
    pids=()
    stop_all() { kill "${pids[@]}" 2>/dev/null || true; }
    trap stop_all INT TERM
    if [ -z "${TORCHFT_LIGHTHOUSE:-}" ]; then
        port=${FT_LIGHTHOUSE_PORT:-29510}
        if command -v torchft_lighthouse >/dev/null 2>&1; then LIGHTHOUSE=(torchft_lighthouse); else LIGHTHOUSE=(uv run torchft_lighthouse); fi
        "${LIGHTHOUSE[@]}" --min_replicas "${FT_LIGHTHOUSE_MIN_REPLICAS:-1}" --quorum_tick_ms 100 --join_timeout_ms 10000 --bind "[::]:${port}" &
        lighthouse=$!
        trap 'kill "${lighthouse}" 2>/dev/null || true' EXIT
        export TORCHFT_LIGHTHOUSE="http://localhost:${port}"
        for _ in $(seq 100); do  # listening before the groups look for it (they refuse a missing one)
            (echo >"/dev/tcp/localhost/${port}") 2>/dev/null && break
            sleep 0.1
        done
    fi
    gpus=$("${PYTHON[@]}" -c "import torch; print(torch.cuda.device_count())" || true)
    gpus=${gpus:-0}
    for ((group = 0; group < FT_REPLICA_GROUPS; group++)); do
        if [ "${gpus}" -gt 0 ]; then
            export CUDA_VISIBLE_DEVICES=$(seq -s, $((group * NGPU)) $(((group + 1) * NGPU - 1)))
        fi
        "${TORCHRUN[@]}" --nproc_per_node="${NGPU}" --rdzv_backend c10d --rdzv_endpoint="localhost:0" \
            --local-ranks-filter "${LOG_RANK}" --role "group${group}_rank" --tee 3 \
            -m titan_train.cli --job.config_file "${CONFIG_FILE}" "$@" --fault_tolerance.replica_id "${group}" &
        pids+=($!)
    done
    status=0
    for pid in "${pids[@]}"; do
        wait "${pid}" || { code=$?; [ "${code}" -gt "${status}" ] && status=${code}; }
    done
    exit "${status}"
fi
exec "${TORCHRUN[@]}" --nproc_per_node="${NGPU}" --rdzv_backend c10d --rdzv_endpoint="localhost:0" \
    --local-ranks-filter "${LOG_RANK}" --role rank --tee 3 \
    -m titan_train.cli --job.config_file "${CONFIG_FILE}" "$@"
