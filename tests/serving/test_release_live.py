"""Releases against a real tritonserver (CPU reference backend): the live server always serves what
releases.json records (issue 25 items 3, 4, 6, 15, 17, 20).

One server for the module, on serving repository A (current unit A of ``units4``). The tests run in
file order and build on each other's history; the LAST test kills the server (kill -9).
"""

from __future__ import annotations

import contextlib
import json
import re
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from precision_pipeline.core.errors import PipelineError, UserError
from precision_pipeline.serving import release, release_configs, release_live, release_recover, release_state, rollout
from precision_pipeline.serving.triton_server import SHM_PREFIX, TritonServer, free_port, models_to_load, text_request
from tests.serving.test_release_safety import units4  # noqa: F401  (module fixture)

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def served(tmp_path_factory, units4):  # noqa: F811
    repo = tmp_path_factory.mktemp("live-a") / "model_repository"
    release_recover.init_serving_repo(repo, units4[0].out_dir, profile="bf16-h100")
    srv = TritonServer(repo, models_to_load(repo), log_file=repo.parent / "server.log")
    srv.start()
    print(f"\n[release-live] server ready in {srv.start_s:.1f} s")
    try:
        yield repo, srv
    finally:
        srv.stop()


def ask(srv, model="ensemble") -> str:
    c = srv.http_client()
    try:
        return c.infer(model, text_request("What is 2 + 2?", 2)).as_numpy("text_output").reshape(-1)[0].decode()
    finally:
        c.close()


def in_subprocess(code: str, crash_at: str | None = None, **kw) -> subprocess.Popen | subprocess.CompletedProcess:
    env = dict(os.environ, **({release_state.CRASH_ENV: crash_at} if crash_at else {}))
    pre = "import sys, json; sys.path.insert(0, 'build'); from pathlib import Path; "
    return subprocess.run([sys.executable, "-c", pre + code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600, **kw)


def at_step(repo, percent) -> bool:
    """The rollout's route.json (written after releases.json) sends ``percent`` % to the candidate."""
    route = json.loads((repo / "tensorrt_llm_bls" / "route.json").read_text())
    return (route.get("canary") or {}).get("percent") == percent


def attach_code(srv) -> str:
    return (f"from precision_pipeline.serving.triton_server import TritonServer; srv = TritonServer.attach({srv.http_url!r}); "
            f"srv.metrics_port = {srv.metrics_port}; ")


def test_url_of_another_repository_is_refused_before_anything_changes(served, units4, tmp_path):  # noqa: F811
    repo_a, srv = served
    release_live.verify_server(repo_a, srv)                # the server serves A: accepted
    repo_b = tmp_path / "b" / "model_repository"      # B: the same unit names as A (the same build)
    release_recover.init_serving_repo(repo_b, units4[0].out_dir, profile="bf16-h100")
    release.promote(repo_b, units4[1].out_dir)
    before_b, before_srv = release_state.state_path(repo_b).read_text(), srv.loaded_models()
    for call in (lambda: release.rollback(repo_b, server=srv),
                 lambda: release.promote(repo_b, units4[2].out_dir, server=srv),
                 lambda: release_recover.recover(repo_b, server=srv),
                 lambda: rollout.rollout(repo_b, units4[2].out_dir, srv, None, steps=(100,), hold_s=0)):
        with pytest.raises(UserError, match="does not serve") as ei:
            call()
        assert ei.value.problems[0].field == "--url"
    r = subprocess.run([sys.executable, "-m", "invoke", "rollback", "--repo", str(repo_b), "--url", srv.http_url],
                       cwd=ROOT, capture_output=True, text=True, timeout=120, env=dict(os.environ, COLUMNS="200"))
    assert r.returncode == 2 and "--url:" in r.stderr and "Traceback" not in r.stdout + r.stderr
    assert release_state.state_path(repo_b).read_text() == before_b and srv.loaded_models() == before_srv
    assert ask(srv).strip()                           # A still serves
    assert release_live.live_unit(srv) == units4[0].engine_unit


def test_url_of_another_repository_while_its_own_server_runs_names_that_server(served, units4, tmp_path):  # noqa: F811
    """Hostile s15 F6: --url of the server of repository A for repository B, while B's own server runs: the refusal
    said the --url server serves B "too" and its fix was to kill B's own (right) server. Now the --url server's identity
    is checked first and B's server is named as the one to pass (a process with a tritonserver command line stands in
    for it)."""
    from precision_pipeline.cli import serving as cli
    from precision_pipeline.serving.triton_server import servers_of

    repo_a, srv = served
    repo_b = tmp_path / "b" / "model_repository"
    release_recover.init_serving_repo(repo_b, units4[0].out_dir, profile="bf16-h100")
    port = free_port()
    own = subprocess.Popen(["bash", "-c", 'exec -a tritonserver "$0" -c "import time; time.sleep(120)" '
                            f"--model-repository={repo_b} --http-port={port}", sys.executable])
    try:
        for _ in range(100):
            if servers_of(repo_b):
                break
            time.sleep(0.05)
        with pytest.raises(UserError) as ei:
            cli.refuse_other_servers(srv, repo_b)
        p = ei.value.problems[0]
        assert p.field == "--url" and p.reason.startswith(f"the server at {srv.http_url} does not serve {repo_b}: ")
        assert p.reason.endswith(f" tritonserver (pid {own.pid}) at 127.0.0.1:{port} is the server of {repo_b}.")
        assert p.fix == f"pass --url 127.0.0.1:{port}; nothing was changed." and "kill" not in p.fix
    finally:
        own.kill()
        own.wait()


def test_the_stand_in_refuses_a_prompt_past_the_engines_max_input_len(served, units4):  # noqa: F811
    """Hostile s15b F10: the CPU stand-in answered a 6,000-token prompt that an engine of max_input_len 4,096 refuses
    (TensorRT-LLM's request validation throws "Prompt length (%d) exceeds maximum input length (%d)."). The unit's
    cpu_reference.json carries the plan's limits and the stand-in applies them as the real backend does."""
    import numpy as np
    import tritonclient.http as http
    from tritonclient.utils import InferenceServerException

    repo, srv = served
    unit = units4[0].engine_unit
    ref = json.loads((repo / unit / "engine" / "cpu_reference.json").read_text())
    assert ref["limits"] == {"max_input_len": 4096, "max_seq_len": 8192}

    def req(n):
        ins = []
        for name, arr in (("input_ids", np.ones((1, n), np.int32)), ("input_lengths", np.array([[n]], np.int32)),
                          ("request_output_len", np.array([[1]], np.int32))):
            x = http.InferInput(name, list(arr.shape), "INT32")
            x.set_data_from_numpy(arr)
            ins.append(x)
        return ins
    c = srv.http_client()
    try:
        with pytest.raises(InferenceServerException, match=r"Prompt length \(4097\) exceeds maximum input length \(4096\)\."):
            c.infer(unit, req(4097))
        assert c.infer(unit, req(8)).as_numpy("output_ids") is not None
    finally:
        c.close()


def test_rollback_without_url_is_refused_while_the_server_serves_the_repository(served, invoke_here):
    """Hostile s8 #56, on the real server: its command line names the repository, so a command without --url is
    refused with the --url to pass (tests/serving/test_hostile_s8_left.py has the fast case)."""
    from precision_pipeline.serving.triton_server import servers_of

    repo, srv = served
    assert servers_of(repo) == [(srv.proc.pid, srv.http_url)]
    before = release_state.state_path(repo).read_text()
    r = invoke_here("rollback", "--repo", str(repo))
    assert r.returncode == 2 and f"fix: pass --url {srv.http_url} (the server then loads" in r.stderr, r.stdout + r.stderr
    assert release_state.state_path(repo).read_text() == before


def test_a_second_server_of_the_repository_is_refused(served, invoke_here, monkeypatch):
    """Hostile s12 F-Q (outage): a second `invoke serve` of the served repository started, and a rollback --url through
    the first left the second's BLS answering HTTP 400 to every request. Now serve refuses the second (naming the
    first's pid and port) before anything starts, and promote/rollback/rollout/probe --url refuse (nothing changed)
    while a server other than the one at --url serves the repository (a process with a tritonserver's command line
    stands in for one started some other way)."""
    from types import SimpleNamespace

    from precision_pipeline.cli import serving as cli
    from precision_pipeline.serving import build_output
    from precision_pipeline.serving.triton_server import servers_of

    repo, srv = served
    before, live = release_state.state_path(repo).read_text(), release_live.live_unit(srv)
    ports = [str(free_port()) for _ in range(3)]
    r = subprocess.run([sys.executable, "-m", "invoke", "serve", "--repo", str(repo), "--http-port", ports[0], "--grpc-port",
                        ports[1], "--metrics-port", ports[2]], cwd=ROOT, capture_output=True, text=True, timeout=90,
                       env=dict(os.environ, COLUMNS="400"))  # a process: a serve that is not refused runs until killed
    assert r.returncode == 2, r.stdout + r.stderr
    assert (f"--repo: tritonserver (pid {srv.proc.pid}) already serves {repo.resolve()} at {srv.http_url}; a second server "
            "of one repository would not follow a promote or rollback made through the first (its BLS, which reads the "
            "shared route.json, would send requests to a unit it never loaded); nothing was started.\n    fix: use that "
            f"server (--url {srv.http_url}), or stop it first (kill {srv.proc.pid}); to scale, give each server its own "
            "repository (promote into each).") in r.stderr, r.stdout
    assert "starting tritonserver" not in r.stdout and "Traceback" not in r.stdout + r.stderr
    port2 = ports[0]
    second = subprocess.Popen(["bash", "-c", 'exec -a tritonserver "$0" -c "import time; time.sleep(120)" '
                               f"--model-repository={repo}/ --http-port={port2}", sys.executable])
    monkeypatch.setattr(build_output, "open_build", lambda *a, **k: SimpleNamespace(
        profile=SimpleNamespace(name="bf16-h100"), packed=None, probe_set=lambda n: None))
    monkeypatch.setattr(build_output, "promote_build", lambda *a, **k: pytest.fail("promoted"))
    try:
        for _ in range(100):
            if len(servers_of(repo)) == 2:
                break
            time.sleep(0.05)
        msg = (f"--url: tritonserver (pid {second.pid}) at 127.0.0.1:{port2} serves {repo} too, not only the server at "
               f"{srv.http_url}: a change through --url would switch that one alone, and the other's BLS (it reads the "
               "shared route.json) would send every request to a unit it never loaded; nothing was changed.\n    fix: "
               f"stop the second server (kill {second.pid}) and run this again: one repository is served by one server "
               "(`invoke serve` refuses a second); to scale, give each server its own repository (promote into each).")
        for args in (("rollback",), ("promote", "--profile", "bf16-h100"), ("probe",)):
            r = invoke_here(*args, "--repo", str(repo), "--url", srv.http_url)
            assert r.returncode == 2 and msg in r.stderr, (args, r.stdout + r.stderr)
        with pytest.raises(UserError) as ei:  # rollout's attach (after its build checks)
            cli._attach(srv.http_url, None, repo)
        assert ei.value.message == msg.replace("\n    fix:", " Fix:")
        from precision_pipeline.serving.triton_server import other_servers, repository_at

        cli._attach(srv.http_url, None)  # rollout --abort puts every server's routes back: not refused
        assert other_servers(repo, f"localhost:{srv.http_port}") == [(second.pid, f"127.0.0.1:{port2}")]
        assert repository_at(f"localhost:{srv.http_port}") == str(repo.resolve())
    finally:
        second.kill()
        second.wait()
    assert release_state.state_path(repo).read_text() == before and release_live.live_unit(srv) == live
    with tcp_forward(srv.http_port) as fwd:  # hostile s16 H2: the one server through a port forward is no second one
        with pytest.raises(UserError) as ei:
            cli._attach(fwd, None, repo)
    assert ei.value.problems[0].reason == (
        f"{fwd} serves {repo}, but no tritonserver of this machine listens there, and tritonserver (pid {srv.proc.pid}) at "
        f"{srv.http_url} serves it here: --url reaches that server through a port forward or a proxy, or is a second "
        "server elsewhere; nothing was changed.")
    assert ei.value.problems[0].fix.startswith(f"pass --url {srv.http_url} (the server on this machine)")
    assert "kill" not in ei.value.message


def test_a_url_where_nothing_answers_names_the_repositorys_server(served):
    """Hostile s15c T58: `--url` of a port where no Triton answers said "start one with `invoke serve`, or leave --url
    out" -- both refused while the repository's server runs; the refusal names that server now."""
    from precision_pipeline.cli import serving as cli

    repo, srv = served
    port = free_port()
    with pytest.raises(UserError) as ei:
        cli.server_of(f"127.0.0.1:{port}", repo)
    assert ei.value.problems[0].reason == (f"no Triton server answers at http://127.0.0.1:{port}. tritonserver (pid "
                                           f"{srv.proc.pid}) serves {repo} at {srv.http_url}; nothing was changed.")
    assert ei.value.problems[0].fix == f"pass --url {srv.http_url}."


def test_a_commit_that_cannot_be_written_undoes_the_live_switch(served, units4, monkeypatch):  # noqa: F811
    """Hostile s16b F4: `ulimit -f` (or a full disk) let the configs be rewritten but not releases.json: the live server
    stayed on the new unit, the record on the old, and the message said the repository was intact. Now the commit's
    OSError undoes the switch (``release_switch.commit_switch``) and says so."""
    import errno

    from precision_pipeline.core.errors import PipelineError
    from precision_pipeline.serving import release_switch

    repo, srv = served
    old = release_state.read_state(repo)["current"]
    new = next(u for u in units4 if u.engine_unit != old).out_dir
    before = release_state.state_path(repo).read_text()
    real = release_switch.write_state

    def full(repo_dir, state):
        raise OSError(errno.EFBIG, "File too large", str(release_state.state_path(repo_dir)))
    monkeypatch.setattr(release_switch, "write_state", full)
    with pytest.raises(PipelineError) as ei:
        release.promote(repo, new, server=srv)
    msg = str(ei.value)
    assert msg.startswith(f"releases.json could not be written (File too large: {release_state.state_path(repo)}), so the "
                          "switch to tensorrt_llm_") and f"the switch was undone: {old} serves again" in msg, msg
    assert release_state.state_path(repo).read_text() == before
    from precision_pipeline.core.errors import exit_code_for

    assert exit_code_for(ei.value) == 2  # nothing changed: a refusal, not an internal error (hostile s18b A28b)
    assert release_configs.current_of_configs(repo) == (old, old) and release_live.live_unit(srv) == old and ask(srv).strip()
    monkeypatch.setattr(release_switch, "write_state", real)
    assert release.list_releases(repo)["problems"] == []


def test_a_fifo_in_place_of_route_json_blocks_no_request_and_is_rewritten(served):
    """Hostile s16 H13: route.json replaced by a FIFO: every BLS request blocked for good (the BLS opened it), and a
    rollback's recovery was an OSError traceback. The BLS now reads regular files only (keeping the last route), and
    the recovery rewrites route.json from releases.json."""
    repo, srv = served
    cur = release_state.read_state(repo)["current"]
    route = repo / "tensorrt_llm_bls" / "route.json"
    route.unlink()
    os.mkfifo(route)
    try:
        assert ask(srv, "tensorrt_llm_bls").strip()         # answered on the last route, not blocked
        assert release.list_releases(repo)["problems"]        # said, not raised
        fixed = release_recover.recover(repo, srv)
        assert f"{route} was unreadable (not a regular file): rewritten from releases.json" in fixed
        assert json.loads(route.read_text()) == {"tensorrt_llm_model_name": cur} and ask(srv, "tensorrt_llm_bls").strip()
    finally:
        if not route.is_file():
            route.unlink(missing_ok=True)
            release_configs.point_bls(repo, cur)


@contextlib.contextmanager
def tcp_forward(port: int):
    """A plain TCP forward (as kubectl port-forward or ssh -L) from a free local port to ``port``; yields its URL."""
    import socket
    import socketserver
    import threading

    class Pipe(socketserver.BaseRequestHandler):
        def handle(self):
            with socket.create_connection(("127.0.0.1", port)) as up:
                def pump(a, b):
                    with contextlib.suppress(OSError):
                        while data := a.recv(65536):
                            b.sendall(data)
                    with contextlib.suppress(OSError):
                        b.shutdown(socket.SHUT_WR)
                t = threading.Thread(target=pump, args=(up, self.request), daemon=True)
                t.start()
                pump(self.request, up)
                t.join(30)

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Pipe)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_first_promote_of_a_new_repository_with_url_of_another_is_refused(served, invoke_here, monkeypatch, tmp_path):
    """Hostile s12 F-E: the first promote of a new --repo with --url of the server of another repository said
    "created" and never used --url. Now it is refused before anything is created, naming both repositories."""
    from types import SimpleNamespace

    from precision_pipeline.serving import build_output

    repo, srv = served
    new = tmp_path / "new" / "model_repository"
    monkeypatch.setattr(build_output, "open_build", lambda *a, **k: SimpleNamespace(profile=SimpleNamespace(name="bf16-h100")))
    monkeypatch.setattr(build_output, "promote_build", lambda *a, **k: pytest.fail("promoted"))
    r = invoke_here("promote", "--profile", "bf16-h100", "--repo", str(new), "--url", f"localhost:{srv.http_port}")
    assert r.returncode == 2, r.stdout + r.stderr
    assert (f"--url: localhost:{srv.http_port} serves repository {repo.resolve()}, not the new {new}; the first promote "
            "creates the files only (nothing was created).\n    fix: leave --url out, then `invoke serve --repo "
            f"{new}`.") in r.stderr, r.stdout
    assert not (tmp_path / "new").exists()


def test_wrong_metrics_port_is_refused_before_loading(served, units4):  # noqa: F811
    repo, srv = served
    other = TritonServer.attach(srv.http_url)
    other.metrics_port = free_port()  # the local server at --url names its own (hostile s15 F15)
    with pytest.raises(UserError, match=f"exports its metrics on port {srv.metrics_port}, not {other.metrics_port}") as ei:
        rollout.rollout(repo, units4[3].out_dir, other, None, steps=(50, 100), hold_s=0)
    assert ei.value.problems[0].field == "--metrics-port"
    assert "rollout" not in release_state.read_state(repo) and srv.loaded_models().get(units4[3].engine_unit) is None


def test_abort_after_a_crash_at_the_100_percent_switch_serves_stable(served, units4):  # noqa: F811
    """Crash after the ensemble was reloaded on the candidate, before the commit; then `rollout --abort`."""
    repo, srv = served
    a, b = units4[0].engine_unit, units4[1].engine_unit
    p = in_subprocess(attach_code(srv) + "from precision_pipeline.serving import release_rollout; "
                      f"release_rollout.begin_rollout(Path({str(repo)!r}), Path({str(units4[1].out_dir)!r}), server=srv, steps=(100,)); "
                      f"release_rollout.finish_rollout(Path({str(repo)!r}), server=srv)", crash_at="rollout_switch")
    assert p.returncode == release_state.CRASH_EXIT, p.stderr
    assert release_live.live_unit(srv) == b and release_state.read_state(repo)["current"] == a  # the live ensemble on B
    rec = rollout.abort(repo, srv)
    assert rec["ensemble_reloaded"] is True and "candidate_kept" not in rec
    assert release_live.live_unit(srv) == a and ask(srv).strip()            # the stable release serves
    assert srv.loaded_models().get(b) != "READY" and srv.loaded_models().get(a) == "READY"
    assert release_configs.current_of_configs(repo) == (a, a)
    assert json.loads((repo / "tensorrt_llm_bls" / "route.json").read_text()) == {"tensorrt_llm_model_name": a}
    assert release_state.read_state(repo)["history"][-1]["action"] == "rollout_abort"


def test_refused_rollback_after_a_crash_at_switch_still_reconciles_the_server(served, units4):  # noqa: F811
    """Crash of a promote after the ensemble reload (step ``switch``); `rollback --url` then has no previous
    release (B was only an aborted candidate) and refuses, but the live server is put back on A first."""
    repo, srv = served
    a, c = units4[0].engine_unit, units4[2].engine_unit
    p = in_subprocess(attach_code(srv) + "from precision_pipeline.serving import release; "
                      f"release.promote(Path({str(repo)!r}), Path({str(units4[2].out_dir)!r}), server=srv)", crash_at="switch")
    assert p.returncode == release_state.CRASH_EXIT, p.stderr
    assert release_live.live_unit(srv) == c and release_state.read_state(repo)["current"] == a
    with pytest.raises(UserError, match="no previous release"):
        release.rollback(repo, server=srv)
    assert release_live.live_unit(srv) == a and ask(srv).strip()
    assert srv.loaded_models().get(c) != "READY"      # the uncommitted unit is not left loaded
    assert release_configs.current_of_configs(repo) == (a, a)


def test_abort_and_probe_after_a_crash_at_bls_config_put_the_live_server_back(served, units4):  # noqa: F811
    """Hostile s15 F1: after a promote crashed between its BLS switch and its commit (the live ensemble and route.json
    on the uncommitted unit), `rollout --abort --url` refused "no rollout is in progress" and left it so, and
    `probe --url` passed the recorded unit while every request went to the other. Both now recover first: the abort
    refuses with what it did (``UserError.done``), the probe (``cli.serving._recover_for_probe``) returns it."""
    from precision_pipeline.cli import serving as cli

    repo, srv = served
    a, c = units4[0].engine_unit, units4[2].engine_unit
    p = in_subprocess(attach_code(srv) + "from precision_pipeline.serving import release; "
                      f"release.promote(Path({str(repo)!r}), Path({str(units4[2].out_dir)!r}), server=srv)", crash_at="bls_config")
    assert p.returncode == release_state.CRASH_EXIT, p.stderr
    assert release_live.live_unit(srv) == c and release_state.read_state(repo)["current"] == a
    with pytest.raises(UserError, match="no rollout is in progress") as ei:
        rollout.abort(repo, srv)
    moved = (f"live ensemble moved from {c} to {a}, the current release releases.json records (a command "
             "interrupted mid-switch, or releases.json edited by hand)")
    assert moved in ei.value.done
    assert release_live.live_unit(srv) == a and release_configs.current_of_configs(repo) == (a, a)
    assert srv.loaded_models().get(c) != "READY" and ask(srv).strip()
    srv.load(c)                                            # the same window again, made by hand
    release_configs.point_ensemble(repo, c)
    release_configs.point_bls(repo, c)
    srv.load("ensemble")
    assert release_live.live_unit(srv) == c
    fixed = cli._recover_for_probe(repo, srv, release_state.read_state(repo))
    assert moved in fixed and f"{c} unloaded (no release; nothing routes to it)" in fixed
    assert release_live.live_unit(srv) == a and release_configs.current_of_configs(repo) == (a, a)
    assert cli._recover_for_probe(repo, srv, release_state.read_state(repo)) == []
    srv.unload("tensorrt_llm_bls")                         # hostile s15 F13: the routed entry point unloaded by hand
    assert srv.loaded_models().get("tensorrt_llm_bls") not in (None, "READY")
    # repaired by `invoke serve`'s watchdog (release_recover.heal, every HEAL_EVERY_S s; hostile s15b F14, s15c T72:
    # a split left by a killed command lasted until the next command), which leaves the server alone while a release
    # command holds the lock, and by any command's recovery
    with release_state.lock(repo):
        assert release_recover.heal(repo, srv) == []
    assert srv.loaded_models().get("tensorrt_llm_bls") not in (None, "READY")
    fixed = release_recover.heal(repo, srv)
    assert [f for f in fixed if f.startswith("tensorrt_llm_bls loaded again (its state was ")] and ask(srv, "tensorrt_llm_bls")
    assert release_recover.heal(repo, srv) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_abort_the_rollout(served, units4, sig):  # noqa: F811
    repo, srv = served
    a, d = units4[0].engine_unit, units4[3].engine_unit
    env = dict(os.environ)
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.path.insert(0, 'build'); from pathlib import Path; "
                             + attach_code(srv) + "from precision_pipeline.serving import rollout; "
                             f"rollout.rollout(Path({str(repo)!r}), Path({str(units4[3].out_dir)!r}), srv, None, "
                             "steps=(50, 100), hold_s=300)"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while not at_step(repo, 50):
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the rollout did not reach 50 %"
            time.sleep(0.2)
        route = json.loads((repo / "tensorrt_llm_bls" / "route.json").read_text())
        assert route["canary"] == {"tensorrt_llm_model_name": d, "percent": 50}
        t = time.monotonic()
        proc.send_signal(sig)
        proc.wait(120)
        print(f"\n[release-live] {sig.name}: rollout ended in {time.monotonic() - t:.1f} s")
    finally:
        if proc.poll() is None:
            proc.kill()
    out = proc.stdout.read()
    assert proc.returncode != 0 and "KeyboardInterrupt" in out, out
    st = release_state.read_state(repo)
    assert "rollout" not in st and st["current"] == a
    last = st["history"][-1]
    assert last["action"] == "rollout_abort" and last["rollout"]["failed_check"] == "interrupted"
    assert last["rollout"]["percent"] == 50
    assert json.loads((repo / "tensorrt_llm_bls" / "route.json").read_text()) == {"tensorrt_llm_model_name": a}
    assert srv.loaded_models().get(d) != "READY"


def test_a_frozen_server_during_a_promote_load_is_given_up(served, units4, capfd, monkeypatch):  # noqa: F811
    """Hostile s12 F-L (hang): a tritonserver frozen (SIGSTOP) while `promote/rollback --url` loads a unit held the
    command up to 900 s without a line. Now the load says where it is every LOAD_PROGRESS_S and gives up when the
    server does not answer /v2/health/live for LOAD_STALL_S (here 3 s): ServerStopped (exit 7), nothing switched,
    and once the server runs again it serves what releases.json records."""
    import threading

    from precision_pipeline.core.errors import ServerStopped
    from precision_pipeline.serving import triton_server

    repo, srv = served
    before, live = release_state.state_path(repo).read_text(), release_live.live_unit(srv)
    target, current = units4[1].engine_unit, release_state.read_state(repo)["current"]
    post, frozen = triton_server.TritonServer._post, []

    def freeze_on_load(self, path, *a, **k):  # SIGSTOP right after the load request is sent
        if path.endswith(f"/{target}/load") and not frozen:
            frozen.append(threading.Timer(0.3, os.kill, (srv.proc.pid, signal.SIGSTOP)))
            frozen[0].start()
        return post(self, path, *a, **k)

    monkeypatch.setattr(triton_server.TritonServer, "_post", freeze_on_load)
    monkeypatch.setattr(triton_server, "LOAD_STALL_S", 3.0)
    monkeypatch.setattr(triton_server, "LOAD_PROGRESS_S", 1.0)
    capfd.readouterr()
    t = time.perf_counter()
    try:
        with pytest.raises(ServerStopped) as ei:
            release.promote(repo, units4[1].out_dir, server=TritonServer.attach(srv.http_url))
    finally:
        os.kill(srv.proc.pid, signal.SIGCONT)
    took, err = time.perf_counter() - t, capfd.readouterr().err
    assert frozen and took < 30, took
    assert str(ei.value).startswith(f"the Triton server at {srv.http_url} stopped answering while loading {target} (no "
                                    "answer on /v2/health/live for "), str(ei.value)
    assert str(ei.value).endswith(f"Nothing was switched: releases.json still names {current}, and a restarted server "
                                  "serves it (`invoke serve --repo REPO`); run the command again once it answers.")
    assert f"  loading {target} on {srv.http_url}: 1 s ..." in err.splitlines(), err
    assert release_state.state_path(repo).read_text() == before
    for _ in range(300):  # the server finishes the load it was frozen in; the test puts the unit away again
        if srv.loaded_models().get(target) in ("READY", "UNAVAILABLE"):
            break
        time.sleep(0.1)
    srv.unload(target)
    assert release_live.live_unit(srv) == live and ask(srv)


def test_a_hand_edited_current_that_cannot_serve_is_never_routed_to(served, units4, capsys):  # noqa: F811
    """Hostile s16 H3: releases.json hand-edited onto a kept unit whose files were damaged; serve's watchdog re-pointed
    route.json at it first, its load then failed, and every BLS request failed from then on (and `rollback --to
    --url` was a RuntimeError traceback). Now the load comes first (``release_recover.current_problem``): a unit that
    does not load, or whose files differ from their record by size, is never routed to; the watchdog says so once."""
    repo, srv = served
    old = release_state.read_state(repo)["current"]
    new = next(u for u in units4 if u.engine_unit != old)
    release.promote(repo, new.out_dir, server=srv)
    k = new.engine_unit
    ref = repo / old / "engine" / "cpu_reference.json"
    good = ref.read_bytes()
    ref.write_bytes(b"{" * len(good))                  # the same size: only the load finds it
    st = release_state.read_state(repo)
    release_state.write_state(repo, {**st, "current": old})  # the hand edit
    assert release_recover.heal(repo, srv) == []
    out = capsys.readouterr().out
    assert out.count("[serve] not repaired: ") == 1  # the files edited since its install are read first (s17c F1),
    assert (f"the current release {old} is damaged on disk ({old}/engine/cpu_reference.json has the recorded size" in out
            or f"the current release {old} does not load on the server" in out)  # the load (edited within its second)
    assert f"(the BLS still sends requests to {k})" in out
    assert release_configs.current_of_configs(repo) == (k, k) and release_live.live_unit(srv) == k
    assert ask(srv, "tensorrt_llm_bls").strip() and ask(srv).strip()
    assert release_recover.heal(repo, srv) == [] and capsys.readouterr().out == ""  # said once
    os.truncate(ref, 7)                                # now the sizes say it, before any load
    with pytest.raises(UserError, match=f"the current release {old} is damaged on disk \\({old}/engine/cpu_reference"
                       f".json is 7 bytes, not the recorded {len(good):,} at its install\\)") as ei:
        rollout.abort(repo, srv)
    assert "promote its build again" in ei.value.problems[0].fix
    r = release.rollback(repo, to=k, server=srv)        # the way out printed: no traceback
    assert r["unit"] == k
    assert release_state.read_state(repo)["current"] == k and release_configs.current_of_configs(repo) == (k, k)
    ref.write_bytes(good)
    release.rollback(repo, to=old, server=srv)          # the module's state as it was: old serves
    assert release_state.read_state(repo)["current"] == old and release_live.live_unit(srv) == old


def test_a_dead_backend_stub_is_reloaded_by_the_watchdog(served):
    """Hostile s16 H4: a killed stub process of the current unit (the OOM killer) left the model READY and every
    request HTTP 500 ("Stub process ... is not healthy") with nothing said; `invoke serve`'s watchdog now reloads it
    (``serve_watchdog.revive_dead_instances``, every HEAL_EVERY_S s)."""
    from precision_pipeline.serving.server_procs import backend_stubs
    from precision_pipeline.serving.serve_watchdog import entry_point_note, revive_dead_instances

    repo, srv = served
    cur = release_state.read_state(repo)["current"]
    seen: dict[str, set[str]] = {}
    assert revive_dead_instances(srv, seen) == [] and seen[cur] == {f"{cur}_0_0"}
    assert {"preprocessing_0_0", "postprocessing_0_0", "tensorrt_llm_bls_0_0"} <= set(backend_stubs(srv.proc.pid))
    os.kill(backend_stubs(srv.proc.pid)[f"{cur}_0_0"], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while f"{cur}_0_0" in backend_stubs(srv.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    with pytest.raises(Exception, match="not healthy|Stub"):
        ask(srv)
    said = [f"{cur} reloaded: the process of its instance {cur}_0_0 had died or was stopped, so every request to it failed"]
    assert revive_dead_instances(srv, seen) == said
    assert ask(srv).strip() and ask(srv, "tensorrt_llm_bls").strip()
    assert revive_dead_instances(srv, seen) == [] and seen[cur] == {f"{cur}_0_0"}
    stub = backend_stubs(srv.proc.pid)[f"{cur}_0_0"]
    os.kill(stub, signal.SIGSTOP)                      # hostile s16b F2: a stopped stub fails every request too
    try:
        from precision_pipeline.core.store import process_state

        while not process_state(stub).startswith("T") and time.monotonic() < deadline + 60:  # the signal is async
            time.sleep(0.05)
        assert revive_dead_instances(srv, seen) == said
        assert ask(srv).strip() and backend_stubs(srv.proc.pid)[f"{cur}_0_0"] != stub
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(stub, signal.SIGCONT)
    # hostile s16 T170: a promote or rollback through a server whose BLS stub died said "current: X" while every
    # request through the BLS failed; its check after the switch asks the BLS, reloading it once when it fails
    assert entry_point_note(srv, repo, "rolled back to X") is None
    os.kill(backend_stubs(srv.proc.pid)["tensorrt_llm_bls_0_0"], signal.SIGKILL)
    while "tensorrt_llm_bls_0_0" in backend_stubs(srv.proc.pid) and time.monotonic() < deadline + 30:
        time.sleep(0.1)
    # hostile s17c H17: with its model.py gone a reload of the BLS never ends in Triton (and queues every later one):
    # none is tried, the command says what is missing at once
    model_py = repo / "tensorrt_llm_bls" / "1" / "model.py"
    model_py.rename(model_py.with_name("model.py.aside"))
    t = time.monotonic()
    try:
        with pytest.raises(PipelineError, match=r"^rolled back to X: releases.json and the server agree, but requests "
                           r"through tensorrt_llm_bls \(the entry point\) fail \(.*\), and it cannot be reloaded: "
                           + re.escape(f"{model_py} is missing (restore it from a build's packed repository")):
            entry_point_note(srv, repo, "rolled back to X")
        assert time.monotonic() - t < 30
    finally:
        model_py.with_name("model.py.aside").rename(model_py)
    note = entry_point_note(srv, repo, "rolled back to X")
    assert note.startswith("tensorrt_llm_bls reloaded: a request through it failed after the switch (") and ask(srv, "tensorrt_llm_bls")


def test_server_dying_mid_step_rolls_back_and_leaves_no_shared_memory(served, units4):  # noqa: F811
    """LAST in this module: kills the module's server (kill -9) while a rollout holds its first step."""
    repo, srv = served
    a = units4[0].engine_unit
    mine = sorted(p.name for p in Path("/dev/shm").glob(f"{SHM_PREFIX}{srv.shm_token}*"))
    assert mine, "the python backend's regions carry this server's prefix"
    code = (attach_code(srv) + "from precision_pipeline.serving import rollout; "
            f"r = rollout.rollout(Path({str(repo)!r}), Path({str(units4[3].out_dir)!r}), srv, None, steps=(50, 100), "
            "hold_s=300); print('RESULT', json.dumps({'status': r.status, 'failed_check': r.failed_check}))")
    proc = subprocess.Popen([sys.executable, "-c", "import sys, json; sys.path.insert(0, 'build'); from pathlib import Path; "
                             + code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while not at_step(repo, 50):
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline
            time.sleep(0.2)
        os.killpg(srv.proc.pid, signal.SIGKILL)       # the server and its stubs
        t = time.monotonic()
        proc.wait(300)
        assert time.monotonic() - t < 60              # noticed during the 300 s hold, not after it
    finally:
        if proc.poll() is None:
            proc.kill()
    out = proc.stdout.read()
    assert proc.returncode == 0 and "Traceback" not in out, out
    result = json.loads(out.split("RESULT", 1)[1])
    assert result == {"status": "rolled_back", "failed_check": "server"}
    st = release_state.read_state(repo)
    assert "rollout" not in st and st["current"] == a
    assert "server_error" in st["history"][-1]["rollout"]
    assert json.loads((repo / "tensorrt_llm_bls" / "route.json").read_text()) == {"tensorrt_llm_model_name": a}
    srv.stop()
    assert not list(Path("/dev/shm").glob(f"{SHM_PREFIX}{srv.shm_token}*"))
