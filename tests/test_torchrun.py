"""megatron_train.torchrun's exit code from torchrun's record of the failed ranks."""

from __future__ import annotations

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from megatron_train.torchrun import exit_code


def _failed(*codes: int) -> ChildFailedError:
    """Ranks 0, 1, ... failed in this order with these exit codes."""
    failures = {}
    for rank, code in enumerate(codes):
        failure = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=code, error_file="")
        failure.timestamp = rank
        failures[rank] = failure
    return ChildFailedError("megatron_train.train", failures)


@pytest.mark.parametrize(
    ("codes", "expected"),
    [
        ((2, 2), 2),  # every rank refused the config
        ((2, -15), 2),  # the first refused it; the agent ended the other with SIGTERM
        ((3, 3, -15), 3),  # stopped after the save
        ((2, 3), 1),  # ranks disagree
        ((-9, 2), 1),  # the first was killed (e.g. out of memory)
        ((1, -15), 1),  # training failed
    ],
)
def test_the_first_ranks_reported_code_is_the_launchers(codes, expected):
    assert exit_code(_failed(*codes)) == expected
