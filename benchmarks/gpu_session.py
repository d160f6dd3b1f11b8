"""One device call's worth of the GPU checks and benchmarks, the most wanted first, each in a time box.

    python benchmarks/gpu_session.py --out $OUT [--budget-s 540] [--steps a,b]   # on the GPU node
    python benchmarks/gpu_session.py --out /tmp/dry --cpu                           # dry run here

On the node: the checkout, and wheelhouse/ from ``tools/build_wheelhouse.sh --python 3.12
--node-freeze benchmarks/gpu_node_freeze.txt --with-torchtitan 0.2.2 --out wheelhouse`` (installed
first unless megatron-core already imports; the freeze is the lent GPU image's ``pip list``).
A lent GPU comes with minutes, not hours, and each call that starts a machine costs one of them:
this script runs the whole plan in one command, the most wanted first. Each step is a real
command line (the offline install; benchmarks/throughput.py eager, with every option that helped
and four micro-batches (torchtitan beside it at that micro-batch), that compiled (torchtitan
compiled beside it) and again with gradient accumulation fusion, the eager best profiled, the
compiled defaults, with the rotary embedding compiled, with our compiled loss;
benchmarks/gpu_smoke.py; benchmarks/masked_attention_grad.py; benchmarks/cross_entropy_memory.py);
it gets at most its own cap and what is left of the budget, and a step that fails or runs out of
time does not stop the next. Every step's output goes to ``OUT/steps.log`` under a header line of
its own, the profiler's table and trace to ``OUT/profile/``, and a table of what ran, how long and
how it ended to ``OUT/summary.txt``, so what a cut-short session measured still comes back (in few
files: a device call brings back at most eight). ``--cpu`` runs the same steps at the tiny shape
on this machine, leaving out the GPU smoke test (it needs CUDA). The whole plan takes more than
one call's ten minutes: ``--steps`` runs the named steps only, so it goes in two calls to the
same warm machine (the second finds megatron-core installed and skips the install).

A wheelhouse built ``--with-te cu13`` makes the plan Transformer Engine's: the install compiles
TE's torch extension against the node's torch (capped at 480 s; 129 s on the lent H200's 16
cores), then benchmarks/cudnn_libraries.py (one cuDNN beside TE), the TE row, ours and
transformers' beside it (as above, without the profile and the compiled rows), and the TE spec
with fused cross-entropy and four micro-batches. That wheelhouse is 204 MB (TE's core
wheel alone 179 MB), more than one device call carries (64 MiB), so it travels as a tar in parts
to a warm machine, one call each (``tar -cf - -C wheelhouse . | split -b 52M - te.``): each call
copies its part under /tmp, and the last one joins them into wheelhouse/ (``cat /tmp/te/te.* |
tar -xf - -C wheelhouse``) and runs this script.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_train import cli  # noqa: E402
from megatron_train.outputs import check_output_dir  # noqa: E402

MIN_STEP_S = 45
"""A step is not started with less time than this left: it would only spend it starting up."""
TAIL_LINES = 12
HEADER = "=== step "


@dataclass(frozen=True)
class Step:
    name: str
    cap_s: int
    argv: list[str]


def plan(cpu: bool, out: Path, wheelhouse: Path = ROOT / "wheelhouse") -> list[Step]:
    py = sys.executable
    bench = [py, "benchmarks/throughput.py"]
    # The CPU dry run: every script and flag the GPU run uses, at the tiny shape.
    shape = ["--device", "cpu", "--tiny"] if cpu else []
    tiny = [*shape, "--steps", "1", "--warmup", "1"] if cpu else ["--steps", "10", "--warmup", "3"]
    # A wheelhouse built --with-te makes this Transformer Engine's session: its torch extension
    # compiles in the install step (minutes), and the TE row comes first, ours beside it in its own
    # step so that each table is printed even if the budget runs out before the other.
    te = not cpu and any(wheelhouse.glob("transformer_engine_torch-*.tar.gz"))
    steps = []
    install = wheelhouse / "install.sh"
    # The probes (a subprocess each) only where there is something to install.
    if install.exists() and (
        not _imports("megatron.core") or (te and not _imports("transformer_engine.pytorch"))
    ):
        steps.append(Step("install", 480 if te else 240, ["env", f"PYTHON={py}", "bash", str(install)]))
    if te:
        # One cuDNN in a process that imports TE and uses torch's cuDNN (transformers' row failed
        # there on the H200 before megatron_train/cudnn_sharing.py): which libraries each case maps.
        steps.append(Step("cudnn_libraries", 90, [py, "benchmarks/cudnn_libraries.py"]))
        steps.append(Step("throughput_te", 240, [*bench, "--frameworks", "ours-te", *tiny]))
    # Beside TE, transformers' row too (it failed there once); torchtitan's is measured elsewhere.
    frameworks = "ours" if cpu else "ours,hf" if te else "ours,hf,torchtitan"
    steps.append(Step("throughput_eager", 300, [*bench, "--frameworks", frameworks, *tiny]))
    # The local spec with every option that made it faster somewhere, and four micro-batches of
    # the same 32k tokens: how close the local path comes to 50 % MFU (cuDNN attention is CUDA's).
    # torchtitan at the same micro-batch beside it, so the ratio to it compares like with like.
    options = ["--set", "model.rope_fusion=true", "--set", "model.cross_entropy_fusion=true"]
    options += [] if cpu else ["--set", "model.attention_backend=cudnn"]
    larger = ["--micro-batch", "4", "--grad-accum", "2"]
    with_titan = "ours" if cpu or te else "ours,torchtitan"
    steps.append(Step("all_options", 210, [*bench, "--frameworks", with_titan, *options, *larger, *tiny]))
    if te:
        fused_loss = ["--set", "model.cross_entropy_fusion=true", *larger, *tiny]
        steps.append(Step("te_all_options", 150, [*bench, "--frameworks", "ours-te", *fused_loss]))
    else:
        # The same compiled, beside torchtitan compiled: the local path's best against its best.
        # (The compiled layers hold RoPE and the loss; cuDNN attention stays an option.)
        cudnn = [] if cpu else ["--set", "model.attention_backend=cudnn"]
        best = ["--frameworks", with_titan, "--compile", *cudnn, *larger, *tiny]
        steps.append(Step("compiled_all_options", 300, [*bench, *best]))
        # And with the weight-gradient GEMMs accumulating into main_grad, the linears then outside
        # the compiled graphs (model.compile alone leaves the fusion off): which is faster here.
        fused = ["--frameworks", "ours", "--compile", "--set", "model.gradient_accumulation_fusion=true"]
        steps.append(Step("compiled_wgrad_fused", 150, [*bench, *fused, *cudnn, *larger, *tiny]))
        # Where the eager best's time goes: the operators by GPU time and how busy the GPU is.
        profiled = ["--frameworks", "ours", *options, *larger, *shape, "--steps", "2", "--warmup", "3"]
        steps.append(Step("profile", 150, [*bench, *profiled, "--profile", str(out / "profile")]))
        # TE fuses its own kernels; the compiled rows of the local spec are the other sessions'.
        compiled = ["--frameworks", "ours" if cpu else "ours,torchtitan", "--compile"]
        steps.append(Step("throughput_compiled", 300, [*bench, *compiled, *tiny]))
    # The local spec with its rotary embedding compiled (model.rope_fusion, off by default), and
    # with our compiled loss (model.cross_entropy_fusion; megatron-core's keeps an fp32 copy of
    # the logits): a row each, since either may become a default.
    rope = ["--frameworks", "ours", "--set", "model.rope_fusion=true", *tiny]
    steps.append(Step("rope_compiled", 150, [*bench, *rope]))
    fused_loss = ["--frameworks", "ours", "--set", "model.cross_entropy_fusion=true", *tiny]
    steps.append(Step("fused_loss", 150, [*bench, *fused_loss]))
    if not cpu:
        # The demo (its loop paces garbage collection and times data waits) and profiling; the
        # resume was measured there before (README). Runs stay on the node.
        runs = Path(tempfile.gettempdir(), f"gpu_smoke-{os.getpid()}-{time.time_ns()}")
        smoke = [py, "benchmarks/gpu_smoke.py", "--out", str(runs), "--checks", "demo,profile"]
        steps.append(Step("smoke", 200, smoke))
    # pytorch#196678: the document-mask path's gradients where cuDNN's go NaN, cuDNN forced beside.
    masked = [py, "benchmarks/masked_attention_grad.py", *(["--device", "cpu"] if cpu else [])]
    steps.append(Step("masked_attention_grad", 60, masked))
    ce = ["--seq", "64", "--vocab", "512", "--repeats", "1"] if cpu else []
    steps.append(Step("cross_entropy_memory", 150, [py, "benchmarks/cross_entropy_memory.py", *ce]))
    return steps


def _imports(module: str) -> bool:
    probe = [sys.executable, "-c", f"import {module}"]
    return subprocess.run(probe, cwd=ROOT, capture_output=True).returncode == 0


def run_step(step: Step, timeout_s: float, log: Path) -> str:
    """Run one step, appending its output to ``log`` under a header; returns how it ended. The
    step's whole process group goes when it runs out of time (torchrun and its ranks too)."""
    with open(log, "a") as out:
        out.write(f"{HEADER}{step.name}\n$ {' '.join(step.argv)}\n")
        out.flush()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(step.argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return f"out of time after {timeout_s:.0f} s"
    return "ok" if code == 0 else f"failed (exit {code})"


def step_outputs(log: Path) -> dict[str, str]:
    """Each step's output in the session log, by step name."""
    if not log.exists():
        return {}
    parts = log.read_text().split(HEADER)[1:]
    return {part.split("\n", 1)[0]: part.split("\n", 1)[1] for part in parts}


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, help="folder for the logs and summary.txt (made if missing)")
    parser.add_argument("--budget-s", type=cli.positive_float, default=540, help="seconds for the whole plan")
    parser.add_argument("--cpu", action="store_true", help="dry run at the tiny shape on this machine")
    parser.add_argument(
        "--wheelhouse", type=Path, default=ROOT / "wheelhouse", help="the offline install kit (if there)"
    )
    parser.add_argument(
        "--steps", help="comma-separated steps of the plan to run, in its order (default: all): a plan "
        "longer than one device call goes in two calls to the same warm machine"
    )  # fmt: skip
    args = parser.parse_args(argv)
    out = Path(args.out)
    steps = plan(args.cpu, out, args.wheelhouse)
    if args.steps is not None:
        wanted, names = args.steps.split(","), [step.name for step in steps]
        if unknown := [name for name in wanted if name not in names]:
            cli.report(
                f"--steps: {unknown[0]!r} is not a step of this plan. Fix: name steps of {', '.join(names)}"
            )
            return cli.EXIT_BAD_INPUT
        steps = [step for step in steps if step.name in wanted]
    if code := cli.run(lambda: check_output_dir("--out", out)):
        return code
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_s
    rows = []
    log = out / "steps.log"
    for step in steps:
        left = deadline - time.monotonic()
        if left < MIN_STEP_S:
            rows.append((step.name, 0.0, f"skipped ({left:.0f} s of the budget left)"))
            continue
        started = time.monotonic()
        ended = run_step(step, min(step.cap_s, left), log)
        rows.append((step.name, time.monotonic() - started, ended))
        print(f"{step.name}: {ended} in {rows[-1][1]:.0f} s", flush=True)
    summary = "\n".join(f"{name:<22} {seconds:6.0f} s  {ended}" for name, seconds, ended in rows) + "\n"
    (out / "summary.txt").write_text(summary)
    # The call's reply shows only the end of the output: each step's last lines (its table) go there.
    for name, output in step_outputs(log).items():
        print(f"--- {name} (last lines)", *output.splitlines()[-TAIL_LINES:], sep="\n")
    print(summary, end="")
    return 0 if all(ended == "ok" for _, _, ended in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
