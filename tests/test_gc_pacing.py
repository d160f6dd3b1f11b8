"""train.gc_interval: automatic collection off in the step loop, collections at the same steps."""

from __future__ import annotations

import gc
import os

import pytest

from megatron_train.gc_pacing import GcPacing


@pytest.fixture
def collections():
    made: list[int] = []

    def record(phase: str, info: dict) -> None:
        if phase == "start":
            made.append(info["generation"])

    gc.callbacks.append(record)
    yield made
    gc.callbacks.remove(record)


def _cycles(n: int) -> None:
    for _ in range(n):
        a: list = []
        a.append(a)


def test_paced_collection_happens_only_after_every_nth_step_and_ends_with_the_loop(collections):
    assert gc.isenabled() and gc.get_freeze_count() == 0
    with GcPacing(3) as pacing:
        assert collections == [2], "everything built before the loop is collected once, then frozen"
        assert not gc.isenabled() and gc.get_freeze_count() > 0
        collections.clear()
        for step in range(1, 8):
            _cycles(5000)  # past the first generation's threshold many times over
            pacing.after_step(step)
            assert collections == [1] * (step // 3), step
        assert gc.collect() > 0, "the cycles after step 6 wait for the next paced collection"
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_interval_zero_leaves_automatic_collection_on(collections):
    with GcPacing(0) as pacing:
        _cycles(5000)
        pacing.after_step(1)
        assert gc.isenabled() and gc.get_freeze_count() == 0
    assert collections, "Python collected on its own"


def test_a_process_forked_in_the_loop_collects_automatically():
    with GcPacing(5):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(write, b"1" if gc.isenabled() else b"0")
            os._exit(0)
        os.waitpid(pid, 0)
        assert os.read(read, 1) == b"1"
        assert not gc.isenabled()
