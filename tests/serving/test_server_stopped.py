"""A Triton server that stops answering while a command waits on it (hostile s12 F-N: killed during a promote's or
rollback's model load -> RemoteDisconnected traceback; F-L: frozen -> up to 900 s without a line): ``ServerStopped``,
exit 7, a sentence saying that nothing was switched. Stand-in HTTP servers (one that closes every connection without
an answer, one that holds every request) stand in for the dead and the frozen tritonserver; the live SIGSTOP is in
test_release_live.py."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from precision_pipeline.core.errors import EXIT_SERVER_STOPPED, ServerStopped, exit_code_for
from precision_pipeline.serving import release_live
from precision_pipeline.serving.triton_server import LOAD_STALL_S, TritonServer


@contextlib.contextmanager
def fake_tritonserver(args: str):
    """A process whose command line is ``tritonserver ARGS`` (it answers nothing): what ``server_processes`` lists as a
    local server. Yields the process once it is listed and asleep; kills it on the way out."""
    import subprocess
    import sys

    from precision_pipeline.serving.triton_server import process_state, server_processes

    p = subprocess.Popen(["bash", "-c", f'exec -a tritonserver "$0" -c "import time; time.sleep(120)" {args}',
                          sys.executable])
    try:
        for _ in range(200):  # listed, and asleep in time.sleep (no longer starting Python)
            if any(pid == p.pid for pid, _, _ in server_processes()) and process_state(p.pid).startswith("S"):
                break
            time.sleep(0.05)
        yield p
    finally:
        p.kill()
        p.wait()


class _Listener:
    """A TCP listener on 127.0.0.1 that, per connection, reads the request and then closes without an answer
    (``mode="close"``: a server killed mid-request) or holds it open for good (``mode="hold"``: a frozen one)."""

    def __init__(self, mode: str):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.mode, self.held, self.seen = mode, [], []
        threading.Thread(target=self._run, daemon=True).start()

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.sock.getsockname()[1]}"

    def _run(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.settimeout(2)
            try:
                self.seen.append(conn.recv(65536).split(b"\r\n", 1)[0].decode())
                conn.settimeout(0.2)  # read the rest (a body sent apart from the headers): a close with unread data
                while conn.recv(65536):  # is a reset (ConnectionResetError), not the clean close tested here
                    pass
            except OSError:
                pass
            if self.mode == "close":
                conn.close()
            else:
                self.held.append(conn)

    def close(self):
        self.sock.close()
        for c in self.held:
            c.close()


@pytest.fixture
def listener(request):
    lst = _Listener(request.param)
    yield lst
    lst.close()


def _server(url: str) -> TritonServer:
    host, _, port = url.rpartition(":")  # the client side only, as attach() makes it (attach would probe the URL)
    srv = TritonServer(Path("."), http_port=int(port), grpc_port=1, metrics_port=1)
    srv.host = host
    return srv


@pytest.mark.parametrize("listener", ["close"], indirect=True)
def test_a_server_that_dies_during_the_load_is_server_stopped(listener, capsys):
    srv = _server(listener.url)
    with pytest.raises(ServerStopped) as ei:
        release_live.load_unit(srv, "tensorrt_llm_aaaaaaaaaaaa", "--out", "tensorrt_llm_bbbbbbbbbbbb", "fix")
    msg = str(ei.value)
    assert msg.startswith(f"the Triton server at {listener.url} stopped answering while loading tensorrt_llm_aaaaaaaaaaaa "
                          "(RemoteDisconnected: Remote end closed connection without response). Nothing was switched: "
                          "releases.json still names tensorrt_llm_bbbbbbbbbbbb, and a restarted server serves it "
                          "(`invoke serve --repo REPO`); run the command again once it answers."), msg
    assert exit_code_for(ei.value) == EXIT_SERVER_STOPPED == 7
    assert isinstance(ei.value, ConnectionError)  # rollout's `except OSError` handlers see it as before
    assert listener.seen[0] == "POST /v2/repository/models/tensorrt_llm_aaaaaaaaaaaa/load HTTP/1.1"
    # once gone, the clean-up's requests fail at once instead of waiting on the server
    t = time.perf_counter()
    with pytest.raises(ServerStopped, match="while unloading tensorrt_llm_aaaaaaaaaaaa.$"):
        srv.unload("tensorrt_llm_aaaaaaaaaaaa")
    assert time.perf_counter() - t < 5.0 < LOAD_STALL_S and len(listener.seen) == 1  # no new request was sent


def test_nobody_listening_is_server_stopped():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: connection refused
        with pytest.raises(ServerStopped, match=r"stopped answering while reading its repository index \(URLError: "):
            _server(url).loaded_models()


@pytest.mark.parametrize("listener", ["hold"], indirect=True)
def test_a_frozen_server_is_given_up_after_the_stall_limit_with_progress_lines(listener, capsys):
    srv = _server(listener.url)
    t = time.perf_counter()
    with pytest.raises(ServerStopped) as ei:
        srv.load("tensorrt_llm_aaaaaaaaaaaa", stall_s=2.0, progress_s=1.0)
    took = time.perf_counter() - t
    assert 2.0 <= took < 6.0, took
    assert str(ei.value).startswith(f"the Triton server at {listener.url} stopped answering while loading "
                                    "tensorrt_llm_aaaaaaaaaaaa (no answer on /v2/health/live for "), str(ei.value)
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"  loading tensorrt_llm_aaaaaaaaaaaa on {listener.url}: 1 s ...", err
    assert len(err) >= 2
    assert listener.seen[0].startswith("POST /v2/repository/models/tensorrt_llm_aaaaaaaaaaaa/load ")
    assert "GET /v2/health/live HTTP/1.1" in listener.seen[1:]


def test_a_probe_run_that_cannot_reach_the_server_is_a_failed_run(tmp_path):
    """Hostile s12 F-P: `probe --every` ended with "the input was refused; nothing was changed" when the server
    stopped (the check of which repository it serves found no answer). Now that check raises ServerStopped, and
    ``probe_and_record`` counts such a run as an error run (exporter result "error", the loop goes on) instead."""
    from precision_pipeline.serving import probe as pr
    from precision_pipeline.serving.release_state import IDENTITY_PARAM

    (tmp_path / "ensemble").mkdir()
    (tmp_path / "ensemble" / "config.pbtxt").write_text(
        f'name: "ensemble"\nparameters {{\n  key: "{IDENTITY_PARAM}"\n  value {{ string_value: "abc" }}\n}}\n')
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, not listening: refused
        srv = _server(f"127.0.0.1:{s.getsockname()[1]}")
        with pytest.raises(ServerStopped, match="stopped answering while reading its ensemble's configuration"):
            release_live.verify_server(tmp_path, srv)

        class Exporter:
            seen = []

            def observe(self, profile, unit, res, error, route=""):
                self.seen.append((profile, unit, res, error))

        ex, pset = Exporter(), SimpleNamespace(prompts=[SimpleNamespace(input_ids=[1, 2, 3])], end_id=2)
        srv.gone = True  # left by an earlier run of the loop: this run asks the server again
        rec = pr.probe_and_record(srv, "tensorrt_llm_aaaaaaaaaaaa", pset, repo_dir=None, profile="fp8-h100", exporter=ex)
        err = rec["probe"]["error"]
        assert rec["probe"]["passed"] is False and "Connection refused" in err and "(--url)" not in err, err
        assert ex.seen == [("fp8-h100", "tensorrt_llm_aaaaaaaaaaaa", None, err)]


def test_the_rollout_line_after_the_server_stopped_says_so():
    """Hostile s12 F-O: after the server died mid-step, rollout said "<stable> serves all traffic (None ms from the
    decision ...)". Now it says that the server stopped and what it serves when started again; no "None"."""
    from precision_pipeline.cli.serving import rollout_outcome

    res = SimpleNamespace(status="rolled_back", failed_step=50, failed_check="server", stable="tensorrt_llm_bbbbbbbbbbbb",
                          candidate="tensorrt_llm_aaaaaaaaaaaa", decision_to_stable_ms=None, seconds=3.0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"127.0.0.1:{s.getsockname()[1]}"
        assert rollout_outcome(res, _server(url), url, Path("/r/repo")) == (
            f"[red]rolled back[/] at 50 %: the server at {url} stopped answering; releases.json names "
            "tensorrt_llm_bbbbbbbbbbbb, which it serves when started again (`invoke serve --repo /r/repo`); "
            "tensorrt_llm_aaaaaaaaaaaa was not promoted")
    alive = SimpleNamespace(loaded_models=lambda: {})  # the switch refused, the server answers
    assert rollout_outcome(res, alive, url, Path("/r/repo")) == (
        "[red]rolled back[/] at 50 %: check server failed; tensorrt_llm_bbbbbbbbbbbb serves all traffic")
    res.failed_check, res.decision_to_stable_ms = "kl_p99", 166.4
    assert rollout_outcome(res, alive, url, Path("/r/repo")) == (
        "[red]rolled back[/] at 50 %: check kl_p99 failed; tensorrt_llm_bbbbbbbbbbbb serves all traffic (166 ms from the "
        "decision to the candidate's last request)")


def test_load_returns_its_seconds(monkeypatch):
    """``load``'s return value is the seconds it took (the release records keep it as ``load_ms``)."""
    srv = _server("127.0.0.1:1")
    monkeypatch.setattr(srv, "_post", lambda *a, **k: b"")
    took = srv.load("tensorrt_llm_x")
    assert 0.0 <= took < 5.0


def test_server_processes_reads_only_tritonserver_command_lines(tmp_path):
    """``server_processes`` on a stand-in ``/proc``: a tritonserver's repository (a relative one against its working
    directory) and HTTP endpoint (defaults 0.0.0.0 -> 127.0.0.1 and 8000); other processes, an empty command line
    (a kernel thread) and an unreadable one are not servers; hostile s15 F2b: ``--model-repository repo`` (a separate
    value, as tritonserver also takes it) and ``--model-store`` count too, each repository of one server a row."""
    from precision_pipeline.serving.triton_server import server_processes, servers_of

    proc = tmp_path / "proc"
    repo = tmp_path / "srv" / "model_repository"
    repo.mkdir(parents=True)
    procs = {"101": ["/opt/tritonserver/bin/tritonserver", f"--model-repository={repo}/", "--http-port=9000",
                     "--http-address=10.0.0.5"],
             "102": ["tritonserver", "--model-repository=model_repository"],
             "103": ["python3", "-m", "tritonserver", f"--model-repository={repo}"],
             "104": [""], "105": None,
             "106": ["tritonserver", "--model-repository", "model_repository", "--http-port", "9100", "--exit-on-error",
                     "--model-store", str(tmp_path / "other")],
             "107": ["/tmp/tritonserver-2.51", f"--model-repository={repo}", "--http-port=9200"],  # hostile s16 H1
             "108": ["triton-prod", f"--model-repository={repo}", "--http-port=9300"],   # s16b F1: a renamed copy
             "109": ["triton-prod", "--http-port=9400"]}                                 # no repository: not listed
    for pid, argv in procs.items():
        (proc / pid).mkdir(parents=True)
        if argv is not None:
            (proc / pid / "cmdline").write_bytes("\0".join(argv).encode() + (b"\0" if argv != [""] else b""))
    (proc / "102" / "cwd").symlink_to(tmp_path / "srv")
    (proc / "106" / "cwd").symlink_to(tmp_path / "srv")
    (proc / "107" / "exe").symlink_to("/opt/tritonserver/bin/tritonserver")   # argv[0] a symlink's name: the exe says it
    (proc / "103" / "exe").symlink_to("/usr/bin/python3.11")
    for pid in ("108", "109"):
        (proc / pid / "exe").symlink_to("/tmp/triton-copy")
        (proc / pid / "maps").write_text("7f00-7f01 r-xp 0 08:01 12 /opt/tritonserver/lib/libtritonserver.so\n")
    (proc / "103" / "maps").write_text("7f00-7f01 r-xp 0 08:01 13 /usr/lib/libpython3.11.so\n")
    (tmp_path / "other").mkdir()
    assert server_processes(proc) == [(101, str(repo), "10.0.0.5:9000"), (102, str(repo), "127.0.0.1:8000"),
                                      (106, str(tmp_path / "other"), "127.0.0.1:9100"), (106, str(repo), "127.0.0.1:9100"),
                                      (107, str(repo), "127.0.0.1:9200"), (108, str(repo), "127.0.0.1:9300")]
    assert servers_of(repo, proc) == [(101, "10.0.0.5:9000"), (102, "127.0.0.1:8000"), (106, "127.0.0.1:9100"),
                                      (107, "127.0.0.1:9200"), (108, "127.0.0.1:9300")]
    assert server_processes(tmp_path / "no-proc") == []


def test_servers_of_knows_a_repository_by_identity_not_by_name(tmp_path):
    """Hostile s15 F2: the same directory bind-mounted at a second path is the same repository: a tritonserver
    serving it through the other mount point is one of its servers (``serve`` then refuses a second one and a change
    through ``--url`` names it). Needs ``mount --bind`` (root, as on CI); a plain other directory is never one."""
    import subprocess

    from precision_pipeline.serving.triton_server import same_directory, servers_of

    repo, other = tmp_path / "srv" / "model_repository", tmp_path / "other"
    repo.mkdir(parents=True)
    other.mkdir()
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "--bind", str(tmp_path / "srv"), str(mnt)], capture_output=True).returncode != 0:
        pytest.skip("mount --bind is not permitted here")
    try:
        proc = tmp_path / "proc"
        (proc / "201").mkdir(parents=True)
        (proc / "201" / "cmdline").write_bytes(f"tritonserver\0--model-repository={mnt}/model_repository\0".encode())
        assert servers_of(repo, proc) == [(201, "127.0.0.1:8000")]
        assert servers_of(other, proc) == []
        assert same_directory(str(mnt / "model_repository"), str(repo))
        assert not same_directory(str(other), str(repo))
        assert not same_directory(str(tmp_path / "missing"), str(repo))
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_wait_ready_returns_at_the_first_ready_answer_and_times_out_otherwise(monkeypatch):
    srv = _server("127.0.0.1:1")
    asked = []
    monkeypatch.setattr(srv, "_get", lambda path, **kw: asked.append(path) or 200)
    srv.wait_ready(timeout_s=5)
    assert asked == ["/v2/health/ready"]
    monkeypatch.setattr(srv, "_get", lambda path, **kw: 503)
    monkeypatch.setattr(srv, "log_tail", lambda *a, **k: "")
    with pytest.raises(TimeoutError, match="not ready after 0.3 s"):
        srv.wait_ready(timeout_s=0.3)


def test_a_server_used_as_a_context_starts_only_when_not_started(monkeypatch):
    srv = _server("127.0.0.1:1")
    started, stopped = [], []
    monkeypatch.setattr(srv, "start", lambda *a, **k: started.append(1))
    monkeypatch.setattr(srv, "stop", lambda *a, **k: stopped.append(1))
    with srv as s:
        assert s is srv and started == [1]
    srv.proc = object()  # already started (attach, or start() called before)
    with srv:
        pass
    assert (started, stopped) == ([1], [1, 1])


def test_attach_to_a_local_server_that_does_not_answer_names_it_and_its_state(tmp_path):
    """Hostile s15 F10: a stopped (SIGSTOP) tritonserver: `--url` said "no Triton server answers, start one", without
    --url "pass --url", and serve "already serves": a circle. ``attach`` now names the local process listening there,
    its state and the way out (a process with a tritonserver command line that never answers stands in)."""
    import signal

    from precision_pipeline.core.errors import UserError
    from precision_pipeline.serving.triton_server import TritonServer, free_port

    repo = tmp_path / "model_repository"
    repo.mkdir()
    port = free_port()
    with fake_tritonserver(f"--model-repository={repo} --http-port={port}") as p:
        with pytest.raises(UserError) as ei:
            TritonServer.attach(f"localhost:{port}")
        pr = ei.value.problems[0]
        assert pr.reason == (f"tritonserver (pid {p.pid}, serving {repo}) listens at localhost:{port} but does not answer "
                             "(process state S (sleeping)); nothing was changed.")
        assert pr.fix == f"wait for it, or stop it (kill {p.pid}) and start it again (`invoke serve --repo {repo}`)."
        p.send_signal(signal.SIGSTOP)
        time.sleep(0.2)
        with pytest.raises(UserError) as ei:
            TritonServer.attach(f"127.0.0.1:{port}")
        assert "(process state T (stopped))" in ei.value.problems[0].reason
        assert ei.value.problems[0].fix.startswith(f"resume it (kill -CONT {p.pid}), or stop it")
    with pytest.raises(UserError, match="no Triton server answers"):
        TritonServer.attach(f"127.0.0.1:{port}")


def test_a_rollout_refuses_the_metrics_port_of_another_local_server(tmp_path):
    """Hostile s15 F15: two repositories served from the same builds share unit names, so another server's metrics
    listed the candidate and a rollout judged its canary on r1's counters. The local tritonserver at --url names its
    own --metrics-port; another one is refused before anything is scraped or loaded."""
    from types import SimpleNamespace

    from precision_pipeline.core.errors import UserError
    from precision_pipeline.serving import rollout
    from precision_pipeline.serving.triton_server import free_port, local_metrics_port

    http, metrics = free_port(), free_port()
    with fake_tritonserver(f"--model-repository={tmp_path} --http-port={http} --metrics-port {metrics}") as p:
        assert local_metrics_port(f"localhost:{http}") == (p.pid, metrics)
        srv = SimpleNamespace(http_url=f"127.0.0.1:{http}", host="127.0.0.1", metrics_port=metrics + 1)
        with pytest.raises(UserError) as ei:
            rollout.check_metrics(srv, "tensorrt_llm_aaaaaaaaaaaa")
        assert ei.value.problems[0].reason.startswith(f"the tritonserver at 127.0.0.1:{http} (pid {p.pid}) exports its "
                                                      f"metrics on port {metrics}, not {metrics + 1}: ")
        assert ei.value.problems[0].fix == f"pass --metrics-port {metrics}."
    assert local_metrics_port(f"127.0.0.1:{http}") is None


def test_stop_kills_what_is_left_of_the_servers_process_group(tmp_path):
    """Hostile s15c T144: SIGTERM to `invoke serve` while its models loaded left a python backend stub running (ppid 1)
    after tritonserver exited. ``stop`` now kills what is left of the server's process group (a shell that leaves a
    child in its own new session stands in for tritonserver and a stub)."""
    import subprocess

    from precision_pipeline.serving.triton_server import TritonServer

    srv = object.__new__(TritonServer)
    srv.proc = subprocess.Popen(["bash", "-c", "sleep 60 & echo $! > child; exit 0"], cwd=tmp_path, start_new_session=True)
    srv.proc.wait(10)
    child = int((tmp_path / "child").read_text())
    srv.shm_token, srv._own_log = "none-such-token", False
    os.kill(child, 0)                                                   # left running, as a stub was
    srv.stop()
    for _ in range(100):
        try:
            os.kill(child, 0)
            if Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                break
        except (ProcessLookupError, FileNotFoundError):
            break
        time.sleep(0.05)
    else:
        pytest.fail("the group's leftover process was not killed")


def test_verify_server_refuses_the_local_server_of_a_copy(tmp_path):
    """Hostile s15c N7: a `cp -a` copy of repository r2 served by a tritonserver carries r2's identity parameters, so
    `rollback --repo r2 --url <the copy's server>` passed the check, changed the copy's server and ended in an internal
    error. A local tritonserver at --url must serve the repository itself (a stand-in process serves the copy)."""
    from types import SimpleNamespace

    from precision_pipeline.core.errors import UserError
    from precision_pipeline.serving.release_live import verify_server
    from precision_pipeline.serving.triton_server import free_port

    repo, copy = tmp_path / "r2" / "model_repository", tmp_path / "copy" / "model_repository"
    repo.mkdir(parents=True)
    copy.mkdir(parents=True)
    port = free_port()
    with fake_tritonserver(f"--model-repository={copy} --http-port={port}"):
        with pytest.raises(UserError) as ei:
            verify_server(repo, SimpleNamespace(http_url=f"127.0.0.1:{port}"))
        assert ei.value.problems[0].field == "--url"
        assert ei.value.problems[0].reason.startswith(f"the server at 127.0.0.1:{port} does not serve {repo}: it is a "
                                                      f"tritonserver of this machine serving {copy} (the folder decides")


def test_a_model_that_stays_unloading_is_said_and_given_up(monkeypatch, capsys):
    """Hostile s16 H5: after a backend stub died, its model stayed UNLOADING and a rollback's retention waited 120 s
    in silence. Now a line every LOAD_PROGRESS_S while it waits, and one when it gives up."""
    from precision_pipeline.serving import triton_server as ts

    srv = _server("127.0.0.1:1")
    posted = []
    monkeypatch.setattr(srv, "_post", lambda path, *a: posted.append(path) or b"{}")
    monkeypatch.setattr(srv, "loaded_models", lambda: {"tensorrt_llm_aaaaaaaaaaaa": "UNLOADING"})
    monkeypatch.setattr(ts, "LOAD_PROGRESS_S", 0.2)
    srv.unload("tensorrt_llm_aaaaaaaaaaaa", wait_s=0.7)
    err = capsys.readouterr().err.splitlines()
    assert posted == ["/v2/repository/models/tensorrt_llm_aaaaaaaaaaaa/unload"]
    assert sum(line.startswith("  unloading tensorrt_llm_aaaaaaaaaaaa on 127.0.0.1:1: ") for line in err) >= 1, err
    assert err[-1].startswith("  tensorrt_llm_aaaaaaaaaaaa is still UNLOADING on 127.0.0.1:1 after ") \
        and err[-1].endswith("not waited on further: the server frees it when it can"), err


def test_a_load_that_never_finishes_is_given_up_after_load_timeout_s(monkeypatch, capsys):
    """Hostile s16 H10: a model Triton keeps LOADING for ever (its stub cannot start) held serve's watchdog -- and the
    releases lock -- for minutes. ``load`` gives up after ``load_timeout_s`` (the watchdog's: ``HEAL_LOAD_S``)."""
    from precision_pipeline.serving import triton_server as ts

    srv = _server("127.0.0.1:1")
    srv.load_timeout_s = 0.6
    monkeypatch.setattr(srv, "_post", lambda *a: time.sleep(30))
    monkeypatch.setattr(srv, "_get", lambda *a, **k: 200)
    monkeypatch.setattr(ts, "LOAD_POLL_S", 0.1)
    t = time.monotonic()
    with pytest.raises(RuntimeError, match=r"loading tensorrt_llm_bls did not finish in \d+ s \(the server keeps that load pending"):
        srv.load("tensorrt_llm_bls", progress_s=0.2)
    assert time.monotonic() - t < 20
    assert "  loading tensorrt_llm_bls on 127.0.0.1:1: " in capsys.readouterr().err
    assert ts.HEAL_LOAD_S == 60.0 and TritonServer.load_timeout_s == 900.0


def test_stop_does_not_wait_for_minutes_on_an_unload_that_never_ends(monkeypatch):
    """Hostile s16 H13c: `invoke serve`'s stop was silent ~140 s while an instance blocked for good kept its unload
    from finishing; each unload is now given STOP_UNLOAD_S before the signals end the server."""
    import subprocess
    import sys

    from precision_pipeline.serving import triton_server as ts

    srv = _server("127.0.0.1:1")
    srv.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    monkeypatch.setattr(ts, "STOP_UNLOAD_S", 0.3)
    monkeypatch.setattr(srv, "loaded_models", lambda: {"tensorrt_llm_bls": "READY"})
    monkeypatch.setattr(srv, "unload", lambda *a: time.sleep(30))
    t = time.monotonic()
    srv.stop(timeout_s=5)
    assert time.monotonic() - t < 10 and srv.proc.poll() is not None


def test_stop_says_each_step_that_waits(monkeypatch):
    """Hostile s17c H17: `invoke serve` printed "stopping (SIGTERM) ..." and then nothing for 62 s while its
    tritonserver (a load pending in it) ignored SIGTERM; each step that may wait is said now, the SIGKILL too."""
    import subprocess
    import sys

    from precision_pipeline.serving import triton_server as ts

    srv = _server("127.0.0.1:1")
    srv.proc = subprocess.Popen([sys.executable, "-c", "import signal, sys, time; signal.signal(signal.SIGTERM, "
                                 "signal.SIG_IGN); print(1, flush=True); time.sleep(60)"], start_new_session=True,
                                stdout=subprocess.PIPE)
    srv.proc.stdout.readline()  # SIGTERM is ignored from here on
    monkeypatch.setattr(ts, "STOP_UNLOAD_S", 0.3)
    monkeypatch.setattr(ts, "LOAD_PROGRESS_S", 0.5)
    monkeypatch.setattr(srv, "loaded_models", lambda: {"tensorrt_llm_bls": "READY", "ensemble": "READY"})
    monkeypatch.setattr(srv, "unload", lambda *a: None)
    said = []
    srv.stop(timeout_s=2, say=said.append)
    pid = srv.proc.pid
    assert said == ["  unloading 2 models (each at most 0 s, side by side) ...",
                    f"  tritonserver (pid {pid}) has not exited 0 s after SIGTERM (a model load or unload it waits "
                    "on?); SIGKILL in 2 s", f"  tritonserver (pid {pid}): SIGKILL"]
    assert srv.proc.returncode == -9


def test_a_rollout_without_url_names_the_repositorys_server_or_says_it_needs_one(tmp_path):
    """Hostile s16 H11: `rollout` without --url tried 127.0.0.1:8000 and said "leave --url out" -- it was left out, and
    the repository's server ran elsewhere."""
    from precision_pipeline.cli import serving as cli
    from precision_pipeline.core.errors import UserError
    from precision_pipeline.serving.triton_server import free_port

    repo = tmp_path / "model_repository"
    repo.mkdir()
    port = free_port()
    with pytest.raises(UserError) as ei:
        cli._rollout_server(f"127.0.0.1:{port}", False, None, repo)
    assert ei.value.problems[0].reason == (f"is not given, and no Triton server answers at the default 127.0.0.1:{port}: a "
                                           "rollout moves live traffic, so it needs the server of the repository.")
    assert "leave --url out" not in ei.value.message
    with fake_tritonserver(f"--model-repository={repo} --http-port=9931") as srv:
        with pytest.raises(UserError) as ei:
            cli._rollout_server("127.0.0.1:8000", False, None, repo)
    assert ei.value.problems[0].reason == (f"is not given (default 127.0.0.1:8000), but tritonserver (pid {srv.pid}) "
                                           f"serves {repo} at 127.0.0.1:9931; nothing was changed.")
    assert ei.value.problems[0].fix == "pass --url 127.0.0.1:9931."


def test_a_handle_on_a_running_server_makes_no_log_file(tmp_path, monkeypatch):
    """Hostile s17 F3: every --url command made an empty /tmp/tritonserver-*.log (never removed, its descriptor left
    open), and under `ulimit -f 0` or a full /tmp that mkstemp was a traceback before anything was asked. Only
    start() makes the temporary log."""
    import tempfile

    from precision_pipeline.core.errors import UserError

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        with pytest.raises(UserError, match="no Triton server answers at"):
            TritonServer.attach(f"127.0.0.1:{s.getsockname()[1]}")
    assert _server("127.0.0.1:1").log_file is None and _server("127.0.0.1:1").log_tail() == ""
    assert list(tmp_path.iterdir()) == []


def test_each_watchdog_pass_starts_afresh_after_a_request_timed_out(tmp_path, monkeypatch):
    """Hostile s17 X3: a request that timed out while tritonserver was SIGSTOPped set ``gone`` on serve's handle for
    good; every later watchdog pass then failed at once (ServerStopped) and a killed BLS stub was never revived. Each
    pass of a running server starts with ``gone`` cleared."""
    import subprocess
    import sys

    from precision_pipeline.serving import release_recover
    from precision_pipeline.serving import triton_server as ts

    srv = _server("127.0.0.1:1")
    srv.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    srv.stop = lambda *a, **k: srv.proc.kill()
    seen = []

    def heal(repo, server):
        seen.append(server.gone)
        server.gone = True  # this pass's request timed out
        if len(seen) == 3:
            server.proc.kill()
            server.proc.wait()  # the loop's next poll() sees it ended
        return []

    monkeypatch.setattr(ts, "HEAL_EVERY_S", 0.0)
    monkeypatch.setattr(release_recover, "heal", heal)
    monkeypatch.setattr("precision_pipeline.serving.serve_watchdog.revive_dead_instances", lambda s, seen: [])
    ts._run_until_stopped(srv, tmp_path, heal=True)
    assert seen == [False, False, False]


def test_a_connection_closed_mid_smoke_test_is_server_stopped(monkeypatch):
    """Hostile s17b F8: the server stopped during a promote's smoke test: geventhttpclient's HTTPConnectionClosed (an
    http.client.HTTPException, no OSError) escaped as a traceback and "internal error". It is the server's stop."""
    from geventhttpclient.response import HTTPConnectionClosed

    def closed(server, unit, **k):
        raise HTTPConnectionClosed("connection closed.")

    monkeypatch.setattr(release_live, "smoke_test", closed)
    srv = _server("127.0.0.1:1")
    with pytest.raises(ServerStopped) as ei:
        release_live.smoke_unit(srv, "tensorrt_llm_aaaaaaaaaaaa", "--out", "tensorrt_llm_bbbbbbbbbbbb", "fix")
    assert str(ei.value).startswith("the Triton server at 127.0.0.1:1 stopped answering while smoke-testing "
                                    "tensorrt_llm_aaaaaaaaaaaa (HTTPConnectionClosed: connection closed.).")
    assert "Nothing was switched: releases.json still names tensorrt_llm_bbbbbbbbbbbb" in str(ei.value)
    assert exit_code_for(ei.value) == EXIT_SERVER_STOPPED


def test_a_smoke_request_failing_while_the_server_unloads_its_entry_models_is_the_servers_stop(monkeypatch):
    """Hostile s17b F12: SIGTERM of serve during a promote's smoke request: "[404] preprocessing has no available
    versions" was blamed on the build ("rebuild the output"). The server had unloaded its models (stopping)."""
    from tritonclient.utils import InferenceServerException

    def fails(server, unit, **k):
        raise InferenceServerException("[404] Request for unknown model: 'preprocessing' has no available versions")

    monkeypatch.setattr(release_live, "smoke_test", fails)
    srv = _server("127.0.0.1:1")
    srv.loaded_models = lambda: {"preprocessing": "UNLOADING", "postprocessing": "READY"}
    with pytest.raises(ServerStopped) as ei:
        release_live.smoke_unit(srv, "tensorrt_llm_aaaaaaaaaaaa", "--out", "tensorrt_llm_bbbbbbbbbbbb", "rebuild")
    assert "it unloaded preprocessing meanwhile (stopping?)" in str(ei.value)
    srv.loaded_models = lambda: {"preprocessing": "READY", "postprocessing": "READY"}
    with pytest.raises(UserError_) as ei:
        release_live.smoke_unit(srv, "tensorrt_llm_aaaaaaaaaaaa", "--out", "tensorrt_llm_bbbbbbbbbbbb", "rebuild")
    assert "loads but fails its smoke request" in ei.value.problems[0].reason


from precision_pipeline.core.errors import UserError as UserError_  # noqa: E402


def test_a_dead_instance_that_cannot_be_reloaded_is_said_once_with_why(tmp_path, monkeypatch, capsys):
    """Hostile s17c H16: tensorrt_llm_bls/1/model.py removed, then its stub killed: every BLS request failed and serve's
    watchdog printed only "loading tensorrt_llm_bls ... 50 s" lines, never that the reload failed or why (the failure
    was swallowed). The missing file is named once, without a 60 s load attempt; a reload that fails is said too."""
    import subprocess
    import sys

    from precision_pipeline.serving import serve_watchdog

    (tmp_path / "tensorrt_llm_bls" / "1").mkdir(parents=True)
    (tmp_path / "tensorrt_llm_bls" / "config.pbtxt").write_text("")
    srv = _server("127.0.0.1:1")
    srv.model_repository = tmp_path
    srv.proc = subprocess.Popen([sys.executable, "-c", "pass"])
    srv.proc.wait()
    srv.loaded_models = lambda: {"tensorrt_llm_bls": "READY"}
    monkeypatch.setattr(serve_watchdog, "backend_stubs", lambda pid: {})
    loads = []
    monkeypatch.setattr(serve_watchdog, "reload_model", lambda s, m: loads.append(m))
    seen = {"tensorrt_llm_bls": {"tensorrt_llm_bls_0_0"}}
    assert serve_watchdog.revive_dead_instances(srv, seen) == []
    assert serve_watchdog.revive_dead_instances(srv, seen) == []
    out = capsys.readouterr().out
    assert out.count("[serve] not repaired: tensorrt_llm_bls's instance tensorrt_llm_bls_0_0 died and it cannot be "
                     f"reloaded ({tmp_path / 'tensorrt_llm_bls' / '1' / 'model.py'} is missing") == 1 and loads == []
    (tmp_path / "tensorrt_llm_bls" / "1" / "model.py").write_text("")
    assert serve_watchdog.revive_dead_instances(srv, seen)[0].startswith("tensorrt_llm_bls reloaded")
    assert loads == ["tensorrt_llm_bls"]


def test_a_reload_that_never_finishes_is_said_once_and_not_queued_again(tmp_path, monkeypatch, capsys):
    """Hostile s17c H17: a reload Triton keeps pending for good (a stub that cannot start) read as "server stopped"
    (the request's socket timeout won), which the watchdog swallowed and retried every 5 s -- silently, holding the
    releases lock 60 s each time, each retry queued in Triton behind the pending one. Now: said once with the fix
    (restart the server), not tried again until that load ends (new instances appear, or the model leaves READY)."""
    import subprocess
    import sys

    from precision_pipeline.core.errors import LoadNotFinished
    from precision_pipeline.serving import serve_watchdog

    (tmp_path / "tensorrt_llm_bls" / "1").mkdir(parents=True)
    (tmp_path / "tensorrt_llm_bls" / "config.pbtxt").write_text("")
    (tmp_path / "tensorrt_llm_bls" / "1" / "model.py").write_text("")
    srv = _server("127.0.0.1:1")
    srv.model_repository = tmp_path
    srv.proc = subprocess.Popen([sys.executable, "-c", "pass"])
    srv.proc.wait()
    states = {"tensorrt_llm_bls": "READY"}
    srv.loaded_models = lambda: dict(states)
    stubs = {}
    monkeypatch.setattr(serve_watchdog, "backend_stubs", lambda pid: dict(stubs))
    monkeypatch.setattr(serve_watchdog, "process_state", lambda pid: "S (sleeping)")
    loads = []

    def pending(s, m):
        loads.append(m)
        raise LoadNotFinished(f"loading {m} did not finish in 60 s (the server keeps that load pending and queues "
                              "every later load of it behind that one; its log says why)")

    monkeypatch.setattr(serve_watchdog, "reload_model", pending)
    seen = {"tensorrt_llm_bls": {"tensorrt_llm_bls_0_0"}}
    for _ in range(3):
        assert serve_watchdog.revive_dead_instances(srv, seen) == []
    assert loads == ["tensorrt_llm_bls"]
    out = capsys.readouterr().out
    assert out == ("[serve] not repaired: tensorrt_llm_bls's instance tensorrt_llm_bls_0_0 died and it could not be reloaded: "
                   "loading tensorrt_llm_bls did not finish in 60 s (the server keeps that load pending and queues every later "
                   "load of it behind that one; its log says why); another reload would wait behind it, so none is "
                   "tried; every request to tensorrt_llm_bls fails meanwhile. Fix: restart the server (stop `invoke "
                   "serve` with Ctrl-C, then run it again: it starts with releases.json's current unit)\n")
    stubs["tensorrt_llm_bls_0_0"] = 4242                       # the pending load finished after all: new instance
    monkeypatch.setattr(serve_watchdog, "reload_model", lambda s, m: loads.append(m))
    assert serve_watchdog.revive_dead_instances(srv, seen) == [] and loads == ["tensorrt_llm_bls"]
    assert seen["tensorrt_llm_bls"] == {"tensorrt_llm_bls_0_0"} and "!pending:tensorrt_llm_bls" not in seen
    del stubs["tensorrt_llm_bls_0_0"]                          # it dies again: reloaded again
    assert serve_watchdog.revive_dead_instances(srv, seen)[0].startswith("tensorrt_llm_bls reloaded")
    assert loads == ["tensorrt_llm_bls"] * 2


def test_the_load_request_outlives_the_load_limit_so_a_pending_load_is_no_server_stop(monkeypatch):
    """Hostile s17c H17: the load request's own timeout equalled ``load_timeout_s``, so a load Triton kept pending
    ended as ServerStopped (a socket timeout) rather than "did not finish" while the server answered."""
    from precision_pipeline.core.errors import LoadNotFinished
    from precision_pipeline.serving import triton_server as ts

    srv = _server("127.0.0.1:1")
    srv.load_timeout_s = 0.5
    limits = []

    def post(path, body, timeout, doing):
        limits.append(timeout)
        time.sleep(timeout)
        raise srv.stopped(doing, TimeoutError("timed out"))

    monkeypatch.setattr(srv, "_post", post)
    monkeypatch.setattr(srv, "_get", lambda *a, **k: 200)
    monkeypatch.setattr(ts, "LOAD_POLL_S", 0.05)
    with pytest.raises(LoadNotFinished, match=r"^loading tensorrt_llm_bls did not finish in \d+ s"):
        srv.load("tensorrt_llm_bls")
    assert limits == [0.5 + ts.LOAD_POST_SLACK_S] and ts.LOAD_POST_SLACK_S == 30.0


def test_the_entry_point_check_is_bounded_and_says_a_pending_reload(tmp_path, monkeypatch):
    """Hostile s17c H17: after a switch, the request through the BLS waited up to 600 s and its reload up to 900 s, in
    silence, on a server whose BLS load was pending: the rollback ran into the user's 300 s timeout. The request waits
    ``ENTRY_POINT_REQUEST_S``, the reload ``ENTRY_POINT_RELOAD_S``, and a pending reload is said with the fix."""
    from precision_pipeline.core.errors import LoadNotFinished, PipelineError
    from precision_pipeline.serving import serve_watchdog as wd

    (tmp_path / "tensorrt_llm_bls" / "1").mkdir(parents=True)
    (tmp_path / "tensorrt_llm_bls" / "config.pbtxt").write_text("")
    (tmp_path / "tensorrt_llm_bls" / "1" / "model.py").write_text("")
    asked, limits = [], []

    class Client:
        def infer(self, *a):
            raise RuntimeError("[500] Stub process 'tensorrt_llm_bls_0_0' is not healthy.")

        def close(self):
            pass

    server = SimpleNamespace(load_timeout_s=900.0, http_client=lambda **kw: asked.append(kw) or Client())

    def pending(srv, model):
        limits.append(srv.load_timeout_s)
        raise LoadNotFinished("loading tensorrt_llm_bls did not finish in 120 s (the server keeps that load pending)")

    monkeypatch.setattr(wd, "reload_model", pending)
    with pytest.raises(PipelineError) as ei:
        wd.entry_point_note(server, tmp_path, "rolled back to X")
    assert str(ei.value) == ("rolled back to X: releases.json and the server agree, but requests through tensorrt_llm_bls "
                             "(the entry point) fail (RuntimeError: [500] Stub process 'tensorrt_llm_bls_0_0' is not "
                             "healthy.), and it could not be reloaded: loading tensorrt_llm_bls did not finish in 120 s "
                             f"(the server keeps that load pending). Fix: restart the server (`invoke serve --repo {tmp_path}`).")
    assert asked == [{"connection_timeout": 60.0, "network_timeout": 60.0}] and wd.ENTRY_POINT_REQUEST_S == 60.0
    assert limits == [120.0] == [wd.ENTRY_POINT_RELOAD_S] and server.load_timeout_s == 900.0


def test_a_smoke_test_failing_in_an_entry_model_blames_the_entry_model_not_the_unit():
    """Hostile s18b F2: preprocessing's stub dead (its tokenizer gone): promote --url said the built unit "loads but
    fails its smoke request ... fix: rebuild the output", and rollback --url blamed a good kept unit."""
    from tritonclient.utils import InferenceServerException

    from precision_pipeline.serving import release_live

    unloaded = []

    class Client:
        def infer(self, model, *a, **k):
            raise InferenceServerException("[400] Stub process 'preprocessing_0_0' is not healthy.")

        def close(self):
            pass

    server = SimpleNamespace(http_client=lambda **kw: Client(), loaded_models=lambda: {"preprocessing": "READY"},
                             unload=lambda name, *a, **k: unloaded.append(name))
    with pytest.raises(UserError_) as ei:
        release_live.smoke_unit(server, "tensorrt_llm_aaaaaaaaaaaa", "--out", "tensorrt_llm_bbbbbbbbbbbb",
                                "rebuild the output")
    p = ei.value.problems[0]
    assert p.field == "--url" and p.reason == (
        "the server's preprocessing fails ([400] Stub process 'preprocessing_0_0' is not healthy.), so "
        "tensorrt_llm_aaaaaaaaaaaa could not be smoke-tested and nothing was switched (tensorrt_llm_bbbbbbbbbbbb still "
        "serves); the entry model is broken, not tensorrt_llm_aaaaaaaaaaaa.")
    assert "rebuild" not in p.fix and "`invoke releases --repo REPO`" in p.fix


def test_a_unit_still_loading_from_an_earlier_load_is_refused_at_once():
    """Hostile s18b F1: `rollback --to X --url` while X was still LOADING from an earlier load (its stub stopped)
    waited again with only "loading X ... N s" lines, up to 900 s."""
    from precision_pipeline.serving import release_live

    loads = []
    server = SimpleNamespace(http_url="127.0.0.1:1", load=lambda name, *a, **k: loads.append(name))
    with pytest.raises(UserError_) as ei:
        release_live.load_unit(server, "tensorrt_llm_aaaaaaaaaaaa", "--to", "tensorrt_llm_bbbbbbbbbbbb", "fix",
                               {"tensorrt_llm_aaaaaaaaaaaa": "LOADING"})  # rollback's index of the server
    p = ei.value.problems[0]
    assert p.field == "--url" and loads == [] and p.reason.startswith(
        "the server at 127.0.0.1:1 still lists tensorrt_llm_aaaaaaaaaaaa as LOADING from an earlier load that never "
        "finished") and p.reason.endswith("nothing was switched (tensorrt_llm_bbbbbbbbbbbb still serves).")
