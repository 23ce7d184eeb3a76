"""serving/probe.py's text probe, its record and its fallback record pinned without a server (issue 26: the module's
fast tests scored 4/10; the text path was reached only by the slow LLM-API rollout tests). Stand-ins: a character
tokenizer (one id a character, id 1 the BOS every text gets, "xy" encoded as one id 999 from text), a server whose
client answers from a table (``release_live.llm_api_text`` replaced)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from precision_pipeline.serving import probe as P
from precision_pipeline.spec.profile import GateThresholds

BOS, MERGED, BAD = 1, 999, 0xFFFD


class CharTok:
    """``tok(text).input_ids``: BOS then one id per character, "xy" merged into ``MERGED``; ``decode``: the characters
    (BOS as "<s>" unless special tokens are skipped; ``MERGED`` as "xy")."""

    class _Enc:
        def __init__(self, ids):
            self.input_ids = ids

    def __call__(self, text):
        ids, i = [BOS], 0
        while i < len(text):
            if text[i:i + 2] == "xy":
                ids.append(MERGED)
                i += 2
            else:
                ids.append(ord(text[i]))
                i += 1
        return self._Enc(ids)

    def decode(self, ids, skip_special_tokens=False):
        out = []
        for i in ids:
            if i == BOS:
                out.append("" if skip_special_tokens else "<s>")
            else:
                out.append("xy" if i == MERGED else chr(i))
        return "".join(out)


def ids_of(text):
    return [BOS, *(ord(c) for c in text)]


def test_text_rows_by_hand():
    tok = CharTok()
    ids = ids_of("abxyc")  # [BOS, a, b, x, y, c]: "x", "y" apart, as a model generated them
    # rows 0..3 = positions 1..4 (contexts "a", "ab", "abx", "abxy"); reference top-1 per row
    ref = [ord("b"), BAD, ord("y"), ord("c")]
    rows = P.text_rows(tok, ids, slice(1, 5), ref)
    # row 1: the reference token is no whole character (U+FFFD); row 3: "abxy" as text is [BOS, a, b, 999], not the ids
    assert rows == [(0, "a", "b"), (2, "abx", "y")]
    # ids that do not start with the BOS keep their first token in the context text
    assert P.text_rows(tok, ids[1:], slice(0, 2), [ord("b"), ord("x")]) == []  # "a" -> [BOS, a] != [a]


class _Client:
    def close(self):
        self.closed = True


class _Server:
    gone = True

    def __init__(self):
        self.client = _Client()

    def http_client(self):
        return self.client


def _probe_set(rows, gate_top1, top1_min=0.5):
    p = P.ProbePrompt("p0", "facts", ids_of("abcd"), slice(1, 4), None, np.zeros(3), np.asarray(gate_top1), rows)
    return P.ProbeSet([p, P.ProbePrompt("p1", "code", [BOS], slice(0, 0), None, np.zeros(0), np.zeros(0), [])],
                      GateThresholds(top1_min=top1_min, kl_p99_max=0.25), 2, Path("gate"), "k")


@pytest.mark.parametrize("top1_min, passed", [(0.5, True), (0.51, False)])
def test_text_probe_top1_at_the_bar(monkeypatch, top1_min, passed):
    from precision_pipeline.serving import release_live

    answers = {"a": "b", "ab": "q"}  # row 0 agrees, row 1 does not: top1 = 0.5
    monkeypatch.setattr(release_live, "llm_api_text", lambda c, unit, ctx, n: answers[ctx])
    srv = _Server()
    res = P.run_text_probe(srv, "tensorrt_llm_llmapi_x", _probe_set([(0, "a", "b"), (2, "ab", "c")], [1.0, 0.0, 1.0],
                                                                     top1_min), bootstrap=0)
    assert (res.top1, res.tokens, res.prompts, res.method) == (0.5, 2, 1, "text")
    assert res.checks["top1"] == {"value": 0.5, "threshold": top1_min, "op": ">=", "passed": passed}
    assert res.passed is passed and res.failures == ([] if passed else ["top1"])
    assert res.checks["kl_p99"]["value"] is None and res.checks["kl_p99"]["threshold"] == 0.25
    assert res.gate_same_prompts == {"top1": 1.0, "tokens": 2}  # the gate's rows 0 and 2
    assert res.per_prompt == [{"id": "p0", "tokens": 2, "top1": 0.5, "rows_of_answer": 3}]
    assert srv.client.closed


def test_text_probe_without_a_bar_or_rows_is_not_passed(monkeypatch):
    from precision_pipeline.serving import release_live

    monkeypatch.setattr(release_live, "llm_api_text", lambda c, unit, ctx, n: "b")
    res = P.run_text_probe(_Server(), "u", _probe_set([], [1.0, 1.0, 1.0]), bootstrap=0)
    assert res.top1 is None and res.passed is False
    assert res.checks["judged"] == {"value": 0, "threshold": None, "op": None, "passed": False,
                                    "why": "no answer row can be sent as text"}
    ps = _probe_set([(0, "a", "b")], [1.0, 1.0, 1.0])
    ps.thresholds = GateThresholds(kl_p99_max=0.25)
    res = P.run_text_probe(_Server(), "u", ps, bootstrap=0)
    assert (res.top1, res.passed, res.checks["judged"]["why"]) == (1.0, False, "the bar has no top1_min")


def test_probe_and_record_resets_gone_and_keeps_an_error_run(monkeypatch):
    srv = _Server()
    seen = []

    def fake_run(server, unit, pset):
        seen.append(server.gone)
        raise RuntimeError("probe of u: ConnectionError: refused")

    monkeypatch.setattr(P, "run_probe", fake_run)
    rec = P.probe_and_record(srv, "u", None, profile="fp8-h100", route="strict-tier")
    assert seen == [False] and srv.gone is False  # a server found stopped by an earlier run is tried again
    assert rec == {"unit": "u", "profile": "fp8-h100", "probe": {"error": "probe of u: ConnectionError: refused",
                                                                 "passed": False, "route": "strict-tier"}}


def test_record_elsewhere_appends_one_json_line_a_run(tmp_path, monkeypatch):
    from precision_pipeline.core import paths

    monkeypatch.setattr(paths, "cache_dir", lambda: tmp_path / "cache")
    repo = tmp_path / "srv" / "model_repository"
    err = PermissionError(13, "Permission denied", str(repo / "releases.json"))
    out1 = P.record_elsewhere(repo, {"unit": "u", "probe": {"passed": True}}, err)
    out2 = P.record_elsewhere(repo, {"unit": "v"}, OSError(28, "No space left on device"))
    path = P.elsewhere_path(repo)
    assert path.parent == tmp_path / "cache" / "probe-results" and path.name.startswith("srv-")
    why1 = f"Permission denied: {repo / 'releases.json'}"
    assert out1 == {"unit": "u", "probe": {"passed": True}, "not_recorded": why1, "recorded_in": str(path)}
    assert out2["not_recorded"] == f"No space left on device: {repo.resolve().parent}"
    lines = path.read_text().split("\n")
    assert lines[2] == "" and len(lines) == 3
    assert json.loads(lines[0]) == {"repo": str(repo.resolve()), "not_recorded": why1, "unit": "u", "probe": {"passed": True}}
    assert json.loads(lines[1])["unit"] == "v"


def test_context_logits_are_asked_as_binary_data():
    """The logits come back as binary data (a [1, T, V] float32 tensor as JSON would be ~10x the bytes and parsed
    number by number)."""

    class Rec:
        def infer(self, unit, inputs, outputs=None):
            self.asked = [o._get_tensor() for o in outputs]
            self.inputs = {i.name(): i.shape() for i in inputs}

            class R:
                def as_numpy(self, name):
                    return np.zeros((1, 3, 5), np.float32)
            return R()

    c = Rec()
    out = P.engine_context_logits(None, "u", [1, 2, 3], end_id=2, client=c)
    assert tuple(out.shape) == (3, 5)
    assert c.asked == [{"name": "context_logits", "parameters": {"binary_data": True}}]
    assert c.inputs == {"input_ids": [1, 3], "input_lengths": [1, 1], "request_output_len": [1, 1], "end_id": [1, 1],
                        "pad_id": [1, 1], "return_context_logits": [1, 1]}


def test_exporter_gauges_in_their_units():
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    ex = P.ProbeExporter(None)
    res = P.ProbeResult("u", 0.125, 0.0625, 0.75, 40, 2, {}, {"kl_p99": {"threshold": 0.5, "passed": True},
                                                               "top1": {"threshold": 0.7, "passed": True}},
                        True, 1500.0)
    ex.observe("fp8-h100", "u", res, route="strict-tier")
    got = {s.name: s.value for f in text_string_to_metric_families(generate_latest(ex.registry).decode())
           for s in f.samples if s.labels.get("engine_unit") == "u" and "result" not in s.labels}
    want = {"precision_pipeline_probe_kl_p99": 0.125, "precision_pipeline_probe_kl_mean": 0.0625,
            "precision_pipeline_probe_top1": 0.75, "precision_pipeline_probe_passed": 1.0,
            "precision_pipeline_probe_duration_seconds": 1.5, "precision_pipeline_probe_tokens": 40.0,
            "precision_pipeline_probe_kl_p99_threshold": 0.5, "precision_pipeline_probe_top1_threshold": 0.7}
    assert {k: got[k] for k in want} == want


@pytest.mark.parametrize("present", ["metrics.json", "per_token.npz"])
def test_a_gate_folder_with_one_of_its_two_files_is_refused(tmp_path, present):
    from precision_pipeline.core.errors import UserError

    (tmp_path / present).write_text("{}")
    with pytest.raises(UserError, match="has no metrics.json and per_token.npz of a gate run"):
        P.load_probe_set(tmp_path, 2)
