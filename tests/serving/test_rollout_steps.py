"""The rollout's decisions without a server (fast): metrics parsing, per-unit windows, the canary
share, each check's threshold at its boundary, a probe that errors, and whole rollouts driven by
scripted metrics through a recording stand-in server (the live rollouts are in test_rollout.py).

Planted-bug tests (issue 26): a probe that raises must fail the step (never count as a pass), and
the ``errors`` check must read the candidate's failures, not the stable unit's.
"""

from __future__ import annotations

import json

import pytest

from precision_pipeline.core.errors import UserError
from precision_pipeline.serving import release_configs, release_state, rollout
from tests.serving.test_release import new_repo, units  # noqa: F401  (units: module fixture)
from tests.serving.test_release_planted import RecordingServer, smoke_calls  # noqa: F401  (fixture)

S, C = "tensorrt_llm_stable", "tensorrt_llm_cand"
OK, FAIL, DUR, PEND = rollout.COUNTERS


def counters(**per_model) -> dict:
    """``counters(stable=(success, failure, duration_us), cand=(...), ensemble=(...))`` as scrape() returns them."""
    names = {"stable": S, "cand": C, "ensemble": "ensemble"}
    out = {}
    for key, vals in per_model.items():
        for metric, v in zip((OK, FAIL, DUR, PEND), vals):
            out[(metric, names[key])] = float(v)
    return out


ZERO = counters(stable=(0, 0, 0), cand=(0, 0, 0), ensemble=(0, 0, 0))


class Probe:
    """A stand-in probe result (what _evaluate reads: passed, failures, summary())."""

    def __init__(self, passed=True, failures=()):
        self.passed, self.failures = passed, list(failures)

    def summary(self):
        return {"passed": self.passed, "kl_p99": 0.1}


def probe_ok(server, unit, probe_set):
    return Probe()


def probe_raises(server, unit, probe_set):
    raise RuntimeError(f"probe of {unit}: context_logits None (engine built without --gather_context_logits?)")


def evaluate(b, a=ZERO, percent=20, checks=rollout.Checks(), probe_fn=probe_ok):
    return rollout._evaluate(None, None, S, C, a, b, percent, checks, probe_fn)


# --------------------------------------------------------------------------------------------
# Metrics


TRITON_METRICS = """\
# HELP nv_inference_request_success Number of successful inference requests, all batch sizes
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="ensemble",version="1"} 3
nv_inference_request_success{model="tensorrt_llm_cand",version="1"} 10
nv_inference_request_success{model="tensorrt_llm_cand",version="2"} 5
# HELP nv_inference_request_failure Number of failed inference requests, all batch sizes
# TYPE nv_inference_request_failure counter
nv_inference_request_failure{model="tensorrt_llm_cand",reason="BACKEND",version="1"} 2
# HELP nv_inference_request_duration_us Cumulative inference request duration in microseconds
# TYPE nv_inference_request_duration_us counter
nv_inference_request_duration_us{model="tensorrt_llm_cand",version="1"} 1500
# HELP nv_inference_pending_request_count Instantaneous number of pending requests awaiting execution per-model.
# TYPE nv_inference_pending_request_count gauge
nv_inference_pending_request_count{model="tensorrt_llm_cand",version="1"} 4
# HELP nv_inference_count Number of inferences performed
# TYPE nv_inference_count counter
nv_inference_count{model="tensorrt_llm_cand",version="1"} 99
# HELP nv_cpu_utilization CPU utilization rate [0.0 - 1.0]
# TYPE nv_cpu_utilization gauge
nv_cpu_utilization 0.5
"""


def test_scrape_sums_versions_and_keeps_only_the_per_model_counters(tmp_path):
    f = tmp_path / "metrics"
    f.write_text(TRITON_METRICS)
    got = rollout.scrape(f.as_uri())
    assert got == {(OK, "ensemble"): 3.0, (OK, C): 15.0, (FAIL, C): 2.0, (DUR, C): 1500.0, (PEND, C): 4.0}


def test_metrics_url():
    class Srv:
        host, metrics_port = "10.0.0.7", 8002

    assert rollout.metrics_url(Srv()) == "http://10.0.0.7:8002/metrics"


def test_window_of_one_model():
    a = counters(cand=(10, 1, 5000))
    b = counters(cand=(14, 3, 13000), stable=(100, 50, 10**6))
    w = rollout.Window.of(a, b, C)
    assert (w.success, w.failure, w.mean_ms) == (4, 2, 2.0)  # (13000 - 5000) us / 4 requests
    assert rollout.Window.of(a, a, C).mean_ms is None  # no request, no mean


def test_canary_share_and_routed_requests():
    # the BLS routed 30 + 10 requests; the stable unit also served the 20 ensemble requests
    b = counters(stable=(48, 2, 0), cand=(9, 1, 0), ensemble=(20, 0, 0))
    assert rollout.routed_of(ZERO, b, S, C) == 40.0
    assert rollout.canary_share(ZERO, b, S, C) == 25.0  # failures count as routed to the candidate
    assert rollout.canary_share(ZERO, ZERO, S, C) is None


# --------------------------------------------------------------------------------------------
# The checks of one step


def test_every_check_passes_and_the_numbers_are_recorded():
    b = counters(stable=(80, 0, 80_000), cand=(20, 0, 40_000))
    nums, failed = evaluate(b)
    assert failed is None
    assert nums["percent"] == 20 and nums["share_measured"] == 20.0
    assert nums["candidate"] == {"success": 20, "failure": 0, "mean_ms": 2.0}
    assert nums["stable"] == {"success": 80, "failure": 0, "mean_ms": 1.0}
    assert nums["probe"] == {"passed": True, "kl_p99": 0.1}


def test_errors_check_reads_the_candidates_failures():
    """Planted: ``wc.failure`` replaced by ``ws.failure`` (the stable unit's) must fail here."""
    stable_failing = counters(stable=(80, 7, 80_000), cand=(20, 0, 40_000))
    assert evaluate(stable_failing)[1] is None  # the stable unit's failures are not the candidate's
    cand_failing = counters(stable=(80, 0, 80_000), cand=(20, 1, 40_000))
    nums, failed = evaluate(cand_failing)
    assert failed == "errors" and nums["candidate"]["failure"] == 1 and "probe" not in nums
    # max_failures is the allowance: at it passes, above it fails
    assert evaluate(cand_failing, checks=rollout.Checks(max_failures=1))[1] is None
    assert rollout.Checks().max_failures == 0


def test_a_probe_that_raises_fails_the_step():
    """Planted: a probe error counted as a pass would promote an engine that cannot return logits."""
    b = counters(stable=(80, 0, 80_000), cand=(20, 0, 40_000))
    nums, failed = evaluate(b, probe_fn=probe_raises)
    assert failed == "probe:error"
    assert nums["probe"] == {"error": "probe of tensorrt_llm_cand: context_logits None (engine built without "
                                      "--gather_context_logits?)"}


def test_a_failed_probe_names_its_checks():
    b = counters(stable=(80, 0, 80_000), cand=(20, 0, 40_000))
    nums, failed = evaluate(b, probe_fn=lambda *a: Probe(False, ["kl_p99", "top1"]))
    assert failed == "probe:kl_p99,top1" and nums["probe"]["passed"] is False


def test_traffic_check_at_its_threshold():
    """A route that never reaches the candidate fails once the step's share of the routed requests
    reaches ``traffic_expected`` (3): 60 routed x 5 % = 3 fails; 59 x 5 % = 2.95 does not."""
    assert rollout.Checks().traffic_expected == 3.0
    nums, failed = evaluate(counters(stable=(60, 0, 60_000), cand=(0, 0, 0)), percent=5)
    assert failed == "traffic" and nums["share_measured"] == 0.0
    assert evaluate(counters(stable=(59, 0, 59_000), cand=(0, 0, 0)), percent=5)[1] is None
    # nothing routed at all (no share): not a traffic failure
    assert evaluate(ZERO, percent=50)[1] is None


def test_latency_check_at_its_thresholds():
    """Candidate mean > 3 x stable mean fails, when both served >= 5 requests (``min_requests``)."""
    assert (rollout.Checks().latency_ratio, rollout.Checks().min_requests) == (3.0, 5)
    slow = counters(stable=(5, 0, 5_000), cand=(5, 0, 15_001))  # 1 ms vs 3.0002 ms
    assert evaluate(slow)[1] == "latency"
    assert evaluate(counters(stable=(5, 0, 5_000), cand=(5, 0, 15_000)))[1] is None  # exactly 3x passes
    assert evaluate(counters(stable=(4, 0, 4_000), cand=(5, 0, 50_000)))[1] is None  # stable below min_requests
    assert evaluate(counters(stable=(5, 0, 5_000), cand=(4, 0, 40_000)))[1] is None  # candidate below min_requests
    assert evaluate(slow, checks=rollout.Checks(latency_ratio=4.0))[1] is None


def test_errors_come_before_the_probe_and_latency():
    both = counters(stable=(5, 0, 5_000), cand=(5, 2, 50_000))
    calls = []
    assert evaluate(both, probe_fn=lambda *a: calls.append(a) or Probe())[1] == "errors" and calls == []


# --------------------------------------------------------------------------------------------
# Whole rollouts: recording server, scripted metrics


class MetricsServer(RecordingServer):
    host, metrics_port = "127.0.0.1", 1


class Script:
    """scrape() stand-in: each of the first ``windows`` step windows shows ``cand`` (success, failure,
    duration_us) for the candidate and 4x its requests on the stable unit; then the counters stay
    still (drained)."""

    def __init__(self, stable, cand_unit, cand=(10, 0, 10_000), windows=2):
        self.s, self.c, self.cand, self.windows, self.n, self.calls = stable, cand_unit, cand, windows, 0, 0

    def __call__(self, url):
        assert url == "http://127.0.0.1:1/metrics"
        self.calls += 1
        k = self.n
        self.n += 1
        s, f, d = self.cand
        ws = min(self.windows, k // 2 + k % 2)  # windows completed at this scrape (a, b alternate)
        return {(OK, self.s): 4.0 * s * ws, (FAIL, self.s): 0.0, (DUR, self.s): 4.0 * d * ws, (OK, self.c): float(s * ws),
                (FAIL, self.c): float(f * ws), (DUR, self.c): float(d * ws)}


def _repo(tmp_path, units, monkeypatch, cand=(10, 0, 10_000), windows=1):  # noqa: F811
    """A serving repository (stable: units[0]) and scripted metrics for it and candidate units[2]."""
    repo = new_repo(tmp_path, units)
    stable = release_state.read_state(repo)["current"]
    script = Script(stable, units[2].engine_unit, cand, windows)
    monkeypatch.setattr(rollout, "scrape", script)
    # the metrics-port check before loading scrapes once (tested in test_release_safety.py); it would shift the
    # script's step windows by one scrape
    monkeypatch.setattr(rollout, "check_metrics", lambda server, unit: None)
    return repo, stable, script


def test_rollout_promotes_through_every_step(tmp_path, units, smoke_calls, monkeypatch):  # noqa: F811
    repo, stable, script = _repo(tmp_path, units, monkeypatch, windows=2)
    srv = MetricsServer(repo)
    seen, probed = [], []
    res = rollout.rollout(repo, units[2].out_dir, srv, "probe-set", steps=(5, 20, 100), hold_s=0.0,
                          probe_fn=lambda s, u, p: probed.append((s, u, p)) or Probe(), on_step=seen.append)
    cand = units[2].engine_unit
    assert (res.status, res.candidate, res.stable, res.failed_step, res.failed_check) == ("promoted", cand, stable, None, None)
    assert [s["percent"] for s in res.steps] == [5, 20, 100] and seen == res.steps
    assert [s["passed"] for s in res.steps[:2]] == [True, True] and res.steps[0]["share_measured"] == 20.0
    assert probed == [(srv, cand, "probe-set")] * 2 and smoke_calls[0] == [cand]
    assert script.calls == 4 and res.seconds > 0
    st = release_state.read_state(repo)
    assert st["current"] == cand and "rollout" not in st and st["history"][-1]["action"] == "rollout"
    assert st["history"][-1]["rollout"]["checks"]["steps"][0]["percent"] == 5
    assert release_configs.current_of_configs(repo) == (cand, cand)


def test_rollout_with_a_probe_that_raises_rolls_back(tmp_path, units, smoke_calls, monkeypatch):  # noqa: F811
    """Planted (issue 26): the probe raising must be a rollback at the first step, never a promotion."""
    repo, stable, _ = _repo(tmp_path, units, monkeypatch)
    srv = MetricsServer(repo)
    res = rollout.rollout(repo, units[2].out_dir, srv, None, steps=(5, 50, 100), hold_s=0.0, probe_fn=probe_raises,
                          by="test")
    assert (res.status, res.failed_step, res.failed_check) == ("rolled_back", 5, "probe:error")
    assert len(res.steps) == 1 and res.steps[0]["passed"] is False and "error" in res.numbers["probe"]
    assert res.decision_to_stable_ms is not None and res.decision_to_stable_ms >= 0
    st = release_state.read_state(repo)
    assert st["current"] == stable and "rollout" not in st
    last = st["history"][-1]
    assert last["action"] == "rollout_abort" and last["by"] == "test (automatic)"
    assert last["rollout"]["failed_check"] == "probe:error" and last["rollout"]["step"] == 5
    assert json.loads((repo / "tensorrt_llm_bls" / "route.json").read_text()) == {"tensorrt_llm_model_name": stable}
    assert release_configs.current_of_configs(repo) == (stable, stable)


def test_a_failed_probe_of_a_routed_release_names_the_route(tmp_path, units, smoke_calls, monkeypatch):  # noqa: F811
    """Issue 31: with a routing table in the stable release, the candidate takes over the primary's routes; its
    probe's numbers (the step, the rollback record) name them (``probe.route_units``)."""
    from precision_pipeline.spec.profile import load_profile
    from precision_pipeline.spec.routing import routing_table

    repo, stable, _ = _repo(tmp_path, units, monkeypatch)
    (repo / stable / "routing.json").write_text(json.dumps(routing_table(load_profile("fp8-h100-routed").routing)))
    res = rollout.rollout(repo, units[2].out_dir, MetricsServer(repo), None, steps=(5, 100), hold_s=0.0,
                          probe_fn=lambda *a: Probe(False, ["kl_p99"]), by="test")
    assert (res.status, res.failed_step, res.failed_check) == ("rolled_back", 5, "probe:kl_p99")
    assert release_state.read_state(repo)["fallback"] == units[1].engine_unit  # the fallback rules' unit: not probed
    assert res.numbers["probe"] == {"passed": False, "kl_p99": 0.1, "route": "busy,default"}
    assert release_state.read_state(repo)["history"][-1]["rollout"]["failed_check"] == "probe:kl_p99"


def test_rollout_rolls_back_on_candidate_errors(tmp_path, units, smoke_calls, monkeypatch):  # noqa: F811
    repo, stable, _ = _repo(tmp_path, units, monkeypatch, cand=(10, 1, 10_000))
    res = rollout.rollout(repo, units[2].out_dir, MetricsServer(repo), None, steps=(5, 100), hold_s=0.0,
                          probe_fn=probe_ok)
    assert (res.status, res.failed_step, res.failed_check) == ("rolled_back", 5, "errors")
    assert res.numbers["candidate"]["failure"] == 1 and release_state.read_state(repo)["current"] == stable


def test_rollout_stops_when_aborted_by_another_process(tmp_path, units, smoke_calls, monkeypatch):  # noqa: F811
    repo, stable, _ = _repo(tmp_path, units, monkeypatch)

    def probe_then_abort(server, unit, probe_set):  # `invoke rollout --abort` runs during the first step
        rollout.abort(repo, None, by="other")
        return Probe()

    res = rollout.rollout(repo, units[2].out_dir, MetricsServer(repo), None, steps=(5, 50, 100), hold_s=0.0,
                          probe_fn=probe_then_abort)
    assert res.status == "aborted" and [s["percent"] for s in res.steps] == [5]
    st = release_state.read_state(repo)
    assert st["current"] == stable and st["history"][-1]["by"] == "other"


def test_rollout_error_rolls_back_and_reraises(tmp_path, units, smoke_calls, monkeypatch):  # noqa: F811
    repo, stable, _ = _repo(tmp_path, units, monkeypatch)

    def probe_bug(server, unit, probe_set):
        raise KeyError("not a RuntimeError: a bug, re-raised after the rollback")

    with pytest.raises(KeyError):
        rollout.rollout(repo, units[2].out_dir, MetricsServer(repo), None, steps=(5, 100), hold_s=0.0, probe_fn=probe_bug)
    st = release_state.read_state(repo)
    assert st["current"] == stable and "rollout" not in st
    assert st["history"][-1]["rollout"]["failed_check"] == "error" and st["history"][-1]["by"] == "invoke rollout (error)"


def test_rollout_refuses_bad_steps_before_touching_the_repository(tmp_path, units, monkeypatch):  # noqa: F811
    repo, _, _ = _repo(tmp_path, units, monkeypatch)
    before = release_state.read_state(repo)
    with pytest.raises(UserError, match="--steps"):
        rollout.rollout(repo, units[2].out_dir, MetricsServer(repo), None, steps=(50, 20, 100))
    assert release_state.read_state(repo) == before


def test_parse_steps_text_and_sequences():
    assert rollout.parse_steps(" 5, 20 ,100") == (5, 20, 100)
    assert rollout.parse_steps([10, 100]) == (10, 100)
    assert rollout.parse_steps("100") == (100,)
    assert rollout.DEFAULT_STEPS == (5, 20, 50, 100)
    for bad in ("5,20,101", "5,x,100", "-5,100"):
        with pytest.raises(UserError):
            rollout.parse_steps(bad)


def test_wait_drained_measures_the_last_request(monkeypatch):
    """The candidate serves 2 more requests after the decision, then nothing: decision_to_stable_ms is
    the time to its count's last change (rounded to 0.1 ms), served_after_decision 2; pending requests
    keep it waiting. A stand-in clock (binary fractions, so every sum is exact)."""
    seq = [counters(cand=(10, 0, 0, 1)), counters(cand=(11, 0, 0, 1)), counters(cand=(12, 0, 0, 0))]
    clock = {"t": 100.0}
    monkeypatch.setattr(rollout.time, "perf_counter", lambda: clock["t"])
    monkeypatch.setattr(rollout.time, "sleep", lambda s: clock.__setitem__("t", clock["t"] + s))
    monkeypatch.setattr(rollout, "scrape", lambda url: seq.pop(0) if len(seq) > 1 else seq[0])
    srv = MetricsServer(None)
    got = rollout.wait_drained(srv, C, t_decision=99.99996, poll_s=0.25, quiet_s=0.5)
    assert got["served_after_decision"] == 2
    assert got["decision_to_stable_ms"] == 500.0  # 99.99996 -> 100.5 (second poll: last change) = 500.04 ms
    assert clock["t"] == 101.0  # quiet for 0.5 s after the last change, nothing pending
    # a unit that never drains: gives up after timeout_s, polling until the deadline and not past it
    monkeypatch.setattr(rollout, "scrape", lambda url: counters(cand=(10, 0, 0, 3)))
    clock["t"] = 0.0
    got = rollout.wait_drained(srv, C, t_decision=0.0, timeout_s=1.0, poll_s=0.25)
    assert got == {"decision_to_stable_ms": 0.0, "served_after_decision": 0} and clock["t"] == 1.0


def test_counters_that_went_backwards_are_no_verdict_and_roll_back():
    """Hostile s17 F21 (AB4): the candidate unloaded mid-step by a killed abort: its counters restarted and the step
    read "candidate -1 ok / 0 failed, share -4.8 %". Counters that went backwards judge nothing: the step fails with
    `counters_reset`, which is no verdict on the candidate."""
    from precision_pipeline.serving import release_state

    a = counters(stable=(50, 0, 5000), cand=(10, 0, 1000), ensemble=(0, 0, 0))
    b = counters(stable=(60, 0, 6000), cand=(9, 0, 900), ensemble=(0, 0, 0))
    nums, failed = evaluate(b, a=a)
    assert failed == rollout.COUNTERS_RESET == "counters_reset"
    assert "counters_reset" in release_state.NOT_A_VERDICT
    # hostile s17c F3: the step and the outcome printed "candidate -1 ok", "share -50.0 %", "check counters_reset failed"
    assert nums["candidate"] is None and nums["share_measured"] is None and nums["counters_reset"] is True
    from pathlib import Path
    from types import SimpleNamespace

    from precision_pipeline.cli import serving as cli

    res = SimpleNamespace(status="rolled_back", failed_check="counters_reset", failed_step=50, candidate="C", stable="S")
    assert cli.rollout_outcome(res, None, "u", Path("r")) == (
        "[red]rolled back[/] at 50 %: the candidate's or the stable unit's counters went backwards during the step "
        "(unloaded or reloaded meanwhile: `invoke rollout --abort` from another shell, a hand unload, serve's watchdog), "
        "so nothing was judged: no verdict on C (it may be rolled out again); S serves all traffic")
    ok = counters(stable=(60, 0, 6000), cand=(12, 0, 1200), ensemble=(0, 0, 0))
    assert evaluate(ok, a=a)[1] is None
