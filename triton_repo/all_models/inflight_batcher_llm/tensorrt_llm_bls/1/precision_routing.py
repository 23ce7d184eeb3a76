"""Per-request precision routing: which warm unit of a release serves one request (the one home of the decision).

Pure Python (standard library only), so the same file decides in three places: the BLS, per request, inside
Triton (``model.py`` beside it imports it); ``invoke route explain`` without a server; and the tests. The
table it reads is rendered from the profile's ``routing`` section by ``precision_pipeline.spec.routing``
(``routing_table``) and packed as the primary unit's ``routing.json`` (serving/pack.py ``ROUTING_FILE``), which the
BLS reads per request (re-read when it changes), so the table travels with the release that serves it.

Table (``version`` 1)::

    {"version": 1, "rules": [{"name": str, "target": "primary" | "fallback", "when": {...}}, ...]}

``when`` holds the rule's conditions, all of which must hold (an empty ``when`` always holds: the default
rule, which is last). Conditions:

* ``tier``: list of str -- the request's ``precision_tier`` parameter is one of them;
* ``prompt_tokens_over``: int -- the prompt has more tokens than this;
* ``max_tokens_over``: int -- the request asks for more new tokens than this;
* ``signal``: {"name": str, "above" | "below": float, "release_below" | "release_above": float,
  "min_dwell_s": float} -- a server signal (``SIGNALS``) with hysteresis: the rule turns *on* when the signal
  goes past ``above`` (or under ``below``) and *off* only when it comes back past the release threshold;
  it switches at most once per ``min_dwell_s`` seconds. An unknown signal value (not measured yet) keeps
  the rule's state. Signal rules keep their state in ``RoutingState`` (one per BLS instance), updated on
  every decision whether or not an earlier rule decides the request.

Rules are tried in order; the first whose conditions hold decides. ``decide`` returns a ``Decision``
(target, rule name, reason in words).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

TABLE_VERSION = 1
TARGETS = ("primary", "fallback")
SIGNALS = {
    "inflight_requests": "requests waiting for the BLS: Triton's nv_inference_pending_request_count of "
                         "tensorrt_llm_bls (its queue depth), scraped from the server's metrics endpoint",
    "kv_cache_utilization": "used / max KV-cache blocks of the primary unit, 0..1 (the tensorrtllm backend's "
                            "nv_trt_llm_kv_cache_block_metrics, scraped from the server's metrics endpoint)",
}
CONDITIONS = ("tier", "prompt_tokens_over", "max_tokens_over", "signal")


@dataclass(frozen=True)
class Decision:
    """The unit (``target``: "primary" or "fallback") that serves a request, the rule that chose it and why."""

    target: str
    rule: str
    reason: str


@dataclass
class _SignalState:
    on: bool = False
    since: Optional[float] = None  # time of the last switch (None: never switched)
    switches: int = 0


@dataclass
class RoutingState:
    """The state of a table's signal rules (hysteresis, dwell), one per BLS instance; ``switches`` counts every
    on/off change, ``last_switch`` is the time of the newest (None before the first)."""

    rules: dict = field(default_factory=dict)

    def of(self, name: str) -> _SignalState:
        return self.rules.setdefault(name, _SignalState())

    @property
    def switches(self) -> int:
        return sum(s.switches for s in self.rules.values())

    @property
    def last_switch(self) -> Optional[float]:
        times = [s.since for s in self.rules.values() if s.since is not None]
        return max(times) if times else None


def table_problems(table: Any) -> list:
    """What is wrong with a routing table (messages; empty: it can be used). The profile's schema
    (``precision_pipeline.spec.routing``) refuses all of this earlier with the field's name; the BLS checks
    again because route.json can be edited by hand."""
    if not isinstance(table, Mapping) or table.get("version") != TABLE_VERSION:
        return [f"routing table: not a mapping with version {TABLE_VERSION}"]
    rules = table.get("rules")
    if not isinstance(rules, list) or not rules:
        return ["routing table: rules must be a non-empty list"]
    out = []
    for i, r in enumerate(rules):
        if not isinstance(r, Mapping) or not isinstance(r.get("name"), str) or r.get("target") not in TARGETS:
            out.append(f"routing rule {i}: needs a name and a target in {TARGETS}")
            continue
        when = r.get("when")
        if not isinstance(when, Mapping) or any(k not in CONDITIONS for k in when):
            out.append(f"routing rule {r['name']!r}: when must be a mapping of {CONDITIONS}")
            continue
        sig = when.get("signal")
        if sig is not None and (not isinstance(sig, Mapping) or sig.get("name") not in SIGNALS
                                or ("above" in sig) == ("below" in sig)):
            out.append(f"routing rule {r['name']!r}: signal needs a name in {tuple(SIGNALS)} and one of above/below")
    if rules and isinstance(rules[-1], Mapping) and rules[-1].get("when"):
        out.append("routing table: the last rule must be the default (no conditions)")
    return out


def _update_signal(name: str, sig: Mapping, signals: Mapping, state: RoutingState, now: float) -> None:
    st = state.of(name)
    value = signals.get(sig["name"])
    if value is None:
        return
    if "above" in sig:
        want = value > sig["above"] if not st.on else not value < sig.get("release_below", sig["above"])
    else:
        want = value < sig["below"] if not st.on else not value > sig.get("release_above", sig["below"])
    if want != st.on and (st.since is None or now - st.since >= float(sig.get("min_dwell_s", 0))):
        st.on, st.since, st.switches = want, now, st.switches + 1


def _holds(rule: Mapping, request: Mapping, signals: Mapping, state: RoutingState) -> Optional[str]:
    """The reason the rule's conditions all hold for this request, else None."""
    when, why = rule["when"], []
    if "tier" in when:
        tier = request.get("tier")
        if tier not in when["tier"]:
            return None
        why.append(f"tier {tier}")
    for key, feature in (("prompt_tokens_over", "prompt_tokens"), ("max_tokens_over", "max_tokens")):
        if key in when:
            n = request.get(feature)
            if n is None or not n > when[key]:
                return None
            why.append(f"{feature} {n} > {when[key]}")
    if "signal" in when:
        sig = when["signal"]
        if not state.of(rule["name"]).on:
            return None
        side = f"> {sig['above']}" if "above" in sig else f"< {sig['below']}"
        why.append(f"{sig['name']} {side} (value {signals.get(sig['name'])})")
    return ", ".join(why) or "default"


def decide(table: Mapping, request: Mapping, signals: Optional[Mapping] = None, state: Optional[RoutingState] = None,
           now: float = 0.0) -> Decision:
    """The unit that serves ``request`` ({"prompt_tokens": int, "max_tokens": int, "tier": str | None}) under
    ``signals`` ({signal name: value}, ``SIGNALS``) at time ``now`` (seconds, monotonic), updating ``state``
    (the signal rules' hysteresis; a fresh one when None). Raises ValueError for a table with problems
    (``table_problems``)."""
    problems = table_problems(table)
    if problems:
        raise ValueError("; ".join(problems))
    signals = signals or {}
    state = state if state is not None else RoutingState()
    for rule in table["rules"]:
        if "signal" in rule["when"]:
            _update_signal(rule["name"], rule["when"]["signal"], signals, state, now)
    for rule in table["rules"]:
        why = _holds(rule, request, signals, state)
        if why is not None:
            return Decision(rule["target"], rule["name"], why)
    raise ValueError("routing table: no rule matched (the last rule must be the default)")  # unreachable when checked


def has_signals(table: Mapping) -> bool:
    """True when a (checked) table has a signal rule: the BLS then scrapes the server's metrics."""
    return any("signal" in r["when"] for r in table["rules"])


_SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
PENDING_FAMILY = "nv_inference_pending_request_count"
"""Triton's gauge of requests awaiting execution per model (Triton's docs/user_guide/metrics.md, "Pending
Request Count"); one sample per model and version."""
KV_FAMILY = "nv_trt_llm_kv_cache_block_metrics"
"""The tensorrtllm backend's KV-cache gauge, label ``kv_cache_block_type`` = used / max / ... (tensorrtllm_backend
inflight_batcher_llm/src/custom_metrics_reporter/custom_metrics_reporter.cc; serving/dashboard.py cites it too)."""


def signals_from_metrics(text: str, bls_model: str, unit: str) -> dict:
    """The server signals (``SIGNALS``) in a Prometheus text exposition of the server's ``/metrics``:
    ``inflight_requests`` = the sum over versions of ``PENDING_FAMILY`` for ``bls_model``; ``kv_cache_utilization``
    = used / max of ``KV_FAMILY`` (samples of ``unit`` when they carry a ``model`` label). A signal the text does
    not carry (a family absent, used or max absent, max 0) is left out: unknown, the rules keep their state."""
    pending, kv = [], {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or m.group(1) not in (PENDING_FAMILY, KV_FAMILY):
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        if m.group(1) == PENDING_FAMILY:
            if labels.get("model") == bls_model:
                pending.append(value)
        elif labels.get("model", unit) == unit:
            kind = labels.get("kv_cache_block_type")
            kv[kind] = kv.get(kind, 0.0) + value
    out = {}
    if pending:
        out["inflight_requests"] = sum(pending)
    if "used" in kv and kv.get("max"):
        out["kv_cache_utilization"] = kv["used"] / kv["max"]
    return out
