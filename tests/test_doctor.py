"""``python -m syncbn doctor``: the audit of real models and of planted problems.

Real models: torchvision's resnet50 (clean), timm's efficientnet_b0 (``BatchNormAct2d``), an
OpenMMLab-style backbone of mmcv ``ConvModule`` blocks with ``norm_eval``. Planted problems: a
BatchNorm subclass with its own forward, one with extra state, a layer that would see one value
per channel. The bytes the doctor counts are checked against the engine's own packing functions.
The checks across ranks (``--live``) are in test_doctor_live.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from _helpers import torchvision_shim  # noqa: F401 - before torchvision and timm
from _helpers.doctor_models import MODELS, Capture, doctor, problem_lines
from syncbn.cli import main
from syncbn.engine import _math

pytest.importorskip("torchvision")


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
    assert set(report) == {  # the keys docs/doctor.md documents
        "syncbn_version", "torch_version", "model", "input_shape", "batch_size", "world_size",
        "group_size", "layers", "totals", "group_sizes", "live", "findings", "problems",
    }  # fmt: skip
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


def test_factory_kwargs_and_a_model_that_is_one_layer(tmp_path: Path, capsys: Capture) -> None:
    argv = ("torch.nn:BatchNorm2d", "--kwargs", '{"num_features": 4, "momentum": null}')
    code, out, report = doctor(tmp_path, capsys, *argv, "--input-shape", "3,4,5,5")
    assert code == 0, out
    (layer,) = report["layers"]
    assert (layer["name"], layer["converts_to"], layer["channels"]) == ("(root)", "SyncBatchNorm2d", 4)
    assert layer["input_shape"] == [3, 4, 5, 5] and layer["forward_bytes"] == 8 * 9
