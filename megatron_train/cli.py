"""What every entry point does with bad input: one ``error: ...`` line on stderr, exit code 2, no
traceback. Argument parsing, argument ranges and the reporting of bad-input errors live here."""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import math
import os
import select
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn, ParamSpec, TextIO

from megatron_train.errors import BAD_INPUT, Failure, denied, out_of_room, unusable_path
from megatron_train.placement import launcher_rank, node_name

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
EXIT_STOPPED_EARLY = 3
"""Training stopped before its last step on a signal or its time limit, after saving a checkpoint."""
EXIT_INTERRUPTED, EXIT_READER_GONE = 130, 141
"""128 + SIGINT or SIGPIPE: the status a shell gives a command that signal ended."""


def report(err: BaseException | str) -> None:
    """Print a bad-input error as one line, whatever newlines its text holds."""
    print("error: " + " ".join(str(err).split()), file=sys.stderr, flush=True)


def exit_process(code: int) -> NoReturn:
    """End an entry point's process with ``code``, leaving the objects it made to the operating
    system: the collection Python runs at exit walks all that torch and megatron-core built, about
    a second of CPU per process, times every rank of every start and every tool run."""
    gc.freeze()
    sys.exit(code)


OTHER_RANK_REPORT_DELAY_S = 10.0
"""How long a rank other than 0 waits before it reports a bad input itself (:func:`report_once`)."""


def first_rank() -> bool:
    """Whether the launcher (torchrun, srun, or none) made this process rank 0."""
    return launcher_rank() == "0"


def report_once(err: BaseException | str) -> None:
    """:func:`report` once per job: under torchrun or srun every rank meets the same bad input.

    Rank 0 reports at once. Another rank waits first: a launcher ends every rank as soon as one
    exits, so a rank that exited first could have rank 0 ended before it printed, and the job
    would end without a line. Rank 0's exit ends the waiting rank; a problem rank 0 did not meet
    (a path this rank's node lacks, say) is reported by this rank after the wait, naming itself.
    """
    if first_rank():
        report(err)
        return
    time.sleep(OTHER_RANK_REPORT_DELAY_S)
    report(f"rank {launcher_rank()} on {node_name()}: {err}")


class _StoreOnce(argparse.Action):
    """Stores an option's value and refuses a second one: argparse keeps the last without a word,
    so ``--config a.yaml --config b.yaml`` trained b.yaml where its user may have meant both."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values, option_string=None
    ) -> None:
        if option_string is not None:
            if self.dest in parser.given:
                first, then = (
                    os.fspath(v) if isinstance(v, os.PathLike) else v
                    for v in (parser.given[self.dest], values)
                )
                raise argparse.ArgumentError(self, f"given twice ({first!r}, then {then!r}); give it once")
            parser.given[self.dest] = values
        setattr(namespace, self.dest, values)


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with a usage mistake reported as one line (not the usage text) and exit code 2,
    and an option given twice refused rather than its last value taken."""

    def __init__(self, override_for: Callable[[str], str | None] | None = None, **kwargs) -> None:
        """``override_for``: for a command that takes config overrides, the override an option it
        does not take stands for (``--train-iters=10`` -> ``train.steps=10``), or None."""
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(**kwargs)
        self.override_for = override_for
        self.register("action", None, _StoreOnce)
        self.register("action", "store", _StoreOnce)
        self.given: dict[str, object] = {}
        self.argv: list[str] = []

    def parse_known_args(self, args=None, namespace=None):
        self.given = {}
        self.argv = list(sys.argv[1:] if args is None else args)
        for arg in self.argv:
            # Bytes that are not UTF-8 (a Latin-1 terminal, a file name from another system) reach
            # Python as lone surrogates, which the tokenizers, safetensors and SentencePiece's
            # paths cannot take: each failed its own way, mostly with a traceback.
            try:
                arg.encode("utf-8")
            except UnicodeEncodeError:
                report_once(
                    f"the argument {arg!r} is not UTF-8 text. Fix: give it in UTF-8 (set the terminal "
                    "to UTF-8, or rename the file to a UTF-8 name)"
                )
                sys.exit(EXIT_BAD_INPUT)
        return super().parse_known_args(args, namespace)

    def _unknown_options(self) -> list[str]:
        """The ``--options`` given that are none of this parser's (nor a prefix of one)."""
        return [
            name
            for name in (arg.split("=", 1)[0] for arg in self.argv if arg.startswith("--"))
            if name != "--" and not any(known.startswith(name) for known in self._option_string_actions)
        ]

    def error(self, message: str) -> NoReturn:
        # argparse reports a missing required option before an unknown one, so a misspelt
        # --config would read as if it had been left out.
        unknown = self._unknown_options()
        if message.startswith("the following arguments are required") and unknown:
            message += f" (not an option here: {', '.join(unknown)})"
        fix = f"see {self.prog} --help"
        if self.override_for and unknown:
            # Megatron-LM's and torchtitan's options are flags; ours are key=value overrides.
            at = next(i for i, arg in enumerate(self.argv) if arg.split("=", 1)[0] == unknown[0])
            given, after = self.argv[at], self.argv[at + 1 : at + 2]
            if "=" not in given and after and not after[0].startswith("-") and "=" not in after[0]:
                given += f"={after[0]}"  # ``--train-iters 10``
            if override := self.override_for(given):
                fix = f"give it as a config override after --config, key=value without dashes: {override}"
        report_once(f"{message}. Fix: {fix}")
        sys.exit(EXIT_BAD_INPUT)


def _number(kind: type, check: Callable[[float], bool], wanted: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {wanted}") from None
        if not (math.isfinite(value) and check(value)):
            raise argparse.ArgumentTypeError(f"{text!r} is not {wanted}")
        return value

    parse.__name__ = wanted
    return parse


positive_int = _number(int, lambda v: v >= 1, "a positive integer")
non_negative_int = _number(int, lambda v: v >= 0, "an integer >= 0")
positive_float = _number(float, lambda v: v > 0, "a number > 0")
probability = _number(float, lambda v: 0 < v <= 1, "a number in (0, 1]")
# A count a shell script compares: bash's arithmetic is signed 64-bit, and wraps past it (2**64 is 0).
shell_count = _number(int, lambda v: 0 <= v < 2**63, "an integer from 0 to 2**63 - 1, as bash compares")
# sbatch --signal's sig_time is 16 bits; above 65535 it refuses the whole submission.
signal_seconds = _number(
    int, lambda v: 1 <= v <= 65535, "a whole number of seconds from 1 to 65535 (sbatch --signal's range)"
)
# torch's generators take a 64-bit unsigned seed.
seed = _number(int, lambda v: 0 <= v < 2**64, "an integer from 0 to 2**64 - 1")


def non_empty(text: str) -> str:
    """An argument that must not be empty (an empty ``--partition=`` reaches sbatch as a typo)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty value")
    return text


def path(text: str) -> Path:
    """A path argument. An empty one (``--out $DIR`` with the variable unset) was the current
    folder, and the error or output that followed named '.', not the argument."""
    return Path(non_empty(text))


def no_room(err: BaseException, what: str, fix: str) -> str | None:
    """The error line (without ``error:``) for ``err`` when it is a write the file system refused
    for want of room, which ends an entry point with exit code 1; None for any other error."""
    cause = out_of_room(err)
    return None if cause is None else f"{what} could not be written ({cause}). Fix: {fix}"


def _stdout_to_devnull() -> None:
    """Standard output sent to /dev/null, once it failed: Python's flush at exit would fail the
    same way on what its buffer still holds."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _stdout_reader_gone() -> bool:
    """Whether standard output is a pipe whose reader went away (poll reports an error on it)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # None (started with it closed), or no descriptor
        return False
    watch = select.poll()
    watch.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in watch.poll(0))


_stdout_full: str | None = None
"""Why standard output took no more lines (:func:`say`), once it refused one."""


def say(text: str) -> None:
    """Print a line of a tool's report on what it wrote. Where standard output has no room for it
    (a file on a full disk), this line and the later ones go to stderr and the tool goes on: the
    error of an output that could not be written would tell of outputs that were written."""
    global _stdout_full
    if _stdout_full is None:
        try:
            print(text, flush=True)
            return
        except OSError as err:
            if (_stdout_full := out_of_room(err)) is None:
                raise
            _stdout_to_devnull()
    print(
        f"note: standard output had no room for this line ({_stdout_full}): {text}",
        file=sys.stderr,
        flush=True,
    )


class _LogStream:
    """Standard output whose lines are a log for people: one the file system has no room for is
    dropped, with those after it, and a note on stderr."""

    def __init__(self, stream: TextIO, goes_on: str) -> None:
        self._stream, self._goes_on = stream, goes_on

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as err:
            self._drop(err)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as err:
            self._drop(err)

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)

    def _drop(self, err: OSError) -> None:
        if (cause := out_of_room(err)) is None:
            raise err
        _stdout_to_devnull()
        # stderr is often the same file (a Slurm rank log), with no more room for this.
        with contextlib.suppress(OSError):
            print(
                f"note: standard output had no room for the log ({cause}); {self._goes_on}",
                file=sys.stderr,
                flush=True,
            )


@contextlib.contextmanager
def log_stream(goes_on: str) -> Iterator[None]:
    """Inside, a line standard output has no room for (a log on a full disk or past its quota)
    is dropped with the rest of the log, and a note saying ``goes_on``, rather than raised: a
    long command (training) ended at its next log line, losing what it had done since its last
    save, for want of room where only its log goes."""
    previous = sys.stdout
    if previous is None:  # started without one (``>&-``): print() writes nothing, as it should
        yield
        return
    sys.stdout = _LogStream(previous, goes_on)
    try:
        yield
    finally:
        sys.stdout = previous


P = ParamSpec("P")


def entry_point(main: Callable[P, int]) -> Callable[P, int]:
    """``main``, as every command's: a path the file system refuses for its form (too long, or a
    loop of symbolic links) or to this user (permissions, a read-only mount) is bad input (one
    line, exit code 2) wherever it is first used, since each of the many places that look at a
    given path would otherwise end in a traceback. An interrupt (Ctrl-C) that reaches Python as
    KeyboardInterrupt ends it with one line from the first rank and exit code 130, as a shell
    reports it, after the outputs being written were removed on the way out (a tool's SIGTERM,
    :class:`Terminated`, likewise, ending by that signal); a pipe whose reader went away ends it
    quietly (141); output the file system has no room for is one line and exit code 1."""

    @functools.wraps(main)
    def checked(*args: P.args, **kwargs: P.kwargs) -> int:
        try:
            return main(*args, **kwargs)
        except Terminated:
            _end_by_sigterm()
        except KeyboardInterrupt:
            if first_rank():
                report("interrupted before it finished; nothing half-written was kept. Fix: run it again")
            return EXIT_INTERRUPTED
        except BrokenPipeError:
            if not _stdout_reader_gone():
                raise  # a socket, or a pipe to another process: not the output's reader
            # The reader of the output went away (``inspect_checkpoint.py ... | head``): nothing
            # to report, and no one to report it to.
            _stdout_to_devnull()
            return EXIT_READER_GONE
        except BaseException as err:  # torch's CheckpointException is a BaseException
            if line := unusable_path(err) or denied(err):
                report_once(line)
                return EXIT_BAD_INPUT
            # What a command prints, where its standard output is a file on a full disk.
            if line := no_room(err, "the output", "free space where it goes or write it elsewhere"):
                report(line)
                return EXIT_FAILED
            raise

    return checked


class Terminated(KeyboardInterrupt):
    """SIGTERM in a tool (Slurm's time limit or preemption, scancel, kill), raised wherever the
    tool is, as Ctrl-C's KeyboardInterrupt is, so that the same clean-up runs on the way out."""


def _terminate(signum: int, frame: object) -> NoReturn:
    # Slurm signals every process of the job, and may again: the clean-up must not be cut short.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated


def _end_by_sigterm() -> NoReturn:
    """After a tool's clean-up: one line when it runs alone, then the end by SIGTERM itself, as a
    launcher expects of the ranks it sends SIGTERM to when another one failed (that one has said
    why; ours would be a second, misleading line)."""
    if os.environ.get("WORLD_SIZE", "1") == "1":
        report("terminated (SIGTERM) before it finished; nothing half-written was kept. Fix: run it again")
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:  # None: started with it closed (``>&-``)
            stream.flush()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
    while True:  # the signal ends the process as soon as it is delivered
        signal.pause()


@entry_point
def run(body: Callable[[], None]) -> int:
    """Run ``body``; a bad-input error becomes one ``error: ...`` line and exit code 2, a
    :class:`Failure` or an output the file system has no room for one line and exit code 1, and
    SIGTERM ends it as Ctrl-C does (the tools remove what they had written). Any process group
    ``body`` started is torn down on every path."""
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        body()
    except BAD_INPUT as err:
        report_once(err)
        return EXIT_BAD_INPUT
    except Failure as err:
        report_once(err)
        return EXIT_FAILED
    except BaseException as err:  # torch's CheckpointException is a BaseException
        if (line := no_room(err, "the output", "free space where it goes or write it elsewhere")) is None:
            raise
        report(line)
        return EXIT_FAILED
    finally:
        # A process that called this in-process (a test) keeps its own handler; None: one set
        # outside Python.
        signal.signal(signal.SIGTERM, previous or signal.SIG_DFL)
        # Only the runtime starts process groups; tools that never import it (and torch with it)
        # start in a fraction of the time.
        if runtime := sys.modules.get("megatron_train.runtime"):
            runtime.shutdown()
    return 0
