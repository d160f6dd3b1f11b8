"""Model families built from megatron-core specs."""
