"""Terminal output shared by the commands: aligned tables, a small progress bar, error messages."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import TextIO

__all__ = ["format_table", "ProgressBar", "format_error", "fail"]


def format_error(value: float) -> str:
    """An error magnitude in 3 significant digits (``0`` for exact zero)."""
    return "0" if value == 0 else f"{value:.2e}"


def fail(message: str, code: int = 2, show: bool = True) -> int:
    """Print ``message`` on stderr (only with ``show``: the main process); return the exit code ``code``."""
    if show:
        print(message, file=sys.stderr)
    return code


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool] = ()) -> str:
    """Rows of strings as an aligned table, a rule under the header; ``right``: per column, right-align it."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    align = list(right) + [False] * (len(headers) - len(right))

    def line(cells: Sequence[str]) -> str:
        parts = [c.rjust(w) if a else c.ljust(w) for c, w, a in zip(cells, widths, align)]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule] + [line(r) for r in rows])


class ProgressBar:
    """A progress bar of ``total`` steps on ``stream`` (stderr): redrawn in place on a terminal (at most
    10 times a second), a line per quarter elsewhere; ``enabled=False`` draws nothing (non-zero ranks)."""

    width = 24  # the bar's characters

    def __init__(self, total: int, label: str, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.total = max(1, total)
        self.label = label
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled
        self.start = time.perf_counter()
        self._last_draw = 0.0
        self._next_quarter = 1
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def _text(self, step: int, info: str) -> str:
        filled = int(self.width * step / self.total)
        bar = "#" * filled + "-" * (self.width - filled)
        elapsed = time.perf_counter() - self.start
        return f"{self.label} [{bar}] {step:>{len(str(self.total))}}/{self.total} {info} {elapsed:5.1f}s"

    def update(self, step: int, info: str = "") -> None:
        """Show that ``step`` of ``total`` steps are done, with ``info`` (e.g. the loss)."""
        if not self.enabled:
            return
        if self._tty:
            now = time.perf_counter()
            if now - self._last_draw >= 0.1 or step >= self.total:
                self._last_draw = now
                self.stream.write("\r" + self._text(step, info) + ("\n" if step >= self.total else ""))
                self.stream.flush()
        elif step * 4 >= self._next_quarter * self.total:
            self._next_quarter = step * 4 // self.total + 1
            self.stream.write(self._text(step, info) + "\n")
            self.stream.flush()
