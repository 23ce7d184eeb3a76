"""The probe judges every route's unit (issue 31): ``probe.route_units`` reads which units the current release's
routing table reaches (the primary and the warm fallback), ``invoke probe`` judges each of them, and a failure (the
console line, releases.json's record, the exporter's series and the alerts built on them) names the route. Fast: no
server (a recording ``run_probe``); the alerts' wording is tested with promtool in test_alerts.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from precision_pipeline.core.errors import UserError

from precision_pipeline.serving import probe
from precision_pipeline.spec.profile import load_profile
from precision_pipeline.spec.routing import routing_table

PRIMARY, FALLBACK = "tensorrt_llm_aaaaaaaaaaaa", "tensorrt_llm_bbbbbbbbbbbb"
ROUTED = routing_table(load_profile("fp8-h100-routed").routing)


def _repo(tmp_path, table=ROUTED, fallback=FALLBACK, warm=True):
    """A serving repository layout: releases.json beside model_repository/, the primary's routing.json."""
    repo = tmp_path / "model_repository"
    for u in (PRIMARY, FALLBACK):
        (repo / u).mkdir(parents=True, exist_ok=True)
    if table is not None:
        (repo / PRIMARY / "routing.json").write_text(json.dumps(table))
    (tmp_path / "releases.json").write_text(json.dumps({
        "current": PRIMARY, "fallback": fallback, "warm_fallback": warm,
        "releases": [{"unit": PRIMARY, "profile": "fp8-h100-routed"}]}))
    return repo


def test_route_units_are_what_the_bls_routes_to(tmp_path):
    repo = _repo(tmp_path)
    assert probe.route_units(repo) == {PRIMARY: "busy,default", FALLBACK: "strict-tier,long-prompts"}
    assert list(probe.route_units(repo)) == [PRIMARY, FALLBACK]  # the primary first
    # no table: the current unit serves every request
    assert probe.route_units(_repo(tmp_path / "plain", table=None)) == {PRIMARY: "all"}
    # a table with problems is ignored by the BLS (every request to the current unit): so here
    broken = {"version": 1, "rules": [{"name": "x", "target": "elsewhere", "when": {}}]}
    assert probe.route_units(_repo(tmp_path / "broken", table=broken)) == {PRIMARY: "all"}
    # fallback rules without a fallback unit reach the primary (the BLS's "releases.json has no fallback unit")
    assert probe.route_units(_repo(tmp_path / "nofb", fallback=None)) == {
        PRIMARY: "strict-tier,busy,long-prompts,default"}
    # every request to the fallback: the primary is not judged as a route's unit
    only = {"version": 1, "rules": [{"name": "default", "target": "fallback", "when": {}}]}
    assert probe.route_units(_repo(tmp_path / "only", table=only)) == {FALLBACK: "default"}
    assert probe.route_units(tmp_path / "none" / "model_repository") == {}


def _result(unit, passed):
    checks = {"kl_p99": {"value": 0.1 if passed else 0.9, "threshold": 0.5, "passed": passed},
              "top1": {"value": 0.9, "threshold": 0.5, "passed": True}}
    return probe.ProbeResult(unit, 0.1 if passed else 0.9, 0.05, 0.9, 30, 4, {}, checks, passed, 12.0)


def test_invoke_probe_judges_every_routes_unit_and_a_failure_names_the_route(tmp_path, monkeypatch, capsys):
    from prometheus_client import generate_latest

    from precision_pipeline.cli import serving as cli
    from precision_pipeline.serving import release_live
    from precision_pipeline.serving.triton_server import TritonServer

    repo = _repo(tmp_path)
    probed = []

    def run_probe(server, unit, pset):
        probed.append(unit)
        return _result(unit, passed=unit == PRIMARY)  # the BF16 fallback fails: its alert must say which requests

    exporters = []
    real_exporter = probe.ProbeExporter
    monkeypatch.setattr(probe, "run_probe", run_probe)
    monkeypatch.setattr(probe, "load_probe_set", lambda *a, **k: "probe-set")
    monkeypatch.setattr(probe, "ProbeExporter", lambda port: exporters.append(real_exporter()) or exporters[-1])
    monkeypatch.setattr(release_live, "verify_server", lambda repo_dir, server: None)
    monkeypatch.setattr(cli, "_recover_for_probe", lambda repo_dir, server, state: [])  # a routes-only stand-in repository
    monkeypatch.setattr(TritonServer, "attach", classmethod(lambda cls, url: SimpleNamespace(http_url=url)))
    assert cli.probe(url="127.0.0.1:1", repo=str(repo), gate=str(tmp_path)) == 3  # one route's unit failed
    assert probed == [PRIMARY, FALLBACK]
    out = capsys.readouterr().out
    assert f"probe {PRIMARY} (route busy,default) (fp8-h100-routed, context_logits)" in out and "-> pass" in out
    assert f"probe {FALLBACK} (route strict-tier,long-prompts) (fp8-h100-routed, context_logits)" in out
    assert out.rstrip().endswith("-> FAIL")
    hist = [h for h in json.loads((tmp_path / "releases.json").read_text())["history"] if h["action"] == "probe"]
    assert [(h["unit"], h["probe"]["route"], h["probe"]["passed"]) for h in hist] == [
        (PRIMARY, "busy,default", True), (FALLBACK, "strict-tier,long-prompts", False)]
    # --unit judges that unit only, still named by its route; every N s: the exporter's series carry the route
    probed.clear()
    assert cli.probe(url="127.0.0.1:1", repo=str(repo), gate=str(tmp_path), unit=FALLBACK, every=60, runs=1) == 0
    assert probed == [FALLBACK]
    text = generate_latest(exporters[-1].registry).decode()
    lab = f'engine_unit="{FALLBACK}",profile="fp8-h100-routed",route="strict-tier,long-prompts"'
    assert f"precision_pipeline_probe_passed{{{lab}}} 0.0" in text
    assert (f'precision_pipeline_probe_runs_total{{engine_unit="{FALLBACK}",profile="fp8-h100-routed",result="fail",'
            'route="strict-tier,long-prompts"} 1.0') in text


def test_probe_unit_of_another_profile_or_not_loaded_is_refused():
    """Hostile s15 F7: ``probe --unit U --profile P`` judged U (built from another profile) against P's reference and
    bar and recorded a false FAIL of the current release; a unit the server had not loaded was exit 3 with Triton's raw
    404. Both are refused (exit 2) before anything is probed or recorded."""
    from precision_pipeline.cli import serving as cli

    state = {"releases": [{"unit": PRIMARY, "profile": "fp8-h100-routed"}, {"unit": FALLBACK, "profile": "bf16-h100"}]}
    loaded = {PRIMARY: "READY", FALLBACK: "UNAVAILABLE"}
    srv = SimpleNamespace(http_url="127.0.0.1:1", loaded_models=lambda: loaded)
    cli._check_probe_unit_fits(srv, PRIMARY, state, "fp8-h100-routed")          # its own profile, loaded: fine
    with pytest.raises(UserError) as ei:
        cli._check_probe_unit_fits(srv, PRIMARY, state, "bf16-h100")
    p = ei.value.problems[0]
    assert p.field == "--unit" and p.reason == (f"{PRIMARY} was built from profile fp8-h100-routed, not bf16-h100: its "
                                                "probe would be judged against bf16-h100's reference outputs and bar, "
                                                "and recorded.")
    assert p.fix == "pass --profile fp8-h100-routed (and --out of its build), or leave --unit out."
    with pytest.raises(UserError, match=f"{FALLBACK} is not loaded on the server at 127.0.0.1:1 \\(UNAVAILABLE\\)"):
        cli._check_probe_unit_fits(srv, FALLBACK, state, "bf16-h100")
    with pytest.raises(UserError, match="tensorrt_llm_000000000000 is not loaded .* \\(unknown to it\\)"):
        cli._check_probe_unit_fits(srv, "tensorrt_llm_000000000000", None, "bf16-h100")


def test_probe_metrics_port_without_every_is_refused(tmp_path):
    """Hostile s15b F15: ``probe --metrics-port P`` without ``--every`` was ignored silently, even with P in use."""
    from precision_pipeline.cli import serving as cli

    with pytest.raises(UserError) as ei:
        cli.probe(url="127.0.0.1:1", repo=str(tmp_path / "none"), unit=PRIMARY, metrics_port=18733)
    assert ei.value.problems[0].field == "--metrics-port"
    assert ei.value.problems[0].reason.startswith("only applies with --every")


def test_a_probe_of_a_unit_the_server_has_not_loaded_is_refused(monkeypatch):
    """Hostile s18b F7: `probe --profile P` whose build's unit is a kept release, not loaded: exit 3 (an accuracy
    failure) with the server's raw 404 and no fix."""
    from types import SimpleNamespace

    from precision_pipeline.cli import serving as cli
    from precision_pipeline.core.errors import UserError

    server = SimpleNamespace(http_url="127.0.0.1:1", loaded_models=lambda: {"tensorrt_llm_bbbbbbbbbbbb": "READY"})
    with pytest.raises(UserError) as ei:
        cli._probe_one(None, server, "tensorrt_llm_aaaaaaaaaaaa", "pset", None, "p", None, "")
    assert ei.value.problems[0].reason.startswith("tensorrt_llm_aaaaaaaaaaaa is not loaded on the server at 127.0.0.1:1")
    assert "nothing was probed" in ei.value.problems[0].reason and "roll back to it" in ei.value.problems[0].fix
