"""What one micro-batch feeds the model on this rank: document masks and positions for packed
sequences, then this rank's share of the sequence under context parallelism.

Documents are found on the device from the tokens themselves (each ends with the tokenizer's
EOD), so the data loader never builds a sequence-squared mask per sample. Our local attention
takes the mask as megatron's ``attention_mask``; Transformer Engine's takes the documents as one
packed ``thd`` sequence with their boundaries (``cu_seqlens``), and restarts RoPE positions at
each boundary whatever ``reset_positions`` says.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.utils import get_batch_on_this_cp_rank

from megatron_train.config import ExperimentConfig
from megatron_train.errors import ConfigError
from megatron_train.tokenizer import load_tokenizer

_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """``[batch, seq]``: which document of its sample each token belongs to (a document ends with
    its EOD token; the sample's first, possibly partial, document is 0)."""
    ends = (tokens == eod).to(torch.int32)
    return torch.cumsum(ends, dim=1) - ends


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """``[batch, seq]``: each token's position within its own document."""
    index = torch.arange(documents.size(1), device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return index - torch.cummax(torch.where(starts, index, 0), dim=1).values


def document_attention_mask(documents: torch.Tensor) -> torch.Tensor:
    """megatron's ``[batch, 1, seq, seq]`` attention mask (True: may not attend): causal, and
    only within a token's own document."""
    seq = documents.size(1)
    causal = torch.ones(seq, seq, dtype=torch.bool, device=documents.device).tril()
    same_document = documents.unsqueeze(2) == documents.unsqueeze(1)
    return ~(causal & same_document).unsqueeze(1)


def packed_documents(documents: torch.Tensor) -> PackedSeqParams:
    """The documents of a one-sample micro-batch as one ``thd`` sequence for Transformer Engine's
    attention: where each starts (``cu_seqlens``)."""
    lengths = torch.unique_consecutive(documents.view(-1), return_counts=True)[1]
    starts = F.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32)
    longest = int(lengths.max())
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=starts,
        cu_seqlens_kv=starts,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )


def check_token_ids(loaded: dict[str, torch.Tensor], vocab_size: int) -> None:
    """Every id of a loader's micro-batch (still on the host: no device sync) is below
    ``vocab_size``. The start checks a slice of each dataset only; an id beyond the embedding is
    an index error on the CPU and a device-side assert on a GPU, and beyond a tensor-parallel
    cross-entropy's vocabulary a silently wrong loss."""
    largest = int(torch.maximum(loaded["tokens"].max(), loaded["labels"].max()))
    if largest >= vocab_size:
        raise ConfigError(
            "data.blend",
            f"a sample of the data holds token id {largest}, beyond the model's {vocab_size} tokens: part of "
            "the data was tokenized with another tokenizer",
            "preprocess it with the run's tokenizer, or leave that dataset out of data.blend",
        )


class BatchPreparer:
    """Moves a loader's micro-batch to the device and shapes it for this rank's model."""

    def __init__(
        self,
        device: torch.device,
        eod: int | None = None,
        reset_positions: bool = False,
        transformer_engine: bool = False,
        vocab_size: int | None = None,
    ):
        """``eod``: mask attention within documents ending with this token (None: plain causal);
        ``reset_positions``: RoPE positions restart at 0 in each document; ``transformer_engine``:
        documents go to Transformer Engine's attention as a packed sequence; ``vocab_size``: the
        model's, which every token id must be below (None: not checked)."""
        self.device, self.eod, self.reset_positions = device, eod, reset_positions
        self.transformer_engine, self.vocab_size = transformer_engine, vocab_size

    @classmethod
    def for_config(
        cls, cfg: ExperimentConfig, device: torch.device, transformer_engine: bool
    ) -> BatchPreparer:
        """What ``data.document_mask`` and ``data.reset_position_ids`` ask for."""
        d, vocab = cfg.data, cfg.model.vocab_size
        if not d.document_mask:
            return cls(device, vocab_size=vocab)
        eod = load_tokenizer(d.tokenizer.type, d.tokenizer.path).eod
        return cls(device, eod, d.reset_position_ids, transformer_engine, vocab)

    def __call__(self, loaded: dict[str, torch.Tensor]) -> dict:
        """``tokens``, ``labels``, ``loss_mask``, ``position_ids`` and the model's
        ``attention_mask`` (None unless documents are masked on the local path), plus
        ``packed_seq_params`` for Transformer Engine's document masking."""
        if self.vocab_size is not None:
            check_token_ids(loaded, self.vocab_size)
        batch = {key: loaded[key].to(self.device, non_blocking=True) for key in _KEYS}
        batch["attention_mask"] = None
        if self.eod is not None and self.transformer_engine:
            batch["packed_seq_params"] = packed_documents(document_ids(batch["tokens"], self.eod))
            return batch
        if self.eod is not None:
            documents = document_ids(batch["tokens"], self.eod)
            batch["attention_mask"] = document_attention_mask(documents)
            if self.reset_positions:
                batch["position_ids"] = document_positions(documents)
        if parallel_state.get_context_parallel_world_size() > 1:
            # Chunks i and 2CP-1-i of 2CP, so causal attention costs every CP rank the same.
            batch = get_batch_on_this_cp_rank(batch)
        return batch
