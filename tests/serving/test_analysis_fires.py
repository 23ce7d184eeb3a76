"""The Argo AnalysisTemplate's conditions judged on planted values (issue 26): the error-rate metric
must fail a canary at 2 % failed requests and pass it at 0.5 %, and each probe metric must fail
beyond the gate threshold and pass at it.

``successCondition`` is an expr-lang expression (Argo Rollouts: ``len(result) > 0 && result[0] <= X``);
it is evaluated here by a translation to Python of exactly the operators the renderer uses. The
error-rate PromQL itself runs in promtool (``promtool test rules``, a recording rule over planted
counters), so both the query's unit (a fraction, not a percentage) and the limit are pinned.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml

from precision_pipeline.serving import monitoring
from tests.serving.test_k8s_policy import _render_argo

PROMTOOL = shutil.which("promtool")


def condition_holds(cond: str, result: list[float]) -> bool:
    """Argo's successCondition on ``result`` (expr-lang: ``len()``, ``&&``, ``||``, comparisons, literals)."""
    assert re.fullmatch(r"[\w\s\[\]().<>=&|!0-9e+-]+", cond), cond
    py = cond.replace("&&", " and ").replace("||", " or ")
    return bool(eval(py, {"__builtins__": {}}, {"len": len, "result": result}))  # noqa: S307 - checked above


@pytest.fixture(scope="module")
def analysis(tmp_path_factory):
    res = _render_argo(tmp_path_factory.mktemp("argo"))
    at = yaml.safe_load((res.out_dir / "analysis-template.yaml").read_text())
    return {m["name"]: m for m in at["spec"]["metrics"]}, res


def test_error_rate_limit_fails_the_canary_above_one_percent(analysis):
    """Planted: ``MAX_ERROR_RATE * 100`` (a percentage limit on a fraction) passes a 2 % error rate."""
    m, _ = analysis
    cond = m["error-rate"]["successCondition"]
    assert monitoring.MAX_ERROR_RATE == 0.01
    assert condition_holds(cond, [0.005]) and condition_holds(cond, [0.01])
    assert not condition_holds(cond, [0.02]) and not condition_holds(cond, [0.5])
    assert condition_holds(cond, [])  # no traffic yet: no data is not a failure


def test_probe_conditions_at_and_beyond_the_gate(analysis):
    m, _ = analysis
    kl, t1 = m["probe-kl-p99"]["successCondition"], m["probe-top1"]["successCondition"]
    assert condition_holds(kl, [0.55]) and not condition_holds(kl, [0.5501]) and not condition_holds(kl, [])
    assert condition_holds(t1, [0.85]) and not condition_holds(t1, [0.8499]) and not condition_holds(t1, [])


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package prometheus)")
def test_error_rate_query_is_a_fraction_of_the_canarys_requests(analysis, tmp_path):
    """The query over planted counters: the canary pods fail 2 of 100 requests a minute (the stable
    pods fail many more, and must not count): the query gives 0.02, and the condition fails."""
    m, _ = analysis
    q = m["error-rate"]["provider"]["prometheus"]["query"].replace("{{args.canary-hash}}", "abc")
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": [{"record": "canary_error_rate", "expr": q}]}]}))
    can, stab = 'rollouts_pod_template_hash="abc",model="tensorrt_llm_x"', 'rollouts_pod_template_hash="old",model="tensorrt_llm_y"'
    tests = {"rule_files": [str(rules)], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [
            {"series": f"nv_inference_request_success{{{can}}}", "values": "0+98x10"},
            {"series": f"nv_inference_request_failure{{{can}}}", "values": "0+2x10"},
            {"series": f"nv_inference_request_success{{{stab}}}", "values": "0+50x10"},
            {"series": f"nv_inference_request_failure{{{stab}}}", "values": "0+50x10"},
        ],
        "promql_expr_test": [{"expr": "canary_error_rate", "eval_time": "5m",
                              "exp_samples": [{"labels": "canary_error_rate", "value": 0.02}]}],
    }]}
    tf = tmp_path / "t.yaml"
    tf.write_text(yaml.safe_dump(tests, sort_keys=False))
    r = subprocess.run([PROMTOOL, "test", "rules", str(tf)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not condition_holds(m["error-rate"]["successCondition"], [0.02])
