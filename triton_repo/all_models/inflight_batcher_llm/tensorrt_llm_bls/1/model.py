"""tensorrt_llm_bls (Triton python backend): preprocessing -> tensorrt_llm_<h12> -> postprocessing via BLS calls.

The engine model's name comes from the ``tensorrt_llm_model_name`` parameter (tensorrtllm_backend's
name for it), overridden by ``<this model's dir>/route.json`` {"tensorrt_llm_model_name": ...} when
present. build/precision_pipeline/serving/release.py rewrites both when a release is promoted or rolled back: route.json is
checked (stat) on every request, so a running BLS switches engines without being reloaded.

Canary (a gradual rollout, build/precision_pipeline/serving/rollout.py): route.json may also hold
``"canary": {"tensorrt_llm_model_name": <candidate unit>, "percent": P}``; then P of every 100
requests of this BLS instance go to the candidate, spread evenly (a deterministic accumulator, not a
coin flip, so the share per instance is exact to one request). Without "canary" every request goes to
the stable unit. Non-streaming:
one response per request (in decoupled mode it is sent through the response sender with the FINAL flag;
``stream`` = true is refused, this BLS does not stream).

Two kinds of unit (issue 28): an **engine unit** (``tensorrt_llm_<h12>``, the engine route) gets token tensors
(preprocessing -> unit -> postprocessing); an **LLM-API unit** (``llm_api_<h12>``, the llm_api route; TensorRT-LLM's
Triton LLM-API model, build/precision_pipeline/serving/llmapi_contract.py) gets text: one call per row with
``text_input`` [1] (the row's text, as given: that model applies no chat template), ``sampling_param_max_tokens``,
``sampling_param_exclude_input_from_output`` true (as engine units exclude the prompt) and
``return_cumulative_logprob`` true; its ``text_output`` and ``cumulative_logprob`` become this model's
``text_output`` and ``cum_log_probs``. The LLM-API model returns no per-token log probs (no ``output_log_probs``
in such a response) and no token counts (the tokens counter is not incremented for it). route.json may name
either kind as stable or canary, so a release of one route falls back to / rolls out over a release of the other;
the unit's ``precision_path.json`` carries ``serving_route`` (``engine`` when absent, ``llm_api``), and every
response's ``precision_path`` says which unit and which route served it.

Per-request precision routing (issue 31; build/precision_pipeline/spec/routing.py): when the stable unit has a
``routing.json`` (pack writes the profile's ``routing`` table into the unit), every request is decided by
``precision_routing.decide`` (the file beside this one) with the state of its signal rules kept across requests
(one ``RoutingState`` per instance, fresh when the table changes): target ``primary`` = the stable unit (a canary
takes its share of these), ``fallback`` = releases.json's fallback unit (the stable unit when none is recorded,
said in the reason). Features: the longest row's prompt tokens (preprocessing's ``REQUEST_INPUT_LEN``), the
largest ``max_tokens``, the request parameter ``precision_tier``. Signals: the server's own ``/metrics``
(``METRICS_URL_ENV``), scraped by a thread every ``SIGNAL_PERIOD_S`` while the table has a signal rule
(``precision_routing.signals_from_metrics``): this model's own counters cannot see the requests Triton queues for
it. The rule and reason go on the ``precision_path`` output (``route_rule``, ``route_reason``), the span
(``precision.route_rule``, ``precision.route_reason``) and the metric label ``route_rule``.

Precision path (observability): each engine unit carries ``precision_path.json`` (written by
serving/pack.py ``precision_path``: profile, unit, engine_hash, gemm, kv, context_fmha, logits_dtype,
dtype). Every response carries that path of the unit that served it in the output
``precision_path`` (``[batch, 1]`` string: a JSON object of those keys plus ``route`` = ``stable``,
``canary`` or ``fallback``, the last when the unit is releases.json's ``fallback``). An output
tensor, not response parameters: the python backend of Triton 2.51 (this project's server) has no
``parameters`` on ``InferenceResponse``. The ensemble cannot carry it (its outputs come from the
composing models; the real tensorrtllm backend has no such output): ask the BLS. Metrics on the server's own ``/metrics`` through the python-backend
metrics API (``pb_utils.MetricFamily``), beside Triton's per-model counters:

* ``precision_pipeline_requests_total`` (counter; labels ``METRIC_LABELS``): requests answered, by path;
* ``precision_pipeline_request_failures_total`` (counter; same labels): requests that failed after routing;
* ``precision_pipeline_tokens_total`` (counter; ``METRIC_LABELS`` + ``kind`` = ``input`` | ``output``);
* ``precision_pipeline_rollout_canary_percent`` (gauge): the canary share route.json asks for (0 without one);
* ``precision_pipeline_fallback_active`` (gauge): 1 while the stable route is releases.json's fallback unit;
* ``precision_pipeline_routing_switches_total`` (counter; ``rule``, ``to`` = on | off), ``..._routing_last_switch_timestamp_seconds``
  and ``..._routing_rule_active`` (gauges; ``rule``): the signal rules; ``..._routing_signal`` (gauge; ``name``): a
  signal's value at the last decision.

(Triton exposes python-backend counters under the family name as given; the ``_total`` suffix is
part of our names.)

Traces (OpenTelemetry): with the parameter ``otlp_traces_url`` set (the profile's
``deployment.otlp_endpoint`` + ``/v1/traces``, serving/pack.py), every request gets one span, kind
SERVER, scope ``SPAN_SCOPE``, resource ``service.name`` = ``SERVICE_NAME``, exported by the OTel SDK's
``BatchSpanProcessor`` over OTLP/HTTP (protobuf) and flushed when the model is unloaded (``finalize``).
Its attributes come from the same dict as the ``precision_path`` output (``span_attributes``): the
served model as ``gen_ai.request.model``, the engine unit also as ``gen_ai.response.model``, every
other key as ``precision.<key>`` (``precision.profile``, ``precision.unit``, ``precision.engine_hash``,
``precision.gemm``, ``precision.kv``, ``precision.context_fmha``, ``precision.logits_dtype``,
``precision.dtype``, ``precision.route``); plus ``gen_ai.operation.name`` (parameter
``gen_ai_operation_name``: ``chat`` when preprocessing applies the chat template), ``gen_ai.request.max_tokens``
and ``gen_ai.usage.input_tokens`` / ``gen_ai.usage.output_tokens`` (the counts the tokens counter adds).
Names: OpenTelemetry GenAI semantic conventions (``opentelemetry.semconv._incubating.attributes.gen_ai_attributes``,
opentelemetry-semantic-conventions 0.48b0). A failed request's span has status ERROR and ``error.type`` (the
exception's class). When Triton itself traces in OpenTelemetry mode (``--trace-config mode=opentelemetry``),
the span is a child of Triton's request span (``request.trace().get_context()``, W3C ``traceparent``) and the
BLS's calls to preprocessing / the engine / postprocessing carry the same trace. With the URL set and
OpenTelemetry not importable in the stub's interpreter, the model refuses to load (no silent loss of traces).
"""

import json
import os
import stat
import sys
import threading
import time
import urllib.request

import numpy as np
import triton_python_backend_utils as pb_utils

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # precision_routing.py beside this file
import precision_routing  # noqa: E402


def _regular(path):
    """``path`` when it is a regular file; OSError otherwise: opening a FIFO (or a device) in its place would block
    this instance, and so every request, for good (hostile s16 H13: route.json replaced by a FIFO). The callers keep
    what they last read."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise OSError(f"{path} is not a regular file")
    return path


METRIC_LABELS = ("profile", "engine_unit", "engine_hash", "gemm", "kv", "context_fmha", "logits_dtype", "route",
                 "route_rule")
PATH_FILE = "precision_path.json"
ROUTING_FILE = "routing.json"  # = serving/pack.py ROUTING_FILE (a test checks)
TIER_PARAMETER = "precision_tier"  # = spec/routing.py TIER_PARAMETER (a test checks)
MODEL_NAME = "tensorrt_llm_bls"
METRICS_URL_ENV = "PRECISION_PIPELINE_METRICS_URL"  # set by serving/triton_server.py for the port it chose
DEFAULT_METRICS_URL = "http://127.0.0.1:8002/metrics"  # tritonserver's default --metrics-port
SIGNAL_PERIOD_S = 1.0  # how often the signals are scraped (only while the table has a signal rule)
LLM_API_PREFIX = "llm_api_"  # = serving/llmapi_unit.py PREFIX (a test checks)
SPAN_SCOPE = "precision_pipeline.tensorrt_llm_bls"
SERVICE_NAME = "precision-pipeline"  # = serving/triton_server.py TRACE_SERVICE_NAME (Triton's own spans; a test checks)


def span_attributes(served, gen_ai):
    """Span attributes of a served precision path (``precision_path`` output dict, ``route`` included):
    ``model`` -> gen_ai.request.model, ``unit`` -> also gen_ai.response.model, every key -> ``precision.<key>``
    unless it has a gen_ai name. ``gen_ai``: the semconv gen_ai attribute module."""
    out = {}
    for k, v in served.items():
        out[gen_ai.GEN_AI_REQUEST_MODEL if k == "model" else f"precision.{k}"] = v
    if "unit" in served:
        out[gen_ai.GEN_AI_RESPONSE_MODEL] = served["unit"]
    return out


def _param(cfg, key, default=None):
    v = cfg.get("parameters", {}).get(key, {}).get("string_value")
    return default if v is None or v.startswith("${") else v


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        self.trt_name = _param(cfg, "tensorrt_llm_model_name")
        if not self.trt_name:
            raise pb_utils.TritonModelException("tensorrt_llm_bls: parameter tensorrt_llm_model_name is not set")
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(cfg)
        self.route_file = os.path.join(args.get("model_repository", ""), "route.json")
        self.route_mtime = None
        self.canary, self.percent, self.acc = None, 0, 0
        self.repo_dir = os.path.dirname(os.path.abspath(args.get("model_repository", "") or "."))
        self.state_file = os.path.join(os.path.dirname(self.repo_dir), "releases.json")
        self.state_key, self.fallback = None, None
        self.paths, self.metrics = {}, {}
        self.operation = _param(cfg, "gen_ai_operation_name") or "text_completion"
        self._init_tracing(_param(cfg, "otlp_traces_url"))
        self._init_metrics()
        self._init_routing()
        self._read_route()
        self._gauges()

    def _init_metrics(self):
        self.f_req = pb_utils.MetricFamily(name="precision_pipeline_requests_total", kind=pb_utils.MetricFamily.COUNTER,
                                           description="requests answered by the BLS, by precision path and engine unit")
        self.f_fail = pb_utils.MetricFamily(name="precision_pipeline_request_failures_total", kind=pb_utils.MetricFamily.COUNTER,
                                            description="BLS requests that failed after routing, by precision path")
        self.f_tok = pb_utils.MetricFamily(name="precision_pipeline_tokens_total", kind=pb_utils.MetricFamily.COUNTER,
                                           description="tokens through the BLS by precision path (kind: input, output)")
        f_can = pb_utils.MetricFamily(name="precision_pipeline_rollout_canary_percent", kind=pb_utils.MetricFamily.GAUGE,
                                      description="canary share of BLS requests route.json asks for (percent)")
        f_fb = pb_utils.MetricFamily(name="precision_pipeline_fallback_active", kind=pb_utils.MetricFamily.GAUGE,
                                     description="1 while the stable route is the fallback unit of releases.json")
        self.f_switch = pb_utils.MetricFamily(name="precision_pipeline_routing_switches_total", kind=pb_utils.MetricFamily.COUNTER,
                                              description="switches of the routing table's signal rules (to: on, off)")
        self.f_last = pb_utils.MetricFamily(name="precision_pipeline_routing_last_switch_timestamp_seconds",
                                            kind=pb_utils.MetricFamily.GAUGE,
                                            description="Unix time of a signal rule's last switch (time() - it: time since)")
        self.f_active = pb_utils.MetricFamily(name="precision_pipeline_routing_rule_active", kind=pb_utils.MetricFamily.GAUGE,
                                              description="1 while a signal rule is on (its condition holds, hysteresis)")
        self.f_signal = pb_utils.MetricFamily(name="precision_pipeline_routing_signal", kind=pb_utils.MetricFamily.GAUGE,
                                              description="a server signal's value at the last routing decision")
        self.g_canary = f_can.Metric(labels={"model": "tensorrt_llm_bls"})
        self.g_fallback = f_fb.Metric(labels={"model": "tensorrt_llm_bls"})
        self._families = (self.f_req, self.f_fail, self.f_tok, f_can, f_fb, self.f_switch, self.f_last, self.f_active,
                          self.f_signal)

    def _init_tracing(self, url):
        """A TracerProvider of this model with a BatchSpanProcessor exporting to ``url`` over OTLP/HTTP
        (no provider when ``url`` is empty)."""
        self.provider = self.tracer = None
        if not url:
            return
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.semconv._incubating.attributes import gen_ai_attributes
            from opentelemetry.trace import SpanKind, Status, StatusCode
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as e:
            raise pb_utils.TritonModelException(
                f"tensorrt_llm_bls: otlp_traces_url is {url!r} but OpenTelemetry is not importable by the python "
                f"backend ({e}): install requirements.lock's opentelemetry pins in the serving image, or remove "
                "deployment.otlp_endpoint from the profile and re-pack")
        self.gen_ai, self.span_kind, self.Status, self.StatusCode = gen_ai_attributes, SpanKind.SERVER, Status, StatusCode
        self.propagator = TraceContextTextMapPropagator()
        self.provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
        self.tracer = self.provider.get_tracer(SPAN_SCOPE)

    def _parent(self, request):
        """Triton's trace context of ``request`` (its OpenTelemetry mode), or None."""
        try:
            ctx = request.trace().get_context()
        except Exception:
            return None
        if not ctx:
            return None
        try:
            carrier = json.loads(ctx)
        except ValueError:
            carrier = {"traceparent": ctx}
        return self.propagator.extract(carrier) if isinstance(carrier, dict) else None

    def _start_span(self, request):
        if self.tracer is None:
            return None
        span = self.tracer.start_span(self.operation, context=self._parent(request), kind=self.span_kind)
        span.set_attribute(self.gen_ai.GEN_AI_OPERATION_NAME, self.operation)
        return span

    def _path(self, unit):
        """The unit's precision_path.json (cached per unit), with ``unit`` filled in."""
        p = self.paths.get(unit)
        if p is None:
            try:
                with open(_regular(os.path.join(self.repo_dir, unit, PATH_FILE))) as f:
                    p = {str(k): str(v) for k, v in json.load(f).items()}
            except (OSError, ValueError, AttributeError):
                p = {}
            p["unit"] = unit
            p.setdefault("serving_route", "llm_api" if unit.startswith(LLM_API_PREFIX) else "engine")
            self.paths[unit] = p
        return p

    def _fallback(self):
        """releases.json's fallback unit (re-read when the file changes)."""
        try:
            st = os.stat(self.state_file)
            key = (st.st_mtime_ns, st.st_ino, st.st_size)
        except OSError:
            return self.fallback
        if key != self.state_key:
            try:
                with open(_regular(self.state_file)) as f:
                    self.fallback = json.load(f).get("fallback")
                self.state_key = key
            except (OSError, ValueError, AttributeError):
                pass
        return self.fallback

    def _gauges(self):
        self.g_canary.set(float(self.percent if self.canary else 0))
        self.g_fallback.set(1.0 if self.trt_name == self._fallback() else 0.0)

    def _labels(self, unit, route, rule=""):
        p = self._path(unit)
        vals = {**p, "route": route, "route_rule": rule, "engine_unit": unit}
        return {k: vals.get(k, "") for k in METRIC_LABELS}

    def _metric(self, family, labels):
        key = (id(family), tuple(sorted(labels.items())))
        m = self.metrics.get(key)
        if m is None:
            m = self.metrics[key] = family.Metric(labels=labels)
        return m

    def _route(self):
        """The stable unit or, with a canary in route.json, the candidate for its percent of these requests."""
        self._read_route()
        if self.canary and self.percent:
            self.acc += self.percent
            if self.acc >= 100:
                self.acc -= 100
                return self.canary
        return self.trt_name

    def _read_route(self):
        """route.json when it exists (re-read when it changes): the stable unit and the canary; else the parameter."""
        try:
            st = os.stat(self.route_file)
        except OSError:
            st = None
        key = None if st is None else (st.st_mtime_ns, st.st_ino, st.st_size)
        if st is not None and key != self.route_mtime:
            try:
                with open(_regular(self.route_file)) as f:
                    route = json.load(f)
                name = route.get("tensorrt_llm_model_name")
                if name:
                    self.trt_name = name
                can = route.get("canary") or {}
                self.canary = can.get("tensorrt_llm_model_name") or None
                self.percent = max(0, min(100, int(can.get("percent", 0)))) if self.canary else 0
                self.route_mtime = key
            except (OSError, ValueError, TypeError):
                pass

    def _init_routing(self):
        self.table, self.table_key = None, None
        self.rstate = precision_routing.RoutingState()
        self.signals = {}
        self.metrics_url = os.environ.get(METRICS_URL_ENV) or DEFAULT_METRICS_URL
        self.scraper, self.stop_scrape = None, threading.Event()

    def _table(self, unit):
        """The routing table of ``unit`` (the stable release: ``<unit>/routing.json``, re-read when it or the unit
        changes; a new table starts with fresh signal state), or None (no file, or a file with problems: logged,
        every request goes to the stable unit)."""
        path = os.path.join(self.repo_dir, unit, ROUTING_FILE)
        try:
            st = os.stat(path)
            key = (unit, st.st_mtime_ns, st.st_ino, st.st_size)
        except OSError:
            key = (unit, None)
        if key == self.table_key:
            return self.table
        table = None
        if key[1] is not None:
            try:
                with open(_regular(path)) as f:
                    table = json.load(f)
                problems = precision_routing.table_problems(table)
            except (OSError, ValueError) as e:
                problems = [str(e)]
            if problems:
                pb_utils.Logger.log_error(f"tensorrt_llm_bls: {path}: {'; '.join(problems)}; requests go to {unit} "
                                          "until the release's table is fixed")
                table = None
        if table != self.table:
            self.rstate = precision_routing.RoutingState()
        self.table, self.table_key = table, key
        if table and precision_routing.has_signals(table) and self.scraper is None:
            self.scraper = threading.Thread(target=self._scrape_loop, name="routing-signals", daemon=True)
            self.scraper.start()
        return table

    def _scrape_loop(self):
        """Every SIGNAL_PERIOD_S: the server's own metrics -> ``self.signals`` (empty when the scrape fails: unknown
        signals keep the rules' state). The server's, not this model's counters: one BLS instance executes one
        request at a time, so only Triton's scheduler sees the requests queued for it."""
        while True:
            try:
                with urllib.request.urlopen(self.metrics_url, timeout=SIGNAL_PERIOD_S) as r:
                    text = r.read().decode("utf-8", "replace")
                self.signals = precision_routing.signals_from_metrics(text, MODEL_NAME, self.trt_name)
            except Exception:
                self.signals = {}
            if self.stop_scrape.wait(SIGNAL_PERIOD_S):
                return

    def _tier(self, request):
        """The request's ``precision_tier`` parameter (Triton request parameters, JSON text: python_backend
        README, "Request Parameters"), or None."""
        try:
            v = json.loads(request.parameters() or "{}").get(TIER_PARAMETER)
        except (AttributeError, ValueError):
            return None
        return v if isinstance(v, str) else None

    def _choose(self, request, opt, pre):
        """(unit, (rule, reason) or None): the stable release's routing table decides primary or fallback (features:
        the longest row's prompt tokens from preprocessing, the largest max_tokens, the tier); a canary takes its
        share of the requests the table gives the primary (the candidate replaces the primary, not the fallback)."""
        self._read_route()
        table = self._table(self.trt_name)
        if not table:
            return self._route(), None
        feats = {"prompt_tokens": int(np.max(pre["REQUEST_INPUT_LEN"])),
                 "max_tokens": int(np.max(np.asarray(opt("max_tokens")))), "tier": self._tier(request)}
        signals = dict(self.signals)
        before = {n: (st.on, st.switches) for n, st in self.rstate.rules.items()}
        d = precision_routing.decide(table, feats, signals, self.rstate, time.monotonic())
        self._switch_metrics(before, signals)
        if d.target == "primary":
            return self._route(), (d.rule, d.reason)
        fb = self._fallback()
        if not fb:
            return self._route(), (d.rule, d.reason + "; releases.json has no fallback unit: the primary serves it")
        return fb, (d.rule, d.reason)

    def _switch_metrics(self, before, signals):
        for name, value in signals.items():
            self._metric(self.f_signal, {"name": name}).set(float(value))
        for rule, st in self.rstate.rules.items():
            self._metric(self.f_active, {"rule": rule}).set(1.0 if st.on else 0.0)
            if st.switches != before.get(rule, (False, 0))[1]:
                self._metric(self.f_switch, {"rule": rule, "to": "on" if st.on else "off"}).increment(1)
                self._metric(self.f_last, {"rule": rule}).set(time.time())

    @staticmethod
    def _call(model, inputs, outputs, trace=None):
        kw = {} if trace is None else {"trace": trace}  # the parent's Triton trace: child calls join it
        req = pb_utils.InferenceRequest(model_name=model, inputs=inputs, requested_output_names=outputs, **kw)
        resp = req.exec()
        if resp.has_error():
            raise RuntimeError(f"{model}: {resp.error().message()}")
        return {n: pb_utils.get_output_tensor_by_name(resp, n).as_numpy() for n in outputs}

    @staticmethod
    def _token_counts(input_ids, input_lengths, output_ids, sequence_length):
        """(prompt tokens, generated tokens) of one request. output_ids holds the prompt first unless
        the unit excludes it (request input or the unit's ``exclude_input_in_output`` parameter, which
        this model cannot read): a row whose output starts with its whole prompt includes it."""
        ids = np.asarray(input_ids).reshape(len(input_ids), -1)
        lens = np.asarray(input_lengths).reshape(-1)
        out = np.asarray(output_ids).reshape(ids.shape[0], -1)  # [batch, beam 1, len] -> [batch, len]
        seq = np.asarray(sequence_length).reshape(-1)
        n_out = 0
        for i in range(ids.shape[0]):
            n, s = int(lens[i]), int(seq[i])
            has_prompt = s >= n and np.array_equal(out[i, :n], ids[i, :n])
            n_out += s - n if has_prompt else s
        return int(lens.sum()), int(n_out)

    def _one(self, request, span=None):
        def opt(name):
            t = pb_utils.get_input_tensor_by_name(request, name)
            return None if t is None else t.as_numpy()

        stream = opt("stream")
        if stream is not None and bool(np.asarray(stream).reshape(-1)[0]):
            raise ValueError("stream=true is not supported by this BLS model")
        trace = request.trace() if span is not None else None
        if span is not None:
            span.set_attribute(self.gen_ai.GEN_AI_REQUEST_MAX_TOKENS, int(np.asarray(opt("max_tokens")).reshape(-1)[0]))
        pre, trt_in = self._preprocess(opt, trace)  # before the choice (``_preprocess``); an LLM-API unit ignores it
        unit, decision = self._choose(request, opt, pre)
        self._gauges()
        route = "canary" if unit == self.canary and unit != self.trt_name else (
            "fallback" if unit == self.fallback else "stable")
        labels = self._labels(unit, route, decision[0] if decision else "")
        served = {**self._path(unit), "route": route}  # one dict: the precision_path output and the span's attributes
        if decision:
            served["route_rule"], served["route_reason"] = decision
        if span is not None:
            span.set_attributes(span_attributes(served, self.gen_ai))
            if served.get("model"):
                span.update_name(f"{self.operation} {served['model']}")  # GenAI span name: "{operation} {model}"
        try:
            if unit.startswith(LLM_API_PREFIX):
                tensors, counts = self._llm_api(unit, opt, trace), None
            else:
                tensors, counts = self._engine(unit, pre, trt_in, trace)
        except Exception:
            self._metric(self.f_fail, labels).increment(1)
            raise
        self._metric(self.f_req, labels).increment(1)
        if counts is not None:
            n_in, n_out = counts
            self._metric(self.f_tok, {**labels, "kind": "input"}).increment(n_in)
            self._metric(self.f_tok, {**labels, "kind": "output"}).increment(n_out)
            if span is not None:
                span.set_attributes({self.gen_ai.GEN_AI_USAGE_INPUT_TOKENS: n_in, self.gen_ai.GEN_AI_USAGE_OUTPUT_TOKENS: n_out})
        path = json.dumps(served, sort_keys=True).encode()
        batch = int(np.asarray(tensors[0].as_numpy()).shape[0])
        return pb_utils.InferenceResponse(output_tensors=[
            *tensors, pb_utils.Tensor("precision_path", np.array([[path]] * batch, dtype=object))])

    def _llm_api(self, unit, opt, trace):
        """Text in / text out through an LLM-API unit, one call per row (that model takes one 1-D prompt)."""
        texts = np.asarray(opt("text_input"), dtype=object).reshape(-1)
        max_tokens = np.asarray(opt("max_tokens")).reshape(-1)
        out, cum = [], []
        for i, text in enumerate(texts):
            r = self._call(unit, [
                pb_utils.Tensor("text_input", np.array([text], dtype=object)),
                pb_utils.Tensor("sampling_param_max_tokens", np.array([int(max_tokens[min(i, len(max_tokens) - 1)])], np.int32)),
                pb_utils.Tensor("sampling_param_exclude_input_from_output", np.array([True])),
                pb_utils.Tensor("return_cumulative_logprob", np.array([True]))], ["text_output", "cumulative_logprob"], trace)
            out.append([np.asarray(r["text_output"], dtype=object).reshape(-1)[0]])
            c = np.asarray(r["cumulative_logprob"]).reshape(-1)[0]  # the real model sends str(value) as BYTES
            cum.append([float(c.decode() if isinstance(c, bytes) else c)])
        return [pb_utils.Tensor("text_output", np.array(out, dtype=object)),
                pb_utils.Tensor("cum_log_probs", np.array(cum, dtype=np.float32))]

    def _preprocess(self, opt, trace):
        """preprocessing's outputs and the engine unit's input tensors. Run *before* the unit is chosen: the choice
        (route.json) must be as close to the unit's call as possible, since a release switch unloads the previous
        unit right after route.json changes (a request that chose it before preprocessing would find it gone)."""
        pre_in = [pb_utils.Tensor("QUERY", opt("text_input")),
                  pb_utils.Tensor("REQUEST_OUTPUT_LEN", opt("max_tokens").astype(np.int32))]
        for src, dst in (("bad_words", "BAD_WORDS_DICT"), ("stop_words", "STOP_WORDS_DICT"), ("end_id", "END_ID"), ("pad_id", "PAD_ID")):
            v = opt(src)
            if v is not None:
                pre_in.append(pb_utils.Tensor(dst, v))
        pre = self._call("preprocessing", pre_in, ["INPUT_ID", "REQUEST_INPUT_LEN", "REQUEST_OUTPUT_LEN", "STOP_WORDS_IDS",
                                                    "BAD_WORDS_IDS", "OUT_END_ID", "OUT_PAD_ID"], trace)
        trt_in = [pb_utils.Tensor("input_ids", pre["INPUT_ID"]),
                  pb_utils.Tensor("input_lengths", pre["REQUEST_INPUT_LEN"]),
                  pb_utils.Tensor("request_output_len", pre["REQUEST_OUTPUT_LEN"]),
                  pb_utils.Tensor("end_id", pre["OUT_END_ID"]),
                  pb_utils.Tensor("pad_id", pre["OUT_PAD_ID"]),
                  pb_utils.Tensor("stop_words_list", pre["STOP_WORDS_IDS"]),
                  pb_utils.Tensor("bad_words_list", pre["BAD_WORDS_IDS"])]
        for name in ("exclude_input_in_output", "return_log_probs"):
            v = opt(name)
            if v is not None:
                trt_in.append(pb_utils.Tensor(name, v))
        return pre, trt_in

    def _engine(self, unit, pre, trt_in, trace):
        """engine unit -> postprocessing (after ``_preprocess``): (output tensors, (prompt tokens, generated tokens))."""
        trt = self._call(unit, trt_in, ["output_ids", "sequence_length", "cum_log_probs", "output_log_probs"], trace)
        post = self._call("postprocessing", [pb_utils.Tensor("TOKENS_BATCH", trt["output_ids"]),
                                             pb_utils.Tensor("SEQUENCE_LENGTH", trt["sequence_length"])], ["OUTPUT"], trace)
        counts = self._token_counts(pre["INPUT_ID"], pre["REQUEST_INPUT_LEN"], trt["output_ids"], trt["sequence_length"])
        return [pb_utils.Tensor("text_output", post["OUTPUT"]),
                pb_utils.Tensor("cum_log_probs", trt["cum_log_probs"]),
                pb_utils.Tensor("output_log_probs", trt["output_log_probs"])], counts

    def execute(self, requests):
        responses = []
        for request in requests:
            span = self._start_span(request)
            try:
                resp = self._one(request, span)
            except Exception as e:
                resp = pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(f"tensorrt_llm_bls: {e}"))
                if span is not None:
                    span.set_attribute("error.type", type(e).__name__)  # OTel semantic conventions (error.type)
                    span.set_status(self.Status(self.StatusCode.ERROR, str(e)))
            finally:
                if span is not None:
                    span.end()
            if self.decoupled:
                request.get_response_sender().send(resp, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                responses.append(resp)
        return None if self.decoupled else responses

    def finalize(self):
        self.stop_scrape.set()
        if self.scraper is not None:
            self.scraper.join(2 * SIGNAL_PERIOD_S)
        if self.provider is not None:
            self.provider.shutdown()  # flushes the BatchSpanProcessor's queue to the receiver
        self.metrics.clear()  # Metric objects go before their families (python-backend rule)
        self.g_canary = self.g_fallback = None
