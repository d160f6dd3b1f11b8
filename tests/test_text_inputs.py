"""Corpus inputs streamed from many files and formats, raw text that never turns into special
tokens, and datasets written per input file, resumed and merged."""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from megatron_train.errors import ConfigError
from megatron_train.text_encoding import text_encoder
from megatron_train.text_sources import input_files, iter_texts
from megatron_train.tokenizer import load_tokenizer
from tests.conftest import ROOT, load_tool


def _jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


@pytest.fixture
def shards(tmp_path):
    """The same kind of documents in every format, in a nested directory."""
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    (d / "a.jsonl").write_bytes(_jsonl([{"text": "one"}, {"text": ""}, {"text": "two"}]))
    (d / "b.jsonl.gz").write_bytes(gzip.compress(_jsonl([{"text": "three"}, {"text": None}])))
    (d / "sub" / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_jsonl([{"text": "four"}])))
    pq.write_table(pa.table({"text": ["five", "six"], "n": [1, 2]}), d / "sub" / "d.parquet")
    (d / "sub" / "e.txt").write_text("seven\n\neight\n")
    (d / "notes.md").write_text("not a corpus file")
    return d


def test_a_directory_streams_every_format_in_sorted_order(shards):
    files = input_files([str(shards)])
    assert [f.name for f in files] == ["a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "d.parquet", "e.txt"]
    assert list(iter_texts(files)) == ["one", "two", "three", "four", "five", "six", "seven", "eight"]


def test_globs_and_files_name_each_file_once(shards):
    files = input_files([str(shards / "**" / "*.jsonl*"), str(shards / "a.jsonl")])
    assert [f.name for f in files] == ["a.jsonl", "b.jsonl.gz", "c.jsonl.zst"]


def test_a_dotted_text_key_reaches_into_nested_fields(tmp_path):
    (tmp_path / "n.jsonl").write_bytes(_jsonl([{"meta": {"body": "deep"}}, {"meta.body": "literal"}]))
    assert list(iter_texts([tmp_path / "n.jsonl"], "meta.body")) == ["deep", "literal"]


def test_a_line_whose_other_field_holds_an_integer_python_cannot_read_keeps_its_text(tmp_path):
    """json.loads refuses an integer of over 4300 digits; only the text field matters here."""
    huge = "9" * 5000
    (tmp_path / "a.jsonl").write_text(f'{{"id": {huge}, "text": "kept"}}\n{{"id": -{huge}, "text": "too"}}\n')
    assert list(iter_texts([tmp_path / "a.jsonl"])) == ["kept", "too"]


def test_a_byte_order_mark_is_no_part_of_the_first_document(tmp_path):
    bom = b"\xef\xbb\xbf"
    (tmp_path / "a.jsonl").write_bytes(bom + _jsonl([{"text": "first"}, {"text": "second"}]))
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(bom + _jsonl([{"text": "third"}])))
    (tmp_path / "c.txt").write_bytes(bom + b"fourth\n")
    files = input_files([str(tmp_path)])
    assert list(iter_texts(files)) == ["first", "second", "third", "fourth"]


@pytest.mark.parametrize(
    "content, key, problem",
    [
        (b'{"text": "ok"}\nnot json\n', "text", "bad.jsonl:2 is not JSON"),
        (b'{"text": "ok"}\n{"body": "x"}\n', "text", "bad.jsonl:2 has no field 'text'"),
        (b'{"text": ["a"]}\n', "text", "holds list, not a string"),
        (b'{"text": 7}\n', "text", "holds a number, not a string"),
        (b'{"text": ' + b"9" * 5000 + b"}\n", "text", "holds a number, not a string"),
        (
            b'{"text": "ok"}\n["a"]\n',
            "text",
            "bad.jsonl:2 is a JSON array, not an object with a 'text' field",
        ),
        (b'"just text"\n', "body", "bad.jsonl:1 is a JSON string, not an object with a 'body' field"),
        (
            b'{"text": "ok", "meta": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n",
            "text",
            r"bad.jsonl:1 is not JSON \(it nests",
        ),
    ],
)
def test_a_bad_line_is_named_with_its_file_and_line(tmp_path, content, key, problem):
    (tmp_path / "bad.jsonl").write_bytes(content)
    with pytest.raises(ConfigError, match=problem):
        list(iter_texts([tmp_path / "bad.jsonl"], key))


def test_a_truncated_compressed_file_is_a_clear_error(tmp_path):
    data = gzip.compress(_jsonl([{"text": "x" * 1000}] * 50))
    (tmp_path / "cut.jsonl.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match="could not be read"):
        list(iter_texts([tmp_path / "cut.jsonl.gz"]))


@pytest.mark.parametrize(
    "spec, problem", [("nothing/*.jsonl", "matches no"), ("missing.jsonl", "does not exist")]
)
def test_inputs_that_name_nothing_are_refused(tmp_path, spec, problem):
    with pytest.raises(ConfigError, match=problem):
        input_files([str(tmp_path / spec)])


SPECIALS = ["<s>", "</s>", "<unk>", "<pad>", "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    """A byte-level BPE tokenizer with Llama-3-style special tokens, saved as a Hugging Face
    tokenizer directory (tokenizer.json)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(["def f(x): return x + 1", "hello world <tags> and </tags>"] * 20, trainer)
    d = tmp_path_factory.mktemp("hf_tok")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>", unk_token="<unk>",
        pad_token="<pad>", additional_special_tokens=SPECIALS[4:],
    )  # fmt: skip
    fast.save_pretrained(d)
    return d


TEXT_WITH_SPECIALS = "x " + " ".join(SPECIALS) + " <s>def</s>"


def test_huggingface_text_never_produces_special_tokens(hf_tokenizer):
    encoder = text_encoder("huggingface", str(hf_tokenizer), threads=2)
    assert os.environ["RAYON_NUM_THREADS"] == "2", "the tokenizer's thread pool size"
    encode = encoder.encode
    special_ids = {Tokenizer.from_file(str(hf_tokenizer / "tokenizer.json")).token_to_id(s) for s in SPECIALS}
    (ids,) = encode([TEXT_WITH_SPECIALS])
    assert not special_ids & set(ids)
    megatron = load_tokenizer("huggingface", str(hf_tokenizer))
    assert megatron.detokenize(ids) == TEXT_WITH_SPECIALS
    assert set(megatron.tokenize(TEXT_WITH_SPECIALS)) & special_ids, "megatron's own path reads them"
    assert encode(["def f(x): return x"]) == [megatron.tokenize("def f(x): return x")]
    assert (encoder.eod, encoder.vocab_size) == (megatron.eod, megatron.vocab_size)


def test_sentencepiece_text_never_produces_control_tokens(corpus):
    encoder = text_encoder("sentencepiece", str(corpus["tokenizer"]), threads=2)
    encode = encoder.encode
    megatron = load_tokenizer("sentencepiece", str(corpus["tokenizer"]))
    assert (encoder.eod, encoder.vocab_size) == (megatron.eod, megatron.vocab_size)
    (ids,) = encode([TEXT_WITH_SPECIALS])
    assert not {0, 1, 2, 3} & set(ids), "pad, unk, bos and eos ids"
    assert megatron.detokenize(ids) == TEXT_WITH_SPECIALS
    docs = [json.loads(line)["text"] for line in corpus["jsonl"].read_text().splitlines()[:20]]
    assert encode(docs) == [megatron.tokenize(d) for d in docs]


def test_a_tokenizer_without_an_end_of_document_token_is_refused(tmp_path):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["plain text"] * 5, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="no end-of-document"):
        text_encoder("huggingface", str(tmp_path), threads=1)


def test_preprocessing_starts_without_torch_or_megatron(corpus, tmp_path):
    """Its start-up is part of every run's time; the tokenizer is the work."""
    args = ["--input", str(corpus["jsonl"]), "--output-prefix", str(tmp_path / "d"),
            "--tokenizer", str(corpus["tokenizer"])]  # fmt: skip
    loaded = subprocess.run(
        [sys.executable, "-X", "importtime", "tools/preprocess_data.py", *args],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stderr  # fmt: skip
    assert re.search(r"\|\s+megatron_train\.text_encoding$", loaded, re.MULTILINE), loaded[-2000:]
    assert not re.findall(r"\|\s+(torch|megatron\.core)$", loaded, re.MULTILINE)


@pytest.mark.parametrize(
    "sent, code, said",
    # SIGTERM: ended by the signal itself (143 in a shell), as a launcher expects of a rank it stops
    [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, -signal.SIGTERM, "terminated (SIGTERM)")],
    ids=["ctrl-c", "sigterm"],
)
def test_a_stop_while_writing_is_one_line_with_its_code_and_leaves_no_file(
    corpus, tmp_path, sent, code, said
):
    big = tmp_path / "big.jsonl"
    big.write_text(corpus["jsonl"].read_text() * 8)
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "tools/preprocess_data.py", "--input", str(big), "--output-prefix", str(out / "d"),
         "--tokenizer", str(corpus["tokenizer"]), "--workers", "1"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # as from a terminal: a shell starts a background job's commands with SIGINT ignored, and
        # Python then leaves it ignored (a test run started with `&` would see the tool finish)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not (out / "d.bin.tmp").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.002)
    proc.send_signal(sent)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == code, stderr[-2000:]
    assert stderr.splitlines() == [
        f"error: {said} before it finished; nothing half-written was kept. Fix: run it again"
    ]
    assert not list(out.iterdir())


def _start_shards(corpus, src, out) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "tools/preprocess_data.py", "--input", str(src), "--output-dir", str(out),
         "--tokenizer", str(corpus["tokenizer"]), "--workers", "2"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip


def _writer_of(proc: subprocess.Popen, path) -> int | None:
    """The worker of ``proc`` that holds ``path`` open, once one does."""
    # By each process's parent: /proc/PID/task/PID/children may miss a child of a running process.
    for child in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[1]) != proc.pid:
                continue
            if any(
                os.readlink(f"/proc/{child}/fd/{fd}") == str(path) for fd in os.listdir(f"/proc/{child}/fd")
            ):
                return int(child)
        except FileNotFoundError:  # a file closed, or a process gone, while looking
            continue
    return None


def _wait_for(proc: subprocess.Popen, ready) -> None:
    deadline = time.monotonic() + 120
    while not ready():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.002)


def _own_processes(proc: subprocess.Popen) -> list[str]:
    """Processes left in the tool's session after it ended."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getsid(int(pid)) == proc.pid:
                found.append(pid)
        except ProcessLookupError:
            continue
    return found


@pytest.mark.parametrize(
    "sent, group, code",
    [(signal.SIGTERM, True, -signal.SIGTERM), (signal.SIGTERM, False, -signal.SIGTERM),
     (signal.SIGINT, True, 130)],
    # Slurm signals every process of the job; `kill` the one named; a terminal's Ctrl-C the group
    ids=["sigterm-to-all", "sigterm-to-the-tool", "ctrl-c"],
)  # fmt: skip
def test_a_stop_of_sharded_output_ends_the_datasets_being_written_at_once(
    corpus, tmp_path, sent, group, code
):
    """Not after the files the workers were writing, and those queued behind them, were finished:
    that took as long as they did, past Slurm's grace between SIGTERM and SIGKILL."""
    src, out = tmp_path / "in", tmp_path / "out"
    src.mkdir()
    for name in "abc":
        (src / f"{name}.jsonl").write_text(corpus["jsonl"].read_text() * 4)
    proc = _start_shards(corpus, src, out)
    _wait_for(proc, lambda: all(_writer_of(proc, out / f"{n}.bin.tmp") for n in "ab"))
    (os.killpg if group else os.kill)(proc.pid, sent)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == code, stderr[-2000:]
    assert stderr.splitlines()[-1].endswith(
        "before it finished; nothing half-written was kept. Fix: run it again"
    )
    # The folder this run made, with nothing finished in it, is gone.
    assert not out.exists(), list(out.iterdir())
    assert not _own_processes(proc)


def test_a_worker_killed_under_sharded_output_is_one_line_and_keeps_the_finished_datasets(corpus, tmp_path):
    src, out = tmp_path / "in", tmp_path / "out"
    src.mkdir()
    text = corpus["jsonl"].read_text()
    (src / "a.jsonl").write_text("".join(text.splitlines(keepends=True)[:10]))
    # No third file: the worker done with a would take it, and might finish it before the kill.
    (src / "b.jsonl").write_text(text * 4)
    proc = _start_shards(corpus, src, out)
    _wait_for(proc, lambda: (out / "a.idx").exists() and _writer_of(proc, out / "b.bin.tmp"))
    # As the kernel's out-of-memory killer ends a process.
    os.kill(_writer_of(proc, out / "b.bin.tmp"), signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1, stderr[-2000:]
    assert stderr.splitlines()[-1].startswith(
        "error: a worker process ended abruptly while writing the datasets"
    )
    assert sorted(p.name for p in out.iterdir()) == ["a.bin", "a.idx"]
    assert not _own_processes(proc)


@pytest.mark.parametrize(
    "command",
    [
        ["-m", "megatron_train.train", "--config", "configs/demo.yaml"],
        # The tools that import torch themselves import the package before it.
        ["tools/generate.py", "--ckpt", "runs/none", "--prompt", "x"],
        ["tools/convert_checkpoint.py", "export-hf", "--ckpt", "runs/none", "--out", "hf/none"],
    ],
    ids=["train", "generate", "convert"],
)
def test_ctrl_c_while_a_command_imports_is_one_line(command):
    """Before a command's own handler is in place, while Python still imports torch and
    megatron-core: one line, not the import's trace, and Python's end by SIGINT (130 in a shell)."""
    proc = subprocess.Popen(
        [sys.executable, *command],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    # torch's library is mapped as its import begins; megatron-core's import follows it.
    maps, deadline = f"/proc/{proc.pid}/maps", time.monotonic() + 60
    while "libtorch" not in open(maps).read():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.002)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGINT, stderr[-2000:]
    assert stderr.splitlines() == [
        "error: interrupted while starting; nothing was written. Fix: run it again"
    ]


def _tool(name: str):
    return load_tool(f"tools/{name}.py")


def test_sharded_output_resumes_and_merges_into_the_single_dataset(tmp_path, corpus, capsys):
    lines = corpus["jsonl"].read_text().splitlines(keepends=True)
    src = tmp_path / "in"
    (src / "part").mkdir(parents=True)
    (src / "a.jsonl").write_text("".join(lines[:60]))
    (src / "part" / "b.jsonl.gz").write_bytes(gzip.compress("".join(lines[60:130]).encode()))
    (src / "part" / "c.jsonl").write_text("".join(lines[130:]))
    preprocess, merge = _tool("preprocess_data"), _tool("merge_datasets")
    tokenizer = ["--tokenizer", str(corpus["tokenizer"]), "--workers", "2"]
    assert preprocess.main(["--input", str(src), "--output-prefix", str(tmp_path / "one"), *tokenizer]) == 0
    shards = tmp_path / "shards"
    assert preprocess.main(["--input", str(src), "--output-dir", str(shards), *tokenizer]) == 0
    assert sorted(p.name for p in shards.iterdir()) == [
        f"{n}.{s}" for n in ("a", "part__b", "part__c") for s in ("bin", "idx")
    ]
    # A run killed while writing part__b: its temporary files, no .idx.
    (shards / "part__b.idx").unlink()
    (shards / "part__b.bin").rename(shards / "part__b.bin.tmp")
    kept = {p.name: p.stat().st_mtime_ns for p in shards.glob("part__c.*")}
    capsys.readouterr()
    assert preprocess.main(["--input", str(src), "--output-dir", str(shards), *tokenizer]) == 0
    assert "2 of 3 datasets already written" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in shards.glob("part__c.*")} == kept
    assert not list(shards.glob("*.tmp"))
    # A dataset named twice, the second time by another spelling, is merged once (as preprocess
    # reads a file named twice once).
    again = f"{shards}/../shards/part__c"
    assert merge.main(["--input", str(shards), again, "--output-prefix", str(tmp_path / "merged")]) == 0
    assert "from 3 dataset(s)" in capsys.readouterr().out
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"merged{suffix}").read_bytes() == (tmp_path / f"one{suffix}").read_bytes()


def test_merge_refuses_a_damaged_dataset_and_writes_nothing(tmp_path, corpus, capsys):
    (tmp_path / "bad.idx").write_bytes(b"MMIDIDX\x00\x00garbage")
    (tmp_path / "bad.bin").write_bytes(b"")
    merge = _tool("merge_datasets")
    args = [
        "--input",
        str(corpus["prefix"]),
        str(tmp_path / "bad"),
        "--output-prefix",
        str(tmp_path / "out" / "m"),
    ]
    assert merge.main(args) == 2
    assert "bad.idx" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_two_inputs_that_would_share_a_dataset_name_are_refused(shards):
    (shards / "a.parquet").write_bytes((shards / "sub" / "d.parquet").read_bytes())
    with pytest.raises(ConfigError, match="both be written as dataset 'a'"):
        _tool("preprocess_data").shard_names(input_files([str(shards)]))
