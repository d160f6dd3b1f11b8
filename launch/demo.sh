#!/usr/bin/env bash
# The demo: pretrain a tiny code model on the Python standard library's own source on 8 CPU ranks
# (or on the GPUs of this node when there are 8). launch/demo.sh runs the dense model at
# TP=2 x PP=2 x DP=2; launch/demo.sh moe runs a mixture of experts at PP=2 x DP=4 with EP=4.
# Any further arguments are config overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
NAME=demo
if [ "${1:-}" = moe ]; then NAME=demo_moe; shift; fi
bash launch/demo_data.sh
# Each demo starts fresh (launch/local.sh with the same config resumes instead).
rm -rf "runs/$NAME/metrics.jsonl" "runs/$NAME/checkpoints"
exec bash launch/local.sh 8 --config "configs/$NAME.yaml" "$@"
