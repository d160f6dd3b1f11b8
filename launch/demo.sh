#!/usr/bin/env bash
# The default demo: pretrain a tiny code model on the Python standard library's own source with
# TP=2 x PP=2 x DP=2 on 8 CPU ranks (or on the GPUs of this node when there are 8).
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=runs/demo/data
mkdir -p "$DATA"
if [ ! -f "$DATA/stdlib_text_document.idx" ]; then
    python tools/stdlib_corpus.py --output "$DATA/stdlib.jsonl"
    python tools/train_tokenizer.py --input "$DATA/stdlib.jsonl" --output-prefix "$DATA/spm" \
        --vocab-size 4096 --max-sentences 20000
    python tools/preprocess_data.py --input "$DATA/stdlib.jsonl" --output-prefix "$DATA/stdlib_text_document" \
        --tokenizer "$DATA/spm.model" --workers 2
fi
# Each demo starts fresh (launch/local.sh with the same config resumes instead).
rm -rf runs/demo/metrics.jsonl runs/demo/checkpoints
exec bash launch/local.sh 8 --config configs/demo.yaml "$@"
