"""Gradual rollout of a new release on a running Triton server, with automatic rollback.

``rollout(repo_dir, engine_unit, server, probe_set, steps=(5, 20, 50, 100), hold_s=...)``:

1. ``release.begin_rollout``: the candidate unit is installed and loaded beside the stable one and
   smoke-tested directly; releases.json records ``rollout`` (candidate, steps, pid).
2. For each step below 100: ``release.set_rollout_percent`` writes route.json with the canary share;
   the BLS (``tensorrt_llm_bls``) sends that share of its requests to the candidate (per request,
   evenly spread). The ensemble stays on the stable unit until 100 %. After ``hold_s`` seconds the
   checks run:

   * ``probe``: the accuracy probe (serving/probe.py) against the candidate, thresholds from the
     profile's gate section (KL P99, top-1 on the answer tokens); with a routing table the step's ``probe``
     numbers name the routes the candidate serves (``route``: the stable unit's in ``probe.route_units``, the
     rules that send requests to the primary, whose share the candidate takes);
   * ``errors``: the candidate's failed requests in the step's window (server metrics
     ``nv_inference_request_failure``) must be 0 (``max_failures``);
   * ``latency``: the candidate's mean request latency (``nv_inference_request_duration_us`` /
     ``nv_inference_request_success``) at most ``latency_ratio`` x the stable unit's, when both served
     at least ``min_requests`` requests in the window;
   * ``traffic``: the candidate served at least one request when its share of the routed requests
     was at least ``traffic_expected`` (a route that never reaches the candidate is not a pass).

   Every check passing widens to the next step; any failing one is an automatic rollback.
3. At 100 %: ``release.finish_rollout`` re-points ensemble and BLS at the candidate and commits it as
   the current release.

Rollback (``abort``; automatic or ``invoke rollout --abort``): route.json back to the stable unit
first, then the candidate's in-flight requests are waited for (metrics: request count unchanged and
nothing pending), then the candidate is unloaded and releases.json records the step, the failed check
and its numbers. ``decision_to_stable_ms``: from the decision to the last request the candidate served
(its count's last change, polled every 10 ms; an upper bound within one poll).

Metrics: the server's Prometheus endpoint (``http://127.0.0.1:<metrics port>/metrics``), parsed with
prometheus_client's text parser (``scrape``). Counters per model (label ``model``): ``nv_inference_request_success``,
``nv_inference_request_failure``, ``nv_inference_request_duration_us``, gauge ``nv_inference_pending_request_count``.

A crash mid-rollout (the rollout process dies) leaves releases.json naming the stable release as
current and a ``rollout`` whose pid is dead: ``release.recover()`` (run by serve/promote/rollback and
the next rollout) writes route.json back to the stable unit. Until then the BLS keeps the last step's
share: the stable ensemble is unaffected.
"""

from __future__ import annotations

import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

from precision_pipeline.core.errors import UserError
from precision_pipeline.serving import release_live, release_rollout, release_state
from precision_pipeline.spec.profile import canary_steps_problem

DEFAULT_STEPS = (5, 20, 50, 100)
COUNTERS = ("nv_inference_request_success", "nv_inference_request_failure", "nv_inference_request_duration_us",
            "nv_inference_pending_request_count")


def parse_steps(text: str | Sequence[int]) -> tuple[int, ...]:
    """``"5,20,50,100"`` -> (5, 20, 50, 100): strictly increasing integers in 1..100 ending at 100."""
    parts = text.split(",") if isinstance(text, str) else list(text)
    if any(not str(x).strip() for x in parts):  # "5,,100" or "5,100,": a typo, not a shorter plan
        raise UserError("--steps", f"{text!r} has an empty step.", "e.g. --steps 5,20,50,100")
    try:
        steps = tuple(int(x) for x in parts)
    except ValueError:
        raise UserError("--steps", f"{text!r} is not a comma-separated list of integers.", "e.g. --steps 5,20,50,100") from None
    why = canary_steps_problem(steps)
    if why:
        raise UserError("--steps", f"{why}.", "e.g. --steps 5,20,50,100")
    return steps


# --------------------------------------------------------------------------------------------
# Server metrics


def scrape(metrics_url: str, timeout: float = 5.0) -> dict[tuple[str, str], float]:
    """{(metric, model): value} of the per-model Triton metrics in ``COUNTERS`` (summed over versions)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=timeout) as r:
        text = r.read().decode()
    out: dict[tuple[str, str], float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name not in COUNTERS:
            continue
        for s in fam.samples:  # the parser names a counter's sample <family>_total
            if s.name in (fam.name, fam.name + "_total") and "model" in s.labels:
                k = (fam.name, s.labels["model"])
                out[k] = out.get(k, 0.0) + float(s.value)
    return out


def metrics_url(server) -> str:
    return f"http://{server.host}:{server.metrics_port}/metrics"


def check_metrics(server, unit: str) -> None:
    """Refuse (UserError on ``--metrics-port``, exit 2) a metrics endpoint that is not ``server``'s:
    it must answer with Triton's per-model metrics and list ``unit`` (loaded there; Triton registers
    a loaded model's counters at 0). Run before anything is loaded."""
    from precision_pipeline.serving.triton_server import local_metrics_port

    url = metrics_url(server)
    fix = "pass the server's metrics port (`invoke serve` prints it; default HTTP port + 2)."
    local = local_metrics_port(server.http_url)
    if local is not None and local[1] != server.metrics_port:  # hostile s15 F15: another server with the same units
        raise UserError("--metrics-port", f"the tritonserver at {server.http_url} (pid {local[0]}) exports its metrics on "
                        f"port {local[1]}, not {server.metrics_port}: {url} is another server's.",
                        f"pass --metrics-port {local[1]}.")
    try:
        got = scrape(url)
    except (OSError, ValueError) as e:
        raise UserError("--metrics-port", f"no Triton metrics at {url} ({type(e).__name__}: {str(e)[:160]}).", fix) from None
    if ("nv_inference_request_success", unit) not in got:
        raise UserError("--metrics-port", f"the metrics at {url} do not list {unit}, which the server at "
                        f"{server.http_url} serves: another server's metrics port?", fix)


COUNTERS_RESET = "counters_reset"
"""The failed check of a step whose candidate's or stable unit's counters went backwards between its scrapes: the
model was unloaded or reloaded during the step (an abort from another process, a hand unload), so its numbers judge
nothing; rolled back, and no verdict on the candidate (``release_state.NOT_A_VERDICT``)."""


def _went_back(a: dict, b: dict, models) -> bool:
    """Whether a counter of ``models`` is lower in scrape ``b`` than in the earlier ``a`` (the model was unloaded or
    reloaded between them: Triton's counters restart)."""
    return any(b.get((k, m), 0.0) < a.get((k, m), 0.0) for k in COUNTERS[:3] for m in models)


@dataclass
class Window:
    """What one model served between two scrapes."""

    success: int
    failure: int
    mean_ms: Optional[float]

    @classmethod
    def of(cls, a: dict, b: dict, model: str) -> "Window":
        d = {m: b.get((m, model), 0.0) - a.get((m, model), 0.0) for m in COUNTERS[:3]}
        n = int(round(d["nv_inference_request_success"]))
        return cls(n, int(round(d["nv_inference_request_failure"])),
                   d["nv_inference_request_duration_us"] / n / 1e3 if n else None)


def canary_share(a: dict, b: dict, stable: str, candidate: str) -> Optional[float]:
    """Percentage of the BLS-routed requests the candidate served between scrapes ``a`` and ``b``:
    candidate / (candidate + stable - ensemble), since every ensemble request goes to the stable unit."""
    routed = routed_of(a, b, stable, candidate)
    cand = sum(b.get((k, candidate), 0.0) - a.get((k, candidate), 0.0) for k in COUNTERS[:2])
    return 100.0 * cand / routed if routed > 0 else None


def routed_of(a: dict, b: dict, stable: str, candidate: str) -> float:
    """Requests the BLS routed (to either unit) between scrapes ``a`` and ``b``."""
    def d(m):
        return sum(b.get((k, m), 0.0) - a.get((k, m), 0.0) for k in COUNTERS[:2])
    return d(candidate) + d(stable) - d("ensemble")


def wait_drained(server, unit: str, t_decision: float, timeout_s: float = 60.0, poll_s: float = 0.01,
                 quiet_s: float = 0.3) -> dict:
    """After the route switch: poll ``unit``'s request counters until nothing is pending and the count
    has not changed for ``quiet_s``. Returns ``decision_to_stable_ms`` (decision to the count's last
    change, or to the first poll when it never changed) and the requests it served meanwhile."""
    url = metrics_url(server)
    first = last = scrape(url)
    t_change = time.perf_counter()
    deadline = t_change + timeout_s
    while time.perf_counter() < deadline:
        time.sleep(poll_s)
        now = scrape(url)
        served = sum(now.get((k, unit), 0.0) for k in COUNTERS[:2])
        if served != sum(last.get((k, unit), 0.0) for k in COUNTERS[:2]):
            t_change = time.perf_counter()
        last = now
        if now.get(("nv_inference_pending_request_count", unit), 0.0) == 0 and time.perf_counter() - t_change >= quiet_s:
            break
    after = sum(last.get((k, unit), 0.0) - first.get((k, unit), 0.0) for k in COUNTERS[:2])
    return {"decision_to_stable_ms": round((t_change - t_decision) * 1e3, 1), "served_after_decision": int(after)}


HOLD_POLL_S = 2.0
"""During a step's hold the server's metrics endpoint is read every this many seconds, so a server
that dies mid-step ends the rollout (check ``server``) within seconds, not after the hold."""


def hold(url: str, hold_s: float, poll_s: float = HOLD_POLL_S) -> None:
    """Wait ``hold_s`` seconds; raises OSError (or ValueError) as soon as ``url`` (the server's
    metrics) stops answering."""
    end = time.monotonic() + hold_s
    while (left := end - time.monotonic()) > 0:
        time.sleep(min(poll_s, left))
        if end - time.monotonic() > 0:
            scrape(url)


# --------------------------------------------------------------------------------------------
# The rollout


@dataclass
class Checks:
    """Thresholds of the non-accuracy checks (accuracy: the profile's gate section, in the ProbeSet)."""

    max_failures: int = 0
    latency_ratio: float = 3.0
    min_requests: int = 5
    traffic_expected: float = 3.0
    """``traffic`` fails when the candidate served nothing although the step's share of the routed
    requests was at least this many (the BLS's even split gives one per 100/percent requests)."""


@dataclass
class RolloutResult:
    status: str                    # "promoted" | "rolled_back" | "aborted" (by `invoke rollout --abort`)
    candidate: str
    stable: str
    steps: list[dict[str, Any]] = field(default_factory=list)
    failed_step: Optional[int] = None
    failed_check: Optional[str] = None
    numbers: dict[str, Any] = field(default_factory=dict)
    decision_to_stable_ms: Optional[float] = None
    seconds: float = 0.0


def _evaluate(server, probe_set, stable: str, cand: str, a: dict, b: dict, percent: int, checks: Checks,
              probe_fn: Callable) -> tuple[dict, Optional[str]]:
    wc, ws = Window.of(a, b, cand), Window.of(a, b, stable)
    share = canary_share(a, b, stable, cand)
    nums: dict[str, Any] = {"percent": percent, "candidate": vars(wc), "stable": vars(ws), "share_measured": share}
    failed = COUNTERS_RESET if _went_back(a, b, (cand, stable)) else "errors" if wc.failure > checks.max_failures else None
    if failed:  # counters_reset: unloaded mid-step (hostile s17 F21), unjudgeable: no negative counts shown (s17c F3)
        nums.update(dict(candidate=None, stable=None, share_measured=None, counters_reset=True) if failed == COUNTERS_RESET else {})
    elif wc.success == 0 and share is not None and routed_of(a, b, stable, cand) * percent / 100 >= checks.traffic_expected:
        failed = "traffic"
    elif (wc.mean_ms is not None and ws.mean_ms is not None and wc.success >= checks.min_requests
          and ws.success >= checks.min_requests and wc.mean_ms > checks.latency_ratio * ws.mean_ms):
        failed = "latency"
    if failed is None:
        try:
            pr = probe_fn(server, cand, probe_set)
            nums["probe"] = pr.summary()
            if not pr.passed:
                failed = "probe:" + ",".join(pr.failures)
        except RuntimeError as e:
            nums["probe"] = {"error": str(e)}
            failed = "probe:error"
    return nums, failed


def _naming(probe_fn: Callable, route: str) -> Callable:
    """``probe_fn`` whose results' ``summary()`` also names ``route`` (``probe.route_units``: the routes of the stable
    unit, which the candidate takes over), so a step's probe numbers and a rollback's record say which requests."""
    if not route:
        return probe_fn

    def run(server, unit, probe_set):
        pr = probe_fn(server, unit, probe_set)
        summary = pr.summary
        pr.summary = lambda: {**summary(), "route": route}
        return pr
    return run


def abort(repo_dir: Path, server=None, *, failed_check: str = "manual abort", numbers: dict | None = None,
          by: str = "invoke rollout --abort", t_decision: float | None = None, verify: bool = True) -> dict:
    """All traffic back to the stable release, candidate unloaded, the abort recorded (module doc;
    ``release.abort_rollout``: ``verify`` checks first that ``server`` serves ``repo_dir``)."""
    t_decision = time.perf_counter() if t_decision is None else t_decision
    drained = (lambda unit: wait_drained(server, unit, t_decision)) if server is not None else None
    return release_rollout.abort_rollout(repo_dir, server=server, failed_check=failed_check, numbers=numbers, by=by,
                                 drained=drained, verify=verify)


def rollout(repo_dir: Path, engine_unit: Path, server, probe_set, *, steps: Iterable[int] = DEFAULT_STEPS,
            hold_s: float = 10.0, profile: str = "", gate: dict | None = None, by: str = "invoke rollout",
            checks: Checks = Checks(), probe_fn: Callable | None = None,
            on_step: Callable[[dict], None] | None = None) -> RolloutResult:
    """Roll ``engine_unit`` out on ``server`` in ``steps`` (module doc). Returns a RolloutResult; a
    failed check is a rollback, not an exception, and so is a server that stops answering or refuses
    mid-step (check ``server``: the candidate may have brought it down). Raises UserError for a wrong
    set-up (no serving repository, a server that does not serve it, a metrics port that is not its, a
    rollout already in progress) before anything is loaded, and re-raises anything unexpected after
    rolling back. SIGTERM and SIGHUP (in the main thread) roll back as Ctrl-C does (failed check
    ``interrupted``), then KeyboardInterrupt propagates."""
    from precision_pipeline.serving import probe
    from precision_pipeline.serving.triton_server import terminate_as_interrupt

    steps = parse_steps(list(steps))
    t0 = time.perf_counter()
    state = release_state.read_state(repo_dir)
    probe_fn = _naming(probe_fn or probe.run_probe, probe.route_units(repo_dir).get(state["current"], "") if state else "")
    if state and server is not None:
        release_live.verify_server(repo_dir, server)
        check_metrics(server, state["current"])
    with terminate_as_interrupt():
        ro = release_rollout.begin_rollout(repo_dir, engine_unit, server=server, profile=profile, gate=gate, steps=steps, by=by)
        cand, stable = ro["candidate"], ro["stable"]
        res = RolloutResult("rolled_back", cand, stable)
        url = metrics_url(server)
        prev_numbers = None

        def ours() -> bool:  # False once `invoke rollout --abort` (another process) ended this rollout
            st = release_state.rollout_state(repo_dir)
            return bool(st) and st.get("candidate") == cand and st.get("pid") == ro.get("pid")

        def rolled_back(pct: int, failed: str, nums: dict) -> None:
            rec = abort(repo_dir, server, failed_check=failed, numbers=nums, by=f"{by} (automatic)",
                        t_decision=time.perf_counter(), verify=False)
            res.failed_step, res.failed_check, res.numbers = pct, failed, nums
            res.decision_to_stable_ms = rec.get("decision_to_stable_ms")

        try:
            for pct in steps:
                if not ours():
                    res.status = "aborted"
                    break
                if pct == 100:
                    try:
                        t = release_rollout.finish_rollout(repo_dir, server=server, checks={"steps": res.steps})
                    except (OSError, RuntimeError) as e:  # the switch failed (configs put back) or the server died
                        rolled_back(pct, "server", {"percent": pct, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                        break
                    res.status = "promoted"
                    res.steps.append({"percent": 100, "switched_ms": round(t["switched_ms"], 1)})
                    if on_step:
                        on_step(res.steps[-1])
                    break
                release_rollout.set_rollout_percent(repo_dir, pct, prev_numbers)
                try:
                    a = scrape(url)
                    hold(url, hold_s)
                    b = scrape(url)
                except (OSError, ValueError) as e:  # the server (or its metrics) stopped answering
                    rolled_back(pct, "server", {"percent": pct, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                    break
                if not ours():
                    res.status = "aborted"
                    break
                nums, failed = _evaluate(server, probe_set, stable, cand, a, b, pct, checks, probe_fn)
                res.steps.append({**nums, "passed": failed is None})
                if on_step:
                    on_step(res.steps[-1])
                if failed is not None:
                    rolled_back(pct, failed, nums)
                    break
                prev_numbers = nums
        except BaseException as e:
            if ours():
                abort(repo_dir, server, failed_check="interrupted" if isinstance(e, KeyboardInterrupt) else "error",
                      by=f"{by} ({'interrupted' if isinstance(e, KeyboardInterrupt) else 'error'})", verify=False)
            raise
    res.seconds = time.perf_counter() - t0
    return res


__all__ = ["rollout", "abort", "scrape", "check_metrics", "canary_share", "wait_drained", "parse_steps", "Checks", "RolloutResult",
           "Window", "DEFAULT_STEPS"]
