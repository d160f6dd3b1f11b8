"""Peak memory of HF <-> megatron-train conversion on a synthetic Llama of a few GB.

    python benchmarks/convert_memory.py --layers 12 --hidden 3072 --shard-gib 1

Writes a random bf16 Llama-shaped model as safetensors shards (streamed, never whole in memory),
then times ``convert_checkpoint.py import-hf`` and ``export-hf`` as child processes and prints
each one's peak RSS next to the largest HF shard file. Nothing is asserted: it prints figures.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_train import cli  # noqa: E402
from megatron_train.config import ModelConfig  # noqa: E402
from megatron_train.hf.plan import hf_shapes  # noqa: E402
from megatron_train.hf.safetensors_io import write_weights  # noqa: E402
from megatron_train.models.registry import for_hf  # noqa: E402


def synthetic_model(out: Path, layers: int, hidden: int, shard_bytes: int) -> int:
    """A random Llama-3-shaped bf16 model; returns its size in bytes."""
    heads = hidden // 128
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
        "hidden_size": hidden, "intermediate_size": int(hidden * 3.5), "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": max(heads // 4, 1), "head_dim": 128,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "tie_word_embeddings": False, "hidden_act": "silu", "dtype": "bfloat16",
    }  # fmt: skip
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    family = for_hf(config)
    shapes = hf_shapes(family, ModelConfig(**family.hf_model_options(config)))
    gen = torch.Generator().manual_seed(0)
    write_weights(
        out, shapes, torch.bfloat16, lambda n: torch.randn(shapes[n], generator=gen) * 0.02, shard_bytes
    )
    return sum(2 * torch.Size(shape).numel() for shape in shapes.values())


# VmHWM, not ru_maxrss: Linux carries ru_maxrss over fork and exec, so a child would report the
# parent's peak (this script's, after writing the synthetic model) rather than its own.
# run_path, unlike ``python tools/x.py``, leaves the script's folder off the path, where each tool
# finds use_checkout.
_CHILD = """
import os, runpy, sys
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM"))
    print("peak-rss-kib", hwm.split()[1], file=sys.stderr)
"""


def measured(*args: str) -> tuple[float, float]:
    """(seconds, peak RSS in GiB) of one conversion run in its own process."""
    start = time.perf_counter()
    cmd = [sys.executable, "-c", _CHILD, str(ROOT / "tools" / "convert_checkpoint.py"), *args]
    result = subprocess.run(
        cmd, capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    )
    elapsed = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-3000:])
    peak_kib = int(result.stderr.rsplit("peak-rss-kib", 1)[1].split()[0])
    return elapsed, peak_kib / 2**20


def main() -> None:
    parser = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=cli.positive_int, default=12)
    parser.add_argument("--hidden", type=cli.positive_int, default=3072)
    parser.add_argument("--shard-gib", type=cli.positive_float, default=1.0)
    parser.add_argument("--workdir", type=Path, help="default: a temporary directory")
    args = parser.parse_args()
    if args.workdir is not None and not args.workdir.is_dir():
        parser.error(f"--workdir: no folder {str(args.workdir)!r}")
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        tmp = Path(tmp)
        total = synthetic_model(tmp / "hf", args.layers, args.hidden, int(args.shard_gib * 2**30))
        largest = max(p.stat().st_size for p in (tmp / "hf").glob("*.safetensors")) / 2**30
        print(f"synthetic model: {total / 2**30:.2f} GiB bf16 in shards of at most {largest:.2f} GiB")
        seconds, peak = measured("import-hf", "--hf", str(tmp / "hf"), "--out", str(tmp / "ckpt"))
        print(f"import-hf: {seconds:.1f} s, peak RSS {peak:.2f} GiB ({peak / largest:.2f} x largest shard)")
        seconds, peak = measured(
            "export-hf",
            "--ckpt",
            str(tmp / "ckpt"),
            "--out",
            str(tmp / "back"),
            "--max-shard-gib",
            str(args.shard_gib),
        )
        print(f"export-hf: {seconds:.1f} s, peak RSS {peak:.2f} GiB ({peak / largest:.2f} x largest shard)")


if __name__ == "__main__":
    main()
