"""Run under torchrun: whether each ``checkpoint.fully_parallel_load`` value reads in parallel
over a group of every rank, for each placement given (rank i on the i-th node named, as Slurm
names nodes). Rank 0 prints one ``placement option -> bool`` line per case.

torchrun --nproc-per-node N tests/helpers/parallel_load_worker.py n1,n1 n1,n2 ...
"""

from __future__ import annotations

import argparse
import os

import torch.distributed as dist

from megatron_train.checkpoint.manager import reads_in_parallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("placements", nargs="+")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    group = dist.new_group(list(range(dist.get_world_size())))
    for placement in args.placements:
        os.environ["SLURMD_NODENAME"] = placement.split(",")[dist.get_rank()]
        for option in ("auto", True, False):
            decided = reads_in_parallel(option, group)
            if dist.get_rank() == 0:
                print(f"{placement} {option} -> {decided}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
