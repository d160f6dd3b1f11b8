"""Transformer Engine is pointed at torch's own cuDNN (megatron_train/cudnn_sharing.py).

The dev machine's torch is the CPU build, with no cuDNN requirement; the GPU image's layout (torch
2.11.0+cu130 requiring nvidia-cudnn-cu13 9.19.0.56, whose wheel puts its libraries under
nvidia/cudnn/lib, as the 9.24.0.43 wheel and torch 2.14.1's metadata in the local package mirror
show) is written here as installed package metadata, which is all the lookup reads.
"""

import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_train import cudnn_sharing

ROOT = Path(__file__).resolve().parents[1]


def _gpu_image_packages(site: Path) -> Path:
    """torch and its pip cuDNN as a CUDA wheel installs them; returns the cuDNN library folder."""
    torch_info = site / "torch-2.11.0+cu130.dist-info"
    torch_info.mkdir(parents=True)
    (torch_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torch\nVersion: 2.11.0+cu130\nRequires-Dist: filelock\n"
        'Requires-Dist: nvidia-cudnn-cu13==9.19.0.56; platform_system == "Linux"\n'
        'Requires-Dist: nvidia-cublas==13.1.0.3; platform_system == "Linux"\n'
    )
    cudnn_info = site / "nvidia_cudnn_cu13-9.19.0.56.dist-info"
    cudnn_info.mkdir()
    (cudnn_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: nvidia-cudnn-cu13\nVersion: 9.19.0.56\n"
    )
    libraries = ["libcudnn_graph.so.9", "libcudnn.so.9", "libcudnn_cnn.so.9", "libcudnn_adv.so.9"]
    (cudnn_info / "RECORD").write_text(
        "".join(f"nvidia/cudnn/lib/{name},,\n" for name in libraries) + "nvidia/cudnn/include/cudnn.h,,\n"
    )
    folder = site / "nvidia" / "cudnn" / "lib"
    folder.mkdir(parents=True)
    for name in libraries:
        (folder / name).write_bytes(b"\x7fELF")
    (folder.parent / "include").mkdir()
    (folder.parent / "include" / "cudnn.h").write_text("")
    return folder


@pytest.fixture
def no_cudnn_choice(monkeypatch):
    monkeypatch.delenv("CUDNN_HOME", raising=False)
    monkeypatch.delenv("CUDNN_PATH", raising=False)


def test_transformer_engine_finds_the_cudnn_torch_requires(tmp_path, monkeypatch, no_cudnn_choice):
    folder = _gpu_image_packages(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    cudnn_sharing.share_torch_cudnn()
    assert os.environ["CUDNN_PATH"] == str(folder.parent)
    # Transformer Engine 2.11's own search under CUDNN_PATH (common/__init__.py): exactly torch's copy.
    found = [
        p for p in glob.glob(f"{os.environ['CUDNN_PATH']}/**/libcudnn.so*", recursive=True) if "stub" not in p
    ]
    assert found == [str(folder / "libcudnn.so.9")]


def test_a_cudnn_the_user_chose_is_kept(tmp_path, monkeypatch, no_cudnn_choice):
    _gpu_image_packages(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("CUDNN_HOME", "/opt/cudnn")
    cudnn_sharing.share_torch_cudnn()
    assert os.environ["CUDNN_HOME"] == "/opt/cudnn" and "CUDNN_PATH" not in os.environ


def test_a_torch_without_a_pip_cudnn_changes_nothing(tmp_path, monkeypatch, no_cudnn_choice):
    # This machine's CPU torch, as an NGC image's torch built against the system cuDNN: no requirement.
    assert cudnn_sharing.torch_cudnn_folder() is None
    # A requirement whose package is not installed.
    folder = _gpu_image_packages(tmp_path)
    for info in tmp_path.glob("nvidia_cudnn_cu13-*.dist-info"):
        (info / "RECORD").unlink()
        (info / "METADATA").unlink()
        info.rmdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    cudnn_sharing.share_torch_cudnn()
    assert folder.is_dir() and "CUDNN_PATH" not in os.environ


def test_importing_the_package_sets_it(tmp_path):
    folder = _gpu_image_packages(tmp_path / "site")
    env = {k: v for k, v in os.environ.items() if k not in ("CUDNN_HOME", "CUDNN_PATH")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), str(ROOT)])
    probe = "import os, sys, megatron_train; print(os.environ.get('CUDNN_PATH'))"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(folder.parent)
