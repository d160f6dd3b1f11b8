"""GPU smoke test on one GPU: the demo and its HF export, a bitwise resume, save cost, numerics vs CPU.

    python benchmarks/gpu_smoke.py [--out runs/gpu_smoke] [--checks demo,resume,save,numerics,profile]

Every step is the real command line a user runs (torchrun -m megatron_train.train, the conversion
tool, the checkpoint benchmark); this script only chains them and compares their metrics.jsonl.
- demo: the demo config (tiny model, stdlib corpus) on 1 rank in bf16, 200 steps, then its
  checkpoint exported to HF, loaded and run by transformers on the GPU;
- resume: 40 steps uninterrupted against a resume from that run's step-20 checkpoint (and a second
  uninterrupted run, which shows whether the GPU kernels themselves are deterministic);
- save: async vs synchronous save blocking (benchmarks/checkpoint_save.py, ~150M parameters);
- numerics: 20 fp32 steps on the GPU against the same 20 on the CPU (CUDA hidden), and bf16 vs fp32;
- profile: profile.* on the demo: CUDA kernels in the trace's named steps, the memory snapshot.
Prints one summary; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_train import cli  # noqa: E402


def sh(cmd: list[str], log: Path, env: dict | None = None) -> float:
    """Run a command from the repo root, appending its output to ``log``; returns seconds taken."""
    start = time.perf_counter()
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        code = subprocess.call(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env or os.environ)
    if code != 0:
        raise SystemExit(f"failed (exit {code}): {' '.join(cmd)}; see {log}")
    return time.perf_counter() - start


def train(run_dir: Path, log: Path, *overrides: str, env: dict | None = None) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           "-m", "megatron_train.train", "--config", "configs/demo.yaml", "parallel.tensor=1",
           "parallel.pipeline=1", f"logging.run_dir={run_dir}", *overrides]  # fmt: skip
    return sh(cmd, log, env)


def metrics(run_dir: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if "loss" in r}


def max_rel(a: dict[int, dict], b: dict[int, dict], key: str, steps) -> float:
    return max(abs(a[s][key] - b[s][key]) / abs(b[s][key]) for s in steps)


def check_demo(out: Path, log: Path) -> list[tuple[bool, str]]:
    """The demo in bf16 on one GPU, then its checkpoint exported to HF and generated from."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    seconds = train(out / "demo", log, "train.precision=bf16")
    demo = [json.loads(x) for x in (out / "demo/metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in demo if "val_loss" in r]
    last = [r for r in demo if "loss" in r][-1]
    results = [(val[-1] < val[0], f"demo bf16, 200 steps in {seconds:.0f} s (with startup): val loss "
                + " -> ".join(f"{v:.2f}" for v in val) + f"; {last['tokens_per_s']:,.0f} tok/s, "
                f"peak {last['peak_mem_gib']:.2f} GiB")]  # fmt: skip
    hf = out / "demo_hf"
    sh([sys.executable, "tools/convert_checkpoint.py", "export-hf", "--ckpt", str(out / "demo/checkpoints"),
        "--out", str(hf), "--dtype", "bfloat16"], log)  # fmt: skip
    tok = AutoTokenizer.from_pretrained(hf)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.bfloat16).cuda()
    ids = tok("def parse_args(", return_tensors="pt").input_ids.cuda()
    text = tok.decode(model.generate(ids, max_new_tokens=24, do_sample=False)[0])
    results.append((len(text) > len("def parse_args("), f"HF export generates on GPU: {text!r}"))
    return results


def check_resume(out: Path, log: Path) -> list[tuple[bool, str]]:
    """40 steps straight against a resume from the same run's step-20 checkpoint, as after a crash."""
    common = ["train.precision=bf16", "train.steps=40", "train.eval_interval=0", "logging.log_interval=1",
              "checkpoint.interval=20", "checkpoint.keep_last=5"]  # fmt: skip
    train(out / "full", log, *common)
    train(out / "full2", log, *common)
    (out / "resumed/checkpoints").mkdir(parents=True)
    shutil.copytree(out / "full/checkpoints/iter_0000020", out / "resumed/checkpoints/iter_0000020")
    (out / "resumed/checkpoints/latest_checkpointed_iteration.txt").write_text("20\n")
    train(out / "resumed", log, *common)
    full, full2, resumed = metrics(out / "full"), metrics(out / "full2"), metrics(out / "resumed")
    after = range(21, 41)
    same = all(full[s]["loss"] == resumed[s]["loss"] and full[s]["grad_norm"] == resumed[s]["grad_norm"]
               for s in after)  # fmt: skip
    deterministic = all(full[s]["loss"] == full2[s]["loss"] for s in range(1, 41))
    return [(same, f"resume at step 20: steps 21-40 losses and grad norms bitwise equal to the "
             f"uninterrupted run: {same} (max rel diff {max_rel(resumed, full, 'loss', after):.1e}); "
             f"two uninterrupted runs bitwise equal: {deterministic}")]  # fmt: skip


def check_save(out: Path, log: Path) -> list[tuple[bool, str]]:
    """How long an async save blocks training against a synchronous one (~150M parameters)."""
    bench = subprocess.run(
        [sys.executable, "benchmarks/checkpoint_save.py", "--nproc", "1", "--repeats", "3",
         "train.precision=bf16", "parallel.tensor=1", "parallel.pipeline=1", "model.num_layers=12",
         "model.hidden_size=1024", "model.ffn_hidden_size=2816", "model.num_attention_heads=16",
         "model.num_query_groups=4"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    (out / "checkpoint_save.log").write_text(bench.stdout + bench.stderr)
    lines = [x for x in bench.stdout.splitlines() if "reshardable" in x or "layout" in x]
    return [(bench.returncode == 0 and len(lines) >= 3, "checkpoint save: " + " | ".join(lines))]


def check_numerics(out: Path, log: Path) -> list[tuple[bool, str]]:
    """fp32 on the GPU against fp32 on the CPU (same machine and data), and bf16 against fp32."""
    steps = ["train.steps=20", "train.eval_interval=0", "logging.log_interval=1", "checkpoint.interval=0",
             "checkpoint.save_at_end=false"]  # fmt: skip
    train(out / "fp32_gpu", log, "train.precision=fp32", *steps)
    cpu_env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "8"}
    train(out / "fp32_cpu", log, "train.precision=fp32", *steps, env=cpu_env)
    train(out / "bf16_gpu", log, "train.precision=bf16", *steps)
    gpu, cpu, bf16 = metrics(out / "fp32_gpu"), metrics(out / "fp32_cpu"), metrics(out / "bf16_gpu")
    first20 = range(1, 21)
    loss_rel, norm_rel = max_rel(gpu, cpu, "loss", first20), max_rel(gpu, cpu, "grad_norm", first20)
    bf_rel = max_rel(bf16, gpu, "loss", first20)
    return [
        (
            loss_rel < 1e-4,
            f"fp32 GPU vs CPU, 20 steps: max rel diff loss {loss_rel:.1e}, grad norm {norm_rel:.1e}",
        ),
        (bf_rel < 2e-2, f"bf16 vs fp32 on GPU, 20 steps: max rel diff loss {bf_rel:.1e} (tolerance 2e-2)"),
    ]


def check_profile(out: Path, log: Path) -> list[tuple[bool, str]]:
    """profile.* on the GPU: the trace holds CUDA kernels inside the named steps, and the memory
    snapshot is written beside it."""
    import gzip

    # After the demo's 10 warm-up steps of the learning rate.
    train(out / "profile", log, "train.precision=bf16", "train.steps=14", "train.eval_interval=0",
          "checkpoint.save_at_end=false", "profile.start_step=12", "profile.memory=true")  # fmt: skip
    folder = out / "profile/profile/step12-13"
    with gzip.open(folder / "rank0.json.gz", "rt") as f:
        events = json.load(f)["traceEvents"]
    kernels = sum(e.get("cat") == "kernel" for e in events)
    steps = sorted({e["name"] for e in events if e["name"].startswith("train step")})
    snapshot = folder / "rank0.memory.pickle"
    ok = kernels > 0 and steps == ["train step 12", "train step 13"] and snapshot.is_file()
    size = f"{snapshot.stat().st_size / 2**20:.1f} MiB" if snapshot.is_file() else "missing"
    text = f"profile of steps 12-13: {kernels} CUDA kernel events, ranges {steps}, memory snapshot {size}"
    # The operator table's first three rows: the most GPU time of their own.
    top = [" ".join(line.split()) for line in (folder / "rank0.txt").read_text().splitlines()[3:6]]
    return [(ok, f"{text}; first rows of rank0.txt: {' | '.join(top)}")]


CHECKS = {"demo": check_demo, "resume": check_resume, "save": check_save, "numerics": check_numerics,
          "profile": check_profile}  # fmt: skip


def main() -> int:
    parser = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--out", default="runs/gpu_smoke", help="a new directory for the runs and logs")
    parser.add_argument(
        "--checks", default=",".join(CHECKS), help="comma-separated subset of " + ", ".join(CHECKS)
    )
    args = parser.parse_args()
    import torch

    checks = args.checks.split(",")
    if unknown := [c for c in checks if c not in CHECKS]:
        parser.error(f"--checks: unknown {unknown}; choose from {', '.join(CHECKS)}")
    if not torch.cuda.is_available():
        cli.report("gpu_smoke: no CUDA device. Fix: run it on a GPU node")
        return cli.EXIT_BAD_INPUT
    out = (ROOT / args.out).resolve()
    if out.exists() and any(out.iterdir()):
        cli.report(f"gpu_smoke: {out} is not empty. Fix: pass a new --out")
        return cli.EXIT_BAD_INPUT
    out.mkdir(parents=True, exist_ok=True)
    log = out / "smoke.log"
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    sh(["bash", "launch/demo_data.sh", str(len(os.sched_getaffinity(0)))], log, {**os.environ, "PATH": path})
    summary = [f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}"]
    failed = 0
    for name in checks:
        for ok, text in CHECKS[name](out, log):
            summary.append(("PASS " if ok else "FAIL ") + text)
            failed += not ok
            print(summary[-1], flush=True)
    (out / "summary.txt").write_text("\n".join(summary) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
