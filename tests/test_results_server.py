"""The server megatron's async checkpoint writer reports through: a forked writer's results reach
the training process, the server stays light (no torch), survives stop signals, ends with its parent."""

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch

from megatron_train.checkpoint import results_server
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
    failed with a traceback, in the thread that starts it during the first training steps)."""
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
