"""Preprocessing throughput: our tools/preprocess_data.py against Megatron-LM's, same input, same
tokenizer, same number of workers, in one run.

    python benchmarks/preprocess_throughput.py --input corpus.jsonl --tokenizer tok/spm.model \\
        [--tokenizer-type sentencepiece|huggingface] [--workers 1 2] [--repeats 3] [--megatron-lm PATH]

Each tool runs as its own process tree (Megatron-LM's from its own checkout, as it is; give the
path of one at the tag matching our megatron-core, e.g. core_v0.16.1); the figures are wall time,
documents per second and the peak resident memory of the whole tree, sampled every 20 ms. The two
tools take turns, ``--repeats`` times each, and the median time is shown: on a shared machine one
run can be several seconds off. A ``tokenizer`` row gives the encoding alone of the same texts
(in memory, no reading or writing), as our tool calls the tokenizer library: the floor under our
time. With SentencePiece a ``whole texts`` row gives the library's call on each whole text, as
Megatron-LM makes it (ours cuts long texts: megatron_train/sentencepiece_cuts.py). The token
files (.bin) are compared byte for byte; inputs holding special-token strings legitimately
differ (Megatron-LM reads them as special tokens, we read them as text). The .idx files differ
where the input has empty texts: Megatron-LM records each as a document of no sequences, we skip
it.
"""

from __future__ import annotations

import argparse
import filecmp
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megatron_train import cli  # noqa: E402
from megatron_train.text_sources import iter_texts  # noqa: E402

_MEGATRON_LM_TOKENIZER = {"sentencepiece": "SentencePieceTokenizer", "huggingface": "HuggingFaceTokenizer"}


def _tree_rss(process: psutil.Process) -> int:
    total = 0
    for p in [process, *process.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def timed(command: list[str], cwd: Path) -> tuple[float, int]:
    """Run ``command``; its wall time and the peak summed RSS of its process tree (bytes)."""
    start = time.perf_counter()
    child = subprocess.Popen(command, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    process, peak = psutil.Process(child.pid), 0
    while child.poll() is None:
        peak = max(peak, _tree_rss(process))
        time.sleep(0.02)
    elapsed = time.perf_counter() - start
    if child.returncode != 0:
        raise SystemExit(f"{command[1]} failed:\n{child.stderr.read()[-3000:]}")
    return elapsed, peak


# The encoding alone of the same texts, in memory, in the batches and threads our tool uses (or
# SentencePiece's own call on whole texts). Its own process, as a Hugging Face tokenizer's thread
# count is fixed once per process.
_TOKENIZER_ALONE = """
import sys, time
from pathlib import Path
import sentencepiece
from megatron_train.text_encoding import text_encoder
from megatron_train.text_sources import iter_texts
path, key, kind, tokenizer, workers, whole = sys.argv[1:]
texts = list(iter_texts([Path(path)], key))
if whole == "whole":
    processor = sentencepiece.SentencePieceProcessor(model_file=tokenizer)
    encode = lambda batch: processor.encode(batch, out_type=int, num_threads=int(workers))
else:
    encode = text_encoder(kind, tokenizer, int(workers)).encode
start = time.perf_counter()
for i in range(0, len(texts), 1024):
    encode(texts[i : i + 1024])
print(time.perf_counter() - start)
"""


def tokenizer_alone(args: argparse.Namespace, workers: int, whole: bool = False) -> float:
    """Seconds the encoding of the input's texts takes with ``workers`` threads: as our tool
    calls the library, or (SentencePiece) the library's call on each whole text."""
    command = [sys.executable, "-c", _TOKENIZER_ALONE, str(args.input), args.text_key, args.tokenizer_type,
               args.tokenizer, str(workers), "whole" if whole else "ours"]  # fmt: skip
    return float(subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True).stdout)


def count_documents(path: Path, key: str) -> int:
    """The number of ``path``'s non-empty texts; a file our tool would refuse is a ConfigError, as
    the tool reports it."""
    return sum(1 for _ in iter_texts([path], key))


def ours_command(args: argparse.Namespace, workers: int, prefix: Path) -> list[str]:
    return [sys.executable, "tools/preprocess_data.py", "--input", str(args.input),
            "--output-prefix", str(prefix), "--tokenizer-type", args.tokenizer_type,
            "--tokenizer", args.tokenizer, "--text-key", args.text_key,
            "--workers", str(workers)]  # fmt: skip


def megatron_lm_command(args: argparse.Namespace, workers: int, prefix: Path) -> list[str]:
    return [args.megatron_lm_python, "tools/preprocess_data.py", "--input", str(args.input),
            "--output-prefix", str(prefix), "--tokenizer-type", _MEGATRON_LM_TOKENIZER[args.tokenizer_type],
            "--tokenizer-model", args.tokenizer, "--json-keys", args.text_key, "--workers", str(workers),
            "--append-eod"]  # fmt: skip


def _summary(runs: list[tuple[float, int]]) -> tuple[float, int] | None:
    """The median time and the highest peak memory of a tool's runs."""
    if not runs:
        return None
    return statistics.median(t for t, _ in runs), max(peak for _, peak in runs)


def main() -> int:
    parser = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--input", required=True, type=Path, help="a jsonl file (Megatron-LM's format)")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--tokenizer-type", choices=sorted(_MEGATRON_LM_TOKENIZER), default="sentencepiece")
    parser.add_argument("--text-key", default="text")
    parser.add_argument("--workers", type=cli.positive_int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--repeats", type=cli.positive_int, default=3, help="runs of each tool; the median is shown"
    )
    parser.add_argument("--megatron-lm", type=Path, help="a Megatron-LM checkout to run its tool from")
    parser.add_argument(
        "--megatron-lm-python", default=sys.executable, help="the Python to run it (needs six, triton)"
    )
    args = parser.parse_args()
    if not args.input.is_file():
        parser.error(f"--input: no file {str(args.input)!r}")
    if not Path(args.tokenizer).exists():
        parser.error(f"--tokenizer: no file or folder {args.tokenizer!r}")
    if args.megatron_lm and not (args.megatron_lm / "tools" / "preprocess_data.py").is_file():
        parser.error(
            f"--megatron-lm: {str(args.megatron_lm)!r} is not a Megatron-LM checkout "
            "(no tools/preprocess_data.py)"
        )
    if args.megatron_lm and not args.input.name.endswith((".jsonl", ".json")):
        parser.error(f"--input: Megatron-LM's tool reads plain JSON lines, not {args.input.name!r}")
    return cli.run(lambda: measure(args))


def measure(args: argparse.Namespace) -> None:
    """Print each tool's time, rate and peak memory at each worker count; an input our tool would
    refuse ends here, before any tool runs, as the tool reports it."""
    docs = count_documents(args.input, args.text_key)
    # Megatron-LM's tool runs from its checkout.
    args.input, args.tokenizer = args.input.resolve(), str(Path(args.tokenizer).resolve())
    print(f"{args.input}: {docs:,} documents, {args.input.stat().st_size / 1e6:.1f} MB; "
          f"{args.tokenizer_type} tokenizer {args.tokenizer}")  # fmt: skip
    print(f"{'workers':>7} {'tool':12} {'seconds':>8} {'docs/s':>8} {'peak MiB':>9} {'vs Megatron-LM':>15}")
    with tempfile.TemporaryDirectory(prefix="preprocess-bench-") as scratch:
        for workers in args.workers:
            ours_prefix, theirs_prefix = (Path(scratch) / f"{who}-{workers}" for who in ("ours", "theirs"))
            runs: dict[str, list[tuple[float, int]]] = {"ours": [], "theirs": []}
            for _ in range(args.repeats):
                for suffix in (".bin", ".idx"):  # our tool never writes over an earlier dataset
                    Path(f"{ours_prefix}{suffix}").unlink(missing_ok=True)
                runs["ours"].append(timed(ours_command(args, workers, ours_prefix), ROOT))
                if args.megatron_lm:
                    command = megatron_lm_command(args, workers, theirs_prefix)
                    runs["theirs"].append(timed(command, args.megatron_lm))
            ours, theirs, same = _summary(runs["ours"]), _summary(runs["theirs"]), None
            if args.megatron_lm:
                written = Path(f"{theirs_prefix}_{args.text_key}_document")
                same = filecmp.cmp(f"{ours_prefix}.bin", f"{written}.bin", shallow=False)
            for tool, figures in (("ours", ours), ("Megatron-LM", theirs)):
                if figures is None:
                    continue
                seconds, peak = figures
                ratio = f"{theirs[0] / seconds:.2f}x" if theirs and tool == "ours" else ""
                rate, mib = docs / seconds, peak / 2**20
                print(f"{workers:>7} {tool:12} {seconds:8.1f} {rate:8.0f} {mib:9.0f} {ratio:>15}")
            alone = tokenizer_alone(args, workers)
            print(f"{workers:>7} {'tokenizer':12} {alone:8.1f} {docs / alone:8.0f}  (encoding only, 1 run)")
            if args.tokenizer_type == "sentencepiece":
                alone = tokenizer_alone(args, workers, whole=True)
                note = "(the library's call, 1 run)"
                print(f"{workers:>7} {'whole texts':12} {alone:8.1f} {docs / alone:8.0f}  {note}")
            if same is not None:
                print(f"{'':>7} tokens (.bin) byte-identical: {same}")


if __name__ == "__main__":
    sys.exit(main())
