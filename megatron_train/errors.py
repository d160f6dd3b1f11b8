"""The bad-input errors: each message names the problem and the fix, and every entry point turns
them into one line on stderr and exit code 2 (no traceback)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad config value; ``key`` is the dotted path of the offending option."""

    def __init__(self, key: str, problem: str, fix: str) -> None:
        self.key, self.problem, self.fix = key, problem, fix
        super().__init__(f"config error at '{key}': {problem}. Fix: {fix}")

    def __reduce__(self) -> tuple:
        # Raised in a worker process, it reaches the parent pickled.
        return ConfigError, (self.key, self.problem, self.fix)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used, with the reason and what to do."""


class ConversionError(ValueError):
    """Input a conversion cannot handle; the message names the problem and the fix."""


BAD_INPUT = (ConfigError, CheckpointError, ConversionError)


def reason(err: BaseException) -> str:
    """A library exception's message as one line of at most 300 characters, for an error line."""
    return " ".join(str(err).split())[:300] or type(err).__name__
