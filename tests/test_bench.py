"""The bench command and the benchmark scripts run and report what they promise (never timings)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn

import _helpers.preload  # noqa: F401  (what the forked ranks import: imported once, here)
from _helpers.processes import run_in_session
from syncbn.cli import main
from syncbn.cli._bench_report import MANY_FAULTS, TARGETS, allocator_note, format_targets, targets
from syncbn.cli.bench import NaiveSyncBatchNorm, parse_shapes

Capture = pytest.CaptureFixture[str]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")
SPEED = os.path.join(BENCHMARKS, "speed")  # benchmarks/ keeps its scripts in folders by purpose
MEMORY = os.path.join(BENCHMARKS, "memory")
ENV = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _script(folder: str, name: str) -> Any:
    """A benchmark script as a module: its ``main`` runs here, its ranks fork from this process.

    No new interpreter (importing torch and syncbn again is most of a small run's time).
    """
    sys.path.insert(0, folder)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(folder)


def _printed(script: str, argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: Any) -> str:
    """What ``speed/<script>.py``'s ``main()`` (reading ``sys.argv``) prints, run in this process.

    Processes it starts itself import this checkout's ``src`` (``PYTHONPATH``).
    """
    monkeypatch.setattr(sys, "argv", [script, *argv])
    monkeypatch.setenv("PYTHONPATH", ENV["PYTHONPATH"])
    _script(SPEED, script).main()
    return str(capsys.readouterr().out)


def _run(args: list[str], timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """Run a script with this checkout's ``src`` (``run_in_session``: nothing it forks survives)."""
    return run_in_session([sys.executable, *args], env=ENV, cwd=ROOT, timeout=timeout)


@pytest.mark.timeout(240)
def test_bench_command_prints_table_and_writes_json(tmp_path, capfd: Capture) -> None:
    # In this process (`python -m syncbn` exits with main's return value): no interpreter to start,
    # the ranks fork from here and rank 0 prints the report (captured at the file descriptor).
    out = tmp_path / "bench.json"
    shapes = "4x3x5x5,16x4,2x3x2x3x4"
    code = main(
        ["bench", "--world-size", "2", "--shapes", shapes, "--iters", "2", "--warmup", "1"]
        + ["--e2e-steps", "1", "--json", str(out)]
    )
    printed = capfd.readouterr()
    proc = subprocess.CompletedProcess(["bench"], code, printed.out, printed.err)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for column in (
        "s/local",
        "local",
        "2xAR",
        "syncbn",
        "alone",
        "a/local",
        "naive",
        "torch",
        "s/floor",
        "s/naive",
    ):
        assert column in proc.stdout
    for shape in shapes.split(","):
        assert shape in proc.stdout
    data = json.loads(out.read_text())
    assert data["config"]["world_size"] == 2
    assert data["machine"]["torch"] == torch.__version__
    assert [r["shape"] for r in data["results"]] == [list(s) for s in parse_shapes(shapes)]
    for rec in data["results"]:
        methods = {"local", "2xAR", "syncbn", "alone", "naive"}
        assert set(rec["median_ms"]) == methods  # no torch on CPU (the developers' methods: layers.py)
        if sys.platform.startswith("linux"):  # minor page faults per call, counted per thread
            assert set(rec["faults_per_call"]) == methods
            assert all(v >= 0 for v in rec["faults_per_call"].values())
        assert all(v > 0 for v in rec["median_ms"].values())
        assert len(rec["per_rank_median_ms"]) == 2
        ratios = rec["ratios"]
        assert ratios["syncbn_over_floor"] > 0 and ratios["syncbn_over_naive"] > 0
        assert ratios["syncbn_over_torch"] is None
        ms = rec["median_ms"]
        assert ratios["syncbn_over_local"] == pytest.approx(ms["syncbn"] / ms["local"])
        assert ratios["alone_over_local"] == pytest.approx(ms["alone"] / ms["local"])
    assert data["config"]["nets"] == ["deep"]
    e2e = data["e2e"]["deep"]  # with the fused floor, in the same loop
    assert set(data["e2e"]) == {"deep"} and set(e2e["median_ms"]) == {"syncbn", "plain", "fused"}
    ms = e2e["median_ms"]
    assert e2e["syncbn_over_plain"] == pytest.approx(ms["syncbn"] / ms["plain"])
    assert e2e["syncbn_over_fused"] == pytest.approx(ms["syncbn"] / ms["fused"])
    assert e2e["fused_over_plain"] == pytest.approx(ms["fused"] / ms["plain"])
    assert "24 conv3x3(32)-BN-ReLU blocks" in proc.stdout and "syncbn / fused" in proc.stdout
    # The closing targets table: every target, measured where this run could, and the load.
    assert "targets (ratio <= goal" in proc.stdout and "load average (1, 5, 15 min)" in proc.stdout
    targets = data["targets"]
    rows = {r["key"]: r for r in targets["rows"]}
    assert set(rows) == set(TARGETS)
    assert rows["eager_step"]["measured"] == pytest.approx(e2e["syncbn_over_plain"])
    assert rows["floor_deep"]["measured"] == pytest.approx(e2e["syncbn_over_fused"])
    assert rows["small_layers"]["measured"] == max(r["ratios"]["syncbn_over_local"] for r in data["results"])
    assert rows["small_alone"]["measured"] == max(r["ratios"]["alone_over_local"] for r in data["results"])
    not_run = ("compiled_narrow", "compiled_wide", "large_layers", "torch_step", "floor_wide", "floor_resnet")
    for key in not_run:  # no --compiled, CPU, the narrow net only
        assert rows[key]["measured"] is None and rows[key]["met"] is None
    assert len(targets["load_start"]) == 3 and len(targets["load_end"]) == 3
    assert data["compiled"] is None


def _record(shape: tuple[int, ...], ratio: float) -> dict[str, Any]:
    return {"shape": list(shape), "ratios": {"syncbn_over_local": ratio}}


def test_targets_table_from_given_numbers() -> None:
    # The --compiled and CUDA rows without compiling or a GPU: the table from given medians.
    records = [_record((32, 64, 56, 56), 0.95), _record((16, 64, 32, 32), 1.2), _record((8, 32, 8, 8), 1.9)]
    records[2]["ratios"]["alone_over_local"] = 1.4
    e2e = {"deep": {"syncbn": 11.0, "plain": 10.0, "fused": 10.0, "torch": 20.0}}
    e2e["wide"] = {"syncbn": 9.0, "plain": 8.0, "fused": 10.0}
    compiled = {"deep": {"syncbn": 12.0, "plain": 10.0}, "wide": {"syncbn": 10.0, "plain": 10.0}}
    rows = {r["key"]: r for r in targets(records, e2e, compiled)}
    expect = {
        "eager_step": (1.1, True),  # at the goal counts as met
        "floor_deep": (1.1, False),  # against the fused floor, measured in the same loop
        "floor_wide": (0.9, True),
        "small_alone": (1.4, False),
        "compiled_narrow": (1.2, False),
        "compiled_wide": (1.0, True),
        "large_layers": (1.2, False),  # the worst large layer
        "small_layers": (1.9, True),
        "torch_step": (0.55, True),
    }
    for key, (value, met) in expect.items():
        assert rows[key]["measured"] == pytest.approx(value) and rows[key]["met"] is met, key
    assert rows["large_layers"]["detail"] == "32x64x56x56 0.95, 16x64x32x32 1.20"
    assert rows["floor_wide"]["detail"] == "x plain: syncbn 1.125, floor 1.250"
    assert rows["floor_resnet"]["measured"] is None and "--nets resnet" in rows["floor_resnet"]["needs"]
    text = format_targets(list(rows.values()), [0.5, 0.25, 0.125], [1.0, 0.5, 0.25])
    lines = text.splitlines()
    assert lines[0].split() == ["target", "ratio", "goal", "detail"]
    assert len(lines) == 2 + len(TARGETS) + 1
    compiled_line = next(line for line in lines if line.startswith("compiled DDP step, narrow"))
    assert "NOT met" in compiled_line and "1.200" in compiled_line
    assert lines[-1] == "load average (1, 5, 15 min): 0.50 0.25 0.12 at start, 1.00 0.50 0.25 at end"
    # Nothing measured: every row says what it needs.
    empty = format_targets(targets([], None, None), None, None)
    assert empty.count("not run") == len(TARGETS) and "needs --compiled" in empty
    assert empty.endswith("unknown at start, unknown at end")


def test_targets_detail_shows_own_work_and_the_allocator_note_names_the_worst_faults() -> None:
    record = _record((32, 64, 56, 56), 1.3)
    record["ratios"]["alone_over_local"] = 0.9
    rows = {r["key"]: r for r in targets([record], None, None)}
    assert rows["large_layers"]["detail"] == "32x64x56x56 1.30 (alone 0.90)"
    # Faults per call below the threshold, or not counted (no faults_per_call): no note.
    quiet = _record((8, 4), 2.0)
    quiet["faults_per_call"] = {"local": MANY_FAULTS - 1.0, "syncbn": 0.5}
    assert allocator_note([quiet, _record((4, 4), 1.0)]) is None
    many = _record((16, 64, 32, 32), 1.1)
    many["faults_per_call"] = {"local": 700.0, "syncbn": 450.0}
    more = _record((32, 64, 56, 56), 1.0)
    more["faults_per_call"] = {"local": 900.0, "syncbn": 3100.0}
    note = allocator_note([quiet, many, more])
    assert note is not None
    assert "up to 3100 per layer call (32x64x56x56)" in note and "MALLOC_TRIM_THRESHOLD_" in note


def test_bench_single_process_runs_without_a_group(capsys: pytest.CaptureFixture[str]) -> None:
    # No group, no rank process: the command runs in the calling process (here, this one).
    assert main(["bench", "--world-size", "1", "--shapes", "8x2", "--iters", "1", "--warmup", "0"]) == 0
    assert "8x2" in capsys.readouterr().out


def test_bench_rejects_bad_shapes(capsys: pytest.CaptureFixture[str]) -> None:
    # A usage error before anything runs: checked in this process (``python -m syncbn`` exits with
    # main's return value, or argparse's SystemExit code).
    with pytest.raises(SystemExit) as caught:
        main(["bench", "--shapes", "16"])
    assert caught.value.code != 0
    assert "bad shape" in capsys.readouterr().err


def test_scaling_table(tmp_path) -> None:
    out = tmp_path / "scaling.json"
    proc = _run([os.path.join(SPEED, "scaling.py"), "--json", str(out)])
    assert proc.returncode == 0, proc.stderr
    assert "| 1024 | 2048 |" in proc.stdout
    data = json.loads(out.read_text())
    hier = data["hierarchical"]["rows"]
    assert {(r["machines"], r["ranks_per_machine"]) for r in hier} == {
        (m, p) for m in (2, 4, 8, 16, 32, 64) for p in (2, 8, 64)
    }
    for r in hier:
        m, w, c = r["machines"], r["world_size"], r["channels"]
        # The leaders' ring carries one vector per machine: the link bytes follow M, not W.
        assert r["link_bytes"]["hierarchical"] == pytest.approx(2 * (m - 1) / m * 8 * (4 * c + 1))
        assert r["link_bytes"]["flat"] == pytest.approx(2 * (w - 1) / w * 8 * (4 * c + 1))
        assert r["time_us"]["hierarchical"] < r["time_us"]["flat"]
    assert "| 64 | 64 | 4096 |" in proc.stdout
    rows = data["rows"]
    assert {r["world_size"] for r in rows} == {2, 8, 64, 256, 1024}
    assert {r["channels"] for r in rows} == {64, 256, 512, 2048}
    for r in rows:
        c, w = r["channels"], r["world_size"]
        assert r["syncbn"]["collectives"] == 2 and r["torch"]["collectives"] == 2
        # syncbn: a float64 all_reduce of 2C+1 values, then one of 2C; held bytes never grow with W.
        assert r["syncbn"]["result_bytes_held"] == 8 * (4 * c + 1)
        assert r["syncbn"]["sent_bytes"] == pytest.approx(2 * (w - 1) / w * 8 * (4 * c + 1))
        # torch: everyone's float32 [mean, invstd, count] lands on every rank.
        assert r["torch"]["result_bytes_held"] == w * 4 * (2 * c + 1) + 4 * 2 * c
        assert 0 < r["best_syncbn_us"] <= r["syncbn_ring_us"]
    big = [r for r in rows if r["world_size"] == 1024]
    assert all(r["sent_ratio_torch_over_syncbn"] > 100 for r in big)


def test_naive_reference_is_batchnorm_in_one_process() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 3, 4, 4, generator=gen, dtype=torch.float64)
    dy = torch.randn(6, 3, 4, 4, generator=gen, dtype=torch.float64)
    naive, ref = NaiveSyncBatchNorm(3).double(), nn.BatchNorm2d(3).double()
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    naive(x1).backward(dy)
    ref(x2).backward(dy)
    torch.testing.assert_close(x1.grad, x2.grad)
    torch.testing.assert_close(naive.weight.grad, ref.weight.grad)
    torch.testing.assert_close(naive.running_var, ref.running_var)


def test_memory_per_layer_saves_at_most_one_extra_activation() -> None:
    rec = _script(MEMORY, "memory").run_memory([(4, 8, 6, 6)])[0]
    assert rec["local"]["saved_activations"] >= 1.0
    assert rec["syncbn_extra_saved_activations"] <= 1.0
    assert rec["syncbn"]["peak_activations"] <= rec["local"]["peak_activations"] + 1.0


@pytest.mark.timeout(120)
def test_bench_force_sync_on_one_rank(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    # The forced synchronised paths on a group of one: a developer's measurement (benchmarks/speed/layers.py).
    out = tmp_path / "forced.json"
    argv = ["--world-size", "1", "--force-sync", "--shapes", "4x3x4x4", "--iters", "1", "--warmup", "0"]
    assert _script(SPEED, "layers").main([*argv, "--json", str(out)]) == 0
    assert "syncbn and torch forced" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["config"]["force_sync"] is True
    assert data["results"][0]["median_ms"]["syncbn"] > 0


@pytest.mark.timeout(120)
def test_layers_script_reports_the_developer_methods(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "layers.json"
    argv = ["--shapes", "4x3x5x5,16x4", "--iters", "2", "--warmup", "1", "--json", str(out)]
    assert _script(SPEED, "layers").main(argv) == 0
    printed = capsys.readouterr().out
    for column in ("2xAR-shm", "local+AR", "sync-pg", "s/floor-shm", "pg/l+AR", "s/local", "a/local"):
        assert column in printed
    for rec in json.loads(out.read_text())["results"]:
        methods = {"local", "2xAR", "2xAR-shm", "local+AR", "syncbn", "alone", "syncbn-pg", "naive"}
        assert set(rec["median_ms"]) == methods and all(v > 0 for v in rec["median_ms"].values())
        ratios = rec["ratios"]
        assert ratios["syncbn_over_own_floor"] > 0 and ratios["syncbn_pg_over_interleaved_floor"] > 0
        assert ratios["syncbn_over_local"] > 0 and ratios["syncbn_over_floor"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_bench_cuda_without_a_gpu_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--device", "cuda", "--shapes", "4x3"]) == 2  # before any rank starts
    assert "CUDA is not available" in capsys.readouterr().out


@pytest.mark.timeout(300)
def test_e2e_script_reports_both_models(tmp_path) -> None:
    out = tmp_path / "e2e.json"
    argv = ["--steps", "1", "--warmup", "0", "--batch", "2", "--fused-bound", "--json", str(out)]
    assert _script(SPEED, "e2e").main(argv) == 0
    data = json.loads(out.read_text())
    assert set(data["results"]) == {"deep", "resnet"}
    for rec in data["results"].values():
        assert set(rec["median_ms"]) == {"syncbn", "syncbn-pg", "plain", "fused"}
        assert len(rec["per_rank_median_ms"]) == 2
        ms = rec["median_ms"]
        assert rec["syncbn_over_plain"] == pytest.approx(ms["syncbn"] / ms["plain"])
        assert rec["fused_over_plain"] == pytest.approx(ms["fused"] / ms["plain"])


@pytest.mark.timeout(200)
def test_floor_script_reports_the_decomposition(tmp_path) -> None:
    out = tmp_path / "floor.json"
    argv = ["--shapes", "8x4,4x3x2x2", "--steps", "2", "--blocks", "1", "--json", str(out)]
    assert _script(SPEED, "floor").main(argv) == 0
    data = json.loads(out.read_text())
    assert set(data["results"]) == {"8x4", "4x3x2x2"}
    for rec in data["results"].values():
        ms = rec["median_ms"]
        assert set(ms) == {"bn", "py-floor", "own", "2rounds", "fused", "syncbn"}
        assert all(v > 0 for v in ms.values())
        assert rec["fused_over_bn"] == pytest.approx(ms["fused"] / ms["bn"])
        assert rec["floor_over_bn"] == pytest.approx((ms["py-floor"] + ms["2rounds"]) / ms["bn"])
        assert rec["lockstep_ms"] == pytest.approx(ms["syncbn"] - ms["own"] - ms["2rounds"])


def test_skew_script_compares_the_allocators(monkeypatch: pytest.MonkeyPatch, capsys: Capture) -> None:
    # Each allocator runs in fresh processes of the script's own; the parent runs here.
    argv = ["--shapes", "4x3x4x4", "--iters", "3", "--rounds", "1"]
    printed = _printed("skew", argv, monkeypatch, capsys)
    rows = [line.split() for line in printed.splitlines() if "4x3x4x4" in line]
    assert [row[0] for row in rows] == ["glibc", "no-trim"]
    for row in rows:
        local, syncbn, arith, s_local, a_local = map(float, row[2:7])
        assert min(local, syncbn, arith) > 0
        # (the table's times are rounded to microseconds: tiny layers' ratios only roughly agree)
        assert s_local == pytest.approx(syncbn / local, rel=0.05)
        assert a_local == pytest.approx(arith / local, rel=0.05)
        assert 0.0 <= float(row[-1]) <= 1.0  # the share of collectives where one rank waited
    assert "load average" in printed


@pytest.mark.timeout(660)
def test_eager_overhead_script_compares_two_trees(monkeypatch: pytest.MonkeyPatch, capsys: Capture) -> None:
    # Fresh processes, each importing torch: minutes on a loaded 2-core machine (a bound, not a timing).
    src = os.path.join(ROOT, "src")
    argv = ["--src", src, "--src", src, "--rounds", "1", "--shapes", "8x4", "--iters", "1"]
    printed = _printed("eager_overhead", argv, monkeypatch, capsys)
    (row,) = [line.split() for line in printed.splitlines() if line.lstrip().startswith("8x4")]
    assert float(row[1]) > 0 and float(row[2]) > 0
    assert float(row[3]) == pytest.approx(float(row[2]) / float(row[1]), abs=0.002)


class _CountingSum:
    """A group whose sum is the identity, counting the tensors it is handed."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def all_reduce_sum(self, tensor: torch.Tensor, tag: object = None) -> torch.Tensor:
        self.sizes.append(tensor.numel())
        return tensor


def test_fused_bound_is_a_batch_norm_with_the_layers_two_collectives() -> None:
    # The emulated compiled-kernel bound must do a real batch norm's work (its timing stands
    # for one), and hand the group a layer's two buffers: 2C + 1 values forward, 2C backward.
    from syncbn.cli._bench_methods import FusedBoundBatchNorm2d

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 5, 3, 4, generator=gen) * 3 + 2
    dy = torch.randn(6, 5, 3, 4, generator=gen)
    group = _CountingSum()
    bound, ref = FusedBoundBatchNorm2d(5, group), nn.BatchNorm2d(5)  # type: ignore[arg-type]
    with torch.no_grad():
        for layer in (bound, ref):
            layer.weight.copy_(torch.rand(5, generator=torch.Generator().manual_seed(4)) + 0.5)
            layer.bias.copy_(torch.randn(5, generator=torch.Generator().manual_seed(5)))
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = bound(x1), ref(x2)
    y1.backward(dy)
    y2.backward(dy)
    torch.testing.assert_close(y1, y2)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(bound.weight.grad, ref.weight.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(bound.bias.grad, ref.bias.grad, rtol=1e-4, atol=1e-5)
    assert group.sizes == [2 * 5 + 1, 2 * 5]


def test_deep_narrow_net_has_24_small_bn_layers() -> None:
    from syncbn.cli._bench_e2e import deep_narrow

    net = deep_narrow(nn.BatchNorm2d)
    bns = [m for m in net.modules() if isinstance(m, nn.BatchNorm2d)]
    assert len(bns) == 24 and {m.num_features for m in bns} == {32}
    assert net(torch.randn(2, 3, 8, 8)).shape == (2, 10)


@pytest.mark.timeout(200)
def test_breakdown_script_splits_each_collective(tmp_path, capfd: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "breakdown.json"
    variants = "plain,syncbn,plain-noddp,syncbn-noddp,own-noddp,syncbn-spin0"
    argv = ["--rounds", "1", "--steps", "1", "--warmup", "1", "--variants", variants, "--json", str(out)]
    assert _script(SPEED, "breakdown").main(argv) == 0
    printed = capfd.readouterr().out  # printed by rank 0, a forked process
    columns = ("x plain", "outside", "inside", "wait", "frame", "release", "wake-spin", "same-core")
    for column in (*columns, "load average"):
        assert column in printed
    res = json.loads(out.read_text())["results"]
    assert set(res["step_ms"]) == set(variants.split(","))
    assert set(res["rows"]) == {"syncbn", "syncbn-noddp", "syncbn-spin0"}
    for row in res["rows"].values():
        assert row["calls"] == 48  # 24 BN layers, forward and backward: every collective recorded
        assert row["ratio"] > 0 and row["inside_us"] >= row["wait_us"] >= 0
        assert 0 <= row["shared_core"] <= 1
        if "release_us" in row:  # the exchange inside the framed call is found by a private name
            assert row["release_us"] > 0 and row["frame_us"] > 0
    assert res["own_work_per_collective_us"] is not None
    assert res["bare_sum"]["wall_us"] > 0


@pytest.mark.timeout(300)
def test_call_split_script_reports_each_part(monkeypatch: pytest.MonkeyPatch, capsys: Capture) -> None:
    printed = _printed(
        "call_split", ["--shapes", "8x4", "--iters", "2", "--rounds", "1"], monkeypatch, capsys
    )
    rows = {
        line.split()[0]: line.split()
        for line in printed.splitlines()
        if line.startswith("  ") and "x" in line
    }
    for name in ("local", "ops", "ops+fn", "engine", "module"):
        assert float(rows[name][1]) > 0, printed
    assert "engine's Python" in printed
