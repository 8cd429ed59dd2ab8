"""``python -m syncbn doctor``: the audit of real models and of planted problems.

Real models: torchvision's resnet50 (clean), timm's efficientnet_b0 (``BatchNormAct2d``), an
OpenMMLab-style backbone of mmcv ``ConvModule`` blocks with ``norm_eval``. Planted problems: a
BatchNorm subclass with its own forward, one with extra state, a layer that would see one value
per channel. The bytes the doctor counts are checked against the engine's own packing functions.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from _helpers import torchvision_shim  # noqa: F401 - before torchvision and timm
from syncbn.cli import main
from syncbn.engine import _math

pytest.importorskip("torchvision")

MODELS = "_helpers.doctor_models"
Capture = pytest.CaptureFixture[str]


def doctor(tmp_path: Path, capsys: Capture, *argv: str) -> tuple[int, str, dict[str, Any]]:
    """Run ``syncbn doctor *argv --json``; (exit code, stdout, the JSON report)."""
    report = tmp_path / "doctor.json"
    code = main(["doctor", *argv, "--json", str(report)])
    out = capsys.readouterr().out
    return code, out, json.loads(report.read_text())


def problem_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("problem: ")]


def engine_bytes(channels: int, dtype: torch.dtype = torch.float32) -> tuple[int, int]:
    """What the engine's packing functions make for one layer: (forward, backward) bytes."""
    mean, var = torch.zeros(channels, dtype=dtype), torch.ones(channels, dtype=dtype)
    packed = _math.pack_moments(4, mean, var, channels=channels, device=torch.device("cpu"))
    acc = _math.accumulation_dtype(dtype)
    grads = _math.pack_grad_sums(torch.zeros(channels, dtype=acc), torch.zeros(channels, dtype=acc))
    return packed.numel() * packed.element_size(), grads.numel() * grads.element_size()


def test_resnet50_is_clean_and_every_layer_is_counted(tmp_path: Path, capsys: Capture) -> None:
    import torchvision

    code, out, report = doctor(
        tmp_path, capsys, "torchvision.models:resnet50", "--input-shape", "4,3,64,64", "--world-size", "8"
    )
    assert code == 0, out
    assert problem_lines(out) == [] and report["problems"] == 0
    plain = {n: m for n, m in torchvision.models.resnet50().named_modules() if isinstance(m, nn.BatchNorm2d)}
    layers = report["layers"]
    assert [layer["name"] for layer in layers] == list(plain)  # the model's order
    assert {(layer["cls"], layer["converts_to"], layer["state"]) for layer in layers} == {
        ("BatchNorm2d", "SyncBatchNorm2d", "synchronised")
    }
    payload = 0
    for layer in layers:
        forward, backward = engine_bytes(plain[layer["name"]].num_features)
        assert (layer["channels"], layer["calls"]) == (plain[layer["name"]].num_features, 1)
        assert (layer["forward_bytes"], layer["backward_bytes"]) == (forward, backward)
        payload += forward + backward
    totals = report["totals"]
    assert totals == {
        **totals,
        "layers": 53,
        "synchronised": 53,
        "collectives": 106,
        "forward_collectives": 53,
        "payload_bytes": payload,
    }
    assert layers[0]["input_shape"] == [4, 64, 32, 32]  # after the stem's stride-2 conv
    # The group-size table: divisors of 8, the default group (all 8 ranks) chosen.
    rows = {r["group_size"]: r for r in report["group_sizes"]}
    assert sorted(rows) == [1, 2, 4, 8] and rows[8]["chosen"] and rows[2]["group_batch"] == 8
    assert rows[1]["fewest_values_per_channel"] == 4 * 2 * 2  # layer4 sees 2x2 positions
    assert "106 all_reduce calls" in out and "layer4.0.bn2" in out


def test_timm_model_maps_batchnormact_and_finds_a_one_value_layer(tmp_path: Path, capsys: Capture) -> None:
    pytest.importorskip("timm")
    spec = "timm.models.efficientnet:efficientnet_b0"
    code, out, report = doctor(tmp_path, capsys, spec, "--input-shape", "1,3,64,64", "--world-size", "2")
    assert code == 0, out
    assert {(layer["cls"], layer["converts_to"]) for layer in report["layers"]} == {
        ("BatchNormAct2d", "SyncBatchNormAct2d")
    }
    # At 32x32 the last stage sees 1x1 positions: one sample per rank in groups of one rank cannot train.
    code, out, report = doctor(
        tmp_path, capsys, spec, "--input-shape", "1,3,32,32", "--world-size", "2", "--group-size", "1"
    )
    assert code == 1
    (line,) = problem_lines(out)
    assert "sees 1 value per channel in a group of 1 rank" in line and "group_size of 2 or more" in line
    two = next(r for r in report["group_sizes"] if r["group_size"] == 2)
    assert two["fewest_values_per_channel"] == 2 and not two["chosen"]


def test_mmcv_norm_eval_backbone_is_noted_not_failed(tmp_path: Path, capsys: Capture) -> None:
    pytest.importorskip("mmcv")
    code, out, report = doctor(tmp_path, capsys, f"{MODELS}:mmcv_norm_eval", "--input-shape", "2,3,8,8")
    assert code == 0, out
    states = {layer["name"]: (layer["cls"], layer["state"]) for layer in report["layers"]}
    assert states == {
        "backbone.stem.bn": ("BatchNorm2d", "eval after train()"),
        "backbone.stage1.0.bn": ("BatchNorm2d", "eval after train()"),
        "backbone.stage1.1.bn": ("BatchNorm2d", "eval after train()"),
        "neck.bn": ("SyncBatchNorm", "synchronised"),  # mmcv's "SyncBN" is torch's class
    }
    (note,) = [f for f in report["findings"] if f["severity"] == "note"]
    assert note["message"].startswith(
        "3 layers ('backbone.stem.bn', 'backbone.stage1.0.bn', 'backbone.stage1.1.bn')"
    )
    assert "norm_eval" in note["message"]
    assert report["totals"]["collectives"] == 2  # the neck only


def test_subclass_with_its_own_forward_is_one_problem_line(tmp_path: Path, capsys: Capture) -> None:
    code, out, report = doctor(tmp_path, capsys, f"{MODELS}:custom_forward")
    assert code == 1
    (line,) = problem_lines(out)
    assert line.startswith("problem: '1.1' (ScaledBN) is left unconverted")
    assert "derive ScaledBN from syncbn.SyncBatchNorm2d" in line and "_syncbn_plain_forward" in line
    assert [layer["state"] for layer in report["layers"]] == ["synchronised", "left unconverted"]
    assert report["totals"]["collectives"] == 2


def test_subclass_with_extra_state_names_what_conversion_drops(tmp_path: Path, capsys: Capture) -> None:
    code, out, _ = doctor(tmp_path, capsys, f"{MODELS}:extra_state")
    assert code == 1
    (line,) = problem_lines(out)
    assert line.startswith("problem: '1.1' (TaggedBN) converts to SyncBatchNorm2d, which drops")
    assert "get_extra_state, set_extra_state, describe" in line


def test_a_forward_that_does_not_fit_the_shape_is_a_problem(tmp_path: Path, capsys: Capture) -> None:
    code, out, _ = doctor(tmp_path, capsys, f"{MODELS}:clean", "--input-shape", "2,5,8,8")
    assert code == 1
    (line,) = problem_lines(out)
    assert "a training forward of a batch of shape (2, 5, 8, 8) failed" in line and "--input-shape" in line


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["nocolon"], "expected MODULE:FACTORY"),
        (["no_such_module_xyz:f"], "cannot load"),
        (["torch:float32"], "expected 'torch:float32' to be a callable"),
        (["torch.nn:Identity", "--kwargs", "[1]"], "expected a JSON object"),
        (["torch.nn:Identity", "--input-shape", "4"], "expected N,C"),
        (["torch.nn:Identity", "--group-size", "node"], "needs --live"),
        (["torch.nn:Identity", "--world-size", "4", "--group-size", "3"], "must divide"),
    ],
)
def test_usage_errors_exit_2(argv: list[str], expected: str, capsys: Capture) -> None:
    try:
        code = main(["doctor", *argv])
    except SystemExit as exc:  # argparse's own usage error
        code = int(exc.code or 0)
    assert code == 2
    assert expected in capsys.readouterr().err


# ---- --live: the ranks against each other (2 gloo ranks, spawned by the command or by torchrun) ----


def live(tmp_path: Path, capsys: Capture, factory: str, *argv: str) -> tuple[int, str, dict[str, Any]]:
    return doctor(
        tmp_path, capsys, f"{MODELS}:{factory}", "--live", "--world-size", "2", "--timeout", "60", *argv
    )


def test_live_clean_model_passes_and_names_the_transport(tmp_path: Path, capsys: Capture) -> None:
    from syncbn import _shm

    code, out, report = live(tmp_path, capsys, "clean", "--input-shape", "2,3,8,8")
    assert code == 0, out
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
