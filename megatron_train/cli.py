"""What every command-line tool does around its work: bad input -> one line and exit 2."""

from __future__ import annotations

import sys
from collections.abc import Callable

from megatron_train import runtime
from megatron_train.errors import BAD_INPUT

EXIT_BAD_INPUT = 2


def run(body: Callable[[], None]) -> int:
    """Run ``body``; a bad-input error becomes ``error: ...`` on stderr and exit code 2. Any process
    group ``body`` started is torn down on every path."""
    try:
        body()
    except BAD_INPUT as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    finally:
        runtime.shutdown()
    return 0
