"""`invoke probe`'s refusals (exit 2, one line, no traceback); the live runs are in test_observability.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _probe(*args, tmp_path):
    return subprocess.run([sys.executable, "-m", "invoke", "probe", "--repo", str(tmp_path / "none"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_probe_needs_a_profile_or_gate(tmp_path):
    p = _probe("--url", "127.0.0.1:1", tmp_path=tmp_path)
    assert p.returncode == 2 and "--profile" in p.stderr + p.stdout and "Traceback" not in p.stderr


def test_probe_refuses_bad_numbers_before_any_work(tmp_path):
    for args in (("--every", "0"), ("--metrics-port", "70000")):
        p = _probe(*args, "--gate", str(tmp_path / "nogate"), tmp_path=tmp_path)
        assert p.returncode == 2 and args[0] in p.stderr + p.stdout and "Traceback" not in p.stderr, (args, p.stderr)


def test_probe_refuses_a_gate_folder_without_a_gate_run(tmp_path):
    p = _probe("--gate", str(tmp_path), tmp_path=tmp_path)
    assert p.returncode == 2 and "metrics.json" in p.stderr + p.stdout and "Traceback" not in p.stderr
