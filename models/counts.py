"""Compute per token of our decoders, for throughput and MFU."""

from __future__ import annotations

from megatron_train.config import ModelConfig


def flops_per_token(m: ModelConfig, seq_length: int) -> float:
    """Training FLOPs per token: 3x the forward matmuls, causal attention counted half, and of a
    mixture of experts only what a token passes through (its top-k experts, the shared expert
    and the router).

    Forward per layer: 2h(q + 2kv) for QKV, 2qh for the output projection, 6h*ffn for each SwiGLU
    a token passes and 2sq for QK^T and AV over the causal half of the scores; plus 2hV for the
    output layer. Counting only the causal half is Megatron-LM's convention (PaLM's and
    torchtitan's count it whole).
    """
    q_dim, kv_dim = m.head_dim * m.num_attention_heads, m.head_dim * m.query_groups
    if m.num_experts is None:
        mlp = 2 * 3 * m.hidden_size * m.ffn_hidden_size
    else:
        active_ffn = m.moe_router_topk * m.expert_ffn_hidden_size + (m.moe_shared_expert_ffn_hidden_size or 0)
        mlp = 2 * 3 * m.hidden_size * active_ffn + 2 * m.hidden_size * m.num_experts  # experts, router
    per_layer = (
        2 * m.hidden_size * (q_dim + 2 * kv_dim)  # QKV projection
        + 2 * q_dim * m.hidden_size  # output projection
        + mlp
        + 2 * seq_length * q_dim  # scores and weighted values, causal half
    )
    logits = 2 * m.hidden_size * m.padded_vocab_size
    return 3.0 * (m.num_layers * per_layer + logits)
