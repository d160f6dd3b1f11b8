"""Tokenizer and preprocessing round trips, and blend proportions."""

from __future__ import annotations

import json
import socket

import numpy as np
import pytest
import torch.distributed as dist
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_train.tokenizer import load_tokenizer
from tests.conftest import run_tool

TRICKY = [
    "def f(x):\n\treturn x  +  1\n\n\n",
    "   leading and trailing spaces   ",
    "unicode: héllo wörld 世界 🐍 \u00a0nbsp",
    "# -*- coding: utf-8 -*-\r\nwindows line\r\n",
    "",
]


@pytest.fixture(scope="module")
def tokenizer(corpus):
    return load_tokenizer("sentencepiece", str(corpus["tokenizer"]))


@pytest.mark.parametrize("text", TRICKY)
def test_tokenizer_round_trip(tokenizer, text):
    assert tokenizer.detokenize(tokenizer.tokenize(text)) == text


def test_preprocess_round_trip(corpus, tokenizer):
    docs = [json.loads(line)["text"] for line in corpus["jsonl"].read_text().splitlines()]
    docs = [d for d in docs if d]
    ds = IndexedDataset(str(corpus["prefix"]))
    assert len(ds) == len(docs)
    for i in (0, 1, len(docs) // 2, len(docs) - 1):
        ids = ds[i].tolist()
        assert ids[-1] == tokenizer.eod, "each document ends with EOD"
        assert tokenizer.detokenize(ids[:-1]) == docs[i]


def test_preprocess_missing_input_is_a_clear_error(tmp_path, corpus):
    result = run_tool(
        "tools/preprocess_data.py", "--input", str(tmp_path / "none.jsonl"), "--output-prefix",
        str(tmp_path / "out"), "--tokenizer", str(corpus["tokenizer"]), check=False,
    )  # fmt: skip
    assert result.returncode == 2 and "none.jsonl" in result.stderr
    assert not list(tmp_path.glob("out*")), "no partial output"


@pytest.fixture
def single_process_group():
    """megatron's dataset builders expect a process group, as in training."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_blend_proportions(tmp_path, corpus, tokenizer, single_process_group):
    # Two copies of the corpus under different prefixes, blended 3:1.
    for name in ("a", "b"):
        for suffix in (".bin", ".idx"):
            (tmp_path / f"{name}{suffix}").symlink_to(str(corpus["prefix"]) + suffix)
    config = GPTDatasetConfig(
        random_seed=1,
        sequence_length=32,
        blend=([str(tmp_path / "a"), str(tmp_path / "b")], [0.75, 0.25]),
        split="100,0,0",
        path_to_cache=str(tmp_path / "cache"),
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    n = 4000
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [n, 0, 0], lambda: True, config).build()
    share_a = np.mean(train.dataset_index[:n] == 0)
    assert abs(share_a - 0.75) < 0.01, share_a
