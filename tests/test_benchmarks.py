"""The benchmarks' CPU dry runs: every path each can run here, end to end."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import load_tool, write_config

ROOT = Path(__file__).resolve().parents[1]


def test_throughput_benchmark_dry_run_on_cpu_prints_a_row_per_framework(tmp_path):
    result = subprocess.run(
        [sys.executable, "benchmarks/throughput.py", "--device", "cpu", "--tiny", "--steps", "1",
         "--warmup", "1", "--frameworks", "ours,hf,torchtitan", "--log-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {
        line.split()[0]: line
        for line in result.stdout.splitlines()
        if line.startswith(("ours", "hf", "torch"))
    }
    for name in ("ours", "hf"):
        assert re.match(rf"{name}\s+[\d,]+\s+[\d.]+", rows[name]), result.stdout
    assert "did not run" in rows["torchtitan"], result.stdout
    [ratio] = re.findall(r"^tokens/s: ours / hf ([\d.]+)x$", result.stdout, re.MULTILINE)
    assert float(ratio) > 0
    # Both frameworks build the same model: the same parameters, tied embeddings counted once.
    params = {
        name: json.loads(line.split(" ", 1)[1])["params"]
        for name in ("ours", "hf")
        for line in (tmp_path / f"{name}.log").read_text().splitlines()
        if line.startswith("RESULT ")
    }
    assert params["ours"] == params["hf"] > 0, params


def test_transformers_baseline_process_loads_neither_megatron_core_nor_transformer_engine():
    """The baseline is transformers alone: megatron-core (which imports Transformer Engine where it
    is installed) stays out of its process; our FLOPs formula runs in the parent."""
    worker = subprocess.run(
        [sys.executable, "-X", "importtime", "benchmarks/throughput.py", "--worker", "hf", "--device", "cpu",
         "--tiny", "--steps", "1", "--warmup", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert worker.returncode == 0 and "RESULT " in worker.stdout, worker.stderr[-3000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in worker.stderr.splitlines() if "|" in line}
    assert "transformers" in imported and not {"megatron.core", "transformer_engine"} & imported


def test_throughput_benchmark_prints_where_a_framework_failed(tmp_path):
    """A framework whose process fails keeps one line in the table, and its traceback's end goes
    to the output above it (on the H200 only the last line of a cuDNN error had come back)."""
    broken = tmp_path / "transformers"
    broken.mkdir()
    (broken / "__init__.py").write_text('raise ImportError("transformers broken on purpose")\n')
    result = subprocess.run(
        [sys.executable, "benchmarks/throughput.py", "--device", "cpu", "--tiny", "--steps", "1",
         "--warmup", "1", "--frameworks", "hf"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    tail = result.stdout.split("hf: its last lines:\n", 1)[1].split("\nhf: did not run")[0].splitlines()
    assert 1 < len(tail) <= 15 and tail[0].startswith("  ") and "run_hf" in "\n".join(tail), tail
    assert tail[-1] == "  ImportError: transformers broken on purpose"
    assert re.search(
        r"^hf\s+-.*did not run: ImportError: transformers broken on purpose$", result.stdout, re.M
    )


def test_preprocess_benchmark_prints_our_row(corpus):
    result = subprocess.run(
        [sys.executable, "benchmarks/preprocess_throughput.py", "--input", str(corpus["jsonl"]),
         "--tokenizer", str(corpus["tokenizer"]), "--workers", "1", "--repeats", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"^\s+1 ours\s+[\d.]+\s+\d+\s+\d+", result.stdout, re.MULTILINE), result.stdout
    for row in ("tokenizer", "whole texts"):
        assert re.search(rf"^\s+1 {row}\s+[\d.]+\s+\d+", result.stdout, re.MULTILINE), result.stdout


def test_gc_benchmark_sees_the_loop_collect_only_at_the_paced_steps(tmp_path, corpus):
    config = write_config(tmp_path / "cfg.yaml", corpus, tmp_path / "unused")
    result = subprocess.run(
        [sys.executable, "benchmarks/gc_pauses.py", "--steps", "5", "--interval", "2",
         "--config", str(config)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()[-2:]}
    # After the one full collection at the start, only steps 2 and 4 collect (generation 1).
    assert rows["paced"][3:6] == ["0", "2", "1"], result.stdout[-2000:]
    assert float(rows["automatic"][-1]) > 0 and float(rows["paced"][-1]) > 0


def test_convert_memory_benchmark_measures_both_directions(tmp_path):
    """Each conversion runs in a child of its own, started as the command line starts a tool."""
    result = subprocess.run(
        [sys.executable, "benchmarks/convert_memory.py", "--layers", "1", "--hidden", "128",
         "--shard-gib", "0.01", "--workdir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    for direction in ("import-hf", "export-hf"):
        assert re.search(rf"^{direction}: [\d.]+ s, peak RSS [\d.]+ GiB", result.stdout, re.MULTILINE), (
            result.stdout
        )
    assert not any(tmp_path.iterdir()), "its temporary folder is removed"


def test_gpu_session_plan_with_a_te_wheelhouse_builds_te_first_and_measures_its_row_first(tmp_path):
    """A wheelhouse built --with-te turns the GPU plan into Transformer Engine's: a longer install
    (the extension compiles there), the TE row in a step of its own before ours, no compiled rows."""
    session = load_tool("benchmarks/gpu_session.py")
    (tmp_path / "install.sh").write_text("")
    sdist = tmp_path / "transformer_engine_torch-2.11.0.tar.gz"
    sdist.write_bytes(b"")

    def frameworks(step) -> str:
        return step.argv[step.argv.index("--frameworks") + 1]

    steps = session.plan(cpu=False, out=tmp_path / "out", wheelhouse=tmp_path)
    names = [step.name for step in steps]
    # megatron-core imports here but TE's torch extension does not, so TE's install is planned.
    assert names == [
        "install", "cudnn_libraries", "throughput_te", "throughput_eager", "all_options", "te_all_options",
        "rope_compiled", "fused_loss", "smoke", "masked_attention_grad", "cross_entropy_memory",
    ]  # fmt: skip
    assert steps[0].cap_s > 240
    assert frameworks(steps[2]) == "ours-te" and frameworks(steps[3]) == "ours,hf"

    sdist.unlink()
    steps = session.plan(cpu=False, out=tmp_path / "out", wheelhouse=tmp_path)
    names = [step.name for step in steps]
    assert names == [
        "throughput_eager", "all_options", "compiled_all_options", "compiled_wgrad_fused", "profile",
        "throughput_compiled", "rope_compiled", "fused_loss", "smoke", "masked_attention_grad",
        "cross_entropy_memory",
    ]  # fmt: skip
    assert frameworks(steps[0]) == "ours,hf,torchtitan"
    assert "model.attention_backend=cudnn" in steps[1].argv and steps[1].argv.count("--set") == 3
    assert frameworks(steps[1]) == "ours,torchtitan" and "--micro-batch" in steps[1].argv
    # The compiled best beside torchtitan compiled, at the same micro-batch; then with the fusion.
    assert frameworks(steps[2]) == "ours,torchtitan" and "--compile" in steps[2].argv
    assert "model.attention_backend=cudnn" in steps[2].argv and "--micro-batch" in steps[2].argv
    assert "model.gradient_accumulation_fusion=true" in steps[3].argv and "--compile" in steps[3].argv
    assert steps[4].argv[-2:] == ["--profile", str(tmp_path / "out" / "profile")]


def test_cudnn_probe_runs_both_cases_where_there_is_no_cudnn():
    """benchmarks/cudnn_libraries.py on a CPU machine: each case's process runs and says what it
    found (no TE, no cuDNN mapped); on a GPU node the same lines name the cuDNN folders."""
    result = subprocess.run([sys.executable, "benchmarks/cudnn_libraries.py"], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    for case in ("shared", "unshared"):
        assert re.search(
            rf"^{case}: CUDNN_PATH=None, .*cuDNN loaded from 0 folder\(s\)$", result.stdout, re.M
        ), result.stdout


def _dry_run(out: Path, steps: list[str]) -> dict[str, str]:
    """The GPU plan's ``steps`` at the tiny shape on the CPU, as one call of a session runs them:
    each step's output in the one session log, each step ok in the summary."""
    result = subprocess.run(
        [sys.executable, "benchmarks/gpu_session.py", "--cpu", "--out", str(out), "--steps", ",".join(steps)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = (out / "summary.txt").read_text().splitlines()
    assert [line.split()[0] for line in summary] == steps and all(line.endswith(" ok") for line in summary)
    outputs = load_tool("benchmarks/gpu_session.py").step_outputs(out / "steps.log")
    assert list(outputs) == steps
    return outputs


def test_every_planned_throughput_step_parses_and_resolves_its_config(tmp_path, monkeypatch):
    """Each throughput step of the GPU plans (with and without a TE wheelhouse) and of the CPU dry
    run: its flags parse and its model config resolves and validates, at the shape it runs. The dry
    runs below run only the steps that reach code no other step reaches."""
    session, throughput = load_tool("benchmarks/gpu_session.py"), load_tool("benchmarks/throughput.py")
    # The install step's probes decide only whether that step is planned; it runs no benchmark.
    monkeypatch.setattr(session, "_imports", lambda module: True)
    (tmp_path / "transformer_engine_torch-2.11.0.tar.gz").write_bytes(b"")
    plans = [(True, tmp_path / "none"), (False, tmp_path / "none"), (False, tmp_path)]
    checked = set()
    for cpu, wheelhouse in plans:
        for step in session.plan(cpu=cpu, out=tmp_path / "out", wheelhouse=wheelhouse):
            if step.argv[1] != "benchmarks/throughput.py":
                continue
            args = throughput.build_parser().parse_args(step.argv[2:])
            assert args.tiny == cpu and args.device == ("cpu" if cpu else "cuda"), step
            throughput._check_experiment(throughput.shape(args), args)
            checked.add(step.name)
    assert {"rope_compiled", "fused_loss", "throughput_compiled", "te_all_options"} <= checked


# The plan in the two calls a session makes of it (README), one test each so that the two halves
# of the longest dry run run side by side. Each option alone and the compiled defaults are the
# all-options steps' code at fewer flags (their flags are checked above).
def test_gpu_session_dry_run_first_call_every_option_eager_and_compiled(tmp_path):
    """Every option at micro-batch 4 x 2, eager and compiled, with and without the fused
    weight-gradient accumulation."""
    steps = ["all_options", "compiled_all_options", "compiled_wgrad_fused"]
    outputs = _dry_run(tmp_path / "dry", steps)
    assert "micro-batch 4 x 2 accumulation" in outputs["all_options"]
    notes = "wgrad GEMMs accumulate into main_grad, model.rope_fusion=true, model.cross_entropy_fusion=true"
    assert notes in outputs["all_options"]
    # model.compile leaves the fusion off unless asked for it.
    assert "torch.compile" in outputs["compiled_all_options"]
    assert "main_grad" not in outputs["compiled_all_options"].split("framework")[-1]
    assert "torch.compile, wgrad GEMMs accumulate into main_grad" in outputs["compiled_wgrad_fused"]


def test_gpu_session_dry_run_second_call_profile_and_cross_entropy_and_a_spent_budget(tmp_path):
    """The profiler's table and trace, the cross-entropy benchmark's rows (one per mode); a spent
    budget skips every step."""
    steps = ["profile", "masked_attention_grad", "cross_entropy_memory"]
    outputs = _dry_run(tmp_path / "dry", steps)
    assert re.search(r"^ +704 auto +0 of 90,112$", outputs["masked_attention_grad"], re.M)
    table = (tmp_path / "dry" / "profile" / "ours.txt").read_text()
    assert re.match(r"per traced step: [\d.]+ ms wall\n", table) and "aten::mm" in table
    shares = [int(share) for share in re.findall(r"^[A-Za-z(), ]+ +[\d.]+ +(\d+)%$", table, re.M)]
    assert re.search(r"^matmul +[\d.]+ +\d+%$", table, re.M) and 96 <= sum(shares) <= 104, table
    assert re.search(r"^matmul rate: [\d.]+ TFLOP/s \([\d.e-]+ TFLOP a step\)$", table, re.M), table
    assert (tmp_path / "dry" / "profile" / "ours.json.gz").stat().st_size > 0
    cross_entropy = outputs["cross_entropy_memory"]
    for mode in ("megatron-core", "megatron fused, eager", "megatron fused, compiled", "ours, compiled"):
        assert re.search(rf"^{mode}\s+-?[\d,]+ MiB\s+-?[\d.]+\s+[\d.]+$", cross_entropy, re.MULTILINE), (
            cross_entropy
        )
    assert "device: cpu" in cross_entropy

    # --steps keeps the plan's named steps only, in the plan's order.
    spent = subprocess.run(
        [
            *(sys.executable, "benchmarks/gpu_session.py", "--cpu"),
            *("--out", str(tmp_path / "spent"), "--budget-s", "5", "--steps", "cross_entropy_memory,profile"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert spent.returncode == 1
    skipped = (tmp_path / "spent" / "summary.txt").read_text().splitlines()
    assert [line.split()[0] for line in skipped] == ["profile", "cross_entropy_memory"]
    assert all("skipped" in line for line in skipped)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["throughput.py", "--seq", "-5"], "argument --seq: '-5' is not a positive integer"),
        (["throughput.py", "--frameworks", "ours,megatron"], "unknown framework 'megatron'"),
        (["throughput.py", "--frameworks", "ours,hf,ours"], "'ours' is given twice"),
        (
            ["throughput.py", "--tiny", "--device", "cpu", "--set", "model.hidden_size=0"],
            "'model.hidden_size'",
        ),
        (["checkpoint_save.py", "--nproc", "2", "model.num_layers=-1"], "'model.num_layers'"),
        (["overhead.py", "--nproc", "0"], "argument --nproc: '0' is not a positive integer"),
        (["memory_model.py", "--preset", "llama9"], "unknown preset 'llama9'"),
        (["recompute_memory.py", "--preset", "tiny", "model.bogus=1"], "'model.bogus': unknown key"),
        (["cross_entropy_memory.py", "--repeats", "0"], "argument --repeats"),
        (
            ["gpu_session.py", "--cpu", "--out", "unmade", "--steps", "profile,bogus"],
            "--steps: 'bogus' is not",
        ),
        (["gpu_session.py", "--cpu", "--out", "unmade", "--budget-s", "0"], "argument --budget-s: '0'"),
        (["gpu_session.py", "--cpu", "--out", "README.md/logs"], "README.md is a file"),
        (["throughput.py", "--device", "cpu", "--tiny", "--profile", "README.md"], "'--profile'"),
        (
            ["throughput.py", "--device", "cpu", "--tiny", "--frameworks", "ours-te,torchtitan"],
            "none of them runs here (ours-te: Transformer Engine runs on CUDA only; torchtitan:",
        ),
        (["throughput.py", "--tiny", "--frameworks", "hf"], "'--device': no CUDA device"),
        (["convert_memory.py", "--workdir", "/nonexistent"], "--workdir: no folder"),
        (["preprocess_throughput.py", "--input", "missing.jsonl", "--tokenizer", "x"], "--input: no file"),
        (
            ["preprocess_throughput.py", "--input", "README.md", "--tokenizer", "README.md"],
            "'--input': README.md:1 is not JSON",
        ),
        (["cudnn_libraries.py", "--case"], "unexpected argument '--case'"),
    ],
)
def test_a_bad_benchmark_argument_is_one_error_line_before_anything_runs(argv, says):
    script, *args = argv
    # No GPU, as on the dev machine: --device cuda is then a bad input.
    result = subprocess.run(
        [sys.executable, f"benchmarks/{script}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], result.stderr[-2000:]
    assert result.stdout == ""
