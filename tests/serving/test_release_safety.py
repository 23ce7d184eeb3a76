"""Releases that never serve the wrong thing (issue 25, serving half), without a server.

Retention and rollback ignore aborted candidates; a damaged releases.json stops every command with
the file and the fix; leftovers of killed writes are removed; CLI refusals of bad serving inputs;
TIME-WAIT ports; read-only repositories (the read-only file system is simulated where the write
would fail: as root, chmod cannot make a directory unwritable).
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from precision_pipeline.core.errors import UserError
from precision_pipeline.serving import (pack, release, release_configs, release_live, release_recover, release_rollout,
                                        release_state, release_units, rollout)
from precision_pipeline.spec.profile import load_profile

ROOT = Path(__file__).resolve().parents[2]
INVOKE = [sys.executable, "-m", "invoke"]


def inv(*args):
    return subprocess.run([*INVOKE, *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, COLUMNS="200"))


@pytest.fixture(scope="module")
def units4(tmp_path_factory, default_model_dir):
    """Four packed repositories of the default model with different engine hashes (A, B, C, D)."""
    from tests.serving.test_pack import make_plan, with_limits

    base = tmp_path_factory.mktemp("units4")
    prof = load_profile("bf16-h100")
    out = []
    for i, mb in enumerate((64, 32, 16, 8)):
        d = base / f"build{i}"
        out.append(pack.pack_repository(with_limits(make_plan(prof), max_batch_size=mb), prof, Path(default_model_dir),
                                        d / "no-checkpoint", d / "engine", False, d / "model_repository", str(d)))
    assert len({r.engine_unit for r in out}) == 4
    return out


def serving_repo(tmp_path, first, keep=2) -> Path:
    repo = tmp_path / "serving" / "model_repository"
    release_recover.init_serving_repo(repo, first.out_dir, profile="bf16-h100", keep_releases=keep)
    return repo


def flip_middle_byte(path: Path) -> None:
    """Invert the middle byte of ``path`` in place, its size kept (a second call puts it back)."""
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))


def rejected_rollout(repo, unit_src, failed_check="probe:kl_p99", percent=5):
    """A rollout of ``unit_src`` that its checks rejected at ``percent`` % (no server: the files only)."""
    release_rollout.begin_rollout(repo, unit_src.out_dir, steps=(percent, 100))
    release_rollout.set_rollout_percent(repo, percent)
    return release_rollout.abort_rollout(repo, failed_check=failed_check, by="test (automatic)")


def on_disk(repo):
    return sorted(p.name for p in repo.iterdir() if pack.is_unit(p.name))


# ---- item 1: retention never keeps an aborted candidate in place of a release


def test_aborted_candidate_never_pushes_out_a_release(tmp_path, units4):
    a, b, c, d = (u.engine_unit for u in units4)
    repo = serving_repo(tmp_path, units4[0], keep=2)
    release.promote(repo, units4[1].out_dir)          # B current, A previous
    rejected_rollout(repo, units4[2], failed_check="manual abort")  # C aborted
    t = release.promote(repo, units4[3].out_dir)      # D current: keep B and A (2 previous); C goes
    st = release_state.read_state(repo)
    assert on_disk(repo) == sorted([a, b, d]) and t["removed"] == [c]
    assert sorted(r["unit"] for r in st["releases"]) == sorted([a, b, d])
    assert release_state.current_order(st) == [d, b, a]
    release.rollback(repo, to=a)                      # A's unit and record are still usable
    assert release_state.read_state(repo)["current"] == a


# ---- item 5: a rejected candidate is never a rollback target


def test_rejected_candidate_is_never_a_rollback_target(tmp_path, units4):
    a, b, c, _ = (u.engine_unit for u in units4)
    repo = serving_repo(tmp_path, units4[0])
    rejected_rollout(repo, units4[2])                 # C rejected by the probe at 5 %
    assert release_state.rejected_units(release_state.read_state(repo)) == {c: "probe:kl_p99 at 5 %"}
    with pytest.raises(UserError, match="no previous release"):
        release.rollback(repo)                        # the only other unit on disk is the rejected one
    with pytest.raises(UserError, match=r"rolled back \(probe:kl_p99 at 5 %\)") as ei:
        release.rollback(repo, to=c)
    assert ei.value.problems[0].field == "--to"
    release.promote(repo, units4[1].out_dir)          # B current; the previous release is A, never C
    assert release.rollback(repo)["unit"] == a
    assert release_state.read_state(repo)["current"] == a and c not in on_disk(repo)  # retention dropped C


def test_a_candidate_rolled_out_later_is_a_release_again(tmp_path, units4):
    a, _, c, _ = (u.engine_unit for u in units4)
    repo = serving_repo(tmp_path, units4[0])
    rejected_rollout(repo, units4[2])
    release_rollout.begin_rollout(repo, units4[2].out_dir, steps=(100,))
    release_rollout.finish_rollout(repo)                      # C passed this time: current
    assert release_state.rejected_units(release_state.read_state(repo)) == {}
    assert release.rollback(repo)["unit"] == a and release.rollback(repo)["unit"] == c


# ---- item 17: a damaged releases.json


@pytest.mark.parametrize("damage", ["truncate", "not-a-record"])
def test_damaged_releases_json_is_refused_and_never_overwritten(tmp_path, units4, damage):
    repo = serving_repo(tmp_path, units4[0])
    release.promote(repo, units4[1].out_dir)          # a write: releases.json.prev exists
    path = release_state.state_path(repo)
    text = path.read_text()
    bad = text[: len(text) // 2] if damage == "truncate" else "[1, 2]\n"
    path.write_text(bad)
    calls = [lambda: release_state.read_state(repo), lambda: release.rollback(repo),
             lambda: release.promote(repo, units4[2].out_dir), lambda: release_recover.recover(repo),
             lambda: release_rollout.begin_rollout(repo, units4[2].out_dir, steps=(100,))]
    for call in calls:
        with pytest.raises(UserError) as ei:
            call()
        p = ei.value.problems[0]
        assert p.field == str(path) and "damaged" in p.reason and "changed nothing" in p.reason
        assert f"cp {path}.prev {path}" in p.fix
    assert path.read_text() == bad                    # never overwritten
    assert json.loads(Path(f"{path}.prev").read_text())["current"] == units4[1].engine_unit
    r = inv("releases", "--repo", str(repo))
    assert r.returncode == 2 and "Traceback" not in r.stdout + r.stderr
    assert str(path) in (r.stdout + r.stderr) and "damaged" in (r.stdout + r.stderr)


def test_a_fifo_or_device_as_releases_json_is_refused_not_waited_on(tmp_path):
    """Found re-trying issue 25 item 16: ``mkfifo releases.json`` hung every command on the repository (the read
    waits for a writer for ever) and a link to /dev/zero filled memory. Refused as damaged, before it is opened."""
    repo = tmp_path / "serving" / "model_repository"
    repo.mkdir(parents=True)
    path = release_state.state_path(repo)
    for make in (lambda: os.mkfifo(path), lambda: path.symlink_to("/dev/zero")):
        make()
        signal.signal(signal.SIGALRM, lambda *a: pytest.fail("read_state waited on the file"))
        signal.alarm(10)
        try:
            with pytest.raises(UserError) as ei:
                release_state.read_state(repo)
        finally:
            signal.alarm(0)
        p = ei.value.problems[0]
        assert p.field == str(path) and p.reason == (
            f"is {'a FIFO (named pipe)' if path.is_fifo() else 'a device'}, not a file, so the current release is "
            "unknown; this command changed nothing.")
        assert p.fix == f"remove it (`rm {path}`), then restore {path} from a backup."  # no .prev here
        path.unlink()
    # hostile s17 F2: the fix said `cp releases.json.prev releases.json`, which hangs on a FIFO and copies into a folder
    prev = path.with_name(path.name + release_state.PREV_SUFFIX)
    prev.write_text(json.dumps({"current": "tensorrt_llm_aaaaaaaaaaaa"}))
    path.mkdir()
    with pytest.raises(UserError) as ei:
        release_state.read_state(repo)
    assert ei.value.problems[0].reason.startswith("is a folder, not a file")
    assert ei.value.problems[0].fix == (f"remove it (`rmdir {path}` (or move it away)), then restore the state before "
                                        f"the last change: `cp {prev} {path}`.")


# ---- item 20: leftovers of killed writes


def test_recover_removes_leftovers_of_killed_writes(tmp_path, units4):
    repo = serving_repo(tmp_path, units4[0])
    parent = repo.parent
    planted = [parent / ".releases.json.k2j3h4.tmp", parent / ".releases.json.prev.4242.tmp",
               parent / "..releases.lock.json.ab12cd.tmp", repo / "tensorrt_llm_bls" / ".route.json.x1y2.tmp",
               repo / "ensemble" / ".config.pbtxt.q9w8.tmp"]
    for p in planted:  # what a kill -9 in the middle of atomic_write_bytes leaves (mkstemp names)
        p.write_text("{")
    fixed = release_recover.recover(repo)
    assert [p.name for p in planted if p.exists()] == []
    assert any("leftover temporary" in f for f in fixed)
    assert sorted(p.name for p in parent.iterdir()) == [".releases.lock", "model_repository", "releases.json"]
    release.promote(repo, units4[1].out_dir)          # a promote leaves only the state and its .prev
    assert sorted(p.name for p in parent.iterdir()) == [".releases.lock", "model_repository", "releases.json",
                                                        "releases.json.prev"]


def test_stale_shared_memory_regions_are_removed_unless_mapped(tmp_path):
    from precision_pipeline.serving.triton_server import SHM_PREFIX, clean_stale_shm

    shm = Path("/dev/shm")
    stale, used, other = (shm / f"{SHM_PREFIX}test{os.getpid()}_{n}" for n in ("stale", "used", "x"))
    foreign = shm / f"not_ours_{os.getpid()}"
    for p in (stale, used, foreign):
        p.write_bytes(b"\0" * 4096)
    try:
        with open(used, "r+b") as f, mmap.mmap(f.fileno(), 4096) as m:  # a live server's region: mapped
            m[0] = 1
            assert clean_stale_shm(f"test{os.getpid()}_", min_age_s=3600) == []  # too young to be judged
            assert clean_stale_shm(f"test{os.getpid()}_", min_age_s=0) == [stale.name]
            assert used.exists() and foreign.exists() and not stale.exists() and not other.exists()
    finally:
        for p in (stale, used, foreign):
            p.unlink(missing_ok=True)


# ---- items 15 / 17: refusals of bad serving inputs


@pytest.mark.parametrize("text", ["5,,100", "5,100,", ",100"])
def test_steps_with_an_empty_step_are_refused(text):
    with pytest.raises(UserError, match="has an empty step") as ei:
        rollout.parse_steps(text)
    assert ei.value.problems[0].field == "--steps"
    assert rollout.parse_steps("5,20,100") == (5, 20, 100)


def test_a_copy_of_the_repository_is_refused_with_the_originals_server(tmp_path, units4):
    """Hostile round: `cp -a` of a serving repository carries its identity and its absolute tokenizer_dir, so
    both matched the original's server; a rollback on the copy then switched and unloaded the original's
    live models (every request 404). The copy is refused before anything is loaded."""
    import shutil

    from tests.serving.test_release_planted import RecordingServer

    repo_a = serving_repo(tmp_path, units4[0])
    release.promote(repo_a, units4[1].out_dir)
    copy = tmp_path / "copy" / "model_repository"
    shutil.copytree(repo_a.parent, copy.parent)
    srv = RecordingServer(repo_a, ready={"ensemble", "preprocessing", units4[1].engine_unit})
    release_live.verify_server(repo_a, srv)  # the original: accepted
    before = release_state.state_path(copy).read_text()
    for call in (lambda: release_live.verify_server(copy, srv), lambda: release.rollback(copy, server=srv)):
        with pytest.raises(UserError, match="is a copy or a move") as ei:
            call()
        assert ei.value.problems[0].field == "--repo"
    assert srv.calls == [] and release_state.state_path(copy).read_text() == before
    from precision_pipeline.serving import triton_server as ts  # hostile s15c T21: serve of the copy, refused too

    with pytest.raises(UserError, match="is a copy or a move .* a server of it would load the original's files") as ei:
        ts.serve(copy, http_port=1, grpc_port=2, metrics_port=3, block=False)
    assert ei.value.problems[0].field == "--repo"


def test_a_rollback_target_that_does_not_load_is_refused_not_a_traceback(tmp_path, units4):
    """Hostile round: a kept release damaged on disk (its checkpoint truncated through the build output's hard
    link) failed to load on `rollback --to`: exit 1 with a traceback. It is a refusal; nothing is switched."""
    from tests.serving.test_release_planted import RecordingServer

    repo = serving_repo(tmp_path, units4[0])
    release.promote(repo, units4[1].out_dir)
    a, b = units4[0].engine_unit, units4[1].engine_unit
    before = release_state.state_path(repo).read_text()
    srv = RecordingServer(repo, ready={"ensemble", "preprocessing", b}, fail_load=a)
    with pytest.raises(UserError, match="does not load") as ei:
        release.rollback(repo, to=a, server=srv)
    assert ei.value.problems[0].field == "--to" and release_state.state_path(repo).read_text() == before
    c = units4[2].engine_unit  # the same for promote and rollout of a unit the server refuses (exit 2, no switch)
    for call in (lambda: release.promote(repo, units4[2].out_dir, server=srv),
                 lambda: release_rollout.begin_rollout(repo, units4[2].out_dir, server=srv, steps=(100,))):
        srv.fail_load = c
        with pytest.raises(UserError, match="does not load") as ei:
            call()
        assert ei.value.problems[0].field == "--out" and release_configs.current_of_configs(repo) == (b, b)
    assert release_state.read_state(repo)["current"] == b and "rollout" not in release_state.read_state(repo)
    assert [x[:2] for x in srv.calls if x[0] == "load"] == [("load", a), ("load", c), ("load", c)]


def test_a_folder_that_is_no_serving_repository_is_never_offered_for_deletion(units4):
    """Hostile round: `promote --repo /` said 'fix: delete / (or move it away) and promote again'."""
    with pytest.raises(UserError) as ei:
        release_recover.init_serving_repo(Path("/"), units4[0].out_dir, profile="bf16-h100")
    p = ei.value.problems[0]
    assert "not a serving repository" in p.reason and "delete /" not in p.fix and "new directory as --repo" in p.fix


def test_probe_of_the_ensemble_is_never_recorded(tmp_path, units4):
    repo = serving_repo(tmp_path, units4[0])
    before = release_state.state_path(repo).read_text()
    with pytest.raises(UserError, match="is not a unit") as ei:
        release_state.record_probe(repo, "ensemble", {"passed": True, "ms": 1.0})
    assert ei.value.problems[0].field == "--unit" and release_state.state_path(repo).read_text() == before
    release_state.check_probe_unit("llm_api_0123456789ab")  # an LLM-API unit is probed (its text probe) and recorded
    for bad in ("llm_api_0123456789aX", "tensorrt_llm_bls", "llm_api_0123456789abc"):
        with pytest.raises(UserError, match="is not a unit"):
            release_state.check_probe_unit(bad)
    r = inv("probe", "--unit", "ensemble", "--gate", "/nonexistent/gate", "--repo", str(repo))
    assert r.returncode == 2 and "--unit:" in (r.stdout + r.stderr) and "Traceback" not in r.stdout + r.stderr


@pytest.mark.parametrize("args, flag", [
    (["releases", "--repo", "/nonexistent/serving/model_repository"], "--repo"),
    (["releases", "--repo", "/"], "--repo"),  # hostile round #16: exit 0 with an empty state
    (["rollout", "--profile", "fp8-h100", "--metrics-port", "abc"], "--metrics-port"),
    (["rollout", "--abort", "--metrics-port", "70000"], "--metrics-port"),
    (["build", "--profile", "fp8-h100", "--repo-root", "/" + "a" * 5000, "--out", "/nonexistent-dir/x"], "--repo-root"),
    (["build", "--profile", "fp8-h100", "--repo-root", "/" + "b" * 300 + "/x", "--out", "/nonexistent-dir/x"], "--repo-root"),
])
def test_bad_serving_values_exit_2(args, flag, invoke_here):
    r = (inv if args[0] == "build" and "a" * 5000 in args[4] else invoke_here)(*args)  # one in a new process
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"{flag}:" in (r.stdout + r.stderr) and "Traceback" not in r.stdout + r.stderr
    if args[:3] == ["releases", "--repo", "/"]:
        assert "/ is not a serving repository: there is no /releases.json beside it" in (r.stdout + r.stderr)
    assert len((r.stdout + r.stderr)) < 2000  # the 5,000 characters are not echoed back


@pytest.mark.parametrize("flags, flag, says", [
    (["--steps", "0,100"], "--steps", ""), (["--steps", "100,5"], "--steps", ""), (["--steps", "5.5,100"], "--steps", ""),
    (["--hold", "nan"], "--hold", "'nan' is not a number of seconds in 0..86400"), (["--hold", "-1"], "--hold", ""),
    (["--hold", "1e309"], "--hold", ""), (["--probe-prompts", "0"], "--probe-prompts", "")])
def test_rollout_flags_are_refused_before_the_build_is_read(flags, flag, says, invoke_here):
    """Found re-trying issue 25 item 15: `--steps`/`--hold` were checked only after the build was opened, so a bad
    value was first answered with the build's problem (fix that, then hear of the flag)."""
    r = invoke_here("rollout", "--profile", "no-such-profile-x", *flags)
    assert r.returncode == 2 and f"{flag}:" in (r.stdout + r.stderr) and says in (r.stdout + r.stderr), r.stdout + r.stderr
    assert "--profile:" not in (r.stdout + r.stderr) and "Traceback" not in r.stdout + r.stderr


# ---- item 18: TIME-WAIT ports, read-only repositories


def test_a_port_with_only_time_wait_sockets_is_free():
    from precision_pipeline.serving.triton_server import TritonServer, free_port

    srv_sock = socket.socket()
    # as tritonserver's listeners (libevent's LEV_OPT_REUSEABLE, gRPC): Linux lets a new bind through a
    # TIME-WAIT socket only when both have SO_REUSEADDR, and the accepted sockets inherit it
    srv_sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv_sock.bind(("127.0.0.1", 0))
    srv_sock.listen(1)
    port = srv_sock.getsockname()[1]
    cli = socket.create_connection(("127.0.0.1", port))
    conn, _ = srv_sock.accept()
    conn.close()                        # the server side closes first: its end goes to TIME-WAIT on `port`
    time.sleep(0.1)
    cli.close()
    srv_sock.close()
    ss = subprocess.run(["ss", "-tan", f"sport = :{port}"], capture_output=True, text=True).stdout
    assert "TIME-WAIT" in ss, ss
    srv = TritonServer(Path("."), http_port=port, grpc_port=free_port(), metrics_port=free_port())
    assert srv.ports_in_use() == []
    with socket.socket() as listening:  # a listening socket still counts
        listening.bind(("127.0.0.1", 0))
        listening.listen(1)
        srv.http_port = listening.getsockname()[1]
        assert srv.ports_in_use() == [("--http-port", srv.http_port)]


def _read_only(*_a, **_k):
    raise OSError(errno.EROFS, os.strerror(errno.EROFS), "/srv/ro/.releases.lock")


def test_probe_result_is_kept_when_releases_json_cannot_be_written(tmp_path, units4, monkeypatch):
    from precision_pipeline.serving import probe

    monkeypatch.setenv("PRECISION_CACHE_DIR", str(tmp_path / "cache"))
    repo = serving_repo(tmp_path, units4[0])
    unit = units4[0].engine_unit
    summary = {"unit": unit, "kl_p99": 0.25, "top1": 0.96, "passed": True, "ms": 12.0}

    class Res:
        passed = True

        def summary(self):
            return summary

    monkeypatch.setattr(probe, "run_probe", lambda *a, **k: Res())
    monkeypatch.setattr(release_state, "lock", _read_only)
    rec = probe.probe_and_record(None, unit, None, repo_dir=repo, profile="bf16-h100")
    path = probe.elsewhere_path(repo)
    assert rec["recorded_in"] == str(path) and "Read-only file system" in rec["not_recorded"]
    line = json.loads(path.read_text().splitlines()[-1])
    assert line["probe"] == summary and line["unit"] == unit and line["repo"] == str(repo.resolve())
    assert line["action"] == "probe" and line["profile"] == "bf16-h100"


def test_serve_of_a_read_only_repository(tmp_path, units4, monkeypatch, capsys):
    from precision_pipeline.serving import triton_server as ts

    repo = serving_repo(tmp_path, units4[0])
    started = []
    monkeypatch.setattr(release_recover, "recover", _read_only)
    monkeypatch.setattr(ts.TritonServer, "start", lambda self: started.append(self.models) or setattr(self, "start_s", 0.0))
    monkeypatch.setenv("PRECISION_CACHE_DIR", str(tmp_path / "cache"))
    srv = ts.serve(repo, http_port=1, grpc_port=2, metrics_port=3, block=False)
    assert started == [release_state.serving_models(repo, release_state.read_state(repo))]
    assert "read-only" in capsys.readouterr().out and srv.log_file == tmp_path / "cache" / "logs" / "tritonserver-1.log"
    release_configs.point_bls(repo, units4[1].engine_unit)    # an interrupted switch: needs a recovery it cannot write
    with pytest.raises(UserError, match="is read-only .* needs a recovery") as ei:
        ts.serve(repo, http_port=1, grpc_port=2, metrics_port=3, block=False)
    assert "writable" in ei.value.problems[0].fix and len(started) == 1


@pytest.mark.parametrize("name, says", [("my repos", "contains a space"), ("café", "non-ASCII character 'é' (U+00E9)")])
def test_serve_refuses_a_repository_path_the_stubs_cannot_start_from(tmp_path, name, says, invoke_here, monkeypatch):
    """Issue 25 item 13, the serve side: a repository moved after its build to a path with a space (or non-ASCII)
    was started and waited on until the start timeout (the Python stubs' command line splits the path). Refused on
    --repo before recovery, ports or the server."""
    from precision_pipeline.serving import triton_server as ts

    started = []

    def start(self):
        started.append(self.model_repository)
        raise RuntimeError("the server was started")
    monkeypatch.setattr(ts.TritonServer, "start", start)
    repo = tmp_path / name / "model_repository"
    repo.mkdir(parents=True)
    with pytest.raises(UserError) as ei:
        ts.serve(repo, http_port=1, grpc_port=2, metrics_port=3, block=False)
    p = ei.value.problems[0]
    assert p.field == "--repo" and says in p.reason and "unquoted" in p.reason
    assert p.fix.startswith("serve a repository at a path of ASCII letters") and "nothing was started" in p.fix
    r = invoke_here("serve", "--repo", str(repo), "--http-port", "18000", "--grpc-port", "18001", "--metrics-port", "18002")
    assert r.returncode == 2 and "--repo:" in (r.stdout + r.stderr) and says in (r.stdout + r.stderr), r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr and started == []
    assert sorted(q.name for q in repo.parent.iterdir()) == ["model_repository"]  # nothing written beside it


# ---- items 15 / 20: `invoke serve` when its tritonserver dies; its log


def _live(port: int) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/live", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


@pytest.mark.slow
def test_serve_exits_non_zero_when_its_server_dies(tmp_path):
    """`invoke serve` of an empty repository; kill -9 of its tritonserver ends the task with exit 1, the
    server's log tail and no traceback. The log is the per-port file, not a new temporary file."""
    from precision_pipeline.serving.triton_server import free_port, serve_log_path

    repo = tmp_path / "repo"
    repo.mkdir()
    ports = [free_port(), free_port(), free_port()]
    tmp = tmp_path / "tmp"  # its own TMPDIR: another test's server may have a temporary log in /tmp meanwhile
    tmp.mkdir()
    proc = subprocess.Popen([*INVOKE, "serve", "--repo", str(repo), "--http-port", str(ports[0]), "--grpc-port",
                             str(ports[1]), "--metrics-port", str(ports[2])], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=dict(os.environ, COLUMNS="200", TMPDIR=str(tmp)))
    said = []
    try:
        while not said or not said[-1].startswith("  log "):  # serving: its endpoints printed (live alone is still
            said.append(proc.stdout.readline())               # its start-up, which says "did not start" instead)
            assert said[-1] or proc.poll() is None, "".join(said)
        assert _live(ports[0])
        servers = [c for c in _children(proc.pid) if Path(f"/proc/{c}/comm").read_text().strip() == "tritonserver"]
        os.kill(servers[0], signal.SIGKILL)
        proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(said) + proc.stdout.read()
    assert proc.returncode == 1, out
    assert "tritonserver was killed by signal 9" in out and "Traceback" not in out
    log = serve_log_path(ports[0])
    try:
        assert str(log) in out and log.is_file()
        assert not list(tmp.glob("tritonserver-*.log"))  # no temporary log left behind
    finally:
        log.unlink(missing_ok=True)


def test_a_rollout_aborted_from_another_shell_exits_3(monkeypatch, tmp_path, capsys):
    """`invoke rollout` whose rollout another shell aborted: not promoted, so exit 3 (as a rollback)."""
    import importlib.util

    from invoke import Exit

    from precision_pipeline.serving import triton_server

    spec = importlib.util.spec_from_file_location("tasks_under_test", ROOT / "tasks.py")
    tasks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tasks)

    class Srv:
        http_port, http_url = 8000, "127.0.0.1:8000"

    from precision_pipeline.serving import build_output

    class Built:  # what the typed build reader gives (serving/build_output.py has its own tests)
        profile, out_dir, packed, ref = load_profile("bf16-h100"), tmp_path, tmp_path, "bf16-h100"

        def serving_facts(self):
            return {"image": None, "sm": 90}

        def probe_set(self, prompts):
            return None

    monkeypatch.setattr(build_output, "open_build", lambda profile, out=None: Built())
    from precision_pipeline.serving import acceptance  # what the build holds is checked by its own tests (test_acceptance)

    monkeypatch.setattr(acceptance, "check_promotable", lambda *a, **k: acceptance.Acceptance(gate={}, warnings=[]))
    monkeypatch.setattr(release, "read_state", lambda repo: {"current": "tensorrt_llm_000000000000"})
    monkeypatch.setattr(triton_server.TritonServer, "attach", classmethod(lambda cls, url: Srv()))
    monkeypatch.setattr(rollout, "rollout", lambda *a, **k: rollout.RolloutResult("aborted", "tensorrt_llm_c", "tensorrt_llm_s"))
    with pytest.raises(Exit) as ei:
        tasks.rollout.body(None, profile="bf16-h100", steps="5,100", hold="0")
    assert ei.value.code == 3 and "was aborted" in "".join(capsys.readouterr())


@pytest.mark.slow
def test_a_clean_stop_removes_the_servers_own_temporary_log(tmp_path):
    from precision_pipeline.serving.triton_server import TritonServer

    (tmp_path / "repo").mkdir()
    srv = TritonServer(tmp_path / "repo").start()
    log = srv.log_file
    assert log.is_file() and log.name.startswith("tritonserver-")
    assert srv.stop() == 0 and not log.exists()
    kept = TritonServer(tmp_path / "repo", log_file=tmp_path / "mine.log").start()  # a log the caller named stays
    assert kept.stop() == 0 and (tmp_path / "mine.log").is_file()


# ---- the serving repository never shares a file with a build output; a unit's name is its content


def _pack_with_checkpoint(root: Path, profile=None, size=300_000):
    """A packed build output ``root`` whose unit links a (fake) checkpoint ``root/checkpoint`` of ``size`` bytes."""
    from tests.serving.test_pack import make_plan

    prof = profile or load_profile("bf16-h100")
    ck = root / "checkpoint"
    ck.mkdir(parents=True)
    (ck / "config.json").write_text('{"architecture": "LlamaForCausalLM"}')
    (ck / "rank0.safetensors").write_bytes(os.urandom(size))
    return pack.pack_repository(make_plan(prof), prof, Path(default_model()), ck, root / "engine", False,
                                root / "model_repository", str(root))


def default_model():
    from precision_pipeline.spec.default_model import ensure_default_model

    return ensure_default_model()


def _inodes(folder: Path) -> set[tuple[int, int]]:
    return {(p.stat().st_dev, p.stat().st_ino) for p in folder.rglob("*") if p.is_file()}


def test_truncating_a_build_output_never_reaches_a_kept_release(tmp_path, units4):
    """Hostile round #66/#107: pack and promote hard-linked the checkpoint, so `truncate -s` of the build output's
    checkpoint/rank0.safetensors also truncated the release kept in the serving repository (a rollback target)."""
    res = _pack_with_checkpoint(tmp_path / "out")
    unit = res.engine_unit
    repo = serving_repo(tmp_path, units4[0])
    release.promote(repo, res.out_dir)               # unit with the checkpoint: current
    release.promote(repo, units4[1].out_dir)         # ... now the kept previous release
    assert not _inodes(repo.parent) & (_inodes(tmp_path / "out") | _inodes(units4[0].out_dir.parent))
    kept = repo / unit / "engine" / "checkpoint" / "rank0.safetensors"
    before = kept.read_bytes()
    os.truncate(tmp_path / "out" / "checkpoint" / "rank0.safetensors", 1000)
    assert kept.stat().st_size == 300_000 and kept.read_bytes() == before
    release.rollback(repo, to=unit)                  # the rollback target is intact
    assert release_state.read_state(repo)["current"] == unit


def test_a_build_output_changed_after_its_pack_is_refused_at_install(tmp_path, units4):
    """Install copies each file of the unit and checks its size and sha256 against pack.json's unit_files."""
    res = _pack_with_checkpoint(tmp_path / "out")
    repo = serving_repo(tmp_path, units4[0])
    before = release_state.state_path(repo).read_text()
    rank0 = tmp_path / "out" / "checkpoint" / "rank0.safetensors"
    os.truncate(rank0, 100_000)
    with pytest.raises(UserError) as ei:
        release.promote(repo, res.out_dir)
    p = ei.value.problems[0]
    assert p.field == str(res.out_dir / res.engine_unit / "engine" / "checkpoint" / "rank0.safetensors")
    assert "is 100,000 bytes, but pack recorded 300,000 bytes" in p.reason and "invoke build" in p.fix
    assert release_state.state_path(repo).read_text() == before and on_disk(repo) == [units4[0].engine_unit]
    assert not [q.name for q in repo.iterdir() if q.name.startswith(".")]
    with open(rank0, "r+b") as f:                    # same size, other bytes: the sha256 tells
        f.truncate(300_000)
    with pytest.raises(UserError, match="is 300,000 bytes with another sha256, but pack recorded 300,000 bytes"):
        release.promote(repo, res.out_dir)
    assert release_state.state_path(repo).read_text() == before


def test_a_change_to_what_pack_renders_gives_the_unit_another_name(tmp_path):
    """Hostile round #139: a re-pack after a change to the rendered config kept the unit's name (it was the
    engine hash), so promote took the stale folder of that name in the serving repository."""
    from tests.conftest import prof

    a = _pack_with_checkpoint(tmp_path / "a", prof(runtime__max_queue_delay_microseconds=100))
    b = _pack_with_checkpoint(tmp_path / "b", prof(runtime__max_queue_delay_microseconds=200))
    assert a.engine_hash != b.engine_hash            # other checkpoint bytes
    # the same checkpoint bytes and plan, only the rendered config differs: same engine hash, other unit
    shutil.rmtree(tmp_path / "b")
    shutil.copytree(tmp_path / "a" / "checkpoint", tmp_path / "b" / "checkpoint")
    from tests.serving.test_pack import make_plan

    p2 = prof(runtime__max_queue_delay_microseconds=200)
    b = pack.pack_repository(make_plan(p2), p2, Path(default_model()), tmp_path / "b" / "checkpoint",
                             tmp_path / "b" / "engine", False, tmp_path / "b" / "model_repository", str(tmp_path / "a"))
    assert b.engine_hash == a.engine_hash and b.engine_unit != a.engine_unit
    assert b.engine_unit == pack.unit_name(b.unit_key)


def test_a_stale_folder_of_the_units_name_is_replaced_or_refused_when_it_serves(tmp_path, units4):
    """An existing folder of the unit's name is verified (files and config); a stale one is replaced by a
    verified copy, unless it is the unit that serves now (refused, nothing changed)."""
    a, b = units4[0], units4[1]
    repo = serving_repo(tmp_path, a)
    release.promote(repo, b.out_dir)                 # a: kept previous release
    cfg = repo / a.engine_unit / "config.pbtxt"
    good = cfg.read_text()
    release_configs.set_params(cfg, {"kv_cache_free_gpu_mem_fraction": "0.5"})  # a stale render of the same name
    release.promote(repo, a.out_dir)
    assert release_state.read_state(repo)["current"] == a.engine_unit
    assert pack.config_params(release_configs.load_config(cfg))["kv_cache_free_gpu_mem_fraction"] == "0.9"
    assert release_configs.load_config(cfg).SerializeToString(deterministic=True) == \
        pack.parse_model_config(good, "x").SerializeToString(deterministic=True)
    assert not [q.name for q in repo.iterdir() if q.name.startswith(".")]
    ref = repo / a.engine_unit / "engine" / pack.CPU_REFERENCE_FILE
    ref.write_text(ref.read_text() + " ")            # the current unit differs from the build: refused with a server
    before = release_state.state_path(repo).read_text()
    with pytest.raises(UserError, match="it is the unit that serves now") as ei:
        release_units.install_unit(repo, a.out_dir, protect={a.engine_unit}, record={}, live=True)
    assert "engine/cpu_reference.json is" in ei.value.problems[0].reason
    assert release_state.state_path(repo).read_text() == before and ref.read_text().endswith(" ")
    with pytest.raises(UserError, match="is already the current release") as ei:  # files only (hostile s15c T113):
        release.promote(repo, a.out_dir)            # nothing serves it, so the damaged folder is repaired, and said
    assert ei.value.done == (f"the current release {a.engine_unit} is damaged on disk ({a.engine_unit}/engine/"
                             f"cpu_reference.json is {ref.stat().st_size + 1:,} bytes, not the recorded "
                             f"{ref.stat().st_size:,} at its install)",
                             f"the damaged folder of {a.engine_unit} (engine/cpu_reference.json is "
                             f"{ref.stat().st_size + 1:,} bytes, not the recorded {ref.stat().st_size:,}) replaced by a "
                             "verified copy of this build",)
    assert not ref.read_text().endswith(" ") and not [q.name for q in repo.iterdir() if q.name.startswith(".")]


def test_rollback_fallback_without_one_names_the_commands_to_run(tmp_path, units4):
    """Hostile round #38: the fix of `rollback --fallback` with no fallback was 'set one with release.set_fallback()',
    a Python function, not a command."""
    repo = serving_repo(tmp_path, units4[0])
    release.promote(repo, units4[1].out_dir)
    r = inv("rollback", "--repo", str(repo), "--fallback")
    assert r.returncode == 2 and "--fallback: this repository has no fallback release" in (r.stdout + r.stderr), (r.stdout + r.stderr)
    fix = " ".join((r.stdout + r.stderr).split())
    assert f"invoke rollback --repo {repo}" in fix and "invoke build --profile" in fix and "set_fallback" not in fix


def test_a_unit_that_fails_its_smoke_request_is_refused_not_a_traceback(tmp_path, units4, monkeypatch):
    """Hostile round (458128f reverted to RuntimeError): a unit that loads but fails its smoke request made promote
    exit 1 with a traceback. It is a refusal of that unit: exit 2, its name, the server's message, nothing switched."""
    from tritonclient.utils import InferenceServerException

    from tests.serving.test_release_planted import RecordingServer

    repo = serving_repo(tmp_path, units4[0])
    a, b = units4[0].engine_unit, units4[1].engine_unit
    before = release_state.state_path(repo).read_text()
    for err in (RuntimeError(f"smoke test of {b}: empty text"),
                InferenceServerException(f"[400] in ensemble '{b}', decoding failed")):
        def failing(server, unit, **kw):
            raise err
        monkeypatch.setattr(release_live, "smoke_test", failing)
        srv = RecordingServer(repo, ready={"ensemble", "preprocessing", a})
        for call, field in ((lambda: release.promote(repo, units4[1].out_dir, server=srv), "--out"),
                            (lambda: release_rollout.begin_rollout(repo, units4[1].out_dir, server=srv, steps=(100,)), "--out")):
            with pytest.raises(UserError) as ei:
                call()
            p = ei.value.problems[0]
            assert p.field == field and f"{b} loads but fails its smoke request" in p.reason and f"({a} still serves)" in p.reason
            assert str(err)[:30] in p.reason
            assert release_state.state_path(repo).read_text() == before and release_configs.current_of_configs(repo) == (a, a)
            assert ("unload", b) in [x[:2] for x in srv.calls]


def test_a_rollback_whose_previous_release_folder_is_gone_names_it(tmp_path, units4):
    """Hostile s12 F-M: the previous release's folder moved away -> "there is no previous release on disk", although
    the record names it. Now the refusal names the missing unit and the two ways back; nothing changes."""
    a = units4[0].engine_unit
    repo = serving_repo(tmp_path, units4[0])
    release.promote(repo, units4[1].out_dir)
    (repo / a).rename(tmp_path / "elsewhere")
    before = release_state.state_path(repo).read_text()
    with pytest.raises(UserError) as ei:
        release.rollback(repo)
    assert ei.value.message == (f"rollback: the previous release {a} is missing from {repo} (deleted or moved); nothing "
                                "was switched. Fix: restore its folder there, or promote its build again (`invoke promote "
                                "--profile P --out <its build>`).")
    assert release_state.state_path(repo).read_text() == before
    (tmp_path / "elsewhere").rename(repo / a)
    assert release.rollback(repo)["unit"] == a


def test_a_rollback_never_skips_a_missing_previous_release_for_an_older_one(tmp_path, units4):
    """Hostile s16b T163: A, B, C promoted, B's folder deleted by hand: a plain rollback switched to A without a word.
    It is refused, naming B, and offers A by name (--to, which then works); nothing changes before."""
    a, b, c = (u.engine_unit for u in units4[:3])
    repo = serving_repo(tmp_path, units4[0])
    release.promote(repo, units4[1].out_dir)
    release.promote(repo, units4[2].out_dir)
    assert release_state.read_state(repo)["current"] == c
    shutil.rmtree(repo / b)
    before = release_state.state_path(repo).read_text()
    with pytest.raises(UserError) as ei:
        release.rollback(repo)
    p = ei.value.problems[0]
    assert p.reason == f"the previous release {b} is missing from {repo} (deleted or moved); nothing was switched."
    assert p.fix.endswith(f", or roll back past it to the release before it: `invoke rollback --repo {repo} --to {a}`.")
    assert release_state.state_path(repo).read_text() == before and release_configs.current_of_configs(repo) == (c, c)
    assert release.rollback(repo, to=a)["unit"] == a


def test_a_refusal_after_a_recovery_says_what_the_recovery_did(tmp_path, units4, capsys):
    """Hostile s15 F1: a promote of the current release right after a crashed promote (its ensemble and BLS configs
    left on the uncommitted unit) re-pointed them back, then refused "already the current release" with "nothing
    was changed". The refusal now carries what the recovery did (``UserError.done``, attached by the releases lock)
    and the report says so; a refusal with no recovery still says nothing was changed; ``rollout --abort`` with no
    rollout recovers too before it refuses."""
    from precision_pipeline.cli.console import _print_report

    a, b = units4[0].engine_unit, units4[1].engine_unit
    repo = serving_repo(tmp_path, units4[0])
    release.promote(repo, units4[1].out_dir)
    release.rollback(repo)                                   # A current, B a kept release
    for call in (lambda: release.promote(repo, units4[0].out_dir), lambda: release_rollout.abort_rollout(repo)):
        release_configs.point_ensemble(repo, b)                # a crash between the configs' switch and the commit
        release_configs.point_bls(repo, b)
        with pytest.raises(UserError) as ei:
            call()
        assert ei.value.done == (f"ensemble re-pointed at {a}", f"tensorrt_llm_bls re-pointed at {a}")
        assert release_configs.current_of_configs(repo) == (a, a)
        _print_report(ei.value, 2)
        err = capsys.readouterr().err
        assert "refused; before that, the recovery every release command starts with: ensemble re-pointed at" in err
        assert "nothing was changed" not in err
    with pytest.raises(UserError) as ei:                      # nothing to recover: as before
        release.promote(repo, units4[0].out_dir)
    assert ei.value.done == ()
    _print_report(ei.value, 2)
    assert "the input was refused; nothing was changed." in capsys.readouterr().err


def test_a_deleted_current_release_folder_has_ways_out(tmp_path, units4):
    """Hostile s15 F3: with the current release's folder deleted, rollback (plain, --to, --fallback), promote and
    serve all refused with "restore the unit directory or roll back to one that exists", rollback included. Now
    rollback and promote go on (the current unit is left, not read); a promote of its own build reinstalls the folder
    and says so; commands that need it still refuse, naming every way out."""
    a, b, c = (u.engine_unit for u in units4[:3])
    repo = serving_repo(tmp_path, units4[0])
    release.promote(repo, units4[1].out_dir)                     # B current, A kept
    shutil.rmtree(repo / b)
    with pytest.raises(UserError) as ei:                          # a command that needs the current unit
        release.set_fallback(repo, units4[2].out_dir)
    assert ei.value.problems[0].reason == f"the current release {b} is missing from {repo} (its folder deleted or moved), so nothing was re-pointed at it."
    assert f"`invoke rollback --repo {repo}` (the previous one), `--to UNIT` or `--fallback`" in ei.value.problems[0].fix
    with pytest.raises(UserError, match="already the current release") as ei:
        release.promote(repo, units4[1].out_dir)                  # its own build: the folder comes back
    assert ei.value.done == (f"the current release {b} is missing from {repo} (its folder deleted or moved)",
                             f"the folder of {b} reinstalled from this build")
    assert (repo / b / "config.pbtxt").is_file()
    shutil.rmtree(repo / b)
    assert release.rollback(repo)["unit"] == a                    # the previous release
    assert release_state.read_state(repo)["current"] == a and release_configs.current_of_configs(repo) == (a, a)
    release.promote(repo, units4[1].out_dir)
    shutil.rmtree(repo / b)
    assert release.promote(repo, units4[2].out_dir)["unit"] == c  # another build over a missing current
    assert release_configs.current_of_configs(repo) == (c, c)


def test_rollout_abort_without_url_and_without_a_local_server_rewrites_the_files(tmp_path, units4, capsys):
    """Hostile s15 F12: `rollout --abort --repo R` (the emergency stop, typed without --url) was refused "no Triton
    server answers at 127.0.0.1:8000; fix: leave --url out", and the rollout went on to 100 %. Without --url the abort
    now takes the local tritonserver of the repository (``servers_of``), or, with none, rewrites the files only."""
    from precision_pipeline.cli import serving as cli

    a = units4[0].engine_unit
    repo = serving_repo(tmp_path, units4[0])
    release_rollout.begin_rollout(repo, units4[1].out_dir, steps=(50, 100))
    release_rollout.set_rollout_percent(repo, 50)
    assert cli.rollout(abort=True, repo=str(repo)) == 0
    out = capsys.readouterr().out
    assert "no --url and no tritonserver on this machine serves the repository" in out
    assert f"aborted at 50 %: {a} serves all traffic" in out
    assert "rollout" not in release_state.read_state(repo)
    assert json.loads((repo / "tensorrt_llm_bls" / "route.json").read_text()) == {"tensorrt_llm_model_name": a}


def test_serve_of_a_repository_on_a_read_only_mount(tmp_path, units4, monkeypatch, capsys):
    """Hostile s15 F14: on a real read-only mount (``mount --bind -o ro``: a volume mounted readOnly) serve was refused
    at the releases lock ("cannot create the lock file") before the read-only check the README describes. Needs
    ``mount`` (root, as on CI)."""
    import subprocess

    from precision_pipeline.serving import triton_server as ts

    repo = serving_repo(tmp_path, units4[0])
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "--bind", "-o", "ro", str(repo.parent), str(ro)], capture_output=True).returncode:
        pytest.skip("mount --bind -o ro is not permitted here")
    try:
        started = []
        monkeypatch.setattr(ts.TritonServer, "start", lambda self: started.append(self.models) or setattr(self, "start_s", 0.0))
        monkeypatch.setenv("PRECISION_CACHE_DIR", str(tmp_path / "cache"))
        ts.serve(ro / "model_repository", http_port=1, grpc_port=2, metrics_port=3, block=False)
        assert started == [release_state.serving_models(repo, release_state.read_state(repo))]
        assert "read-only (Read-only file system); it agrees with releases.json" in capsys.readouterr().out
    finally:
        subprocess.run(["umount", str(ro)], check=False)


def test_releases_names_files_that_disagree_with_the_record(tmp_path, units4, capsys):
    """Hostile s15 T8/T120, s15b F14: `invoke releases` exited 0 without a word when a kill between the ensemble and
    the BLS switch left them on two units, route.json was hand-edited, or the current unit's folder was deleted."""
    from precision_pipeline.cli import serving as cli

    a, b = units4[0].engine_unit, units4[1].engine_unit
    repo = serving_repo(tmp_path, units4[0])
    release.promote(repo, units4[1].out_dir)
    release.rollback(repo)
    assert release.list_releases(repo)["problems"] == []
    release_configs.point_ensemble(repo, b)                     # a kill between the two switches
    [p] = release.list_releases(repo)["problems"]
    assert p == (f"the ensemble's config calls {b}, releases.json records {a} (an interrupted change): `invoke rollback "
                 f"--repo {repo} --to {a}` (add --url when a server serves it) puts everything back on it")
    release_configs.point_ensemble(repo, a)
    ref_b = repo / b / "engine" / pack.CPU_REFERENCE_FILE    # hostile s16 T32: a kept unit truncated on disk
    size_b = ref_b.stat().st_size
    os.truncate(ref_b, 5)
    [p] = release.list_releases(repo)["problems"]
    assert p == (f"the kept release {b} is damaged on disk ({b}/engine/cpu_reference.json is 5 bytes, not the recorded "
                 f"{size_b:,} at its install): promote its build again (a verified copy replaces it); a rollback to it is "
                 "refused until then")
    release.promote(repo, units4[1].out_dir)                    # the repair printed: a verified copy
    release.rollback(repo)
    assert release.list_releases(repo)["problems"] == []
    ref_a = repo / a / "engine" / pack.CPU_REFERENCE_FILE       # s16b T9: the current damaged and a split: the split's
    good_a = ref_a.read_bytes()                                 # fix is no longer "everything back on" the damaged unit
    os.truncate(ref_a, 5)
    release_configs.point_ensemble(repo, b)
    first, split = release.list_releases(repo)["problems"]
    assert first.startswith(f"the current release {a} is damaged on disk") and f"--to {a}" not in split
    assert split.endswith("(an interrupted change): repair the current release first (above); a rollback to another "
                          "release also re-points everything")
    ref_a.write_bytes(good_a)
    release_configs.point_ensemble(repo, a)
    assert release.list_releases(repo)["problems"] == []
    (repo / "tensorrt_llm_bls" / "route.json").write_text(json.dumps({"tensorrt_llm_model_name": a, "canary": {
        "tensorrt_llm_model_name": "preprocessing", "percent": 100}}))
    [p] = release.list_releases(repo)["problems"]
    assert p.startswith('the BLS config or route.json ({"canary": {"percent": 100, "tensorrt_llm_model_name": "preprocessing"}')
    shutil.rmtree(repo / a)
    capsys.readouterr()
    cli.releases(str(repo))
    out, err = capsys.readouterr()
    assert json.loads(out)["problems"] and f"warning: the current release {a} is missing from {repo}" in err


def test_serve_heals_the_repository_while_it_runs(tmp_path, units4, monkeypatch, capsys):
    """Hostile s15b F14 / s15c T72: ``invoke serve`` runs ``release_recover.heal`` every ``HEAL_EVERY_S`` seconds
    while its server runs and prints what it repaired (a stand-in process that ends after ~1.5 s plays the server)."""
    import subprocess
    import sys

    from precision_pipeline.core.errors import PipelineError
    from precision_pipeline.serving import triton_server as ts

    repo = serving_repo(tmp_path, units4[0])
    calls = []
    monkeypatch.setattr(ts, "HEAL_EVERY_S", 0.2)
    monkeypatch.setattr(release_recover, "heal", lambda r, s: calls.append(r) or (["x re-pointed"] if len(calls) == 1 else []))
    monkeypatch.setattr(ts.TritonServer, "start", lambda self: setattr(self, "proc", subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(1.5)"])) or setattr(self, "start_s", 0.0))
    monkeypatch.setattr(ts.TritonServer, "stop", lambda self, timeout_s=30, say=None: None)
    monkeypatch.setenv("PRECISION_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(PipelineError, match="exited with status 0"):
        ts.serve(repo, http_port=1, grpc_port=2, metrics_port=3)
    assert len(calls) >= 2 and all(c == repo for c in calls)
    assert capsys.readouterr().out.count("[serve] repaired: x re-pointed\n") == 1


def test_serve_of_a_repository_whose_current_unit_was_truncated_is_refused_before_start(tmp_path, units4, monkeypatch):
    """Hostile s15c T112: a truncated file of the current unit reached tritonserver (exit 1 with its option table and
    Python frames); serve now compares every file the server would load with releases.json's recorded sizes."""
    from precision_pipeline.serving import triton_server as ts

    repo = serving_repo(tmp_path, units4[0])
    started = []
    monkeypatch.setattr(ts.TritonServer, "start", lambda self: started.append(self.models) or setattr(self, "start_s", 0.0))
    monkeypatch.setenv("PRECISION_CACHE_DIR", str(tmp_path / "cache"))
    unit = units4[0].engine_unit
    rel, row = max(((r, w) for r, w in release_state.read_state(repo)["unit_files"][unit].items()
                    if not r.endswith(".pbtxt")), key=lambda kv: kv[1][0])  # a config is parsed (and refused) earlier
    os.truncate(repo / unit / rel, row[0] // 2)
    with pytest.raises(UserError, match=f"the current release {unit} is damaged on disk \\({unit}/{rel} is "
                       f"{row[0] // 2:,} bytes, not the recorded {row[0]:,} at its install\\)") as ei:
        ts.serve(repo, http_port=1, grpc_port=2, metrics_port=3, block=False)   # the recovery's check (current_problem)
    assert "invoke rollback --repo" in ei.value.problems[0].fix and started == []
    shutil.copyfile(next(Path(units4[0].out_dir).rglob(f"{unit}/{rel}")), repo / unit / rel)
    release.set_fallback(repo, units4[1].out_dir, warm=True)   # a warm fallback: loaded at the start too
    cand = units4[1].engine_unit
    (repo / cand / rel).unlink()
    with pytest.raises(UserError, match=f"{cand}/{rel} is missing at its install: a unit the server would load changed "
                       "on disk .* nothing was started"):
        ts.serve(repo, http_port=1, grpc_port=2, metrics_port=3, block=False)   # the serve's own check (check_sizes)
    assert started == []


def test_a_read_only_serve_says_what_disagrees_once(tmp_path, units4, capsys):
    """Hostile s16 H8: a serve of a read-only mount cannot repair a split left by a command killed through a writable
    path; its watchdog now says it (``serve_watchdog.say_disagreements``), once per problem."""
    from precision_pipeline.serving import serve_watchdog

    a, b = units4[0].engine_unit, units4[1].engine_unit
    repo = serving_repo(tmp_path, units4[0])
    release.promote(repo, units4[1].out_dir)
    release.rollback(repo)
    said: set[str] = set()
    assert serve_watchdog.say_disagreements(repo, said) == [] and capsys.readouterr().out == ""
    release_configs.point_ensemble(repo, b)                     # a kill between the two switches
    serve_watchdog.say_disagreements(repo, said)
    serve_watchdog.say_disagreements(repo, said)
    assert capsys.readouterr().out == (f"[serve] not repaired (this repository is read-only here): the ensemble's config "
                                       f"calls {b}, releases.json records {a} (an interrupted change): `invoke rollback "
                                       f"--repo {repo} --to {a}` (add --url when a server serves it) puts everything "
                                       "back on it\n")


def test_a_server_gone_at_the_identity_check_says_what_holds(tmp_path, units4):
    """Hostile s16b T44/T47: a server killed (or frozen) before a promote's identity check gave a one-line "stopped
    answering while reading its ensemble's configuration", without what still holds (the README's exit 7 text)."""
    from precision_pipeline.core.errors import EXIT_SERVER_STOPPED, ServerStopped, exit_code_for
    from tests.serving.test_server_stopped import _server

    repo = serving_repo(tmp_path, units4[0])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, not listening: refused
        with pytest.raises(ServerStopped) as ei:
            release.promote(repo, units4[1].out_dir, server=_server(f"127.0.0.1:{s.getsockname()[1]}"))
    assert "stopped answering while reading its ensemble's configuration" in str(ei.value)
    assert str(ei.value).endswith(f"Nothing was switched: releases.json still names {units4[0].engine_unit}, and a "
                                  "restarted server serves it (`invoke serve --repo REPO`); run the command again once "
                                  "it answers.")
    assert exit_code_for(ei.value) == EXIT_SERVER_STOPPED and release_state.read_state(repo)["current"] == units4[0].engine_unit


def test_a_folder_in_place_of_route_json_is_moved_aside_and_the_printed_fix_works(tmp_path, units4):
    """Hostile s17 F1: `mkdir` in place of route.json: releases said so and prescribed `rollback --to <current>`, which
    was refused ("already current"), and the recovery re-raised IsADirectoryError (the watchdog stayed silent). The
    folder is moved beside releases.json (never deleted), route.json is rewritten from the record, and `rollback --to
    <current>` is the printed fix that works: nothing to switch, exit 0."""
    a, b = units4[0].engine_unit, units4[1].engine_unit
    repo = serving_repo(tmp_path, units4[0])
    release.promote(repo, units4[1].out_dir)
    route = repo / "tensorrt_llm_bls" / "route.json"
    route.unlink()
    route.mkdir()
    (route / "mine.txt").write_text("a user's file")
    problems = release.list_releases(repo)["problems"]
    assert len(problems) == 1 and problems[0].endswith(
        f"`invoke rollback --repo {repo} --to {b}` (add --url when a server serves it) puts everything back on it")
    t = release.rollback(repo, to=b)
    assert t["unit"] == b and t["already_current"] is True
    assert json.loads(route.read_text()) == {"tensorrt_llm_model_name": b}
    aside = [p for p in repo.parent.iterdir() if p.name.startswith("route.json.folder-")]
    assert len(aside) == 1 and (aside[0] / "mine.txt").read_text() == "a user's file"
    assert release.list_releases(repo)["problems"] == [] and release_state.read_state(repo)["current"] == b
    assert a in release.list_releases(repo)["on_disk"]


def test_the_current_unit_loaded_again_by_the_recovery_is_said(tmp_path, units4):
    """Hostile s17 F4: the current unit unloaded by hand (every BLS request 400) was loaded again by the serve
    watchdog without a line in its log, where every other repair prints `[serve] repaired: ...`. The load is among
    what the recovery reports (heal returns it; serve prints it)."""
    from tests.serving.test_release_planted import RecordingServer

    a, b = units4[0].engine_unit, units4[1].engine_unit
    repo = serving_repo(tmp_path, units4[0])
    release.promote(repo, units4[1].out_dir)
    srv = RecordingServer(repo, ready={"ensemble", "preprocessing", "postprocessing", "tensorrt_llm_bls", a})
    fixed = release_recover.heal(repo, srv)
    assert f"the current release {b} loaded again on the server (its state was not loaded)" in fixed
    assert ("load", b) in [x[:2] for x in srv.calls] and b in srv.ready
    assert not [f for f in release_recover.heal(repo, srv) if "loaded again" in f]  # once loaded, nothing more to say


def test_a_stopped_rollout_process_is_said_by_releases_and_the_serve_watchdog(tmp_path, units4, capsys):
    """Hostile s17 F8: `kill -STOP` of a rollout at 50 % left the canary on an unjudged candidate for as long as it
    stayed stopped; `invoke releases` listed no problem and serve's watchdog said nothing. Both say it now, with the
    two ways out; a running rollout process is no problem."""
    from precision_pipeline.serving.serve_watchdog import say_stalled_rollout

    repo = serving_repo(tmp_path, units4[0])
    release_rollout.begin_rollout(repo, units4[1].out_dir, steps=(50, 100))
    release_rollout.set_rollout_percent(repo, 50)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        state = release_state.read_state(repo)
        state["rollout"]["pid"], state["rollout"]["pid_start"] = child.pid, release_state.process_start(child.pid)
        release_state.write_state(repo, state)
        assert release.list_releases(repo)["problems"] == []  # running: nothing to say
        os.kill(child.pid, signal.SIGSTOP)
        for _ in range(50):
            if release_state.stalled_rollout(release_state.read_state(repo), repo):
                break
            time.sleep(0.1)
        want = (f"the rollout of {units4[1].engine_unit} is at 50 % but its process (pid {child.pid}) is T (stopped): no "
                "check runs while the canary keeps that share of the traffic; resume it (kill -CONT "
                f"{child.pid}) or end it: `invoke rollout --abort --repo {repo}` (add --url when a server serves it)")
        assert release.list_releases(repo)["problems"] == [want]
        said: set[str] = set()
        say_stalled_rollout(repo, said)
        say_stalled_rollout(repo, said)
        assert capsys.readouterr().out == f"[serve] warning: {want}\n"  # once
    finally:
        child.kill()
        child.wait()


def test_a_server_start_reads_the_files_of_a_unit_edited_since_its_install(tmp_path, units4):
    """Hostile s17 F9: one byte of the current unit's weights flipped in place (size kept), then `invoke serve`: the
    start checked sizes only and served the corrupt unit. A file whose mtime is later than the unit's install record
    is hashed and compared; untouched files are not read (a 405B unit starts as fast as before)."""
    from precision_pipeline.serving import release_units

    repo = serving_repo(tmp_path, units4[0])
    a = units4[0].engine_unit
    state = release_state.read_state(repo)
    rel = max(state["unit_files"][a], key=lambda r: state["unit_files"][a][r][0])  # the biggest file: the weights
    reads = []
    real = release_units.file_differs
    release_units.file_differs = lambda p, row, sha256=True: reads.append((p.name, sha256)) or real(p, row, sha256)
    try:
        release_units.check_sizes(repo, [a], state, "--repo")
        assert not [r for r in reads if r[1]]  # installed just now, nothing edited since: no file read
        for r in state["releases"]:
            r["time"] = "2020-01-01T00:00:00+0000"  # installed long ago: every file is newer than that
        release_units.check_sizes(repo, [a], state, "--repo")  # read and equal: fine
        path = repo / a / rel
        flip_middle_byte(path)
        with pytest.raises(UserError) as ei:
            release_units.check_sizes(repo, [a], state, "--repo")
        assert ei.value.problems[0].reason.startswith(f"{a}/{rel} has the recorded size ({path.stat().st_size:,} bytes) "
                                                      "but another sha256")
        assert "nothing was started" in ei.value.problems[0].reason
    finally:
        release_units.file_differs = real
    release_state.write_state(repo, state)  # the old install time on disk too: `releases` lists it (s17b F7)
    problems = release.list_releases(repo)["problems"]
    assert len(problems) == 1 and problems[0].startswith(f"the current release {a} is damaged on disk ({a}/{rel} has the "
                                                         "recorded size")


def test_a_stopped_tritonserver_is_said_once_and_its_resumption_too(capsys):
    """Hostile s17 F11: tritonserver SIGSTOPped for 75 s: every client timed out and serve's log said nothing."""
    from precision_pipeline.serving.serve_watchdog import server_stopped

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    said: set[str] = set()
    try:
        assert server_stopped(child.pid, said) is False and capsys.readouterr().out == ""
        os.kill(child.pid, signal.SIGSTOP)
        for _ in range(50):
            if server_stopped(child.pid, said):
                break
            time.sleep(0.1)
        assert server_stopped(child.pid, said) is True
        os.kill(child.pid, signal.SIGCONT)
        for _ in range(50):
            if not server_stopped(child.pid, said):
                break
            time.sleep(0.1)
        assert capsys.readouterr().out == (
            f"[serve] warning: tritonserver (pid {child.pid}) is stopped (SIGSTOP or Ctrl-Z): every request waits until "
            f"it is resumed: kill -CONT {child.pid}\n[serve] tritonserver (pid {child.pid}) runs again\n")
    finally:
        child.kill()
        child.wait()


def test_a_missing_fallback_is_listed_and_named_by_rollback_fallback(tmp_path, units4):
    """Hostile s17 F14: the fallback's folder moved away: `releases` listed no problem and `rollback --fallback` said
    only "is not on disk. Fix: pick a kept release"."""
    repo = tmp_path / "serving" / "model_repository"
    release_recover.init_serving_repo(repo, units4[0].out_dir, fallback_repo=units4[2].out_dir)
    release.promote(repo, units4[1].out_dir)
    fb = release_state.read_state(repo)["fallback"]
    assert fb == units4[2].engine_unit and release.list_releases(repo)["problems"] == []
    (repo / fb).rename(tmp_path / "elsewhere")
    assert release.list_releases(repo)["problems"] == [
        f"the fallback {fb} is missing from {repo} (deleted or moved): `rollback --fallback` is refused until its folder "
        "is restored there"]
    with pytest.raises(UserError) as ei:
        release.rollback(repo, fallback=True)
    p = ei.value.problems[0]
    assert p.field == "--fallback" and p.reason == (f"the fallback {fb} is missing from {repo} (deleted or moved); "
                                                    "nothing was switched.")
    assert release_state.read_state(repo)["current"] == units4[1].engine_unit


def test_a_dead_rollout_is_listed_by_releases(tmp_path, units4):
    """Hostile s17b F4: a rollout killed at its 100 % switch left the configs on the candidate while releases.json names
    the stable unit; `releases` listed no problem (a rollout in progress was not compared) and not the dead process."""
    repo = serving_repo(tmp_path, units4[0])
    release_rollout.begin_rollout(repo, units4[1].out_dir, steps=(100,))
    state = release_state.read_state(repo)
    state["rollout"]["pid"] = 2 ** 22 + 12345  # no such process
    release_state.write_state(repo, state)
    problems = release.list_releases(repo)["problems"]
    assert problems == [f"the rollout of {units4[1].engine_unit} did not finish: its process (pid {2 ** 22 + 12345}) is "
                        "gone (killed or crashed), so the files may route requests to the unjudged candidate; the next "
                        f"release command or serve's watchdog ends it (everything back on {units4[0].engine_unit}), or "
                        f"now: `invoke rollout --abort --repo {repo}` (add --url when a server serves it)"]


def test_promoting_the_current_units_build_again_clears_a_harmless_edit_and_says_so(tmp_path, units4):
    """Hostile s17 F13: a comment line appended to the current unit's config.pbtxt: releases and the watchdog said
    "damaged ... promote its build again", and that promote said only "already the current release". The folder
    holds the build's unit (config compared as parsed), so the promote records the folder as it is and says so; the
    damage is no longer listed. A real content change still names the rollback first."""
    a = units4[0].engine_unit
    repo = serving_repo(tmp_path, units4[0])
    with open(repo / a / "config.pbtxt", "a") as f:
        f.write("# a comment\n")
    problems = release.list_releases(repo)["problems"]
    assert len(problems) == 1 and problems[0].startswith(f"the current release {a} is damaged on disk ({a}/config.pbtxt is")
    assert "roll back to another release (the server keeps serving what it loaded until then), then promote its build " \
           "again" in problems[0]
    with pytest.raises(UserError) as ei:
        release.promote(repo, units4[0].out_dir)
    assert ei.value.problems[0].reason.startswith(f"{a} is already the current release; its folder was compared with "
                                                  "this build file by file")
    assert release.list_releases(repo)["problems"] == []
    with pytest.raises(UserError) as ei:  # a second time: nothing left to record
        release.promote(repo, units4[0].out_dir)
    assert ei.value.problems[0].reason == f"{a} is already the current release."


def test_promoting_a_unit_its_rollout_rejected_warns(tmp_path, units4):
    """Hostile s17 F12: the candidate a failed probe had just rolled back was promoted without a word."""
    from types import SimpleNamespace

    from precision_pipeline.serving import build_output

    repo = serving_repo(tmp_path, units4[0])
    c = units4[2].engine_unit
    assert build_output._rejected_warning(SimpleNamespace(packed=units4[2].out_dir), repo) == []
    rejected_rollout(repo, units4[2])
    w = build_output._rejected_warning(SimpleNamespace(packed=units4[2].out_dir), repo)
    assert w == [f"{c} was rolled back by its rollout in this repository ({release_state.rejected_units(release_state.read_state(repo))[c]}); "
                 "a promote makes it current at once, without the rollout's live checks (`invoke rollout` judges it again)."]
    assert "probe:kl_p99" in w[0]
    assert build_output._rejected_warning(SimpleNamespace(packed=units4[1].out_dir), repo) == []


def test_a_missing_or_hand_broken_ensemble_config_names_a_fix_that_works(tmp_path, units4):
    """Hostile s17b F5/F6: ensemble/config.pbtxt deleted: releases said "the ensemble's config calls None (an
    interrupted change)" with `rollback --to CUR` as the fix, which was refused; garbage appended to it: every command
    said "fix the template or the value". Both name the file and the way back, and the printed way back works."""
    a = units4[0].engine_unit
    repo = serving_repo(tmp_path, units4[0])
    cfg = repo / "ensemble" / "config.pbtxt"
    saved = cfg.read_text()
    cfg.unlink()
    problems = release.list_releases(repo)["problems"]
    assert problems == [f"{cfg} is missing (deleted or moved): every release command refuses until it is restored: from "
                        "a backup, or copy ensemble/config.pbtxt from a build's packed repository (`<build out>/"
                        f"model_repository/ensemble/config.pbtxt`), then `invoke rollback --repo {repo} --to {a}` "
                        "re-points it"]
    shutil.copyfile(units4[1].out_dir / "ensemble" / "config.pbtxt", cfg)  # another build's: calls its unit
    assert release.rollback(repo, to=a)["already_current"] is True
    assert release_configs.current_of_configs(repo)[0] == a and release.list_releases(repo)["problems"] == []
    assert release_state._identity(repo) == release_state.read_state(repo)["repository_id"]  # put back by the recovery
    cfg.write_text(saved + "garbage {{{\n")
    with pytest.raises(UserError) as ei:
        release.list_releases(repo)
    p = ei.value.problems[0]
    assert p.field == str(cfg) and p.reason.endswith("it was edited by hand or damaged, and this command changed nothing.")
    assert "copy ensemble/config.pbtxt from the packed repository of a build" in p.fix


def test_a_hand_set_current_onto_a_unit_edited_since_its_install_is_not_pointed_at(tmp_path, units4):
    """Hostile s17c F1/H12: releases.json's current edited by hand onto a kept unit whose config.pbtxt was edited with
    its size kept: serve's watchdog (a recovery) re-pointed the ensemble and the BLS at it and served it; serve's start
    and rollback refuse that unit. The recovery reads the files edited since the install of a unit it is about to
    point at, and refuses it; a unit the configs already call is not read again (every pass of the watchdog)."""
    a, b = units4[0].engine_unit, units4[1].engine_unit
    repo = serving_repo(tmp_path, units4[0])
    release.promote(repo, units4[1].out_dir)
    release.rollback(repo, to=a)
    cfg = repo / b / "config.pbtxt"
    text = cfg.read_text()
    i = text.index("max_batch_size: ") + len("max_batch_size: ")
    cfg.write_text(text[:i] + ("7" if text[i] != "7" else "8") + text[i + 1:])  # one digit: the size is kept
    later = time.time() + 5
    os.utime(cfg, (later, later))  # written after the install record's second
    state = release_state.read_state(repo)
    state["current"] = b
    release_state.write_state(repo, state)
    with pytest.raises(UserError) as ei:
        release_recover.recover(repo)
    assert ei.value.problems[0].reason.startswith(f"the current release {b} is damaged on disk ({b}/config.pbtxt has "
                                                  "the recorded size (")
    assert "so nothing was re-pointed at it (the BLS still sends requests to " + a in ei.value.problems[0].reason
    assert release_configs.current_of_configs(repo) == (a, a)
    cfg.write_text(text)
    os.utime(cfg, (later, later))
    assert f"ensemble re-pointed at {b}" in release_recover.recover(repo)
    assert release_configs.current_of_configs(repo) == (b, b)


def test_a_current_unit_moved_aside_keeps_its_records_and_is_verified_when_put_back(tmp_path, units4):
    """Hostile s18b W01/W02: the current unit's folder moved aside, then `rollback`: retention deleted its release row
    (gate numbers, provenance) and its install record without a word; the folder put back with a byte flipped was then
    made current by `rollback --to` with only "not verified"."""
    a, b = units4[0].engine_unit, units4[1].engine_unit
    repo = serving_repo(tmp_path, units4[0])
    release.promote(repo, units4[1].out_dir)
    before = release_state.read_state(repo)
    row = [r for r in before["releases"] if r["unit"] == b]
    (repo / b).rename(tmp_path / "aside")
    assert release.rollback(repo)["unit"] == a
    st = release_state.read_state(repo)
    assert [r for r in st["releases"] if r["unit"] == b] == row and st["unit_files"][b] == before["unit_files"][b]
    (tmp_path / "aside").rename(repo / b)
    rel = max(st["unit_files"][b], key=lambda r: st["unit_files"][b][r][0])
    path = repo / b / rel
    flip_middle_byte(path)
    with pytest.raises(UserError, match="another sha256"):
        release.rollback(repo, to=b)
    flip_middle_byte(path)  # flipped back: the bytes as installed
    t = release.rollback(repo, to=b)
    assert t["unit"] == b and t["verified"] is True


def test_a_plain_rollback_that_waited_for_another_switch_does_not_undo_it(tmp_path, units4, monkeypatch):
    """Hostile s18b F8 (K14): two plain `rollback --url` 0.3 s apart: the second waited on the lock, then rolled back
    from the release the first had made current to the one both had left -- undoing the first, exit 0, in silence."""
    import threading

    a, b = units4[0].engine_unit, units4[1].engine_unit
    repo = serving_repo(tmp_path, units4[0])
    release.promote(repo, units4[1].out_dir)
    real_lock = release.lock
    entered = threading.Event()

    def lock_after_the_other(repo_dir, *a, **k):  # the other rollback runs while this one waits for the lock
        if not entered.is_set():
            entered.set()
            release.rollback(repo)
        return real_lock(repo_dir, *a, **k)

    monkeypatch.setattr(release, "lock", lock_after_the_other)
    with pytest.raises(UserError) as ei:
        release.rollback(repo)
    assert ei.value.problems[0].reason == (f"the current release changed from {b} to {a} while this command waited for "
                                           "the lock (another command switched it); a plain rollback now would undo "
                                           "that, so nothing was switched.")
    assert release_state.read_state(repo)["current"] == a
    monkeypatch.setattr(release, "lock", real_lock)
    assert release.rollback(repo, to=b)["unit"] == b  # a named target is what it says


def test_a_deleted_releases_json_with_its_prev_beside_it_names_the_way_back(tmp_path, units4):
    """Hostile s18 F2: releases.json deleted, releases.json.prev beside it: rollback said "init the serving repository
    first", promote "use a new directory", releases pointed at the same repository -- none worked."""
    repo = serving_repo(tmp_path, units4[0])
    release.promote(repo, units4[1].out_dir)
    path = release_state.state_path(repo)
    prev = path.with_name(path.name + ".prev")
    assert prev.is_file()
    path.unlink()
    for call in (lambda: release.rollback(repo), lambda: release.list_releases(repo),
                 lambda: release.promote(repo, units4[2].out_dir)):
        with pytest.raises(UserError) as ei:
            call()
        p = ei.value.problems[0]
        assert p.field == str(path) and p.reason.startswith(f"is missing beside the serving repository {repo}, while "
                                                            f"{prev} is there")
        assert f"`cp {prev} {path}`" in p.fix
    shutil.copyfile(prev, path)  # the way back printed
    assert release_state.read_state(repo)["current"] in (units4[0].engine_unit, units4[1].engine_unit)
    assert release.rollback(repo, to=units4[0].engine_unit)["unit"] == units4[0].engine_unit


def test_missing_entry_model_files_are_listed_warned_and_refused_by_serve(tmp_path, units4, capsys):
    """Hostile s17c F7/H15/H16: a python entry model's 1/model.py or config, or the tokenizer, deleted by hand: releases
    listed nothing and a files-only rollback exited 0 in silence, while the server could never load that model again
    (a load whose stub cannot start never ends in Triton 2.51). Listed with the way back, warned by rollback, and
    refused by serve before anything starts."""
    from precision_pipeline.cli import serving as cli
    from precision_pipeline.serving import triton_server

    a = units4[0].engine_unit
    repo = serving_repo(tmp_path, units4[0])
    assert release.list_releases(repo)["problems"] == []
    gone = [repo / "tensorrt_llm_bls" / "1" / "model.py", repo / "preprocessing" / "tokenizer",
            repo / "postprocessing" / "config.pbtxt"]
    for p in gone:
        p.rename(p.with_name(p.name + ".aside"))
    why = {"preprocessing": f"{gone[1] / 'tokenizer_config.json'} is missing (restore it from a build's packed repository: "
                            "<build out>/model_repository/preprocessing/tokenizer/)",
           "postprocessing": f"{gone[2]} is missing (restore it from a build's packed repository: <build out>/"
                             "model_repository/postprocessing/config.pbtxt)",
           "tensorrt_llm_bls": f"{gone[0]} is missing (restore it from a build's packed repository: <build out>/"
                               "model_repository/tensorrt_llm_bls/1/model.py)"}
    assert release_units.entry_model_problems(repo) == why
    assert release.list_releases(repo)["problems"] == [
        f"{why[m]}: the server cannot load {m} from this repository (a restarted server, or serve's watchdog after its "
        "instance died); every request through it fails then" for m in ("preprocessing", "postprocessing", "tensorrt_llm_bls")]
    capsys.readouterr()
    cli.rollback(repo=str(repo), to=a)
    out = " ".join(capsys.readouterr().out.split())
    assert out.count("warning: ") == 3 and f"warning: {why['tensorrt_llm_bls']}: the server cannot load tensorrt_llm_bls" in out
    with pytest.raises(UserError) as ei:
        triton_server.serve(repo, http_port=1, grpc_port=2, metrics_port=3, block=False)
    assert ei.value.problems[0].field == "--repo" and ei.value.problems[0].reason == (
        f"{'; '.join(why.values())}: tritonserver would never finish loading preprocessing, postprocessing, "
        "tensorrt_llm_bls (its python stub cannot start; hostile s17c H16); nothing was started.")
    for p in gone:
        p.with_name(p.name + ".aside").rename(p)
    assert release.list_releases(repo)["problems"] == [] and release_units.entry_model_problems(repo) == {}


def test_a_copy_elsewhere_is_listed_and_refused_by_files_only_commands(tmp_path, units4):
    """Hostile s17b F9: `cp -a` of a serving repository (with its releases.json) into another folder: a files-only
    rollback there exited 0 and recorded a release whose config still reads the original's files (serve refuses the
    copy), and releases listed no problem."""
    a = serving_repo(tmp_path / "one", units4[0])
    release.promote(a, units4[1].out_dir)
    (tmp_path / "two").mkdir()
    shutil.copytree(a.parent, tmp_path / "two" / "serving", symlinks=True)
    copy = tmp_path / "two" / "serving" / "model_repository"
    before = release_state.state_path(copy).read_text()
    with pytest.raises(UserError) as ei:
        release.rollback(copy)
    p = ei.value.problems[0]
    assert p.field == "--repo" and p.reason.startswith(f"{copy} is a copy or a move of another serving repository")
    assert release_state.state_path(copy).read_text() == before
    assert p.fix.endswith(f"for a new repository at this path, first move this copy away ({copy} and the releases.json "
                          f"beside it, {copy.parent / 'releases.json'}), then `invoke promote --profile P --repo {copy}` "
                          "creates one (hostile s17c F6).")  # it said "create a new one here", which was refused
    shutil.move(str(copy.parent), str(tmp_path / "moved-away"))
    assert serving_repo(tmp_path / "two", units4[2]) == copy  # the way the fix names works (the first promote's init)
    assert release_state.read_state(copy)["current"] == units4[2].engine_unit and release.list_releases(copy)["problems"] == []
    shutil.rmtree(copy.parent)
    shutil.move(str(tmp_path / "moved-away"), str(copy.parent))
    problems = release.list_releases(copy)["problems"]
    assert len(problems) == 1 and problems[0].startswith(f"{copy} is a copy or a move of another serving repository")
    assert "every release command and `invoke serve` refuse it; run the command on the repository" in problems[0]
    assert release.rollback(a)["unit"] == units4[0].engine_unit  # the original works


def test_a_commit_refused_for_permission_names_permissions_not_space():
    """Hostile s17b F10: `chattr +i releases.json`: the switch was undone and said, but the fix said "free space"."""
    import errno as e

    from precision_pipeline.serving.release_switch import _write_fix

    assert _write_fix(OSError(e.EPERM, "Operation not permitted")).startswith("make releases.json and its folder writable")
    assert _write_fix(OSError(e.EACCES, "Permission denied")).startswith("make releases.json and its folder writable")
    assert _write_fix(OSError(e.EFBIG, "File too large")) == "raise the file-size limit (`ulimit -f`)"
    assert _write_fix(OSError(e.ENOSPC, "No space left")) == "free space on that file system (or raise the file-size limit)"


def test_a_server_freeze_during_a_rollout_of_an_earlier_release_keeps_it_a_release(tmp_path, units4):
    """Hostile s17 RT4: a rollout of an earlier release (A, current before) rolled back only because the server froze
    (failed check `server`) made A no release: the next promote's retention deleted its folder and record. A server
    stop says nothing about a unit that served before; a never-released candidate it ended stays rejected."""
    a, b, c, d = (u.engine_unit for u in units4)
    repo = serving_repo(tmp_path, units4[0], keep=2)
    release.promote(repo, units4[1].out_dir)                       # B current, A previous
    rejected_rollout(repo, units4[0], failed_check="server")       # A rolled out again, the server froze
    st = release_state.read_state(repo)
    assert a not in release_state.rejected_units(st)
    rejected_rollout(repo, units4[2], failed_check="server")       # C never a release: stays rejected
    assert c in release_state.rejected_units(release_state.read_state(repo))
    release.promote(repo, units4[3].out_dir)                        # D current: B and A kept, C goes
    assert on_disk(repo) == sorted([a, b, d])
    assert release.rollback(repo, to=a)["unit"] == a


def test_a_rollout_pid_reused_by_another_process_counts_as_dead(tmp_path, units4):
    """Hostile s17 PID1: a rollout killed at 50 %, its pid then given to another process: the canary kept 50 % with
    no checks, recovery and releases silent (only the pid was compared). The rollout records its process's start time;
    another process with that pid is not it, so the recovery ends the rollout."""
    repo = serving_repo(tmp_path, units4[0])
    release_rollout.begin_rollout(repo, units4[1].out_dir, steps=(50, 100))
    release_rollout.set_rollout_percent(repo, 50)
    ro = release_state.read_state(repo)["rollout"]
    assert ro["pid"] == os.getpid() and ro["pid_start"] == release_state.process_start(os.getpid()) is not None
    assert release_state.rollout_alive(ro)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        state = release_state.read_state(repo)
        state["rollout"]["pid"] = child.pid  # the same pid, another process (its start time differs)
        release_state.write_state(repo, state)
        assert not release_state.rollout_alive(state["rollout"])
        assert release.list_releases(repo)["problems"][0].startswith(
            f"the rollout of {units4[1].engine_unit} did not finish: its process (pid {child.pid}) is gone")
        fixed = release_recover.recover(repo)
        assert any(f.startswith(f"interrupted rollout of {units4[1].engine_unit} ended") for f in fixed)
        assert release_state.read_state(repo).get("rollout") is None
    finally:
        child.kill()
        child.wait()


def test_a_unit_without_its_install_record_is_listed(tmp_path, units4):
    """Hostile s17b F11: the unit_files row of a kept release deleted by hand: a rollback to it (and serve) passed with
    nothing checked, and releases listed nothing."""
    a, b = units4[0].engine_unit, units4[1].engine_unit
    repo = serving_repo(tmp_path, units4[0])
    release.promote(repo, units4[1].out_dir)
    state = release_state.read_state(repo)
    del state["unit_files"][a]
    release_state.write_state(repo, state)
    assert release.list_releases(repo)["problems"] == [
        f"{a} has no install record in releases.json (unit_files; deleted by hand, or installed before the record "
        "existed): its files cannot be verified before it serves; promote its build again to record it (a verified copy)"]
    assert release.rollback(repo, to=a)["verified"] is False
    assert b not in " ".join(release.list_releases(repo)["problems"])


def test_a_command_that_goes_on_after_its_recovery_says_what_it_recovered(tmp_path, units4, capsys):
    """Hostile s17b F1/Q07: a successful rollback whose recovery moved a folder away from route.json, or ended a
    killed rollout, printed only "current: X": what the recovery did is said on stderr when the lock is released."""
    b = units4[1].engine_unit
    repo = serving_repo(tmp_path, units4[0])
    release.promote(repo, units4[1].out_dir)
    capsys.readouterr()
    route = repo / "tensorrt_llm_bls" / "route.json"
    route.unlink()
    route.mkdir()
    release.rollback(repo, to=b)
    err = capsys.readouterr().err
    assert f"[release] recovered first: {route} was a folder: moved to {repo.parent}/route.json.folder-" in err
    release.rollback(repo, to=b)
    assert "recovered first" not in capsys.readouterr().err  # nothing to recover: nothing said


def test_the_recovery_never_puts_a_canary_back_on_a_candidate_the_server_has_not_loaded(tmp_path, units4):
    """Hostile s17 F21: `rollout --abort` killed after it unloaded the candidate, before it rewrote the record: the
    serve watchdog put the 50 % canary back into route.json, and every second request failed on the unloaded unit.
    With a server that has not loaded the candidate, every request goes to the stable unit and that is said."""
    from tests.serving.test_release_planted import RecordingServer

    a, b = units4[0].engine_unit, units4[1].engine_unit
    repo = serving_repo(tmp_path, units4[0])
    release_rollout.begin_rollout(repo, units4[1].out_dir, steps=(50, 100))
    release_rollout.set_rollout_percent(repo, 50)
    route = repo / "tensorrt_llm_bls" / "route.json"
    route.write_text(json.dumps({"tensorrt_llm_model_name": a}))  # the abort's first write, then killed
    srv = RecordingServer(repo, ready={"ensemble", "preprocessing", "postprocessing", "tensorrt_llm_bls", a})
    fixed = release_recover.heal(repo, srv)
    assert json.loads(route.read_text()) == {"tensorrt_llm_model_name": a}
    assert not any("put back in route.json" in f for f in fixed)
    srv.ready.add(b)  # loaded (a live rollout's step): its canary is put back
    route.write_text(json.dumps({"tensorrt_llm_model_name": a}))
    fixed = release_recover.heal(repo, srv)
    assert json.loads(route.read_text())["canary"] == {"tensorrt_llm_model_name": b, "percent": 50}
