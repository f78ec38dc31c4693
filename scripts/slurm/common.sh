# Shared by single_node.sbatch and multi_node.sbatch; sourced, not run. sbatch executes a copy of the batch
# script from a spool directory, so this file is found through RLSPMD_ROOT (default: the submit directory).
#
# rlspmd_launch CMD...   runs the job step CMD (srun ... torchrun ...) and handles the end of the allocation:
#
#   * SLURM sends SIGUSR1 to this batch shell RLSPMD_SIGNAL_LEAD seconds before the time limit
#     (#SBATCH --signal=B:USR1@<lead>). The trap forwards it to srun, which forwards it to every task
#     (torchrun); torchrun (--signals-to-handle ...,SIGUSR1) passes it to its workers. rlspmd only sets a
#     flag, agrees on it over all ranks at the next step boundary, writes a checkpoint and exits.
#   * After the step ends, a signalled job requeues itself (scontrol requeue); the requeued job runs the
#     same command, which has --resume auto, so it continues from the newest complete checkpoint.
#     At most RLSPMD_MAX_REQUEUES times (SLURM_RESTART_COUNT counts them).
#   * RLSPMD_SLURM_DRY_RUN=1 prints the command instead (for checking a setup, and for tests).

rlspmd_config_args() {  # "$@" = CONFIG [OVERRIDES...] -> RLSPMD_TRAIN_ARGS
    if [[ $# -lt 1 || ! -f $1 ]]; then
        echo "usage: sbatch $0 CONFIG.py [--section.field VALUE ...]   (config file '${1:-}' not found in $(pwd))" >&2
        exit 2
    fi
    RLSPMD_TRAIN_ARGS=(-m rlspmd.train --config "$1" --resume auto "${@:2}")
    if [[ -n ${RLSPMD_OUTPUT_DIR:-} ]]; then
        RLSPMD_TRAIN_ARGS+=(--trainer.output-dir "$RLSPMD_OUTPUT_DIR")
    fi
}

rlspmd_gpus_per_node() {
    if [[ -n ${RLSPMD_NPROC_PER_NODE:-} ]]; then echo "$RLSPMD_NPROC_PER_NODE"
    elif [[ -n ${SLURM_GPUS_ON_NODE:-} ]]; then echo "${SLURM_GPUS_ON_NODE##*:}"   # "4" or "a100:4"
    elif command -v nvidia-smi >/dev/null; then nvidia-smi -L | wc -l
    else echo 1
    fi
}

# What torchrun needs for a clean preemption: forward SIGUSR1 to the workers, and give them time to finish
# the current step and save before it escalates to SIGKILL.
rlspmd_torchrun_signal_args() {
    echo --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout="${RLSPMD_STOP_GRACE_S:-280}"
}

rlspmd_launch() {
    if [[ -n ${RLSPMD_SLURM_DRY_RUN:-} ]]; then
        local word line=""
        for word in "$@"; do  # shell-quote only the words that need it
            if [[ $word =~ ^[A-Za-z0-9_./:=,@+%-]+$ ]]; then line+="$word "; else line+="$(printf '%q' "$word") "; fi
        done
        echo "${line% }"
        return 0
    fi
    local preempted=0 step_pid rc
    trap 'preempted=1; echo "[rlspmd] SIGUSR1: the time limit is near; asking the trainer to checkpoint and stop"; kill -USR1 "$step_pid" 2>/dev/null' USR1
    "$@" &
    step_pid=$!
    while :; do  # wait returns early when the trap fires; wait again until the step has ended
        wait "$step_pid"
        rc=$?
        kill -0 "$step_pid" 2>/dev/null || break
    done
    trap - USR1
    if (( preempted )); then
        if (( ${SLURM_RESTART_COUNT:-0} < ${RLSPMD_MAX_REQUEUES:-50} )); then
            echo "[rlspmd] requeueing job ${SLURM_JOB_ID} (restart ${SLURM_RESTART_COUNT:-0}); it resumes from the newest checkpoint"
            scontrol requeue "$SLURM_JOB_ID"
            return 0
        fi
        echo "[rlspmd] not requeueing: RLSPMD_MAX_REQUEUES=${RLSPMD_MAX_REQUEUES:-50} reached" >&2
    fi
    return "$rc"
}
