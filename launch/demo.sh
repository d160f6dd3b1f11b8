#!/usr/bin/env bash
# The default demo: pretrain a tiny code model on the Python standard library's own source with
# TP=2 x PP=2 x DP=2 on 8 CPU ranks (or on the GPUs of this node when there are 8).
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/demo_data.sh
# Each demo starts fresh (launch/local.sh with the same config resumes instead).
rm -rf runs/demo/metrics.jsonl runs/demo/checkpoints
exec bash launch/local.sh 8 --config configs/demo.yaml "$@"
