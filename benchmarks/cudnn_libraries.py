"""Which cuDNN one process ends up holding once torch has used cuDNN and Transformer Engine is
imported, with and without megatron_train pointing TE at torch's copy (megatron_train/cudnn_sharing.py).

    python benchmarks/cudnn_libraries.py          # on a GPU node with TE installed

Each case is a fresh process. ``shared`` imports megatron_train first, as every command of ours
does; ``unshared`` imports torch directly, as a script that never imports us would. Each runs
cuDNN through torch (a convolution, and SDPA's cuDNN attention in bf16, forward and backward),
then imports TE, as the transformers benchmark row did when it failed on the H200 (megatron-core,
and with it TE, came in only for its FLOPs after the timed loop), then runs the same again, and
prints the folders of the cuDNN libraries mapped into it (/proc/self/maps). Exit 0 when the shared
case used cuDNN from one folder without an error; a CPU machine prints what it can (no cuDNN is
loaded there) and exits 0.
"""

from __future__ import annotations

import json
import subprocess
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def probe(shared: bool) -> dict:
    report: dict = {"errors": []}
    if shared:
        import megatron_train  # noqa: F401

    import os

    import torch

    report["CUDNN_PATH"] = os.environ.get("CUDNN_PATH")
    gpu = torch.cuda.is_available()
    if gpu:
        report["torch_cudnn"] = torch.backends.cudnn.version()
        _use_cudnn(torch, "before TE", report)
    try:
        import transformer_engine.pytorch  # noqa: F401

        report["transformer_engine"] = "imported"
    except Exception as error:  # what TE's import raised is the finding
        report["transformer_engine"] = f"{type(error).__name__}: {error}"
    if gpu:
        _use_cudnn(torch, "after TE", report)
    folders: dict[str, list[str]] = {}
    with open("/proc/self/maps") as maps:
        for path in sorted({Path(line.split()[-1]) for line in maps if "libcudnn" in line}):
            folders.setdefault(str(path.parent), []).append(path.name)
    report["cudnn_folders"] = folders
    return report


def _use_cudnn(torch, when: str, report: dict) -> None:
    for name, use in (("convolution", _convolution), ("cudnn attention", _cudnn_attention)):
        try:
            use(torch)
        except Exception:
            report["errors"].append(f"{name} {when}: {traceback.format_exc(limit=-3).strip()}")


def _convolution(torch) -> None:
    x = torch.randn(2, 3, 16, 16, device="cuda", requires_grad=True)
    w = torch.randn(4, 3, 3, 3, device="cuda", requires_grad=True)
    torch.nn.functional.conv2d(x, w).sum().backward()
    torch.cuda.synchronize()


def _cudnn_attention(torch) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (
        torch.randn(1, 8, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
    )
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    torch.cuda.synchronize()


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--case":
        print(json.dumps(probe(sys.argv[2] == "shared")))
        return 0
    # Read by hand: megatron_train's parser would import the package here, whose CUDNN_PATH the
    # ``unshared`` case would then inherit.
    if sys.argv[1:] in (["-h"], ["--help"]):
        print(__doc__.strip())
        return 0
    if sys.argv[1:]:
        print(
            f"error: unexpected argument {sys.argv[1]!r}: this probe takes none. "
            "Fix: run python benchmarks/cudnn_libraries.py",
            file=sys.stderr,
        )
        return 2
    code = 0
    for case in ("shared", "unshared"):
        proc = subprocess.run(
            [sys.executable, __file__, "--case", case], cwd=ROOT, capture_output=True, text=True
        )
        if proc.returncode != 0:
            print(f"{case}: the process failed (exit {proc.returncode}):\n{proc.stderr.strip()}")
            code = 1 if case == "shared" else code
            continue
        report = json.loads(proc.stdout.strip().splitlines()[-1])
        folders = report["cudnn_folders"]
        te, cudnn = report["transformer_engine"], report.get("torch_cudnn", "-")
        print(f"{case}: CUDNN_PATH={report['CUDNN_PATH']}, Transformer Engine {te}, torch's cuDNN {cudnn}, "
              f"cuDNN loaded from {len(folders)} folder(s)")  # fmt: skip
        for folder, names in sorted(folders.items()):
            print(f"  {folder}: {', '.join(names)}")
        for error in report["errors"]:
            print(f"  failed: {error}")
        if case == "shared" and (len(folders) > 1 or report["errors"]):
            code = 1
    return code


if __name__ == "__main__":
    sys.exit(main())
