"""Llama-family presets: ``model.preset`` names and the ``model.*`` values they set."""

from __future__ import annotations

PRESETS: dict[str, dict] = {
    "tiny": dict(
        num_layers=4, hidden_size=128, ffn_hidden_size=352, num_attention_heads=4,
        num_query_groups=2, max_position_embeddings=1024,
    ),
    "small": dict(
        num_layers=8, hidden_size=512, ffn_hidden_size=1408, num_attention_heads=8,
        num_query_groups=4, max_position_embeddings=2048,
    ),
    "llama2-7b": dict(
        num_layers=32, hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32,
        num_query_groups=32, max_position_embeddings=4096, vocab_size=32000, norm_eps=1e-5,
        rotary_base=10000,
    ),
    "llama3-8b": dict(
        num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
        num_query_groups=8, max_position_embeddings=8192, vocab_size=128256, norm_eps=1e-5,
        rotary_base=500000,
    ),
    "llama3.1-8b": dict(
        num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
        num_query_groups=8, max_position_embeddings=131072, vocab_size=128256, norm_eps=1e-5,
        rotary_base=500000, rope_scaling=True, rope_scaling_factor=8.0,
    ),
    "llama3-70b": dict(
        num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
        num_query_groups=8, max_position_embeddings=8192, vocab_size=128256, norm_eps=1e-5,
        rotary_base=500000,
    ),
}  # fmt: skip
