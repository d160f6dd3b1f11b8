"""Long texts cut for SentencePiece BPE encode to the ids of the whole text, for every model the
cutting applies to; the other models are encoded whole."""

from __future__ import annotations

import io
import json
import random
import re

import pytest
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2

from megatron_train import sentencepiece_cuts
from megatron_train.sentencepiece_cuts import SPACE, bpe_cutter
from megatron_train.text_encoding import text_encoder

# One xdist worker runs this module, so its module-scoped tokenizers are built once.
pytestmark = pytest.mark.xdist_group("sentencepiece_cuts")

# tools/train_tokenizer.py's settings; Llama-2's (a dummy prefix) with user-defined symbols.
OURS = dict(normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False)
LLAMA2 = dict(
    normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True,
    user_defined_symbols=["<|tool|>", "\n\n\n"],
)  # fmt: skip
FRAGMENTS = ["def", "the", " ", "  ", "    ", "\n", "\n\n", "\n    ", "\t", SPACE, "<|tool|>", "if __name__",
             "日本語", "😀", "1234", "x", ",", ":\n", "é", "(", ")\n"]  # fmt: skip


@pytest.fixture(scope="module")
def texts(corpus) -> list[str]:
    docs = [json.loads(line)["text"] for line in corpus["jsonl"].read_text().splitlines()[:40]]
    rng = random.Random(0)
    made = ["".join(rng.choice(FRAGMENTS) for _ in range(rng.randrange(1, 400))) for _ in range(60)]
    return [*docs, *made, "", " ", "\n", SPACE]


@pytest.fixture(scope="module")
def lines(corpus) -> list[str]:
    docs = [json.loads(line)["text"] for line in corpus["jsonl"].read_text().splitlines()[:200]]
    return [line for doc in docs for line in doc.split("\n") if line][:20000]


def _train(lines: list[str], model_type: str = "bpe", **options) -> bytes:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, model_type=model_type, vocab_size=800,
        byte_fallback=True, allow_whitespace_only_pieces=True, split_digits=True, minloglevel=2, **options,
    )  # fmt: skip
    return model.getvalue()


def _without_escaping(model: bytes) -> bytes:
    # No trainer makes a BPE model that keeps spaces as they are, but it encodes like one.
    proto = sentencepiece_model_pb2.ModelProto.FromString(model)
    proto.normalizer_spec.escape_whitespaces = False
    return proto.SerializeToString()


@pytest.fixture(scope="module")
def models(lines) -> dict[str, bytes]:
    llama2 = _train(lines, **LLAMA2)
    return {"ours": _train(lines, **OURS), "llama2": llama2, "unescaped": _without_escaping(llama2)}


@pytest.mark.parametrize("part_chars", [1, 512])
@pytest.mark.parametrize("name", ["ours", "llama2", "unescaped"])
def test_the_parts_encode_to_the_ids_of_the_whole_text(models, texts, monkeypatch, name, part_chars):
    """With parts of one character, a text is cut wherever the rule allows."""
    monkeypatch.setattr(sentencepiece_cuts, "PART_CHARS", part_chars)
    whole = spm.SentencePieceProcessor(model_proto=models[name])
    parts_model, cut = bpe_cutter(models[name])
    parts_processor = spm.SentencePieceProcessor(model_proto=parts_model)
    prefix = {"ours": "", "llama2": SPACE, "unescaped": " "}[name]
    cuts = 0
    for text in texts:
        parts = cut(text)
        assert "".join(parts) == (prefix + text if text else "")
        ids = [i for part in parts_processor.encode(parts, out_type=int) for i in part]
        assert ids == whole.encode(text, out_type=int), (name, text[:200])
        cuts += len(parts) - 1
    assert cuts > (20_000 if part_chars == 1 else 40)


def test_cutting_across_a_piece_would_change_the_ids(models, texts):
    """What the rule guards against: a cut before every space parts some pieces."""
    processor = spm.SentencePieceProcessor(model_proto=models["ours"])
    changed = 0
    for text in texts[:40]:
        parts = [p for p in re.split("(?= )", text) if p]
        ids = [i for part in processor.encode(parts, out_type=int) for i in part]
        changed += ids != processor.encode(text)
    assert changed > 10


def test_the_encoder_cuts_long_texts_and_gives_the_whole_texts_ids(models, texts, tmp_path):
    (tmp_path / "llama2.model").write_bytes(models["llama2"])
    encoder = text_encoder("sentencepiece", str(tmp_path / "llama2.model"), threads=2)
    whole = spm.SentencePieceProcessor(model_proto=models["llama2"])
    assert encoder.encode(texts) == whole.encode(texts, out_type=int)


@pytest.mark.parametrize(
    "options",
    [
        dict(model_type="unigram", **OURS),
        dict(normalization_rule_name="nmt_nfkc", remove_extra_whitespaces=False, add_dummy_prefix=False),
        dict(normalization_rule_name="identity", remove_extra_whitespaces=True, add_dummy_prefix=False),
        dict(treat_whitespace_as_suffix=True, **OURS),
    ],
    ids=["unigram", "nfkc", "extra-whitespace", "whitespace-suffix"],
)
def test_models_whose_encoding_cannot_be_cut_are_encoded_whole(lines, texts, tmp_path, options):
    model = _train(lines, **options)
    assert bpe_cutter(model) is None
    (tmp_path / "m.model").write_bytes(model)
    encoder = text_encoder("sentencepiece", str(tmp_path / "m.model"), threads=1)
    whole = spm.SentencePieceProcessor(model_proto=model)
    assert encoder.encode(texts) == whole.encode(texts, out_type=int)
