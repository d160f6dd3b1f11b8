"""torchrun, ending with the workers' own exit code: ``python -m megatron_train.torchrun`` takes
torchrun's arguments (launch/local.sh calls it).

torchrun turns any failed worker into its own traceback and exit code 1, so a bad config (every
rank exits 2 after one ``error:`` line) or a run stopped after its save (3) looked like a crash.
Here, when every failed rank exited 2, or every one 3, that code is the launcher's and nothing
is added to the ranks' own output; any other failure names the first failed rank and exits 1.
"""

from __future__ import annotations

import logging
import sys

from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from megatron_train import cli
from megatron_train.train import EXIT_BAD_CONFIG, EXIT_STOPPED_EARLY

# The exit codes a rank gives after reporting for itself.
_REPORTED = (EXIT_BAD_CONFIG, EXIT_STOPPED_EARLY)


class _QuietReportedExits(logging.Filter):
    """Drops the agent's "failed (exitcode: N)" line for the codes ranks report themselves."""

    def filter(self, record: logging.LogRecord) -> bool:
        reported = record.msg.startswith("failed (exitcode") and record.args and record.args[0] in _REPORTED
        return not reported


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_QuietReportedExits())
    try:
        run(args)
    except ChildFailedError as err:
        codes = {failure.exitcode for failure in err.failures.values()}
        if len(codes) == 1 and codes <= set(_REPORTED):
            return codes.pop()
        rank, first = err.get_first_failure()
        cli.report(f"rank {rank} failed first, with exit code {first.exitcode}; its output is above")
        return 1
    except SignalException as err:
        # The agent passed the signal on to the ranks, which saved and reported for themselves.
        return 128 + int(err.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
