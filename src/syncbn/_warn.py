"""Where a warning points: the user's line, the first frame outside syncbn and torch."""

from __future__ import annotations

import os
import sys

import torch

__all__ = ["user_stacklevel"]

# Frames in syncbn's and torch's package directories are not the user's line.
_INTERNAL = (
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
)


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes the caller's ``warnings.warn`` name the user's line.

    The user's line is the first frame, walking out from the caller, whose file lies outside
    syncbn's and torch's package directories (a module's forward reached through
    ``nn.Module.__call__``, DDP and hooks is found however deep it is). The outermost frame when
    every frame is internal.

    Example::

        >>> warnings.warn("syncbn: ...", UserWarning, stacklevel=user_stacklevel())
    """
    frame = sys._getframe(1)  # the function that calls warnings.warn: stacklevel 1
    level = 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame = frame.f_back
        level += 1
    return level
