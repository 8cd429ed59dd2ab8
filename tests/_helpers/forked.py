"""Run a launcher's main process as a fork of the test process, bounded, nothing left behind.

A script that starts rank processes (a Lightning Trainer, accelerate's ``notebook_launcher``)
would pay a fresh interpreter and its imports (torch, Lightning: seconds of CPU) just to be the
process that starts the ranks. :func:`run_forked` forks the test process instead, with those
imports already made, and calls the script's entry point there. The child runs in a session of
its own with its output in a log file: past the deadline, or once it ends, the whole session is
killed, so no rank it started outlives the test.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from typing import Any, Callable


def run_forked(fn: Callable[..., Any], *args: Any, log: str, timeout: float) -> None:
    """Call ``fn(*args)`` in a forked child; raise with its log's tail if it fails or outlasts ``timeout``.

    Args:
        fn: what the child runs (its return value is dropped); an exception makes it exit 1.
        *args: passed to ``fn`` (inherited through fork, need not pickle).
        log: file that receives the child's stdout and stderr (and those of what it starts).
        timeout: seconds before the child's session is killed.

    Raises:
        AssertionError: the child exited with a status other than 0, or not within ``timeout``.
    """
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            os.setsid()
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            sys.stdout = sys.stderr = open(fd, "w", buffering=1, closefd=False)
            fn(*args)
            code = 0
        except BaseException:  # noqa: BLE001 - reported through the log
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            os._exit(code)
    deadline = time.monotonic() + timeout
    status = None
    while status is None and time.monotonic() < deadline:
        done, code = os.waitpid(pid, os.WNOHANG)
        status = os.waitstatus_to_exitcode(code) if done else None
        time.sleep(0.05)
    try:
        os.killpg(pid, signal.SIGKILL)  # whatever it left behind (or everything, past the deadline)
    except ProcessLookupError:
        pass
    if status is None:
        os.waitpid(pid, 0)
    if status != 0:
        with open(log) as f:
            text = f.read()
        ended = f"did not end within {timeout:g} s" if status is None else f"exited with {status}"
        raise AssertionError(f"{getattr(fn, '__name__', fn)} {ended}:\n{text[-6000:]}")
