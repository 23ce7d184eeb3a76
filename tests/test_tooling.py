"""Tools that treat a folder named ``build`` as output must not skip the source root ``build/``.

Each test fails when its fix is undone: ``build/__init__.py`` added back (PyPA's ``build`` is
shadowed), ``norecursedirs`` removed from pytest.ini (pytest's default skips ``build``), ruff's
``exclude`` removed from pyproject.toml (ruff's default skips ``build``), or the ``!/build/``
re-include removed from .gitignore (GitHub's Python template ignores ``build/``). PyPA ``build``
and ruff are pinned in requirements.lock (``./run.sh`` installs them).
"""

from __future__ import annotations

import fnmatch
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE = "build/precision_pipeline/pipeline.py"


def _python(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}  # cwd first on sys.path, as for a user
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)


def _require(module: str) -> None:
    out = _python("-c", f"import importlib.util as u, sys; s = u.find_spec({module!r}); "
                        "sys.exit(0 if s and s.origin else 3)")
    if out.returncode != 0:  # not found, or only as a namespace package (the source root build/)
        pytest.fail(f"{module} is not installed: it is pinned in requirements.lock; run ./run.sh "
                    f"(or pip install -r requirements.lock)")


def test_python_m_build_is_pypa_build_in_the_repository_root():
    _require("build")
    assert not (ROOT / "build" / "__init__.py").exists(), "build/ is a source root, not a package"
    out = _python("-m", "build", "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: python -m build")
    assert "--sdist" in out.stdout and "--wheel" in out.stdout


def test_pytest_recurses_into_build(pytestconfig):
    patterns = pytestconfig.getini("norecursedirs")
    assert not [p for p in patterns if fnmatch.fnmatch("build", p)], patterns
    # the other defaults stay
    for name in (".venv", ".git", "dist", "venv", "node_modules", "x.egg", "CVS", "_darcs"):
        assert any(fnmatch.fnmatch(name, p) for p in patterns), name


def test_ruff_lints_the_source_root():
    _require("ruff")
    out = _python("-m", "ruff", "check", "--show-files")
    assert out.returncode == 0, out.stderr
    files = {Path(line.strip()).resolve() for line in out.stdout.splitlines() if line.strip()}
    assert (ROOT / SOURCE).resolve() in files
    assert (ROOT / "build/precision_pipeline/gate/checkpoint_gate.py").resolve() in files
    assert not [f for f in files if ".venv" in f.parts]


def test_ruff_check_passes():
    _require("ruff")
    out = _python("-m", "ruff", "check", "build", "tests", "tasks.py", "benchmarks")
    assert out.returncode == 0, out.stdout + out.stderr


def _ignored(path: str) -> bool:
    # --no-index: judge the path by the ignore rules alone (tracked files are otherwise never "ignored")
    out = subprocess.run(["git", "check-ignore", "--no-index", "-q", path], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode in (0, 1), out.stderr
    return out.returncode == 0


def test_gitignore_keeps_the_source_and_ignores_outputs():
    if subprocess.run(["git", "rev-parse", "--git-dir"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    text = (ROOT / ".gitignore").read_text()
    assert "\nbuild/\n" in text and "\ndist/\n" in text and "\n*.egg-info/\n" in text  # the template is there
    for kept in (SOURCE, "build/precision_pipeline/gate/data/golden_prompts.jsonl", "build/precision_pipeline/spec/x.py"):
        assert not _ignored(kept), kept
    for ignored in ("dist/x", ".venv", "env/x", "x/build/y", "precision_pipeline.egg-info/PKG-INFO",
                    "build/precision_pipeline.egg-info/PKG-INFO", "build/lib/precision_pipeline/x.py",
                    "build/precision_pipeline/__pycache__/x.cpython-311.pyc", "artifacts/x", ".cache"):
        assert _ignored(ignored), ignored
    tracked_but_ignored = subprocess.run(["git", "ls-files", "--cached", "--ignored", "--exclude-standard"], cwd=ROOT,
                                         capture_output=True, text=True).stdout.split()
    assert tracked_but_ignored == []
