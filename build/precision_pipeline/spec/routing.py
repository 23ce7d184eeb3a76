"""The profile's ``routing`` section: ordered rules that send each request to one of the release's warm units.

A release serves its **primary** unit (this profile's) and, with ``deployment.warm_fallback: true``, keeps its
**fallback** unit (``deployment.fallback``, usually BF16) loaded. Without a ``routing`` section every request
goes to the primary (a canary aside) and the fallback serves nobody until a rollback; with one, the BLS
decides per request::

    routing:
      long_context_tokens: 2048        # what "long" means for the FP8-attention advice (resolve warns)
      rules:                           # tried in order; the first whose conditions all hold decides
        - name: strict-tier
          tier: [strict]               # the request's precision_tier parameter
          target: fallback
        - name: long-prompts
          prompt_tokens_over: 2048
          target: fallback
        - name: busy                   # a server signal, with hysteresis and a minimum dwell time
          signal: {name: inflight_requests, above: 8, release_below: 4, min_dwell_s: 30}
          target: primary
        - name: default                # required, last, no conditions
          target: primary

The decision itself has one home, ``triton_repo/all_models/inflight_batcher_llm/tensorrt_llm_bls/1/
precision_routing.py`` (standard library only: the BLS runs it inside Triton); this module validates the
section (every error names the rule and the field), renders it as that file's table (``routing_table``, which pack writes as the primary unit's
``routing.json``) and loads the file for ``invoke route explain`` (``evaluator``). The rules that need the rest of the profile (a
fallback target needs a warm fallback; the FP8-attention advice) are resolve's (``resolve/rules_fit.py``).

Rules are **total** (the last rule is the default) and **unambiguous**: a rule that an earlier rule covers
(every request it would take, the earlier one takes first: same or weaker conditions) is refused as
unreachable, so the order never hides a rule silently.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from precision_pipeline.core.paths import REPO_ROOT

EVALUATOR_PATH = REPO_ROOT / "triton_repo/all_models/inflight_batcher_llm/tensorrt_llm_bls/1/precision_routing.py"
RULE_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,39}$")
TIER_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")
TIER_PARAMETER = "precision_tier"
"""The request parameter that names a tier (Triton request parameters, as ``precision_tier: "strict"``)."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


SIGNAL_MAX = {"kv_cache_utilization": 1.0}
"""The largest value a signal takes (none: unbounded, e.g. ``inflight_requests``, a count): a rule's thresholds
(``Signal``) and ``invoke route explain``'s steady value (``--kv-util``) are checked against it."""


class Signal(_Section):
    """A server signal with hysteresis: the rule turns on past ``above`` (or under ``below``) and off only back
    past the release threshold, at most once per ``min_dwell_s`` seconds."""

    name: Literal["inflight_requests", "kv_cache_utilization"] = Field(
        description="inflight_requests: requests waiting for the BLS (Triton's pending count of tensorrt_llm_bls, its "
        "queue depth); kv_cache_utilization: used/max KV blocks of the primary (0..1). Both from the server's metrics.")
    above: Optional[float] = Field(None, ge=0, description="On when the signal is greater than this.")
    release_below: Optional[float] = Field(None, ge=0, description="With above: off again when the signal is less "
                                           "than this (< above: the hysteresis band).")
    below: Optional[float] = Field(None, ge=0, description="On when the signal is less than this.")
    release_above: Optional[float] = Field(None, ge=0, description="With below: off again when the signal is greater "
                                           "than this (> below).")
    min_dwell_s: float = Field(30.0, gt=0, le=86400, description="Seconds the rule stays on or off before it may "
                               "switch again (default 30: the brief's 30 s scrape window).")

    @model_validator(mode="after")
    def _band(self) -> "Signal":
        if (self.above is None) == (self.below is None):
            raise ValueError("give exactly one of above / below")
        if self.above is not None:
            if self.release_below is None or self.release_above is not None:
                raise ValueError("a rule on 'above' needs release_below (and no release_above): the hysteresis band "
                                 "that keeps it from flapping")
            if not self.release_below < self.above:
                raise ValueError(f"release_below {self.release_below} must be less than above {self.above}")
        else:
            if self.release_above is None or self.release_below is not None:
                raise ValueError("a rule on 'below' needs release_above (and no release_below): the hysteresis band "
                                 "that keeps it from flapping")
            if not self.release_above > self.below:
                raise ValueError(f"release_above {self.release_above} must be greater than below {self.below}")
        hi = SIGNAL_MAX.get(self.name)
        if hi is not None and max(v for v in (self.above, self.below, self.release_below,
                                              self.release_above) if v is not None) > hi:
            raise ValueError(f"{self.name} is a fraction (0..{hi:g})")
        return self


class RoutingRule(_Section):
    """One rule: its conditions (all must hold; none: the default rule) and the unit it sends the request to."""

    name: str = Field(description="Rule name (label of the precision.route_reason span attribute and metrics).")
    target: Literal["primary", "fallback"] = Field(description="primary: this profile's unit; fallback: the warm "
                                                   "deployment.fallback unit.")
    tier: Optional[list[str]] = Field(None, min_length=1, description=f"The request's {TIER_PARAMETER} parameter is "
                                      "one of these.")
    prompt_tokens_over: Optional[int] = Field(None, ge=1, description="The prompt has more tokens than this.")
    max_tokens_over: Optional[int] = Field(None, ge=1, description="The request asks for more new tokens than this.")
    signal: Optional[Signal] = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not RULE_NAME_RE.match(v):
            raise ValueError("must match [a-z0-9][a-z0-9_-]* (at most 40 characters)")
        return v

    @field_validator("tier")
    @classmethod
    def _tiers(cls, v: Optional[list[str]]) -> Optional[list[str]]:
        if v is not None:
            bad = [t for t in v if not TIER_RE.match(t)]
            if bad:
                raise ValueError(f"tier names must match [a-z0-9][a-z0-9_-]*: {bad}")
            if len(set(v)) != len(v):
                raise ValueError("a tier is listed twice")
        return v

    def conditions(self) -> dict[str, Any]:
        """The rule's conditions as the evaluator's ``when`` mapping (empty for the default rule)."""
        out: dict[str, Any] = {}
        if self.tier is not None:
            out["tier"] = list(self.tier)
        for k in ("prompt_tokens_over", "max_tokens_over"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        if self.signal is not None:
            out["signal"] = self.signal.model_dump(exclude_none=True)
        return out


def covers(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """True when every request that conditions ``b`` admit, conditions ``a`` admit too (so a rule with ``b`` after
    one with ``a`` never decides anything)."""
    for k, v in a.items():
        if k not in b:
            return False
        if k == "tier" and not set(b[k]) <= set(v):
            return False
        if k in ("prompt_tokens_over", "max_tokens_over") and b[k] < v:
            return False
        if k == "signal" and b[k] != v:
            return False
    return True


class Routing(_Section):
    """The ``routing`` section (module docstring)."""

    long_context_tokens: int = Field(2048, ge=1, description="Prompts longer than this are long: resolve warns when "
                                     "the primary's attention or KV cache is FP8 and no rule sends such prompts to the "
                                     "fallback (the brief's advice on FP8 attention at long context).")
    rules: list[RoutingRule] = Field(min_length=1, description="Tried in order; the last is the default (no "
                                     "conditions).")

    @model_validator(mode="after")
    def _total_and_unambiguous(self) -> "Routing":
        names = [r.name for r in self.rules]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"rule names must be unique: {dup} given twice")
        if self.rules[-1].conditions():
            raise ValueError(f"the last rule ({self.rules[-1].name!r}) must be the default: no conditions, only a "
                             "target (every request must be routed)")
        for j, later in enumerate(self.rules):
            for earlier in self.rules[:j]:
                if covers(earlier.conditions(), later.conditions()):
                    what = "the default rule" if not earlier.conditions() else f"rule {earlier.name!r}"
                    raise ValueError(f"rule {later.name!r} is unreachable: {what} comes first and takes every request "
                                     f"it would (move {later.name!r} before it, or narrow {earlier.name!r})")
        return self

    def targets(self) -> set[str]:
        """The units the rules send requests to."""
        return {r.target for r in self.rules}


def routing_table(routing: Routing) -> dict[str, Any]:
    """The evaluator's table (``precision_routing.py``: version 1) for a validated section."""
    ev = evaluator()
    return {"version": ev.TABLE_VERSION, "rules": [{"name": r.name, "target": r.target, "when": r.conditions()}
                                                    for r in routing.rules]}


def evaluator(path: Optional[Path] = None):
    """The decision module (``EVALUATOR_PATH``) loaded as ``precision_routing`` (the same file the BLS runs)."""
    path = path or EVALUATOR_PATH
    mod = sys.modules.get("precision_routing")
    if mod is not None and Path(getattr(mod, "__file__", "")) == path:
        return mod
    spec = importlib.util.spec_from_file_location("precision_routing", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["precision_routing"] = mod  # dataclasses resolve the module by name
    spec.loader.exec_module(mod)
    return mod


__all__ = ["Signal", "RoutingRule", "Routing", "covers", "routing_table", "evaluator", "EVALUATOR_PATH",
           "TIER_PARAMETER"]
