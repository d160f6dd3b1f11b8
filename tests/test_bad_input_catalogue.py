"""A catalogue of bad inputs across every entry point: each stops with its documented exit code and
one ``error:`` line naming the problem, and every file of the workspace (the inputs, an existing
run, existing outputs) hashes the same before and after; nothing new appears either.

Cases run in-process (each entry point's ``main``) for speed; tests elsewhere cover the CLIs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from megatron_train import cli, data_cache
from megatron_train.token_writer import TokenWriter
from tests.conftest import ROOT, free_port, load_tool, run_tool, write_config

transformers = pytest.importorskip("transformers")


def _tool(path: str) -> Callable[[list[str]], int]:
    return load_tool(path).main


def _entry(name: str) -> Callable[[list[str]], int]:
    if name == "train":
        from megatron_train.train import main
    elif name == "preflight":
        from megatron_train.preflight import main
    else:
        main = _tool(
            {
                "submit": "launch/submit.py",
                "convert": "tools/convert_checkpoint.py",
                "generate": "tools/generate.py",
                "inspect": "tools/inspect_checkpoint.py",
                "preprocess": "tools/preprocess_data.py",
                "merge": "tools/merge_datasets.py",
                "tokenizer": "tools/train_tokenizer.py",
                "corpus": "tools/stdlib_corpus.py",
            }[name]
        )
    return main


@dataclass
class Case:
    id: str
    entry: str
    argv: Callable[[Path], list[str]]
    says: str
    """Text the one error line must contain (the problem it names)."""
    setup: Callable[[Path], None] | None = None
    code: int = 2
    env: dict[str, str | None] | None = None
    """Launcher variables that differ from one process of a one-rank world (None: unset)."""


# -- workspace: inputs and an existing run, shared by all cases ------------------------------------


@pytest.fixture(scope="module")
def ws(tmp_path_factory, corpus, trained) -> Path:
    ws = tmp_path_factory.mktemp("catalogue")
    (ws / "corpus").mkdir()
    for name in ("stdlib.bin", "stdlib.idx", "spm.model", "stdlib.jsonl"):
        src = corpus["prefix"].parent / name
        shutil.copy2(src, ws / "corpus" / name)
    shutil.copytree(trained["run"], ws / "run")
    write_config(
        ws / "cfg.yaml",
        {"prefix": ws / "corpus" / "stdlib", "tokenizer": ws / "corpus" / "spm.model"},
        ws / "run",
        checkpoint={"interval": 2},
        train={"steps": 4},
    )
    config = transformers.LlamaConfig(
        vocab_size=1024, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(ws / "hf")
    (ws / "cases").mkdir()
    return ws


def _hashes(*roots: Path) -> dict[str, str]:
    found = {}
    for root in roots:
        for path in sorted(root.rglob("*")):
            if path.is_file():
                found[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                found[str(path)] = "dir"
    return found


# -- helpers that make one damaged input inside the case's own folder -------------------------------

CKPT = "run/checkpoints/iter_0000004"


def _case(ws: Path, case_id: str) -> Path:
    return ws / "cases" / case_id


def _write(rel: str, content: bytes | str) -> Callable[[Path, str], None]:
    def setup(ws: Path, case_id: str) -> None:
        path = _case(ws, case_id) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode() if isinstance(content, str) else content)

    return setup


def _writes(*files: tuple[str, str]) -> Callable[[Path, str], None]:
    """Several files in the case's folder, as :func:`_write` writes one."""

    def setup(ws: Path, case_id: str) -> None:
        for rel, content in files:
            _write(rel, content)(ws, case_id)

    return setup


def _link(rel: str, target: str) -> Callable[[Path, str], None]:
    """A symbolic link ``rel`` in the case's folder to ``target`` (relative to the link)."""

    def setup(ws: Path, case_id: str) -> None:
        path = _case(ws, case_id) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.symlink_to(target)

    return setup


LONG_NAME = "n" * 300  # file systems allow 255 bytes a name
ROOMLESS_NAME = "n" * 250  # a name the file system takes, without room for a temporary ending


def _copy_ckpt(damage: Callable[[Path], None] | None = None) -> Callable[[Path, str], None]:
    def setup(ws: Path, case_id: str) -> None:
        dst = _case(ws, case_id) / "ckpt" / "iter_0000004"
        shutil.copytree(ws / CKPT, dst)
        if damage:
            damage(dst)

    return setup


def _run_with_ckpt(damage: Callable[[Path], None]) -> Callable[[Path, str], None]:
    """A run directory of the case's own whose one checkpoint ``damage`` changes."""

    def setup(ws: Path, case_id: str) -> None:
        dst = _case(ws, case_id) / "run" / "checkpoints" / "iter_0000004"
        shutil.copytree(ws / CKPT, dst)
        damage(dst)

    return setup


def _saves_with_an_older_ckpt(folder: str, damage: Callable[[Path], None]) -> Callable[[Path, str], None]:
    """A save dir ``folder`` of the case's own with a whole checkpoint at step 2 and one at step 4
    that ``damage`` changes."""

    def setup(ws: Path, case_id: str) -> None:
        saves = _case(ws, case_id) / folder
        shutil.copytree(ws / CKPT, saves / "iter_0000002")
        shutil.copytree(ws / CKPT, saves / "iter_0000004")
        damage(saves / "iter_0000004")

    return setup


def _without_checksums(ckpt: Path) -> None:
    record = json.loads((ckpt / "complete.json").read_text())
    for entry in record["files"].values():
        entry.pop("sha256")
    (ckpt / "complete.json").write_text(json.dumps(record))


def _same_size_garbage(name: str) -> Callable[[Path], None]:
    def damage(ckpt: Path) -> None:
        size = (ckpt / name).stat().st_size
        (ckpt / name).write_bytes(b"\x07" * size)
        record = json.loads((ckpt / "complete.json").read_text())
        record["files"][name].pop("sha256")
        (ckpt / "complete.json").write_text(json.dumps(record))

    return damage


def _record_size_only(ckpt: Path, name: str) -> None:
    """Record file ``name``'s new size in the completion record, leaving its old checksum."""
    record = json.loads((ckpt / "complete.json").read_text())
    record["files"][name]["size"] = (ckpt / name).stat().st_size
    (ckpt / "complete.json").write_text(json.dumps(record))


def _recorded_without_common(ckpt: Path) -> None:
    (ckpt / "common.pt").unlink()
    record = json.loads((ckpt / "complete.json").read_text())
    del record["files"]["common.pt"]
    (ckpt / "complete.json").write_text(json.dumps(record))


def _common_changed_in_place(ckpt: Path) -> None:
    """common.pt without one field of the schedule's state, its recorded size updated but not its
    checksum: a file changed in place, as a flipped bit leaves it (the size check passes)."""
    import torch

    common = torch.load(ckpt / "common.pt", weights_only=True)
    del common["scheduler"]["end_wd"]
    torch.save(common, ckpt / "common.pt")
    _record_size_only(ckpt, "common.pt")


def _trained_elsewhere(ckpt: Path) -> None:
    """The checkpoint of a run whose config named its tokenizer by a path relative to the folder
    training ran in (as configs/demo.yaml does), recorded whole: nothing in it is damaged."""
    import torch

    from megatron_train.checkpoint.files import sha256_of

    common = torch.load(ckpt / "common.pt", weights_only=True)
    common["config"]["data"]["tokenizer"]["path"] = "runs/demo/data/spm.model"
    torch.save(common, ckpt / "common.pt")
    record = json.loads((ckpt / "complete.json").read_text())
    record["files"]["common.pt"] = {
        "size": (ckpt / "common.pt").stat().st_size,
        "sha256": sha256_of(ckpt / "common.pt"),
    }
    (ckpt / "complete.json").write_text(json.dumps(record))


def _metadata_key_changed_in_place(ckpt: Path) -> None:
    """DCP's .metadata with one tensor's name mangled, its recorded size updated but not its
    checksum: a file changed in place, as a flipped bit leaves it."""
    import pickle

    metadata = pickle.loads((ckpt / ".metadata").read_bytes())
    tensors = metadata.state_dict_metadata
    tensors["decoder.final_layernorm.weighs"] = tensors.pop("decoder.final_layernorm.weight")
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    _record_size_only(ckpt, ".metadata")


def _copy_data(damage: Callable[[Path], None]) -> Callable[[Path, str], None]:
    def setup(ws: Path, case_id: str) -> None:
        d = _case(ws, case_id)
        d.mkdir(parents=True)
        for suffix in (".bin", ".idx"):
            shutil.copy2(ws / "corpus" / f"stdlib{suffix}", d / f"data{suffix}")
        damage(d / "data")

    return setup


def _set_idx_entry(array: str, index: int, value: int) -> Callable[[Path], None]:
    """Set entry ``index`` (negative: from the end) of one of the .idx's arrays: ``lengths``
    (int32), ``pointers`` or ``documents`` (int64), keeping every size as it was."""

    def damage(prefix: Path) -> None:
        idx = prefix.with_suffix(".idx")
        sequences, documents = struct.unpack("<QQ", idx.read_bytes()[18:34])
        offset, dtype, count = {
            "lengths": (34, np.int32, sequences),
            "pointers": (34 + 4 * sequences, np.int64, sequences),
            "documents": (34 + 12 * sequences, np.int64, documents),
        }[array]
        np.memmap(idx, dtype, "r+", offset=offset, shape=(count,))[index] = value

    return damage


def _imported_with_same_size_config(text: str) -> Callable[[Path, str], None]:
    """The workspace's Hugging Face model imported, its copy of config.json then replaced by
    ``text`` padded to the same size (its completion record checks sizes)."""

    def setup(ws: Path, case_id: str) -> None:
        out = _case(ws, case_id) / "ckpt"
        run_tool("tools/convert_checkpoint.py", "import-hf", "--hf", str(ws / "hf"), "--out", str(out))
        config = out / "iter_0000000" / "hf" / "config.json"
        config.write_text(text.ljust(config.stat().st_size))

    return setup


def _small_data(docs: int, tokens: int, token_id: int = 5) -> Callable[[Path, str], None]:
    """A dataset of ``docs`` documents of ``tokens`` tokens each, all ``token_id``."""

    def setup(ws: Path, case_id: str) -> None:
        d = _case(ws, case_id)
        d.mkdir(parents=True)
        with open(d / "data.bin", "wb") as f:
            writer = TokenWriter(f, np.dtype(np.uint16))
            writer.add([[token_id] * tokens for _ in range(docs)])
        writer.write_index(d / "data.idx")

    return setup


def _corpus_link(ws: Path, case_id: str) -> None:
    """A symbolic link to the corpus folder: the same dataset at another path."""
    _case(ws, case_id).symlink_to(ws / "corpus", target_is_directory=True)


def _bare_venv(ws: Path, case_id: str) -> None:
    """A Python environment without the training stack (a system or another project's python)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(_case(ws, case_id))], check=True)


_HELD: list[socket.socket] = []


def _master_port_taken(ws: Path, case_id: str) -> None:
    """Another job's listener on the job's MASTER_PORT, open until the tests end."""
    sock = socket.socket()
    sock.bind(("", int(os.environ["MASTER_PORT"])))
    sock.listen()
    _HELD.append(sock)


def _another_program_on_master_port(ws: Path, case_id: str) -> None:
    """A program other than torch's store at MASTER_PORT (a web server), answering each connection."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", int(os.environ["MASTER_PORT"])))
    sock.listen()
    _HELD.append(sock)

    def answer() -> None:
        with contextlib.suppress(OSError):  # the socket closes when the tests end
            while True:
                client, _ = sock.accept()
                client.recv(64)
                client.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
                _HELD.append(client)  # open, as a server waiting for the rest of a request keeps it

    threading.Thread(target=answer, daemon=True).start()


def _data_tokenized_again(ws: Path, case_id: str) -> None:
    """A cache whose indices were built from the corpus, and another dataset now at its prefix."""
    _small_data(400, 70)(ws, case_id)
    d = _case(ws, case_id)
    shutil.move(d / "data.bin", d / "new.bin")
    shutil.move(d / "data.idx", d / "new.idx")
    for suffix in (".bin", ".idx"):
        shutil.copy2(ws / "corpus" / f"stdlib{suffix}", d / f"data{suffix}")
    data_cache.record(d / "cache", [str(d / "data")])
    for suffix in (".bin", ".idx"):
        shutil.move(d / f"new{suffix}", d / f"data{suffix}")


def _bigger_tokenizer(ws: Path, case_id: str) -> None:
    """A SentencePiece model with more tokens than the trained run's vocabulary."""
    d = _case(ws, case_id)
    d.mkdir(parents=True)
    argv = ["--input", str(ws / "corpus" / "stdlib.jsonl"), "--output-prefix", str(d / "spm")]
    assert _tool("tools/train_tokenizer.py")([*argv, "--vocab-size", "1200", "--max-sentences", "4000"]) == 0


def _truncate(suffix: str, keep: int) -> Callable[[Path], None]:
    def damage(prefix: Path) -> None:
        path = prefix.with_suffix(suffix)
        path.write_bytes(path.read_bytes()[:keep])

    return damage


def _patch_idx(offset: int, data: bytes) -> Callable[[Path], None]:
    def damage(prefix: Path) -> None:
        path = prefix.with_suffix(".idx")
        raw = bytearray(path.read_bytes())
        raw[offset : offset + len(data)] = data
        path.write_bytes(bytes(raw))

    return damage


# Llama-3.1 RoPE scaling as config.json holds it, one of its required keys left out.
LLAMA3_ROPE_WITHOUT_LOW_FREQ_FACTOR = {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}  # fmt: skip


def _hf_copy(edit: Callable[[Path], None]) -> Callable[[Path, str], None]:
    def setup(ws: Path, case_id: str) -> None:
        dst = _case(ws, case_id) / "hf"
        shutil.copytree(ws / "hf", dst)
        edit(dst)

    return setup


def _edit_hf_config(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def edit(hf: Path) -> None:
        config = json.loads((hf / "config.json").read_text())
        change(config)
        (hf / "config.json").write_text(json.dumps(config))

    return edit


def _edit_hf_text(old: str, new: str) -> Callable[[Path], None]:
    """config.json with its first ``old`` replaced by ``new``, as text (json.dumps cannot write
    every bad value)."""

    def edit(hf: Path) -> None:
        text = (hf / "config.json").read_text()
        assert old in text
        (hf / "config.json").write_text(text.replace(old, new, 1))

    return edit


def _hf_config_linked_to(target: str) -> Callable[[Path], None]:
    """config.json replaced by a symbolic link to ``target``."""

    def edit(hf: Path) -> None:
        (hf / "config.json").unlink()
        (hf / "config.json").symlink_to(target)

    return edit


def _copy_config(ws: Path, case_id: str) -> None:
    """The experiment's config kept in the folder it names as its run directory."""
    _case(ws, case_id).mkdir(parents=True)
    shutil.copy2(ws / "cfg.yaml", _case(ws, case_id) / "config.yaml")


def _train(*overrides: str, config: str = "cfg.yaml") -> Callable[[Path], list[str]]:
    return lambda ws: ["--config", str(ws / config), *[o.replace("WS/", f"{ws}/") for o in overrides]]


def _args(*args: str) -> Callable[[Path], list[str]]:
    return lambda ws: [a.replace("WS/", f"{ws}/") for a in args]


def _preflight(*overrides: str) -> Callable[[Path], list[str]]:
    """The preflight of the workspace's config for one GPU."""
    return _args("--config", "WS/cfg.yaml", "--gpus-per-node", "1", *overrides)


def _preprocess(*args: str) -> Callable[[Path], list[str]]:
    """Preprocessing the workspace's corpus with its tokenizer."""
    return _args("--input", "WS/corpus/stdlib.jsonl", "--tokenizer", "WS/corpus/spm.model", *args)


def _preprocess_with(tokenizer: str) -> Callable[[Path], list[str]]:
    """Preprocessing the workspace's corpus with the tokenizer at ``tokenizer``."""
    corpus = ("--input", "WS/corpus/stdlib.jsonl")
    return _args(*corpus, "--output-prefix", "WS/cases/p/out", "--tokenizer", tokenizer)


FRESH = "logging.run_dir=WS/cases/fresh_run"  # a run that must not be created by a failed start
# A well-formed key, so that the start gets as far as wandb.init, and the discard port.
WANDB_UNREACHABLE = {
    "WANDB_API_KEY": "0" * 40,
    "WANDB_BASE_URL": "http://127.0.0.1:9",
    "WANDB_INIT_TIMEOUT": "1",
}
# The server named: not the one an earlier case's settings left in wandb (its default, 90 s away).
UNREACHABLE_SAYS = (
    "'logging.wandb': wandb could not start its online run: Timed out while retrying: "
    'Post "http://127.0.0.1:9/'
)

# Each level nine times the one before: 9**7 strings in data.blend.
ALIAS_BOMB = (
    "a: &a ["
    + ", ".join(["x"] * 9)
    + "]\n"
    + "".join(
        f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]\n" for prev, name in zip("abcdef", "bcdefg")
    )
)
ALIAS_BOMB = "data:\n  blend:\n" + "".join(f"    {line}\n" for line in ALIAS_BOMB.splitlines())

CASES = [
    # train: the config file itself
    Case("config-missing", "train", _train(config="nope.yaml"), "does not exist"),
    Case("config-a-device", "train", _train(config="/dev/null"), "'/dev/null' is not a regular file"),
    Case("config-is-dir", "train", _train(config="corpus"), "is a directory"),
    Case(
        "config-syntax",
        "train",
        _train(config="cases/config-syntax/c.yaml"),
        "not valid YAML at line",
        _write("c.yaml", "model:\n  preset: [tiny\n"),
    ),
    Case(
        "config-list",
        "train",
        _train(config="cases/config-list/c.yaml"),
        "not a mapping",
        _write("c.yaml", "- model\n- data\n"),
    ),
    Case(
        "config-section-scalar",
        "train",
        _train(config="cases/config-section-scalar/c.yaml"),
        "'model'",
        _write("c.yaml", "model: 5\n"),
    ),
    Case(
        "config-binary",
        "train",
        _train(config="cases/config-binary/c.yaml"),
        "cannot be read",
        _write("c.yaml", b"\x89PNG\r\n\x1a\n\x00model"),  # an image named by mistake
    ),
    Case(
        # A YAML escape puts a NUL into a path, which os.path refuses with a ValueError.
        "config-path-with-a-nul-character",
        "train",
        _train(config="cases/config-path-with-a-nul-character/c.yaml"),
        "'runs/a\\x00b' is not valid. Fix: set logging.run_dir to a non-empty path without NUL characters",
        _write("c.yaml", 'logging:\n  run_dir: "runs/a\\0b"\n'),
    ),
    Case(
        "config-key-twice",
        "train",
        _train(config="cases/config-key-twice/c.yaml"),
        "key 'model' is given twice",
        _write("c.yaml", "model: {preset: tiny}\ntrain: {steps: 2}\nmodel: {preset: small}\n"),
    ),
    Case(
        "config-nested-too-deeply",
        "train",
        _train(config="cases/config-nested-too-deeply/c.yaml"),
        "nests lists or mappings too deeply",
        _write("c.yaml", "model: " + "[" * 5000 + "]" * 5000 + "\n"),
    ),
    Case(
        "override-nested-too-deeply",
        "train",
        _train("model.num_layers=" + "[" * 5000 + "]" * 5000),
        "'model.num_layers': the value nests",
    ),
    Case(
        # A few lines of aliases make millions of entries: the line shows their start.
        "config-alias-bomb",
        "train",
        _train(config="cases/config-alias-bomb/c.yaml"),
        "'data.blend': expected a list, got {'a': ['x', 'x', 'x', 'x', 'x', 'x', ...], 'b': [[...],",
        _write("c.yaml", ALIAS_BOMB),
    ),
    Case(
        "config-integer-too-long",
        "train",
        _train(config="cases/config-integer-too-long/c.yaml"),
        "line 2, column 10: an integer of 5,001 characters, too long to read",
        _write("c.yaml", "train:\n  steps: 1" + "0" * 5000 + "\n"),
    ),
    Case(
        "override-hex-integer-of-thousands-of-digits",
        "train",
        _train("train.steps=0x" + "f" * 5000),
        "'train.steps': an integer of about 6,021 digits is beyond 64-bit integers",
    ),
    Case(
        # An integer is a number where a float is expected; this one is past the largest float.
        "override-float-given-an-integer-past-every-float",
        "train",
        _train("optimizer.lr=1" + "0" * 400),
        "'optimizer.lr': an integer of about 401 digits is not a finite number",
    ),
    Case(
        "override-integer-past-int64",
        "train",
        _train(f"model.num_layers={2**63}"),
        "'model.num_layers': 9223372036854775808 is beyond 64-bit integers. Fix: set model.num_layers to at "
        "most 9,223,372,036,854,775,807",
    ),
    Case("config-name-too-long", "train", _train(config=f"{LONG_NAME}.yaml"), "a name in it is 305 bytes"),
    Case(
        "blend-name-too-long", "train", _train(f"data.blend=[WS/{LONG_NAME}]"), "longer than the file system"
    ),
    Case("override-no-equals", "train", _train("train.steps"), "key.sub=value"),
    # argparse kept the last of an option given twice
    Case("config-given-twice", "train", _train("--config", "WS/cfg.yaml"), "argument --config: given twice"),
    Case(
        "config-misspelt",
        "train",
        _args("--confg", "WS/cfg.yaml"),
        "required: --config (not an option here: --confg)",
    ),
    # a Megatron-LM user's flag, and an override written as one: named as the override it is here
    Case(
        "megatron-lm-flag",
        "train",
        _train("--train-iters", "10"),
        "--train-iters. Fix: give it as a config override after --config, key=value without dashes: "
        "train.steps=10 (Megatron-LM's --train-iters)",
    ),
    Case(
        "override-as-a-flag",
        "preflight",
        _preflight("--optimizer.lr=1e-4"),
        "without dashes: optimizer.lr=1e-4",
    ),
    Case(
        "generate-prompt-given-twice",
        "generate",
        _args("--ckpt", f"WS/{CKPT}", "--prompt", "def", "--prompt", "class"),
        "argument --prompt: given twice ('def', then 'class')",
    ),
    # it said "train one with tools/train_tokenizer.py", as if the run had none
    Case(
        "generate-tokenizer-relative-to-where-training-ran",
        "generate",
        _args("--ckpt", "WS/cases/generate-tokenizer-relative-to-where-training-ran/ckpt", "--prompt", "def"),
        "'runs/demo/data/spm.model' (data.tokenizer.path in the checkpoint's config) does not exist under",
        _copy_ckpt(_trained_elsewhere),
    ),
    Case(
        "export-hf-tokenizer-relative-to-where-training-ran",
        "convert",
        _args(
            "export-hf",
            "--ckpt",
            "WS/cases/export-hf-tokenizer-relative-to-where-training-ran/ckpt",
            "--out",
            "WS/cases/export-hf-tokenizer-relative-to-where-training-ran/hf",
        ),
        "'runs/demo/data/spm.model' (data.tokenizer.path in its config) does not exist under ",
        _copy_ckpt(_trained_elsewhere),
    ),
    # it named a tensor the model has no place for, as if the architecture were another one
    Case(
        "generate-metadata-changed-in-place",
        "generate",
        _args("--ckpt", "WS/cases/generate-metadata-changed-in-place/ckpt", "--prompt", "def"),
        "iter_0000004/.metadata fails its SHA-256 check: the checkpoint is corrupt",
        _copy_ckpt(_metadata_key_changed_in_place),
    ),
    # "use another checkpoint", without naming one
    Case(
        "export-hf-newest-changed-in-place",
        "convert",
        _args(
            "export-hf", "--ckpt", "WS/cases/export-hf-newest-changed-in-place/ckpt", "--out", "WS/cases/hf"
        ),
        "fails its SHA-256 check: the checkpoint is corrupt; use another checkpoint (",
        _saves_with_an_older_ckpt("ckpt", _metadata_key_changed_in_place),
    ),
    # a KeyError traceback: the export reads each tensor its config implies by name
    Case(
        "export-hf-metadata-without-a-tensor",
        "convert",
        _args(
            "export-hf", "--ckpt", "WS/cases/export-hf-metadata-without-a-tensor/ckpt", "--out", "WS/cases/hf"
        ),
        "holds no tensor decoder.final_layernorm.weight, which its config implies: the checkpoint is corrupt",
        _copy_ckpt(lambda ckpt: (_metadata_key_changed_in_place(ckpt), _without_checksums(ckpt))),
    ),
    # An empty path (a shell variable not set) was the current folder, named '.' in what followed.
    Case(
        "export-hf-out-empty",
        "convert",
        _args("export-hf", "--ckpt", f"WS/{CKPT}", "--out", ""),
        "argument --out: an empty value",
    ),
    Case(
        "import-hf-from-empty",
        "convert",
        _args("import-hf", "--hf", "", "--out", "WS/cases/o"),
        "argument --hf: an empty value",
    ),
    Case("inspect-empty-path", "inspect", _args(""), "argument path: an empty value"),
    Case("train-config-empty", "train", _args("--config", ""), "argument --config: an empty value"),
    Case("preflight-config-empty", "preflight", _args("--config", ""), "argument --config: an empty value"),
    Case(
        "submit-log-dir-empty",
        "submit",
        _args("--config", "WS/cfg.yaml", "--log-dir", "", "--dry-run"),
        "argument --log-dir: an empty value",
    ),
    Case(
        "generate-tokenizer-empty",
        "generate",
        _args("--ckpt", f"WS/{CKPT}", "--prompt", "x", "--tokenizer", ""),
        "argument --tokenizer: an empty value",
    ),
    # both said a path ".nnn...nnn.partial-<pid>" of their own was too long, not what to shorten
    Case(
        "export-hf-out-name-without-room",
        "convert",
        _args("export-hf", "--ckpt", f"WS/{CKPT}", "--out", f"WS/cases/{ROOMLESS_NAME}"),
        "config error at '--out': its file name is 250 bytes long",
    ),
    Case(
        "import-hf-out-name-without-room",
        "convert",
        _args("import-hf", "--hf", "WS/hf", "--out", f"WS/cases/{ROOMLESS_NAME}"),
        "config error at '--out': its file name is 250 bytes long",
    ),
    Case(
        "export-hf-out-given-twice",
        "convert",
        _args("export-hf", "--ckpt", f"WS/{CKPT}", "--out", "WS/cases/a", "--out", "WS/cases/b"),
        "argument --out: given twice",
    ),
    Case(
        "recompute-modules-without-selective",
        "train",
        _train("model.recompute_modules=[mlp]", FRESH),
        "no effect with model.recompute=none",
    ),
    Case("override-into-scalar", "train", _train("train.steps.x=1"), "write train.steps=VALUE"),
    Case("override-unknown-section", "train", _train("trian.steps=1"), "did you mean"),
    Case(
        "override-neither-union-option",
        "train",
        _train("checkpoint.fully_parallel_load=maybe"),
        "to true or false, or 'auto'",
    ),
    Case("odd-head-dimension", "train", _train("model.kv_channels=7", FRESH), "channels in pairs"),
    Case("loader-workers-beyond-cores", "train", _train("data.num_workers=1000000", FRESH), "CPU cores"),
    Case(
        "cuda-only-attention-kernel",
        "train",
        _train("model.attention_backend=efficient", FRESH),
        "only on CUDA",
    ),
    Case(
        "flash-attention-dropout-on-cpu",
        "train",
        _train("model.attention_backend=flash", "model.attention_dropout=0.1", FRESH),
        "flash attention has no dropout on the CPU",
    ),
    # train: mixture of experts
    Case("moe-on-llama", "train", _train("model.num_experts=8", FRESH), "no mixture-of-experts models"),
    Case(
        "expert-parallel-on-dense",
        "train",
        _train("parallel.expert=2", FRESH),
        "mixture-of-experts models only",
    ),
    Case(
        "recompute-dense-mlp-of-an-expert-model",
        "train",
        _train(
            "model.preset=qwen3-moe-tiny", "model.recompute=selective", "model.recompute_modules=[mlp]", FRESH
        ),
        "use 'moe' for the whole expert layer",
    ),
    Case(
        "moe-topk-above-experts",
        "train",
        _train("model.preset=qwen3-moe-tiny", "model.moe_router_topk=9", FRESH),
        "exceeds model.num_experts=8",
    ),  # fmt: skip
    Case(
        "moe-experts-over-ep",
        "train",
        _train("model.preset=qwen3-moe-tiny", "parallel.expert=3", FRESH),
        "not divisible over 3",
    ),  # fmt: skip
    Case(
        "moe-expert-bias-softmax",
        "train",
        _train("model.preset=qwen3-moe-tiny", "model.moe_router_expert_bias=true", FRESH),
        "sigmoid",
    ),  # fmt: skip
    Case(
        "moe-pre-softmax-with-sigmoid",
        "train",
        _train(
            "model.preset=qwen3-moe-tiny",
            "model.moe_router_score_function=sigmoid",
            "model.moe_router_pre_softmax=true",
            FRESH,
        ),
        "moe_router_score_function is sigmoid",
    ),
    Case(
        "mixtral-without-experts",
        "train",
        _train("model.family=mixtral", "model.preset=null", FRESH),
        "every Mixtral model is a mixture of experts",
    ),  # fmt: skip
    Case("resume-dense-run-as-moe", "train", _train("model.preset=qwen3-moe-tiny"), "architecture mismatch"),
    # train: long context
    Case(
        "reset-positions-without-document-mask",
        "train",
        _train("data.reset_position_ids=true", FRESH),
        "data.document_mask is false",
    ),
    # train: schedule
    Case("min-lr-above-lr", "train", _train("optimizer.min_lr=1", FRESH), "exceeds the peak optimizer.lr"),
    Case("wsd-steps-without-wsd", "train", _train("optimizer.wsd_decay_steps=2", FRESH), "WSD only"),
    Case(
        "wsd-steps-beyond-the-run",
        "train",
        _train("optimizer.decay_style=WSD", "optimizer.wsd_decay_steps=40", FRESH),
        "do not fit",
    ),
    Case(
        "model-beyond-memory",
        "train",
        _train("model.hidden_size=65536", "model.ffn_hidden_size=200000", FRESH),
        "GiB each rank has",
    ),
    Case(
        # a size past int64, which a torch.Size of the parameter count overflowed
        "model-experts-past-int64",
        "train",
        _train("model.preset=qwen3-moe-tiny", "model.num_experts=1000000000000000000000", FRESH),
        "'model.num_experts': 1000000000000000000000 is beyond 64-bit integers",
    ),
    Case(
        "model-experts-within-int64-beyond-memory",
        "train",
        _train("model.preset=qwen3-moe-tiny", f"model.num_experts={2**62}", FRESH),
        "GiB each rank has",
    ),
    Case(
        "micro-batch-beyond-memory",
        "train",
        _train("train.micro_batch_size=200000", "train.global_batch_size=200000", FRESH),
        "GiB each rank has",
    ),
    Case(
        "steps-beyond-memory",
        "train",
        _train("train.steps=1000000000000", FRESH),
        "dataset indices megatron-core builds in memory",
    ),
    Case(
        "eval-steps-beyond-memory",
        "train",
        _train("train.eval_steps=1000000000000", FRESH),
        "train.eval_steps",
    ),
    # train: data and tokenizer
    Case("blend-odd-pairs", "train", _train("data.blend=[0.5, WS/corpus/stdlib, 0.5]"), "pairs"),
    Case("blend-zero-weights", "train", _train("data.blend=[0, WS/corpus/stdlib]"), "has weight 0"),
    Case(
        "blend-one-zero-weight",
        "train",
        _train("data.blend=[1, WS/corpus/stdlib, 0, WS/run]"),
        "run has weight 0",
    ),
    Case(
        # megatron-core divides the weights by their sum and asserts each share is positive.
        "blend-weight-vanishing",
        "train",
        _train("data.blend=[1e308, WS/corpus/stdlib, 1e-308, WS/cases/blend-weight-vanishing/data]"),
        "data's weight 1e-308 is 0 as a share of their sum 1e+308",
        _copy_data(lambda prefix: None),
    ),
    Case("blend-negative-weight", "train", _train("data.blend=[-1, WS/corpus/stdlib]"), "'data.blend'"),
    Case(
        "blend-names-a-dataset-twice",
        "train",
        _train("data.blend=[0.7, WS/corpus/stdlib, 0.3, WS/corpus/../corpus/stdlib]"),
        "named twice",
    ),
    Case(
        "blend-twice-via-link",
        "train",
        _train("data.blend=[0.7, WS/corpus/stdlib, 0.3, WS/cases/blend-twice-via-link/stdlib]"),
        "named twice",
        setup=_corpus_link,
    ),
    Case("blend-missing-idx", "train", _train("data.blend=[WS/corpus/nothing]"), "does not exist"),
    Case("blend-names-the-bin", "train", _train("data.blend=[WS/corpus/stdlib.bin]"), "drop the suffix"),
    Case("blend-names-a-folder", "train", _train("data.blend=[WS/corpus]"), "e.g. "),
    # it said the pattern's .bin did not exist and to preprocess the data again
    Case("blend-a-pattern", "train", _train("data.blend=[WS/corpus/std*]"), "/corpus/stdlib], or join them"),
    Case(
        "blend-names-the-text",
        "train",
        _train("data.blend=[WS/corpus/stdlib.jsonl]"),
        "preprocess_data.py --input",
    ),
    Case(
        "merge-input-empty",
        "merge",
        _args("--input", "WS/corpus/stdlib", "", "--output-prefix", "WS/cases/m"),
        "argument --input: an empty value",
    ),
    Case(
        "merge-output-prefix-a-device",
        "merge",
        _args("--input", "WS/corpus/stdlib", "--output-prefix", "/dev/null"),
        "/dev/null is a device, pipe or socket",
    ),
    # megatron-core's builder copied the damaged entry into the merged dataset: exit 0
    Case(
        "merge-input-with-a-damaged-entry",
        "merge",
        _args(
            "--input",
            "WS/corpus/stdlib",
            "WS/cases/merge-input-with-a-damaged-entry/data",
            "--output-prefix",
            "WS/cases/m",
        ),  # fmt: skip
        "merge-input-with-a-damaged-entry/data.idx is damaged: sequence 10 has length -5",
        _copy_data(_set_idx_entry("lengths", 10, -5)),
    ),
    # Path.resolve() before Python 3.13 raised RuntimeError for the loop: a traceback
    Case(
        "merge-input-a-loop-of-links",
        "merge",
        _args("--input", "WS/cases/merge-input-a-loop-of-links/data", "--output-prefix", "WS/cases/m"),
        "goes through a loop of symbolic links",
        _link("data", "data"),
    ),
    Case(
        "merge-input-names-the-idx",
        "merge",
        _args("--input", "WS/corpus/stdlib.idx", "--output-prefix", "WS/x"),
        "prefix",
    ),
    Case(
        "merge-input-a-pattern",
        "merge",
        _args("--input", "WS/corpus/*", "--output-prefix", "WS/x"),
        "is a pattern, which is not expanded here. Fix: list the datasets by prefix: [",
    ),
    Case(
        "bin-a-device",
        "train",
        _train("data.blend=[WS/cases/bin-a-device/data]"),
        "data.bin is not a regular file (a device, pipe or socket)",
        _copy_data(
            lambda prefix: (
                prefix.with_suffix(".bin").unlink(),
                prefix.with_suffix(".bin").symlink_to("/dev/zero"),
            )
        ),
    ),
    Case(
        "bin-truncated",
        "train",
        _train("data.blend=[WS/cases/bin-truncated/data]"),
        "data.bin",
        _copy_data(_truncate(".bin", 1000)),
    ),
    Case(
        "idx-truncated",
        "train",
        _train("data.blend=[WS/cases/idx-truncated/data]"),
        "data.idx",
        _copy_data(_truncate(".idx", 100)),
    ),
    # megatron-core asserts on an unweighted blend with a split too short for a sample, and loops
    # forever over a weighted blend's empty split
    Case(
        "split-in-exponent-notation", "train", _train("data.split=1e2,0,0", FRESH), "'1e2,0,0' is not valid"
    ),
    Case(
        "split-without-a-sample",
        "train",
        _train("data.blend=[WS/cases/split-without-a-sample/data]"),
        "the train split of",
        _small_data(docs=1, tokens=6),
    ),
    Case(
        "blend-split-without-a-sample",
        "train",
        _train("data.blend=[WS/corpus/stdlib,WS/cases/blend-split-without-a-sample/data]"),
        "the valid split of",
        _small_data(docs=10, tokens=20),
    ),
    Case(
        "weighted-blend-empty-split",
        "train",
        _train("data.blend=[0.5,WS/corpus/stdlib,0.5,WS/cases/weighted-blend-empty-split/data]"),
        "holds 0 tokens",
        _small_data(docs=4, tokens=400),
    ),
    # data.valid_blend: a held-out set read whole, so data.split has nothing to cut
    Case(
        "valid-blend-beside-a-split", "train", _train("data.valid_blend=[WS/corpus/stdlib]"), "'data.split'"
    ),
    Case(
        "valid-blend-empty", "train", _train("data.split=98,2,0", "data.valid_blend=[]"), "'data.valid_blend'"
    ),
    Case(
        "valid-blend-missing",
        "train",
        _train("data.split=98,2,0", "data.valid_blend=[WS/corpus/nothing]"),
        "'data.valid_blend'",
    ),
    Case(
        "valid-blend-shorter-than-a-sample",
        "train",
        _train("data.split=98,2,0", "data.valid_blend=[WS/cases/valid-blend-shorter-than-a-sample/data]"),
        "'data.valid_blend'",
        _small_data(docs=1, tokens=10),
    ),
    Case(
        "valid-blend-tokenized-with-a-larger-vocabulary",
        "train",
        _train(
            "data.split=98,2,0",
            "data.valid_blend=[WS/cases/valid-blend-tokenized-with-a-larger-vocabulary/data]",
        ),
        "'data.valid_blend'",
        _small_data(docs=50, tokens=200, token_id=60000),
    ),
    # ids beyond the embedding: an index error mid-run on the CPU, a device-side assert on a GPU
    Case(
        "blend-tokenized-with-a-larger-vocabulary",
        "train",
        _train("data.blend=[WS/cases/blend-tokenized-with-a-larger-vocabulary/data]"),
        "holds token id 60000, beyond the tokenizer's",
        _small_data(docs=50, tokens=200, token_id=60000),
    ),
    Case(
        "idx-header-only",
        "train",
        _train("data.blend=[WS/cases/idx-header-only/data]"),
        "data.idx",
        _copy_data(_truncate(".idx", 20)),
    ),
    # megatron-core reads the entries unchecked: a ValueError traceback from its index build
    Case(
        "idx-sequence-longer-than-its-bytes",
        "train",
        _train("data.blend=[WS/cases/idx-sequence-longer-than-its-bytes/data]"),
        "data.idx is damaged: sequence 11 starts at byte",
        _copy_data(_set_idx_entry("lengths", 10, 2**30)),
    ),
    # ... an AssertionError traceback
    Case(
        "idx-document-boundary-past-the-sequences",
        "train",
        _train("data.blend=[WS/cases/idx-document-boundary-past-the-sequences/data]"),
        "data.idx is damaged: document boundary",
        _copy_data(_set_idx_entry("documents", -1, 2**20)),
    ),
    # ... and training on other bytes than the documents'
    Case(
        "idx-negative-sequence-length",
        "train",
        _train("data.blend=[WS/cases/idx-negative-sequence-length/data]"),
        "data.idx is damaged: sequence 10 has length -5",
        _copy_data(_set_idx_entry("lengths", 10, -5)),
    ),
    Case(
        "idx-bad-magic",
        "train",
        _train("data.blend=[WS/cases/idx-bad-magic/data]"),
        "not a megatron index",
        _copy_data(_patch_idx(0, b"NOTANIDX\x00")),
    ),
    Case(
        "idx-bad-version",
        "train",
        _train("data.blend=[WS/cases/idx-bad-version/data]"),
        "version",
        _copy_data(_patch_idx(9, struct.pack("<Q", 7))),
    ),
    Case(
        "idx-bad-dtype",
        "train",
        _train("data.blend=[WS/cases/idx-bad-dtype/data]"),
        "dtype",
        _copy_data(_patch_idx(17, b"\x63")),
    ),
    Case(
        "idx-wrong-count",
        "train",
        _train("data.blend=[WS/cases/idx-wrong-count/data]"),
        "data.idx",
        _copy_data(_patch_idx(18, struct.pack("<Q", 10**6))),
    ),
    Case(
        "tokenizer-garbage",
        "train",
        _train("data.tokenizer.path=WS/cases/tokenizer-garbage/spm.model"),
        "'data.tokenizer.path'",
        _write("spm.model", b"this is not a sentencepiece model"),
    ),
    Case(
        # SentencePiece read it whole: 16 GB and two minutes before it failed
        "tokenizer-a-device",
        "train",
        _train("data.tokenizer.path=/dev/zero"),
        "'data.tokenizer.path': /dev/zero is neither a file nor a folder",
    ),
    Case("tokenizer-wrong-type", "train", _train("data.tokenizer.type=huggingface"), "'data.tokenizer.path'"),
    Case(
        "tokenizer-empty-dir",
        "train",
        _train("data.tokenizer.path=WS/cases/tokenizer-empty-dir/tok", "data.tokenizer.type=huggingface"),
        "'data.tokenizer.path'",
        _write("tok/README", "nothing here"),
    ),
    Case("vocab-too-small", "train", _train("model.vocab_size=100"), "'model.vocab_size'"),
    Case(
        "cache-dir-under-file",
        "train",
        _train(FRESH, "data.cache_dir=WS/corpus/spm.model/cache"),
        "'data.cache_dir'",
    ),
    Case(
        "run-dir-under-file", "train", _train("logging.run_dir=WS/corpus/spm.model/run"), "'logging.run_dir'"
    ),
    # os.access tells root it may write into /proc; making the run there would fail later
    Case("run-dir-in-proc", "train", _train("logging.run_dir=/proc/megatron-train/run"), "'logging.run_dir'"),
    Case(
        "run-dir-holds-its-own-config",
        "train",
        _train(
            "logging.run_dir=WS/cases/run-dir-holds-its-own-config",
            config="cases/run-dir-holds-its-own-config/config.yaml",
        ),
        "config.yaml is not a training run's resolved config",
        _copy_config,
    ),
    # no shell reads a YAML config: '~/runs' would make a folder named '~' in the working directory
    # It trained, but what names it is refused by the tools that would read the run (export-hf's
    # tokenizer files, SentencePiece)
    Case(
        "run-dir-not-utf8",
        "train",
        _train("logging.run_dir=WS/cases/run-dir-not-utf8/r\udce9"),
        "'logging.run_dir=",
    ),
    Case(
        "run-dir-through-a-loop-of-links",
        "train",
        _train("logging.run_dir=WS/cases/run-dir-through-a-loop-of-links/a/run"),
        "'logging.run_dir'",
        _link("a", "a"),
    ),
    Case(
        "run-dir-a-link-to-nowhere",
        "train",
        _train("logging.run_dir=WS/cases/run-dir-a-link-to-nowhere/run"),
        "which leads nowhere",
        _link("run", "gone"),
    ),
    Case("save-dir-name-too-long", "train", _train(f"checkpoint.save_dir=WS/cases/{LONG_NAME}"), "300 bytes"),
    Case(
        "tensorboard-folder-is-a-file",
        "train",
        _train("logging.tensorboard=true", "logging.run_dir=WS/cases/tensorboard-folder-is-a-file"),
        "'logging.tensorboard'",
        _writes(("tensorboard", "notes\n"), ("metrics.jsonl", "")),
    ),
    # the run appended to its metrics or wrote its trace after it had started, with a traceback
    Case(
        "metrics-file-is-a-folder",
        "train",
        _train("logging.run_dir=WS/cases/metrics-file-is-a-folder"),
        "metrics.jsonl is a directory, where the run writes a file",
        _write("metrics.jsonl/notes.txt", "mine\n"),
    ),
    Case(
        "metrics-file-a-link-to-nowhere",
        "train",
        _train("logging.run_dir=WS/cases/metrics-file-a-link-to-nowhere"),
        "metrics.jsonl is a symbolic link to 'gone', which leads nowhere",
        _link("metrics.jsonl", "gone"),
    ),
    Case(
        "profile-folder-is-a-file",
        "train",
        _train("profile.start_step=1", "logging.run_dir=WS/cases/profile-folder-is-a-file"),
        "'profile.start_step'",
        _writes(("profile", "notes\n"), ("metrics.jsonl", "")),
    ),
    Case(
        # "$RUN/" with RUN unset
        "run-dir-the-filesystem-root",
        "train",
        _train("logging.run_dir=/"),
        "'logging.run_dir': '/' is the filesystem's root",
    ),
    Case(
        "save-dir-the-filesystem-root-through-dots",
        "train",
        _train("checkpoint.save_dir=/tmp/.."),
        "'checkpoint.save_dir': '/tmp/..' is the filesystem's root",
    ),
    Case(
        "run-dir-with-a-tilde",
        "train",
        _train("logging.run_dir=~/runs/x"),
        "'logging.run_dir': '~/runs/x' holds a ~ or $VARIABLE",
    ),
    Case(
        "blend-with-a-shell-variable",
        "preflight",
        _preflight("data.blend=[$SCRATCH/corpus]"),
        "which no shell expands in a config",
    ),
    # a dataset tokenized again under the prefix a cache indexed: its indices name old documents
    Case(
        "data-changed-under-its-cache",
        "train",
        _train(
            FRESH,
            "data.blend=[WS/cases/data-changed-under-its-cache/data]",
            "data.cache_dir=WS/cases/data-changed-under-its-cache/cache",
        ),
        "is not the dataset the index cache",
        _data_tokenized_again,
    ),  # fmt: skip
    Case("launch-rank-outside-world", "train", _train(FRESH), "outside a world of 1", env={"RANK": "3"}),
    Case("launch-world-not-a-count", "train", _train(FRESH), "'WORLD_SIZE'", env={"WORLD_SIZE": "x"}),
    # a world of no ranks was "rank 0 is outside a world of 0 ranks"; a superscript two a traceback
    Case(
        "launch-world-of-none",
        "train",
        _train(FRESH),
        "WORLD_SIZE='0', not a count of ranks",
        env={"WORLD_SIZE": "0"},
    ),  # fmt: skip
    Case("launch-rank-a-superscript", "train", _train(FRESH), "RANK='²', not a count", env={"RANK": "²"}),
    # an empty RANK without WORLD_SIZE is one process, whose error waited 10 s for a rank 0 and
    # then read "rank  on <host>: ..."
    Case(
        "launch-rank-set-empty-by-hand",
        "train",
        _train(FRESH, "train.iters=2"),
        "error: config error at 'train.iters'",
        env={"RANK": "", "WORLD_SIZE": None},
    ),  # fmt: skip
    # torch's rendezvous met these with a traceback (a port) or retried for minutes (an address)
    Case(
        "launch-ranks-without-a-meeting-point",
        "train",
        _train(FRESH),
        "'MASTER_ADDR': not set",
        env={"WORLD_SIZE": "2", "MASTER_ADDR": None},
    ),
    Case("launch-port-out-of-range", "train", _train(FRESH), "'MASTER_PORT'", env={"MASTER_PORT": "99999"}),
    Case(
        "launch-port-in-use",
        "train",
        _train(FRESH),
        "already in use",
        _master_port_taken,
        env={"WORLD_SIZE": "2"},
    ),
    # torch's rendezvous ended these with a traceback; rank 1 also printed a C++ stack trace a retry
    Case(
        "launch-rank-0-alone",
        "train",
        _train(FRESH),
        "for the job's 2 ranks and only 1 joined",
        env={"WORLD_SIZE": "2", "MEGATRON_TRAIN_DIST_TIMEOUT_MIN": "0.05"},
    ),
    Case(
        "launch-another-program-at-the-meeting-point",
        "train",
        _train(FRESH),
        "is not a torch rendezvous: another program listens there",
        _another_program_on_master_port,
        env={"RANK": "1", "WORLD_SIZE": "2", "MEGATRON_TRAIN_DIST_TIMEOUT_MIN": "0.05"},
    ),
    Case(
        "launch-rank-0-never-started",
        "train",
        _train(FRESH),
        "could not reach rank 0's rendezvous at 127.0.0.1:",
        env={"RANK": "1", "WORLD_SIZE": "2", "MEGATRON_TRAIN_DIST_TIMEOUT_MIN": "0.05"},
    ),
    Case(
        "launch-address-does-not-resolve",
        "train",
        _train(FRESH),
        "MASTER_ADDR='no-such-host.invalid', which does not resolve",
        env={"MASTER_ADDR": "no-such-host.invalid"},
    ),
    Case(
        "launch-timeout-not-a-number",
        "generate",
        _args("--ckpt", "WS/run", "--prompt", "x"),
        "'MEGATRON_TRAIN_DIST_TIMEOUT_MIN'",
        env={"MEGATRON_TRAIN_DIST_TIMEOUT_MIN": "ten"},
    ),
    Case(
        "launch-timeout-past-a-timedelta",
        "train",
        _train(),
        "to a year (525,600)",
        env={"MEGATRON_TRAIN_DIST_TIMEOUT_MIN": "1e13"},
    ),
    Case(
        # torch keeps timeouts in milliseconds: this one was none, and blamed MASTER_ADDR
        "launch-timeout-below-a-millisecond",
        "train",
        _train(),
        "'1e-9' is not a number of minutes from 0.01 (0.6 s) to a year",
        env={"MEGATRON_TRAIN_DIST_TIMEOUT_MIN": "1e-9"},
    ),
    Case(
        "preflight-timeout-not-a-number",
        "preflight",
        _preflight(),
        "'ten' is not a number of minutes",
        env={"MEGATRON_TRAIN_DIST_TIMEOUT_MIN": "ten"},
    ),
    Case(
        "launch-exit-status-folder-missing",
        "train",
        _train(FRESH),
        "'/nonexistent-folder', which is not a writable directory",
        env={"MEGATRON_TRAIN_EXIT_STATUS_FILE": "/nonexistent-folder/exit-status"},
    ),
    Case(
        "launch-exit-status-file-is-a-directory",
        "train",
        _train(FRESH),
        "'MEGATRON_TRAIN_EXIT_STATUS_FILE': '/' is a directory",
        env={"MEGATRON_TRAIN_EXIT_STATUS_FILE": "/"},
    ),
    # wandb.init raises on rank 0 after the run directory is written; a tty would even prompt.
    Case(
        "wandb-online-without-a-key",
        "train",
        _train(FRESH, "logging.wandb=true", "logging.wandb_mode=online"),
        "'logging.wandb_mode': is online but wandb finds no API key here",
        env={"WANDB_API_KEY": None, "NETRC": "/nonexistent-netrc"},
    ),
    Case(
        "wandb-online-with-a-malformed-key",
        "train",
        _train(FRESH, "logging.wandb=true", "logging.wandb_mode=online"),
        "is online but WANDB_API_KEY invalid",
        env={"WANDB_API_KEY": "abc"},
    ),
    Case(
        "wandb-project-with-a-slash",
        "train",
        _train(FRESH, "logging.wandb=true", "logging.wandb_project=team/exp"),
        "'logging.wandb_project': wandb refuses 'team/exp': Invalid project name",
    ),
    # A server out of reach fails wandb.init after its timeout, once the run's folders are made.
    Case(
        "wandb-server-out-of-reach-fresh-run",
        "train",
        _train(FRESH, "logging.wandb=true", "logging.wandb_mode=online"),
        UNREACHABLE_SAYS,
        env=WANDB_UNREACHABLE,
    ),
    Case(
        "wandb-server-out-of-reach-existing-run",
        "train",
        _train("train.steps=8", "logging.wandb=true", "logging.wandb_mode=online"),
        UNREACHABLE_SAYS,
        env=WANDB_UNREACHABLE,
    ),
    # train: checkpoints to resume from (the existing run must stay as it was)
    Case(
        "resume-other-architecture",
        "train",
        _train("model.hidden_size=128", "model.ffn_hidden_size=256"),
        "architecture",
    ),
    Case("resume-untied-into-tied", "train", _train("model.tie_embeddings=true"), "output_layer"),
    Case(
        "finetune-untied-into-tied",
        "train",
        _train(FRESH, "model.tie_embeddings=true", f"checkpoint.load=WS/{CKPT}", "checkpoint.finetune=true"),
        "output_layer",
    ),
    Case("fresh-start-over-saved-run", "train", _train("checkpoint.load=none"), "would not continue"),
    # a rollback that a requeued job's load=auto would have left for the newer checkpoint
    Case(
        "rollback-beside-newer-checkpoints",
        "train",
        _train("checkpoint.load=WS/run/checkpoints/iter_0000002", "train.steps=6"),
        "iter_0000002 is older than iter_0000004",
    ),
    # resumed with checksums asked of a run saved without: it resumed from nothing, over its saves
    Case(
        "resume-verifying-checksums-saved-without",
        "train",
        _train(
            "logging.run_dir=WS/cases/resume-verifying-checksums-saved-without/run",
            "checkpoint.verify_checksums=true",
            "train.steps=6",
        ),
        "'checkpoint.verify_checksums'",
        _run_with_ckpt(_without_checksums),
    ),
    Case(
        "verify-checksums-never-written",
        "train",
        _train("checkpoint.checksums=false", "checkpoint.verify_checksums=true", FRESH),
        "could not resume from its own checkpoints",
    ),
    Case(
        "preflight-verifying-checksums-saved-without",
        "preflight",
        _preflight(
            "checkpoint.verify_checksums=true",
            "train.steps=6",
            "logging.run_dir=WS/cases/preflight-verifying-checksums-saved-without/run",
        ),
        "'checkpoint.verify_checksums'",
        _run_with_ckpt(_without_checksums),
    ),
    # a checkpoint damaged after it was complete (a file gone), and no other: a fresh start
    # overwrote it
    Case(
        "resume-only-a-damaged-checkpoint",
        "train",
        _train("logging.run_dir=WS/cases/resume-only-a-damaged-checkpoint/run", "train.steps=6"),
        "iter_0000004 was complete when it was saved",
        _run_with_ckpt(lambda c: (c / "common.pt").unlink()),
    ),
    # recorded complete without common.pt (a folder removed while it was saved, then made anew by
    # the writers): megatron's reader failed on its own error path, "'str' object has no attribute"
    Case(
        "resume-recorded-without-common",
        "train",
        _train("logging.run_dir=WS/cases/resume-recorded-without-common/run", "train.steps=6"),
        "iter_0000004/common.pt is missing: the checkpoint is corrupt",
        _run_with_ckpt(_recorded_without_common),
    ),
    # a same-size damaged .distcp passes the size check; its pickled objects were an
    # UnsafeCheckpointError traceback
    Case(
        "resume-distcp-garbage",
        "train",
        _train("logging.run_dir=WS/cases/resume-distcp-garbage/run", "train.steps=6"),
        "holds an object that does not unpickle (the weights-only unpickler refused it",
        _run_with_ckpt(_same_size_garbage("__0_0.distcp")),
    ),
    # a KeyError traceback from the schedule's state
    Case(
        "resume-common-changed-in-place",
        "train",
        _train("logging.run_dir=WS/cases/resume-common-changed-in-place/run", "train.steps=6"),
        "common.pt fails its SHA-256 check: the checkpoint is corrupt; move iter_0000004 out of ",
        _run_with_ckpt(_common_changed_in_place),
    ),
    # "use another checkpoint", without saying how a resume does that
    Case(
        "resume-newest-changed-in-place",
        "train",
        _train("logging.run_dir=WS/cases/resume-newest-changed-in-place/run", "train.steps=6"),
        "then run the same command to resume from iter_0000002, the newest complete checkpoint before it",
        _saves_with_an_older_ckpt("run/checkpoints", _common_changed_in_place),
    ),
    # it trained, then failed its first save (exit 1) with the run's files changed
    Case(
        "resume-tracker-a-directory",
        "train",
        _train("logging.run_dir=WS/cases/resume-tracker-a-directory/run", "train.steps=6"),
        "latest_checkpointed_iteration.txt is a directory, where the run writes a file",
        _run_with_ckpt(lambda c: (c.parent / "latest_checkpointed_iteration.txt").mkdir()),
    ),
    # IsADirectoryError tracebacks, from the cache's lock and its record
    Case(
        "cache-lock-a-directory",
        "train",
        _train("logging.run_dir=WS/cases/cache-lock-a-directory/run", "train.steps=6"),
        "data_cache/build.lock is a directory, where the run writes a file",
        _run_with_ckpt(lambda c: (c.parents[1] / "data_cache" / "build.lock").mkdir(parents=True)),
    ),
    Case(
        "cache-record-a-directory",
        "train",
        _train("logging.run_dir=WS/cases/cache-record-a-directory/run", "train.steps=6"),
        "data_cache/datasets.json is a directory, where the run writes a file",
        _run_with_ckpt(lambda c: (c.parents[1] / "data_cache" / "datasets.json").mkdir(parents=True)),
    ),
    # megatron-core's cache loader: an IsADirectoryError traceback
    Case(
        "cache-index-a-directory",
        "train",
        _train("logging.run_dir=WS/cases/cache-index-a-directory/run", "train.steps=6"),
        "GPTDataset-train-sample_index.npy is a folder under the name of an index file",
        _run_with_ckpt(
            lambda c: (c.parents[1] / "data_cache" / "0-GPTDataset-train-sample_index.npy").mkdir(
                parents=True
            )
        ),  # noqa: E501
    ),
    # read before that check: the start blocked for good on the pipe
    Case(
        "cache-record-a-pipe",
        "train",
        _train("logging.run_dir=WS/cases/cache-record-a-pipe/run", "train.steps=6"),
        "data_cache/datasets.json is not a regular file, where the run writes a file",
        _run_with_ckpt(
            lambda c: (
                (c.parents[1] / "data_cache").mkdir(),
                os.mkfifo(c.parents[1] / "data_cache/datasets.json"),
            )
        ),
    ),
    Case(
        "resume-another-run-over-saved-run",
        "train",
        _train("checkpoint.load=WS/cases/resume-another-run-over-saved-run/other"),
        "would not continue",
        lambda ws, case_id: shutil.copytree(ws / CKPT, _case(ws, case_id) / "other" / "iter_0000004"),
    ),
    Case(
        "finetune-over-saved-run",
        "train",
        _train(f"checkpoint.load=WS/{CKPT}", "checkpoint.finetune=true"),
        "checkpoint.init_from",
    ),
    # the run directory of a run that saved elsewhere: its config.yaml and metrics.jsonl were replaced
    Case(
        "fresh-start-in-the-folder-of-a-run-saved-elsewhere",
        "train",
        _train("checkpoint.save_dir=WS/cases/fresh-start-in-the-folder-of-a-run-saved-elsewhere"),
        "belongs to the run saved in",
    ),
    Case(
        "preflight-fresh-start-in-the-folder-of-a-run-saved-elsewhere",
        "preflight",
        _preflight(
            "checkpoint.save_dir=WS/cases/preflight-fresh-start-in-the-folder-of-a-run-saved-elsewhere"
        ),
        "belongs to the run saved in",
    ),
    Case(
        "preflight-fresh-start-over-saved-run",
        "preflight",
        _preflight("checkpoint.load=none"),
        "would not continue",
    ),
    Case(
        "resume-with-the-other-optimizer",
        "train",
        _train("optimizer.distributed=false", "train.steps=6"),
        "optimizer.distributed=true",
    ),
    Case(
        "preflight-resume-with-the-other-optimizer",
        "preflight",
        _preflight("optimizer.distributed=false", "train.steps=6"),
        "optimizer.distributed=true",
    ),
    Case("steps-below-the-checkpoint", "train", _train("train.steps=3"), "already at step 4"),
    Case(
        "preflight-steps-below-the-checkpoint",
        "preflight",
        _preflight("train.steps=3"),
        "already at step 4",
    ),
    Case(
        "load-missing",
        "train",
        _train(FRESH, "checkpoint.load=WS/nothing"),
        "does not exist: give a checkpoint",
    ),
    Case(
        "load-torn",
        "train",
        _train(FRESH, "checkpoint.load=WS/cases/load-torn/ckpt/iter_0000004"),
        "torn",
        _copy_ckpt(lambda c: (c / "complete.json").unlink()),
    ),
    Case(
        "record-not-json",
        "train",
        _train(FRESH, "checkpoint.load=WS/cases/record-not-json/ckpt/iter_0000004"),
        "complete.json",
        _copy_ckpt(lambda c: (c / "complete.json").write_text("{not json")),
    ),
    Case(
        "record-nested-too-deep",
        "train",
        _train(FRESH, "checkpoint.load=WS/cases/record-nested-too-deep/ckpt/iter_0000004"),
        "complete.json is unreadable (it nests arrays or objects deeper than Python's JSON reader goes",
        _copy_ckpt(lambda c: (c / "complete.json").write_text("[" * 100_000 + "]" * 100_000)),
    ),
    Case(
        "record-wrong-shape",
        "train",
        _train(FRESH, "checkpoint.load=WS/cases/record-wrong-shape/ckpt/iter_0000004"),
        "complete.json",
        _copy_ckpt(lambda c: (c / "complete.json").write_text('{"files": 5}')),
    ),
    # an OSError traceback (File name too long) from the size check
    Case(
        "record-lists-a-name-too-long",
        "train",
        _train(FRESH, "checkpoint.load=WS/cases/record-lists-a-name-too-long/ckpt/iter_0000004"),
        "complete.json lists a file no file system holds ('xxxxx",
        _copy_ckpt(
            lambda c: (c / "complete.json").write_text(json.dumps({"files": {"x" * 300: {"size": 1}}}))
        ),
    ),
    Case(
        "record-entry-no-size",
        "train",
        _train(FRESH, "checkpoint.load=WS/cases/record-entry-no-size/ckpt/iter_0000004"),
        "complete.json",
        _copy_ckpt(lambda c: (c / "complete.json").write_text('{"files": {"common.pt": {}}}')),
    ),
    Case(
        "record-file-missing",
        "train",
        _train(FRESH, "checkpoint.load=WS/cases/record-file-missing/ckpt/iter_0000004"),
        "missing",
        _copy_ckpt(lambda c: (c / "__0_1.distcp").unlink()),
    ),
    Case(
        "record-file-truncated",
        "train",
        _train(FRESH, "checkpoint.load=WS/cases/record-file-truncated/ckpt/iter_0000004"),
        "truncated",
        _copy_ckpt(lambda c: (c / "__0_0.distcp").write_bytes(b"x")),
    ),
    Case(
        "common-garbage",
        "train",
        _train(FRESH, "checkpoint.load=WS/cases/common-garbage/ckpt/iter_0000004"),
        "common.pt",
        _copy_ckpt(_same_size_garbage("common.pt")),
    ),
    Case(
        "megatron-metadata-garbage",
        "train",
        _train(FRESH, "checkpoint.load=WS/cases/megatron-metadata-garbage/ckpt/iter_0000004"),
        "metadata.json is unreadable",
        _copy_ckpt(_same_size_garbage("metadata.json")),
    ),
    Case(
        "tensor-metadata-garbage",
        "train",
        _train(FRESH, "checkpoint.load=WS/cases/tensor-metadata-garbage/ckpt/iter_0000004"),
        ".metadata",
        _copy_ckpt(_same_size_garbage(".metadata")),
    ),
    Case(
        "init-from-file",
        "train",
        _train(FRESH, "checkpoint.init_from=WS/corpus/spm.model"),
        "'checkpoint.init_from'",
    ),
    Case(
        "init-from-hf-missing-field",
        "train",
        _train(FRESH, "checkpoint.init_from=WS/cases/init-from-hf-missing-field/hf", "model.preset=null"),
        "hidden_size",
        _hf_copy(_edit_hf_config(lambda c: c.pop("hidden_size"))),
    ),
    Case(
        "init-from-hf-config-link-to-nowhere",
        "train",
        _train(FRESH, "checkpoint.init_from=WS/cases/init-from-hf-config-link-to-nowhere/hf"),
        "safetensors weights, but its config.json is a symbolic link to 'gone.json', which leads nowhere",
        _hf_copy(_hf_config_linked_to("gone.json")),
    ),
    Case(
        "init-from-hf-bad-safetensors",
        "train",
        _train(
            FRESH,
            "checkpoint.init_from=WS/cases/init-from-hf-bad-safetensors/hf",
            "model.preset=null",
            "model.max_position_embeddings=128",
        ),
        "model.safetensors",
        _hf_copy(lambda hf: (hf / "model.safetensors").write_bytes(b"\x00" * 64)),
    ),
    # preflight
    Case(
        "preflight-blend-name-too-long", "preflight", _preflight(f"data.blend=[WS/{LONG_NAME}]"), "300 bytes"
    ),
    Case("preflight-nodes-0", "preflight", _args("--config", "WS/cfg.yaml", "--nodes", "0"), "--nodes"),
    Case(
        "preflight-gpus-negative",
        "preflight",
        _args("--config", "WS/cfg.yaml", "--gpus-per-node", "-1"),
        "--gpus-per-node",
    ),
    Case(
        "preflight-memory-nan",
        "preflight",
        _args("--config", "WS/cfg.yaml", "--gpu-memory-gib", "nan"),
        "--gpu-memory-gib",
    ),
    Case("preflight-unknown-flag", "preflight", _args("--config", "WS/cfg.yaml", "--nodez", "2"), "--nodez"),
    Case(
        "preflight-context-splits-sequence-unevenly",
        "preflight",
        _args("--config", "WS/cfg.yaml", "--gpus-per-node", "4", "parallel.context=4", "data.seq_length=60"),
        "2 x parallel.context = 8",
    ),
    Case(
        "preflight-moe-tensor-parallel-without-sequence-parallel",
        "preflight",
        _args(
            "--config",
            "WS/cfg.yaml",
            "--gpus-per-node",
            "2",
            "model.preset=qwen3-moe-tiny",
            "parallel.tensor=2",
        ),
        "must be true to train a mixture-of-experts model with tensor parallelism",
    ),
    Case(
        "preflight-save-dir-under-file",
        "preflight",
        _args(
            "--config",
            "WS/cfg.yaml",
            "--nodes",
            "1",
            "--gpus-per-node",
            "1",
            "checkpoint.save_dir=WS/corpus/spm.model/ckpt",
        ),
        "'checkpoint.save_dir'",
    ),
    Case(
        "preflight-resume-other-model",
        "preflight",
        _preflight("model.num_layers=2"),
        "'model.num_layers'",
    ),
    Case(
        "preflight-common-garbage",
        "preflight",
        _args(
            "--config",
            "WS/cfg.yaml",
            "--gpus-per-node",
            "1",
            FRESH,
            "checkpoint.load=WS/cases/preflight-common-garbage/ckpt/iter_0000004",
        ),
        "common.pt",
        _copy_ckpt(_same_size_garbage("common.pt")),
    ),
    Case(
        "preflight-over-memory",
        "preflight",
        _preflight("--gpu-memory-gib", "0.001"),
        "estimate",
    ),
    # submit
    Case(
        "submit-config-name-too-long",
        "submit",
        _args("--config", f"WS/{LONG_NAME}.yaml", "--dry-run"),
        "longer than the file system",
    ),
    Case(
        "submit-bad-time",
        "submit",
        _args("--config", "WS/cfg.yaml", "--time", "forever", "--dry-run"),
        "--time",
    ),
    Case(
        "submit-negative-signal",
        "submit",
        _args("--config", "WS/cfg.yaml", "--signal-seconds", "-5", "--dry-run"),
        "--signal-seconds",
    ),
    Case(
        "submit-signal-past-sbatch-range",
        "submit",
        _args("--config", "WS/cfg.yaml", "--time", "2-00:00:00", "--signal-seconds", "65536", "--dry-run"),
        "from 1 to 65535",
    ),
    Case(
        "submit-signal-after-the-limit",
        "submit",
        _args("--config", "WS/cfg.yaml", "--time", "00:04:00", "--signal-seconds", "300", "--dry-run"),
        "not shorter than --time",
    ),
    Case(
        "submit-log-dir-under-file",
        "submit",
        _args("--config", "WS/cfg.yaml", "--log-dir", "WS/corpus/spm.model/logs", "--dry-run"),
        "'--log-dir'",
    ),
    # sbatch would read the log name %x-%j.out as it stands: every job writing one file
    Case(
        "submit-log-dir-with-a-backslash",
        "submit",
        _args("--config", "WS/cfg.yaml", "--log-dir", "WS/cases/logs\\new", "--dry-run"),
        "holds a backslash",
    ),
    Case(
        "submit-nodes-0", "submit", _args("--config", "WS/cfg.yaml", "--nodes", "0", "--dry-run"), "--nodes"
    ),
    Case(
        # the job script's [[ count -lt 2**64 ]] read 2**64 as 0, and never requeued
        "submit-max-requeues-past-bash",
        "submit",
        _args("--config", "WS/cfg.yaml", "--max-requeues", str(2**64), "--dry-run"),
        "--max-requeues: '18446744073709551616' is not an integer from 0 to 2**63 - 1",
    ),
    Case(
        "submit-empty-partition",
        "submit",
        _args("--config", "WS/cfg.yaml", "--partition", "", "--dry-run"),
        "--partition: an empty value",
    ),
    # Slurm cannot open logs/a/b-<id>.out (no folder logs/a): the job failed with no log at all
    Case(
        "submit-job-name-with-a-slash",
        "submit",
        _args("--config", "WS/cfg.yaml", "--job-name", "exp/1", "--dry-run"),
        "--job-name: 'exp/1' holds a '/'",
    ),
    Case(
        "submit-job-name-past-a-file-name",
        "submit",
        _args("--config", "WS/cfg.yaml", "--job-name", "x" * 241, "--dry-run"),
        "--job-name: a name of 241 bytes",
    ),
    Case(
        "submit-job-name-with-a-newline",
        "submit",
        _args("--config", "WS/cfg.yaml", "--job-name", "exp\n1", "--dry-run"),
        "holds a control character",
    ),
    Case(
        "submit-account-with-a-newline",
        "submit",
        _args("--config", "WS/cfg.yaml", "--account", "proj\n1", "--dry-run"),
        "holds a control character",
    ),
    Case(
        "submit-partition-with-a-tab",
        "submit",
        _args("--config", "WS/cfg.yaml", "--partition", "gpu\t", "--dry-run"),
        "holds a control character",
    ),
    Case(
        "submit-preflight-fails",
        "submit",
        _preflight("--dry-run", "parallel.tensor=3"),
        "'parallel.tensor'",
    ),
    # pretrain.sbatch mounts only into a container: without an image the mounts were ignored
    Case(
        "submit-mounts-without-image",
        "submit",
        _args("--config", "WS/cfg.yaml", "--container-mounts", "/data:/data", "--dry-run"),
        "no --container-image",
    ),
    Case(
        "submit-mount-with-an-empty-part",
        "submit",
        _args(
            "--config",
            "WS/cfg.yaml",
            "--container-image",
            "x.sqsh",
            "--container-mounts",
            "/data:",
            "--dry-run",
        ),
        "not a pyxis mount",
    ),
    # the interpreter every rank starts with: found out here, not after the job waited in the queue
    Case(
        "submit-python-missing",
        "submit",
        _args("--config", "WS/cfg.yaml", "--python", "WS/venv/bin/python", "--dry-run"),
        "not an executable file",
    ),
    Case(
        "submit-python-without-torch",
        "submit",
        _args(
            "--config",
            "WS/cfg.yaml",
            "--python",
            "WS/cases/submit-python-without-torch/bin/python",
            "--dry-run",
        ),  # fmt: skip
        "No module named 'torch'",
        setup=_bare_venv,
    ),
    # run where Slurm is not installed (a laptop, a dev box): submitting needs sbatch
    Case(
        "submit-without-sbatch",
        "submit",
        _preflight(),
        "sbatch is not on PATH",
        env={"PATH": str(Path(sys.executable).parent)},
    ),
    # convert: import-hf
    Case(
        "import-hf-vocab-pad-multiple-past-its-range",
        "convert",
        _args("import-hf", "--hf", "WS/hf", "--out", "WS/cases/o", "--vocab-pad-multiple", "100000"),
        "config error at '--vocab-pad-multiple': 100000 is out of range. Fix: set --vocab-pad-multiple to",
    ),
    Case(
        "import-hf-missing",
        "convert",
        _args("import-hf", "--hf", "WS/nothing", "--out", "WS/cases/o"),
        "does not exist",
    ),
    Case(
        "import-hf-no-config",
        "convert",
        _args("import-hf", "--hf", "WS/cases/import-hf-no-config/hf", "--out", "WS/cases/o"),
        "config.json",
        _hf_copy(lambda hf: (hf / "config.json").unlink()),
    ),
    Case(
        "import-hf-config-not-json",
        "convert",
        _args("import-hf", "--hf", "WS/cases/import-hf-config-not-json/hf", "--out", "WS/cases/o"),
        "config.json",
        _hf_copy(lambda hf: (hf / "config.json").write_text("{oops")),
    ),
    Case(
        "import-hf-missing-field",
        "convert",
        _args("import-hf", "--hf", "WS/cases/import-hf-missing-field/hf", "--out", "WS/cases/o"),
        "num_attention_heads",
        _hf_copy(_edit_hf_config(lambda c: c.pop("num_attention_heads"))),
    ),
    Case(
        "import-hf-field-wrong-type",
        "convert",
        _args("import-hf", "--hf", "WS/cases/import-hf-field-wrong-type/hf", "--out", "WS/cases/o"),
        "hidden_size",
        _hf_copy(_edit_hf_config(lambda c: c.update(hidden_size="big"))),
    ),
    Case(
        "import-hf-unsupported",
        "convert",
        _args("import-hf", "--hf", "WS/cases/import-hf-unsupported/hf", "--out", "WS/cases/o"),
        "GPT2LMHeadModel",
        _hf_copy(_edit_hf_config(lambda c: c.update(architectures=["GPT2LMHeadModel"]))),
    ),
    # transformers' strict config fields refused it, in a traceback from the tokenizer's load
    Case(
        "import-hf-token-id-a-string",
        "convert",
        _args("import-hf", "--hf", "WS/cases/import-hf-token-id-a-string/hf", "--out", "WS/cases/o"),
        "(Field 'eos_token_id' with value '2' doesn't match any type in",
        _hf_copy(_edit_hf_config(lambda c: c.update(eos_token_id="2"))),
    ),
    Case(
        "import-hf-architectures-a-string",
        "convert",
        _args("import-hf", "--hf", "WS/cases/import-hf-architectures-a-string/hf", "--out", "WS/cases/o"),
        'expected a list of the one class that saved it, ["LlamaForCausalLM"]',
        _hf_copy(_edit_hf_config(lambda c: c.update(architectures="LlamaForCausalLM"))),
    ),
    # a TypeError traceback (len() of a number)
    Case(
        "import-hf-architectures-a-number",
        "convert",
        _args("import-hf", "--hf", "WS/cases/import-hf-architectures-a-number/hf", "--out", "WS/cases/o"),
        'architectures=1: expected a list of the one class that saved it, such as ["LlamaForCausalLM"]',
        _hf_copy(_edit_hf_config(lambda c: c.update(architectures=1))),
    ),
    # without head_dim, the head dimension was derived before the head count was checked: a
    # ZeroDivisionError traceback
    Case(
        "import-hf-no-heads",
        "convert",
        _args("import-hf", "--hf", "WS/cases/import-hf-no-heads/hf", "--out", "WS/cases/o"),
        "config.json num_attention_heads: 0 is out of range",
        _hf_copy(_edit_hf_config(lambda c: c.update(num_attention_heads=0, head_dim=None))),
    ),
    # transformers' getattr(torch, dtype): an AttributeError traceback
    Case(
        "import-hf-dtype-not-a-dtype",
        "convert",
        _args("import-hf", "--hf", "WS/cases/import-hf-dtype-not-a-dtype/hf", "--out", "WS/cases/o"),
        "config.json dtype='bf16': expected the name of a torch dtype, such as \"bfloat16\"",
        _hf_copy(_edit_hf_config(lambda c: c.update(dtype="bf16"))),
    ),
    # transformers' RoPE validation raised a KeyError, which its read check did not catch
    Case(
        "import-hf-llama3-rope-incomplete",
        "convert",
        _args("import-hf", "--hf", "WS/cases/import-hf-llama3-rope-incomplete/hf", "--out", "WS/cases/o"),
        "(Missing required keys in `rope_parameters` for 'rope_type'='llama3': {'low_freq_factor'})",
        _hf_copy(_edit_hf_config(lambda c: c.update(rope_parameters=LLAMA3_ROPE_WITHOUT_LOW_FREQ_FACTOR))),
    ),
    # transformers' JSONDecodeError, in a traceback
    Case(
        "import-hf-tokenizer-json-cut-short",
        "convert",
        _args("import-hf", "--hf", "WS/cases/import-hf-tokenizer-json-cut-short/hf", "--out", "WS/cases/o"),
        "import-hf-tokenizer-json-cut-short/hf do not load in transformers (Expecting property name",
        _hf_copy(lambda hf: (hf / "tokenizer.json").write_text('{"version": "1.0", "model": {')),
    ),
    # an OSError traceback (File name too long) from the check that the shards exist
    Case(
        "import-hf-index-names-a-shard-too-long",
        "convert",
        _args(
            "import-hf", "--hf", "WS/cases/import-hf-index-names-a-shard-too-long/hf", "--out", "WS/cases/o"
        ),
        "lacks shard file(s) xxxxx",
        _hf_copy(
            lambda hf: (hf / "model.safetensors.index.json").write_text(
                json.dumps({"weight_map": {"model.embed_tokens.weight": "x" * 300}})
            )
        ),
    ),
    # transformers builds the class of model_type, not of architectures: this one is GPT-2 to it
    Case(
        "import-hf-model-type-of-another-model",
        "convert",
        _args(
            "import-hf", "--hf", "WS/cases/import-hf-model-type-of-another-model/hf", "--out", "WS/cases/o"
        ),
        "names the architecture LlamaForCausalLM but model_type 'gpt2'",
        _hf_copy(_edit_hf_config(lambda c: c.update(model_type="gpt2"))),
    ),
    # transformers applies a rope_scaling dict over rope_parameters: importing without it computes
    # another model
    Case(
        "import-hf-yarn-beside-rope-parameters",
        "convert",
        _args(
            "import-hf", "--hf", "WS/cases/import-hf-yarn-beside-rope-parameters/hf", "--out", "WS/cases/o"
        ),
        "only Llama-3.1 ('llama3') RoPE scaling",
        _hf_copy(_edit_hf_config(lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}))),
    ),
    Case(
        "import-hf-partial-rotary",
        "convert",
        _args("import-hf", "--hf", "WS/cases/import-hf-partial-rotary/hf", "--out", "WS/cases/o"),
        "partial_rotary_factor=0.5",
        _hf_copy(_edit_hf_config(lambda c: c.update(partial_rotary_factor=0.5))),
    ),
    Case(
        "import-hf-rope-theta-not-a-number",
        "convert",
        _args("import-hf", "--hf", "WS/cases/import-hf-rope-theta-not-a-number/hf", "--out", "WS/cases/o"),
        "rope_theta='1e4'",
        _hf_copy(
            _edit_hf_config(lambda c: c.update(rope_parameters={"rope_type": "default", "rope_theta": "1e4"}))
        ),
    ),
    # a value no model takes names config.json's field, not the model.* key it would become
    Case(
        "import-hf-zero-ffn-size",
        "convert",
        _args("import-hf", "--hf", "WS/cases/import-hf-zero-ffn-size/hf", "--out", "WS/cases/o"),
        "config.json intermediate_size: 0 is out of range",
        _hf_copy(_edit_hf_config(lambda c: c.update(intermediate_size=0))),
    ),
    # 0 key-value heads read as "absent" (one group per head) and failed on the weights' shapes
    Case(
        "import-hf-zero-kv-heads",
        "convert",
        _args("import-hf", "--hf", "WS/cases/import-hf-zero-kv-heads/hf", "--out", "WS/cases/o"),
        "config.json num_key_value_heads: 0 is out of range",
        _hf_copy(_edit_hf_config(lambda c: c.update(num_key_value_heads=0))),
    ),
    # a damaged config.json: ten million layers took minutes and 12 GB to plan before a missing
    # tensor was named, and a size past int64 overflowed torch in a traceback
    Case(
        "import-hf-layers-beyond-the-weights",
        "convert",
        _args("import-hf", "--hf", "WS/cases/import-hf-layers-beyond-the-weights/hf", "--out", "WS/cases/o"),
        "describes 10,000,000 layers",
        _hf_copy(_edit_hf_config(lambda c: c.update(num_hidden_layers=10_000_000))),
    ),
    Case(
        "import-hf-size-past-int64",
        "convert",
        _args("import-hf", "--hf", "WS/cases/import-hf-size-past-int64/hf", "--out", "WS/cases/o"),
        "config.json intermediate_size: 1000000000000000000000 is beyond 64-bit integers",
        _hf_copy(_edit_hf_config(lambda c: c.update(intermediate_size=10**21))),
    ),
    Case(
        "import-hf-config-integer-too-long",
        "convert",
        _args("import-hf", "--hf", "WS/cases/import-hf-config-integer-too-long/hf", "--out", "WS/cases/o"),
        "holds an integer too long to read (over 4300 digits)",
        _hf_copy(_edit_hf_text('"hidden_size": ', '"hidden_size": 1' + "0" * 5000 + ', "was_hidden_size": ')),
    ),
    Case(
        "import-hf-config-nested-too-deep",
        "convert",
        _args("import-hf", "--hf", "WS/cases/import-hf-config-nested-too-deep/hf", "--out", "WS/cases/o"),
        "config.json is not valid JSON (it nests arrays or objects deeper than Python's JSON reader goes",
        _hf_copy(
            _edit_hf_text('"hidden_size": ', '"deep": ' + "[" * 100_000 + "]" * 100_000 + ', "hidden_size": ')
        ),
    ),
    Case(
        "import-hf-config-a-device",
        "convert",
        _args("import-hf", "--hf", "WS/cases/import-hf-config-a-device/hf", "--out", "WS/cases/o"),
        "config.json is not a regular file (a device, pipe or socket): --hf must be",
        _hf_copy(_hf_config_linked_to("/dev/null")),
    ),
    Case(
        "import-hf-config-not-utf8",
        "convert",
        _args("import-hf", "--hf", "WS/cases/import-hf-config-not-utf8/hf", "--out", "WS/cases/o"),
        "config.json is not UTF-8 text ('utf-8' codec can't decode byte 0xff",
        _hf_copy(lambda hf: (hf / "config.json").write_bytes(b'\xff\xfe{"hidden_size": 64}')),
    ),
    Case(
        # Each size fits in int64, the tensor's bytes do not.
        "import-hf-tensor-bytes-past-int64",
        "convert",
        _args("import-hf", "--hf", "WS/cases/import-hf-tensor-bytes-past-int64/hf", "--out", "WS/cases/o"),
        "beyond what torch can hold",
        _hf_copy(_edit_hf_config(lambda c: c.update(intermediate_size=2**62))),
    ),
    # older Hugging Face repositories hold pickled weights only; the error says how to re-save them
    Case(
        "import-hf-bin-weights-only",
        "convert",
        _args("import-hf", "--hf", "WS/cases/import-hf-bin-weights-only/hf", "--out", "WS/cases/o"),
        "pytorch_model*.bin only, which are not read",
        _hf_copy(lambda hf: (hf / "model.safetensors").rename(hf / "pytorch_model.bin")),
    ),
    # a config.json cut short: the import dropped the layers it no longer named
    Case(
        "import-hf-fewer-layers-than-stored",
        "convert",
        _args("import-hf", "--hf", "WS/cases/import-hf-fewer-layers-than-stored/hf", "--out", "WS/cases/o"),
        "model.layers.1, beyond the 1 layers config.json describes",
        _hf_copy(_edit_hf_config(lambda c: c.update(num_hidden_layers=1))),
    ),
    # a string "false" is true to Python: the import tied embeddings the checkpoint has apart
    Case(
        "import-hf-tie-as-a-string",
        "convert",
        _args("import-hf", "--hf", "WS/cases/import-hf-tie-as-a-string/hf", "--out", "WS/cases/o"),
        "tie_word_embeddings='false': expected true or false",
        _hf_copy(_edit_hf_config(lambda c: c.update(tie_word_embeddings="false"))),
    ),
    Case(
        "import-hf-bad-safetensors",
        "convert",
        _args("import-hf", "--hf", "WS/cases/import-hf-bad-safetensors/hf", "--out", "WS/cases/o"),
        "model.safetensors",
        _hf_copy(lambda hf: (hf / "model.safetensors").write_bytes(b"\x00" * 64)),
    ),
    Case(
        "import-hf-out-exists",
        "convert",
        _args("import-hf", "--hf", "WS/hf", "--out", "WS/run"),
        "already exists",
    ),
    Case(
        "import-hf-out-under-file",
        "convert",
        _args("import-hf", "--hf", "WS/hf", "--out", "WS/corpus/spm.model/out"),
        "spm.model",
    ),
    Case(
        "import-hf-into-the-hf-directory",
        "convert",
        _args("import-hf", "--hf", "WS/hf", "--out", "WS/hf/megatron"),
        "is inside the Hugging Face directory",
    ),
    Case(
        "import-hf-tp-3",
        "convert",
        _args("import-hf", "--hf", "WS/hf", "--out", "WS/cases/o", "--tp", "3"),
        "TP3 x PP1 does not fit this model",
    ),
    Case(
        "import-hf-tp-0",
        "convert",
        _args("import-hf", "--hf", "WS/hf", "--out", "WS/cases/o", "--tp", "0"),
        "--tp",
    ),
    # convert: export-hf
    Case(
        "export-hf-missing",
        "convert",
        _args("export-hf", "--ckpt", "WS/nothing", "--out", "WS/cases/o"),
        "does not exist",
    ),
    Case(
        "export-hf-torn",
        "convert",
        _args("export-hf", "--ckpt", "WS/cases/export-hf-torn/ckpt", "--out", "WS/cases/o"),
        "torn",
        _copy_ckpt(lambda c: (c / "complete.json").unlink()),
    ),
    Case(
        "export-hf-out-exists",
        "convert",
        _args("export-hf", "--ckpt", f"WS/{CKPT}", "--out", "WS/hf"),
        "already exists",
    ),
    Case(
        "export-hf-over-a-link-to-nowhere",
        "convert",
        _args("export-hf", "--ckpt", f"WS/{CKPT}", "--out", "WS/cases/export-hf-over-a-link-to-nowhere/hf"),
        "already exists",
        _link("hf", "gone"),
    ),
    Case(
        "import-hf-name-too-long",
        "convert",
        _args("import-hf", "--hf", f"WS/{LONG_NAME}", "--out", "WS/cases/o"),
        "longer than the file system",
    ),
    Case(
        "export-hf-shard-0",
        "convert",
        _args("export-hf", "--ckpt", f"WS/{CKPT}", "--out", "WS/cases/o", "--max-shard-gib", "0"),
        "--max-shard-gib",
    ),
    Case(
        "export-hf-tokenizer-missing",
        "convert",
        _args("export-hf", "--ckpt", f"WS/{CKPT}", "--out", "WS/cases/o", "--tokenizer", "WS/nothing"),
        "tokenizer",
    ),
    Case(
        "export-hf-tokenizer-garbage",
        "convert",
        _args(
            "export-hf", "--ckpt", f"WS/{CKPT}", "--out", "WS/cases/o", "--tokenizer", "WS/corpus/stdlib.idx"
        ),
        "does not load as the run's sentencepiece tokenizer",
    ),
    Case(
        "export-hf-tokenizer-a-device",
        "convert",
        _args("export-hf", "--ckpt", f"WS/{CKPT}", "--out", "WS/cases/o", "--tokenizer", "/dev/zero"),
        "the tokenizer '/dev/zero' is neither a file nor a folder",
    ),
    Case(
        "export-hf-tokenizer-too-big",
        "convert",
        _args(
            "export-hf",
            "--ckpt",
            f"WS/{CKPT}",
            "--out",
            "WS/cases/o",
            "--tokenizer",
            "WS/cases/export-hf-tokenizer-too-big/spm.model",
        ),
        "it is not the run's",
        _bigger_tokenizer,
    ),
    Case(
        "export-hf-into-the-checkpoint",
        "convert",
        _args("export-hf", "--ckpt", f"WS/{CKPT}", "--out", f"WS/{CKPT}/hf"),
        "is inside the checkpoint",
    ),
    Case(
        "export-hf-common-garbage",
        "convert",
        _args("export-hf", "--ckpt", "WS/cases/export-hf-common-garbage/ckpt", "--out", "WS/cases/o"),
        "common.pt",
        _copy_ckpt(_same_size_garbage("common.pt")),
    ),
    # a JSONDecodeError traceback: the imported model's config.json is read back as it was written
    Case(
        "export-hf-imported-config-json-damaged",
        "convert",
        _args(
            "export-hf",
            "--ckpt",
            "WS/cases/export-hf-imported-config-json-damaged/ckpt",
            "--out",
            "WS/cases/o",
        ),
        "hf/config.json is unreadable (Expecting value: line 1 column 1 (char 0)): the checkpoint was",
        _imported_with_same_size_config("not json"),
    ),
    # exported as it was: a GPT-2 config.json beside a Llama's weights, which transformers misreads
    Case(
        "export-hf-imported-config-json-of-another-model",
        "convert",
        _args(
            "export-hf",
            "--ckpt",
            "WS/cases/export-hf-imported-config-json-of-another-model/ckpt",
            "--out",
            "WS/cases/o",
        ),
        "hf/config.json names architectures=['GPT2LMHeadModel'], not a llama model: the checkpoint was",
        _imported_with_same_size_config('{"architectures": ["GPT2LMHeadModel"]}'),
    ),
    # generate
    Case(
        "generate-tokenizer-name-too-long",
        "generate",
        _args("--ckpt", f"WS/{CKPT}", "--tokenizer", f"WS/{LONG_NAME}"),
        "300 bytes",
    ),
    Case("generate-missing", "generate", _args("--ckpt", "WS/nothing"), "does not exist: give a checkpoint"),
    # A Latin-1 terminal: the byte 0xe9 reaches Python as the surrogate escape U+DCE9.
    Case(
        "generate-prompt-not-utf8",
        "generate",
        _args("--ckpt", f"WS/{CKPT}", "--prompt", "caf\udce9"),
        "not UTF-8",
    ),
    Case(
        "generate-negative-tokens",
        "generate",
        _args("--ckpt", f"WS/{CKPT}", "--max-new-tokens", "-1"),
        "--max-new-tokens",
    ),
    Case("generate-top-p-2", "generate", _args("--ckpt", f"WS/{CKPT}", "--top-p", "2"), "--top-p"),
    Case(
        "generate-seed-beyond-64-bits",
        "generate",
        _args("--ckpt", f"WS/{CKPT}", "--seed", "99999999999999999999"),
        "--seed",
    ),
    Case(
        "generate-tokenizer-of-another-type",
        "generate",
        _args(
            "--ckpt", f"WS/{CKPT}", "--tokenizer", "WS/corpus/spm.model", "--tokenizer-type", "huggingface"
        ),
        "set --tokenizer-type to the type it is",
    ),
    Case(
        "generate-temperature-when-greedy",
        "generate",
        _args("--ckpt", f"WS/{CKPT}", "--temperature", "0.7"),
        "applies only when sampling with --top-p",
    ),
    Case("generate-seed-when-greedy", "generate", _args("--ckpt", f"WS/{CKPT}", "--seed", "7"), "'--seed'"),
    Case(
        "generate-zero-temperature",
        "generate",
        _args("--ckpt", f"WS/{CKPT}", "--top-p", "0.9", "--temperature", "0"),
        "--temperature",
    ),
    Case(
        "generate-prompt-ids-text",
        "generate",
        _args("--ckpt", f"WS/{CKPT}", "--prompt-ids", "1,x"),
        "--prompt-ids",
    ),
    Case(
        "generate-prompt-ids-too-big",
        "generate",
        _args("--ckpt", f"WS/{CKPT}", "--prompt-ids", "1,999999"),
        "--prompt-ids",
    ),
    Case(
        "generate-beyond-positions",
        "generate",
        _args("--ckpt", f"WS/{CKPT}", "--prompt-ids", "1,2", "--max-new-tokens", "1000"),
        "max_position_embeddings",
    ),
    Case(
        "generate-prompt-beyond-positions",
        "generate",
        _args("--ckpt", f"WS/{CKPT}", "--prompt", "def f(): pass " * 100),
        "leaves no room",
    ),
    Case(
        "generate-prompt-and-ids",
        "generate",
        _args("--ckpt", f"WS/{CKPT}", "--prompt", "def", "--prompt-ids", "1"),
        "not allowed with",
    ),
    Case(
        "generate-empty-prompt-ids", "generate", _args("--ckpt", f"WS/{CKPT}", "--prompt-ids", ""), "integers"
    ),
    Case(
        "generate-tokenizer-too-big",
        "generate",
        _args("--ckpt", f"WS/{CKPT}", "--tokenizer", "WS/cases/generate-tokenizer-too-big/spm.model"),
        "more than the model's",
        _bigger_tokenizer,
    ),
    Case(
        "generate-tp-3",
        "generate",
        _args("--ckpt", f"WS/{CKPT}", "--tp", "3"),
        "TP3 x PP1 does not fit this model",
    ),
    Case(
        "generate-tp-2-on-one-rank", "generate", _args("--ckpt", f"WS/{CKPT}", "--tp", "2"), "launched rank"
    ),
    Case(
        "generate-tokenizer-missing",
        "generate",
        _args("--ckpt", f"WS/{CKPT}", "--tokenizer", "WS/nothing"),
        "--tokenizer",
    ),
    # inspect (exit 2: no checkpoint; 1: torn or corrupt, reported on stdout)
    Case("inspect-missing", "inspect", _args("WS/nothing"), "does not exist: give a checkpoint"),
    Case("inspect-empty-dir", "inspect", _args("WS/corpus"), "holds no checkpoint"),
    Case("inspect-name-too-long", "inspect", _args(f"WS/{LONG_NAME}"), "longer than the file system"),
    Case(
        "inspect-checksums-of-a-save-without",
        "inspect",
        _args("WS/cases/inspect-checksums-of-a-save-without/run", "--verify-checksums"),
        "without --verify-checksums",
        _run_with_ckpt(_without_checksums),
    ),
    # a Hugging Face model where a checkpoint is expected: say what it is and how to use it
    Case(
        "load-a-hugging-face-model",
        "train",
        _train(FRESH, "checkpoint.load=WS/hf"),
        "is a Hugging Face model directory, not a megatron-train checkpoint: train from it with "
        "checkpoint.init_from",
    ),
    Case("generate-from-a-hugging-face-model", "generate", _args("--ckpt", "WS/hf"), "import-hf"),
    Case(
        "init-from-a-hugging-face-config-without-weights",
        "train",
        _train(FRESH, "checkpoint.init_from=WS/cases/init-from-a-hugging-face-config-without-weights/hf"),
        "holds a Hugging Face config.json and no checkpoint, but it holds no .safetensors weights; download",
        _hf_copy(lambda hf: (hf / "model.safetensors").unlink()),
    ),
    Case(
        "init-from-a-hugging-face-model-with-pickled-weights",
        "train",
        _train(FRESH, "checkpoint.init_from=WS/cases/init-from-a-hugging-face-model-with-pickled-weights/hf"),
        "its weights are pytorch_model*.bin only, which are not read",
        _hf_copy(lambda hf: (hf / "model.safetensors").rename(hf / "pytorch_model.bin")),
    ),
    Case(
        "inspect-common-garbage",
        "inspect",
        _args("WS/cases/inspect-common-garbage/ckpt/iter_0000004"),
        "common.pt",
        _copy_ckpt(_same_size_garbage("common.pt")),
        code=1,
    ),
    Case(
        "inspect-record-wrong-shape",
        "inspect",
        _args("WS/cases/inspect-record-wrong-shape/ckpt/iter_0000004"),
        "complete.json",
        _copy_ckpt(lambda c: (c / "complete.json").write_text("[1, 2]")),
        code=1,
    ),
    # preprocess
    Case(
        "preprocess-output-name-too-long",
        "preprocess",
        _args(
            "--input",
            "WS/corpus/stdlib.jsonl",
            "--output-prefix",
            f"WS/cases/{LONG_NAME}",
            "--tokenizer",
            "WS/corpus/spm.model",
            "--tokenizer-type",
            "sentencepiece",
        ),
        "its file name is 300 bytes long",
    ),
    Case(
        "preprocess-output-dir-name-too-long",
        "preprocess",
        _args(
            "--input",
            "WS/cases/preprocess-output-dir-name-too-long/in",
            "--output-dir",
            "WS/cases/preprocess-output-dir-name-too-long/out",
            "--tokenizer",
            "WS/corpus/spm.model",
            "--tokenizer-type",
            "sentencepiece",
        ),
        "a name of 307 bytes",
        _writes(
            ("in/a.jsonl", '{"text": "first"}\n'),
            ("/".join(["in", *["d" * 100] * 3, "b.jsonl"]), '{"text": "nested"}\n'),
        ),
    ),
    # An empty path (a shell variable unset) was the current folder: its corpus files were read.
    Case(
        "preprocess-input-empty",
        "preprocess",
        _args("--input", "", "--output-prefix", "WS/cases/p/out", "--tokenizer", "WS/corpus/spm.model"),
        "argument --input: an empty value",
    ),
    Case(
        "preprocess-tokenizer-empty",
        "preprocess",
        _args("--input", "WS/corpus/stdlib.jsonl", "--output-prefix", "WS/cases/p/out", "--tokenizer", ""),
        "argument --tokenizer: an empty value",
    ),
    Case(
        "preprocess-output-dir-empty",
        "preprocess",
        _args("--input", "WS/corpus/stdlib.jsonl", "--output-dir", "", "--tokenizer", "WS/corpus/spm.model"),
        "argument --output-dir: an empty value",
    ),
    Case(
        "preprocess-input-missing",
        "preprocess",
        _args(
            "--input",
            "WS/nothing.jsonl",
            "--output-prefix",
            "WS/cases/p/out",
            "--tokenizer",
            "WS/corpus/spm.model",
        ),
        "does not exist",
    ),
    Case(
        "preprocess-input-a-device",
        "preprocess",
        _args(
            "--input", "/dev/null", "--output-prefix", "WS/cases/p/out", "--tokenizer", "WS/corpus/spm.model"
        ),
        "/dev/null is neither a file nor a directory",
    ),
    Case(
        "preprocess-empty-input",
        "preprocess",
        _args(
            "--input",
            "WS/cases/preprocess-empty-input/in.jsonl",
            "--output-prefix",
            "WS/cases/p/out",
            "--tokenizer",
            "WS/corpus/spm.model",
        ),
        "no documents",
        _write("in.jsonl", ""),
    ),
    Case(
        "preprocess-not-json",
        "preprocess",
        _args(
            "--input",
            "WS/cases/preprocess-not-json/in.jsonl",
            "--output-prefix",
            "WS/cases/p/out",
            "--tokenizer",
            "WS/corpus/spm.model",
        ),
        "in.jsonl",
        _write("in.jsonl", "this is not json\n"),
    ),
    Case(
        "preprocess-text-not-string",
        "preprocess",
        _args(
            "--input",
            "WS/cases/preprocess-text-not-string/in.jsonl",
            "--output-prefix",
            "WS/cases/p/out",
            "--tokenizer",
            "WS/corpus/spm.model",
        ),
        "string",
        _write("in.jsonl", '{"text": 5}\n{"text": 7}\n'),
    ),
    Case(
        "preprocess-lone-surrogate",
        "preprocess",
        _args(
            "--input",
            "WS/cases/preprocess-lone-surrogate/in.jsonl",
            "--output-prefix",
            "WS/cases/p/out",
            "--tokenizer",
            "WS/corpus/spm.model",
        ),
        "in.jsonl:2: field 'text' holds a lone surrogate",
        _write("in.jsonl", '{"text": "ok"}\n{"text": "\\udc00 alone"}\n'),
    ),
    # SentencePiece's path cannot hold it: a UnicodeEncodeError traceback
    Case(
        "preprocess-tokenizer-path-not-utf8",
        "preprocess",
        _preprocess_with("WS/cases/preprocess-tokenizer-path-not-utf8/\udcffspm.model"),
        "/\\udcffspm.model' is not UTF-8 text",
        lambda ws, case_id: _write("\udcffspm.model", (ws / "corpus/spm.model").read_bytes())(ws, case_id),
    ),
    Case(
        "preprocess-no-text-key",
        "preprocess",
        _preprocess("--output-prefix", "WS/cases/p/out", "--text-key", "body"),
        "'body'",
    ),
    Case(
        "preprocess-tokenizer-garbage",
        "preprocess",
        _preprocess_with("WS/cases/preprocess-tokenizer-garbage/t.model"),
        "t.model",
        _write("t.model", b"garbage"),
    ),
    Case(
        "preprocess-output-in-proc",
        "preprocess",
        _preprocess("--output-prefix", "/proc/megatron-train/out"),
        "--output-prefix",
    ),
    Case(
        "preprocess-output-under-file",
        "preprocess",
        _preprocess("--output-prefix", "WS/corpus/spm.model/out"),
        "--output-prefix",
    ),
    # IsADirectoryError
    Case(
        "preprocess-temporary-name-a-folder",
        "preprocess",
        _preprocess("--output-prefix", "WS/cases/preprocess-temporary-name-a-folder/out"),
        "out.bin.tmp, a temporary name of the output, is a directory",
        setup=_write("out.bin.tmp/kept", "a file of someone else's"),
    ),
    Case(
        "preprocess-output-dir-the-root",
        "preprocess",
        _preprocess("--output-dir", "/"),
        "'--output-dir': '/' is the filesystem's root",
    ),
    Case(
        "preprocess-workers-0",
        "preprocess",
        _preprocess("--output-prefix", "WS/cases/p/out", "--workers", "0"),
        "--workers",
    ),
    Case(
        "preprocess-workers-past-the-cores",
        "preprocess",
        _preprocess("--output-prefix", "WS/cases/p/out", "--workers", "10000"),
        "--workers",
    ),
    Case(
        "preprocess-batch-size-past-64-bits",
        "preprocess",
        _preprocess("--output-dir", "WS/cases/p/shards", "--batch-size", "99999999999999999999"),
        "--batch-size",
    ),
    Case(
        "preprocess-unknown-suffix",
        "preprocess",
        _args(
            "--input",
            "WS/corpus/spm.model",
            "--output-prefix",
            "WS/cases/p/out",
            "--tokenizer",
            "WS/corpus/spm.model",
        ),
        "unknown file type",
    ),
    # train_tokenizer
    Case(
        "tokenizer-input-empty",
        "tokenizer",
        _args("--input", "", "--output-prefix", "WS/cases/t/spm"),
        "argument --input: an empty value",
    ),
    Case(
        "tokenizer-output-prefix-a-device",
        "tokenizer",
        _args("--input", "WS/corpus/stdlib.jsonl", "--output-prefix", "/dev/null"),
        "would go beside it as /dev/null.model",
    ),
    Case(
        "tokenizer-input-missing",
        "tokenizer",
        _args("--input", "WS/nothing.jsonl", "--output-prefix", "WS/cases/t/spm"),
        "does not exist",
    ),
    Case(
        "tokenizer-empty-input",
        "tokenizer",
        _args("--input", "WS/cases/tokenizer-empty-input/in.txt", "--output-prefix", "WS/cases/t/spm"),
        "no documents",
        _write("in.txt", ""),
    ),
    Case(
        "tokenizer-text-not-string",
        "tokenizer",
        _args("--input", "WS/cases/tokenizer-text-not-string/in.jsonl", "--output-prefix", "WS/cases/t/spm"),
        "string",
        _write("in.jsonl", '{"text": [1, 2]}\n'),
    ),
    Case(
        "tokenizer-lone-surrogate",
        "tokenizer",
        _args("--input", "WS/cases/tokenizer-lone-surrogate/in.jsonl", "--output-prefix", "WS/cases/t/spm"),
        "in.jsonl:2: field 'text' holds a lone surrogate",
        _write("in.jsonl", '{"text": "caf\\u00e9"}\n{"text": "half a pair \\ud83d"}\n'),
    ),
    Case(
        "tokenizer-vocab-too-big",
        "tokenizer",
        _args(
            "--input",
            "WS/cases/tokenizer-vocab-too-big/in.txt",
            "--output-prefix",
            "WS/cases/t/spm",
            "--vocab-size",
            "5000",
        ),
        "--vocab-size",
        _write("in.txt", "a small text\nof two lines\n"),
    ),
    Case(
        "tokenizer-vocab-beyond-int32",
        "tokenizer",
        _args(
            "--input",
            "WS/corpus/stdlib.jsonl",
            "--output-prefix",
            "WS/cases/t",
            "--vocab-size",
            "99999999999",
        ),
        "--vocab-size",
    ),
    Case(
        "tokenizer-vocab-below-the-text-s-characters",
        "tokenizer",
        _args(
            "--input",
            "WS/corpus/stdlib.jsonl",
            "--output-prefix",
            "WS/cases/t/spm",
            "--vocab-size",
            "100",
            "--max-sentences",
            "200",
        ),
        "set --vocab-size to at least",
    ),  # fmt: skip
    Case(
        "tokenizer-vocab-below-the-special-pieces",
        "tokenizer",
        _args("--input", "WS/corpus/stdlib.jsonl", "--output-prefix", "WS/cases/t/spm", "--vocab-size", "3"),
        "cannot hold the 4 special ones",
    ),
    Case(
        "tokenizer-vocab-0",
        "tokenizer",
        _args("--input", "WS/corpus/stdlib.jsonl", "--output-prefix", "WS/cases/t/spm", "--vocab-size", "0"),
        "--vocab-size",
    ),
    Case(
        "tokenizer-output-under-file",
        "tokenizer",
        _args("--input", "WS/corpus/stdlib.jsonl", "--output-prefix", "WS/corpus/spm.model/spm"),
        "--output-prefix",
    ),
    Case(
        "tokenizer-output-exists",
        "tokenizer",
        _args(
            "--input",
            "WS/cases/tokenizer-output-exists/in.txt",
            "--output-prefix",
            "WS/corpus/spm",
            "--vocab-size",
            "5000",
        ),
        "already exists",
        _write("in.txt", "two\nlines\n"),
    ),
    Case(
        "preprocess-output-exists",
        "preprocess",
        _preprocess("--output-prefix", "WS/corpus/stdlib"),
        "stdlib.bin already exists",
    ),
    Case(
        "merge-input-missing",
        "merge",
        _args("--input", "WS/nothing", "--output-prefix", "WS/cases/m"),
        "nothing.bin",
    ),
    Case(
        "merge-dir-without-datasets",
        "merge",
        _args("--input", "WS/run", "--output-prefix", "WS/cases/m"),
        "holds no",
    ),
    Case(
        "merge-output-under-file",
        "merge",
        _args("--input", "WS/corpus/stdlib", "--output-prefix", "WS/corpus/spm.model/m"),
        "is a file",
    ),
    Case(
        "merge-onto-its-input",
        "merge",
        _args("--input", "WS/corpus/stdlib", "--output-prefix", "WS/corpus/stdlib"),
        "already exists",
    ),
    # an output prefix ending in a separator names a folder; its files would land beside it
    Case(
        "merge-prefix-is-a-folder",
        "merge",
        _args("--input", "WS/corpus/stdlib", "--output-prefix", "WS/corpus/"),
        "names a folder",
    ),
    # a prefix ending in a suffix the tool adds would write corpus.bin.bin, which data.blend refuses
    Case(
        "merge-prefix-ends-in-bin",
        "merge",
        _args("--input", "WS/corpus/stdlib", "--output-prefix", "WS/cases/m/corpus.bin"),
        "Fix: drop the suffix: --output-prefix",
    ),
    Case(
        "preprocess-prefix-ends-in-idx",
        "preprocess",
        _preprocess("--output-prefix", "WS/cases/p/corpus.idx"),
        "it would write",
    ),  # fmt: skip
    Case(
        "tokenizer-prefix-ends-in-model",
        "tokenizer",
        _args("--input", "WS/corpus/stdlib.jsonl", "--output-prefix", "WS/cases/t/spm.model"),
        "ends in .model",
    ),
    Case(
        "preprocess-prefix-is-a-folder",
        "preprocess",
        _preprocess("--output-prefix", "WS/corpus/"),
        "names a folder",
    ),  # fmt: skip
    Case(
        "tokenizer-prefix-is-a-folder",
        "tokenizer",
        _args("--input", "WS/corpus/stdlib.jsonl", "--output-prefix", "WS/corpus/", "--vocab-size", "300"),
        "names a folder",
    ),
    # the demo's corpus
    Case("corpus-exists", "corpus", _args("--output", "WS/corpus/stdlib.jsonl"), "already exists"),
    Case("corpus-is-a-folder", "corpus", _args("--output", "WS/corpus/"), "names a folder"),
    Case("corpus-not-yet-a-folder", "corpus", _args("--output", "WS/cases/new/"), "names a folder"),
    Case("corpus-inside-a-file", "corpus", _args("--output", "WS/cfg.yaml/c.jsonl"), "is a file"),
    Case(
        "corpus-over-a-link-to-nowhere",
        "corpus",
        _args("--output", "WS/cases/corpus-over-a-link-to-nowhere/c.jsonl"),
        "already exists",
        _link("c.jsonl", "gone.jsonl"),
    ),
    Case(
        "corpus-name-too-long",
        "corpus",
        _args("--output", f"WS/cases/{LONG_NAME}.jsonl"),
        "is 306 bytes long",
    ),
    Case("corpus-no-files", "corpus", _args("--output", "WS/cases/c.jsonl", "--max-files", "0"), "'0'"),
]


def test_the_catalogue_is_large_and_distinct():
    assert len(CASES) >= 60
    assert len({c.id for c in CASES}) == len(CASES)
    assert {c.entry for c in CASES} == {"train", "preflight", "submit", "convert", "generate", "inspect",
                                        "preprocess", "merge", "tokenizer", "corpus"}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_and_touches_nothing(ws, corpus, case, capfd, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    # Set here, so that the rendezvous of a case that starts a process group leaves nothing behind.
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    for name, value in (case.env or {}).items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    monkeypatch.chdir(ws)
    # wandb keeps the settings its first login read from the environment (server, init timeout)
    # for the rest of the process: each case starts from the environment, as a new process would.
    if "wandb" in sys.modules:
        sys.modules["wandb"].teardown()
    if case.setup:
        case.setup(ws, case.id)
    before = _hashes(ws, corpus["prefix"].parent)
    try:
        code = _entry(case.entry)(case.argv(ws))
    except SystemExit as exit_:  # a usage mistake, reported by the argument parser
        code = exit_.code
    out, err = capfd.readouterr()
    assert code == case.code, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    if case.code == 2:
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
        assert case.says in lines[0], lines[0][:3000]
        assert len(lines[0]) <= 2000, f"a line of {len(lines[0]):,} characters: {lines[0][:3000]}"
    else:
        assert case.says in out, out[-3000:]
    assert _hashes(ws, corpus["prefix"].parent) == before


def test_each_entry_point_alone_in_its_process_prints_only_the_error_line(ws):
    """In-process cases share a process that has imported megatron_train first; a process of its
    own shows what a user sees, such as a dependency's import-time warnings above the error."""
    commands = {"train": ["-m", "megatron_train.train"], "preflight": ["-m", "megatron_train.preflight"],
                "submit": ["launch/submit.py"], "convert": ["tools/convert_checkpoint.py"],
                "generate": ["tools/generate.py"], "inspect": ["tools/inspect_checkpoint.py"],
                "preprocess": ["tools/preprocess_data.py"], "merge": ["tools/merge_datasets.py"],
                "tokenizer": ["tools/train_tokenizer.py"], "corpus": ["tools/stdlib_corpus.py"]}  # fmt: skip
    first = {}
    for case in CASES:
        if case.setup is None and case.code == 2 and case.env is None:
            first.setdefault(case.entry, case)
    assert first.keys() == commands.keys()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    # Started together: each spends its seconds importing torch and megatron-core.
    running = {
        entry: subprocess.Popen(
            [
                sys.executable,
                *[str(ROOT / a) if a.endswith(".py") else a for a in commands[entry]],
                *case.argv(ws),
            ],
            cwd=ws,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for entry, case in first.items()
    }
    for entry, process in running.items():
        _, err = process.communicate(timeout=300)
        assert process.returncode == 2, (entry, err[-3000:])
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), (entry, err[-3000:])
        assert first[entry].says in lines[0], (entry, lines[0])


def test_a_command_whose_output_pipe_closes_ends_quietly(ws):
    """``inspect_checkpoint.py ... | head``: the reader may be gone before the last line."""
    read, write = os.pipe()
    os.close(read)
    try:
        result = subprocess.run(
            [sys.executable, str(ROOT / "tools/inspect_checkpoint.py"), str(ws / CKPT)],
            stdout=write, stderr=subprocess.PIPE, text=True, timeout=300,
        )  # fmt: skip
    finally:
        os.close(write)
    assert (result.returncode, result.stderr) == (141, "")


def test_a_broken_pipe_that_is_not_the_outputs_is_not_taken_for_its_reader_gone(monkeypatch):
    """A pipe or socket to another process that broke (a helper process killed) ended a command
    as if its output's reader had gone: exit code 141 and not a word. Standard output here is a
    pipe whose reader is still there."""
    out_read, out_write = os.pipe()
    stdout = os.fdopen(out_write, "w")
    monkeypatch.setattr(sys, "stdout", stdout)

    def talks_to_a_dead_helper() -> int:
        read, write = os.pipe()
        os.close(read)
        try:
            os.write(write, b"x")
        finally:
            os.close(write)
        return 0

    try:
        with pytest.raises(BrokenPipeError):
            cli.entry_point(talks_to_a_dead_helper)()
    finally:
        stdout.close()
        os.close(out_read)


@pytest.mark.parametrize(
    "command",
    [
        ["tools/inspect_checkpoint.py", "WS/" + CKPT],
        ["-m", "megatron_train.preflight", "--config", "WS/cfg.yaml", "--gpus-per-node", "1"],
    ],
    ids=["inspect", "preflight"],
)
def test_a_command_whose_output_finds_no_room_says_so_in_one_line(ws, command):
    """``inspect_checkpoint.py ... > report.txt`` on a full disk (/dev/full: every write fails so)."""
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            [sys.executable, *(arg.replace("WS/", f"{ws}/") for arg in command)],
            cwd=ROOT, stdout=full, stderr=subprocess.PIPE, text=True, timeout=300,
        )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "error: the output could not be written ([Errno 28] No space left on device). Fix: free space "
        "where it goes or write it elsewhere"
    ]


@pytest.mark.parametrize(
    ("command", "written"),
    [
        (["tools/merge_datasets.py", "--input", "WS/corpus/stdlib", "--output-prefix", "OUT/merged"],
         ["merged.bin", "merged.idx"]),
        (["tools/convert_checkpoint.py", "export-hf", "--ckpt", "WS/" + CKPT, "--out", "OUT/hf"], ["hf"]),
    ],
    ids=["merge", "export-hf"],
)  # fmt: skip
def test_a_tool_whose_report_finds_no_room_keeps_what_it_wrote(ws, tmp_path, command, written):
    """``merge_datasets.py ... > log.txt`` on a full disk: the dataset was written, yet the tool's
    last line failed as "the output could not be written" (exit 1)."""
    args = [arg.replace("WS/", f"{ws}/").replace("OUT/", f"{tmp_path}/") for arg in command]
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            [sys.executable, *args], cwd=ROOT, stdout=full, stderr=subprocess.PIPE, text=True, timeout=300
        )
    assert result.returncode == 0, result.stderr
    assert all((tmp_path / name).exists() for name in written)
    lines = result.stderr.splitlines()
    assert lines and all(
        line.startswith(
            "note: standard output had no room for this line ([Errno 28] No space left on device): "
        )
        for line in lines
    )
    assert str(tmp_path) in lines[-1]


def test_a_tool_whose_report_finds_no_room_says_each_later_line_on_stderr(ws, tmp_path):
    """Once standard output refused a line, it was sent to /dev/null, and the lines after it
    (here the closing ``wrote ...`` after a note of datasets already written) were lost."""
    (tmp_path / "text").mkdir()
    for name in ("a.jsonl", "b.jsonl"):
        shutil.copy(ws / "corpus" / "stdlib.jsonl", tmp_path / "text" / name)
    args = [sys.executable, "tools/preprocess_data.py", "--input", str(tmp_path / "text"), "--output-dir",
            str(tmp_path / "out"), "--tokenizer", str(ws / "corpus" / "spm.model"), "--tokenizer-type",
            "sentencepiece"]  # fmt: skip
    assert subprocess.run(args, cwd=ROOT, capture_output=True, timeout=300).returncode == 0
    for path in (tmp_path / "out").glob("b.*"):
        path.unlink()
    with open("/dev/full", "w") as full:
        result = subprocess.run(args, cwd=ROOT, stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    notes = [
        line for line in result.stderr.splitlines() if line.startswith("note: standard output had no room")
    ]
    assert len(notes) == 2 and "1 of 2 datasets already written" in notes[0] and "wrote " in notes[1]
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["a.bin", "a.idx", "b.bin", "b.idx"]


def test_readme_lists_exit_codes_per_entry_point():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Exit codes") :]
    for entry in ("megatron_train.train", "megatron_train.preflight", "launch/submit.py",
                  "tools/convert_checkpoint.py", "tools/generate.py", "tools/inspect_checkpoint.py",
                  "tools/preprocess_data.py", "tools/train_tokenizer.py",
                  "tools/stdlib_corpus.py"):  # fmt: skip
        assert entry in section, entry
