"""Qwen3-family presets: ``model.preset`` names and the ``model.*`` values they set."""

from __future__ import annotations

_QWEN3 = dict(qk_norm=True, vocab_size=151936, norm_eps=1e-6, rotary_base=1000000, kv_channels=128)

PRESETS: dict[str, dict] = {
    # For tests and the MoE demo: 8 experts, 2 per token.
    "qwen3-moe-tiny": dict(
        num_layers=4, hidden_size=128, ffn_hidden_size=352, num_attention_heads=4, num_query_groups=2,
        max_position_embeddings=1024, qk_norm=True, num_experts=8, moe_ffn_hidden_size=96,
        moe_router_topk=2,
    ),
    "qwen3-moe-small": dict(
        num_layers=8, hidden_size=512, ffn_hidden_size=1408, num_attention_heads=8, num_query_groups=4,
        max_position_embeddings=2048, qk_norm=True, num_experts=16, moe_ffn_hidden_size=256,
        moe_router_topk=4,
    ),
    "qwen3-0.6b": dict(
        _QWEN3, num_layers=28, hidden_size=1024, ffn_hidden_size=3072, num_attention_heads=16,
        num_query_groups=8, max_position_embeddings=40960, tie_embeddings=True,
    ),
    "qwen3-8b": dict(
        _QWEN3, num_layers=36, hidden_size=4096, ffn_hidden_size=12288, num_attention_heads=32,
        num_query_groups=8, max_position_embeddings=40960,
    ),
    "qwen3-30b-a3b": dict(
        _QWEN3, num_layers=48, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=32,
        num_query_groups=4, max_position_embeddings=40960, num_experts=128, moe_ffn_hidden_size=768,
        moe_router_topk=8,
    ),
}  # fmt: skip
