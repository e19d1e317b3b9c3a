#!/usr/bin/env bash
# The first GPU run of autoplan: one prepared check for a machine with one H100 or H200 and this repository.
# Every step has its own time limit (they sum to about 1000 s, the install step included; the steps run in the order
# of what matters most, so a run cut short keeps the first ones; --only reruns some) and prints measured / predicted
# ratios. On a fresh H200 (2026-11-27) each train.py launch spent about 35 s starting (torch, CUDA, NCCL) before its
# first step, the kernels step took 63 s and the plans 21 s; everything goes to one log,
# benchmarks/results/gpu_check_<device>_<UTC time>.log, beside the steps' JSON files
# (benchmarks/results/gpu_check_<device>/).
#
#   bash benchmarks/gpu_check.sh [--device cuda|cpu] [--wheels DIR] [--only STEP,STEP,...]
#
# --only runs the named steps alone (a second try of those that failed; detect and summary always run).
#
# Steps (benchmarks/gpu_check.py has one subcommand each; kernels is benchmarks/gpu_kernels.py, pytest_gpu the
# test suite's gpu-marked tests):
#   kernels     the kernels the cost model prices by one efficiency each: bf16 GEMM, copy, SDPA attention per
#               backend at 8K..64K tokens (causal and not), DeepSeek-V3's attention shape (SDPA, FlexAttention),
#               torch._grouped_mm at mixture-of-experts shapes
#   pytest_gpu  pytest -m gpu (the tests that skip without a CUDA GPU)
#   plan        Llama-3.2-1B's shapes (benchmarks/models/llama32_1b.py) for --gpus 1 on the machine's profile
#               (H100 or H200, detected): the search's plan, its layout without compile, and recompute=selective
#               and recompute=full under compile; DeepSeek-V3 16B's first 4 layers (moe, eager) and Llama-3.2-1B
#               at 32K tokens (long). GPU_CHECK_PLANS=base,moe,... makes some of them only
#   train_moe, train_moe_compiled, train_long  10, 10 and 6 steps of those (the MoE eager and compiled), the last 2 traced (train.py --profile): step time, the
#               allocated and the reserved peak memory, and the traced kernels' time per cost kind (GEMM, attention,
#               memory, optimizer) against the priced ops of that kind
#   train       20 steps compiled (the last 2 traced, as above) and 20 eager (step time, MFU, peak memory, the compile speed-up against the
#               predicted one, recompiles counted from TORCH_LOGS=recompiles); 10 steps each of the selective and
#               full plans under compile
#   calibrate   autoplan calibrate on one rank: bf16 GEMM TFLOP/s, HBM bandwidth and launch overhead against the
#               profile's, writing a calibrated profile (calibrated.yaml)
#   offload     FSDP2 with pinned-memory CPU offload on a one-rank mesh
#   checkpoint  a DCP save and resume (train.py --checkpoint-dir, --resume) against a straight run
#   profile     autoplan profile --measure (ops timed on the GPU in bf16) against the roofline, per op kind
#   summary     every ratio in one table
#
# Packages the GPU machine may lack (PuLP, highspy, ...) come as wheels from a folder: --wheels DIR or
# AUTOPLAN_WHEELS=DIR. Prepare it on a machine with the internet, for the GPU machine's Python and platform:
#   pip download -d wheels/ --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       "pulp>=2.8" "highspy>=1.7" "networkx>=3" "pandas>=2" "pyyaml>=6" "rich>=13" "transformers>=4.45" "pyflakes>=3"
# (torch itself is the machine's CUDA build; nothing here installs it). The script installs from the folder
# only what does not import, with pip --no-index.
#
# --device cpu is the dry run (tests/test_gpu_check.py runs it): the model shrunk to 2 layers, one CPU process,
# torch.compile disabled (TORCHDYNAMO_DISABLE=1: it checks the script, not inductor), shorter runs, every time
# limit x5 (GPU_CHECK_SLACK=N sets the factor: a CPU shared with other work is slow to start torch). About 2 min
# of CPU time; its results go to benchmarks/results/gpu_check_cpu* (ignored by git) unless GPU_CHECK_RESULTS and
# GPU_CHECK_LOG say otherwise.
set -uo pipefail

DEVICE=cuda
WHEELS="${AUTOPLAN_WHEELS:-}"
ONLY=""
while [ $# -gt 0 ]; do
    case "$1" in
        --device) DEVICE="$2"; shift 2 ;;
        --wheels) WHEELS="$2"; shift 2 ;;
        --only) ONLY=",$2,"; shift 2 ;;
        *) echo "gpu_check.sh: unknown argument $1 (use --device cuda|cpu, --wheels DIR, --only STEP,...)" >&2; exit 2 ;;
    esac
done
case "$DEVICE" in cuda|cpu) ;; *) echo "gpu_check.sh: --device must be cuda or cpu, got $DEVICE" >&2; exit 2 ;; esac

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"
STAMP="$(date -u +%Y%m%dT%H%M%SZ)"
RESULTS="${GPU_CHECK_RESULTS:-$REPO/benchmarks/results/gpu_check_$DEVICE}"
LOG="${GPU_CHECK_LOG:-$REPO/benchmarks/results/gpu_check_${DEVICE}_$STAMP.log}"
mkdir -p "$RESULTS" "$(dirname "$LOG")"
: > "$LOG"
FAILED=0

if [ "$DEVICE" = cpu ]; then
    # the dry run checks the script on a CPU shared with other work: no time limit is a measurement there
    export TORCHDYNAMO_DISABLE=1
    TRAIN_STEPS=4; SHORT_STEPS=4; LONG_STEPS=4; OFFLOAD_STEPS=3; SLACK="${GPU_CHECK_SLACK:-5}"
else
    TRAIN_STEPS=20; SHORT_STEPS=10; LONG_STEPS=6; OFFLOAD_STEPS=5; SLACK="${GPU_CHECK_SLACK:-1}"
fi
s() { echo $(( $1 * SLACK )); }  # a limit in seconds, scaled for the dry run

log() { echo "$@" | tee -a "$LOG"; }

# step NAME TIMEOUT_S COMMAND...: run in a session of its own under its own time limit (x SLACK), output into
# the log; past the limit the whole session is killed (torchrun's ranks included, so none outlives its step);
# a failure is noted and the next step runs
step() {
    local name="$1" limit; limit="$(s "$2")"; shift 2
    if [ -n "$ONLY" ] && [[ "$ONLY" != *",$name,"* ]] && [ "$name" != detect ] && [ "$name" != summary ]; then
        return
    fi
    local started=$SECONDS code
    log "=== $name (limit ${limit} s): $*"
    setsid "$@" > >(tee -a "$LOG") 2>&1 < /dev/null &
    local pid=$!
    while kill -0 "$pid" 2>/dev/null && [ $((SECONDS - started)) -lt "$limit" ]; do sleep 1; done
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM -- "-$pid" 2>/dev/null; sleep 5; kill -KILL -- "-$pid" 2>/dev/null
        wait "$pid" 2>/dev/null
        log "=== $name: TIMED OUT after ${limit} s (killed)"; FAILED=$((FAILED + 1))
        return
    fi
    wait "$pid"; code=$?
    sleep 0.2  # tee's last lines
    if [ "$code" -ne 0 ]; then
        log "=== $name: FAILED (exit $code)"; FAILED=$((FAILED + 1))
    else
        log "=== $name: done in $((SECONDS - started)) s"
    fi
}

log "gpu_check $STAMP on $(hostname), device $DEVICE, repository $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?')"
if ! "$PY" -c "import pulp, highspy, networkx, pandas, yaml, rich, transformers, pyflakes" 2>/dev/null; then
    if [ -z "$WHEELS" ]; then
        log "gpu_check: a package autoplan needs does not import and no wheel folder was given (--wheels DIR or AUTOPLAN_WHEELS)"
        exit 2
    fi
        # into a folder of its own: the machine's Python may be read-only, and its other packages stay as they are
    export PIP_TARGET_DIR="${PIP_TARGET_DIR:-/tmp/autoplan-site}"
    export PYTHONPATH="$PYTHONPATH:$PIP_TARGET_DIR"
    ONLY_SAVED="$ONLY"; ONLY=""
    step install 30 "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$PIP_TARGET_DIR" \
        --find-links "$WHEELS" "pulp>=2.8" "highspy>=1.7" "pyflakes>=3"
    ONLY="$ONLY_SAVED"
    if ! "$PY" -c "import pulp, highspy, networkx, pandas, yaml, rich, transformers" 2>&1 | tee -a "$LOG"; then
        log "gpu_check: a package autoplan needs still does not import (the wheel folder has pulp and highspy; the others must be on the machine)"
        exit 2
    fi
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])" 2>&1 | tee -a "$LOG"
(command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv) 2>&1 | tee -a "$LOG"

G="$PY benchmarks/gpu_check.py --device $DEVICE --results $RESULTS"
step detect     5  $G detect
step plan      90  $G plan --plans "${GPU_CHECK_PLANS:-base,selective,full,moe,moe_compiled,long}"
step train_moe     150 $G train --plan moe --run moe --steps "$SHORT_STEPS" --profile --timeout "$(s 145)"
step train_moe_compiled 150 $G train --plan moe_compiled --run moe_compiled --steps "$SHORT_STEPS" --profile --timeout "$(s 145)"
step train_long    150 $G train --plan long --run long --steps "$LONG_STEPS" --profile --timeout "$(s 145)"
step train_compile   95 $G train --plan base --run compile --steps "$TRAIN_STEPS" --profile --timeout "$(s 90)"
step checkpoint 150 $G checkpoint --timeout "$(s 45)"
if [ "$DEVICE" = cuda ]; then
    step pytest_gpu 150 "$PY" -m pytest -m gpu -q -p no:cacheprovider tests/test_verify_gpu.py tests/test_gpu_runtime.py
fi
step kernels   90  "$PY" benchmarks/gpu_kernels.py --device "$DEVICE" --results "$RESULTS" --budget-s "$(s 75)"
step train_selective 95 $G train --plan selective --run selective --steps "$SHORT_STEPS" --timeout "$(s 90)"
step train_eager     95 $G train --plan base --run eager --no-compile --steps "$TRAIN_STEPS" --timeout "$(s 90)"
step train_full      95 $G train --plan full --run full --steps "$SHORT_STEPS" --timeout "$(s 90)"
step offload   40  $G offload --steps "$OFFLOAD_STEPS"
step profile   50  $G profile
step calibrate 40  $G calibrate --timeout "$(s 35)"
step summary    5  $G summary
log "gpu_check: $FAILED step(s) failed or timed out; log $LOG"
[ "$FAILED" -eq 0 ]
