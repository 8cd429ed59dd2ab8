"""Quiet by default: the common launch prints no syncbn warning; a bound the user set and DDP outwaits does.

torchrun + ``DistributedDataParallel(model)`` with its defaults + ``convert_sync_batchnorm`` is how
most jobs use SyncBatchNorm: DDP's buffer broadcast then waits up to the process group's timeout
(1800 s) while syncbn's own waits end after 300 s. That limit is stated in the docs and reported as
data (``syncbn.groups.step_bound``), not warned about. A warning (``UnboundedStepWarning``) comes
only where the user chose a bound (``SYNCBN_TIMEOUT``, ``syncbn.set_timeout``) that DDP's broadcast
outwaits, once per process, at the user's line.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import _helpers.preload  # noqa: F401  (what the forked ranks import: imported once, here)
import syncbn
from _helpers.dist_harness import launch
from _helpers.processes import run_in_session

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "_helpers" / "run_ddp_defaults.py"
PACKAGE = str(Path(syncbn.__file__).resolve().parent)
# What Python's default warning display prints: "path:line: Category: message".
WARNING_LINE = re.compile(r"^(?P<file>.+?):(?P<line>\d+): (?P<category>\w+(Warning|Error)): (?P<message>.*)$")


def _torchrun() -> str | None:
    beside = Path(sys.executable).parent / "torchrun"
    return str(beside) if beside.exists() else shutil.which("torchrun")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYNCBN_") and k != "PYTHONWARNINGS"}
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(key, None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def _run_script(tmp_path: Path, **extra: str) -> tuple[list[dict[str, Any]], list[dict[str, str]], str]:
    """Launch the script on 2 ranks; its ranks' JSON lines, the warning lines of stderr, all of stderr."""
    torchrun = _torchrun()
    assert torchrun is not None
    command = [torchrun, "--standalone", "--nproc-per-node", "2", str(SCRIPT)]
    proc = run_in_session(command, env=_env(**extra), cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    found = [m.groupdict() for m in map(WARNING_LINE.match, proc.stderr.splitlines()) if m]
    return ranks, found, proc.stderr


def _user_line() -> int:
    lines = SCRIPT.read_text().splitlines()
    return next(i for i, text in enumerate(lines, 1) if text.rstrip().endswith("# the user's line"))


def _is_syncbns(warning: dict[str, str]) -> bool:
    return (
        warning["file"].startswith(PACKAGE)
        or "syncbn" in warning["message"]
        or warning["category"] in ("UnboundedStepWarning", "ConversionWarning")
    )


@pytest.mark.skipif(_torchrun() is None, reason="torchrun not installed")
def test_torchrun_with_ddp_defaults_prints_no_syncbn_warning_on_any_rank(tmp_path: Path) -> None:
    ranks, found, stderr = _run_script(tmp_path)
    assert [w for w in found if _is_syncbns(w)] == [], stderr
    assert "syncbn:" not in stderr and "UnboundedStepWarning" not in stderr, stderr
    # The limit is still there, as data (the doctor reports it): 1800 s against 300 s, not warned.
    for rank in ranks:
        assert rank["outwaited"] is True, rank
        assert rank["finding"] == {
            "bound": 300.0,
            "bound_source": "default",
            "group_timeout": 1800.0,
            "broadcast_buffers": True,
            "holds_syncbn": True,
        }
    assert ranks[0]["running_mean"] == ranks[1]["running_mean"]


@pytest.mark.skipif(_torchrun() is None, reason="torchrun not installed")
def test_a_syncbn_timeout_ddp_outwaits_is_warned_once_per_rank_at_the_scripts_line(tmp_path: Path) -> None:
    ranks, found, stderr = _run_script(tmp_path, SYNCBN_TIMEOUT="5")
    warned = [w for w in found if w["category"] == "UnboundedStepWarning"]
    assert len(warned) == 2, stderr  # once per process, each rank
    for w in warned:
        assert Path(w["file"]).resolve() == SCRIPT and int(w["line"]) == _user_line(), w
        message = w["message"]
        assert message.startswith("syncbn: SYNCBN_TIMEOUT (5 s)") and "(1800 s)" in message, message
        assert "broadcast_buffers=False" in message and "init_process_group" in message, message
        assert "Robustness page" in message and ".md" not in message and "docs/" not in message, message
    assert [w for w in found if _is_syncbns(w) and w not in warned] == [], stderr
    assert all(r["finding"]["bound_source"] == "SYNCBN_TIMEOUT" for r in ranks)


# --------------------------------------------------------- which cases warn, in one launch of 2 ranks


def _steps(ddp: nn.Module, rank: int) -> list[warnings.WarningMessage]:
    """Two training steps of ``ddp``; the warnings they raised (recorded, every one)."""
    gen = torch.Generator().manual_seed(rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            ddp(torch.randn(4, 3, generator=gen, dtype=torch.float64)).pow(2).sum().backward()  # USER LINE
    return [w for w in caught if issubclass(w.category, syncbn.groups.UnboundedStepWarning)]


def _ddp(group: Any, **options: Any) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).double()
    return nn.parallel.DistributedDataParallel(
        syncbn.convert_sync_batchnorm(model), process_group=group, **options
    )


def _cases(rank: int, world_size: int) -> dict[str, Any]:
    # A group with gloo's default timeout, as init_process_group makes it (the harness's is 30 s).
    long = dist.new_group(list(range(world_size)), timeout=timedelta(seconds=1800))
    out: dict[str, Any] = {}
    syncbn.set_timeout("default")  # no SYNCBN_TIMEOUT in the environment: syncbn's default, 300 s
    quiet = _ddp(long)
    out["default"] = (len(_steps(quiet, rank)), syncbn.groups.step_bound(quiet).outwaited)
    syncbn.set_timeout(2000)  # above the group's timeout: a bound syncbn keeps
    out["above"] = (len(_steps(_ddp(long), rank)),)
    syncbn.set_timeout(None)  # no bound of syncbn's own
    out["none"] = (len(_steps(_ddp(long), rank)),)
    syncbn.set_timeout(2)
    out["no_broadcast"] = (len(_steps(_ddp(long, broadcast_buffers=False), rank)),)
    caught = _steps(_ddp(long), rank)  # the one case: a bound the user set, DDP's broadcast outwaits it
    out["warned"] = [(w.filename, w.lineno, str(w.message)) for w in caught]
    out["once"] = len(_steps(_ddp(long), rank))  # once per process
    syncbn.set_timeout("default")
    return out


def test_only_a_bound_the_user_set_and_ddp_outwaits_warns_at_the_users_line() -> None:
    line = next(
        i for i, t in enumerate(Path(__file__).read_text().splitlines(), 1) if t.endswith("# USER LINE")
    )
    for result in launch(_cases, 2, timeout=120):
        assert result["default"] == (0, True), result  # outwaited, as by default, yet quiet
        assert result["above"] == (0,) and result["none"] == (0,) and result["no_broadcast"] == (0,), result
        assert len(result["warned"]) == 1, result
        filename, lineno, message = result["warned"][0]
        assert (filename, lineno) == (__file__, line), result["warned"]
        assert message.startswith("syncbn: syncbn.set_timeout (2 s)") and "(1800 s)" in message, message
        assert result["once"] == 0


def test_the_first_step_hook_is_traced_without_a_graph_break_and_leaves_at_an_eager_step() -> None:
    # compile(DDP(m)) traces the pre-hook syncbn puts on each DDP model. Popping its handle while
    # traced broke the graph (dynamo cannot hold a hook handle) and dynamo then ran the whole DDP
    # frame eagerly; traced, the hook now does nothing, and the first eager step removes it.
    import torch._dynamo

    from syncbn.groups import _ddp

    torch._dynamo.reset()
    model = nn.Linear(2, 2)
    _ddp._step_hooks[model] = model.register_forward_pre_hook(_ddp._first_step)
    x = torch.randn(3, 2)
    torch.compile(model, backend="eager", fullgraph=True)(x)  # a graph break raises here
    assert model in _ddp._step_hooks and len(model._forward_pre_hooks) == 1
    model(x)
    assert model not in _ddp._step_hooks and len(model._forward_pre_hooks) == 0


class _OwnForward(nn.BatchNorm2d):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input) * 2


class _SyncOwnForward(syncbn.SyncBatchNorm2d):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input) * 2


def _marked(marker: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, text in enumerate(lines, 1) if text.endswith(marker))


def test_conversion_warnings_name_the_users_line_whatever_the_nesting() -> None:
    def model() -> nn.Module:  # the layer left alone sits three modules deep
        return nn.Sequential(nn.Conv2d(3, 4, 1), nn.Sequential(nn.Sequential(_OwnForward(4))))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        syncbn.convert_sync_batchnorm(model())  # CONVERT LINE
        syncbn.SyncBatchNorm.convert_sync_batchnorm(model())  # CLASSMETHOD LINE
        syncbn.revert_sync_batchnorm(nn.Sequential(_SyncOwnForward(4)))  # REVERT LINE
    found = [w for w in caught if issubclass(w.category, syncbn.convert.ConversionWarning)]
    assert [(w.filename, w.lineno) for w in found] == [
        (__file__, _marked("# CONVERT LINE")),
        (__file__, _marked("# CLASSMETHOD LINE")),
        (__file__, _marked("# REVERT LINE")),
    ], [str(w.message) for w in caught]
    assert "'1.0.0'" in str(found[0].message) and "'0'" in str(found[2].message)
    assert not any("docs/" in str(w.message) for w in found)


def test_no_message_names_a_file_a_pip_install_lacks() -> None:
    """String constants of library code, docstrings aside, name no docs file or README (pip has none)."""
    import ast

    found = []
    for path in sorted(Path(PACKAGE).rglob("*.py")):
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                if re.search(r"docs/|\.md\b|README", node.value):
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {node.value[:80]!r}")
    assert found == []
