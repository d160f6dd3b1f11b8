"""Joining the job's process group: where the ranks meet, and the ways a launch fails to meet
there, each as one line."""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch.distributed as dist

from megatron_train import placement
from megatron_train.errors import ConfigError


def join(rank: int, world_size: int, backend: str, timeout: datetime.timedelta) -> None:
    """``dist.init_process_group`` for this rank, which Ctrl-C ends while it waits for the others.

    Raises ConfigError for a port already taken, ranks that never came and a rank 0 never reached.
    """
    init_method = _init_method(world_size)
    if world_size == 1:
        dist.init_process_group(backend, init_method=init_method, rank=0, world_size=1, timeout=timeout)
        return
    with _native_stderr_held() as held, _ctrl_c_ends_the_wait(rank, world_size, held.terminal):
        try:
            dist.init_process_group(
                backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout
            )
        except dist.DistError as err:
            if (line := _one_line(str(err), timeout)) is None:
                raise
            held.explained = True  # each retry's C++ stack trace goes, as the line says it all
            raise line from None


def _init_method(world_size: int) -> str:
    """Where the ranks meet. A one-process world outside torchrun meets itself on a free local
    port: the MASTER_ADDR / MASTER_PORT a shell exported may name another job's store or a port in
    use. Under torchrun, even one rank must use the store torchrun keeps at those variables."""
    if world_size == 1 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return f"tcp://127.0.0.1:{_free_port()}"
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name):  # RANK and WORLD_SIZE, or srun's variables, set by hand
            raise ConfigError(
                name,
                f"not set, and the {world_size} ranks meet at MASTER_ADDR:MASTER_PORT",
                "start the ranks with python -m megatron_train.torchrun or launch/slurm/pretrain.sbatch, "
                "which set both, or export the first node's address and a free port",
            )
    return "env://"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _meeting_point() -> str:
    return f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"


# torch's words for a meeting point that went away or was never a torch store.
_BROKEN_CONNECTION = ("Broken pipe", "Connection reset by peer", "Connection was likely closed")


def _one_line(message: str, timeout: datetime.timedelta) -> ConfigError | None:
    """The rendezvous failures a launch causes, as one line each; None for any other error."""
    minutes = f"{timeout.total_seconds() / 60:g} minutes (MEGATRON_TRAIN_DIST_TIMEOUT_MIN)"
    if "EADDRINUSE" in message:
        return ConfigError(
            "MASTER_PORT",
            f"port {os.environ.get('MASTER_PORT')} on {placement.node_name()} is already in use (another "
            "job or run listens on it), so rank 0 cannot open the rendezvous there",
            "export a free MASTER_PORT before starting the job (pretrain.sbatch keeps one that is set)",
        )
    if joined := re.search(r"(\d+)/(\d+) clients joined", message):
        return ConfigError(
            "WORLD_SIZE",
            f"rank 0 waited {minutes} at {_meeting_point()} for the job's {joined[2]} ranks and only "
            f"{joined[1]} joined",
            "start every rank (a node's log may show one that failed to start), or raise the timeout "
            "for a slow start",
        )
    if "Ping failed, invalid value returned from server" in message:
        return ConfigError(
            "MASTER_PORT",
            f"what answers at {_meeting_point()} is not a torch rendezvous: another program listens there",
            "set MASTER_ADDR and MASTER_PORT to rank 0's node and the port it opens (torchrun and srun "
            "set both)",
        )
    if any(broke in message for broke in _BROKEN_CONNECTION):
        return ConfigError(
            "MASTER_PORT",
            f"the connection to {_meeting_point()} broke while the ranks met: another program listens "
            "there, or rank 0 or the first node's launcher (which keeps the meeting point under torchrun) "
            "ended",
            "set MASTER_PORT to the port rank 0 opens, and see the first node's log",
        )
    if "trying to connect to" in message:
        return ConfigError(
            "MASTER_ADDR",
            f"could not reach rank 0's rendezvous at {_meeting_point()} within {minutes}",
            "start rank 0 too, and set MASTER_ADDR to rank 0's node as this node reaches it",
        )
    return None


@dataclass
class _HeldOutput:
    terminal: int
    """A copy of the process's stderr as it was, for a line that must not wait."""
    chunks: list[bytes] = field(default_factory=list)
    explained: bool = False
    """Whether one line says what went wrong, in place of what was held."""


@contextlib.contextmanager
def _native_stderr_held() -> Iterator[_HeldOutput]:
    """Hold what is written to fd 2 while the ranks meet, and write it out afterwards. A rank that
    cannot reach rank 0 has torch's C++ store log each retry with a stack trace of some forty
    lines, and C++ logging has no switch once torch is imported; a caller whose one line explains
    the failure marks the held output explained, and it is dropped."""
    sys.stderr.flush()
    terminal = os.dup(2)
    read_fd, write_fd = os.pipe()
    os.dup2(write_fd, 2)
    os.close(write_fd)
    held = _HeldOutput(terminal)

    def drain() -> None:
        while chunk := os.read(read_fd, 1 << 16):
            held.chunks.append(chunk)

    reader = threading.Thread(target=drain, name="rendezvous-stderr", daemon=True)
    reader.start()
    try:
        yield held
    finally:
        sys.stderr.flush()
        os.dup2(terminal, 2)  # the pipe's last write end closes, which ends the reader
        reader.join()
        os.close(read_fd)
        if not held.explained:
            for chunk in held.chunks:
                os.write(terminal, chunk)
        os.close(terminal)


@contextlib.contextmanager
def _ctrl_c_ends_the_wait(rank: int, world_size: int, terminal: int) -> Iterator[None]:
    """End the process at a Ctrl-C while it waits for the other ranks. torch's rendezvous waits in
    C++ until all have joined or the timeout passes, and Python runs its SIGINT handler only
    between bytecodes, so a rank started by hand ignored Ctrl-C for the whole collective timeout.
    The interpreter's C-level handler still writes each signal's number to the wakeup fd, and the
    wait releases the GIL, so a thread reading that fd can end the process."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set the wakeup fd
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)

    # Under torchrun or srun, a Ctrl-C reaches every rank, and rank 0 speaks for them all.
    speaks = rank == 0 or not ({"TORCHELASTIC_RUN_ID", "SLURM_STEP_ID"} & os.environ.keys())
    who = "" if rank == 0 else f"rank {rank} on {placement.node_name()}: "

    def watch() -> None:
        while number := os.read(read_fd, 1):
            if number[0] == signal.SIGINT:
                if speaks:
                    line = (
                        f"error: {who}interrupted while waiting at {_meeting_point()} for the job's "
                        f"{world_size} ranks to join; nothing was written. Fix: start all of them together "
                        "(torchrun and srun do), then run it again\n"
                    )
                    os.write(terminal, line.encode())
                os._exit(128 + signal.SIGINT)

    watcher = threading.Thread(target=watch, name="rendezvous-ctrl-c", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous)
        os.close(write_fd)  # the watcher reads the end of the pipe and returns
        watcher.join()
        os.close(read_fd)
