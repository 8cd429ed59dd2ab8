"""The command line as a user runs it: ``python -m syncbn <command>``.

``python -m syncbn`` is ``SystemExit(main())``: most runs call ``main`` in this process (the ranks
fork from it, no interpreter to start); a real process where the process is the point (the exit
code of a usage error, torchrun).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import _helpers.preload  # noqa: F401  (what the forked ranks import: imported once, here)
from _helpers.processes import run_in_session

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]


def _env(extra_path: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(ROOT / "src")] + ([extra_path] if extra_path else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(key, None)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _syncbn(*args: str, cwd: Path, timeout: float = 150, extra_path: str | None = None):
    return run_in_session(
        [sys.executable, "-m", "syncbn", *args], env=_env(extra_path), cwd=cwd, timeout=timeout
    )


def _in_process(tmp: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """``python -m syncbn ARGV`` run in this process (``SystemExit(main())``): its exit code and output.

    Output goes to files, so that what a forked rank prints is kept too (flushed as the rank exits).
    """
    from syncbn.cli import main

    with open(tmp / "stdout", "a") as out, open(tmp / "stderr", "a") as err:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(argv))
    return subprocess.CompletedProcess(
        list(argv), code, (tmp / "stdout").read_text(), (tmp / "stderr").read_text()
    )


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("demo")
    out = tmp / "out"
    return _in_process(tmp, "demo", "--steps", "30", "--batch", "3", "--seed", "1", "--out", str(out)), out


def test_demo_prints_the_table_and_a_progress_bar(demo_run) -> None:
    proc, _ = demo_run
    assert proc.returncode == 0, proc.stderr
    for text in ("train loss", "test accuracy", "max |param - global|", "(reference)"):
        assert text in proc.stdout
    for name in ("local", "syncbn", "global"):
        assert any(line.startswith(name) for line in proc.stdout.splitlines()), proc.stdout
    assert "30/30" in proc.stderr and "[#" in proc.stderr  # the progress bar, drawn per quarter off a tty


def test_demo_writes_png_and_json_with_every_number(demo_run) -> None:
    proc, out = demo_run
    assert proc.returncode == 0, proc.stderr
    png = out / "loss_curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads((out / "results.json").read_text())
    assert report["config"]["steps"] == 30 and report["config"]["batch"] == 3
    assert report["config"]["dtype"] == "float64" and report["world_size"] == 2
    assert set(report["runs"]) == {"local", "syncbn", "global"}
    for run in report["runs"].values():
        assert len(run["losses"]) == 30
        for key in ("final_train_loss", "test_accuracy", "test_loss", "max_param_diff", "seconds"):
            assert isinstance(run[key], float), key
        assert 0.0 <= run["test_accuracy"] <= 1.0


def test_demo_syncbn_matches_the_single_process_run(demo_run) -> None:
    proc, out = demo_run
    assert proc.returncode == 0, proc.stderr
    runs = json.loads((out / "results.json").read_text())["runs"]
    # float64: syncbn on 2 ranks is the one-process global-batch run up to rounding ...
    assert runs["syncbn"]["max_param_diff"] < 1e-10
    assert runs["syncbn"]["max_buffer_diff"] < 1e-10
    assert runs["global"]["max_param_diff"] == 0.0
    for a, b in zip(runs["syncbn"]["losses"], runs["global"]["losses"]):
        assert abs(a - b) < 1e-10
    assert runs["syncbn"]["test_accuracy"] == runs["global"]["test_accuracy"]
    # ... and per-rank BatchNorm is not.
    assert runs["local"]["max_param_diff"] > 1e-4


def test_demo_without_extras_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # In this process (`python -m syncbn` exits with main's return value): sklearn made unimportable.
    from syncbn.cli import main

    monkeypatch.setitem(sys.modules, "sklearn", None)  # `import sklearn` raises ImportError
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "syncbn[demo]" in err and "scikit-learn" in err
    assert not (tmp_path / "syncbn-demo").exists()


@pytest.fixture(scope="module")
def verify_run(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("verify")
    return _in_process(
        tmp, "verify", "--world-size", "2", "--json", str(tmp / "verify.json")
    ), tmp / "verify.json"


def test_verify_passes_and_prints_a_table(verify_run) -> None:
    proc, path = verify_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    names = ("4d-one-empty", "all-empty", "3d-uneven", "float16-input", "channels-last", "bfloat16-input")
    for name in names:
        assert any(line.startswith(name) and line.endswith("PASS") for line in proc.stdout.splitlines()), name
    assert "FAIL" not in proc.stdout
    assert "cases passed (all passed)" in proc.stdout
    report = json.loads(path.read_text())
    assert report["passed"] is True and report["world_size"] == 2 and report["backend"] == "gloo"
    from syncbn import _shm

    expected = "shared memory (same machine)" if _shm.supported() else "the gloo process group"
    assert report["collectives"] == expected
    assert f"collectives went through {expected}" in proc.stdout
    for case in report["cases"]:
        assert case["passed"] and case["worst_error"] <= case["tolerance"]
        assert set(case) >= {"case", "sizes", "dtype", "errors", "tolerance"}


def test_verify_group_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from syncbn.cli import main

    code = main(["verify", "--world-size", "4", "--group-size", "2", "--json", str(tmp_path / "v.json")])
    proc = subprocess.CompletedProcess(["verify"], code, capsys.readouterr().out, "")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 ranks in groups of subgroup(2)" in proc.stdout
    assert "groups (global ranks): [0, 1], [2, 3]" in proc.stdout
    assert "FAIL" not in proc.stdout and "cases passed (all passed)" in proc.stdout
    report = json.loads((tmp_path / "v.json").read_text())
    assert report["passed"] is True and report["group_size"] == 2
    assert [c["sizes"] for c in report["cases"] if c["case"] == "3d-uneven"] == [[1, 2]]  # per group rank
    # The usage errors come before any rank starts: checked in this process (`python -m syncbn`
    # exits with main's return value, and argparse's SystemExit code).
    assert main(["verify", "--world-size", "4", "--group-size", "3"]) == 2
    assert "--group-size must divide the world size 4 (got group size 3)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as caught:
        main(["verify", "--group-size", "x"])
    assert caught.value.code == 2 and "expected a positive int or 'node' (got 'x')" in capsys.readouterr().err


def _torchrun() -> str | None:
    beside = Path(sys.executable).parent / "torchrun"
    return str(beside) if beside.exists() else shutil.which("torchrun")


@pytest.mark.skipif(_torchrun() is None, reason="torchrun not installed")
def test_verify_and_demo_under_torchrun(tmp_path: Path) -> None:
    torchrun = _torchrun()
    assert torchrun is not None
    base = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "syncbn"]

    def launch(*args: str) -> subprocess.CompletedProcess[str]:
        return run_in_session(base + list(args), env=_env(), cwd=tmp_path, timeout=150)

    # A zero tolerance fails every case with any rounding error: the exit code says so.
    proc = launch("verify", "--tolerance-scale", "0")
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert proc.stdout.count("FAILED") == 1, proc.stdout  # rank 0 prints, once
    assert any(line.startswith("all-empty") and line.endswith("PASS") for line in proc.stdout.splitlines())
    assert any(line.startswith("2d-even") and line.endswith("FAIL") for line in proc.stdout.splitlines())

    # --world-size is the launcher's; --no-out writes nothing.
    proc = launch("demo", "--steps", "5", "--batch", "2", "--world-size", "5", "--no-out")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 ranks x 2 images = global batch 4" in proc.stdout
    assert proc.stdout.count("(reference)") == 1
    assert list(tmp_path.iterdir()) == []


# Every numeric flag of every command, and --backend: a bad value is argparse's usage error (exit 2,
# naming the flag and what it takes), before any rank starts. Several once ran and crashed instead.
BAD_VALUES = [
    ("bench", "--world-size", "0", "an int of at least 1"),  # was FileNotFoundError (result.pkl)
    ("bench", "--iters", "0", "an int of at least 1"),  # was StatisticsError
    ("bench", "--iters", "-3", "an int of at least 1"),
    ("bench", "--warmup", "-1", "an int of at least 0"),
    ("bench", "--threads", "0", "an int of at least 1"),  # was RuntimeError from set_num_threads
    ("bench", "--e2e-steps", "-1", "an int of at least 0"),
    ("bench", "--backend", "bogus", "a torch.distributed backend: gloo"),
    ("verify", "--timeout", "0", "a number of seconds from 0.001 to 1e+09"),  # was gloo's RuntimeError
    ("verify", "--timeout", "-1", "a number of seconds from 0.001 to 1e+09"),
    ("verify", "--timeout", "nan", "a number of seconds from 0.001 to 1e+09"),
    ("verify", "--backend", "bogus", "a torch.distributed backend: gloo"),  # was AssertionError
    ("verify", "--backend", "fake", "a torch.distributed backend: gloo"),
    ("verify", "--tolerance-scale", "-1", "a finite number of at least 0"),  # ran, every case failed
    ("verify", "--tolerance-scale", "inf", "a finite number of at least 0"),
    ("verify", "--world-size", "x", "an int of at least 1"),
    ("demo", "--world-size", "0", "an int of at least 1"),
    ("demo", "--steps", "0", "an int of at least 1"),
    ("demo", "--batch", "-2", "an int of at least 1"),
    ("demo", "--lr", "-0.1", "a finite number of at least 0"),
    ("demo", "--lr", "nan", "a finite number of at least 0"),
    ("demo", "--seed", str(2**64), "an int from -9223372036854775808 to 18446744073709551615"),
    # Output paths: once a traceback after the whole run (verify's cases, minutes of bench).
    ("verify", "--json", "/nonexistent-syncbn/x.json", "a file in an existing, writable folder"),
    ("verify", "--json", os.sep, "a file to write, not a folder"),
    ("bench", "--json", "/nonexistent-syncbn/x.json", "a file in an existing, writable folder"),
]


@pytest.mark.parametrize(("command", "flag", "value", "wanted"), BAD_VALUES)
def test_a_bad_flag_value_is_a_usage_error(
    command: str, flag: str, value: str, wanted: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from syncbn.cli import main

    with pytest.raises(SystemExit) as caught:
        main([command, flag, value])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"syncbn {command}: error: argument {flag}: expected {wanted}"), err
    assert line.endswith(f"(got {value!r})"), err


def test_a_demo_output_folder_in_the_way_of_a_file_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from syncbn.cli import main

    (tmp_path / "taken").write_text("")
    for out in ("taken", os.path.join("taken", "sub")):  # was NotADirectoryError/FileExistsError at the end
        path = str(tmp_path / out)
        assert main(["demo", "--steps", "1", "--out", path]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [
            f"syncbn demo: error: argument --out: expected a folder to write into "
            f"({tmp_path / 'taken'} is a file) (got {path!r})"
        ], err


def test_accepted_flag_values_parse() -> None:
    import argparse

    from syncbn.cli import bench, demo, verify

    def parse(module: Any, *argv: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        return parser.parse_args(list(argv))

    args = parse(
        verify, "--backend", "GLOO", "--tolerance-scale", "0", "--timeout", "0.001", "--world-size", "1"
    )
    assert (args.backend, args.tolerance_scale, args.timeout, args.world_size) == ("gloo", 0.0, 0.001, 1)
    args = parse(bench, "--warmup", "0", "--e2e-steps", "0", "--iters", "1", "--threads", "2")
    assert (args.warmup, args.e2e_steps, args.iters, args.threads) == (0, 0, 1, 2)
    args = parse(demo, "--seed", "-1", "--lr", "0", "--steps", "1", "--batch", "1")
    assert (args.seed, args.lr, args.steps, args.batch) == (-1, 0.0, 1, 1)


def test_a_bad_flag_value_exits_2_before_any_rank_starts(tmp_path: Path) -> None:
    proc = _syncbn("bench", "--world-size", "0", cwd=tmp_path, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "argument --world-size: expected an int of at least 1 (got '0')" in proc.stderr


def test_table_and_progress_bar_helpers() -> None:
    import io

    from syncbn.cli._output import ProgressBar, format_error, format_table

    table = format_table(["name", "error"], [["a", "1.00e-03"], ["long name", "0"]], right=[False, True])
    expected = ["name          error", "---------  --------", "a          1.00e-03", "long name         0"]
    assert table.splitlines() == expected
    assert format_error(0.0) == "0" and format_error(1.234e-7) == "1.23e-07"
    stream = io.StringIO()
    bar = ProgressBar(8, "run", stream=stream)
    for step in range(1, 9):
        bar.update(step, f"loss {step}")
    printed = stream.getvalue().splitlines()
    assert len(printed) == 4 and printed[-1].startswith("run [" + "#" * 24 + "] 8/8 loss 8")
    quiet = io.StringIO()
    ProgressBar(8, "run", stream=quiet, enabled=False).update(8)
    assert quiet.getvalue() == ""


def test_demo_schedule_walks_through_shuffled_epochs() -> None:
    from syncbn.cli.demo import schedule

    order = schedule(10, steps=7, global_batch=3, seed=0)
    assert order.shape == (7, 3)
    flat = order.flatten().tolist()
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))
    assert order.equal(schedule(10, steps=7, global_batch=3, seed=0))
