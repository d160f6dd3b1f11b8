"""Join megatron indexed datasets into one (PREFIX.bin + PREFIX.idx), in the order given.

    python tools/merge_datasets.py --input data/shards --output-prefix data/corpus
    python tools/merge_datasets.py --input data/a data/b --output-prefix data/ab

``--input`` takes dataset prefixes and folders (every dataset in a folder, in sorted order, as
``tools/preprocess_data.py --output-dir`` writes them). Every dataset is checked first (its
.idx header and every entry), and all must hold the same token type. Documents keep their order
and boundaries, so the result is what tokenizing the inputs into one dataset gives. It is
written with megatron-core's IndexedDatasetBuilder under temporary names and renamed once
complete (the .idx last). Exit codes: 0 done, 2 bad input.
"""

from __future__ import annotations

import argparse
from pathlib import Path

# First: this checkout's package, which names a Python without the project's environment.
import use_checkout  # noqa: F401

# isort: split
from megatron_train import cli
from megatron_train.errors import ConfigError
from megatron_train.inputs import check_indexed_dataset
from megatron_train.outputs import dataset_files, made_dir, output_prefix


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--input", type=cli.non_empty, required=True, nargs="+", help="dataset prefixes or folders of them"
    )
    parser.add_argument("--output-prefix", type=cli.non_empty, required=True)
    args = parser.parse_args(argv)
    return cli.run(lambda: merge(args))


def dataset_prefixes(specs: list[str]) -> list[str]:
    """The datasets ``specs`` name: prefixes as given, and each ``*.idx`` in a folder (sorted).
    A dataset named twice (a folder and one of its datasets, say) is merged once, where it first
    appears, as tools/preprocess_data.py reads a file named twice once."""
    prefixes: dict[Path, str] = {}
    for spec in specs:
        if Path(spec).is_dir():
            found = sorted(str(p.with_suffix("")) for p in Path(spec).glob("*.idx"))
            if not found:
                raise ConfigError(
                    "--input", f"{spec} holds no .idx/.bin dataset", "point it at preprocessed data"
                )
        else:
            found = [spec]
        for prefix in found:
            prefixes.setdefault(Path(prefix).resolve(), prefix)
    return list(prefixes.values())


def merge(args: argparse.Namespace) -> None:
    # Imported only after megatron_train, whose import silences megatron-core's start-up notes
    # (a merge on a CPU node would print them above every line).
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    out = output_prefix("--output-prefix", args.output_prefix, (".bin", ".idx"))
    prefixes = dataset_prefixes(args.input)
    # Every entry too: megatron-core's builder copies them unchecked, so a damaged input would
    # make a damaged output (the merge reads them all anyway).
    dtypes = {prefix: check_indexed_dataset(prefix, key="--input", entries=True) for prefix in prefixes}
    if len(set(dtypes.values())) > 1:
        found = ", ".join(f"{p}: {d}" for p, d in dtypes.items())
        raise ConfigError(
            "--input", f"the datasets hold different token types ({found})", "merge like with like"
        )
    with made_dir(out.parent), dataset_files(out, "--output-prefix") as (tmp_bin, tmp_idx):
        builder = IndexedDatasetBuilder(str(tmp_bin), dtype=next(iter(dtypes.values())).type)
        for prefix in prefixes:
            builder.add_index(prefix)
        builder.finalize(str(tmp_idx))
    cli.say(f"wrote {out}.bin/.idx from {len(prefixes)} dataset(s)")


if __name__ == "__main__":
    cli.exit_process(main())
