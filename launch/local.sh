#!/usr/bin/env bash
# Single-node launch: launch/local.sh [NPROC] --config configs/X.yaml [key=value ...]
# NPROC defaults to the number of GPUs; on a CPU-only machine pass the rank count you want.
set -euo pipefail
usage="launch/local.sh [NPROC] --config configs/X.yaml [key=value ...]"
# Leading zeros dropped as text: bash's arithmetic wraps a count past 64 bits into another number.
if [[ "${1:-}" =~ ^[0-9]+$ ]]; then NPROC=$(sed 's/^0*\(.\)/\1/' <<<"$1"); shift
    if [[ "$NPROC" == 0 ]]; then echo "error: launch/local.sh: NPROC is $NPROC. Fix: launch at least 1 rank: $usage" >&2; exit 2; fi
elif [[ -n "${1:-}" && ( "$1" != -* || "$1" =~ ^-[0-9.]+$ ) ]]; then
    echo "error: launch/local.sh: '$1' is not a rank count. Fix: $usage" >&2; exit 2
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then NPROC=$(nvidia-smi -L | wc -l)
else echo "error: launch/local.sh: no GPU found. Fix: give the number of CPU ranks first: $usage" >&2; exit 2
fi
# A shell without the project's environment would end each rank in an import traceback.
if ! python -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('torch') and u.find_spec('megatron_train')))" 2>/dev/null; then
    echo "error: launch/local.sh: '$(command -v python || echo python)' cannot import torch and megatron_train. Fix: activate the environment megatron-train is installed in (make install; source .venv/bin/activate)" >&2
    exit 2
fi
# One thread per rank: ranks already fill the cores, and oversubscription slows gloo collectives.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# One CUDA work queue per device keeps megatron's TP / sequence-parallel communication ordered
# with the compute it overlaps (Megatron-LM requires it); pretrain.sbatch sets it too.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
# torchrun, ending with the ranks' own exit code (2 bad input, 3 stopped after saving).
exec python -m megatron_train.torchrun --standalone --nproc-per-node "$NPROC" -m megatron_train.train "$@"
