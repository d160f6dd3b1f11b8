"""torchrun, ending with the workers' own exit code: ``python -m megatron_train.torchrun`` takes
torchrun's arguments (launch/local.sh calls it).

torchrun turns any failed worker into its own traceback and exit code 1, so a bad config (every
rank exits 2 after one ``error:`` line) or a run stopped after its save (3) looked like a crash.
Here, when the first failed rank exited 2 or 3 and the others gave the same code or were ended by
the agent, that code is the launcher's and nothing is added to the ranks' own output; any other
failure names the first failed rank and exits 1.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import math
import os
import resource
import signal
import socket
import sys
import tempfile
from importlib.metadata import entry_points
from pathlib import Path
from typing import NoReturn

import torch
from torch.distributed.elastic.events.handlers import get_logging_handler
from torch.distributed.elastic.multiprocessing import SignalException, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.run import determine_local_world_size, get_args_parser, parse_min_max_nnodes, run

from megatron_train import cli
from megatron_train.errors import ConfigError, unusable_path
from megatron_train.host_memory import available_memory
from megatron_train.outputs import check_output_dir

# The exit codes a rank gives after reporting for itself.
_REPORTED = (cli.EXIT_BAD_INPUT, cli.EXIT_STOPPED_EARLY)


class _QuietExits(logging.Filter):
    """Drops the agent's lines about ending the ranks: "failed (exitcode: N) ... of binary: ...",
    since the ranks report codes 2 and 3 themselves and :func:`main` says the rest in its own
    words, and "Sending process P closing signal S" to the ranks still running when the first
    one exits."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("Sending process", "failed (exitcode"))


def exit_code(err: ChildFailedError) -> int:
    """The launcher's exit code for failed ranks: the first one's 2 or 3 when every other failed
    rank gave the same code or was ended by the agent's signal (a negative code); otherwise 1."""
    rank, first = err.get_first_failure()
    others = [failure.exitcode for r, failure in err.failures.items() if r != rank]
    if first.exitcode in _REPORTED and all(code == first.exitcode or code < 0 for code in others):
        return first.exitcode
    return 1


def failure_line(err: ChildFailedError) -> str:
    """What the launcher says of failed ranks that did not report for themselves."""
    rank, first = err.get_first_failure()
    if first.exitcode >= 0:
        return f"rank {rank} failed first, with exit code {first.exitcode}; its output is above"
    try:
        name = signal.Signals(-first.exitcode).name
    except ValueError:
        name = f"signal {-first.exitcode}"
    # A killed rank prints nothing: the kernel log says who killed it. A SIGBUS is a read through
    # a memory map past the end of its file, which the datasets are.
    who = {
        signal.SIGKILL: " (the out-of-memory killer sends it: see dmesg)",
        signal.SIGBUS: " (a file it had mapped shrank: a dataset rewritten or cut while the run read it)",
    }.get(-first.exitcode, "")
    return f"rank {rank} was killed by {name}{who} before any other rank failed"


def parse_args(argv: list[str]) -> argparse.Namespace:
    """torchrun's arguments, with a usage mistake as one line (torchrun prints its whole usage),
    and SIGUSR1 among the signals passed on to the ranks unless torchrun's variable names them."""
    parser = get_args_parser()

    def usage_error(message: str) -> NoReturn:
        cli.report(f"{message}. Fix: see python -m megatron_train.torchrun --help")
        sys.exit(cli.EXIT_BAD_INPUT)

    parser.error = usage_error
    # Our ranks stop after a save on SIGUSR1 (Slurm's pre-timeout signal) as on SIGTERM; torchrun
    # alone dies of it and leaves its ranks training without it.
    if "PET_SIGNALS_TO_HANDLE" not in os.environ:
        parser.set_defaults(signals_to_handle=parser.get_default("signals_to_handle") + ",SIGUSR1")
    return parser.parse_args(argv)


def rank_floor() -> int:
    """Bytes each rank takes before it builds anything: this launcher's own peak, as it has
    imported what a rank imports first (torch, megatron-core, the trainer)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def launch_problem(args: argparse.Namespace) -> str | None:
    """What in torchrun's arguments it would meet with a traceback before starting any rank."""
    try:
        local_world_size = determine_local_world_size(args.nproc_per_node)
        problem = f"{local_world_size} ranks per node"
    except ValueError as err:
        local_world_size, problem = 0, str(err).rstrip(".")
    if local_world_size < 1:
        return (
            f"--nproc-per-node {args.nproc_per_node}: {problem}. Fix: give the number of ranks per node "
            "(one per GPU)"
        )
    # torchrun leaves CUDA_VISIBLE_DEVICES alone, so every rank here sees these GPUs and takes
    # LOCAL_RANK % count: two would share one, which NCCL refuses with a traceback per rank.
    gpus = torch.cuda.device_count()
    if args.numa_binding and not gpus:
        # torch reads each rank's GPU to find its NUMA node: an AssertionError without CUDA.
        return (
            f"--numa-binding {args.numa_binding}: binds each rank to the NUMA node of its GPU, and this node "
            "shows no GPU. Fix: leave --numa-binding out"
        )
    if 0 < gpus < local_world_size:
        return (
            f"--nproc-per-node {args.nproc_per_node}: {local_world_size} ranks for the {gpus} GPU(s) this "
            f"node shows, and NCCL runs one rank per GPU. Fix: start at most {gpus} ranks per node "
            "(launch/local.sh with no count starts one per GPU)"
        )
    # A mistyped count (80 for 8) would start ranks until the out-of-memory killer ends the
    # machine's other work too, long before the ranks refuse a world size their config cannot use.
    available, floor = available_memory(), rank_floor()
    if available is not None and local_world_size * floor > available:
        return (
            f"--nproc-per-node {args.nproc_per_node}: {local_world_size} ranks take at least "
            f"{local_world_size * floor / 2**30:,.1f} GiB ({floor / 2**30:.2f} GiB each for torch and "
            f"megatron-core alone), above the {available / 2**30:.1f} GiB this machine has free. "
            f"Fix: start at most {max(1, available // floor)} ranks per node"
        )
    try:
        min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
    except (ValueError, RuntimeError):
        min_nodes = max_nodes = 0
    if not 0 < min_nodes <= max_nodes:
        return f"--nnodes {args.nnodes}: not a node count. Fix: give N, or MIN:MAX with 1 <= MIN <= MAX"
    if max_nodes * local_world_size > _MAX_WORLD:
        # torch's TCPStore takes the count as a C int: a traceback from the rendezvous otherwise.
        return (
            f"--nnodes {args.nnodes}: {max_nodes * local_world_size:,} ranks in all, more than "
            f"torch.distributed can number ({_MAX_WORLD:,}). Fix: give the number of nodes the job has"
        )
    if args.standalone and min_nodes > 1:
        # The standalone rendezvous listens on a free port of this node that no other node is told.
        return (
            f"--nnodes {args.nnodes}: --standalone keeps the rendezvous to this node, so it would wait "
            f"for {min_nodes - 1} more node(s) that cannot join. Fix: drop --standalone and start every "
            "node with --rdzv-backend c10d --rdzv-endpoint FIRST_NODE:PORT, or use --nnodes 1 (under Slurm: "
            "launch/submit.py)"
        )
    if args.max_restarts < 0:
        return f"--max-restarts {args.max_restarts}: below 0. Fix: give 0 (no restart) or more"
    if args.master_port is not None and not 0 < args.master_port < 65536:
        return f"--master-port {args.master_port}: not a port. Fix: use a free port from 1 to 65535"
    if args.rdzv_endpoint and not args.standalone:
        try:
            _, port = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=-1)
        except ValueError as err:
            return (
                f"--rdzv-endpoint {args.rdzv_endpoint}: {str(err).rstrip('.')}. Fix: give HOST or HOST:PORT"
            )
        if port == -1 and args.rdzv_backend == "static":  # c10d alone has a default port
            return (
                f"--rdzv-endpoint {args.rdzv_endpoint}: the static rendezvous (--rdzv-backend static, the "
                "default) needs a port. Fix: give HOST:PORT, or use --rdzv-backend c10d"
            )
    # A static rendezvous waits forever for a node of a rank beyond its count.
    if args.rdzv_backend == "static" and max_nodes > 1 and not 0 <= args.node_rank < max_nodes:
        return (
            f"--node-rank {args.node_rank}: outside the {max_nodes} nodes of --nnodes. Fix: number the nodes "
            f"from 0 to {max_nodes - 1}"
        )
    return _rendezvous_problem(args) or _agent_problem(args) or _output_problem(args, local_world_size)


_MAX_MONITOR_INTERVAL = 60
"""The longest --monitor-interval taken, in seconds: torchrun's default is 0.1, and a value past
a minute is milliseconds written as seconds."""

_MAX_WORLD = 2**31 - 1
"""The most ranks torch.distributed numbers (a C int)."""

# torch's rendezvous backends; another name is torch's "is not registered" traceback.
_RENDEZVOUS_BACKENDS = ("c10d", "static", "etcd", "etcd-v2")


def _rendezvous_problem(args: argparse.Namespace) -> str | None:
    """--rdzv-backend, --rdzv-conf and --local-addr, as the rendezvous would meet them: a traceback
    (an unknown backend, a malformed or negative option) or, for an address that does not resolve,
    a C++ trace after minutes of retries."""
    if args.rdzv_backend not in _RENDEZVOUS_BACKENDS:
        return f"--rdzv-backend {args.rdzv_backend}: not a rendezvous backend. Fix: use c10d (or static)"
    # --standalone replaces the backend with c10d.
    if (
        not args.standalone
        and args.rdzv_backend.startswith("etcd")
        and importlib.util.find_spec("etcd") is None
    ):
        return (
            f"--rdzv-backend {args.rdzv_backend}: needs the python-etcd package (and an etcd server), which "
            "this environment lacks. Fix: use c10d, torch's own rendezvous on the first node"
        )
    for option in filter(None, args.rdzv_conf.split(",")):
        key, _, value = option.partition("=")
        if not key.strip() or not value.strip():
            return (
                f"--rdzv-conf {args.rdzv_conf}: {option!r} is not key=value. Fix: write KEY=VALUE,KEY=VALUE"
            )
        if key.strip().endswith("timeout") and not (value.strip().isdigit() and int(value) > 0):
            return (
                f"--rdzv-conf {args.rdzv_conf}: {key.strip()}={value} is not a number of seconds. Fix: give "
                "whole seconds above 0"
            )
    if args.local_addr:
        try:
            socket.getaddrinfo(args.local_addr, None)
        except (OSError, UnicodeError):
            return (
                f"--local-addr {args.local_addr}: this node knows no such address. Fix: give this node's "
                "host name or IP address, or leave it out"
            )
    return None


def _agent_problem(args: argparse.Namespace) -> str | None:
    """--monitor-interval, --event-log-handler, --logs-specs, --signals-to-handle and
    --shutdown-timeout, which the agent would refuse with a traceback (or, for a signal it does
    not know, a traceback as a warning, and the signal not passed on) once the rendezvous is done."""
    if not (math.isfinite(args.monitor_interval) and args.monitor_interval > 0):
        return f"--monitor-interval {args.monitor_interval:g}: not a time to wait. Fix: give seconds above 0"
    if args.monitor_interval > _MAX_MONITOR_INTERVAL:
        # Milliseconds mistaken for seconds: the launcher sleeps that long between looks at its
        # ranks, so a finished or failed run seemed to hang (beyond time_t, a traceback).
        return (
            f"--monitor-interval {args.monitor_interval:g}: seconds between the launcher's looks at its "
            f"ranks; a run that ended would go unnoticed that long. Fix: give at most "
            f"{_MAX_MONITOR_INTERVAL} (torchrun's default is 0.1)"
        )
    try:
        get_logging_handler(args.event_log_handler)
    except KeyError:
        return f"--event-log-handler {args.event_log_handler}: no such handler. Fix: use console or null"
    if args.logs_specs is not None:
        names = sorted(e.name for e in entry_points(group="torchrun.logs_specs"))
        if args.logs_specs not in names:
            return f"--logs-specs {args.logs_specs}: no such logs spec. Fix: use one of {', '.join(names)}"
    for name in args.signals_to_handle.split(","):
        sig = getattr(signal, name.strip(), None)
        if not isinstance(sig, signal.Signals) or sig in (signal.SIGKILL, signal.SIGSTOP):
            return (
                f"--signals-to-handle {args.signals_to_handle}: {name.strip()!r} is not a signal the "
                "launcher can catch and pass on to the ranks. Fix: name signals such as "
                "SIGTERM,SIGINT,SIGUSR1"
            )
    if args.shutdown_timeout is not None and args.shutdown_timeout < 0:
        return (
            f"--shutdown-timeout {args.shutdown_timeout}: below 0. Fix: give the seconds the ranks have to "
            "stop after SIGTERM before SIGKILL, 0 or more"
        )
    return None


def _output_problem(args: argparse.Namespace, local_world_size: int) -> str | None:
    """--redirects, --tee, --local-ranks-filter and --log-dir, where the ranks' output goes."""
    for flag, value in (("--redirects", args.redirects), ("--tee", args.tee)):
        try:
            Std.from_str(value)
        except ValueError:
            return (
                f"{flag} {value}: not a choice of streams. Fix: give 0 (none), 1 (stdout), 2 (stderr) or 3 "
                "(both), for every rank or as LOCAL_RANK:N,LOCAL_RANK:N"
            )
    if args.local_ranks_filter:
        parts = args.local_ranks_filter.split(",")
        if not all(part.strip().isdigit() for part in parts):
            return (
                f"--local-ranks-filter {args.local_ranks_filter}: not a list of local ranks. Fix: give them "
                "separated by commas, such as 0,1"
            )
        if not any(int(part) < local_world_size for part in parts):
            return (
                f"--local-ranks-filter {args.local_ranks_filter}: names none of the {local_world_size} local "
                f"ranks, so no rank's output would show. Fix: name ranks from 0 to {local_world_size - 1}"
            )
    if args.log_dir and args.log_dir != os.devnull:
        try:
            check_output_dir("--log-dir", Path(args.log_dir))
        except ConfigError as err:
            return f"--log-dir {args.log_dir}: {err.problem}. Fix: {err.fix}"
        except OSError as err:  # a name or path longer than the file system allows
            if (line := unusable_path(err)) is None:
                raise
            return f"--log-dir: {line}"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    problem = launch_problem(args)
    if problem:
        cli.report(problem)
        return cli.EXIT_BAD_INPUT
    local_world_size = determine_local_world_size(args.nproc_per_node)
    # torchrun sets one OpenMP thread per rank itself when several share a node, with a banner
    # above the ranks' output (and above a one-line error) saying so.
    if local_world_size > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_QuietExits())
    # Without --log-dir, torchrun makes a folder in the temporary directory at every launch and
    # leaves it there: folders for logs that --redirects, --tee or a failed rank's record fill.
    made = None if args.log_dir else tempfile.mkdtemp(prefix="torchelastic_")
    args.log_dir = args.log_dir or made
    try:
        run(args)
    except ChildFailedError as err:
        code = exit_code(err)
        if code == 1:
            cli.report(failure_line(err))
        return code
    except SignalException as err:
        # The agent passed the signal on to the ranks, which saved and reported for themselves.
        return 128 + int(err.sigval)
    finally:
        if made:
            _remove_empty_folders(made)
    return 0


def _remove_empty_folders(top: str) -> None:
    """``top`` and the folders below it that hold no file; a log or record in one keeps it and
    the folders above it."""
    for folder, _, _ in os.walk(top, topdown=False):
        try:
            os.rmdir(folder)
        except OSError:
            pass


if __name__ == "__main__":
    cli.exit_process(main())
