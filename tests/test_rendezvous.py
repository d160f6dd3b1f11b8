"""A rank waiting for the others at the rendezvous, ended by Ctrl-C or by a launcher that went away."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatron_train import placement
from tests.conftest import ROOT, free_port, torchrun_env, write_config


def _listening(pid: int, port: int) -> bool:
    """Whether the process has a socket listening on the port (state 0A in /proc/net/tcp{,6})."""
    rows = [row.split() for name in ("tcp", "tcp6") for row in Path(f"/proc/{pid}/net/{name}").open()]
    return any(row[1].endswith(f":{port:04X}") and row[3] == "0A" for row in rows[1:])


def test_ctrl_c_ends_rank_0_waiting_for_the_others_at_once(tmp_path, corpus):
    """torch waits for the ranks in C++, where Python's SIGINT handler never runs: a rank 0 started
    alone ignored Ctrl-C for the whole ten-minute collective timeout."""
    config = write_config(tmp_path / "cfg.yaml", corpus, tmp_path / "run")
    port = free_port()
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


def _node(node_rank: int, port: int, *worker: str, out=subprocess.DEVNULL) -> subprocess.Popen:
    """One node's torchrun of a two-node job with one rank a node, in a session of its own."""
    return subprocess.Popen(
        [sys.executable, "-m", "megatron_train.torchrun", "--nnodes=2", f"--node-rank={node_rank}",
         "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}", *worker],
        cwd=ROOT, env=torchrun_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip


def _rank_at_the_meeting_point(launcher: subprocess.Popen, port: int, log: Path) -> psutil.Process:
    """The launcher's rank, once it is connected to the launchers' store and waits there for the
    other node's rank (which never comes: that node runs a sleep)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert launcher.poll() is None, log.read_text()
        for rank in psutil.Process(launcher.pid).children():
            if _connected(rank, port):
                time.sleep(1)  # into the wait for the other rank
                # Still connected: a loaded machine may have caught a connection of the rank's
                # start-up, before the one it holds while it waits.
                if _connected(rank, port):
                    return rank
        time.sleep(0.1)
    raise AssertionError(f"the rank never reached the meeting point:\n{log.read_text()}")


def _connected(rank: psutil.Process, port: int) -> bool:
    try:
        return any(c.raddr and c.raddr.port == port for c in rank.net_connections())
    except psutil.NoSuchProcess:
        return False


def _end(*launchers: subprocess.Popen) -> None:
    for launcher in launchers:
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        launcher.wait()


@pytest.mark.parametrize("node_rank", [0, 1], ids=["first-node", "second-node"])
def test_a_launcher_killed_while_its_rank_waits_at_the_rendezvous_ends_the_rank(tmp_path, corpus, node_rank):
    """torchrun starts its ranks in sessions of their own, and a rank at the rendezvous waits in
    C++: with its launcher killed outright (kill -9, the out-of-memory killer), the first node's
    rank met the end of the launcher's store in a traceback, and a rank still connecting waited
    there for the whole collective timeout. Now the kernel ends it with its launcher."""
    config = write_config(tmp_path / "cfg.yaml", corpus, tmp_path / "run")
    port = free_port()
    other = _node(1 - node_rank, port, "--no-python", sys.executable, "-c", "import time; time.sleep(600)")
    log = tmp_path / "launcher.log"
    with log.open("w") as out:
        ours = _node(node_rank, port, "-m", "megatron_train.train", "--config", str(config), out=out)
    try:
        rank = _rank_at_the_meeting_point(ours, port, log)
        ours.kill()
        ours.wait()
        _, alive = psutil.wait_procs([rank], timeout=30)
    finally:
        _end(ours, other)
    assert not alive, log.read_text()
    # The first node's launcher takes the meeting point down as it exits, a moment before the
    # kernel signals the rank: a rank quick enough to see that first says so in one line.
    assert "Traceback" not in log.read_text() and len(log.read_text().splitlines()) <= 1, log.read_text()
    assert not (tmp_path / "run").exists()


def test_the_first_nodes_launcher_killed_ends_the_other_nodes_rank_in_one_line(tmp_path, corpus):
    """Under torchrun the ranks meet at the first node's launcher: with it gone, a rank on another
    node ended in a traceback under torch's C++ stack trace."""
    config = write_config(tmp_path / "cfg.yaml", corpus, tmp_path / "run")
    port = free_port()
    first = _node(0, port, "--no-python", sys.executable, "-c", "import time; time.sleep(600)")
    log = tmp_path / "launcher.log"
    with log.open("w") as out:
        ours = _node(1, port, "-m", "megatron_train.train", "--config", str(config), out=out)
    try:
        _rank_at_the_meeting_point(ours, port, log)
        first.kill()
        try:
            code = ours.wait(timeout=60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the rank did not end within 60 s:\n{log.read_text()}") from None
    finally:
        _end(ours, first)
    text = log.read_text()
    assert code == 2, text
    assert text.splitlines() == [
        f"error: rank 1 on {placement.node_name()}: config error at 'MASTER_PORT': the connection to "
        f"127.0.0.1:{port} broke while the ranks met: another program listens there, or rank 0 or the "
        "first node's launcher (which keeps the meeting point under torchrun) ended. Fix: set MASTER_PORT "
        "to the port rank 0 opens, and see the first node's log"
    ], text
    assert not (tmp_path / "run").exists()


def _importing_torch(pid: int) -> bool:
    """Whether the process has mapped torch's library: it is past the package's first lines."""
    try:
        return "libtorch_cpu" in Path(f"/proc/{pid}/maps").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_a_launcher_killed_while_its_ranks_import_ends_them(tmp_path, corpus):
    """A rank imports torch and megatron-core for seconds before it meets the others: with its
    launcher killed then, it went on into the rendezvous, at the dead launcher's store, and
    waited there for the collective timeout."""
    config = write_config(tmp_path / "cfg.yaml", corpus, tmp_path / "run")
    log = tmp_path / "launcher.log"
    with log.open("w") as out:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "megatron_train.torchrun", "--standalone", "--nproc-per-node=2",
             "-m", "megatron_train.train", "--config", str(config)],
            cwd=ROOT, env=torchrun_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        ranks: list[psutil.Process] = []
        while len(ranks) < 2 or not all(_importing_torch(rank.pid) for rank in ranks):
            assert launcher.poll() is None and time.monotonic() < deadline, log.read_text()
            ranks = psutil.Process(launcher.pid).children()
            time.sleep(0.01)
        launcher.kill()
        launcher.wait()
        _, alive = psutil.wait_procs(ranks, timeout=30)
    finally:
        _end(launcher)
    assert not alive, log.read_text()
    assert "Traceback" not in log.read_text()
    assert not (tmp_path / "run").exists()
