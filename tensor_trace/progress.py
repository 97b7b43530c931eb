"""Progress lines on a terminal for long work (merge, export, report, compare).

A task writes ``label: done/total (pct%)`` to stderr with ``\\r`` updates, at most ten times a
second, and erases its line when it ends. It is silent when stderr is not a terminal (pipes,
CI logs, notebooks) or after ``set_quiet(True)`` (the CLI's ``--quiet``), so the output of a
command never changes with it. No dependency: one small class.

    from tensor_trace import progress
    with progress.task("merging rank files", total=len(files)) as bar:
        for f in files:
            ...
            bar.advance()
"""

from __future__ import annotations

import contextlib
import sys
import time

_quiet = False
_MIN_INTERVAL_S = 0.1


def set_quiet(quiet: bool) -> None:
    """Silence (True) or allow (False) progress lines in this process."""
    global _quiet
    _quiet = bool(quiet)


def enabled(stream=None) -> bool:
    """Whether progress goes to ``stream`` (default stderr): a terminal, and not quiet."""
    stream = stream or sys.stderr
    if _quiet:
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Task:
    """One line of progress; ``advance(n)`` counts work done, ``total`` may be unknown (None)."""

    def __init__(self, label: str, total: int | None, stream):
        self.label = label
        self.total = total
        self.done = 0
        self._stream = stream
        self._last = 0.0
        self._width = 0

    @classmethod
    def open(cls, label: str, total: int | None = None, stream=None) -> "Task":
        """A task drawing on ``stream`` (default stderr) when progress is enabled there, else a
        silent one; ``close()`` erases its line."""
        stream = stream or sys.stderr
        t = cls(label, total, stream if enabled(stream) else None)
        if t._stream is not None:
            t._draw()
        return t

    def advance(self, n: int = 1) -> None:
        self.done += n
        if self._stream is None:
            return
        now = time.monotonic()
        if now - self._last >= _MIN_INTERVAL_S or (self.total is not None and self.done >= self.total):
            self._last = now
            self._draw()

    def stage(self, label: str, total: int | None = None) -> None:
        """Go on with another label (a later phase of the same work), counting from zero."""
        self.label, self.total, self.done = label, total, 0
        if self._stream is not None:
            self._draw()

    def _draw(self) -> None:
        if self.total:
            pct = min(100, int(100 * self.done / self.total))
            text = f"{self.label}: {self.done:,}/{self.total:,} ({pct}%)"
        else:
            text = f"{self.label}: {self.done:,}" if self.done else f"{self.label}..."
        pad = max(0, self._width - len(text))
        self._width = len(text)
        self._stream.write("\r" + text + " " * pad)
        self._stream.flush()

    def close(self) -> None:
        if self._stream is not None and self._width:
            self._stream.write("\r" + " " * self._width + "\r")
            self._stream.flush()
            self._width = 0


@contextlib.contextmanager
def task(label: str, total: int | None = None, stream=None):
    """A ``Task`` drawing on ``stream`` (default stderr) when progress is enabled there, else a
    silent one; its line is erased on leaving the block."""
    t = Task.open(label, total, stream)
    try:
        yield t
    finally:
        t.close()
