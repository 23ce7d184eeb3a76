"""The three findings of the session-8 hostile round left open (issue 25; log /work/helpers/s8/hostile-round-s8.md):
#99 the same port for HTTP and gRPC, #102 profile edits after the first promote, #56 a promote without --url while
a server serves the repository. Fast: packed units of the default model, no server (the live check of #56 is in
tests/serving/test_release_live.py, on that module's server)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from precision_pipeline.core.errors import UserError
from precision_pipeline.serving import release_recover, release_state
from precision_pipeline.serving.build_output import repository_settings_warnings
from precision_pipeline.serving.triton_server import TritonServer, free_port, servers_of
from precision_pipeline.spec.profile import load_profile
from tests.serving.test_release import new_repo, units  # noqa: F401  (the module fixture)


def test_serve_refuses_one_port_twice_before_anything(tmp_path, units, invoke_here, monkeypatch):  # noqa: F811
    """#99: tritonserver exited 1 with its usage text; now exit 2 naming the flag, before recovery or a start."""
    repo = new_repo(tmp_path, units, fallback=False)
    monkeypatch.setattr(release_recover, "recover", lambda *a, **k: pytest.fail("recovery ran"))
    port = free_port()
    for args, flag, shown, other in (
            (("--http-port", str(port), "--grpc-port", str(port)), "--grpc-port", port, "--http-port"),
            (("--http-port", str(port), "--metrics-port", str(port)), "--metrics-port", port, "--http-port"),
            (("--grpc-port", "8002"), "--metrics-port", 8002, "--grpc-port")):  # 8002: the metrics default
        r = invoke_here("serve", "--repo", str(repo), *args)
        assert r.returncode == 2, r.stdout + r.stderr
        assert (f"{flag}: {shown} is also {other}; HTTP, gRPC and metrics each need a port of their own (tritonserver "
                "does not start otherwise); nothing was started.\n    fix: pass three different ports (the defaults: "
                "--http-port 8000 --grpc-port 8001 --metrics-port 8002).") in (r.stdout + r.stderr), (r.stdout + r.stderr)
        assert "starting tritonserver" not in (r.stdout + r.stderr) and "Traceback" not in r.stdout + r.stderr
    with pytest.raises(UserError, match="is also --http-port"):  # the API refuses it too, before a process starts
        TritonServer(repo, http_port=port, grpc_port=port, metrics_port=free_port(), log_file=tmp_path / "l").start()


def test_repository_settings_the_profile_changed_are_said(tmp_path, units):  # noqa: F811
    """#102: releases.json keeps the first promote's fallback / warm_fallback / keep_releases; a later promote of a
    profile asking otherwise printed nothing."""
    repo = new_repo(tmp_path, units, fallback=True, warm=True, keep=2)
    fb = release_state.read_state(repo)["fallback"]
    prof = load_profile("fp8-h100")  # fallback bf16-h100, warm, keep 2: what the repository does
    assert repository_settings_warnings(prof, repo) == []
    dep = prof.deployment.model_copy(update={"keep_releases": 0, "warm_fallback": False})
    (w,) = repository_settings_warnings(prof.model_copy(update={"deployment": dep}), repo)
    assert w == (f"fp8-h100 asks deployment.warm_fallback false (the repository: true), deployment.keep_releases 0 (the "
                 f"repository: 2); not applied: {repo.parent / 'releases.json'} keeps the fallback and retention of the "
                 "promote that created the repository, and no later promote or rollout changes them (a new --repo "
                 "takes the profile's at its first promote).")
    (w,) = repository_settings_warnings(load_profile("bf16-h100"), repo)  # no fallback asked; warm moot without one
    assert w.startswith(f"bf16-h100 asks deployment.fallback none (the repository: bf16-h100 ({fb})); not applied")
    assert repository_settings_warnings(prof, tmp_path / "none" / "model_repository") == []  # a first promote


@pytest.fixture()
def fake_server(tmp_path):
    """A process whose command line is a tritonserver's serving ``tmp_path/serving/model_repository`` (through a
    symbolic link, relative to its working directory, as a hand-started one may name it) on HTTP port 18555."""
    (tmp_path / "link").symlink_to("serving")
    cmd = ["bash", "-c", 'exec -a tritonserver "$0" -c "import time; time.sleep(120)" '
           "--model-repository=link/model_repository/ --http-port=18555 --grpc-port=18556", sys.executable]
    p = subprocess.Popen(cmd, cwd=tmp_path)
    try:
        for _ in range(100):
            if servers_of(tmp_path / "serving" / "model_repository"):
                break
            time.sleep(0.05)
        yield p
    finally:
        p.kill()
        p.wait()


def test_promote_and_rollback_without_url_refuse_while_a_server_serves_the_repository(
        tmp_path, units, fake_server, invoke_here, monkeypatch):  # noqa: F811
    """#56: a promote without --url switched only the files while the server kept serving the old unit."""
    from precision_pipeline.serving import build_output

    repo = new_repo(tmp_path, units, fallback=False)
    assert servers_of(repo) == [(fake_server.pid, "127.0.0.1:18555")]
    assert servers_of(tmp_path / "other") == []
    before = release_state.state_path(repo).read_text()
    monkeypatch.setattr(build_output, "open_build", lambda *a, **k: object())
    monkeypatch.setattr(build_output, "promote_build", lambda *a, **k: pytest.fail("promoted"))
    for args in (("rollback", "--repo", str(repo)), ("promote", "--profile", "bf16-h100", "--repo", str(repo))):
        r = invoke_here(*args)
        assert r.returncode == 2, r.stdout + r.stderr
        assert (f"--url: is not given, but tritonserver (pid {fake_server.pid}) serves {repo} at 127.0.0.1:18555: "
                "without --url only the files would switch and that server would keep serving the unit it has; nothing "
                "was changed.\n    fix: pass --url 127.0.0.1:18555 (the server then loads, smoke-tests and switches too), or "
                "stop that server first.") in (r.stdout + r.stderr), (r.stdout + r.stderr)
    assert release_state.state_path(repo).read_text() == before
    fake_server.kill()
    fake_server.wait()
    assert servers_of(repo) == []


def test_url_port_out_of_range_is_said():
    """s8 note #35: --url 127.0.0.1:99999 was reported as "no Triton server answers"."""
    for port in ("99999", "0"):
        with pytest.raises(UserError) as e:
            TritonServer.attach(f"127.0.0.1:{port}")
        assert e.value.problems[0].field == "--url"
        assert e.value.problems[0].reason == f"port {int(port)} is out of range (1..65535)."


SIGTERM_TASK = """
import os, signal, sys, time
sys.path.insert(0, 'build')
from invoke.main import program
from precision_pipeline.serving import build_output, release

def stopped(*a, **k):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)

def committed(repo, *a, **k):  # a rollback stopped after its commit point (hostile s11 F4)
    from precision_pipeline.core.store import atomic_write_json
    from precision_pipeline.serving.release_state import after_commit, state_path

    unit = 'tensorrt_llm_0123456789ab'
    with after_commit(repo, unit, f'rolled back to {unit}'):
        atomic_write_json(state_path(repo), {'current': unit})
        stopped()

build_output.open_build = lambda *a, **k: object()
build_output.promote_build = stopped
release.rollback = committed if os.environ.get('AFTER_COMMIT') else stopped
program.run(['invoke', *sys.argv[1:]])
"""


@pytest.mark.parametrize("task", ["promote", "rollback", "rollback after its commit"])
def test_sigterm_during_promote_or_rollback_ends_it_as_ctrl_c(tmp_path, task):
    """s8 note #103: SIGTERM 12 s into a promote ended it with exit 143 and no word; now as Ctrl-C: KeyboardInterrupt
    through the release code (a loaded candidate is unloaded: release.promote's except), said, exit 130. After the
    commit point (hostile s11 F4: "previous artifacts are intact" although the rollback had committed) the same exit
    130 says what took effect (``release_state.after_commit``)."""
    import os

    args = ["--profile", "bf16-h100"] if task == "promote" else []
    t0 = time.monotonic()
    repo = tmp_path / "r" / "model_repository"
    repo.parent.mkdir()
    r = subprocess.run([sys.executable, "-c", SIGTERM_TASK, task.split()[0], *args, "--repo", str(repo)],
                       cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "AFTER_COMMIT": "1" if "commit" in task else ""})
    said = ("interrupted: rolled back to tensorrt_llm_0123456789ab, interrupted after the switch: releases.json records "
            "tensorrt_llm_0123456789ab as the current release. Releases no longer kept may still be on disk; the next "
            "promote or rollback removes them.\n") if "commit" in task else "interrupted; previous artifacts are intact.\n"
    assert r.returncode == 130 and (r.stdout + r.stderr) == said, r.stdout + r.stderr
    assert time.monotonic() - t0 < 25 and "Traceback" not in r.stderr


def test_a_record_without_keep_releases_keeps_two(tmp_path, units):  # noqa: F811
    """A releases.json without ``keep_releases`` (its default: 2 kept) against profiles asking 2 and 3."""
    import json

    repo = new_repo(tmp_path, units, fallback=True, warm=True, keep=2)
    path = release_state.state_path(repo)
    st = json.loads(path.read_text())
    st.pop("keep_releases")
    path.write_text(json.dumps(st))
    prof = load_profile("fp8-h100")
    assert prof.deployment.keep_releases == 2 and repository_settings_warnings(prof, repo) == []
    dep = prof.deployment.model_copy(update={"keep_releases": 3})
    (w,) = repository_settings_warnings(prof.model_copy(update={"deployment": dep}), repo)
    assert w.startswith("fp8-h100 asks deployment.keep_releases 3 (the repository: 2); not applied")
