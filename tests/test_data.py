"""Tokenizer and preprocessing round trips, and blend proportions."""

from __future__ import annotations

import json
import logging
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import yaml
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_train import batch, data_cache, megatron_compat
from megatron_train.config import ConfigError
from megatron_train.data import IndexProgress, build_datasets, index_count
from megatron_train.data_cache import drop_torn_indices
from megatron_train.host_memory import physical_memory
from megatron_train.inputs import check_resumed_index_memory, epochs, split_sizes
from megatron_train.resolve import load_config, resolve
from megatron_train.token_writer import TokenWriter
from megatron_train.tokenizer import load_tokenizer
from tests.conftest import ROOT, free_port, run_tool, torchrun_command, torchrun_env, write_config

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
    port = free_port()
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


def test_blend_weights_are_shares_at_any_scale(tmp_path, corpus):
    """megatron-core divides the weights by their sum, and so do the checks before it: weights
    near the largest float resolve as the shares they make."""
    prefixes = []
    for name in ("a", "b"):
        for suffix in (".bin", ".idx"):
            shutil.copy(str(corpus["prefix"]) + suffix, tmp_path / f"{name}{suffix}")
        prefixes.append(tmp_path / name)
    config = write_config(tmp_path / "c.yaml", corpus, tmp_path / "run")
    for scale in (1, 1e308):
        weights = [0.75 * scale, 0.25 * scale]
        blend = f"data.blend=[{weights[0]}, {prefixes[0]}, {weights[1]}, {prefixes[1]}]"
        assert resolve(config, [blend], world_size=1).data.blend == [weights[0], str(prefixes[0]), weights[1],
                                                                       str(prefixes[1])]  # fmt: skip


@pytest.mark.parametrize("split", ["90,7,3", "98,2,0", "1,1,1"])
def test_split_sizes_are_the_sizes_of_megatrons_splits(
    tmp_path, corpus, tokenizer, single_process_group, split
):
    """Each split megatron builds holds the sequences counted, and one pass over it holds
    (tokens - 1) // seq_length samples."""
    prefix, seq_length = str(corpus["prefix"]), 64
    config = GPTDatasetConfig(
        random_seed=1, sequence_length=seq_length, blend=([prefix], None), split=split,
        path_to_cache=str(tmp_path), tokenizer=tokenizer, reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False,
    )  # fmt: skip
    datasets = BlendedMegatronDatasetBuilder(GPTDataset, [None] * 3, lambda: True, config).build()
    for size, dataset in zip(split_sizes(prefix, split), datasets, strict=True):
        assert (size is None) == (dataset is None)
        if size is not None:
            assert len(dataset.indices) == size.sequences, split
            assert len(dataset) == (size.tokens - 1) // seq_length, split


@pytest.mark.parametrize("passes", [1, 3, 40])
def test_epochs_are_the_passes_megatron_makes(tmp_path, corpus, tokenizer, single_process_group, passes):
    """The pass count the index-memory check prices is the one megatron's document index holds,
    at a sample count just past a whole number of passes."""
    prefix, seq_length = str(corpus["prefix"]), 64
    train = split_sizes(prefix, "90,10,0")[0]
    samples = ((passes - 1) * train.tokens) // seq_length + 1
    config = GPTDatasetConfig(
        random_seed=1, sequence_length=seq_length, blend=([prefix], None), split="90,10,0",
        path_to_cache=str(tmp_path), tokenizer=tokenizer, reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False,
    )  # fmt: skip
    dataset = BlendedMegatronDatasetBuilder(GPTDataset, [samples, 0, 0], lambda: True, config).build()[0]
    assert epochs(samples, seq_length, train.tokens) == passes
    assert len(dataset.document_index) == passes * train.sequences


def test_a_resume_that_lowers_the_batch_is_priced_for_the_samples_it_reads(tmp_path, corpus):
    """A resume reads the checkpoint's samples again and then its remaining steps' (data.py), more
    than the start-up check's train.steps x train.global_batch_size when the batch was lowered:
    500 steps that read a sample per byte of this machine's memory, then 500 of 8."""
    cfg = load_config(write_config(tmp_path / "c.yaml", corpus, tmp_path / "run"), ["train.steps=1000"])
    check_resumed_index_memory(cfg, consumed_samples=500 * 8, steps_done=500)
    with pytest.raises(ConfigError) as err:
        check_resumed_index_memory(cfg, consumed_samples=physical_memory(), steps_done=500)
    assert err.value.key == "train.steps"
    assert f"resumed after 500 steps that read {physical_memory():,} samples, 500 more steps of 8" in str(
        err.value
    )
    assert "dataset indices megatron-core builds in memory" in err.value.problem


# data.split takes either separator (config.split_parts), as megatron-core's own parser does.
@pytest.mark.parametrize("split", ["80,10,10", "80/10/10"])
def test_index_progress_counts_every_dataset_built_then_read_from_the_cache(
    tmp_path, corpus, single_process_group, split
):
    prefixes = []
    for name in ("a", "b", "c"):  # copies: links to one dataset are refused as naming it twice
        for suffix in (".bin", ".idx"):
            shutil.copy(str(corpus["prefix"]) + suffix, tmp_path / f"{name}{suffix}")
        prefixes += [1.0, str(tmp_path / name)]
    cfg = load_config(
        write_config(tmp_path / "cfg.yaml", corpus, tmp_path / "run"),
        [f"data.blend={json.dumps(prefixes)}", f"data.split={split}", "data.build_threads=2"],
    )
    assert index_count(cfg) == 9
    for run, counts in ((1, "9 built, 0 from cache"), (2, "0 built, 9 from cache")):
        lines = []
        progress = IndexProgress(index_count(cfg), lines.append, every=0)
        build_datasets(cfg, str(tmp_path / "cache"), progress)
        assert progress.summary() == counts, run
        assert len(lines) == 9 and lines[-1].startswith("dataset indices: 9 of 9 begun after"), lines
    assert not logging.getLogger(megatron_compat.DATASET_INDEX_LOGGER).handlers


def test_a_validation_blend_is_read_whole_and_apart_from_the_training_data(
    tmp_path, corpus, single_process_group
):
    """data.valid_blend (Megatron-LM's --valid-data-path): every validation sample comes from its
    dataset, all of whose documents it indexes, and training indexes every document of data.blend,
    where data.split cuts a part off for validation."""
    held_out = tmp_path / "held_out"
    with open(f"{held_out}.bin", "wb") as f:
        writer = TokenWriter(f, np.dtype(np.uint16))
        writer.add([[7] * 100 for _ in range(30)])
    writer.write_index(Path(f"{held_out}.idx"))
    path = write_config(tmp_path / "cfg.yaml", corpus, tmp_path / "run")
    documents = len(IndexedDataset(str(corpus["prefix"])))
    cut, _ = build_datasets(load_config(path, []), str(tmp_path / "cut"))
    assert len(cut.indices) < documents

    raw = yaml.safe_load(path.read_text())
    del raw["data"]["split"]
    raw["data"]["valid_blend"] = [str(held_out)]
    path.write_text(yaml.safe_dump(raw))
    cfg = load_config(path, [])
    assert index_count(cfg) == 2
    train, valid = build_datasets(cfg, str(tmp_path / "cache"))
    assert train.dataset_path == str(corpus["prefix"]) and len(train.indices) == documents
    assert valid.dataset_path == str(held_out) and len(valid.indices) == 30
    assert all((valid[i]["tokens"] == 7).all() and (valid[i]["labels"] == 7).all() for i in range(len(valid)))
    # Validation off: the held-out set is neither indexed nor read.
    quiet = load_config(path, ["train.eval_interval=0"])
    assert index_count(quiet) == 1 and build_datasets(quiet, str(tmp_path / "quiet"))[1] is None


def test_an_index_file_cut_short_in_the_cache_is_dropped_and_built_again(
    tmp_path, corpus, single_process_group
):
    cfg = load_config(write_config(tmp_path / "cfg.yaml", corpus, tmp_path / "run"), [])
    cache = tmp_path / "cache"
    build_datasets(cfg, str(cache))
    shuffle = next(cache.glob("*-train-shuffle_index.npy"))
    intact = sorted(p.name for p in cache.glob("*.npy") if p != shuffle)
    with open(shuffle, "r+b") as f:  # as a full disk or a kill leaves the last file megatron writes
        f.truncate(shuffle.stat().st_size // 2)
    with pytest.raises(ValueError, match="mmap length"):
        build_datasets(cfg, str(cache))
    # A cache folder shared with other arrays: one that numpy cannot map is not megatron's to drop.
    theirs = cache / "features.npy"
    np.save(theirs, np.array([{"kept": True}], dtype=object))
    with pytest.raises(ValueError):
        np.load(theirs, mmap_mode="r")
    intact.append(theirs.name)

    assert drop_torn_indices(str(cache)) == [shuffle]
    assert sorted(p.name for p in cache.glob("*.npy")) == sorted(intact)
    progress = IndexProgress(index_count(cfg), lambda line: None)
    train, _ = build_datasets(cfg, str(cache), progress)
    assert progress.summary() == "1 built, 1 from cache" and len(train) > 0
    assert drop_torn_indices(str(cache)) == []


def test_a_link_to_nowhere_or_a_pipe_under_an_index_file_name_is_dropped_not_read(tmp_path):
    """Reading a pipe would block the start for good; a link to nowhere failed with a traceback."""
    os.mkfifo(tmp_path / "0a-GPTDataset-train-shuffle_index.npy")
    (tmp_path / "0a-GPTDataset-train-sample_index.npy").symlink_to(tmp_path / "gone")
    assert [p.name for p in drop_torn_indices(str(tmp_path))] == [
        "0a-GPTDataset-train-sample_index.npy",
        "0a-GPTDataset-train-shuffle_index.npy",
    ]
    assert not list(tmp_path.iterdir())


def test_a_run_waits_while_another_builds_indices_in_a_shared_cache(tmp_path, corpus):
    """megatron writes index files in place: a second run would delete them as torn, or rewrite
    them under the first run's readers."""
    cache, log = tmp_path / "shared-cache", tmp_path / "run.log"
    config = write_config(tmp_path / "cfg.yaml", corpus, tmp_path / "run", data={"cache_dir": str(cache)},
                          train={"steps": 3, "eval_interval": 0})  # fmt: skip
    cmd = [sys.executable, "-m", "megatron_train.train", "--config", str(config)]
    with data_cache.building(cache, lambda line: None):  # another run, building
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=torchrun_env(), stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 240
        while "another run is building indices" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        time.sleep(1.0)
        assert not list(cache.glob("*.npy")), "it built while the other run held the cache"
    assert proc.wait(timeout=240) == 0, log.read_text()[-3000:]
    assert "datasets ready" in log.read_text() and list(cache.glob("*-train-shuffle_index.npy"))


def test_a_dataset_tokenized_again_under_its_prefix_is_refused_until_it_is_restored(
    tmp_path, corpus, single_process_group
):
    """megatron keys its cached indices on the dataset's path, not its contents: indices built
    for one dataset would read another written under the same prefix."""
    prefix, cache = tmp_path / "data" / "stdlib", tmp_path / "cache"
    prefix.parent.mkdir()
    for suffix in (".bin", ".idx"):
        shutil.copy2(corpus["prefix"].with_suffix(suffix), prefix.with_suffix(suffix))
    cfg = load_config(
        write_config(tmp_path / "cfg.yaml", corpus, tmp_path / "run"), [f"data.blend=[{prefix}]"]
    )
    data_cache.record(cache, [str(prefix)])
    build_datasets(cfg, str(cache))
    data_cache.check_unchanged(cache, {str(prefix): "data.blend"})

    kept = tmp_path / "kept"
    kept.mkdir()
    for suffix in (".bin", ".idx"):
        shutil.move(prefix.with_suffix(suffix), kept / f"stdlib{suffix}")
    tokens = corpus["prefix"].with_suffix(".bin").stat().st_size // 2  # uint16
    with open(prefix.with_suffix(".bin"), "wb") as f:  # a .bin of the same size, other documents
        writer = TokenWriter(f, np.dtype(np.uint16))
        writer.add([[7] * 100] * (tokens // 100) + [[7] * (tokens % 100)])
    writer.write_index(prefix.with_suffix(".idx"))
    assert prefix.with_suffix(".bin").stat().st_size == kept.joinpath("stdlib.bin").stat().st_size
    with pytest.raises(ConfigError, match="is not the dataset the index cache .* same size, other documents"):
        data_cache.check_unchanged(cache, {str(prefix): "data.blend"})

    for suffix in (".bin", ".idx"):  # a copy back, with new timestamps, is the same dataset
        shutil.copy(kept / f"stdlib{suffix}", prefix.with_suffix(suffix))
    data_cache.check_unchanged(cache, {str(prefix): "data.blend"})
    assert json.loads((cache / data_cache.RECORD).read_text()).keys() == {str(prefix)}


@pytest.mark.parametrize(
    "entry", [5, None, {"bin_bytes": 1}, {"bin_bytes": "x", "idx_bytes": 1, "idx_ends_sha256": "0"}]
)
def test_a_cache_record_entry_of_another_shape_counts_as_none(tmp_path, corpus, entry):
    """An entry of the cache's dataset record edited by hand was a TypeError or ValueError
    traceback at start-up; it is as good as no entry (the record of a cut-short write is too), and
    the next record replaces it."""
    prefix, cache = str(corpus["prefix"]), tmp_path / "cache"
    cache.mkdir()
    (cache / data_cache.RECORD).write_text(json.dumps({prefix: entry}))
    data_cache.check_unchanged(cache, {prefix: "data.blend"})
    assert data_cache.built_from(cache) == set()
    data_cache.record(cache, [prefix])
    assert json.loads((cache / data_cache.RECORD).read_text()) == {prefix: data_cache.identity(prefix)}


def test_a_tool_whose_output_finds_no_room_says_so_in_one_line_and_leaves_nothing(tmp_path, corpus):
    limit = corpus["prefix"].with_suffix(".bin").stat().st_size // 2
    # A per-process file size limit refuses the write as a full disk would (Python ignores
    # SIGXFSZ, so the write fails instead of killing the tool).
    result = subprocess.run(
        [sys.executable, "tools/merge_datasets.py", "--input", str(corpus["prefix"]),
         "--output-prefix", str(tmp_path / "merged")],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)),
    )  # fmt: skip
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert result.returncode == 1 and len(errors) == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert errors[0].startswith("error: the output could not be written ([Errno 27] File too large)")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_index_build_longer_than_the_collective_timeout(tmp_path, corpus):
    """Rank 0 builds a 256M-sample index while rank 1 waits in megatron's barrier for longer than
    the collective timeout (12 s here, wide enough for start-up skew on a loaded machine); the
    setup's own timeout keeps the job alive."""
    config = write_config(
        tmp_path / "cfg.yaml", corpus, tmp_path / "run",
        train={"steps": 32_000_000, "eval_interval": 0, "exit_after_minutes": 1e-4},
        checkpoint={"save_at_end": False, "async_save": False},
    )  # fmt: skip
    env = {**torchrun_env(), "MEGATRON_TRAIN_DIST_TIMEOUT_MIN": "0.2"}
    result = subprocess.run(
        torchrun_command(2, config), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    # Both ranks got past the index and stopped after step 1 with exit 3. Once the first rank exits,
    # torchrun SIGTERMs the other, which may still be tearing down after the final barrier.
    assert "stopped early (checkpoint saved)" in result.stdout, result.stderr[-4000:]
    codes = set(re.findall(r"exitcode\s*:\s*(-?\d+)", result.stderr))
    assert "3" in codes and codes <= {"3", "-15"}, result.stderr[-4000:]
    line = r"datasets ready in ([\d.]+) s \(indices: (\d+) built, 0 from cache\): 256,"
    ready = re.search(line, result.stdout)
    built_in = float(ready.group(1))
    assert ready.group(2) == "2", "one index for each split with a share (train and valid)"
    assert built_in > 12, f"the index built in {built_in} s, within the timeout: the test proves nothing"


EOD = 2
PACKED = torch.tensor([[5, 7, EOD, 3, EOD, 9, 9, 9]])  # a document's end, a whole one, a start


def test_documents_are_found_from_their_eod_tokens():
    documents = batch.document_ids(PACKED, EOD)
    assert documents.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2]]
    assert batch.document_positions(documents).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    may_attend = ~batch.document_attention_mask(documents)[0, 0]
    assert [row.nonzero().view(-1).tolist() for row in may_attend] == [
        [0], [0, 1], [0, 1, 2], [3], [3, 4], [5], [5, 6], [5, 6, 7],
    ]  # fmt: skip
    packed = batch.packed_documents(documents)
    assert packed.qkv_format == "thd" and packed.cu_seqlens_q.tolist() == [0, 3, 5, 8]
    assert packed.max_seqlen_q == packed.max_seqlen_kv == 3


def test_a_token_id_beyond_the_model_is_refused_on_the_host_before_the_step():
    prepare = batch.BatchPreparer(torch.device("cpu"), vocab_size=8)
    loaded = {"tokens": torch.tensor([[1, 7, 2]]), "labels": torch.tensor([[7, 2, 8]])}
    with pytest.raises(ConfigError, match="holds token id 8, beyond the model's 8 tokens"):
        prepare(loaded)
