"""Per-request routing (issue 31): the profile's ``routing`` section, the decision file the BLS runs
(``precision_routing.py``), resolve's checks and ``invoke route explain``. Fast: no server, no quantize."""

from __future__ import annotations

import pytest

from precision_pipeline.core.errors import UserError
from precision_pipeline.resolve import plan as P
from precision_pipeline.spec.profile import load_profile
from precision_pipeline.spec.routing import Routing, covers, evaluator, routing_table
from tests.conftest import prof

EV = evaluator()
DEFAULT = {"name": "default", "target": "primary"}
BUSY = {"name": "busy", "target": "primary",
        "signal": {"name": "inflight_requests", "above": 16, "release_below": 8, "min_dwell_s": 30}}
LONG = {"name": "long", "target": "fallback", "prompt_tokens_over": 2048}
STRICT = {"name": "strict", "target": "fallback", "tier": ["strict"]}


def table(*rules, **extra):
    return routing_table(Routing(rules=list(rules), **extra))


def decide(t, signals=None, state=None, now=0.0, **request):
    return EV.decide(t, {"prompt_tokens": 10, "max_tokens": None, "tier": None, **request}, signals, state, now)


# ---------------------------------------------------------------------------------------------
# the decision


def test_first_matching_rule_decides_with_its_reason():
    t = table(STRICT, LONG, {"name": "long-answers", "target": "fallback", "max_tokens_over": 512}, DEFAULT)
    assert decide(t) == EV.Decision("primary", "default", "default")
    assert decide(t, prompt_tokens=2049) == EV.Decision("fallback", "long", "prompt_tokens 2049 > 2048")
    assert decide(t, prompt_tokens=2048).rule == "default"  # over, not at
    assert decide(t, tier="strict", prompt_tokens=5000) == EV.Decision("fallback", "strict", "tier strict")
    assert decide(t, tier="gold").rule == "default"
    assert decide(t, max_tokens=513) == EV.Decision("fallback", "long-answers", "max_tokens 513 > 512")
    assert decide(t, max_tokens=None).rule == "default"  # not asked: the condition does not hold


def test_conditions_of_one_rule_all_hold():
    t = table({"name": "strict-long", "target": "fallback", "tier": ["strict"], "prompt_tokens_over": 100}, DEFAULT)
    assert decide(t, tier="strict", prompt_tokens=101) == EV.Decision("fallback", "strict-long",
                                                                      "tier strict, prompt_tokens 101 > 100")
    assert decide(t, tier="strict", prompt_tokens=100).rule == "default"
    assert decide(t, prompt_tokens=101).rule == "default"


def test_signal_hysteresis_and_dwell_bound_the_switches():
    t = table(BUSY, {**LONG}, DEFAULT)
    st = EV.RoutingState()
    # a load trace (seconds, inflight): up past 16, back into the band 8..16, under 8, spikes inside the dwell
    trace = [(0, 2), (10, 20), (12, 7), (45, 12), (46, 7), (60, 20), (76, 20), (77, 2), (105, 2), (110, 2)]
    seen = [(s, decide(t, {"inflight_requests": v}, st, now=s, prompt_tokens=3000).rule) for s, v in trace]
    assert seen == [(0, "long"), (10, "busy"),
                    (12, "busy"),   # under release_below, but 2 s since the switch (dwell 30 s)
                    (45, "busy"),   # 12 is inside the band 8..16: hysteresis keeps it on
                    (46, "long"),   # under release_below 8, 36 s on: off
                    (60, "long"),   # 20 > 16 but only 14 s since the last switch
                    (76, "busy"),   # exactly the dwell (30 s) since the last switch: on
                    (77, "busy"), (105, "busy"),  # dwell holds it on
                    (110, "long")]  # 34 s: off
    assert st.switches == 4 and st.last_switch == 110


def test_unknown_signal_keeps_the_state():
    t = table(BUSY, DEFAULT)
    st = EV.RoutingState()
    assert decide(t, {"inflight_requests": 40}, st, now=0).rule == "busy"
    assert decide(t, {}, st, now=100).rule == "busy"  # not measured: stays on
    assert decide(t, {"inflight_requests": 1}, st, now=100).rule == "default"


def test_below_signal_rule_with_its_band():
    quiet = {"name": "quiet", "target": "fallback",
             "signal": {"name": "kv_cache_utilization", "below": 0.3, "release_above": 0.6, "min_dwell_s": 1}}
    t = table(quiet, DEFAULT)
    st = EV.RoutingState()
    assert [decide(t, {"kv_cache_utilization": v}, st, now=i * 10).target for i, v in
            enumerate([0.5, 0.2, 0.5, 0.7, 0.4, 0.1])] == ["primary", "fallback", "fallback", "primary", "primary",
                                                          "fallback"]


@pytest.mark.parametrize("bad, words", [
    ({"version": 2, "rules": [{"name": "d", "target": "primary", "when": {}}]}, "version 1"),
    ({"version": 1, "rules": []}, "non-empty"),
    ({"version": 1, "rules": [{"name": "d", "target": "elsewhere", "when": {}}]}, "target"),
    ({"version": 1, "rules": [{"name": "d", "target": "primary", "when": {"colour": 1}}]}, "mapping of"),
    ({"version": 1, "rules": [{"name": "d", "target": "primary", "when": {"prompt_tokens_over": 5}}]}, "default"),
    ({"version": 1, "rules": [{"name": "s", "target": "primary", "when": {"signal": {"name": "gpu_temp", "above": 1}}},
                              {"name": "d", "target": "primary", "when": {}}]}, "signal"),
])
def test_a_hand_edited_table_is_refused_not_guessed(bad, words):
    assert any(words in p for p in EV.table_problems(bad))
    with pytest.raises(ValueError, match=words):
        EV.decide(bad, {"prompt_tokens": 1})


def test_rendered_table_is_what_the_bls_reads():
    r = load_profile("fp8-h100-routed").routing
    t = routing_table(r)
    assert EV.table_problems(t) == []
    assert t == {"version": 1, "rules": [
        {"name": "strict-tier", "target": "fallback", "when": {"tier": ["strict"]}},
        {"name": "busy", "target": "primary", "when": {"signal": {"name": "inflight_requests", "above": 16.0,
                                                                   "release_below": 8.0, "min_dwell_s": 30.0}}},
        {"name": "long-prompts", "target": "fallback", "when": {"prompt_tokens_over": 2048}},
        {"name": "default", "target": "primary", "when": {}}]}


# ---------------------------------------------------------------------------------------------
# the section's schema: total, unambiguous, hysteresis required


def refused(routing: dict) -> str:
    with pytest.raises(UserError) as ei:
        prof("fp8-h100", deployment__warm_fallback=True, routing=routing)
    return str(ei.value)


@pytest.mark.parametrize("rules, words", [
    ([LONG], "must be the default"),
    ([DEFAULT, LONG], "must be the default"),
    ([LONG, DEFAULT, DEFAULT], "unique"),
    ([LONG, {**LONG, "name": "longer", "prompt_tokens_over": 4096}, DEFAULT], "'longer' is unreachable: rule 'long'"),
    ([STRICT, {"name": "strict-long", "target": "primary", "tier": ["strict"], "prompt_tokens_over": 10}, DEFAULT],
     "'strict-long' is unreachable"),
    ([{"name": "tiers", "target": "fallback", "tier": ["strict", "gold"]}, {**STRICT, "name": "s2"}, DEFAULT],
     "'s2' is unreachable"),
    ([DEFAULT, {"name": "d2", "target": "fallback"}], "'d2' is unreachable: the default rule"),
    ([{**BUSY, "signal": {"name": "inflight_requests", "above": 16}}, DEFAULT], "release_below"),
    ([{**BUSY, "signal": {"name": "inflight_requests", "above": 8, "release_below": 8}}, DEFAULT], "less than above"),
    ([{**BUSY, "signal": {"name": "inflight_requests", "below": 8, "release_above": 4}}, DEFAULT],
     "greater than below"),
    ([{**BUSY, "signal": {"name": "inflight_requests", "above": 8, "below": 2}}, DEFAULT], "exactly one"),
    ([{**BUSY, "signal": {"name": "kv_cache_utilization", "above": 80, "release_below": 60}}, DEFAULT], "fraction"),
    ([{**BUSY, "signal": {"name": "inflight_requests", "above": 8, "release_below": 4, "min_dwell_s": 0}}, DEFAULT],
     "min_dwell_s"),
    ([{**LONG, "prompt_tokens_over": "2048"}, DEFAULT], "prompt_tokens_over"),
    ([{**STRICT, "tier": ["Strict!"]}, DEFAULT], "tier"),
    ([{**LONG, "name": "Long Prompts"}, DEFAULT], "name"),
])
def test_ambiguous_partial_or_flapping_rules_are_refused(rules, words):
    assert words in refused({"rules": rules})


def test_covers_is_implication():
    assert covers({}, {"tier": ["a"]})
    assert covers({"prompt_tokens_over": 10}, {"prompt_tokens_over": 10, "tier": ["a"]})
    assert not covers({"prompt_tokens_over": 10}, {"prompt_tokens_over": 9})
    assert not covers({"tier": ["a"]}, {"tier": ["a", "b"]})
    assert not covers({"tier": ["a"]}, {})
    assert not covers({"signal": {"name": "inflight_requests", "above": 1}},
                      {"signal": {"name": "inflight_requests", "above": 2}})


# ---------------------------------------------------------------------------------------------
# resolve: targets are warm units; the FP8-attention advice


def test_fallback_target_needs_a_warm_fallback(default_model_dir):
    p = prof("fp8-h100-routed", deployment__warm_fallback=False)
    with pytest.raises(UserError) as ei:
        P.resolve(p, default_model_dir)
    msg = str(ei.value)
    assert "routing.rules.0.target" in msg and "warm_fallback is false" in msg
    assert "routing.rules.2.target" in msg  # every fallback rule is named, not only the first
    p = prof("fp8-h100-routed", deployment__fallback=None, deployment__warm_fallback=False)
    with pytest.raises(UserError, match="no deployment.fallback is named"):
        P.resolve(p, default_model_dir)


def test_fp8_attention_without_a_long_prompt_rule_is_flagged(default_model_dir):
    plain = P.resolve(prof("fp8-h100", routing={"rules": [STRICT, DEFAULT]}, deployment__warm_fallback=True),
                      default_model_dir)
    w = [x for x in plain.warnings if "routing.rules" in x]
    assert len(w) == 1 and "max_input_len 4,096" in w[0] and "prompt_tokens_over: 2048" in w[0]
    # a long-prompt rule at or under long_context_tokens silences it; one above it does not
    ok = P.resolve(prof("fp8-h100-routed"), default_model_dir)
    assert not [x for x in ok.warnings if "routing.rules" in x]
    late = P.resolve(prof("fp8-h100", deployment__warm_fallback=True,
                          routing={"rules": [{**LONG, "prompt_tokens_over": 3000}, DEFAULT]}), default_model_dir)
    assert [x for x in late.warnings if "routing.rules" in x]
    # s9 hostile round F10: a default that already sends every prompt to the fallback needs no long-prompt rule
    everything = P.resolve(prof("fp8-h100", deployment__warm_fallback=True,
                                routing={"rules": [{"name": "default", "target": "fallback"}]}), default_model_dir)
    assert not [x for x in everything.warnings if "routing.rules" in x]
    # a short max_input_len: nothing is long
    short = P.resolve(prof("fp8-h100", build__max_input_len=2048, deployment__warm_fallback=True,
                           routing={"rules": [STRICT, DEFAULT]}), default_model_dir)
    assert not [x for x in short.warnings if "routing.rules" in x]
    # BF16 attention: nothing to advise
    bf16 = P.resolve(prof("bf16-h100", routing={"rules": [DEFAULT]}), default_model_dir)
    assert not [x for x in bf16.warnings if "routing.rules" in x]


# ---------------------------------------------------------------------------------------------
# invoke route explain


def test_route_explain_long_prompt_to_bf16_short_to_primary(capsys):
    from precision_pipeline.cli.routing import explain

    # issue 31's done-when: the shipped example sends a ~3,000-token prompt to its BF16 unit and a short one to the
    # primary; the fallback it names is the profile's deployment.fallback, a BF16 build (no quantization)
    routed = load_profile("fp8-h100-routed")
    assert routed.deployment.fallback == "bf16-h100" and routed.deployment.warm_fallback is True
    bf16 = load_profile("bf16-h100").quantization
    assert (bf16.dtype, bf16.quant_algo.value, bf16.kv_cache_quant_algo.value) == ("bfloat16", "NO_QUANT", "NONE")
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 300  # ~3,000 tokens
    assert explain("explain", "fp8-h100-routed", prompt=long_prompt) == 0
    out = capsys.readouterr().out.splitlines()
    # counted as the served preprocessing counts (hostile s12 F-B): 3,001 tokens of text + 30 of SmolLM2's template
    assert out[0] == "fallback (bf16-h100) by rule long-prompts: prompt_tokens 3031 > 2048"
    assert out[1].startswith("  request: prompt_tokens 3031 (counted with the tokenizer of SmolLM2-135M-Instruct, its "
                             "chat template included, as the served preprocessing applies it)")
    assert explain("explain", "fp8-h100-routed", prompt="What is the capital of France?") == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "primary (fp8-h100-routed) by rule default: default"
    assert out[1].startswith("  request: prompt_tokens 37 (")
    from transformers import AutoTokenizer

    from precision_pipeline.cli.routing import prompt_token_count
    from precision_pipeline.spec.default_model import model_dir

    tok = AutoTokenizer.from_pretrained(str(model_dir(None)))  # the hostile round's count of "hi" with the template
    want = len(tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True))
    assert prompt_token_count("hi", model_dir(None)) == (want, True) == (31, True)
    explain("explain", "fp8-h100-routed", prompt_tokens=3000, inflight=20)
    assert capsys.readouterr().out.startswith("primary (fp8-h100-routed) by rule busy: inflight_requests > 16.0")
    explain("explain", "fp8-h100-routed", prompt_tokens=5, tier="strict")
    assert capsys.readouterr().out.startswith("fallback (bf16-h100) by rule strict-tier: tier strict")


@pytest.mark.parametrize("flag, value, reason, fix", [
    ("kv_util", "2", "'2' is not a number from 0 to 1.", "pass e.g. --kv-util 0.5."),
    ("kv_util", "-0.1", "'-0.1' is not a number from 0 to 1.", "pass e.g. --kv-util 0.5."),
    ("inflight", "-1", "'-1' is not a number >= 0.", "pass e.g. --inflight 4."),
    ("inflight", "1e309", "'1e309' is not a number >= 0.", "pass e.g. --inflight 4."),  # inf: hostile s12 F-C
    ("inflight", "inf", "'inf' is not a number >= 0.", "pass e.g. --inflight 4."),
])
def test_route_explain_signals_are_bounded_as_the_rules_are(flag, value, reason, fix):
    """Hostile round s11 F6/F7: --kv-util 2 (a utilization of 200 %) was accepted (only >= 0 was checked) although a
    rule's kv_cache_utilization thresholds are fractions (spec/routing.SIGNAL_MAX, one bound for both); the fix line of
    --inflight suggested a fractional count (0.5). 1 is a utilization."""
    from precision_pipeline.cli.routing import explain

    with pytest.raises(UserError) as ei:
        explain("explain", "fp8-h100-routed", prompt_tokens=5, **{flag: value})
    p = ei.value.problems[0]
    assert (p.field, p.reason, p.fix) == ("--" + flag.replace("_", "-"), reason, fix)
    assert explain("explain", "fp8-h100-routed", prompt_tokens=5, kv_util="1") == 0


@pytest.mark.parametrize("kw, field", [
    ({"profile": "fp8-h100", "prompt_tokens": 5}, "--profile"),
    ({"profile": "fp8-h100-routed"}, "--prompt"),
    ({"profile": "fp8-h100-routed", "prompt": "a", "prompt_tokens": 5}, "--prompt"),
    ({"profile": "fp8-h100-routed", "prompt_tokens": 0}, "--prompt-tokens"),
    ({"profile": "fp8-h100-routed", "prompt_tokens": 5, "inflight": -1}, "--inflight"),
    ({"profile": "fp8-h100-routed", "prompt_file": "/nonexistent/x.txt"}, "--prompt-file"),
])
def test_route_explain_refuses_bad_flags(kw, field):
    from precision_pipeline.cli.routing import explain

    with pytest.raises(UserError) as ei:
        explain("explain", **kw)
    assert ei.value.problems[0].field == field
    with pytest.raises(UserError, match="not a route action"):
        explain("describe", "fp8-h100-routed", prompt_tokens=5)


def test_route_explain_says_what_the_engine_does_past_its_limits():
    """Hostile s15b F10: a 750,030-token prompt was explained as "served by fallback", and 10 + 999,999,999 tokens as
    primary, without a word that the engine refuses the first and shortens the second."""
    from types import SimpleNamespace

    from precision_pipeline.cli.routing import limit_notes

    lim = SimpleNamespace(max_input_len=4096, max_seq_len=8192)
    [refused] = limit_notes(4097, None, lim, "bf16-h100")
    assert refused == ('  [red]refused by the engine[/]: prompt_tokens 4097 > max_input_len 4096 of bf16-h100 '
                       '(TensorRT-LLM: "Prompt length (4097) exceeds maximum input length (4096).")')
    assert limit_notes(10, 8183, lim, "p") == ["  note: prompt_tokens 10 + max_tokens 8183 > max_seq_len 8192 of p: the "
                                               "engine shortens the output to 8182 tokens"]
    assert limit_notes(4096, 4096, lim, "p") == [] and limit_notes(10, None, lim, "p") == []
