"""Long texts cut into parts that a SentencePiece BPE model encodes faster, to the same ids.

SentencePiece's BPE merges a whole text at once, from one heap of candidate pairs; on the
stdlib corpus (18 KB documents) it encodes 512-character parts of each document about a sixth
faster than the document whole (``benchmarks/preprocess_throughput.py``, its ``tokenizer`` and
``whole texts`` rows). A cut between two characters changes no id when no piece of the
vocabulary holds those two characters side by side: no merge can then join symbols across the
cut, so each side makes the merges it would make alone, in the same order (equal scores are
taken leftmost first on either side).

That reasoning needs a normalizer that maps each character on its own and adds nothing where a
part begins: no normalization table (SentencePiece's "identity"), no removal of extra
whitespace, whitespace not treated as a suffix. tools/train_tokenizer.py's models qualify, and
Llama-2-style ones, whose dummy prefix is added here by hand, once, to the first part. Other
models (unigram, NFKC-normalizing) are encoded whole.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from sentencepiece import sentencepiece_model_pb2

SPACE = "\u2581"
"""What SentencePiece writes for a space, in the pieces and in the normalized text."""
PART_CHARS = 512
"""A part's length before its cut, in characters: 128 to 2048 measured within 5% of each other."""
_CUT_AT = " \n"
"""Cuts are made next to these, so a part ends where a word or a line does."""

Cutter = Callable[[str], list[str]]


def bpe_cutter(model: bytes) -> tuple[bytes, Cutter] | None:
    """For a serialized SentencePiece model whose encoding can be cut: the model to encode the
    parts with (the same, without its dummy prefix, which the first part carries) and the
    function that cuts a text into those parts. None for a model whose encoding cannot be cut."""
    proto = sentencepiece_model_pb2.ModelProto.FromString(model)
    normalizer, trainer = proto.normalizer_spec, proto.trainer_spec
    if (
        trainer.model_type != trainer.BPE
        or normalizer.precompiled_charsmap
        or normalizer.remove_extra_whitespaces
        or trainer.treat_whitespace_as_suffix
    ):
        return None
    pairs = {p.piece[i : i + 2] for p in proto.pieces for i in range(len(p.piece) - 1)}
    pattern = _cut_pattern(pairs, escaped=normalizer.escape_whitespaces)
    space = SPACE if normalizer.escape_whitespaces else " "
    prefix = space if normalizer.add_dummy_prefix else ""
    normalizer.add_dummy_prefix = False

    def cut(text: str) -> list[str]:
        parts, start = [], 0
        while len(text) - start > PART_CHARS:
            found = pattern.search(text, start + PART_CHARS)
            if found is None or found.start() == len(text):
                break
            parts.append(text[start : found.start()])
            start = found.start()
        parts.append(text[start:])
        if text:
            parts[0] = prefix + parts[0]
        return parts

    return proto.SerializeToString(), cut


def _cut_pattern(pairs: set[str], escaped: bool) -> re.Pattern[str]:
    """Matches (with no width) where a cut next to a space or a line break parts no two
    characters that some piece holds side by side (``pairs``, in normalized form)."""

    def raw(chars: set[str]) -> set[str]:
        # the text's characters that normalize to ``chars``
        return chars | ({" "} if escaped and SPACE in chars else set())

    def refusing(chars: set[str], behind: bool) -> str:
        # a lookaround that fails on any of ``chars``; none when there are none
        if not chars:
            return ""
        listed = "".join(re.escape(c) for c in sorted(chars))
        return f"(?<![{listed}])" if behind else f"(?![{listed}])"

    ways = []
    for char in _CUT_AT:
        normalized = SPACE if escaped and char == " " else char
        before = raw({p[0] for p in pairs if p[1] == normalized})
        after = raw({p[1] for p in pairs if p[0] == normalized})
        ways.append(refusing(before, behind=True) + f"(?={re.escape(char)})")
        ways.append(f"(?<={re.escape(char)})" + refusing(after, behind=False))
    return re.compile("|".join(ways))
