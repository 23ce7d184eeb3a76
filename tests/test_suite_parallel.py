"""The suite under pytest-xdist (``invoke test`` runs ``-n 2 --dist loadfile``; README "Suite time"): the test
command, the order files are handed out in, the threads per worker and fixtures built once per run."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from tests import conftest

ROOT = Path(__file__).resolve().parents[1]


def test_invoke_test_runs_two_workers_one_file_each_heaviest_first(monkeypatch):
    import tasks

    ran: list[str] = []
    ctx = types.SimpleNamespace(run=lambda cmd, **kw: ran.append(cmd) or types.SimpleNamespace(exited=0))
    tasks.test.body(ctx)
    tasks.test.body(ctx, workers=0, fast=True)
    assert ran[0].endswith("-m pytest -q --durations=15 -n 2 --dist loadfile --no-loadscope-reorder"), ran[0]
    assert " -n " not in ran[1] and ran[1].endswith("-m 'not slow'"), ran[1]  # --workers 0: one process


def test_heaviest_files_exist():
    assert [f for f in conftest.HEAVIEST_FILES if not (ROOT / f).is_file()] == []
    assert conftest.HEAVIEST_FILES[0] == "tests/serving/test_rollout.py"  # the longest file starts with the run


def _item(nodeid: str, slow: bool = False):
    return types.SimpleNamespace(nodeid=nodeid, get_closest_marker=lambda name: object() if slow and name == "slow" else None)


def test_files_are_handed_out_heaviest_first_under_xdist_only(monkeypatch):
    items = [_item("tests/a/test_fast.py::t1"), _item("tests/a/test_fast.py::t2"),
             _item("tests/b/test_one_slow.py::t1", slow=True), _item("tests/b/test_one_slow.py::t2"),
             _item("tests/test_nightly.py::t1", slow=True), _item("tests/c/test_two_slow.py::t1", slow=True),
             _item("tests/c/test_two_slow.py::t2", slow=True), _item("tests/core/test_stages.py::t1"),
             _item("tests/z/test_fast.py::t1")]
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    plain = list(items)
    conftest.pytest_collection_modifyitems(None, plain)
    assert plain == items  # a plain run keeps pytest's order
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.nodeid for i in items] == [
        "tests/core/test_stages.py::t1", "tests/test_nightly.py::t1",          # HEAVIEST_FILES, in its order
        "tests/c/test_two_slow.py::t1", "tests/c/test_two_slow.py::t2",      # then most slow tests first
        "tests/b/test_one_slow.py::t1", "tests/b/test_one_slow.py::t2",      # (a file's tests keep their order)
        "tests/a/test_fast.py::t1", "tests/a/test_fast.py::t2", "tests/z/test_fast.py::t1"]  # then the rest as found


@pytest.mark.parametrize("workers, cores, want", [("2", {0, 1}, "1"), ("3", {0, 1}, "1"), ("2", set(range(8)), "4")])
def test_torch_threads_per_worker(monkeypatch, workers, cores, want):
    for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", workers)
    monkeypatch.setattr(conftest.os, "sched_getaffinity", lambda pid: cores)
    conftest._threads_per_xdist_worker()
    assert [conftest.os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")] == [want] * 3
    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # a value the user set is kept
    conftest._threads_per_xdist_worker()
    assert conftest.os.environ["OMP_NUM_THREADS"] == "7"


def test_threads_untouched_without_xdist(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")  # inherited by a pytest started from a worker: no worker
    conftest._threads_per_xdist_worker()
    assert "OMP_NUM_THREADS" not in conftest.os.environ


def test_once_per_run_builds_once_and_rebuilds_after_a_failure(tmp_path, monkeypatch):
    factory = types.SimpleNamespace(getbasetemp=lambda: tmp_path / "popen-gw1")
    (tmp_path / "popen-gw1").mkdir()
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    calls: list[Path] = []

    def fails(folder: Path):
        (folder / "half").write_text("x")
        raise RuntimeError("broken")

    with pytest.raises(RuntimeError):
        conftest.once_per_run(factory, "thing", fails)

    def make(folder: Path):
        calls.append(folder)
        (folder / "out.txt").write_text("built")

    got = conftest.once_per_run(factory, "thing", make)
    assert got == tmp_path / "once-thing" and calls == [got]  # in the run's shared folder, not the worker's
    assert sorted(p.name for p in got.iterdir()) == ["out.txt"]  # the failed attempt's files are gone
    other = types.SimpleNamespace(getbasetemp=lambda: tmp_path / "popen-gw0")  # another worker: reads it
    assert conftest.once_per_run(other, "thing", make) == got and len(calls) == 1


def test_a_pytest_started_inside_a_worker_is_a_plain_run(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")  # inherited from the worker that started it
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    conftest.pytest_configure(types.SimpleNamespace())
    assert "PYTEST_XDIST_WORKER" not in conftest.os.environ and "PYTEST_XDIST_WORKER_COUNT" not in conftest.os.environ
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    conftest.pytest_configure(types.SimpleNamespace(workerinput={"workerid": "gw0"}))  # a worker keeps it
    assert conftest.os.environ["PYTEST_XDIST_WORKER"] == "gw0"
