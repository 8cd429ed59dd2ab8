"""Running a command that starts rank processes, so that nothing it started outlives the test."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping, Sequence


def run_in_session(
    command: Sequence[str], *, env: Mapping[str, str], cwd: str | os.PathLike[str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` in a session of its own; past ``timeout``, kill the whole session.

    The commands fork or spawn their ranks: killing only the parent (what ``subprocess.run`` does
    on a timeout) would leave the ranks orphaned, still holding cores. The failure then says what
    the command printed. Rank processes left behind after a normal end (e.g. a rank stuck at
    interpreter exit) are killed too.
    """
    proc = subprocess.Popen(
        list(command),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(env),
        cwd=cwd,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{command[0]} did not finish within {timeout:g} s:\n{out}\n{err}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
