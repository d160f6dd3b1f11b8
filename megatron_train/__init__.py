"""megatron-train: LLM pretraining on megatron-core."""

import logging
import os
import sys
import warnings
from importlib.util import module_from_spec, spec_from_file_location
from pathlib import Path

__version__ = "0.1.0"


def _map_checkout_families() -> None:
    """The model families are the checkout's top-level models/ folder, installed as
    megatron_train.models (pyproject's package-dir). Imported from a checkout beside a wheel install
    (`python -m megatron_train.train` in the repository root on an air-gapped node), this package
    has no models/ inside, so the name is mapped to that folder here, as an editable install does."""
    folder = Path(__file__).resolve().parent.parent / "models"
    if Path(__file__).with_name("models").is_dir() or not (folder / "registry.py").is_file():
        return
    spec = spec_from_file_location(
        f"{__name__}.models", folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    sys.modules[spec.name] = module = module_from_spec(spec)
    spec.loader.exec_module(module)


_map_checkout_families()

# The node is asked whether it has a GPU through its NVIDIA driver rather than torch, which tools
# that never need torch do not load.
_NO_GPU = not os.path.exists("/proc/driver/nvidia/version")
if _NO_GPU:
    from megatron_train import eager_fusions

    eager_fusions.install()

# Known, harmless start-up noise from our dependencies; anything else still shows. Without a GPU,
# Transformer Engine and apex cannot be used, so megatron-core's notes that it falls back without
# them say nothing; on a GPU node they are shown (a fused path is missing there).
if _NO_GPU:
    warnings.filterwarnings("ignore", message="Apex is not installed")
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
warnings.filterwarnings(
    "ignore", message=r".*`torch.distributed.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated"
)
# A CUDA build of torch on a machine without a GPU (a login node running preflight or a tool) logs,
# when its extension builder is imported, that it found no CUDA runtime; nothing is built there.
logging.getLogger("torch.utils.cpp_extension").addFilter(
    lambda record: not record.getMessage().startswith("No CUDA runtime is found")
)
# megatron-core 0.16's checkpoint loading calls torch.distributed.checkpoint's deprecated name.
warnings.filterwarnings("ignore", message="`load_state_dict` is deprecated", category=FutureWarning)
