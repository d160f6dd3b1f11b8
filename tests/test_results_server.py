"""The server megatron's async checkpoint writer reports through: a forked writer's results reach
the training process, the server stays light (no torch), survives stop signals, ends with its parent."""

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import torch
from megatron.core.dist_checkpointing.strategies import filesystem_async

from megatron_train.checkpoint import results_server
from megatron_train.checkpoint.manager import Checkpointer
from megatron_train.config import ExperimentConfig
from tests.conftest import ROOT


def test_a_forked_writers_results_reach_the_parent_and_the_server_never_loads_torch():
    server = results_server.start((signal.SIGTERM, signal.SIGINT))
    try:
        queue = server.queue()
        results = {"bucket": [torch.arange(4)], "rank": 3}
        writer = multiprocessing.get_context("fork").Process(target=queue.put, args=(results,))
        writer.start()
        writer.join(timeout=60)
        assert writer.exitcode == 0
        got = queue.get_nowait()
        assert got["rank"] == 3 and torch.equal(got["bucket"][0], torch.arange(4))

        pid = server.pid
        assert "libtorch" not in Path(f"/proc/{pid}/maps").read_text()
        os.kill(pid, signal.SIGTERM)  # what torchrun sends the whole process group to save and stop
        time.sleep(0.5)
        assert server.running()
    finally:
        server.stop()


def test_the_server_ends_with_a_parent_that_was_killed():
    code = (
        "import signal, time; from megatron_train.checkpoint import results_server; "
        "s = results_server.start((signal.SIGTERM,)); print(s.pid, flush=True); time.sleep(600)"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    server = psutil.Process(int(parent.stdout.readline()))
    parent.kill()
    parent.wait()
    server.wait(timeout=10)  # psutil.TimeoutExpired if it outlived its parent


def test_a_stop_signal_while_the_server_starts_does_not_end_it(monkeypatch):
    """A save-and-stop signal sent to the process group as the server's interpreter starts, before
    it ignores the signal: it waits, blocked, instead of ending the server (whose start then
    failed with a traceback)."""
    popen = subprocess.Popen

    def signalled_at_start(*args, **kwargs):
        process = popen(*args, **kwargs)
        os.kill(process.pid, signal.SIGTERM)
        return process

    monkeypatch.setattr(results_server.subprocess, "Popen", signalled_at_start)
    server = results_server.start((signal.SIGTERM, signal.SIGINT))
    try:
        assert server.running()
        assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])  # ours is unchanged
    finally:
        server.stop()


def test_the_checkpointer_starts_the_server_before_it_returns_and_in_its_callers_thread(monkeypatch):
    """Started in a thread of its own while the data loader forked its workers, the server's
    Popen waited for its child's exec on a pipe that a worker forked meanwhile also held: the
    start, and the first save that waited for it, hung for as long as the worker lived (a run
    hung at its first save; found by a kill-and-resume fuzzer)."""
    monkeypatch.setattr(filesystem_async, "_results_queue", None)
    checkpointer = Checkpointer(ExperimentConfig(), is_main=False, log=print)
    threads = threading.active_count()
    checkpointer.start_writer()
    try:
        assert threading.active_count() == threads
        assert isinstance(filesystem_async._results_queue, results_server.PickledQueue)
    finally:
        checkpointer.release()
