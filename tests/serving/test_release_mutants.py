"""Release facts pinned down by mutation testing (tests/mutate.py survivors on serving/release.py).

No server: ``smoke_test`` talks to a stand-in HTTP client that answers the three calls it makes
(preprocessing, the unit, postprocessing) with the tensors a real one returns; promote/rollback use
the recording server of test_release_planted.py.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from precision_pipeline.core.errors import UserError
from precision_pipeline.serving import (release, release_configs, release_live, release_recover, release_rollout, release_state,
                                        release_switch, release_units)
from tests.serving.test_release import new_repo, units  # noqa: F401  (units: module fixture)
from tests.serving.test_release_planted import RecordingServer, smoke_calls  # noqa: F401  (fixture)


class _Result:
    def __init__(self, arrays):
        self.arrays = arrays

    def as_numpy(self, name):
        return self.arrays.get(name)


class FakeClient:
    """Answers smoke_test's three infer calls; ``unit_out`` replaces the unit's outputs."""

    def __init__(self, unit_out=None, text="4"):
        self.unit_out, self.text, self.calls, self.closed = unit_out, text, [], False

    def infer(self, model, inputs, outputs=None):
        self.calls.append((model, sorted(i.name() for i in inputs)))
        if model == "preprocessing":
            return _Result({"INPUT_ID": np.array([[1, 2, 3]], np.int32), "REQUEST_INPUT_LEN": np.array([[3]], np.int32),
                            "OUT_END_ID": np.array([[2]], np.int32), "OUT_PAD_ID": np.array([[2]], np.int32)})
        if model == "postprocessing":
            return _Result({"OUTPUT": np.array([self.text.encode()], dtype=object)})
        out = {"output_ids": np.array([[[5, 6]]], np.int32), "sequence_length": np.array([[2]], np.int32)}
        out.update(self.unit_out or {})
        return _Result(out)

    def close(self):
        self.closed = True


class ClientServer:
    def __init__(self, client):
        self.client = client

    def http_client(self):
        return self.client


def test_smoke_test_result_and_calls():
    c = FakeClient()
    r = release_live.smoke_test(ClientServer(c), "tensorrt_llm_abc", max_tokens=8)
    assert r["text"] == "4" and r["tokens"] == 2 and r["ms"] >= 0 and set(r) == {"text", "tokens", "ms"}
    assert [m for m, _ in c.calls] == ["preprocessing", "tensorrt_llm_abc", "postprocessing"]
    assert c.calls[1][1] == ["end_id", "input_ids", "input_lengths", "pad_id", "request_output_len"]
    assert c.closed
    assert release_live.smoke_test(ClientServer(FakeClient(text="four")), "u", expect="four")["text"] == "four"


@pytest.mark.parametrize("unit_out, text, match", [
    ({"output_ids": np.array([[[5, 6]]], np.int64)}, "4", "unexpected outputs"),
    ({"output_ids": np.array([[5, 6]], np.int32)}, "4", "unexpected outputs"),
    ({"output_ids": None}, "4", "unexpected outputs"),
    ({"sequence_length": np.array([[2]], np.int64)}, "4", "unexpected outputs"),
    ({"sequence_length": None}, "4", "unexpected outputs"),
    ({"sequence_length": np.array([[0]], np.int32)}, "4", "sequence_length 0 outside 1..8"),
    ({"sequence_length": np.array([[9]], np.int32)}, "4", "sequence_length 9 outside 1..8"),
    (None, "  ", "empty text"),
])
def test_smoke_test_refuses_bad_outputs(unit_out, text, match):
    c = FakeClient(unit_out, text)
    with pytest.raises(RuntimeError, match=match):
        release_live.smoke_test(ClientServer(c), "u", max_tokens=8)
    assert c.closed


def test_smoke_test_accepts_the_bounds():
    for k in (1, 8):
        r = release_live.smoke_test(ClientServer(FakeClient({"sequence_length": np.array([[k]], np.int32)})), "u", max_tokens=8)
        assert r["tokens"] == k
    with pytest.raises(RuntimeError, match="got '4', expected '5'"):
        release_live.smoke_test(ClientServer(FakeClient()), "u", expect="5")


def test_init_defaults_and_list_releases(tmp_path, units):  # noqa: F811
    repo = tmp_path / "serving" / "model_repository"
    st = release_recover.init_serving_repo(repo, units[0].out_dir, fallback_repo=units[1].out_dir)
    assert st["warm_fallback"] is False and st["keep_releases"] == 2
    a, b = units[0].engine_unit, units[1].engine_unit
    lr = release.list_releases(repo)
    assert lr["state"]["current"] == a and lr["state"]["fallback"] == b
    assert lr["on_disk"] == sorted([a, b]) and lr["configs"] == (a, a)
    with pytest.raises(UserError, match="does not exist"):
        release.list_releases(tmp_path / "nothing")


def test_serving_models_order_and_warm_fallback(tmp_path, units):  # noqa: F811
    repo = new_repo(tmp_path, units, warm=True)
    a, b = units[0].engine_unit, units[1].engine_unit
    st = release_state.read_state(repo)
    assert release_state.serving_models(repo, st) == ["preprocessing", "postprocessing", a, b, "ensemble", "tensorrt_llm_bls"]
    assert release_state.serving_models(repo, dict(st, warm_fallback=False)) == [
        "preprocessing", "postprocessing", a, "ensemble", "tensorrt_llm_bls"]
    assert release_state.serving_models(repo, dict(st, current=b))[2:4] == [b, "ensemble"]       # fallback is current
    assert release_state.serving_models(repo, dict(st, fallback="tensorrt_llm_000000000000"))[3] == "ensemble"  # not on disk


def test_promote_smoke_tests_by_default_and_keeps_the_fallback_record(tmp_path, units, smoke_calls):  # noqa: F811
    repo = new_repo(tmp_path, units)
    a, b, c = (u.engine_unit for u in units)
    srv = RecordingServer(repo, ready={a, b, "ensemble"}, load_s=0.02)  # fallback loaded, not warm: unloaded after
    t0 = time.perf_counter()
    t = release.promote(repo, units[2].out_dir, server=srv)
    elapsed_ms = (time.perf_counter() - t0) * 1e3
    assert smoke_calls[0] == [c] and t["smoke"]["text"] == "4"
    assert 0 <= t["load_ms"] <= t["switched_ms"] <= t["total_ms"] <= elapsed_ms
    assert 20 <= t["load_ms"] and 20 <= t["ensemble_load_ms"] <= t["switched_ms"]  # each load sleeps 20 ms
    st = release_state.read_state(repo)
    assert [(r["unit"], r["kind"]) for r in st["releases"]] == [(a, "release"), (b, "fallback"), (c, "release")]
    assert ("unload", b) in [x[:2] for x in srv.calls] and ("unload", a) in [x[:2] for x in srv.calls]


def test_promote_keeps_a_warm_fallback_loaded(tmp_path, units, smoke_calls):  # noqa: F811
    repo = new_repo(tmp_path, units, warm=True)
    a, b, c = (u.engine_unit for u in units)
    srv = RecordingServer(repo, ready={a, b, "ensemble"})
    release.promote(repo, units[2].out_dir, server=srv)
    assert ("unload", b) not in [x[:2] for x in srv.calls] and ("unload", a) in [x[:2] for x in srv.calls]


def test_failed_promote_of_the_warm_fallback_leaves_it_loaded(tmp_path, units, smoke_calls):  # noqa: F811
    repo = new_repo(tmp_path, units, warm=True)
    a, b = units[0].engine_unit, units[1].engine_unit
    srv = RecordingServer(repo, ready={a, b, "ensemble"}, fail_load="ensemble")
    with pytest.raises(RuntimeError, match="load ensemble failed"):
        release.promote(repo, units[1].out_dir, server=srv)
    assert ("unload", b) not in [x[:2] for x in srv.calls]
    srv2 = RecordingServer(repo, ready={a, "ensemble"}, fail_load="ensemble")
    with pytest.raises(RuntimeError):
        release.promote(repo, units[2].out_dir, server=srv2)
    assert ("unload", units[2].engine_unit) in [x[:2] for x in srv2.calls]


def test_failed_smoke_unloads_the_new_unit(tmp_path, units, smoke_calls):  # noqa: F811
    repo = new_repo(tmp_path, units, warm=True)
    smoke_calls[1].append(True)
    srv = RecordingServer(repo, ready={units[0].engine_unit, "ensemble"})
    with pytest.raises(UserError, match="loads but fails its smoke request"):
        release.promote(repo, units[2].out_dir, server=srv)
    assert ("unload", units[2].engine_unit) in [x[:2] for x in srv.calls]
    assert release_state.read_state(repo)["current"] == units[0].engine_unit


def test_set_fallback_replaces_the_fallback_record(tmp_path, units, smoke_calls):  # noqa: F811
    repo = new_repo(tmp_path, units)
    c = units[2].engine_unit
    t = release.set_fallback(repo, units[2].out_dir, server=RecordingServer(repo), warm=True)
    assert t["unit"] == c and t["smoke"]["text"] == "4" and t["load_ms"] >= 0
    st = release_state.read_state(repo)
    assert st["fallback"] == c and st["warm_fallback"] is True and (repo / c).is_dir()
    assert [r["unit"] for r in st["releases"] if r["kind"] == "fallback"] == [c]
    t = release.set_fallback(repo, units[1].out_dir)
    assert "smoke" not in t and release_state.read_state(repo)["warm_fallback"] is False


def test_rollback_timings_are_milliseconds(tmp_path, units):  # noqa: F811
    repo = new_repo(tmp_path, units)
    release.promote(repo, units[2].out_dir)
    t0 = time.perf_counter()
    t = release.rollback(repo)
    elapsed_ms = (time.perf_counter() - t0) * 1e3
    assert 0 <= t["switched_ms"] <= t["total_ms"] <= elapsed_ms


def test_promoting_a_previous_release_again_keeps_one_record_per_unit(tmp_path, units):  # noqa: F811
    repo = new_repo(tmp_path, units)
    a, b, c = (u.engine_unit for u in units)
    release.promote(repo, units[2].out_dir)
    release.promote(repo, units[0].out_dir)  # a again
    st = release_state.read_state(repo)
    assert st["current"] == a
    assert [(r["unit"], r["kind"]) for r in st["releases"]] == [(b, "fallback"), (c, "release"), (a, "release")]


# ---- issue 26: survivors of a seeded run (seed 0, 20 sampled)


def test_smoke_test_asks_for_8_tokens_by_default():
    assert release_live.smoke_test(ClientServer(FakeClient({"sequence_length": np.array([[8]], np.int32)})), "u")["tokens"] == 8
    with pytest.raises(RuntimeError, match=r"sequence_length 9 outside 1\.\.8"):
        release_live.smoke_test(ClientServer(FakeClient({"sequence_length": np.array([[9]], np.int32)})), "u")


def test_smoke_test_ms_is_milliseconds(monkeypatch):
    clock = iter([10.0, 10.25])
    monkeypatch.setattr(release.time, "perf_counter", lambda: next(clock))
    assert release_live.smoke_test(ClientServer(FakeClient()), "u")["ms"] == 250.0


def test_recover_of_a_folder_without_releases_json_fixes_nothing(tmp_path):
    repo = tmp_path / "model_repository"
    repo.mkdir()
    assert release_recover.recover(repo) == [] and release_state.read_state(repo) is None


def test_begin_rollout_loads_and_smoke_tests_the_candidate_on_the_server(tmp_path, units, smoke_calls):  # noqa: F811
    repo = new_repo(tmp_path, units)
    a, c = units[0].engine_unit, units[2].engine_unit
    srv = RecordingServer(repo, ready={a, "ensemble"})
    ro = release_rollout.begin_rollout(repo, units[2].out_dir, server=srv, steps=(5, 100))
    assert [x[:2] for x in srv.calls] == [("load", c), ("smoke", c)] and smoke_calls[0] == [c]
    assert set(ro["timings"]) == {"load_ms", "smoke"} and ro["timings"]["smoke"]["text"] == "4"
    assert (ro["candidate"], ro["stable"], ro["steps"], ro["percent"]) == (c, a, [5, 100], 0)
    # without a server nothing is loaded: the files only
    repo2 = new_repo(tmp_path / "two", units)
    assert release_rollout.begin_rollout(repo2, units[2].out_dir, steps=(5, 100))["timings"] == {}


def test_abort_with_the_server_unloads_the_candidate(tmp_path, units, smoke_calls):  # noqa: F811
    repo = new_repo(tmp_path, units)
    a, c = units[0].engine_unit, units[2].engine_unit
    srv = RecordingServer(repo, ready={a, "ensemble"})
    release_rollout.begin_rollout(repo, units[2].out_dir, server=srv, steps=(5, 100))
    release_rollout.set_rollout_percent(repo, 5)
    rec = release_rollout.abort_rollout(repo, server=srv, failed_check="probe:kl_p99")
    assert ("unload", c) in [x[:2] for x in srv.calls] and c not in srv.ready
    assert (rec["candidate"], rec["stable"], rec["failed_check"]) == (c, a, "probe:kl_p99") and "candidate_kept" not in rec
    assert release_state.read_state(repo)["current"] == a


def test_rollback_to_a_unit_that_is_no_release_says_why(tmp_path, units):  # noqa: F811
    from precision_pipeline.core.errors import UserError

    repo = new_repo(tmp_path, units, fallback=False)
    c = release_units.install_unit(repo, units[2].out_dir)          # on disk, never promoted or rolled out
    with pytest.raises(UserError, match=r"is not a release to roll back to: it was never a release \(a candidate left "
                                        r"on disk\)") as ei:
        release.rollback(repo, to=c)
    assert ei.value.problems[0].field == "--to"
    release_rollout.begin_rollout(repo, units[2].out_dir, steps=(5, 100))
    release_rollout.set_rollout_percent(repo, 5)
    release_rollout.abort_rollout(repo, failed_check="probe:top1")
    with pytest.raises(UserError, match=r"its rollout was rolled back \(probe:top1 at 5 %\)"):
        release.rollback(repo, to=c)


class LiveConfigServer(RecordingServer):
    """A RecordingServer whose ensemble config is the one it last LOADED (a real server's), not the file's."""

    def __init__(self, repo, **kw):
        super().__init__(repo, **kw)
        self.live = {"ensemble": RecordingServer.model_config(self, "ensemble")}

    def model_config(self, name):
        return self.live.get(name) if name in self.live else super().model_config(name)

    def load(self, name, config=None):
        out = super().load(name, config)
        if name == "ensemble":
            self.live["ensemble"] = RecordingServer.model_config(self, "ensemble")
        return out


def live_unit(srv):
    steps = srv.live["ensemble"]["ensemble_scheduling"]["step"]
    [unit] = [st["model_name"] for st in steps if st["model_name"].startswith("tensorrt_llm_")]
    return unit


def test_abort_after_the_switch_reloads_the_ensemble_onto_the_stable_release(tmp_path, units, smoke_calls):  # noqa: F811
    """A crash after the 100 % switch, before its commit: the live ensemble calls the candidate. The abort points
    the config back, reloads the ensemble (``ensemble_reloaded``), then unloads the candidate."""
    repo = new_repo(tmp_path, units)
    a, c = units[0].engine_unit, units[2].engine_unit
    srv = LiveConfigServer(repo, ready={a, "ensemble"})
    release_rollout.begin_rollout(repo, units[2].out_dir, server=srv, steps=(5, 100))
    release_configs.point_ensemble(repo, c)
    srv.load("ensemble")                                   # the switch reached the server
    assert live_unit(srv) == c
    rec = release_rollout.abort_rollout(repo, server=srv, failed_check="interrupted")
    assert rec["ensemble_reloaded"] is True and "candidate_kept" not in rec
    assert live_unit(srv) == a and c not in srv.ready
    calls = [x[:2] for x in srv.calls]
    assert calls.index(("load", "ensemble"), 3) < calls.index(("unload", c))  # reloaded before the candidate goes
    assert ("load", a) not in calls  # the stable release was loaded already: only the ensemble is reloaded


# ---- release_state.py survivors (session 12)


def test_pid_alive_is_a_signal_0_probe(monkeypatch):
    """A recorded rollout pid is alive when signal 0 reaches it, also when it belongs to another user
    (PermissionError: the process runs); gone (ProcessLookupError) or no positive int is not alive."""
    calls = []

    def stand_in(exc):
        def kill(pid, sig):
            calls.append((pid, sig))
            if exc:
                raise exc
        return kill

    monkeypatch.setattr(release_state.os, "kill", stand_in(PermissionError))
    assert release_state.pid_alive(4242) is True and calls == [(4242, 0)]
    monkeypatch.setattr(release_state.os, "kill", stand_in(ProcessLookupError))
    assert release_state.pid_alive(4243) is False
    monkeypatch.setattr(release_state.os, "kill", stand_in(None))
    assert release_state.pid_alive(4244) is True and calls == [(4242, 0), (4243, 0), (4244, 0)]
    for bad in (0, -1, "4242", None, 4242.0):
        assert release_state.pid_alive(bad) is False
    assert calls == [(4242, 0), (4243, 0), (4244, 0)]  # never signalled
    monkeypatch.undo()
    assert release_state.pid_alive(os.getpid()) is True


def test_release_record_of_an_engine_unit_without_its_reference_file(tmp_path):
    """No engine/cpu_reference.json: the hash comes from the unit's name and the engine counts as absent."""
    unit = "tensorrt_llm_0123456789ab"
    rec = release_state.release_record(tmp_path / unit, unit, "bf16-h100", None, "test", "release")
    assert (rec["engine_hash"], rec["engine_present"], rec["serving_route"], rec["provenance"], rec["gate"],
            rec["profile"], rec["kind"], rec["promoted_by"]) == (
        "0123456789ab", False, "engine", {"engine_hash": "0123456789ab"}, {}, "bf16-h100", "release", "test")


def test_record_probe_keeps_the_newest_probe_records_only(tmp_path, units, monkeypatch):  # noqa: F811
    repo = new_repo(tmp_path, units)
    before = release_state.read_state(repo)["history"]
    unit = units[0].engine_unit
    release_state.record_probe(repo, unit, {"passed": True, "ms": 1.0})
    hist = release_state.read_state(repo)["history"]
    assert hist[:-1] == before and (hist[-1]["action"], hist[-1]["unit"], hist[-1]["ms"]) == ("probe", unit, 1.0)
    monkeypatch.setattr(release_state, "PROBE_HISTORY_MAX", 2)
    for ms in (2.0, 3.0):
        release_state.record_probe(repo, unit, {"passed": True, "ms": ms})
    hist = release_state.read_state(repo)["history"]
    assert hist[:len(before)] == before and [h["ms"] for h in hist[len(before):]] == [2.0, 3.0]  # the oldest probe went


# ---- release_switch.py survivors (session 12)

ENGINE_A, ENGINE_B, LLM_U = "tensorrt_llm_aaaaaaaaaaaa", "tensorrt_llm_bbbbbbbbbbbb", "llm_api_0123456789ab"


class ReadyServer:
    """Records load/unload; ``ready`` is what loaded_models reports."""

    def __init__(self, ready=()):
        self.ready, self.calls = set(ready), []

    def loaded_models(self):
        return {n: "READY" for n in self.ready}

    def load(self, name, config=None):
        self.calls.append(("load", name))
        self.ready.add(name)

    def unload(self, name):
        self.calls.append(("unload", name))
        self.ready.discard(name)


def test_the_ensemble_follows_the_current_release():
    """An engine unit: the ensemble is (re)loaded; an LLM-API unit: a loaded ensemble is unloaded, an unloaded one left."""
    srv = ReadyServer()
    release_switch.ensemble_follow(srv, ENGINE_A)
    assert srv.calls == [("load", "ensemble")]
    release_switch.ensemble_follow(srv, LLM_U)
    assert srv.calls == [("load", "ensemble"), ("unload", "ensemble")]
    release_switch.ensemble_follow(srv, LLM_U)  # not loaded: nothing to unload
    assert srv.calls == [("load", "ensemble"), ("unload", "ensemble")]


def test_switch_timings_are_milliseconds_of_the_server_calls(monkeypatch):
    clock = iter([10.0, 10.25, 20.0, 20.125])
    monkeypatch.setattr(release_switch.time, "perf_counter", lambda: next(clock))
    pointed = []
    monkeypatch.setattr(release_switch, "point_ensemble", lambda repo, u: pointed.append(("ensemble", u)))
    monkeypatch.setattr(release_switch, "point_bls", lambda repo, u: pointed.append(("bls", u)))
    srv, t = ReadyServer(), {}
    release_switch._switch_to("/nonexistent", srv, ENGINE_A, t)
    assert t == {"ensemble_load_ms": 250.0} and pointed == [("ensemble", ENGINE_A), ("bls", ENGINE_A)]
    t = {}
    release_switch._switch_to("/nonexistent", srv, LLM_U, t)
    assert t == {"ensemble_unload_ms": 125.0} and srv.calls == [("load", "ensemble"), ("unload", "ensemble")]


def test_retention_unloads_only_what_is_loaded_and_prunes_the_records(tmp_path):
    repo = tmp_path / "model_repository"
    for u in (ENGINE_A, ENGINE_B, LLM_U):
        (repo / u).mkdir(parents=True)
    state = {"current": ENGINE_A, "keep_releases": 0, "history": [],
             "releases": [{"unit": u} for u in (ENGINE_A, ENGINE_B, LLM_U)], "unit_files": {u: {} for u in (ENGINE_A, ENGINE_B, LLM_U)}}
    srv = ReadyServer(ready={ENGINE_A, LLM_U})
    assert release_switch.retain(repo, state, srv, False, None) == [LLM_U, ENGINE_B]  # sorted by name
    assert ("unload", ENGINE_B) not in srv.calls and ("unload", LLM_U) in srv.calls and srv.ready == {ENGINE_A}
    assert [p.name for p in repo.iterdir()] == [ENGINE_A]
    assert state["releases"] == [{"unit": ENGINE_A}] and state["unit_files"] == {ENGINE_A: {}}


# ---- release_configs.py survivors (session 12)


def test_point_bls_rewrites_route_json_only_when_it_changes(tmp_path, units):  # noqa: F811
    repo = new_repo(tmp_path, units)
    route = repo / "tensorrt_llm_bls" / release_configs.ROUTE_FILE
    a, c = units[0].engine_unit, units[2].engine_unit
    assert release_configs.point_bls(repo, a) is False  # already a's: nothing written
    assert release_configs.point_bls(repo, c) is True and json.loads(route.read_text()) == {"tensorrt_llm_model_name": c}
    before = route.stat().st_mtime_ns, route.stat().st_ino
    assert release_configs.point_bls(repo, c) is False and (route.stat().st_mtime_ns, route.stat().st_ino) == before


def test_set_canary_takes_0_to_100_percent(tmp_path):
    (tmp_path / "tensorrt_llm_bls").mkdir()
    route = tmp_path / "tensorrt_llm_bls" / release_configs.ROUTE_FILE
    for pct in (0, 100):
        release_configs.set_canary(tmp_path, "s", "c", pct)
        assert json.loads(route.read_text()) == {"tensorrt_llm_model_name": "s", "canary": {"tensorrt_llm_model_name": "c", "percent": pct}}
    for pct in (-1, 101):
        with pytest.raises(ValueError, match=f"percent {pct} outside 0..100"):
            release_configs.set_canary(tmp_path, "s", "c", pct)
    assert json.loads(route.read_text())["canary"]["percent"] == 100  # a refused percent leaves route.json as it was


# ---- release_recover.py survivors (session 12)


def test_recover_removes_staged_leftovers_only(tmp_path, units):  # noqa: F811
    """A hidden file that is no leftover of an atomic write (``.notes``) is neither reported nor removed."""
    repo = new_repo(tmp_path, units)
    (repo / ".notes").write_text("mine")
    assert release_recover.recover(repo) == []
    (repo / f".{units[2].engine_unit}.old-123").mkdir()
    assert release_recover.recover(repo) == [f"removed staged leftovers: .{units[2].engine_unit}.old-123"]
    assert sorted(p.name for p in repo.iterdir() if p.name.startswith(".")) == [".notes"]


# ---- release_rollout.py survivors (session 12)


def test_rollout_timings_are_milliseconds_of_a_stand_in_clock(tmp_path, units, smoke_calls, monkeypatch):  # noqa: F811
    """begin_rollout's ``load_ms`` (the candidate's load), abort_rollout's ``route_ms`` (route.json back on the stable
    release) and its history entry's ``ms`` (0.1 ms) from release_rollout's clock."""
    import types

    repo = new_repo(tmp_path, units)
    a = units[0].engine_unit
    srv = RecordingServer(repo, ready={a, "ensemble"})
    ticks = iter([1.0, 1.25, 10.0, 10.0625, 10.123456])
    monkeypatch.setattr(release_rollout, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    ro = release_rollout.begin_rollout(repo, units[2].out_dir, server=srv, steps=(5, 100))
    assert ro["timings"]["load_ms"] == 250.0
    rec = release_rollout.abort_rollout(repo, server=srv, failed_check="errors")
    assert rec["route_ms"] == 62.5 and release_state.read_state(repo)["history"][-1]["ms"] == 123.5


# ---- release_live.py survivors (session 12)


class TextClient:
    """An LLM-API unit's ``text_output`` as given (None: the output is missing)."""

    def __init__(self, out):
        self.out = out

    def infer(self, model, inputs, outputs=None):
        return _Result({"text_output": self.out})


def test_llm_api_text_takes_one_string_only():
    assert release_live.llm_api_text(TextClient(np.array([b"Paris"], dtype=object)), LLM_U, "x", 4) == "Paris"
    for out, shown in ((None, "None"), (np.array([1.5]), "(dtype('float64'), (1,))"),
                       (np.array([b"a", b"b"], dtype=object), "(dtype('O'), (2,))")):
        with pytest.raises(RuntimeError) as ei:
            release_live.llm_api_text(TextClient(out), LLM_U, "x", 4)
        assert str(ei.value) == f"{LLM_U}: text_output {shown}, expected one string"


def test_routed_units_adds_the_live_ensembles_unit(tmp_path):
    (tmp_path / "tensorrt_llm_bls").mkdir()
    (tmp_path / "tensorrt_llm_bls" / release_configs.ROUTE_FILE).write_text(json.dumps(
        {"tensorrt_llm_model_name": ENGINE_A, "canary": {"tensorrt_llm_model_name": LLM_U, "percent": 5}}))

    class LiveEnsemble:
        def model_config(self, name):
            return {"ensemble_scheduling": {"step": [{"model_name": "preprocessing"}, {"model_name": ENGINE_B}]}}

    assert release_live.routed_units(tmp_path, LiveEnsemble()) == {ENGINE_A, LLM_U, ENGINE_B}
    assert release_live.routed_units(tmp_path, None) == {ENGINE_A, LLM_U}


# ---- release_units.py survivors (session 12)


def test_unit_record_reads_only_the_pack_json_of_this_unit(tmp_path):
    unit = tmp_path / "model_repository" / ENGINE_A
    unit.mkdir(parents=True)
    files = {"config.pbtxt": [10, "ab" * 32]}
    (unit.parent / "pack.json").write_text(json.dumps({"engine_unit": ENGINE_A, "unit_files": files}))
    assert release_units.unit_record(unit) == files
    (unit.parent / "pack.json").write_text(json.dumps({"engine_unit": ENGINE_B, "unit_files": files}))  # another unit's
    with pytest.raises(UserError) as ei:
        release_units.unit_record(unit)
    assert ei.value.problems[0].field == "--out" and "records no per-file sizes and checksums of " + ENGINE_A in ei.value.problems[0].reason


def test_install_unit_records_a_kept_unit_and_survives_an_undeletable_trash(tmp_path, units, monkeypatch):  # noqa: F811
    repo = new_repo(tmp_path, units)
    a, c = units[0].engine_unit, units[2].engine_unit
    assert release_units.install_unit(repo, units[0].out_dir) == a  # the same unit is kept, no record asked for
    rec: dict = {}
    assert release_units.install_unit(repo, units[0].out_dir, record=rec) == a
    assert list(rec["unit_files"]) == [a] and rec["unit_files"][a] == release_state.read_state(repo)["unit_files"][a]
    release_units.install_unit(repo, units[2].out_dir)
    (repo / c / "config.pbtxt").write_text("damaged")
    real = release_units.shutil.rmtree

    def rmtree(p, ignore_errors=False):  # the old folder cannot be deleted (an I/O error): the install still stands
        if ".old-" in str(p) and not ignore_errors:
            raise OSError("stand-in: cannot delete")
        real(p, ignore_errors=ignore_errors)

    monkeypatch.setattr(release_units.shutil, "rmtree", rmtree)
    assert release_units.install_unit(repo, units[2].out_dir) == c
    assert (repo / c / "config.pbtxt").read_text() != "damaged"


def test_finish_rollout_records_its_switch_in_tenths_of_a_millisecond(tmp_path, units, smoke_calls, monkeypatch):  # noqa: F811
    """The 100 % step's history entry ``ms``: the switch time from release_rollout's clock, rounded to 0.1 ms."""
    import types

    repo = new_repo(tmp_path, units)
    a = units[0].engine_unit
    srv = RecordingServer(repo, ready={a, "ensemble"})
    ticks = iter([1.0, 1.25, 20.0, 20.01234567] + [30.0] * 10)
    monkeypatch.setattr(release_rollout, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    release_rollout.begin_rollout(repo, units[2].out_dir, server=srv, steps=(5, 100))
    t = release_rollout.finish_rollout(repo, server=srv)
    assert t["switched_ms"] == pytest.approx(12.34567, abs=1e-6)
    last = release_state.read_state(repo)["history"][-1]
    assert (last["action"], last["to"], last["ms"]) == ("rollout", units[2].engine_unit, 12.3)


def test_recovered_rollout_abort_entry(tmp_path, units, smoke_calls):  # noqa: F811
    """A rollout whose process died is ended by recover with a ``rollout_abort`` entry of 0.0 ms (nothing was timed)."""
    repo = new_repo(tmp_path, units)
    srv = RecordingServer(repo, ready={units[0].engine_unit, "ensemble"})
    release_rollout.begin_rollout(repo, units[2].out_dir, server=srv, steps=(5, 100))
    st = release_state.read_state(repo)
    st["rollout"]["pid"] = 2 ** 22 + 12345  # above Linux's pid_max: no such process
    release_state.write_state(repo, st)
    fixed = release_recover.recover(repo)
    assert fixed and "interrupted rollout" in fixed[0]
    last = release_state.read_state(repo)["history"][-1]
    assert (last["action"], last["by"], last["ms"], last["rollout"]["failed_check"]) == ("rollout_abort", "recover", 0.0,
                                                                                          "interrupted")


@pytest.mark.parametrize("keep, ok", [(0, True), (100, True), (101, False), (-1, False)])
def test_keep_releases_bounds(tmp_path, units, keep, ok):  # noqa: F811
    """releases.json's ``keep_releases``: 0..100 (a record asking to keep more is refused when read)."""
    import pydantic

    st = release_state.read_state(new_repo(tmp_path, units))
    if ok:
        assert release_state.ReleasesFile.model_validate({**st, "keep_releases": keep}).keep_releases == keep
    else:
        with pytest.raises(pydantic.ValidationError, match="keep_releases"):
            release_state.ReleasesFile.model_validate({**st, "keep_releases": keep})


def test_copy_unit_with_recorded_files_under_its_version_folder(tmp_path):
    """A unit whose recorded files include ``1/`` (its version folder made by the copies) installs: the version
    folder is made only when missing."""
    from precision_pipeline.core.store import hash_file
    from precision_pipeline.serving import release_units

    src = tmp_path / "tensorrt_llm_aaaaaaaaaaaa"
    (src / "1").mkdir(parents=True)
    (src / "1" / "notes.txt").write_text("kept")
    (src / "config.pbtxt").write_text('name: "tensorrt_llm_aaaaaaaaaaaa"\n'
                                      'parameters { key: "gpt_model_path" value { string_value: "/x" } }\n')
    files = {rel: [(src / rel).stat().st_size, hash_file(src / rel)] for rel in ("1/notes.txt", "config.pbtxt")}
    dst = tmp_path / "repo" / src.name
    release_units.copy_unit(src, dst, files, "/serve/engine")
    assert (dst / "1" / "notes.txt").read_text() == "kept"
    assert 'string_value: "/serve/engine"' in (dst / "config.pbtxt").read_text()


@pytest.mark.parametrize("warm", [False, True])
def test_reconcile_keeps_a_loaded_fallback_only_when_warm(tmp_path, units, warm):  # noqa: F811
    """A fallback whose unit a failed rollout rejected, loaded on the server: kept loaded only when the record keeps
    the fallback warm (hostile s8 #127); a cold one is unloaded like any unit that is no release."""
    from precision_pipeline.serving import release_live

    a, b = units[0].engine_unit, units[1].engine_unit
    repo = new_repo(tmp_path, units, warm=warm)
    srv = RecordingServer(repo, ready={a, b, "ensemble"})
    st = release_state.read_state(repo)
    st["history"].append({"action": "rollout_abort", "from": b, "to": a, "time": "t", "by": "test", "ms": 0.0,
                          "rollout": {"failed_check": "errors", "numbers": {}}})
    assert b in release_state.rejected_units(st)
    fixed = release_live.reconcile_server(repo, srv, st)
    assert fixed == ([] if warm else [f"{b} unloaded (no release; nothing routes to it)"])
    assert (b in srv.ready) is warm


# ---- release.py survivors (session 14, seed 1)


def test_warm_fallback_load_ms_from_a_stand_in_clock(tmp_path, units, smoke_calls, monkeypatch):  # noqa: F811
    import types

    repo = new_repo(tmp_path, units, fallback=False)
    srv = RecordingServer(repo, ready={units[0].engine_unit, "ensemble"})
    ticks = iter([1.0, 1.25] + [9.0] * 10)
    monkeypatch.setattr(release, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    t = release.set_fallback(repo, units[1].out_dir, server=srv, warm=True)
    assert t["load_ms"] == 250.0 and units[1].engine_unit in srv.ready


def test_rollback_of_a_cold_target_times_its_load_and_unloads_the_old_current(tmp_path, units, smoke_calls, monkeypatch):  # noqa: F811
    """A cold previous release is loaded (``load_ms`` from release's clock), and the release rolled back from is
    unloaded afterwards (no warm previous kept by a rollback)."""
    import types

    a, c = units[0].engine_unit, units[2].engine_unit
    repo = new_repo(tmp_path, units, fallback=False)
    release.promote(repo, units[2].out_dir, profile="bf16-h100", promoted_by="test")
    srv = RecordingServer(repo, ready={c, "ensemble"})
    ticks = iter([0.0, 1.0, 2.0, 10.0, 10.5] + [20.0] * 20)
    monkeypatch.setattr(release, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    t = release.rollback(repo, server=srv)
    assert (t["unit"], t["warm"], t["verify_ms"], t["load_ms"]) == (a, False, 1000.0, 500.0)
    assert a in srv.ready and c not in srv.ready


@pytest.mark.parametrize("how, field", [({"to": "a"}, "--to"), ({}, "rollback")])
def test_a_damaged_kept_release_is_refused_naming_the_option(tmp_path, units, how, field):  # noqa: F811
    a = units[0].engine_unit
    repo = new_repo(tmp_path, units, fallback=False)
    release.promote(repo, units[2].out_dir, profile="bf16-h100", promoted_by="test")
    victim = next(p for p in sorted((repo / a).rglob("*")) if p.is_file() and p.name != "config.pbtxt")
    victim.write_bytes(victim.read_bytes() + b"x")
    to = {"to": a[len("tensorrt_llm_"):][:6]} if how else {}
    with pytest.raises(UserError) as e:
        release.rollback(repo, **to)
    assert e.value.problems[0].field == field


def test_a_cold_fallback_is_not_loaded(tmp_path, units, smoke_calls):  # noqa: F811
    repo = new_repo(tmp_path, units, fallback=False)
    srv = RecordingServer(repo, ready={units[0].engine_unit, "ensemble"})
    t = release.set_fallback(repo, units[1].out_dir, server=srv, warm=False)
    assert "load_ms" not in t and units[1].engine_unit not in srv.ready and smoke_calls[0] == []
    assert [c[0] for c in srv.calls] == []


def test_promote_load_ms_from_a_stand_in_clock(tmp_path, units, smoke_calls, monkeypatch):  # noqa: F811
    import types

    repo = new_repo(tmp_path, units, fallback=False)
    srv = RecordingServer(repo, ready={units[0].engine_unit, "ensemble"})
    ticks = iter([0.0, 5.0, 5.125] + [9.0] * 20)
    monkeypatch.setattr(release, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    t = release.promote(repo, units[2].out_dir, server=srv, profile="bf16-h100", promoted_by="test")
    assert t["load_ms"] == 125.0 and t["unit"] == units[2].engine_unit


def test_a_new_repository_records_version_1(tmp_path, units):  # noqa: F811
    st = release_state.read_state(new_repo(tmp_path, units))
    assert st["version"] == 1 and release_state.ReleasesFile.model_fields["version"].default == 1


def test_abort_keeps_its_numbers_and_unloads_only_a_loaded_candidate(tmp_path, units, smoke_calls):  # noqa: F811
    a, c = units[0].engine_unit, units[2].engine_unit
    repo = new_repo(tmp_path, units, fallback=False)
    srv = RecordingServer(repo, ready={a, "ensemble"})
    release_rollout.begin_rollout(repo, units[2].out_dir, server=srv, steps=(5, 100))
    srv.ready.discard(c)  # the candidate went away on its own (a crashed stub)
    srv.calls.clear()
    rec = release_rollout.abort_rollout(repo, server=srv, failed_check="kl_p99", numbers={"kl_p99": 0.31})
    assert rec["numbers"] == {"kl_p99": 0.31}
    assert ("unload", c) not in [(w, n) for w, n, *_ in srv.calls]  # nothing to unload
    release_rollout.begin_rollout(repo, units[2].out_dir, server=srv, steps=(5, 100))
    assert release_rollout.abort_rollout(repo, server=srv)["numbers"] == {}
    assert c not in srv.ready  # a loaded candidate is unloaded


def test_abort_never_unloads_the_fallback(tmp_path, units, smoke_calls):  # noqa: F811
    """A rollout of the unit that is also the fallback (a warm one stays loaded): the abort leaves it loaded."""
    a, b = units[0].engine_unit, units[1].engine_unit
    repo = new_repo(tmp_path, units, fallback=True, warm=True)
    srv = RecordingServer(repo, ready={a, b, "ensemble"})
    st = release_state.read_state(repo)
    st["rollout"] = {"candidate": b, "stable": a, "percent": 5, "step": 0, "steps": [5, 100], "started": "t",
                     "pid": os.getpid(), "by": "test", "checks": []}
    release_state.write_state(repo, st)
    release_rollout.abort_rollout(repo, server=srv, verify=False)
    assert b in srv.ready


def test_crash_hook_exits_with_97(monkeypatch):
    exits = []
    monkeypatch.setattr(release_state.os, "_exit", lambda code: exits.append(code))
    monkeypatch.setenv(release_state.CRASH_ENV, "switch")
    release_state.crash_point("install")
    release_state.crash_point("switch")
    assert exits == [97] and release_state.CRASH_EXIT == 97


def test_a_unit_named_folder_without_its_config_is_no_unit(tmp_path):
    from precision_pipeline.serving import release_units

    d = tmp_path / "tensorrt_llm_aaaaaaaaaaaa"
    d.mkdir()
    with pytest.raises(UserError, match="is neither an engine unit"):
        release_units.resolve_unit_source(d)
    (d / "config.pbtxt").write_text('name: "tensorrt_llm_aaaaaaaaaaaa"\n')
    assert release_units.resolve_unit_source(d) == d
    assert release_units.resolve_unit_source(tmp_path) == d  # a repository holding one unit


def test_rollout_window_of_a_model_absent_from_both_scrapes():
    from precision_pipeline.serving import rollout

    w = rollout.Window.of({}, {}, "u")
    assert (w.success, w.failure, w.mean_ms) == (0, 0, None)
    a = {("nv_inference_request_success", "u"): 2.0, ("nv_inference_request_duration_us", "u"): 1000.0}
    b = {("nv_inference_request_success", "u"): 6.0, ("nv_inference_request_failure", "u"): 1.0,
         ("nv_inference_request_duration_us", "u"): 9000.0}
    w = rollout.Window.of(a, b, "u")
    assert (w.success, w.failure, w.mean_ms) == (4, 1, 2.0)


def test_rollout_defaults_and_abort_verifies_the_server(tmp_path, units):  # noqa: F811
    """``rollout``'s documented hold of 10 s a step; ``abort`` checks by default that the server serves the
    repository before anything changes."""
    import inspect

    from precision_pipeline.serving import rollout

    assert inspect.signature(rollout.rollout).parameters["hold_s"].default == 10.0
    assert inspect.signature(rollout.abort).parameters["verify"].default is True
    mine = new_repo(tmp_path / "a", units, fallback=False)
    theirs = new_repo(tmp_path / "b", units, fallback=False)
    srv = RecordingServer(theirs, ready={units[0].engine_unit, "ensemble", "preprocessing"})
    with pytest.raises(UserError) as e:
        rollout.abort(mine, srv)
    assert e.value.problems[0].field in ("--url", "--repo")
