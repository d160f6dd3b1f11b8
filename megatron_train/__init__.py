"""megatron-train: LLM pretraining on megatron-core."""

import warnings

__version__ = "0.1.0"

# Known, harmless start-up noise from our dependencies; anything else still shows.
warnings.filterwarnings("ignore", message="Apex is not installed")
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
warnings.filterwarnings(
    "ignore", message=r".*`torch.distributed.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated"
)
