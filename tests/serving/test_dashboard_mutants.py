"""serving/dashboard.py pinned (issue 26): the panel grid Grafana draws, the ids it keys panels by, the uid's limit,
and the plan line of the memory-interface panel worked out by hand. Layout facts: Grafana's dashboard JSON model
(docs "JSON model": ``gridPos`` on a 24-column grid, ``h``/``w``/``x``/``y`` in grid units; a panel ``id`` unique in
the dashboard; ``uid`` at most 40 characters)."""

from __future__ import annotations

import pytest

from precision_pipeline.serving import dashboard as D
from tests.serving.test_deploy import make_plan, make_profile

GRID_COLUMNS = 24


@pytest.fixture(scope="module")
def plan_profile():
    prof = make_profile()
    return make_plan(prof), prof


def _cells(p):
    g = p["gridPos"]
    return {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}


def test_panels_tile_the_grid_in_two_columns_with_unique_ids(plan_profile):
    plan, prof = plan_profile
    dash = D.dashboard(plan, prof, "smollm2-fp8")
    panels = dash["panels"]
    assert [p["id"] for p in panels] == list(range(1, 11))
    assert [(p["gridPos"]["x"], p["gridPos"]["y"]) for p in panels] == [
        (0, 0), (12, 0), (0, 8), (12, 8), (0, 16), (12, 16), (0, 24), (12, 24), (0, 32), (12, 32)]
    assert {(p["gridPos"]["w"], p["gridPos"]["h"]) for p in panels} == {(12, 8)}
    seen: set = set()
    for p in panels:  # no two panels overlap, none leaves the 24 columns
        cells = _cells(p)
        assert not cells & seen, p["title"]
        assert max(x for x, _ in cells) < GRID_COLUMNS
        seen |= cells
    assert [p["title"] for p in panels] == [
        "Requests/s by precision path", "Generated tokens/s by precision path", "Probe kl_p99 vs gate threshold",
        "Probe top1 vs gate threshold", "Rollout canary share and fallback", "Probe age",
        "KV-cache blocks (tensorrtllm backend; GPU only)", "GPU memory-interface activity: measured vs plan",
        "Requests/s by routing rule", "Routing signal rules: switches and time since the last"]
    assert [p["fieldConfig"]["defaults"]["unit"] for p in panels] == [
        "reqps", "short", "short", "short", "percent", "s", "short", "percentunit", "reqps", "short"]


def test_uid_and_header(plan_profile):
    plan, prof = plan_profile
    name = "a.b_c" + "x" * 50
    dash = D.dashboard(plan, prof, name)
    assert dash["uid"] == ("a-b-c" + "x" * 50)[:40] and len(dash["uid"]) == 40
    assert dash["title"] == f"{name} precision"
    assert (dash["schemaVersion"], dash["refresh"], dash["time"]) == (39, "30s", {"from": "now-6h", "to": "now"})
    assert dash["tags"] == ["precision-pipeline", plan.profile.name or prof.name]
    assert D.dashboard(plan, prof, "short-name")["uid"] == "short-name"


def test_memory_panel_plan_line_by_hand(plan_profile):
    plan, prof = plan_profile
    panel = D.dashboard(plan, prof, "d")["panels"][7]
    a, b = panel["targets"]
    assert (a["expr"], a["refId"]) == ("avg(DCGM_FI_PROF_DRAM_ACTIVE)", "A")
    per_token = plan.memory.weight_gib_per_gpu * 2**30 / (plan.gpu.bandwidth_gbs * 1e9)
    assert b["refId"] == "B" and b["legendFormat"] == "plan, batch 1 (upper bound)"
    assert b["expr"] == (f'clamp_max(sum(rate(precision_pipeline_tokens_total{{profile="{plan.profile.name or prof.name}",'
                         f'kind="output"}}[5m])) * {per_token:.6g}, 1)')
    assert 0 < per_token < 1e-3  # a 135M model on an H100: microseconds of the full bandwidth a token
    # without a GPU or a memory estimate the plan line is left out (no invented number)
    for update in ({"gpu": None}, {"memory": None}):
        p = D.dashboard(plan.model_copy(update=update), prof, "d")["panels"][7]
        assert [t["refId"] for t in p["targets"]] == ["A"]


def test_probe_panels_carry_the_gate_thresholds(plan_profile):
    plan, prof = plan_profile
    thr = prof.gate.for_model(plan.model.name)
    kl, top1 = D.dashboard(plan, prof, "d")["panels"][2:4]
    assert kl["targets"][1]["legendFormat"] == f"gate threshold (<= {thr.kl_p99_max!r})"
    assert top1["targets"][1]["legendFormat"] == f"gate threshold (>= {thr.top1_min!r})"
    assert top1["targets"][1]["expr"] == f'max(precision_pipeline_probe_top1_threshold{{profile="{plan.profile.name or prof.name}"}})'
    assert [(p["gridPos"]["x"], p["id"]) for p in (kl, top1)] == [(0, 3), (12, 4)]


def test_the_plans_profile_name_labels_the_dashboard(plan_profile):
    """The series are selected by the plan's profile name; a plan without one falls back to the profile's."""
    plan, prof = plan_profile
    other = plan.model_copy(update={"profile": plan.profile.model_copy(update={"name": "as-planned"})})
    d = D.dashboard(other, prof, "d")
    assert d["tags"] == ["precision-pipeline", "as-planned"] and 'profile="as-planned"' in D.expressions(d)[0]
    unnamed = plan.model_copy(update={"profile": plan.profile.model_copy(update={"name": ""})})
    assert D.dashboard(unnamed, prof, "d")["tags"] == ["precision-pipeline", prof.name]
