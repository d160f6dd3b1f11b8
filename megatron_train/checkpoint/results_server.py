"""The queue server megatron's background checkpoint writers report their results through.

Run as ``python -I results_server.py SIGNAL...`` by :func:`start`: the standard library only, so
it starts in a tenth of a second. A ``multiprocessing`` Manager started from the training process
is a spawned interpreter that first imports the parent's main module (``megatron_train.train``:
torch and megatron-core), seconds of CPU per rank, on every start, beside the ranks' own.
"""

from __future__ import annotations

import os
import pickle
import secrets
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.managers import SyncManager
from queue import Queue


class PickledQueue:
    """The queue megatron's writer puts its results on and the training process gets them from,
    carrying them as pickled bytes, so that the server never unpickles them: their classes are
    torch's, and unpickling one there would import torch, the start-up this server exists to avoid."""

    def __init__(self, queue: Queue) -> None:
        self._queue = queue

    def put(self, item: object) -> None:
        self._queue.put(pickle.dumps(item))

    def get_nowait(self) -> object:
        return pickle.loads(self._queue.get_nowait())


class ResultsServer:
    """A running server and a client connected to it; :meth:`queue` makes a queue that processes
    forked later reach, :meth:`stop` ends it (it also ends within a second of its parent)."""

    def __init__(self, process: subprocess.Popen, client: SyncManager) -> None:
        self._process, self._client = process, client

    @property
    def pid(self) -> int:
        """The server process's id."""
        return self._process.pid

    def running(self) -> bool:
        """Whether the server process is still running."""
        return self._process.poll() is None

    def queue(self) -> PickledQueue:
        return PickledQueue(self._client.Queue())

    def stop(self) -> None:
        self._process.kill()
        self._process.wait()


def start(ignored_signals: tuple[signal.Signals, ...]) -> ResultsServer:
    """Start the server, ignoring ``ignored_signals`` (a save-and-stop signal sent to the whole
    process group must not end it before the save is recorded), and connect to it."""
    # An abstract socket: no file to remove, whichever way the processes end.
    address = f"\0megatron-train-results-{os.getpid()}-{secrets.token_hex(8)}"
    authkey = secrets.token_bytes(32)
    # Blocked here, the signals stay blocked in the child through exec until it ignores them: one
    # that reaches it while its interpreter starts waits instead of ending it before it listens.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, ignored_signals)
    try:
        process = subprocess.Popen(
            [sys.executable, "-I", __file__, *(s.name for s in ignored_signals)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    process.stdin.write(f"{address[1:]}\n{authkey.hex()}\n")  # argv cannot hold the NUL
    process.stdin.close()
    if process.stdout.readline() != "listening\n":
        process.wait()
        raise RuntimeError(f"the checkpoint results server ended ({process.returncode}) before it listened")
    process.stdout.close()
    client = SyncManager(address=address, authkey=authkey)
    client.connect()
    return ResultsServer(process, client)


def _exit_with(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def _serve(ignored: list[str]) -> None:
    signals = [signal.Signals[name] for name in ignored]
    for sig in signals:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)
    threading.Thread(target=_exit_with, args=(os.getppid(),), daemon=True).start()
    address = "\0" + sys.stdin.readline().rstrip("\n")
    authkey = bytes.fromhex(sys.stdin.readline())
    server = SyncManager(address=address, authkey=authkey).get_server()
    print("listening", flush=True)
    sys.stdout.close()
    server.serve_forever()


if __name__ == "__main__":
    _serve(sys.argv[1:])
