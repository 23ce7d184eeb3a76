"""Findings of the session-7 hostile round (issue 25; log /work/helpers/s7/hostile-round-s7.md), as failing tests.

They were ``xfail(strict=True)`` until fixed (branch s7-fix); now plain regression tests."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from precision_pipeline.core.errors import UserError
from precision_pipeline.serving import release, release_live, release_recover, release_state
from tests.serving.test_release import new_repo, units  # noqa: F401  (the module fixture)

ROOT = Path(__file__).resolve().parents[2]


class _Server:
    """A stand-in for an attached TritonServer: load/unload/loaded_models only (the rest is patched out)."""

    http_url = "127.0.0.1:1"

    def __init__(self, loaded):
        self.state = dict.fromkeys(loaded, "READY")

    def load(self, name):
        self.state[name] = "READY"

    def unload(self, name):
        self.state[name] = "UNAVAILABLE"

    def loaded_models(self):
        return dict(self.state)


def test_rollback_after_failed_smoke_does_not_switch_to_it_warm(tmp_path, units, monkeypatch):  # noqa: F811
    a = units[0].engine_unit
    repo = new_repo(tmp_path, units, fallback=False)
    release.promote(repo, units[2].out_dir)  # current: units[2], previous: a
    srv = _Server(["ensemble", "preprocessing", "postprocessing", units[2].engine_unit])
    switched = []
    monkeypatch.setattr(release_recover, "verify_server", lambda *a, **k: None)
    monkeypatch.setattr(release_recover, "reconcile_server", lambda *a, **k: [])
    monkeypatch.setattr(release, "switch", lambda repo_dir, server, unit, *a, **k: switched.append(unit))

    def bad_smoke(server, unit, **k):
        raise RuntimeError(f"smoke test of {unit}: empty text")

    monkeypatch.setattr(release_live, "smoke_test", bad_smoke)
    with pytest.raises(UserError):
        release.rollback(repo, to=a, server=srv)
    assert srv.state.get(a) != "READY", "the unit that failed its smoke test stays loaded"
    srv.load(a)  # warm, however it got loaded: a warm target is smoke-tested too
    with pytest.raises(UserError, match="fails its smoke request"):  # the same rollback again: refused again
        release.rollback(repo, to=a, server=srv)
    assert switched == [] and srv.state.get(a) != "READY"


class _NotTriton(http.server.BaseHTTPRequestHandler):
    """Answers 200 text/plain on every path, as Triton's metrics port does."""

    def do_GET(self):  # noqa: N802
        body = b"# HELP nv_inference_count\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


def _fake_repo(tmp_path) -> Path:
    repo = tmp_path / "serving" / "model_repository"
    (repo / "ensemble").mkdir(parents=True)
    (repo / "ensemble" / "config.pbtxt").write_text(
        'name: "ensemble"\nplatform: "ensemble"\n'
        f'parameters {{ key: "{release_state.IDENTITY_PARAM}" value {{ string_value: "0123456789abcdef" }} }}\n')
    (repo.parent / "releases.json").write_text("{}")
    return repo


def _invoke(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, COLUMNS="250"))


def test_url_at_metrics_port_is_refused_not_a_traceback(tmp_path):
    """hostile s7 #70/#73: an HTTP port that is not Triton's HTTP endpoint (the metrics port answers text)."""
    repo = _fake_repo(tmp_path)
    httpd = http.server.HTTPServer(("127.0.0.1", 0), _NotTriton)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        r = _invoke("rollback", "--repo", str(repo), "--url", f"127.0.0.1:{httpd.server_address[1]}")
    finally:
        httpd.shutdown()
    text = r.stdout + r.stderr
    assert "Traceback" not in text, text
    assert r.returncode == 2 and "--url:" in text and "does not answer Triton's HTTP API (v2)" in text, text


def test_url_at_grpc_port_is_refused_not_a_traceback(tmp_path):
    """hostile s7 #74: a gRPC (HTTP/2) port answers an HTTP/1 request with HTTP/2 frames or a closed connection."""
    from concurrent import futures

    import grpc

    repo = _fake_repo(tmp_path)
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    try:
        r = _invoke("rollout", "--abort", "--repo", str(repo), "--url", f"127.0.0.1:{port}")
    finally:
        srv.stop(0)
    text = r.stdout + r.stderr
    assert "Traceback" not in text, text
    assert r.returncode == 2 and "--url:" in text and "does not answer Triton's HTTP API (v2)" in text, text


@pytest.mark.parametrize("url", ["", "  "])
def test_empty_url_is_refused(url):
    """hostile s7 #71: an empty --url (an unset $URL) is not "no server"."""
    from precision_pipeline.serving.triton_server import TritonServer

    assert TritonServer.from_url(None) is None  # the option not given: repository only
    with pytest.raises(UserError, match="--url") as e:
        TritonServer.from_url(url)
    assert "is empty" in str(e.value)


_SIGTERM_CHILD = r'''
import sys
from precision_pipeline.serving.triton_server import terminate_as_interrupt
import tritonclient.http as hc
with terminate_as_interrupt():
    try:
        c = hc.InferenceServerClient("127.0.0.1:%d", network_timeout=60)
        print("ready", flush=True)
        c.is_server_live()  # waits in gevent's hub: the listener never answers
    except KeyboardInterrupt as e:
        print("interrupted", e, flush=True)
        sys.exit(130)
'''


def test_sigterm_while_tritonclient_waits_is_interrupted_without_a_traceback():
    """hostile s7 #109: SIGTERM during a tritonclient.http request (a rollout's smoke test of the candidate)
    raised in gevent's hub, which printed a traceback of the signal handler before the task said "interrupted"."""
    import signal
    import socket
    import time

    with socket.socket() as ls:
        ls.bind(("127.0.0.1", 0))
        ls.listen(8)  # accepts connections into its backlog, never answers
        p = subprocess.Popen([sys.executable, "-c", _SIGTERM_CHILD % ls.getsockname()[1]], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=ROOT,
                             env=dict(os.environ, PYTHONPATH=str(ROOT / "build")))
        assert p.stdout.readline().strip() == "ready"
        time.sleep(1.0)  # in the request
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
    assert (p.returncode, out.strip()) == (130, "interrupted SIGTERM"), (out, err)
    assert "Traceback" not in err, err


def _largest_file(unit_dir: Path) -> Path:
    return max((p for p in unit_dir.rglob("*") if p.is_file() and p.name != "config.pbtxt"), key=lambda p: p.stat().st_size)


def test_rollback_refuses_a_kept_unit_whose_files_changed(tmp_path, units):  # noqa: F811
    """hostile s7 #52: a kept release with bytes zeroed (size kept) was rolled back to and served."""
    a, c = units[0].engine_unit, units[2].engine_unit
    repo = new_repo(tmp_path, units)
    release.promote(repo, units[2].out_dir)  # current c, previous a (its record written at init)
    assert set(release.read_state(repo)["unit_files"]) == {a, units[1].engine_unit, c}
    f = _largest_file(repo / a)
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.write(b"\0" * min(size, 65536))
    before = (repo.parent / "releases.json").read_text()
    with pytest.raises(UserError) as e:
        release.rollback(repo)
    msg = str(e.value)
    assert f"{a}/{f.relative_to(repo / a)} has the recorded size ({size:,} bytes) but another sha256" in msg, msg
    assert f"{c} still serves" in msg
    assert (repo.parent / "releases.json").read_text() == before  # nothing switched
    assert release.list_releases(repo)["configs"] == (c, c)


def test_rollback_refuses_swapped_unit_folders(tmp_path, units):  # noqa: F811
    """hostile s7 #86: two kept unit folders with swapped names: rollback made the other unit's files current."""
    a, b, c = (u.engine_unit for u in units)
    repo = new_repo(tmp_path, units)  # fallback b
    release.promote(repo, units[2].out_dir)  # current c, previous a
    os.rename(repo / a, repo / "swap")
    os.rename(repo / b, repo / a)
    os.rename(repo / "swap", repo / b)
    for kw, field in (({"to": a}, "--to"), ({"fallback": True}, "--fallback")):
        with pytest.raises(UserError) as e:
            release.rollback(repo, **kw)
        assert e.value.problems[0].field == field and "config.pbtxt" in str(e.value), str(e.value)
    assert release.read_state(repo)["current"] == c and release.list_releases(repo)["configs"] == (c, c)
    # folders put back: the same rollback is accepted (verified)
    os.rename(repo / a, repo / "swap")
    os.rename(repo / b, repo / a)
    os.rename(repo / "swap", repo / b)
    t = release.rollback(repo, to=a)
    assert t["unit"] == a and t["verified"] is True


def test_rollback_without_previous_or_fallback_does_not_suggest_fallback(tmp_path, units):  # noqa: F811
    """hostile s7 #90: the fix named --fallback for a repository that has none."""
    repo = new_repo(tmp_path, units, fallback=False)
    with pytest.raises(UserError) as e:
        release.rollback(repo)
    assert "no previous release" in str(e.value) and "--fallback" not in str(e.value) and "no fallback" in str(e.value)
    repo2 = new_repo(tmp_path / "fb", units)
    with pytest.raises(UserError, match=r"roll back to the fallback \(--fallback\)"):
        release.rollback(repo2)


def test_repo_that_is_a_file_is_named_a_file(tmp_path):
    """hostile s7 #105: `releases --repo <releases.json>` said the file "does not exist"."""
    f = tmp_path / "releases.json"
    f.write_text("{}")
    for call in (release.list_releases, release.rollback):
        with pytest.raises(UserError, match="is a file, not a folder"):
            call(f)
