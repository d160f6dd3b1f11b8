"""Training throughput on one device: megatron-train against torchtitan and a plain transformers loop.

    python benchmarks/throughput.py [--frameworks ours,ours-te,torchtitan,hf] [--steps 20] [--warmup 5]
        [--micro-batch 2] [--grad-accum 4] [--seq 4096] [--compile] [--profile DIR]
    python benchmarks/throughput.py --device cpu --tiny        # a dry run of every code path

The model is torchtitan's Llama-3 "1B" flavour, Llama-3.2-1B's shape (16 layers x 2048, GQA 32/8,
SwiGLU 8192, vocab 128256, tied embeddings, RoPE theta 500000), built by each framework in bf16 mixed
precision (fp32 master weights and gradient reduction, bf16 compute) and trained on random tokens
with AdamW. Each framework runs in its own process so memory peaks do not mix. One table prints
tokens/s, TFLOP/s, MFU, peak memory and parameter count; every framework's TFLOP/s uses the
training log's count (``megatron_train.metrics.flops_per_token``: causal attention counted half, as
Megatron-LM does). A framework that cannot run in this command (torchtitan and the Transformer
Engine spec need CUDA and their package) gets a row saying why; when none of those asked for can,
or ``--device cuda`` finds no GPU, it stops with one error line before anything runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_train import cli  # noqa: E402

# torchtitan 0.3's llama3 "1B": ffn = 1024 * ceil(int(1.5 * int(2 * 4 * 2048 / 3)) / 1024) = 8192.
LLAMA3_1B = dict(num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=32,
                 num_query_groups=8, vocab_size=128256, rotary_base=500000, seq=4096)  # fmt: skip
TINY = dict(num_layers=2, hidden_size=128, ffn_hidden_size=384, num_attention_heads=4,
            num_query_groups=2, vocab_size=1024, rotary_base=500000, seq=128)  # fmt: skip
FRAMEWORKS = ("ours", "ours-te", "torchtitan", "hf")
RESULT = "RESULT "
FAILED_LINES = 15
"""How much of a failed framework's output is printed: a traceback's last frames and its error."""


def experiment(m: dict, args, te: bool = False):
    """The benchmark model and batch as our typed config: ours trains it, every row counts its FLOPs."""
    from megatron_train.resolve import build_config

    model = {k: v for k, v in m.items() if k != "seq"}
    raw = {
        "model": {**model, "max_position_embeddings": m["seq"], "tie_embeddings": True,
                  "transformer_impl": "transformer_engine" if te else "local",
                  # Transformer Engine fuses its own kernels: --compile compiles the local layers.
                  "compile": args.compile and not te},
        "data": {"seq_length": m["seq"]},
        "train": {"micro_batch_size": args.micro_batch, "steps": args.warmup + args.steps,
                  "global_batch_size": args.micro_batch * args.grad_accum,
                  "precision": "bf16" if args.device == "cuda" else "fp32"},
        "optimizer": {"lr": 1e-4, "warmup_steps": 0},
    }  # fmt: skip
    return build_config(raw, args.set)


def _check_experiment(m: dict, args) -> None:
    from megatron_train.config_checks import validate_options

    validate_options(experiment(m, args), 1)


def _timed(step, steps: int, warmup: int, sync, prof=None) -> list[float]:
    times = []
    for i in range(warmup + steps):
        sync()
        start = time.perf_counter()
        step()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
        if prof is not None:
            prof.step()
    return times


def _report(name: str, times: list[float], args, m: dict, peak_gib: float, params: int, note: str) -> None:
    # FLOPs are counted in the parent (our formula imports megatron-core, and with it Transformer
    # Engine where installed): the transformers and torchtitan processes never load either.
    step = statistics.median(times)
    tokens = args.micro_batch * args.grad_accum * m["seq"]
    record = dict(framework=name, step_s=step, tokens_per_s=tokens / step, peak_mem_gib=peak_gib, note=note,
                  params=params)  # fmt: skip
    print(RESULT + json.dumps(record), flush=True)


def _peak_allocated_gib() -> float:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


def _random_batches(m: dict, seq: int, micro_batch: int, count: int = 4):
    import torch

    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, m["vocab_size"], (micro_batch, seq + 1), generator=gen) for _ in range(count)]


def run_ours(args, m: dict, te: bool) -> None:
    import torch

    from megatron_train import runtime
    from megatron_train.config_checks import validate_options
    from megatron_train.model import build_model
    from megatron_train.optim import build_optimizer
    from megatron_train.step import Stepper

    on_gpu = torch.cuda.is_available()
    cfg = experiment(m, args, te)
    validate_options(cfg, 1)
    rt = runtime.initialize(cfg, runtime.launch_env())
    chunks = build_model(cfg, rt)
    optimizer, scheduler = build_optimizer(cfg, chunks, rt.dtype)
    stepper = Stepper(cfg, chunks, optimizer, scheduler, rt.device)
    pool = _random_batches(m, m["seq"], args.micro_batch)
    positions = torch.arange(m["seq"]).expand(args.micro_batch, m["seq"])

    def batches():
        i = 0
        while True:
            tokens = pool[i % len(pool)]
            i += 1
            yield {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "position_ids": positions,
                   "loss_mask": torch.ones(args.micro_batch, m["seq"])}  # fmt: skip

    data = [batches()]
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    with _profiler(args, "ours-te" if te else "ours") as prof:
        times = _timed(lambda: stepper.train_step(data), args.steps, args.warmup, sync, prof)
    _report(
        "ours-te" if te else "ours",
        times,
        args,
        m,
        _peak_allocated_gib(),
        sum(p.numel() for chunk in chunks for p in chunk.parameters()),
        "megatron-core GPTModel, "
        + ("Transformer Engine spec" if te else "local spec (SDPA)")
        + (", torch.compile" if cfg.model.compile else "")
        + (", wgrad GEMMs accumulate into main_grad" if chunks[0].config.gradient_accumulation_fusion else "")
        + "".join(f", {x}" for x in args.set),
    )
    runtime.shutdown()


def run_hf(args, m: dict) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = LlamaConfig(
        vocab_size=m["vocab_size"], hidden_size=m["hidden_size"], intermediate_size=m["ffn_hidden_size"],
        num_hidden_layers=m["num_layers"], num_attention_heads=m["num_attention_heads"],
        num_key_value_heads=m["num_query_groups"], max_position_embeddings=m["seq"],
        rope_theta=m["rotary_base"], tie_word_embeddings=True, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device)
    if args.compile:
        model = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    pool = [b.to(device) for b in _random_batches(m, m["seq"], args.micro_batch)]
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step():
        for i in range(args.grad_accum):
            tokens = pool[i % len(pool)]
            with amp:
                loss = model(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss / args.grad_accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with _profiler(args, "hf") as prof:
        times = _timed(step, args.steps, args.warmup, sync, prof)
    _report("hf", times, args, m, _peak_allocated_gib(), sum(p.numel() for p in model.parameters()),
            "transformers LlamaForCausalLM (SDPA) + "
            + ("fused AdamW, autocast bf16" if device.type == "cuda" else "AdamW, fp32")
            + (", torch.compile" if args.compile else ""))  # fmt: skip


def _profiler(args, name: str):
    import contextlib

    import torch

    if not args.profile:
        return contextlib.nullcontext()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    out = Path(args.profile)
    out.mkdir(parents=True, exist_ok=True)

    def done(prof):
        prof.export_chrome_trace(str(out / f"{name}.json.gz"))
        events = prof.key_averages()
        gpu = torch.cuda.is_available()
        sort = "self_cuda_time_total" if gpu else "self_cpu_time_total"
        (out / f"{name}.txt").write_text(
            "\n".join(
                [
                    _busy_line(events, gpu),
                    *_time_by_kind(events, gpu),
                    events.table(sort_by=sort, row_limit=40),
                ]
            )
        )

    # Trace two steps after the warm-up; the timings of traced steps are not reported as figures.
    # with_flops: torch counts each matmul operator's FLOPs, so the matmul kernels' rate is known.
    schedule = torch.profiler.schedule(wait=0, warmup=args.warmup, active=2, repeat=1)
    return torch.profiler.profile(
        activities=activities, schedule=schedule, on_trace_ready=done, with_flops=True
    )


def _traced(events, gpu: bool) -> tuple[int, list[tuple[str, float]]]:
    """How many steps the trace holds, and each kernel's own time in microseconds (on the CPU,
    each operator's), summed over them. Kernel rows only, as the table's own total counts them:
    an operator's row repeats its kernels' time."""
    from torch.autograd import DeviceType

    steps = max(1, sum(e.count for e in events if e.key.startswith("ProfilerStep")))
    if gpu:
        return steps, [(e.key, e.self_device_time_total) for e in events
                       if e.device_type == DeviceType.CUDA and not e.is_user_annotation]  # fmt: skip
    return steps, [(e.key, e.self_cpu_time_total) for e in events if e.key.startswith("aten::")]


def _busy_line(events, gpu: bool) -> str:
    """How much of a traced step the GPU spent in kernels: far under 100 % means the host (Python,
    launches, synchronisations) holds the GPU back, not the kernels."""
    steps, kernels = _traced(events, gpu)
    wall_ms = sum(e.cpu_time_total for e in events if e.key.startswith("ProfilerStep")) / steps / 1e3
    line = f"per traced step: {wall_ms:.1f} ms wall"
    if gpu and wall_ms:
        kernels_ms = sum(us for _, us in kernels) / steps / 1e3
        line += f", {kernels_ms:.1f} ms of GPU kernels ({100 * kernels_ms / wall_ms:.0f} %)"
    return line


KERNEL_KINDS = (
    ("attention", r"flash|fmha|attention|sdpa"),
    ("matmul", r"gemm|nvjet|cutlass|xmma|cublas|^aten::(mm|addmm|bmm|baddbmm)$"),
    ("optimizer", r"multi_tensor|adam"),
    ("norm", r"rms_?norm|layer_?norm"),
    ("compiled (Triton)", r"^triton_"),
    ("copy, cast, fill", r"memcpy|memset|copy|^aten::(cat|to|_to_copy|fill_|zero_|clone|contiguous)$"),
    ("reduction", r"reduce|^aten::(sum|amax|max|mean|norm)$"),
)
"""Kernel kinds by the first pattern a kernel's name (on the CPU, an operator's) matches, in this
order (flash attention's kernels are CUTLASS ones); what matches none is elementwise and other work."""
MATMUL_OPERATORS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def _time_by_kind(events, gpu: bool) -> list[str]:
    """A traced step's kernel time by kind, the largest first, and the rate of its matmuls (the
    FLOPs torch counted for the matmul operators over the matmul kernels' time): what bounds MFU,
    and how far the rest of the step keeps it from the matmuls' rate."""
    import re

    steps, timed = _traced(events, gpu)
    by_kind: dict[str, float] = {}
    for key, us in timed:
        kind = next((k for k, pattern in KERNEL_KINDS if re.search(pattern, key, re.I)), "elementwise, other")
        by_kind[kind] = by_kind.get(kind, 0.0) + us / steps / 1e3
    total = sum(by_kind.values()) or 1.0
    lines = [f"{'kernel time by kind':<22} {'ms/step':>9} {'share':>6}"]
    lines += [f"{kind:<22} {ms:>9.1f} {100 * ms / total:>5.0f}%" for kind, ms in
              sorted(by_kind.items(), key=lambda item: -item[1])]  # fmt: skip
    matmul_ms = by_kind.get("matmul", 0.0)
    flops = sum(e.flops for e in events if e.key in MATMUL_OPERATORS) / steps
    if matmul_ms and flops:
        lines.append(
            f"matmul rate: {flops / (matmul_ms / 1e3) / 1e12:.1f} TFLOP/s ({flops / 1e12:.3g} TFLOP a step)"
        )
    return lines


# torchtitan 0.3 reads its Trainer config from a Python module: this one is written to a scratch dir.
TITAN_CONFIG = """
import os

from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import default_adamw
from torchtitan.config import CompileConfig, TrainingConfig
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.models.llama3 import model_registry
from torchtitan.trainer import Trainer


def bench() -> Trainer.Config:
    spec = model_registry("1B", attn_backend=os.environ["BENCH_ATTN"])
    mb, accum = int(os.environ["BENCH_MICRO_BATCH"]), int(os.environ["BENCH_ACCUM"])
    return Trainer.Config(
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec))),
        hf_assets_path=os.environ["BENCH_TOKENIZER"],
        model_spec=spec,
        optimizer=default_adamw(lr=1e-4),
        training=TrainingConfig(local_batch_size=mb, global_batch_size=mb * accum,
                                seq_len=int(os.environ["BENCH_SEQ"]), steps=int(os.environ["BENCH_STEPS"])),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=os.environ["BENCH_DATA"]),
        metrics=MetricsProcessor.Config(log_freq=1),
        activation_checkpoint=None,
        compile=CompileConfig(enable=os.environ["BENCH_COMPILE"] == "1"),
        dump_folder=os.environ["BENCH_DUMP"],
    )
"""

# torchtitan 0.2 takes its options on the command line and its llama3 has no "1B" flavour: this
# module, imported through --experimental.custom_import, registers the benchmark's shape as "bench".
TITAN_02_FLAVOUR = """
import json
import os

from torchtitan.models.llama3 import TransformerModelArgs, llama3_args

m = json.loads(os.environ["BENCH_MODEL"])
# With multiple_of set to the FFN width, torchtitan rounds int(8 * dim / 3) up to exactly that width.
llama3_args["bench"] = TransformerModelArgs(
    dim=m["hidden_size"], n_layers=m["num_layers"], n_heads=m["num_attention_heads"],
    n_kv_heads=m["num_query_groups"], vocab_size=m["vocab_size"], multiple_of=m["ffn_hidden_size"],
    rope_theta=m["rotary_base"], attn_type=os.environ["BENCH_ATTN"],
)
"""


def titan_02_argv(args, m: dict, tok_dir: Path, data_dir: Path, dump: Path) -> list[str]:
    """torchtitan 0.2's command line for the benchmark run (the flavour module must be importable)."""
    if int(8 * m["hidden_size"] / 3) > m["ffn_hidden_size"]:
        raise SystemExit("torchtitan 0.2 cannot build an FFN narrower than 8/3 x hidden")
    mb = args.micro_batch
    argv = ["--model.name", "llama3", "--model.flavor", "bench",
            "--experimental.custom_import", "titan_bench", "--model.hf_assets_path", str(tok_dir),
            "--training.dataset", "c4_test",
            "--training.dataset_path", str(data_dir), "--training.local_batch_size", str(mb),
            "--training.global_batch_size", str(mb * args.grad_accum), "--training.seq_len", str(m["seq"]),
            "--training.steps", str(args.warmup + args.steps), "--optimizer.lr", "1e-4",
            "--metrics.log_freq", "1", "--activation_checkpoint.mode", "none",
            "--job.dump_folder", str(dump)]  # fmt: skip
    return argv + (["--compile.enable"] if args.compile else [])


def _titan_inputs(scratch: Path) -> tuple[Path, Path]:
    """A word-level tokenizer and a jsonl corpus of random words: torchtitan's loader needs both."""
    import random

    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(8000)]
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + words)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tok_dir, data_dir = scratch / "tokenizer", scratch / "c4_test"
    tok_dir.mkdir(parents=True)
    data_dir.mkdir(parents=True)
    tokenizer.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {"bos_token": specials[0], "eos_token": specials[1], "tokenizer_class": "PreTrainedTokenizerFast"}
        )
    )
    rng = random.Random(0)
    with open(data_dir / "train.json", "w") as out:
        for _ in range(2000):
            out.write(json.dumps({"text": " ".join(rng.choices(words, k=600))}) + "\n")
    return tok_dir, data_dir


def _titan_release() -> tuple[str, tuple[int, int]]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("torchtitan")
    except PackageNotFoundError:
        raise SystemExit("torchtitan is not installed") from None
    major, minor = (int(part) for part in found.split(".")[:2])
    return found, (major, minor)


def run_titan(args, m: dict) -> None:
    import re

    release, version = _titan_release()
    scratch = Path(tempfile.mkdtemp(prefix="titan-bench-"))
    tok_dir, data_dir = _titan_inputs(scratch)
    # 0.3 needs torch >= 2.12 (torch.distributed.fsdp.DataParallelMeshDims); 0.2.2 runs on torch 2.11.
    if version >= (0, 3):
        (scratch / "titan_bench.py").write_text(TITAN_CONFIG)
        options = ["--module", "titan_bench", "--config", "bench"]
        attention = args.titan_attention or "flex"
        how = "FSDP2 mixed precision (bf16 compute, fp32 master), tied embeddings"
    else:
        (scratch / "titan_bench.py").write_text(TITAN_02_FLAVOUR)
        options = titan_02_argv(args, m, tok_dir, data_dir, scratch / "out")
        attention = args.titan_attention or "sdpa"
        how = "autocast bf16 (fp32 weights), untied output layer (0.2 has no weight tying)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(scratch), os.environ.get("PYTHONPATH", "")]),
           "BENCH_TOKENIZER": str(tok_dir), "BENCH_DATA": str(data_dir), "BENCH_DUMP": str(scratch / "out"),
           "BENCH_MICRO_BATCH": str(args.micro_batch), "BENCH_ACCUM": str(args.grad_accum),
           "BENCH_SEQ": str(m["seq"]), "BENCH_STEPS": str(args.warmup + args.steps),
           "BENCH_MODEL": json.dumps(m), "BENCH_COMPILE": "1" if args.compile else "0",
           "BENCH_ATTN": attention}  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           "-m", "torchtitan.train", *options]  # fmt: skip
    proc = subprocess.run(
        cmd, env=env, cwd=scratch, capture_output=True, text=True, timeout=args.titan_timeout
    )
    log = proc.stdout + proc.stderr
    if args.log_dir:
        Path(args.log_dir, "torchtitan_trainer.log").write_text(log)
    if proc.returncode != 0:
        raise SystemExit(f"torchtitan {release} failed: " + " | ".join(log.strip().splitlines()[-3:]))
    ansi = re.compile(r"\x1b\[[0-9;]*m")
    steps, mem, params = {}, 0.0, 0
    for line in map(lambda s: ansi.sub("", s), log.splitlines()):
        found = re.search(r"step:\s*(\d+).*memory:\s*([\d.]+)GiB.*tps:\s*([\d,]+)", line)
        if found:
            steps[int(found[1])] = float(found[3].replace(",", ""))
            mem = max(mem, float(found[2]))
        size = re.search(r"size: ([\d,]+) total parameters", line)
        if size:
            params = int(size[1].replace(",", ""))
    tps = [v for k, v in steps.items() if k > args.warmup]
    if not tps:
        raise SystemExit("torchtitan printed no step lines after the warm-up")
    tokens = args.micro_batch * args.grad_accum * m["seq"]
    note = f"torchtitan {release} Trainer, {how}, {attention} attention"
    note += (", torch.compile" if args.compile else "") + "; memory is its max reserved"
    _report("torchtitan", [tokens / t for t in tps], args, m, mem, params, note)


def cannot_run_here(name: str, args) -> str | None:
    """Why ``name`` cannot run in this command, where that is known before its process starts."""
    if name == "torchtitan":
        if args.device == "cpu":
            return "torchtitan runs on CUDA only"
        if args.tiny:
            return "torchtitan runs the 1B model only (not --tiny)"
        if importlib.util.find_spec("torchtitan") is None:
            return "torchtitan is not installed"
    elif name == "ours-te":
        if args.device == "cpu":
            return "Transformer Engine runs on CUDA only"
        if importlib.util.find_spec("transformer_engine") is None:
            return "Transformer Engine is not installed"
    return None


def _check_here(args) -> None:
    """What this machine and file system must offer before any framework's process starts."""
    import torch

    from megatron_train.errors import ConfigError
    from megatron_train.outputs import check_output_dir

    # A CPU build of torch would otherwise run the rows on the CPU and print them as the GPU's.
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "--device", "no CUDA device on this machine",
            "run it on a GPU node, or dry-run it here with --device cpu --tiny",
        )  # fmt: skip
    for key, path in (("--profile", args.profile), ("--log-dir", args.log_dir)):
        if path is not None:
            check_output_dir(key, Path(path))


def worker(args) -> None:
    m = shape(args)
    if args.worker == "ours":
        run_ours(args, m, te=False)
    elif args.worker == "ours-te":
        from megatron_train.model import transformer_engine_available

        if not transformer_engine_available():
            raise SystemExit("Transformer Engine is not installed (or no GPU)")
        run_ours(args, m, te=True)
    elif args.worker == "torchtitan":
        run_titan(args, m)
    else:
        run_hf(args, m)


def _table(results: dict[str, dict | str], peak: float | None, m: dict, args) -> str:
    from megatron_train.metrics import flops_per_token

    per_token = flops_per_token(experiment(m, args))
    lines = [
        f"model: Llama-3 {'tiny' if args.tiny else '1B'} ({m['num_layers']}x{m['hidden_size']}, GQA "
        f"{m['num_attention_heads']}/{m['num_query_groups']}, SwiGLU {m['ffn_hidden_size']}, vocab "
        f"{m['vocab_size']}), seq {m['seq']}, micro-batch {args.micro_batch} x {args.grad_accum} "
        f"accumulation, median of {args.steps} steps after {args.warmup}",
        "FLOPs/token = 3 x forward matmuls, causal attention counted half (Megatron-LM): "
        f"{per_token / 1e9:.2f} GFLOP; MFU against "
        + (f"{peak:.0f} TFLOP/s dense bf16" if peak else "no known peak"),
        f"{'framework':<12} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>9} {'params':>9}  notes",
    ]
    for name, r in results.items():
        if isinstance(r, str):
            lines.append(f"{name:<12} {'-':>10} {'-':>8} {'-':>6} {'-':>9} {'-':>9}  {r}")
            continue
        tflops = r["tokens_per_s"] * per_token / 1e12
        mfu = f"{100 * tflops / peak:.1f}%" if peak else "-"
        lines.append(f"{name:<12} {r['tokens_per_s']:>10,.0f} {tflops:>8.1f} {mfu:>6} "
                     f"{r['peak_mem_gib']:>9.1f} {r['params'] / 1e6:>8.1f}M  {r['note']}")  # fmt: skip
    # The goals are ratios of tokens/s: computed here rather than by hand from the rows.
    ran = {name: r["tokens_per_s"] for name, r in results.items() if isinstance(r, dict)}
    ratios = [f"{a} / {b} {ran[a] / ran[b]:.2f}x" for a in ("ours", "ours-te") for b in ("torchtitan", "hf")
              if a in ran and b in ran]  # fmt: skip
    if ratios:
        lines.append("tokens/s: " + ", ".join(ratios))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS), help="comma-separated subset of "
                        + ", ".join(FRAMEWORKS))  # fmt: skip
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model at seq 128 (dry run)")
    parser.add_argument("--steps", type=cli.positive_int, default=20)
    parser.add_argument("--warmup", type=cli.non_negative_int, default=5)
    parser.add_argument("--seq", type=cli.positive_int, default=4096)
    parser.add_argument("--micro-batch", type=cli.positive_int, default=2)
    parser.add_argument("--grad-accum", type=cli.positive_int, default=4)
    parser.add_argument(
        "--compile", action="store_true", help="torch.compile: our local layers, torchtitan's, the hf model"
    )
    parser.add_argument(
        "--titan-attention",
        help="torchtitan's attention (default: its release's own, flex for 0.3, sdpa for 0.2)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        help="a config override for ours, e.g. model.attention_backend=cudnn (repeatable)",
    )
    parser.add_argument(
        "--titan-timeout", type=cli.positive_float, default=600, help="seconds torchtitan may take"
    )
    parser.add_argument("--profile", help="write a torch profiler trace of two steps per framework here")
    parser.add_argument("--log-dir", help="keep each framework's full output here")
    parser.add_argument("--worker", choices=FRAMEWORKS, help=argparse.SUPPRESS)
    return parser


def shape(args) -> dict:
    """The benchmark model and sequence that ``args`` ask for."""
    return TINY if args.tiny else {**LLAMA3_1B, "seq": args.seq}


def main() -> int:
    parser = build_parser()
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    names = args.frameworks.split(",")
    if unknown := [name for name in names if name not in FRAMEWORKS]:
        parser.error(f"--frameworks: unknown framework {unknown[0]!r}; choose from {', '.join(FRAMEWORKS)}")
    if twice := [name for i, name in enumerate(names) if name in names[:i]]:
        parser.error(f"--frameworks: {twice[0]!r} is given twice (its table has one row each)")
    m = shape(args)
    # A bad --set, shape or output path is one line here, not a traceback in each framework's process.
    if code := cli.run(lambda: (_check_here(args), _check_experiment(m, args))):
        return code
    skipped = {name: reason for name in names if (reason := cannot_run_here(name, args))}
    if len(skipped) == len(names):
        cli.report(
            "--frameworks: none of them runs here ("
            + "; ".join(f"{name}: {reason}" for name, reason in skipped.items())
            + "). Fix: add ours or hf, or run it on a GPU node that has what is missing"
        )
        return cli.EXIT_BAD_INPUT
    env = dict(os.environ)
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    results: dict[str, dict | str] = {}
    forwarded = sys.argv[1:]
    for name in names:
        if name in skipped:
            results[name] = f"did not run: {skipped[name]}"
            print(f"{name}: {results[name]}", flush=True)
            continue
        proc = subprocess.run([sys.executable, __file__, "--worker", name, *forwarded], env=env,
                              capture_output=True, text=True)  # fmt: skip
        if args.log_dir:
            Path(args.log_dir, f"{name}.log").write_text(proc.stdout + proc.stderr)
        found = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
        if proc.returncode == 0 and found:
            results[name] = json.loads(found[-1][len(RESULT) :])
        else:
            tail = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()
            results[name] = f"did not run: {tail[-1][:200]}"
            # The row keeps one line; where it failed (the traceback's end) goes to the log above it.
            if len(tail) > 1:
                print(f"{name}: its last lines:", *(f"  {line}" for line in tail[-FAILED_LINES:]), sep="\n")
        print(f"{name}: {results[name] if isinstance(results[name], str) else 'done'}", flush=True)
    peak = None
    if args.device == "cuda":
        import torch

        from megatron_train.metrics import peak_tflops

        peak = peak_tflops()
        if torch.cuda.is_available():
            print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(_table(results, peak, m, args))
    return 0 if any(isinstance(r, dict) for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
