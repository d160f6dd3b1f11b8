"""Mixtral-family presets: ``model.preset`` names and the ``model.*`` values they set."""

from __future__ import annotations

PRESETS: dict[str, dict] = {
    "mixtral-tiny": dict(
        num_layers=4, hidden_size=128, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
        max_position_embeddings=1024, num_experts=4, moe_router_topk=2,
    ),
    "mixtral-8x7b": dict(
        num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32, num_query_groups=8,
        max_position_embeddings=32768, vocab_size=32000, norm_eps=1e-5, rotary_base=1000000,
        num_experts=8, moe_router_topk=2,
    ),
}  # fmt: skip
