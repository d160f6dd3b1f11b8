"""megatron-train: LLM pretraining on megatron-core."""

import os
import warnings

__version__ = "0.1.0"

# Known, harmless start-up noise from our dependencies; anything else still shows. Without a GPU,
# Transformer Engine and apex cannot be used, so megatron-core's notes that it falls back without
# them say nothing; on a GPU node they are shown (a fused path is missing there). The node is
# asked through its NVIDIA driver rather than torch, which tools that never need it do not load.
if not os.path.exists("/proc/driver/nvidia/version"):
    warnings.filterwarnings("ignore", message="Apex is not installed")
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
warnings.filterwarnings(
    "ignore", message=r".*`torch.distributed.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated"
)
