"""The accuracy probe: the gate's own metric measured on the live serving path.

A fixed subset of the golden prompts the build's gate scored is sent through the Triton server to an
engine unit (``tensorrt_llm_<h12>``, called directly: the probe judges one engine, not the router).
Each request asks for the unit's **context logits** (tensorrtllm_backend's ``return_context_logits``
input, ``context_logits`` output ``[batch, input_len, vocab]`` FP32; the real backend returns them
only for an engine built with ``trtllm-build --gather_context_logits``, profile
``build.gather_context_logits: true``, and a unit config with ``logits_datatype`` TYPE_FP32). The
answer positions are scored against the FP32 reference the gate stored (the reference cache entry
named by the gate's ``metrics.json`` ``reference_cache.key``: final hidden states, multiplied by the
FP32 lm_head) with the gate's own per-token code (``gate.metrics.token_metrics``):
KL(P_ref || P_engine) P99 and mean (nats, pooled over answer tokens) and top-1 agreement.

An **LLM-API unit** (``llm_api_<h12>``, the llm_api serving route) returns text only, no logits (``KL_NOT_MEASURED``),
so it is judged by ``run_text_probe`` instead: the gate's top-1 agreement with the FP32 reference, teacher-forced
through text (each answer row's context sent as text, one greedy token back, compared with the reference's top-1
token's text), against the profile's ``top1_min``; KL is reported as not measured, and a probe that cannot judge
(no ``top1_min``, no row a text can carry) is not passed. Results say which (``method``: ``context_logits`` | ``text``).

Public API (``invoke rollout`` uses it at each step; ``invoke probe`` may reuse it):

* ``load_probe_set(gate_dir, prompts=4, thresholds=None) -> ProbeSet``: prompts, reference logits,
  the gate's own per-token numbers for the same prompts, thresholds (default: the gate's, i.e. the
  profile's gate section for this model);
* ``run_probe(server, unit, probe_set) -> ProbeResult``: the numbers, their 95 % bootstrap intervals
  (over prompts, as the gate computes them), the checks ``kl_p99 <= kl_p99_max`` and
  ``top1 >= top1_min``, ``passed``;
* ``engine_context_logits(server, unit, input_ids, end_id)``: one prompt's ``[T, vocab]`` logits;
* ``ProbeExporter(port)``: the probe's results as Prometheus metrics on its own HTTP port (``invoke
  probe --every N --metrics-port M``). Triton's python-backend metrics API (``pb_utils.MetricFamily``)
  exists only inside a model running in the server, and nothing outside can write into Triton's
  ``/metrics``, so the probe (a client) exports on its own endpoint: scrape both. Names: ``PROBE_GAUGES``,
  ``precision_pipeline_probe_runs_total{result}``, ``PROBE_LAST_RUN``; labels ``profile``, ``engine_unit``, ``route``
  (``PROBE_LABELS``);
* ``route_units(repo_dir) -> {unit: route}``: the units the current release's routing table reaches (the primary
  and the warm fallback) with the rules that reach each; ``invoke probe`` judges every one of them (issue 31);
* ``probe_and_record(server, unit, probe_set, repo_dir=..., exporter=..., route=...)``: one run, appended to
  releases.json's history (``release.record_probe``) and set on the exporter; when releases.json
  cannot be written (a read-only repository) the record goes to ``elsewhere_path(repo_dir)`` instead
  (``recorded_in``), never lost.

Errors: ``UserError`` when the gate folder has no metrics.json / per-token file or its stored
reference is not in the cache (run the build's gate again); ``RuntimeError`` when the server refuses
or returns logits of the wrong shape (the probe then counts as failed, see serving/rollout.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
import os
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from precision_pipeline.core.errors import UserError
from precision_pipeline.core.store import read_json_safe
from precision_pipeline.spec.profile import GateThresholds

PROBE_METRICS = ("kl_p99", "top1")
"""The metrics the probe checks (threshold fields from ``gate.metrics.CHECKS``)."""
DEFAULT_PROMPTS = 4
RETRY_AFTER_ERROR_S = 30
"""With ``--every N``: a run that errored (the unit not loaded yet, the server unreachable) is retried
after min(N, this many seconds), not N, so a canary's first result does not wait a whole period."""


def next_wait_s(every_s: float, result: dict) -> float:
    """Seconds until the next run of ``invoke probe --every every_s`` after ``result`` (a
    ``probe_and_record`` record's ``probe``): ``every_s``, or min(every_s, ``RETRY_AFTER_ERROR_S``)
    after a run that errored."""
    return min(every_s, RETRY_AFTER_ERROR_S) if "error" in result else every_s
DEFAULT_BOOTSTRAP = 200


@dataclass
class ProbePrompt:
    """One golden prompt of the probe: its token ids, answer positions and the reference logits there."""

    id: str
    category: str
    input_ids: list[int]
    answer: slice                     # positions scored (row t predicts token t + 1)
    ref_logits: Any                   # torch.Tensor [n_answer, vocab] float32
    gate_kl: np.ndarray               # the gate's per-token KL of the build's candidate on this prompt
    gate_top1: np.ndarray
    text_rows: list = field(default_factory=list)
    """The text probe's answer rows (``text_rows``): (row k of ``answer``, the context ids[:answer.start + k + 1] as
    text, the FP32 reference's top-1 token there as the runtime detokenizes it)."""


@dataclass
class ProbeSet:
    prompts: list[ProbePrompt]
    thresholds: GateThresholds
    end_id: int
    gate_dir: Path
    reference_key: str

    def gate_numbers(self) -> dict[str, float]:
        """The gate's own kl_p99 / kl_mean / top1 on exactly these prompts (from its per_token.npz)."""
        kl = np.concatenate([p.gate_kl for p in self.prompts])
        t1 = np.concatenate([p.gate_top1 for p in self.prompts]).astype(np.float64)
        return {"kl_p99": float(np.percentile(kl, 99)), "kl_mean": float(kl.mean()), "top1": float(t1.mean()),
                "tokens": int(kl.size)}


@dataclass
class ProbeResult:
    unit: str
    kl_p99: float
    kl_mean: float
    top1: float
    tokens: int
    prompts: int
    ci95: dict[str, list[float]]
    checks: dict[str, dict[str, Any]]
    passed: bool
    ms: float
    gate_same_prompts: dict[str, float] = field(default_factory=dict)
    per_prompt: list[dict[str, Any]] = field(default_factory=list)
    method: str = "context_logits"
    """``context_logits`` (an engine unit: ``run_probe``) or ``text`` (an LLM-API unit: ``run_text_probe``)."""

    @property
    def failures(self) -> list[str]:
        return [k for k, c in self.checks.items() if c["passed"] is False]

    def summary(self) -> dict[str, Any]:
        return {"unit": self.unit, "kl_p99": self.kl_p99, "kl_mean": self.kl_mean, "top1": self.top1,
                "tokens": self.tokens, "prompts": self.prompts, "ci95": self.ci95, "checks": self.checks,
                "passed": self.passed, "ms": round(self.ms, 1), "gate_same_prompts": self.gate_same_prompts,
                "method": self.method}


def _spread(n_total: int, categories: Sequence[str], n: int) -> list[int]:
    """``n`` prompt indices, one per category in turn (file order), so every category is probed."""
    order: dict[str, list[int]] = {}
    for i, c in enumerate(categories):
        order.setdefault(c, []).append(i)
    out: list[int] = []
    k = 0
    while len(out) < min(n, n_total):
        for idx in order.values():
            if k < len(idx) and len(out) < n:
                out.append(idx[k])
        k += 1
    return sorted(out)


def load_probe_set(gate_dir: Path, prompts: int = DEFAULT_PROMPTS, thresholds: Optional[GateThresholds] = None,
                   cache_root: Optional[Path] = None, model_dir: Optional[Path] = None) -> ProbeSet:
    """The probe's prompts and stored reference for the gate run in ``gate_dir`` (``<build out>/gate``).

    ``prompts``: how many golden prompts (spread over the categories, fixed choice). ``thresholds``:
    default the gate's (metrics.json ``thresholds``). ``model_dir``: the reference model's HF folder
    (tokenizer, lm_head) when it is not at the gate's ``reference_model_dir`` (another machine, a pod;
    env ``PRECISION_PROBE_MODEL_DIR`` too). Raises UserError (see module doc)."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoTokenizer

    from precision_pipeline.gate import reference as gate_reference
    from precision_pipeline.gate.golden import encode_prompt, end_of_turn_id, load_golden

    gate_dir = Path(gate_dir)
    rebuild = "run the build (`invoke build --profile P`) so its gate stores them."
    if not (gate_dir / "metrics.json").is_file() or not (gate_dir / "per_token.npz").is_file():
        raise UserError("gate", f"{gate_dir} has no metrics.json and per_token.npz of a gate run.", rebuild)
    met = read_json_safe(gate_dir / "metrics.json")
    if not isinstance(met, dict):
        raise UserError("gate", f"{gate_dir / 'metrics.json'} is not a gate run's metrics.json (not a JSON object).", rebuild)
    missing = [k for k in ("reference_model_dir", "prompts") if k not in met]
    if missing:
        raise UserError("gate", f"{gate_dir / 'metrics.json'} lacks {', '.join(missing)} (written by an older or "
                        "interrupted gate).", rebuild)
    key = (met.get("reference_cache") or {}).get("key") or ""
    ref = gate_reference.cached_reference(key, cache_root) if key else None
    if ref is None:
        root = gate_reference.reference_cache_dir(cache_root)  # hostile s17c F2: "rebuild" reused the gate and stored nothing
        raise UserError("gate", f"the FP32 reference stored by the gate in {gate_dir} (key {key[:12] or '?'}) is not in "
                        f"the reference cache {root} (a build output copied from another machine or cache).",
                        f"copy {key[:32] or '<key>'}/ from the reference cache of the machine that built it into {root}, "
                        f"or run the gate again: remove {gate_dir} (a rebuild reuses a gate whose folder is there), then "
                        f"`invoke build --profile P --out {gate_dir.parent}`.")
    from_env = not model_dir and bool(os.environ.get("PRECISION_PROBE_MODEL_DIR"))
    model_field = "PRECISION_PROBE_MODEL_DIR" if from_env else "--model"
    model_dir = Path(model_dir or os.environ.get("PRECISION_PROBE_MODEL_DIR") or met["reference_model_dir"])
    model_fix = (f"pass --model DIR (or set PRECISION_PROBE_MODEL_DIR) to the same model, "
                 f"{Path(met['reference_model_dir']).name}, on this machine.")
    if not (model_dir / "config.json").is_file():
        raise UserError(model_field, f"the reference model {model_dir} (its tokenizer and lm_head score the probe) is not "
                        "an HF model folder here.", model_fix)
    try:
        z = np.load(gate_dir / "per_token.npz")
        pidx, z_kl, z_top1 = z["prompt_index"], z["kl"], z["top1"]
    except (OSError, ValueError, KeyError) as e:
        raise UserError("gate", f"{gate_dir / 'per_token.npz'} is not the gate's per-token file ({e}).", rebuild)
    rows = met["prompts"]
    chosen = _spread(len(rows), [r["category"] for r in rows], prompts)
    by_id = {g.id: g for g in load_golden(None)}
    try:
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        lm_w = gate_reference.lm_head_weight(model_dir)
    except (OSError, ValueError, KeyError) as e:
        raise UserError(model_field, f"{model_dir}: cannot load its tokenizer and lm_head ({str(e)[:200]}).", model_fix)
    if ref.hidden and lm_w.shape[-1] != ref.hidden[0].shape[-1]:
        raise UserError(model_field, f"{model_dir} has hidden size {lm_w.shape[-1]}, the gate's reference "
                        f"{ref.hidden[0].shape[-1]}: another model than the gated one.", model_fix)
    out = []
    for i in chosen:
        g = by_id.get(rows[i]["id"])
        if g is None:
            raise UserError("gate", f"golden prompt {rows[i]['id']!r} of {gate_dir} is not in the golden set.",
                            "rebuild the profile with the current golden set.")
        e = encode_prompt(tok, g)
        if len(e.input_ids) != ref.hidden[i].shape[0]:
            raise UserError("gate", f"prompt {e.id}: {len(e.input_ids)} tokens now, {ref.hidden[i].shape[0]} when gated.",
                            "rebuild the profile (tokenizer or golden set changed).")
        a = e.answer_positions
        with torch.inference_mode():
            rl = F.linear(torch.from_numpy(ref.hidden[i][a]), lm_w).contiguous()
        out.append(ProbePrompt(e.id, e.category, list(e.input_ids), a, rl, z_kl[pidx == i], z_top1[pidx == i],
                               text_rows(tok, list(e.input_ids), a, rl.argmax(-1).tolist())))
    thr = thresholds if thresholds is not None else GateThresholds(**met.get("thresholds", {}))
    return ProbeSet(out, thr, int(end_of_turn_id(tok)), gate_dir, key)


def text_rows(tok, ids: Sequence[int], answer: slice, ref_top1: Sequence[int]) -> list[tuple[int, str, str]]:
    """The answer rows a text-only unit can be judged on (``run_text_probe``): row k (position t = answer.start + k,
    which predicts token t + 1) with its context ``ids[:t + 1]`` decoded to text and the reference's top-1 token
    ``ref_top1[k]`` decoded alone without special tokens, as the runtime detokenizes a generated token. A row is left
    out when that text would not reach the model as those ids (``tok(text).input_ids``: the LLM API tokenizes a text
    prompt with ``add_special_tokens`` true, its SamplingParams default -- TensorRT-LLM
    ``tensorrt_llm/inputs/registry.py`` ``DefaultInputProcessor``: ``tokenizer.encode(inputs["prompt"],
    add_special_tokens=sampling_params.add_special_tokens)``), or when the reference token is not a whole character
    (its text holds U+FFFD, so equal texts would not mean equal tokens). The tokens that tokenizer adds to any text
    (``tok("")``: SmolLM2's BOS ``<|im_start|>``) are left out of the context text when the ids start with them:
    the runtime adds them again (sent as text, a chat-templated prompt would start with two)."""
    lead = list(tok("").input_ids)
    skip = len(lead) if lead and list(ids[:len(lead)]) == lead else 0
    out = []
    for k, t in enumerate(range(answer.start, answer.stop)):
        ctx = tok.decode(list(ids[skip:t + 1]), skip_special_tokens=False)
        want = tok.decode([int(ref_top1[k])], skip_special_tokens=True)
        if "\ufffd" not in want and list(tok(ctx).input_ids) == list(ids[:t + 1]):
            out.append((k, ctx, want))
    return out


KL_NOT_MEASURED = ("not measured: the LLM-API model returns text only, no logits (TensorRT-LLM "
                   "triton_backend/all_models/llmapi/tensorrt_llm/1/model.py @044a90d, TritonPythonModel._create_response, "
                   "about lines 628-675 of that copy: text_output from output.text, then only finish_reason / stop_reason / "
                   "cumulative_logprob and perf metrics when asked; the context_logits and generation_logits its docstring "
                   "lists are never sent)")


def run_text_probe(server, unit: str, probe_set: ProbeSet, *, bootstrap: int = DEFAULT_BOOTSTRAP, seed: int = 0) -> ProbeResult:
    """The probe of an LLM-API unit (text in, text out: ``KL_NOT_MEASURED``). What it checks: the gate's ``top1``
    (teacher-forced top-1 agreement with the FP32 reference) on the answer rows of ``text_rows``: per row, one greedy
    request of 1 token (``release_live.llm_api_text``) with the context as text; the row agrees when the generated text
    is the reference's top-1 token's text. Judged against the profile's ``top1_min`` (the gate's threshold, as the
    engine probe). ``kl_p99`` / ``kl_mean`` are None and their check says why. A probe that cannot judge (no
    ``top1_min`` in the bar, or no row a text can carry) is not passed: check ``judged`` fails. A server error is a
    RuntimeError (as ``run_probe``)."""
    from tritonclient.utils import InferenceServerException

    from precision_pipeline.gate import metrics as gm
    from precision_pipeline.serving.release_live import llm_api_text

    t0 = time.perf_counter()
    t1s, gate, per = [], [], []
    c = server.http_client()
    try:
        for p in probe_set.prompts:
            if not p.text_rows:
                continue
            try:
                got = np.array([llm_api_text(c, unit, ctx, 1) == want for _k, ctx, want in p.text_rows], np.float64)
            except (InferenceServerException, ConnectionError) as e:
                raise RuntimeError(f"probe of {unit}: {type(e).__name__}: {str(e)[:300]}") from None
            t1s.append(got)
            gate.append(np.asarray(p.gate_top1)[[k for k, _c, _w in p.text_rows]].astype(np.float64))
            per.append({"id": p.id, "tokens": int(got.size), "top1": float(got.mean()), "rows_of_answer": len(p.gate_top1)})
    finally:
        c.close()
    n = int(sum(g.size for g in t1s))
    top1 = float(np.concatenate(t1s).mean()) if n else None
    thr = probe_set.thresholds.top1_min
    checks: dict[str, dict[str, Any]] = {
        "kl_p99": {"value": None, "threshold": probe_set.thresholds.kl_p99_max, "op": "<=", "passed": None,
                   "why": KL_NOT_MEASURED},
        "top1": {"value": top1, "threshold": thr, "op": ">=",
                 "passed": None if thr is None or top1 is None else top1 >= thr}}
    if checks["top1"]["passed"] is None:
        checks["judged"] = {"value": n, "threshold": None, "op": None, "passed": False,
                            "why": "the bar has no top1_min" if thr is None else "no answer row can be sent as text"}
    gate_same = {"top1": float(np.concatenate(gate).mean()) if n else None, "tokens": n}
    return ProbeResult(unit, None, None, top1, n, len(t1s),  # type: ignore[arg-type]  # no KL on this route
                       {"top1": list(gm.bootstrap_ci(t1s, np.mean, bootstrap, seed))}, checks,
                       checks["top1"]["passed"] is True, (time.perf_counter() - t0) * 1e3, gate_same, per, method="text")


def engine_context_logits(server, unit: str, input_ids: Sequence[int], end_id: int, client=None):
    """``[T, vocab]`` float32 context logits of one prompt from engine unit ``unit`` (one new token
    generated, as the engine gate does). Raises RuntimeError on an error or a wrong shape."""
    import torch
    import tritonclient.http as hc

    c = client or server.http_client()
    try:
        ins = []
        for name, arr in (("input_ids", np.array([list(input_ids)], np.int32)),
                          ("input_lengths", np.array([[len(input_ids)]], np.int32)),
                          ("request_output_len", np.array([[1]], np.int32)),
                          ("end_id", np.array([[end_id]], np.int32)), ("pad_id", np.array([[end_id]], np.int32))):
            t = hc.InferInput(name, list(arr.shape), "INT32")
            t.set_data_from_numpy(arr)
            ins.append(t)
        flag = hc.InferInput("return_context_logits", [1, 1], "BOOL")
        flag.set_data_from_numpy(np.array([[True]]))
        ins.append(flag)
        try:
            r = c.infer(unit, ins, outputs=[hc.InferRequestedOutput("context_logits", binary_data=True)])
        except Exception as e:
            raise RuntimeError(f"probe of {unit}: {type(e).__name__}: {str(e)[:300]}") from None
        cl = r.as_numpy("context_logits")
    finally:
        if client is None:
            c.close()
    if cl is None or cl.ndim != 3 or cl.shape[0] != 1 or cl.shape[1] < len(input_ids):
        raise RuntimeError(f"probe of {unit}: context_logits {None if cl is None else cl.shape}, expected "
                           f"[1, {len(input_ids)}, vocab] (engine built without --gather_context_logits?)")
    return torch.from_numpy(np.ascontiguousarray(cl[0, :len(input_ids)], dtype=np.float32))


def run_probe(server, unit: str, probe_set: ProbeSet, *, bootstrap: int = DEFAULT_BOOTSTRAP, seed: int = 0) -> ProbeResult:
    """Score engine unit ``unit`` on ``probe_set`` through ``server`` (module doc); an LLM-API unit (text only) is
    scored by ``run_text_probe``. Never raises for a bad engine: a wrong answer is a failed check; a server error
    propagates (RuntimeError)."""
    from precision_pipeline.gate import metrics as gm
    from precision_pipeline.serving import llmapi_unit

    if llmapi_unit.is_llm_api_unit(unit):
        return run_text_probe(server, unit, probe_set, bootstrap=bootstrap, seed=seed)

    t0 = time.perf_counter()
    kls, t1s, per = [], [], []
    c = server.http_client()
    try:
        for p in probe_set.prompts:
            cl = engine_context_logits(server, unit, p.input_ids, probe_set.end_id, client=c)
            m = gm.token_metrics(p.ref_logits, cl[p.answer])
            kls.append(m.kl)
            t1s.append(m.top1.astype(np.float64))
            per.append({"id": p.id, "tokens": int(m.kl.size), "kl_mean": float(m.kl.mean()), "top1": float(m.top1.mean())})
    finally:
        c.close()
    kl = np.concatenate(kls)
    top1 = np.concatenate(t1s)
    values = {"kl_p99": float(np.percentile(kl, 99)), "kl_mean": float(kl.mean()), "top1": float(top1.mean())}
    ci = {"kl_p99": list(gm.bootstrap_ci(kls, lambda x: float(np.percentile(x, 99)), bootstrap, seed)),
          "kl_mean": list(gm.bootstrap_ci(kls, np.mean, bootstrap, seed)),
          "top1": list(gm.bootstrap_ci(t1s, np.mean, bootstrap, seed))}
    checks = {}
    for name in PROBE_METRICS:
        thr_field, op = gm.CHECKS[name]
        thr = getattr(probe_set.thresholds, thr_field)
        v = values[name]
        ok = None if thr is None else (v <= thr if op == "<=" else v >= thr)
        checks[name] = {"value": v, "threshold": thr, "op": op, "passed": ok}
    return ProbeResult(unit, values["kl_p99"], values["kl_mean"], values["top1"], int(kl.size), len(kls), ci, checks,
                       all(c["passed"] is not False for c in checks.values()), (time.perf_counter() - t0) * 1e3,
                       probe_set.gate_numbers(), per)


PROBE_GAUGES = {
    "precision_pipeline_probe_kl_p99": "KL(P_ref || P_engine) P99 over the probe's answer tokens (nats), last run",
    "precision_pipeline_probe_kl_mean": "mean KL over the probe's answer tokens (nats), last run",
    "precision_pipeline_probe_top1": "top-1 agreement with the FP32 reference over the answer tokens, last run",
    "precision_pipeline_probe_kl_p99_threshold": "the profile's gate threshold kl_p99_max (nats)",
    "precision_pipeline_probe_top1_threshold": "the profile's gate threshold top1_min",
    "precision_pipeline_probe_passed": "1 when the last run passed every check, else 0",
    "precision_pipeline_probe_duration_seconds": "wall time of the last run",
    "precision_pipeline_probe_tokens": "answer tokens scored by the last run",
}
PROBE_LABELS = ("profile", "engine_unit", "route")
"""``route``: the routing rules whose requests the unit serves (``route_units``: rule names joined by ``,``, ``all``
without a routing table, empty when the unit was named by hand and serves no route); the alerts name it."""
ALL_ROUTES = "all"


def route_units(repo_dir: Path) -> dict[str, str]:
    """{unit: route} of the serving repository ``repo_dir`` (beside its releases.json), the units ``invoke probe``
    judges: the current release's unit and, when its ``routing.json`` sends requests to the fallback, releases.json's
    ``fallback`` unit, each with the names of the rules that reach it, joined by ``,`` in table order (``ALL_ROUTES``
    for the current unit without a table). As the BLS decides (``tensorrt_llm_bls/1/model.py`` ``_choose``): a table
    with problems is ignored (every request to the current unit), and ``fallback`` rules without a fallback unit in
    releases.json reach the current unit. {} without releases.json. UserError as ``release_state.read_state``."""
    import json

    from precision_pipeline.serving import pack, release_state
    from precision_pipeline.spec.routing import evaluator

    state = release_state.read_state(repo_dir)
    if not state:
        return {}
    current, fallback = state["current"], state.get("fallback")
    try:
        table = json.loads((Path(repo_dir) / current / pack.ROUTING_FILE).read_text())
        rules = table["rules"] if not evaluator().table_problems(table) else None
    except (OSError, ValueError, TypeError, KeyError):
        rules = None
    if not rules:
        return {current: ALL_ROUTES}
    out: dict[str, list[str]] = {}
    for r in rules:
        out.setdefault(fallback if r["target"] == "fallback" and fallback else current, []).append(r["name"])
    return {u: ",".join(names) for u, names in sorted(out.items(), key=lambda kv: kv[0] != current)}
PROBE_METRIC_NAMES = {"kl_p99": "precision_pipeline_probe_kl_p99", "top1": "precision_pipeline_probe_top1"}
"""The gauges of the checked metrics (``PROBE_METRICS``): the AnalysisTemplate and PrometheusRule (serving/deploy.py) query them."""
PROBE_LAST_RUN = "precision_pipeline_probe_last_run_timestamp_seconds"


class ProbeExporter:
    """The probe's results on ``http://ADDR:PORT/metrics`` (prometheus_client, its own registry).

    ``port=None``: no HTTP server (``registry`` can still be rendered, e.g. in tests). A port that cannot be bound
    (in use, privileged) is a UserError on ``--metrics-port`` (exit 2), before any probe runs."""

    def __init__(self, port: Optional[int] = None, addr: str = "0.0.0.0"):
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = CollectorRegistry()
        self.gauges = {n: Gauge(n, h, PROBE_LABELS, registry=self.registry) for n, h in PROBE_GAUGES.items()}
        self.runs = Counter("precision_pipeline_probe_runs", "probe runs by result (pass, fail, error)", (*PROBE_LABELS, "result"),
                            registry=self.registry)
        self.last = Gauge(PROBE_LAST_RUN, "Unix time the last run finished (any result)",
                          PROBE_LABELS, registry=self.registry)
        self.server = None
        if port is not None:
            from prometheus_client import start_http_server

            try:
                self.server, _ = start_http_server(int(port), addr=addr, registry=self.registry)
            except OSError as e:
                raise UserError("--metrics-port", f"the probe's metrics endpoint cannot listen on {addr}:{port} "
                                f"({e.strerror or e}); no probe was run.",
                                "pass a free port (`ss -ltn` lists the ones in use), or leave --metrics-port out.") from None

    def observe(self, profile: str, unit: str, result: Optional[ProbeResult], error: Optional[str] = None,
                route: str = "") -> None:
        lab = {"profile": profile, "engine_unit": unit, "route": route}
        if result is None:
            self.runs.labels(**lab, result="error").inc()
        else:
            thr = {k: c["threshold"] for k, c in result.checks.items()}
            vals = {"precision_pipeline_probe_kl_p99": result.kl_p99, "precision_pipeline_probe_kl_mean": result.kl_mean,
                    "precision_pipeline_probe_top1": result.top1, "precision_pipeline_probe_passed": float(result.passed),
                    "precision_pipeline_probe_duration_seconds": result.ms / 1e3, "precision_pipeline_probe_tokens": result.tokens,
                    "precision_pipeline_probe_kl_p99_threshold": thr.get("kl_p99"), "precision_pipeline_probe_top1_threshold": thr.get("top1")}
            for name, v in vals.items():
                if v is not None:
                    self.gauges[name].labels(**lab).set(float(v))
            self.runs.labels(**lab, result="pass" if result.passed else "fail").inc()
        self.last.labels(**lab).set(time.time())

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


def probe_and_record(server, unit: str, probe_set: ProbeSet, *, repo_dir: Optional[Path] = None, profile: str = "",
                     exporter: Optional[ProbeExporter] = None, by: str = "invoke probe", route: str = "") -> dict:
    """One probe run of ``unit``: the result (``ProbeResult.summary()``, or ``{"error": ...}`` when the
    server failed: RuntimeError; with ``route``, the ``route_units`` rules the unit serves, as ``route``) is appended to ``repo_dir``'s releases.json history when given and
    set on ``exporter`` when given; a server that stopped answering (``ServerStopped``) is such an error run too.
    Returns the releases.json record (or the bare summary). Raises UserError (exit 2, nothing probed) when
    ``server`` serves another repository than ``repo_dir`` (``release_live.verify_server``)."""
    from precision_pipeline.serving import release_live, release_state

    if server is not None:  # a run of `probe --every` after one that found the server stopped: it may be back
        server.gone = False
    res: Optional[ProbeResult] = None
    try:
        if repo_dir is not None:  # recorded there: the server must serve it (hostile s8 #101: another's was recorded)
            release_live.verify_server(repo_dir, server)
        res = run_probe(server, unit, probe_set)
        summary = res.summary()
    except (RuntimeError, OSError) as e:  # a run that cannot reach the server (ServerStopped) is a failed run, not a
        summary = {"error": str(e)[:500], "passed": False}  # refused input (hostile s12 F-P); --every goes on
    if route:
        summary["route"] = route
    if exporter is not None:
        exporter.observe(profile, unit, res, summary.get("error"), route=route)
    if repo_dir is not None:
        try:
            return release_state.record_probe(repo_dir, unit, summary, profile=profile, by=by)
        except OSError as e:  # a read-only or full repository: the result is kept elsewhere, not lost
            return record_elsewhere(repo_dir, release_state.probe_record(unit, summary, profile=profile, by=by), e)
    return {"unit": unit, "profile": profile, "probe": summary}


def elsewhere_path(repo_dir: Path) -> Path:
    """Where probe results go when ``repo_dir``'s releases.json cannot be written: one JSON-lines file
    per repository under the cache, ``probe-results/<repository folder>-<h12>.jsonl``."""
    import hashlib

    from precision_pipeline.core.paths import cache_dir

    parent = Path(repo_dir).resolve().parent
    return cache_dir() / "probe-results" / f"{parent.name or 'root'}-{hashlib.sha256(str(parent).encode()).hexdigest()[:12]}.jsonl"


def record_elsewhere(repo_dir: Path, rec: dict, err: OSError) -> dict:
    """Append ``rec`` (a ``release.probe_record``) with ``repo`` and why to ``elsewhere_path(repo_dir)``;
    returns ``rec`` plus ``recorded_in`` (that file) and ``not_recorded`` (why releases.json was not
    written). When that write fails too, ``recorded_in`` is None and the result is only printed."""
    import json

    why = f"{err.strerror or err}: {err.filename or Path(repo_dir).resolve().parent}"
    out = {**rec, "not_recorded": why, "recorded_in": None}
    path = elsewhere_path(repo_dir)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"repo": str(Path(repo_dir).resolve()), "not_recorded": why, **rec}, default=str) + "\n")
        out["recorded_in"] = str(path)
    except OSError:
        pass
    return out


__all__ = ["route_units", "ALL_ROUTES", "PROBE_LABELS", "run_text_probe", "text_rows", "KL_NOT_MEASURED", "elsewhere_path", "record_elsewhere", "RETRY_AFTER_ERROR_S", "next_wait_s", "ProbeExporter", "probe_and_record", "PROBE_GAUGES", "ProbePrompt", "ProbeSet", "ProbeResult", "load_probe_set", "run_probe", "engine_context_logits",
           "PROBE_METRICS"]
