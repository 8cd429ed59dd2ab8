"""The test suite on the oldest, a middle and the newest torch syncbn supports.

    nox -s torch_range                      # all three, oldest first
    nox -s "torch_range(oldest)"            # torch 2.2.2 only
    nox -s "torch_range(newest)" -- tests/test_property.py -x   # arguments after -- go to pytest

Where pip is capped to the releases on local disk (a constraints file under /etc/xdg/pip),
``PIP_CONFIG_FILE=/dev/null nox -s torch_range`` lets it take the newest from the registry.

Each session is its own virtual environment (``.nox/``, kept between runs:
``nox -r`` skips the installs once they are there) with the registry's torch
wheel of that version, which is a CUDA build of several GB, and the test
dependencies. It runs the project's checks' pytest command against ``src/``.
Not part of ``.ci/run``: the two torch downloads are too large for every run.
The default CI covers the torch pinned there.
"""

from __future__ import annotations

import os

import nox

nox.options.reuse_existing_virtualenvs = True

# Oldest first. The oldest is the lower bound in pyproject.toml (torch 2.1 has no float16
# batch norm on CPU, for nn.BatchNorm either); the newest is the latest release tested.
TORCH = {
    "oldest": ("2.2.2", ["numpy<2"]),  # built against numpy 1.x
    "middle": ("2.8.0", ["numpy"]),
    "newest": ("2.15.0", ["numpy"]),
}

TEST_DEPS = [
    "pytest>=7",
    "pytest-timeout>=2.1",
    "pytest-xdist>=3.5",
    "hypothesis>=6.100",
    "scikit-learn>=1.0",
    "matplotlib>=3.5",
]


@nox.session
@nox.parametrize("version", list(TORCH), ids=list(TORCH))
def torch_range(session: nox.Session, version: str) -> None:
    """Run the test suite on one torch release (``oldest``, ``middle`` or ``newest``)."""
    torch_version, extra = TORCH[version]
    session.install(f"torch=={torch_version}", *extra, *TEST_DEPS)
    session.env["PYTHONPATH"] = os.path.join(os.getcwd(), "src")  # subprocesses import this copy
    session.run("python", "-c", "import torch; print('torch', torch.__version__)")
    session.run("python", "-m", "pytest", "-q", *session.posargs)
