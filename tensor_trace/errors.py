"""One error base class; the CLI turns it into a one-line message on stderr and an exit code."""


class TensorTraceError(Exception):
    """An error the user can act on. ``exit_code`` follows the contract: 1 no answer, 2 bad input."""

    exit_code = 2


class BadInput(TensorTraceError):
    """Bad usage or unreadable input (exit 2)."""

    exit_code = 2


class NoAnswer(TensorTraceError):
    """The question has no answer in this trace (exit 1)."""

    exit_code = 1
