"""Peak memory and time of one cross-entropy forward + backward over a micro-batch's logits:
megatron-core's loss, its fused one (eager and compiled), and ours (megatron_train.models.loss,
what ``model.cross_entropy_fusion=true`` runs on the local spec).

    python benchmarks/cross_entropy_memory.py [--seq 4096] [--batch 2] [--vocab 128256] [--repeats 3]

megatron-core's fused loss runs its steps as ``jit_fuser`` (``torch.compile``) functions on a GPU
and eagerly without one; both are shown. Each mode runs in a process of its own, on bf16 logits
of shape [seq, batch, vocab] at TP=1: on a GPU the peak is ``torch.cuda.max_memory_allocated``
above what was allocated before the pass; on the CPU it is the process's resident memory sampled
every half millisecond (coarser, the same for every mode)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_train import cli  # noqa: E402

MODES = ("megatron-core", "megatron fused, eager", "megatron fused, compiled", "ours, compiled")
_FUSED_STEPS = ("calculate_logits_max", "calculate_predicted_logits", "calculate_cross_entropy_loss",
                "calculate_gradients")  # fmt: skip


def _resident_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


class _PeakResident:
    """The largest resident size seen while the body runs, sampled from a thread."""

    def __enter__(self) -> _PeakResident:
        self.peak, self._done = _resident_bytes(), threading.Event()
        self._thread = threading.Thread(target=self._sample)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.0005):
            self.peak = max(self.peak, _resident_bytes())

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()


def measure(mode: str, seq: int, batch: int, vocab: int, repeats: int) -> dict:
    """Peak bytes above the start and median seconds of one forward + backward in ``mode``."""
    import torch
    import torch.distributed as dist

    from megatron_train import cpu_compat

    cuda = torch.cuda.is_available()
    if not cuda:
        cpu_compat.enable()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.fusions import fused_cross_entropy as fused
    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    from megatron_train.models import loss as ours

    parallel_state.initialize_model_parallel(1)
    for name in _FUSED_STEPS:
        step = getattr(fused, name)
        eager = getattr(step, "_torchdynamo_orig_callable", step)  # jit_fuser compiled it on a GPU
        setattr(fused, name, torch.compile(eager) if mode == "megatron fused, compiled" else eager)

    device = "cuda" if cuda else "cpu"
    logits = torch.randn(seq, batch, vocab, dtype=torch.bfloat16, device=device, requires_grad=True)
    target = torch.randint(0, vocab, (seq, batch), device=device)

    def one_pass() -> None:
        group = parallel_state.get_tensor_model_parallel_group()
        if mode == "megatron-core":
            loss = vocab_parallel_cross_entropy(logits, target)
        elif mode == "ours, compiled":
            loss = ours.vocab_parallel_cross_entropy(logits, target, group)
        else:
            loss = fused.fused_vocab_parallel_cross_entropy(logits, target, group)
        loss.sum().backward()
        logits.grad = None
        if cuda:
            torch.cuda.synchronize()

    one_pass()  # compiles, in the compiled mode
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        one_pass()
        seconds.append(time.perf_counter() - started)
    if cuda:
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        one_pass()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        before = _resident_bytes()
        with _PeakResident() as watch:
            one_pass()
        peak = watch.peak - before
    dist.destroy_process_group()
    return {"peak_bytes": peak, "seconds": statistics.median(seconds), "device": device}


def main() -> None:
    parser = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--seq", type=cli.positive_int, default=4096)
    parser.add_argument("--batch", type=cli.positive_int, default=2)
    parser.add_argument("--vocab", type=cli.positive_int, default=128256)
    parser.add_argument("--repeats", type=cli.positive_int, default=3)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        result = measure(args.mode, args.seq, args.batch, args.vocab, args.repeats)
        print("RESULT " + json.dumps(result))
        return

    copy = args.seq * args.batch * args.vocab * 4
    print(f"logits [{args.seq}, {args.batch}, {args.vocab}] bf16; one fp32 copy = {copy / 2**20:,.0f} MiB")
    print(f"{'mode':<26} {'peak above start':>18} {'in fp32 copies':>15} {'ms per pass':>12}")
    device = "unknown"
    for mode in MODES:
        cmd = [sys.executable, __file__, "--mode", mode, "--seq", str(args.seq), "--batch", str(args.batch),
               "--vocab", str(args.vocab), "--repeats", str(args.repeats)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        found = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode != 0 or not found:
            print(f"{mode:<26} failed: {done.stderr.strip().splitlines()[-1:]}")
            continue
        r = json.loads(found[-1].removeprefix("RESULT "))
        device = r["device"]
        print(f"{mode:<26} {r['peak_bytes'] / 2**20:>14,.0f} MiB {r['peak_bytes'] / copy:>15.2f} "
              f"{r['seconds'] * 1000:>12.1f}")  # fmt: skip
    print(f"device: {device}")


if __name__ == "__main__":
    main()
