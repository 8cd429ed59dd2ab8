"""``python -m syncbn doctor --live``: the ranks checked against each other on 2 gloo ranks.

Spawned by the command itself (planted problems: a rank with another layer, another channel
count, other running statistics; groups of one rank; syncbn's bound against DDP's broadcast), and
under torchrun as a user launches it. The collectives and bytes the doctor counts are checked
against the ones a real training step makes.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from _helpers.doctor_models import MODELS, Capture, doctor, problem_lines


def live(tmp_path: Path, capsys: Capture, factory: str, *argv: str) -> tuple[int, str, dict[str, Any]]:
    return doctor(
        tmp_path, capsys, f"{MODELS}:{factory}", "--live", "--world-size", "2", "--timeout", "60", *argv
    )


def test_live_resnet50_passes_and_names_the_transport(tmp_path: Path, capsys: Capture) -> None:
    from syncbn import _shm

    pytest.importorskip("torchvision")
    argv = ("torchvision.models:resnet50", "--live", "--world-size", "2", "--timeout", "60")
    code, out, report = doctor(tmp_path, capsys, *argv, "--input-shape", "2,3,64,64")
    assert code == 0, out
    assert report["findings"] == [] and report["totals"]["synchronised"] == 53
    assert all(layer["calls"] == 1 for layer in report["layers"])  # the forward ran, synchronised
    expected = "shared memory (same machine)" if _shm.supported() else "the gloo process group"
    assert report["live"]["groups"] == [{"ranks": [0, 1], "transport": expected}]
    assert f"group [0, 1]: {expected}" in out
    assert report["live"]["world_size"] == 2 and report["live"]["backend"] == "gloo"
    # Groups of one rank: nothing to send, and the table says which size was chosen.
    code, out, report = live(tmp_path, capsys, "clean", "--input-shape", "2,3,8,8", "--group-size", "1")
    assert code == 0, out
    assert [g["transport"] for g in report["live"]["groups"]] == [
        "no collective (a group of one rank is plain BatchNorm)"
    ] * 2
    assert [r["group_size"] for r in report["group_sizes"] if r["chosen"]] == [1]


def test_live_rank_with_another_layer_is_one_line_per_layer(tmp_path: Path, capsys: Capture) -> None:
    code, out, report = live(tmp_path, capsys, "rank_dependent_layers", "--input-shape", "2,3,8,8")
    assert code == 1
    (line,) = problem_lines(out)
    assert line.startswith("problem: rank 1 has a layer '2.1' (BatchNorm2d(16)), rank 0 has not.")
    assert "Fix: build the same model on every rank" in line
    assert report["live"]["groups"] == []  # models that differ never synchronise here
    code, out, _ = live(tmp_path, capsys, "rank_dependent_channels")
    assert code == 1
    (line,) = problem_lines(out)
    assert "'1.1' is BatchNorm2d(24) on rank 1 and BatchNorm2d(16) on rank 0" in line


def test_live_unequal_running_statistics_name_the_layer_and_the_fix(tmp_path: Path, capsys: Capture) -> None:
    code, out, _ = live(tmp_path, capsys, "rank_dependent_stats")
    assert code == 1
    (line,) = problem_lines(out)
    assert line.startswith(
        "problem: '1.1' has other running statistics than rank 0 (rank 1's running_mean by up to 0.5)"
    )
    assert "syncbn.sync_buffers(model)" in line


def _count_step(rank: int, world_size: int) -> tuple[int, int]:
    """One training step of the clean model on 2 ranks, counting the engine's collectives and bytes."""
    import syncbn
    from _helpers.doctor_models import clean

    model = syncbn.convert_sync_batchnorm(clean())
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(rank))

    def step() -> None:
        out = model(x)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(7)))

    step()  # the first step also sets the group up
    sent: list[int] = []
    inner = syncbn.groups.ProcessGroupSum.all_reduce_sum

    def counting(self: Any, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        sent.append(tensor.numel() * tensor.element_size())
        return inner(self, tensor, *args, **kwargs)

    syncbn.groups.ProcessGroupSum.all_reduce_sum = counting  # type: ignore[method-assign]
    try:
        step()
    finally:
        syncbn.groups.ProcessGroupSum.all_reduce_sum = inner  # type: ignore[method-assign]
    return len(sent), sum(sent)


def test_collectives_and_bytes_are_what_a_real_step_sends(tmp_path: Path, capsys: Capture) -> None:
    from _helpers.dist_harness import launch

    measured = launch(_count_step, 2)
    _, _, report = doctor(tmp_path, capsys, f"{MODELS}:clean", "--input-shape", "2,3,8,8")
    totals = report["totals"]
    assert measured == [(totals["collectives"], totals["payload_bytes"])] * 2
    assert totals["collectives"] == 4  # two layers, one sum each way


@pytest.mark.skipif(
    shutil.which("torchrun") is None and not (Path(sys.executable).parent / "torchrun").exists(),
    reason="torchrun not installed",
)
def test_live_under_torchrun(tmp_path: Path) -> None:
    """The user's launch: every rank exits 1, rank 0 prints the report once."""
    from _helpers.processes import run_in_session

    torchrun = Path(sys.executable).parent / "torchrun"
    root = Path(__file__).resolve().parents[1]
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), str(root / "tests")])
    env["OMP_NUM_THREADS"] = "1"
    command = [str(torchrun if torchrun.exists() else "torchrun"), "--standalone", "--nproc-per-node", "2"]
    command += ["-m", "syncbn", "doctor", f"{MODELS}:rank_dependent_layers", "--live", "--timeout", "60"]
    proc = run_in_session(command, env=env, cwd=tmp_path, timeout=240)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.count("doctor: 1 problem") == 1
    assert "problem: rank 1 has a layer '2.1' (BatchNorm2d(16)), rank 0 has not." in proc.stdout


def test_live_bound_against_ddp_broadcast(
    tmp_path: Path, capsys: Capture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What UnboundedStepWarning used to say: a note for the default bound, a problem for the user's."""
    import syncbn

    # torch's default process-group timeout (1800 s) against syncbn's default bound (300 s): a note.
    code, out, report = doctor(tmp_path, capsys, f"{MODELS}:clean", "--live", "--world-size", "2")
    assert code == 0, out
    assert report["live"] == {
        **report["live"],
        "bound_s": 300.0,
        "bound_source": "default",
        "group_timeout_s": 1800.0,
        "broadcast_buffers": True,
        "outwaited": True,
    }
    (note,) = [f for f in report["findings"] if f["severity"] == "note"]
    assert "DDP's own buffer broadcast" in note["message"] and "broadcast_buffers=False" in note["message"]
    assert "docs/" not in note["message"]  # names the page in words, not a file a pip install lacks
    # A bound the user chose, outwaited by the broadcast: a problem, with both remedies.
    monkeypatch.setenv("SYNCBN_TIMEOUT", "10")
    syncbn.set_timeout("default")  # read the variable again (the ranks inherit it)
    code, out, report = live(tmp_path, capsys, "clean")
    assert code == 1, out
    (line,) = problem_lines(out)
    assert line.startswith("problem: syncbn: SYNCBN_TIMEOUT (10 s) bounds the SyncBatchNorm collectives")
    assert "(60 s)" in line and "init_process_group" in line
    assert report["live"]["bound_source"] == "SYNCBN_TIMEOUT"
    # The job passes broadcast_buffers=False: nothing outwaits syncbn's bound.
    code, out, report = live(tmp_path, capsys, "clean", "--no-broadcast-buffers")
    assert code == 0, out
    assert report["findings"] == [] and report["live"]["outwaited"] is False
