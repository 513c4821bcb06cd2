"""bench/report.py: every step's command is one that exists, a step's output reaches its log and the terminal, a
failed step is reported and the next one still runs."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import report  # noqa: E402


def test_list_names_an_existing_script_for_every_step(tmp_path):
    done = subprocess.run([sys.executable, str(BENCH / "report.py"), "--list", "--out", str(tmp_path)],
                          capture_output=True, text=True, check=True)
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    assert list(lines) == list(report.STEPS)
    for step, command in lines.items():
        if step != "cold-start":
            script = command.split()[1]
            assert os.path.isfile(script), (step, command)
    assert not any(tmp_path.iterdir())  # --list runs nothing


def test_an_unknown_step_is_refused_by_name():
    done = subprocess.run([sys.executable, str(BENCH / "report.py"), "--steps", "engine,speed"],
                          capture_output=True, text=True)
    assert done.returncode == 2
    assert "--steps: unknown speed" in done.stderr and "cold-start" in done.stderr


def test_a_failed_step_is_logged_and_the_next_runs(tmp_path, monkeypatch, capsys):
    py = sys.executable
    monkeypatch.setattr(report, "STEPS", {
        "first": lambda: [py, "-c", "print('one'); raise SystemExit(3)"],
        "second": lambda: [py, "-c", "print('two')"],
    })
    monkeypatch.setattr(report, "BENCH", BENCH)
    assert report.main(["--out", str(tmp_path)]) == 1
    assert (tmp_path / "first.log").read_text().splitlines()[-1] == "one"
    assert (tmp_path / "second.log").read_text().splitlines()[-1] == "two"
    assert "CPU " in (tmp_path / "machine.log").read_text()  # the CPU the figures belong to
    summary = capsys.readouterr().out.split("[report] summary")[1]
    assert "first       FAILED (exit 3)" in summary and "second      ok" in summary


@pytest.mark.parametrize("rc", [0, 5])
def test_main_exits_nonzero_only_when_a_step_failed(tmp_path, monkeypatch, rc):
    monkeypatch.setattr(report, "STEPS", {"only": lambda: [sys.executable, "-c", f"raise SystemExit({rc})"]})
    assert report.main(["--out", str(tmp_path)]) == (1 if rc else 0)


def test_the_cold_start_venv_is_made_and_filled_outside_the_checkout(tmp_path, monkeypatch):
    """Each command of the cold-start step's set-up runs in its own folder: `python -m pip` run in the checkout puts
    the checkout first on sys.path, and a fresh venv's python then imports the checkout's operator/ in place of the
    standard library's operator module (pip fails before it starts)."""
    calls = []

    def run(args, **kwargs):
        calls.append((args, kwargs))
        if "wheel" in args:  # the wheel the install then takes
            wheels = Path(args[args.index("-w") + 1])
            wheels.mkdir(parents=True, exist_ok=True)
            (wheels / "cpuserve-0.1.0-py3-none-linux_x86_64.whl").touch()
        return subprocess.CompletedProcess(args, 0)

    monkeypatch.setattr(report.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(report.subprocess, "run", run)
    command = report.wheel_venv()
    assert [args[1:3] for args, _ in calls] == [["-m", "pip"], ["-m", "venv"], ["-m", "pip"], ["-m", "pip"]]
    root = report.ROOT.resolve()
    for args, kwargs in calls:
        cwd = Path(kwargs["cwd"]).resolve()
        assert kwargs["check"] and root not in (cwd, *cwd.parents), (args, kwargs)
    assert any(str(report.CONSTRAINTS) in args for args, _ in calls)
    assert command[command.index("--cpuserve") + 1].startswith(str(tmp_path))
