#!/usr/bin/env bash
# The demo's data, made once: the Python standard library's source as a corpus, a 4096-token
# SentencePiece tokenizer trained on it, and the tokenized megatron dataset (runs/demo/data).
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=runs/demo/data
WORKERS=${1:-2}
mkdir -p "$DATA"
if [ ! -f "$DATA/stdlib_text_document.idx" ]; then
    # An interrupted earlier run may have left a corpus, a tokenizer or a .bin; the tools never write
    # over them.
    rm -f "$DATA/stdlib.jsonl" "$DATA/spm.model" "$DATA/spm.vocab" "$DATA/stdlib_text_document.bin"
    python tools/stdlib_corpus.py --output "$DATA/stdlib.jsonl"
    python tools/train_tokenizer.py --input "$DATA/stdlib.jsonl" --output-prefix "$DATA/spm" \
        --vocab-size 4096 --max-sentences 20000
    python tools/preprocess_data.py --input "$DATA/stdlib.jsonl" --output-prefix "$DATA/stdlib_text_document" \
        --tokenizer "$DATA/spm.model" --workers "$WORKERS"
fi
