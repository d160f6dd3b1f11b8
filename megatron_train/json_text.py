"""JSON text read from files a user gives or a crash may have damaged."""

from __future__ import annotations

import json
import sys
from typing import Any


class NestedTooDeep(json.JSONDecodeError):
    """JSON nested deeper than Python's reader recurses: as malformed as any other for a reader,
    where ``json.loads`` raises a RecursionError."""

    def __init__(self, text: str) -> None:
        message = (
            "it nests arrays or objects deeper than Python's JSON reader goes "
            f"(about {sys.getrecursionlimit()} levels)"
        )
        super().__init__(message, text, 0)
        self.args = (message,)  # no position: the reader gave up wherever it was

    def __reduce__(self) -> tuple:
        return NestedTooDeep, (self.doc,)


def loads(text: str, **options: Any) -> Any:
    """``json.loads(text, **options)``, raising :class:`NestedTooDeep` (a JSONDecodeError) for
    nesting past the recursion limit."""
    try:
        return json.loads(text, **options)
    except RecursionError:
        raise NestedTooDeep(text) from None
