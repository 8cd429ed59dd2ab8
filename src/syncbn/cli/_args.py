"""``argparse`` ``type=`` functions: a bad flag value is a usage error (exit 2) before a rank starts. Each
raises ``ArgumentTypeError("expected ... (got '...')")``, which ``argparse`` prints after the flag."""

from __future__ import annotations

import argparse
import math
import os
from typing import Any, Callable

import torch.distributed as dist

from .. import _config, groups

__all__ = [
    "add_counts",
    "integer",
    "real",
    "seconds",
    "backend",
    "output_file",
    "output_dir",
    "group_size",
    "add_output",
]

# Backends that would not synchronise anything real: never a sensible choice here.
_NOT_REAL = ("undefined", "fake")


def _bounded(
    convert: Callable[[str], Any], kind: str, low: float, high: float | None
) -> Callable[[str], Any]:
    """A ``type=`` for ``convert(text)``, finite and in ``[low, high]`` (no upper end when ``None``)."""

    def shown(v: float) -> str:
        return str(v) if isinstance(v, int) else f"{v:g}"

    wanted = (
        f"{kind} of at least {shown(low)}" if high is None else f"{kind} from {shown(low)} to {shown(high)}"
    )

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            value = math.nan  # refused below, as a value out of range is
        finite = not isinstance(value, float) or math.isfinite(value)  # an int never overflows here
        if not finite or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {wanted} (got {text!r})")
        return value

    return parse


def integer(low: int, high: int | None = None) -> Callable[[str], int]:
    """A ``type=`` for an int in ``[low, high]`` (no upper end when ``None``)."""
    return _bounded(int, "an int", low, high)


def real(low: float, high: float | None = None, kind: str = "a finite number") -> Callable[[str], float]:
    """A ``type=`` for a finite number in ``[low, high]`` (no upper end when ``None``)."""
    return _bounded(float, kind, low, high)


def add_counts(parser: argparse.ArgumentParser, counts: dict[str, tuple[int, int, str]]) -> None:
    """Add integer flags: ``{"--flag": (default, least value, help)}``, each checked by :func:`integer`."""
    for flag, (default, low, text) in counts.items():
        parser.add_argument(flag, type=integer(low), default=default, help=text)


#: A ``type=`` for a timeout in seconds, within syncbn's own bounds (whole milliseconds reach torch,
#: which reads 0 ms as "no timeout"; at most about 31 years).
seconds = real(_config.MIN_TIMEOUT_S, _config.MAX_TIMEOUT_S, "a number of seconds")


def backend(text: str) -> str:
    """A ``type=`` for a ``torch.distributed`` backend that this torch build has (``gloo``, ``nccl``, ...)."""
    name = text.strip().lower()
    if name not in _NOT_REAL and dist.is_available() and dist.is_backend_available(name):
        return name
    known = [b for b in dist.Backend.backend_list if b not in _NOT_REAL]
    available = [b for b in known if dist.is_available() and dist.is_backend_available(b)]
    missing = [b for b in known if b not in available]
    note = f"; not built into this torch: {', '.join(missing)}" if missing else ""
    listed = ", ".join(available) or "none"
    raise argparse.ArgumentTypeError(f"expected a torch.distributed backend: {listed}{note} (got {text!r})")


def output_file(text: str) -> str:
    """A ``type=`` for a file written at the end: not a folder, in a writable folder (``""``: none)."""
    folder = os.path.dirname(os.path.abspath(text))
    if text and os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"expected a file to write, not a folder (got {text!r})")
    if text and not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
        raise argparse.ArgumentTypeError(
            f"expected a file in an existing, writable folder ({folder} is not one) (got {text!r})"
        )
    return text


def add_output(parser: argparse.ArgumentParser, what: str, timeout: float, timeout_help: str) -> None:
    """``--json FILE`` (also write ``what`` as JSON) and ``--timeout`` seconds (default ``timeout``)."""
    parser.add_argument(
        "--json", metavar="FILE", type=output_file, default=None, help=f"also write the {what} as JSON"
    )
    parser.add_argument("--timeout", type=seconds, default=timeout, help=timeout_help)


def output_dir(text: str) -> str:
    """A ``type=`` for a folder the command writes into, created if missing: no file in its way."""
    path = os.path.abspath(text)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)  # the part that exists: it must be a writable folder
    if not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"expected a folder to write into ({path} is a file) (got {text!r})")
    if not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(
            f"expected a folder to write into ({path} is not writable) (got {text!r})"
        )
    return text


def group_size(text: str) -> int | str:
    """A ``type=`` for a ``group_size``: a positive int, or ``'node'`` (the ranks of each machine)."""
    if text == groups.NODE:
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int or {groups.NODE!r} (got {text!r})")
    return value
