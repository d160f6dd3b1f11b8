"""Write the Python standard library's own source files as a jsonl corpus (the demo's data).

Every machine with Python has these files, so the demo needs no download. The file appears only
once complete and never replaces an existing one. Exit codes: 0 done, 2 bad input.
"""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

# First: this checkout's package, which names a Python without the project's environment.
import use_checkout  # noqa: F401

# isort: split
from megatron_train import cli
from megatron_train.outputs import made_dir, output_prefix, publish


def write_corpus(output: str, max_files: int | None) -> None:
    out = output_prefix("--output", output, ("",))
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    written = 0
    with made_dir(out.parent):
        tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
        try:
            with open(tmp, "w") as f:
                for path in files[:max_files]:
                    try:
                        text = path.read_text(encoding="utf-8")
                    except (UnicodeDecodeError, OSError):
                        continue
                    f.write(json.dumps({"text": text, "path": str(path.relative_to(root))}) + "\n")
                    written += 1
            publish([(tmp, out)], "--output")
        finally:
            tmp.unlink(missing_ok=True)
    cli.say(f"wrote {written} files from {root} to {out}")


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(description=__doc__)
    parser.add_argument("--output", required=True, type=cli.non_empty, help="jsonl file to write")
    parser.add_argument("--max-files", type=cli.positive_int, default=None)
    args = parser.parse_args(argv)
    return cli.run(lambda: write_corpus(args.output, args.max_files))


if __name__ == "__main__":
    cli.exit_process(main())
