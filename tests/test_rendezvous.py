"""A rank waiting for the others at the rendezvous, ended by Ctrl-C."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import ROOT, torchrun_env, write_config


def _listening(pid: int, port: int) -> bool:
    """Whether the process has a socket listening on the port (state 0A in /proc/net/tcp{,6})."""
    rows = [row.split() for name in ("tcp", "tcp6") for row in Path(f"/proc/{pid}/net/{name}").open()]
    return any(row[1].endswith(f":{port:04X}") and row[3] == "0A" for row in rows[1:])


def test_ctrl_c_ends_rank_0_waiting_for_the_others_at_once(tmp_path, corpus):
    """torch waits for the ranks in C++, where Python's SIGINT handler never runs: a rank 0 started
    alone ignored Ctrl-C for the whole ten-minute collective timeout."""
    config = write_config(tmp_path / "cfg.yaml", corpus, tmp_path / "run")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {
        **torchrun_env(),
        "RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    rank = subprocess.Popen(
        [sys.executable, "-m", "megatron_train.train", "--config", str(config)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # A shell's background job starts with SIGINT ignored; a terminal's Ctrl-C finds it handled.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while rank.poll() is None and not _listening(rank.pid, port) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1)  # into the wait for rank 1
        rank.send_signal(signal.SIGINT)
        err = rank.communicate(timeout=30)[1]
    finally:
        rank.kill()
    assert rank.returncode == 130, err
    assert err.splitlines() == [
        f"error: interrupted while waiting at 127.0.0.1:{port} for the job's 2 ranks to join; nothing was "
        "written. Fix: start all of them together (torchrun and srun do), then run it again"
    ], err
    assert not (tmp_path / "run").exists()
