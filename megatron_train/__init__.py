"""megatron-train: LLM pretraining on megatron-core."""

import logging
import os
import sys
import warnings
from importlib.util import find_spec, module_from_spec, spec_from_file_location
from pathlib import Path

__version__ = "0.1.0"


def _is_our_command() -> bool:
    """Whether this process runs one of this project's commands (``python -m megatron_train.*``,
    whose package import sees ``-m`` as argv[0], or a script of the checkout) rather than a program
    that merely imports this package."""
    main = sys.argv[0] if sys.argv else ""
    checkout = Path(__file__).resolve().parent.parent
    return main == "-m" or (main not in ("", "-c") and Path(main).resolve().parent.parent == checkout)


_OUR_COMMAND = _is_our_command()

# A command started by a Python other than the environment's (one not activated) would end in an
# import traceback a few lines on; nothing of it has run yet.
if _OUR_COMMAND and find_spec("torch") is None:
    print(
        f"error: {sys.executable} cannot import torch, so it is not the Python megatron-train is "
        "installed for. Fix: activate that environment (make install; source .venv/bin/activate)",
        file=sys.stderr,
    )
    sys.exit(2)


def _working_directory_exists() -> bool:
    try:
        os.getcwd()
    except FileNotFoundError:
        return False
    return True


# torch's import reads the working directory: one removed (or replaced, as a clean build or a
# test's temporary folder does) under the shell ended in its FileNotFoundError traceback.
if _OUR_COMMAND and not _working_directory_exists():
    where = f" ({os.environ['PWD']})" if os.environ.get("PWD") else ""
    print(
        f"error: the current directory{where} no longer exists: it was removed or replaced after the shell "
        'entered it. Fix: cd to an existing directory (cd "$PWD" if it was made again) and run it again',
        file=sys.stderr,
    )
    sys.exit(2)

# torchrun starts its ranks in sessions of their own, and a rank imports for seconds before it
# meets the others at its launcher: from this first moment, it ends with the launcher.
if _OUR_COMMAND:
    from megatron_train import parent_death

    parent_death.end_with_the_launcher()

# Before anything imports megatron-core, which imports Transformer Engine where it is installed.
from megatron_train.cudnn_sharing import share_torch_cudnn  # noqa: E402

share_torch_cudnn()

from megatron_train import optional_imports  # noqa: E402

optional_imports.install()


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


def _interrupt_while_starting_is_one_line() -> None:
    """A Ctrl-C in a command's first seconds lands while Python imports torch and megatron-core,
    before the command's own handler (``cli.entry_point``) is in place: one line instead of the
    import's traceback. Only for this project's commands (:func:`_is_our_command`); a program
    that merely imports this package keeps its own hook. A script that imports torch before this
    package still shows the trace of a Ctrl-C during torch's own import. Python still ends the
    process by SIGINT (130 in a shell)."""
    if not _OUR_COMMAND:
        return
    from megatron_train.placement import launcher_rank

    others = sys.excepthook

    def hook(kind, value, traceback) -> None:
        if issubclass(kind, KeyboardInterrupt):
            # A terminal's Ctrl-C reaches every rank of the job: the first one says it.
            if launcher_rank() == "0":
                print(
                    "error: interrupted while starting; nothing was written. Fix: run it again",
                    file=sys.stderr,
                )
        else:
            others(kind, value, traceback)

    sys.excepthook = hook


_interrupt_while_starting_is_one_line()

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
