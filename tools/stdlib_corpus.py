"""Write the Python standard library's own source files as a jsonl corpus (the demo's data).

Every machine with Python has these files, so the demo needs no download.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output", required=True, help="jsonl file to write")
    parser.add_argument("--max-files", type=int, default=None)
    args = parser.parse_args(argv)
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with open(out.with_suffix(".tmp"), "w") as f:
        for path in files[: args.max_files]:
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            f.write(json.dumps({"text": text, "path": str(path.relative_to(root))}) + "\n")
            written += 1
    out.with_suffix(".tmp").replace(out)
    print(f"wrote {written} files from {root} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
