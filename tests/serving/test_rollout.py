"""Gradual rollout on a real tritonserver (CPU reference backend): probe, canary share, automatic rollback.

One server for the module. Stable release: the default model in FP32 (no checkpoint). Candidates:
the FP8 + FP8-KV test checkpoint (healthy, fp8-h100's thresholds for this model) and a copy of the
BF16 test checkpoint with decoder layers 3 and 20 swapped (bad: it loads and answers, but wrongly).
The probe set comes from a small gate run of the healthy checkpoint (one prompt per category, no
held-out / greedy / floor: ``gate_dir`` of tests/serving/conftest.py, shared with test_observability.py).
The healthy candidate is loaded once: its rollout (``healthy_rollout``) records the probe it runs at the
first step, which ``test_probe_agrees_with_the_gate`` compares with the gate. The bad candidate's rollout
runs first, against the FP32 stable release.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from precision_pipeline.serving import pack, probe, release_configs, release_recover, release_state, rollout
from precision_pipeline.serving.triton_server import text_request
from precision_pipeline.spec.profile import load_profile

pytestmark = pytest.mark.slow
REPO_ROOT = Path(__file__).resolve().parents[2]
SWAP = (3, 20)


def swapped_checkpoint(src: Path, dst: Path, a: int = SWAP[0], b: int = SWAP[1]) -> Path:
    """A copy of TRT-LLM checkpoint ``src`` whose decoder layers ``a`` and ``b`` trade weights."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.suffix != ".safetensors":
            shutil.copy2(p, dst / p.name)
    for p in src.glob("rank*.safetensors"):
        t = load_file(str(p))
        pa, pb = f"transformer.layers.{a}.", f"transformer.layers.{b}."
        out = {}
        for k, v in t.items():
            k2 = pb + k[len(pa):] if k.startswith(pa) else pa + k[len(pb):] if k.startswith(pb) else k
            out[k2] = v
        assert any(k.startswith(pa) for k in t), f"no layer {a} in {p}"
        save_file(out, str(dst / p.name), metadata={"format": "pt"})
    return dst


def pack_unit(base: Path, name: str, ckpt: Path, model_dir: Path, mb: int = 32, profile: str = "bf16-h100",
              deployment: dict | None = None):
    """``base/name``: a packed repository of ``profile`` (max_batch_size ``mb``) serving ``ckpt`` (a
    missing folder: the HF weights of ``model_dir``). ``deployment``: profile ``deployment`` fields replaced."""
    from tests.serving.test_pack import make_plan, with_limits

    prof = load_profile(profile)
    if deployment:
        prof = prof.model_copy(update={"deployment": prof.deployment.model_validate({**prof.deployment.model_dump(), **deployment})})
    d = base / name
    return pack.pack_repository(with_limits(make_plan(prof), max_batch_size=mb), prof, model_dir, ckpt, d / "engine",
                                False, d / "model_repository", str(d))


@pytest.fixture(scope="module")
def units(tmp_path_factory, bf16_checkpoint, fp8_checkpoint, default_model_dir):
    base = tmp_path_factory.mktemp("rollout-units")
    bad_ckpt = swapped_checkpoint(Path(bf16_checkpoint), base / "swapped-ckpt")
    return {"stable": pack_unit(base, "stable", base / "no-checkpoint", Path(default_model_dir)),
            "healthy": pack_unit(base, "healthy", Path(fp8_checkpoint), Path(default_model_dir)),
            "bad": pack_unit(base, "bad", bad_ckpt, Path(default_model_dir))}


def serve_repository(tmp_path_factory, name: str, stable):
    """A serving repository created from packed unit ``stable`` and a real server on it: yields (repo, server)."""
    from precision_pipeline.serving.triton_server import TritonServer, models_to_load, repository_traces_url

    repo = tmp_path_factory.mktemp(name) / "model_repository"
    release_recover.init_serving_repo(repo, stable.out_dir, profile="bf16-h100")
    srv = TritonServer(repo, models_to_load(repo), log_file=repo.parent / "server.log",
                       trace_url=repository_traces_url(repo))  # as `invoke serve` does
    srv.start()
    try:
        yield repo, srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def served(tmp_path_factory, units):
    yield from serve_repository(tmp_path_factory, "rollout-serving", units["stable"])


@pytest.fixture(scope="module")
def probe_set(gate_dir):
    return probe.load_probe_set(gate_dir, prompts=3)


class Clients:
    """Client threads sending short chat requests through the BLS (the canary path) in bounded loops."""

    def __init__(self, srv, n=2, max_tokens=2, limit=400, prompt="What is 2 + 2?"):
        self.srv, self.n, self.max_tokens, self.limit, self.prompt = srv, n, max_tokens, limit, prompt
        self.stop, self.lock = threading.Event(), threading.Lock()
        self.requests, self.failed, self.errors = 0, 0, []

    def _run(self):
        import tritonclient.http as hc

        c = hc.InferenceServerClient(self.srv.http_url, network_timeout=120.0)
        try:
            for _ in range(self.limit):
                if self.stop.is_set():
                    break
                err = None
                try:
                    if not c.infer("tensorrt_llm_bls", text_request(self.prompt, self.max_tokens)).as_numpy("text_output").reshape(-1)[0]:
                        err = "empty"
                except Exception as e:
                    err = str(e)[:200]
                with self.lock:
                    self.requests += 1
                    if err:
                        self.failed += 1
                        self.errors.append(err)
        finally:
            c.close()

    def __enter__(self):
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(self.n)]
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(120)


def test_parse_steps():
    from precision_pipeline.core.errors import UserError

    assert rollout.parse_steps("5,20,50,100") == (5, 20, 50, 100)
    for bad in ("5,20", "20,5,100", "0,100", "5,5,100", "x"):
        with pytest.raises(UserError):
            rollout.parse_steps(bad)


def test_canary_share_discounts_ensemble():
    a = {}
    b = {("nv_inference_request_success", "s"): 130.0, ("nv_inference_request_success", "c"): 10.0,
         ("nv_inference_request_success", "ensemble"): 40.0}
    assert rollout.canary_share(a, b, "s", "c") == pytest.approx(100 * 10 / 100)


def test_bad_candidate_rolled_back_at_first_step(served, units, probe_set):
    repo, srv = served
    stable = release_state.read_state(repo)["current"]
    with Clients(srv) as cl:
        time.sleep(0.5)
        res = rollout.rollout(repo, units["bad"].out_dir, srv, probe_set, steps=(5, 50, 100), hold_s=3.0)
    print(f"\n[rollout bad] {res.failed_check} after {res.seconds:.1f} s; decision_to_stable_ms={res.decision_to_stable_ms}")
    assert res.status == "rolled_back" and res.failed_step == 5 and res.failed_check.startswith("probe:")
    assert res.numbers["probe"]["kl_p99"] > probe_set.thresholds.kl_p99_max
    assert cl.failed == 0 and cl.requests > 10, cl.errors[:3]
    st = release_state.read_state(repo)
    assert st["current"] == stable and "rollout" not in st
    last = st["history"][-1]
    assert last["action"] == "rollout_abort" and last["rollout"]["step"] == 5
    assert last["rollout"]["failed_check"] == res.failed_check and "probe" in last["rollout"]["numbers"]
    assert 0 <= last["rollout"]["decision_to_stable_ms"] < 60_000
    assert json.loads((repo / "tensorrt_llm_bls" / "route.json").read_text()) == {"tensorrt_llm_model_name": stable}
    assert srv.loaded_models().get(res.candidate) != "READY"


@pytest.fixture(scope="module")
def healthy_rollout(served, units, probe_set):
    """The healthy unit rolled out (steps 25, 100) under client load, once for the module; the probe the rollout
    ran at 25 % is recorded (``probe_fn``: the real ``probe.run_probe``, kept)."""
    repo, srv = served
    stable = release_state.read_state(repo)["current"]
    probes = []

    def recording_probe(server, unit, pset):
        pr = probe.run_probe(server, unit, pset)
        probes.append((unit, pr))
        return pr

    real_hold = rollout.hold

    def hold_until_the_candidate_served(url, hold_s, poll_s=rollout.HOLD_POLL_S):
        """The real hold, then on until the candidate served CANDIDATE_REQUESTS requests in this window (a
        loaded machine may route none to it in 4 s): the window's contents, not its length, are under test.
        A route that never reaches the candidate still fails, after WINDOW_LIMIT_S."""
        cand = release_state.rollout_state(repo)["candidate"]
        key = ("nv_inference_request_success", cand)
        start = rollout.scrape(url).get(key, 0.0)  # the rollout's window starts just before this
        real_hold(url, hold_s, poll_s)
        end = time.monotonic() + WINDOW_LIMIT_S
        while rollout.scrape(url).get(key, 0.0) - start < CANDIDATE_REQUESTS and time.monotonic() < end:
            time.sleep(0.2)

    with Clients(srv, n=2) as cl, pytest.MonkeyPatch.context() as mp:
        mp.setattr(rollout, "hold", hold_until_the_candidate_served)
        res = rollout.rollout(repo, units["healthy"].out_dir, srv, probe_set, steps=(25, 100), hold_s=4.0,
                              probe_fn=recording_probe)
        time.sleep(0.5)
    return {"result": res, "clients": cl, "probes": probes, "stable": stable}


CANDIDATE_REQUESTS = 2
"""Candidate requests the healthy rollout's 25 % window waits for (``healthy_rollout``)."""
WINDOW_LIMIT_S = 120.0
"""How long past ``hold_s`` that window waits for them before the rollout evaluates it anyway."""


def test_probe_agrees_with_the_gate(healthy_rollout, probe_set):
    """The healthy unit through the server (the rollout's probe at 25 %): exactly the gate's own numbers on the same prompts."""
    [(unit, pr)] = healthy_rollout["probes"]
    assert unit == healthy_rollout["result"].candidate
    g = pr.gate_same_prompts
    print(f"\n[probe] {pr.summary()}")
    assert pr.passed and pr.tokens == g["tokens"] > 20 and pr.prompts == 3
    for k in ("kl_p99", "top1"):
        lo, hi = pr.ci95[k]
        assert lo - 1e-6 <= g[k] <= hi + 1e-6, (k, g[k], pr.ci95[k])
    # exact: the CPU reference backend loads the checkpoint with gate.model.load_checkpoint_model, as the gate does, so
    # the probe's numbers equal the gate's bit for bit (measured: kl_p99 0.2404607659578322 both); the client requests
    # running beside it do not change them (the probe's context logits are one unpadded forward per prompt)
    assert (pr.kl_p99, pr.kl_mean, pr.top1) == (g["kl_p99"], g["kl_mean"], g["top1"])
    assert 0.005 < pr.kl_mean < 0.2 and pr.top1 < 1.0  # FP8: a real, non-zero difference the probe sees
    assert healthy_rollout["result"].steps[0]["probe"] == pr.summary()  # what the rollout recorded is this probe


def test_healthy_candidate_reaches_100(served, healthy_rollout):
    repo, srv = served
    res, cl, stable = healthy_rollout["result"], healthy_rollout["clients"], healthy_rollout["stable"]
    print(f"\n[rollout healthy] {[{k: s.get(k) for k in ('percent', 'share_measured')} for s in res.steps]} "
          f"requests={cl.requests} in {res.seconds:.1f} s")
    assert res.status == "promoted", (res.failed_check, res.numbers)
    assert cl.failed == 0 and cl.requests > 10, cl.errors[:3]
    s25 = res.steps[0]
    assert s25["candidate"]["success"] >= CANDIDATE_REQUESTS and s25["candidate"]["failure"] == 0
    # the BLS's deterministic split: within one request per BLS instance of the step's share
    n = s25["candidate"]["success"] + s25["stable"]["success"]
    assert abs(s25["share_measured"] - 25) <= 100 * 2 / n + 0.5
    st = release_state.read_state(repo)
    assert st["current"] == res.candidate != stable and "rollout" not in st
    assert st["history"][-1]["action"] == "rollout"
    assert release_configs.current_of_configs(repo) == (res.candidate, res.candidate)


def test_crash_mid_rollout_serves_stable(tmp_path, units):
    """A rollout killed right after writing a step's route.json: recover() routes everything to stable."""
    repo = tmp_path / "serving" / "model_repository"
    release_recover.init_serving_repo(repo, units["stable"].out_dir, profile="bf16-h100")
    stable = release_state.read_state(repo)["current"]
    code = ("import sys; sys.path.insert(0, 'build'); from pathlib import Path; "
            "from precision_pipeline.serving import release_rollout; "
            f"release_rollout.begin_rollout(Path({str(repo)!r}), Path({str(units['bad'].out_dir)!r}), steps=(5, 100)); "
            f"release_rollout.set_rollout_percent(Path({str(repo)!r}), 5)")
    env = {**os.environ, release_state.CRASH_ENV: "rollout_route"}
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert p.returncode == release_state.CRASH_EXIT, p.stderr
    route = json.loads((repo / "tensorrt_llm_bls" / "route.json").read_text())
    assert route["canary"]["percent"] == 5  # the crash left the canary share in place ...
    fixed = release_recover.recover(repo)
    assert any("interrupted rollout" in f for f in fixed)
    st = release_state.read_state(repo)  # ... recover routes every request to the stable release again
    assert st["current"] == stable and "rollout" not in st
    assert st["history"][-1]["action"] == "rollout_abort" and st["history"][-1]["rollout"]["failed_check"] == "interrupted"
    assert json.loads((repo / "tensorrt_llm_bls" / "route.json").read_text()) == {"tensorrt_llm_model_name": stable}
    assert release_configs.current_of_configs(repo) == (stable, stable)


# --------------------------------------------------------------------------------------------
# The two serving routes in one repository (issue 28) and per-request routing through a release change (issue 31): an
# engine release promoted beside a warm BF16 fallback, an LLM-API release packed with a routing table rolled out with
# the live (text) probe and rolled back -- on this module's server, under client load through the BLS, every response's
# precision_path checked against the phase it was sent and answered in.

ROUTES_REQUESTS = 1000
"""BLS requests over the whole sequence, at least (the done-when of issues 28 and 31)."""
ROUTES_PHASE_REQUESTS = 100
"""BLS requests each steady phase waits for, at least: the promoted engine release, the rollout's 50 % step, the
LLM-API release (routed by its table) and after the rollback. The LLM-API release's phase also waits for what the
1,000 would lack otherwise (its requests are the cheapest: 6 prompt tokens on the LLM-API unit, no chat template)."""
ROUTES_PHASE_LIMIT_S = 1500.0
"""How long one phase may wait for its requests (a loaded 2-core machine serves well under 1 request/s)."""
ROUTES_LONG_TOKENS = 40
"""The table's ``prompt_tokens_over`` (fp8-h100-routed's 2,048 made small: a request costs the CPU stand-in one FP32
forward of its prompt, so the long prompts of the load stay short)."""
LOAD_PROMPT = "The capital of France is"
"""The load's prompt: 35 prompt tokens with the chat template (an engine unit), 6 without (an LLM-API unit); a completion
prompt, since the BLS sends an LLM-API unit the text as given and a raw chat question is answered there with end-of-turn
first (an empty text, a failure)."""
LONG_PROMPT = "The capital of France is Paris. The capital of Spain is"
"""42 prompt tokens with the chat template: over ``ROUTES_LONG_TOKENS`` (``LOAD_PROMPT`` is not)."""
LOAD_KINDS = {"short": (LOAD_PROMPT, None), "strict": (LOAD_PROMPT, "strict"), "long": (LONG_PROMPT, None)}
"""kind -> (prompt, the request's ``precision_tier``)."""
LOAD_MIX = ("short", "short", "strict", "strict", "short", "short", "long", "long") + ("short",) * 4 + ("strict", "strict",
                                                                                        "short", "short")
"""The load's requests in turn: a quarter on tier strict, an eighth long prompts, the rest short (1 new token each); the
even and the odd turns each hold all three kinds in these shares, so the BLS's 50 % canary (every other request) gets
all kinds too."""


def routes_table() -> dict:
    """fp8-h100-routed's routing table (strict-tier, busy, long-prompts, default) with long-prompts over
    ``ROUTES_LONG_TOKENS``, rendered as pack renders a profile's (``pack.routing_files``)."""
    prof = load_profile("fp8-h100-routed")
    rules = [r.model_copy(update={"prompt_tokens_over": ROUTES_LONG_TOKENS}) if r.prompt_tokens_over else r
             for r in prof.routing.rules]
    prof = prof.model_copy(update={"routing": prof.routing.model_copy(update={"rules": rules})})
    return pack.routing_files(prof)[pack.ROUTING_FILE]


def pack_llm_api(base: Path, ckpt: Path, model_dir: Path, routing: dict | None = None):
    """``base/model_repository``: a packed repository holding one LLM-API unit of checkpoint ``ckpt`` (the FP8 test
    checkpoint the ``gate_dir`` gate scored: the probe's reference) with routing table ``routing`` and its pack.json
    record, as the llm_api route's pack writes them (serving/llmapi_unit.py ``pack_llm_api_repository``; only the unit
    and its record are needed here)."""
    from precision_pipeline.serving import llmapi_unit
    from tests.serving.test_llmapi_contract import MODEL_YAML

    repo = base / "model_repository"
    repo.mkdir(parents=True)
    u = llmapi_unit.pack_llm_api_unit(repo, MODEL_YAML, ckpt, model_dir, str(base.resolve()),
                                      {"profile": "fp8-h100-llmapi"}, version="1.2.1", routing=routing)
    (repo / pack.PACK_FILE).write_text(json.dumps({"engine_unit": u.name, "unit_key": u.key, "unit_files": u.unit_files,
                                                   "route": "llm_api"}))
    return repo, u.name


@pytest.fixture(scope="module")
def llm_api_packed(tmp_path_factory, fp8_checkpoint, default_model_dir):
    return pack_llm_api(tmp_path_factory.mktemp("llmapi-unit"), Path(fp8_checkpoint), Path(default_model_dir),
                        routing=routes_table())


@pytest.fixture(scope="module")
def bf16_fallback(tmp_path_factory, bf16_checkpoint, default_model_dir):
    """bf16-h100 packed with the BF16 test checkpoint: the warm fallback the routing table sends requests to."""
    return pack_unit(tmp_path_factory.mktemp("fallback-unit"), "fallback", Path(bf16_checkpoint), Path(default_model_dir))


@pytest.fixture(scope="module")
def text_probe_set(gate_dir):
    """The LLM-API candidate's probe set: 2 prompts (facts, reasoning: 97 answer positions), not the module's 3 (the
    third, code, has 75 positions of the longest contexts: half the text probe's cost, one forward per position)."""
    return probe.load_probe_set(gate_dir, prompts=2)


def _bls_path(srv) -> dict:
    c = srv.http_client()
    try:
        r = c.infer("tensorrt_llm_bls", text_request("What is 2 + 2?", 2))
        return json.loads(r.as_numpy("precision_path").reshape(-1)[0])
    finally:
        c.close()


def agree(repo: Path, srv, unit: str, fallback: str | None = None) -> None:
    """releases.json, the configs and the live server all say ``unit`` serves: it is current and loaded, the BLS
    (config, route.json, and a request's precision_path) calls it, and the ensemble is loaded on it exactly when it is
    an engine unit (the ensemble cannot call an LLM-API unit: release_state.ensemble_serves); ``fallback``: releases.json's
    warm fallback, loaded."""
    st = release_state.read_state(repo)
    assert st["current"] == unit and "rollout" not in st
    assert release_configs.configs_agree(repo, unit)
    loaded = srv.loaded_models()
    assert loaded.get(unit) == "READY"
    if fallback:
        assert (st["fallback"], st["warm_fallback"], loaded.get(fallback)) == (fallback, True, "READY")
    engine = pack.is_unit(unit)
    assert (loaded.get("ensemble") == "READY") is engine
    assert release_state.serving_models(repo, st) == [m for m in release_state.serving_models(repo, st)
                                                       if m != "ensemble" or engine]
    path = _bls_path(srv)
    assert (path["unit"], path["serving_route"], path["route"]) == (unit, "engine" if engine else "llm_api", "stable")
    rec = next(r for r in st["releases"] if r["unit"] == unit and r["kind"] == "release")
    assert rec["serving_route"] == path["serving_route"]
    if not engine:  # provenance: checkpoint key + rendered config key + runtime version
        assert len(rec["provenance"]["checkpoint_key"]) == 64 and len(rec["provenance"]["config_key"]) == 64
        assert rec["provenance"]["runtime"] == "tensorrt_llm 1.2.1"


def load_generator():
    """benchmarks/_load.py, the project's client load (``ClientLoad``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_load", REPO_ROOT / "benchmarks" / "_load.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class RoutedLoad:
    """2 clients of the project's load generator sending ``LOAD_MIX`` through the BLS (1 new token each); every answer
    is recorded as (phase when sent, phase when answered, kind, route, unit, route_rule, route_reason, ms) from its
    ``precision_path``. ``phase`` is set by the test while nothing changes (None during a promote, a rollout's switches,
    its probe, a rollback), so a request with the same phase at both ends was routed inside that phase."""

    def __init__(self, srv):
        self.phase, self.seen, self.turn = None, [], iter(range(10**9))
        self.load = load_generator().ClientLoad(srv.http_url, 2, 100_000, self._send)

    def _send(self, client, _i):
        kind = LOAD_MIX[next(self.turn) % len(LOAD_MIX)]
        text, tier = LOAD_KINDS[kind]
        sent, t0 = self.phase, time.perf_counter()
        r = client.infer("tensorrt_llm_bls", text_request(text, 1), parameters={"precision_tier": tier} if tier else None)
        ms = (time.perf_counter() - t0) * 1e3
        p = json.loads(r.as_numpy("precision_path").reshape(-1)[0])
        self.seen.append((sent, self.phase, kind, p["route"], p["unit"], p.get("route_rule"), p.get("route_reason"), ms))
        return None if r.as_numpy("text_output").reshape(-1)[0] else f"empty text ({kind}, {p['unit']})"

    @property
    def requests(self) -> int:
        return self.load.stats["requests"]

    def served(self, phase: str) -> dict:
        """{(kind, route, unit, route_rule, route_reason): requests} routed inside ``phase``."""
        out: dict = {}
        for sent, answered, kind, route, unit, rule, reason, _ in self.seen:
            if sent == answered == phase:
                out[(kind, route, unit, rule, reason)] = out.get((kind, route, unit, rule, reason), 0) + 1
        return out

    def report(self, phase: str, roles: dict) -> str:
        """What ``phase``'s requests got: per kind the (route, unit's role in ``roles``, rule) and the count, and the
        median client latency (ms) per (route, role, rule) with its count."""
        by: dict = {}
        for sent, answered, kind, route, unit, rule, _, ms in self.seen:
            if sent == answered == phase:
                by.setdefault(f"{route} {roles.get(unit, unit)} {rule or '-'}", {}).setdefault(kind, []).append(ms)
        return "; ".join(f"{k}: " + ", ".join(f"{kind} {len(v)}" for kind, v in sorted(kinds.items()))
                         + f" (median {sorted(sum(kinds.values(), []))[sum(map(len, kinds.values())) // 2]:.0f} ms)"
                         for k, kinds in sorted(by.items()))


def _bls_requests_by_rule(srv) -> dict:
    """{(engine_unit, route, route_rule): value} of the BLS's ``precision_pipeline_requests_total`` (the server's
    /metrics) and {(rule, to): switches} of its signal rules."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(rollout.metrics_url(srv), timeout=30) as r:
        fams = list(text_string_to_metric_families(r.read().decode()))
    req = {(s.labels["engine_unit"], s.labels["route"], s.labels["route_rule"]): s.value for f in fams
           if f.name == "precision_pipeline_requests" for s in f.samples if s.name.endswith("_total")}
    switches = {(s.labels["rule"], s.labels["to"]): s.value for f in fams if f.name == "precision_pipeline_routing_switches"
                for s in f.samples if s.name.endswith("_total")}
    return {"requests": req, "switches": switches}


def test_engine_release_llm_api_rollout_and_rollback_under_load(served, units, probe_set, llm_api_packed, bf16_fallback,
                                                                text_probe_set):
    """Done-when of issues 28 and 31 on the local Triton: 0 failed requests over at least 1,000 through the BLS while
    an engine release is promoted beside a warm BF16 fallback, an LLM-API release packed with a routing table is rolled
    out (steps 50, 100; its probe is the text probe) and rolled back. The rollout changes the routing: before it (no
    table) and during its 50 % step (the stable release's table decides: none) every request goes to the current unit
    or the canary, strict tier and long prompts included; with the LLM-API release current its table sends the strict
    tier and long prompts to the warm fallback and the rest to the LLM-API unit; after the rollback (no table) all go
    to the engine release again. Every response's precision_path is checked against the phase it was routed in;
    releases.json, the configs and the served units agree after each step."""
    from precision_pipeline.serving import release

    repo, srv = served
    llm_repo, llm_unit = llm_api_packed
    before = release_state.read_state(repo)["current"]
    engine = units["stable"] if before != units["stable"].engine_unit else units["healthy"]
    table = routes_table()
    probes, phases, secs = [], {}, {}

    def recording_probe(server, unit, pset):
        t = time.monotonic()
        pr = probe.run_probe(server, unit, pset)
        secs["probe"] = round(time.monotonic() - t, 1)
        probes.append(pr)
        return pr

    load = RoutedLoad(srv)

    def wait_for(n: int, what: str) -> None:
        start, end = load.requests, time.monotonic() + ROUTES_PHASE_LIMIT_S
        t = time.monotonic()
        load.phase = what
        while load.requests - start < n and time.monotonic() < end:
            time.sleep(0.1)
        load.phase = None
        phases[what], secs[what] = load.requests - start, round(time.monotonic() - t, 1)

    def timed(what: str, fn, *a, **kw):
        t, n = time.monotonic(), load.requests
        out = fn(*a, **kw)
        secs[what] = f"{time.monotonic() - t:.1f} s, {load.requests - n} requests"
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rollout, "hold", lambda url, hold_s, poll_s=rollout.HOLD_POLL_S: wait_for(ROUTES_PHASE_REQUESTS, "canary 50 %"))
        fb = timed("fallback", release.set_fallback, repo, bf16_fallback.out_dir, server=srv, warm=True, by="test")["unit"]
        load.load.start()
        t0 = time.monotonic()
        try:
            timed("promote", release.promote, repo, engine.out_dir, server=srv, profile="bf16-h100", promoted_by="test")
            agree(repo, srv, engine.engine_unit, fb)
            wait_for(ROUTES_PHASE_REQUESTS, "engine release")
            res = timed("rollout", rollout.rollout, repo, llm_repo, srv, text_probe_set, steps=(50, 100), hold_s=0,
                        profile="fp8-h100-llmapi", probe_fn=recording_probe)
            assert res.status == "promoted", (res.failed_check, res.numbers)
            agree(repo, srv, llm_unit, fb)
            assert json.loads((repo / llm_unit / pack.ROUTING_FILE).read_text()) == table  # the table came with the unit
            wait_for(max(ROUTES_PHASE_REQUESTS, ROUTES_REQUESTS - ROUTES_PHASE_REQUESTS - load.requests), "llm_api release")
            t = timed("rollback", release.rollback, repo, server=srv, by="test")
            assert t["unit"] == engine.engine_unit
            agree(repo, srv, engine.engine_unit, fb)
            assert not (repo / engine.engine_unit / pack.ROUTING_FILE).exists()
            wait_for(ROUTES_PHASE_REQUESTS, "after rollback")
            seconds = time.monotonic() - t0
        finally:
            load.load.stop()
    stats, metrics = load.load.stats, _bls_requests_by_rule(srv)
    counts = {m: int(v) for (k, m), v in rollout.scrape(rollout.metrics_url(srv)).items()
              if k == "nv_inference_request_success" and v}
    print(f"\n[routes] {stats['requests']} BLS requests, {stats['failed']} failed, {seconds:.1f} s; phases {phases}; "
          f"seconds per step {secs}; per model (Triton success counters, whole module) {counts}; "
          f"probe {probes[0].summary()}")
    roles = {before: "previous", engine.engine_unit: "engine", llm_unit: "llm_api", fb: "bf16-fallback"}
    for ph in phases:
        print(f"[routes] {ph}: {load.report(ph, roles)}")
    print(f"[routes] BLS requests by (unit, route, rule) {metrics['requests']}; signal switches {metrics['switches']}")
    assert stats["failed"] == 0 and stats["requests"] >= ROUTES_REQUESTS, stats["errors"][:3]
    assert min(phases.values()) >= ROUTES_PHASE_REQUESTS

    # every response, phase by phase: which unit served it and by which rule (none without a table)
    kinds = set(LOAD_KINDS)

    def only(phase: str, want) -> dict:
        got = load.served(phase)
        assert {k[0] for k in got} == kinds, (phase, got)  # every kind was sent in the phase
        assert all(k[1:] == want(k[0]) for k in got), (phase, got)
        return got

    engine_only = lambda kind: ("stable", engine.engine_unit, None, None)  # noqa: E731
    only("engine release", engine_only)  # a warm fallback, but no table: strict and long stay on the release
    routed = only("llm_api release", lambda kind: {
        "short": ("stable", llm_unit, "default", "default"),
        "strict": ("fallback", fb, "strict-tier", "tier strict"),
        "long": ("fallback", fb, "long-prompts", f"prompt_tokens 42 > {ROUTES_LONG_TOKENS}")}[kind])
    only("after rollback", engine_only)  # the table left with the LLM-API release
    canary = load.served("canary 50 %")  # the stable release's table decides (none): the candidate's applies at 100 %
    assert set(canary) == {(kind, *unit) for kind in kinds for unit in (("stable", engine.engine_unit, None, None),
                                                                        ("canary", llm_unit, None, None))}, canary
    on = {r: sum(v for k, v in canary.items() if k[1] == r) for r in ("stable", "canary")}
    assert abs(on["canary"] - on["stable"]) <= 5, on  # the BLS's deterministic split: every other request
    assert sum(v for k, v in routed.items() if k[0] == "strict") >= 0.2 * phases["llm_api release"]
    # every answer at all (the phases' and the transitions'): one of the three units; the rules only on the LLM-API release
    assert {(s[3], s[4]) for s in load.seen} <= {("stable", before), ("stable", engine.engine_unit), ("canary", llm_unit),
                                                 ("stable", llm_unit), ("fallback", fb)}
    assert len(load.seen) == stats["requests"]
    # the server's own counters agree: every fallback request was routed there by the table, none by a switch of `busy`
    for rule in ("strict-tier", "long-prompts"):
        assert metrics["requests"][(fb, "fallback", rule)] == sum(1 for s in load.seen if s[5] == rule)
    assert metrics["switches"] == {}  # busy (inflight_requests > 16) never on: 2 clients
    [pr] = probes  # the LLM-API candidate was judged by the text probe: top-1 through text, no KL
    assert pr.summary()["method"] == "text" and pr.kl_p99 is None and "no logits" in pr.checks["kl_p99"]["why"]
    assert pr.passed and pr.tokens >= 20 and pr.checks["top1"]["threshold"] == probe_set.thresholds.top1_min
    assert pr.prompts == 2 and pr.tokens == text_probe_set.gate_numbers()["tokens"] == 97
    assert abs(pr.top1 - pr.gate_same_prompts["top1"]) * pr.tokens <= 2 + 1e-9  # at most 2 tokens apart (the stand-in serves the gated checkpoint); counts, not a float ratio: 2/172 once failed by 2e-17
    assert res.steps[0]["candidate"]["success"] > 0 and res.steps[0]["candidate"]["failure"] == 0
    st = release_state.read_state(repo)
    assert [h["action"] for h in st["history"][-3:]] == ["promote", "rollout", "rollback"]
    assert (st["history"][-2]["to"], st["history"][-1]["from"]) == (llm_unit, llm_unit)
