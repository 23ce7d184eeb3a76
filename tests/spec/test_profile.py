"""Profile loader: extends merging, misspelt keys, names, path traversal, cycles, and a fuzz test.

The fuzz test (hypothesis, bounded examples) feeds the loader arbitrary YAML: scalars, lists,
deep nesting, huge and negative numbers, unicode names, ``extends`` chains and cycles, raw
text and raw bytes. The loader must return a Profile or raise ``UserError`` -- never any other
exception.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from precision_pipeline.core.errors import EXIT_INVALID, UserError
from precision_pipeline.spec.profile import Profile, deep_merge, load_profile, shipped_profiles, validate_profile

SHIPPED = ["bf16-h100", "fp8-h100", "fp8-h200", "int4-awq-a100", "int8-sq-l4", "nvfp4-b200"]


def write(dirpath: Path, name: str, data) -> Path:
    p = dirpath / name
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data, allow_unicode=True), encoding="utf-8")
    return p


def err(fn, *a) -> UserError:
    with pytest.raises(UserError) as ei:
        fn(*a)
    assert ei.value.exit_code == EXIT_INVALID
    return ei.value


# ---------------------------------------------------------------------------------------------
# shipped profiles


def test_shipped_profiles_listed_and_load():
    assert set(SHIPPED) <= set(shipped_profiles())
    for name in shipped_profiles():
        p = load_profile(name)
        assert isinstance(p, Profile) and p.name == name


# ---------------------------------------------------------------------------------------------
# extends


def test_deep_merge_rules():
    base = {"a": {"x": 1, "y": [1, 2]}, "b": 1, "c": [1]}
    over = {"a": {"y": [3]}, "c": {"k": 1}, "d": None}
    assert deep_merge(base, over) == {"a": {"x": 1, "y": [3]}, "b": 1, "c": {"k": 1}, "d": None}


def test_shipped_extends_merges_key_by_key():
    child = load_profile("fp8-h200")
    parent = load_profile("fp8-h100")
    assert child.target.gpu == "h200"
    assert child.build.max_batch_size == 128  # overridden
    assert child.build.max_seq_len == parent.build.max_seq_len == 8192  # kept from the parent mapping
    assert child.quantization.quant_algo.value == "FP8"
    assert child.name == "fp8-h200"


def test_extends_lists_and_scalars_replace(tmp_path):
    p = write(tmp_path, "child.yaml", {"extends": "fp8-h100", "quantization": {"exclude_modules": ["*router*"]},
                                       "build": {"max_seq_len": 4096}, "description": "child"})
    prof = load_profile(str(p))
    assert prof.quantization.exclude_modules == ["*router*"]  # list replaced, not appended
    assert prof.quantization.kv_cache_quant_algo.value == "FP8"  # sibling key kept
    assert prof.build.max_seq_len == 4096 and prof.build.max_input_len == 4096
    assert prof.description == "child" and prof.name == "child"


def test_a_gate_field_the_child_sets_holds_over_inherited_overrides(tmp_path):
    """Hostile s12 F-S: a profile extending fp8-h100 with ``gate.kl_p99_max: 0.0001`` built and passed with KL P99
    0.2053: the inherited ``gate.overrides`` entry for the default model (0.55) won, silently. The child's own field
    now replaces that field in the overrides it inherits; fields the child does not set keep the override's value,
    and an override the child restates wins over its own top-level field, as before."""
    fp = "f3d5ee0f917c655e8f439bef6b7d913d54bcbe1452e3804f2a0efc6be8518906"  # the default model's, in fp8-h100
    parent = load_profile("fp8-h100").gate.for_model(fp)
    assert (parent.kl_p99_max, parent.kl_mean_max) == (0.55, 0.07)
    p = write(tmp_path, "tight.yaml", {"extends": "fp8-h100", "gate": {"kl_p99_max": 0.0001, "min_prompts": 1}})
    bar = load_profile(str(p)).gate.for_model(fp)
    assert (bar.kl_p99_max, bar.kl_mean_max, bar.min_prompts) == (0.0001, 0.07, 1)
    p = write(tmp_path, "own.yaml", {"extends": "fp8-h100", "gate": {"kl_p99_max": 0.0001,
                                                                       "overrides": {fp: {"kl_p99_max": 0.6}}}})
    bar = load_profile(str(p)).gate.for_model(fp)
    assert (bar.kl_p99_max, bar.kl_mean_max) == (0.6, 0.07)
    assert load_profile(str(p)).gate.kl_p99_max == 0.0001


def test_extends_relative_path_chain(tmp_path):
    write(tmp_path, "base.yaml", {"target": {"gpu": "l4"}, "build": {"max_batch_size": 7, "max_seq_len": 100}})
    write(tmp_path, "mid.yaml", {"extends": "./base.yaml", "build": {"max_batch_size": 8}})
    p = write(tmp_path, "leaf.yaml", {"extends": "./mid.yaml", "build": {"max_seq_len": 200}})
    prof = load_profile(str(p))
    assert (prof.target.gpu, prof.build.max_batch_size, prof.build.max_seq_len) == ("l4", 8, 200)


def test_fallback_is_found_beside_the_profile_like_extends(tmp_path, monkeypatch):
    """s9 hostile round F9: ``deployment.fallback: bf16b`` beside the profile was "no shipped profile named 'bf16b'",
    and ``bf16b.yaml`` was read from the current directory."""
    write(tmp_path, "bf16b.yaml", {"extends": "bf16-h100"})
    monkeypatch.chdir("/")
    for named in ("bf16b", "bf16b.yaml", "./bf16b.yaml"):
        p = write(tmp_path, "fp8a.yaml", {"extends": "fp8-h100", "deployment": {"fallback": named}})
        fb = load_profile(str(p)).deployment.fallback
        assert fb == str((tmp_path / "bf16b.yaml").resolve()), named
        assert load_profile(fb).quantization.quant_algo.value == "NO_QUANT"
    # a shipped name with no file beside it stays the shipped profile
    p = write(tmp_path, "fp8c.yaml", {"extends": "fp8-h100", "deployment": {"fallback": "bf16-h100"}})
    assert load_profile(str(p)).deployment.fallback == "bf16-h100"


def test_extends_cycle(tmp_path):
    write(tmp_path, "a.yaml", {"extends": "./b.yaml", "target": {"gpu": "l4"}})
    write(tmp_path, "b.yaml", {"extends": "./a.yaml"})
    e = err(load_profile, str(tmp_path / "a.yaml"))
    pr = e.problems[0]
    assert pr.field == "extends"
    assert pr.reason == "profiles extend each other in a cycle: a -> b -> a."


def test_extends_self(tmp_path):
    write(tmp_path, "me.yaml", {"extends": "./me.yaml", "target": {"gpu": "l4"}})
    assert "cycle" in err(load_profile, str(tmp_path / "me.yaml")).problems[0].reason


def test_extends_unknown_parent(tmp_path):
    p = write(tmp_path, "c.yaml", {"extends": "fp8-h10", "target": {"gpu": "l4"}})
    pr = err(load_profile, str(p)).problems[0]
    assert pr.field == "extends" and pr.reason == "no shipped profile named 'fp8-h10'."
    assert pr.fix.startswith("did you mean 'fp8-h100'?")


def test_extends_not_a_string(tmp_path):
    p = write(tmp_path, "c.yaml", {"extends": ["fp8-h100"], "target": {"gpu": "l4"}})
    pr = err(load_profile, str(p)).problems[0]
    assert pr.field == "extends" and pr.reason == "must be a profile name, got list."


# ---------------------------------------------------------------------------------------------
# keys and values


def test_misspelt_top_level_key_suggests_closest(tmp_path):
    p = write(tmp_path, "m.yaml", {"target": {"gpu": "h100"}, "quantisation": {"quant_algo": "FP8"}})
    pr = err(load_profile, str(p)).problems[0]
    assert pr.field == "quantisation" and pr.reason == "is not a known profile key." and pr.fix == "did you mean 'quantization'?"


def test_misspelt_nested_key_suggests_closest(tmp_path):
    p = write(tmp_path, "m.yaml", {"target": {"gpu": "h100"}, "build": {"max_batch_sise": 3},
                                   "context_phase": {"use_paged_context_fmah": True}})
    probs = {pr.field: pr for pr in err(load_profile, str(p)).problems}
    assert probs["build.max_batch_sise"].fix == "did you mean 'max_batch_size'?"
    assert probs["context_phase.use_paged_context_fmah"].fix == "did you mean 'use_paged_context_fmha'?"


def test_every_bad_field_reported(tmp_path):
    p = write(tmp_path, "m.yaml", {"build": {"max_batch_size": -1}, "quantization": {"quant_algo": "FP9"}})
    fields = {pr.field for pr in err(load_profile, str(p)).problems}
    assert {"target", "build.max_batch_size", "quantization.quant_algo"} <= fields


def test_missing_target():
    pr = err(validate_profile, {}).problems[0]
    assert pr.field == "target" and pr.reason == "is required."


# ---------------------------------------------------------------------------------------------
# names and paths


def test_unknown_shipped_name_suggests_closest():
    pr = err(load_profile, "fp8-h10").problems[0]
    assert pr.field == "--profile" and pr.reason == "no shipped profile named 'fp8-h10'."
    assert pr.fix.startswith("did you mean 'fp8-h100'? Shipped: ")


@pytest.mark.parametrize("name", ["../../etc", "../../etc/passwd", "/etc/passwd", "..", ".", "~root", "fp8-h100\x00",
                                  "FP8-H100", "a" * 65, "../precision_profiles/fp8-h100", "$(id)"])
def test_path_traversal_and_bad_names_refused(name):
    e = err(load_profile, name)
    assert e.problems[0].field == "--profile"


def test_extends_path_traversal(tmp_path):
    for parent in ("../../etc", "../../../../../../etc/passwd", "/etc/passwd", "/dev/null", ".."):
        p = write(tmp_path, "t.yaml", {"extends": parent, "target": {"gpu": "l4"}})
        assert err(load_profile, str(p)).problems[0].field == "extends", parent


def test_not_a_mapping(tmp_path):
    for text, kind in (("- a\n- b\n", "list"), ("42\n", "int"), ("hello\n", "str")):
        p = write(tmp_path, "x.yaml", text)
        assert f"holds a {kind}, not a mapping" in err(load_profile, str(p)).problems[0].reason


def test_invalid_yaml_and_encoding(tmp_path):
    p = write(tmp_path, "bad.yaml", "target: [unclosed\n")
    assert "is not valid YAML at line" in err(load_profile, str(p)).problems[0].reason
    b = tmp_path / "bin.yaml"
    b.write_bytes(b"\xff\xfe\x00target")
    assert "not UTF-8" in err(load_profile, str(b)).problems[0].reason
    t = tmp_path / "tag.yaml"
    t.write_text("!!python/object/apply:os.system ['true']\n")
    assert "is not valid YAML" in err(load_profile, str(t)).problems[0].reason


def test_too_big(tmp_path):
    p = tmp_path / "big.yaml"
    p.write_text("# " + "x" * (300 * 1024) + "\n")
    assert "profiles are at most" in err(load_profile, str(p)).problems[0].reason


def test_deep_nesting(tmp_path):
    p = write(tmp_path, "deep.yaml", "target: " + "[" * 1500 + "]" * 1500 + "\n")
    err(load_profile, str(p))


# ---------------------------------------------------------------------------------------------
# fuzz


PROFILE_KEYS = ["target", "gpu", "quantization", "quant_algo", "kv_cache_quant_algo", "group_size", "exclude_modules",
                "build", "max_batch_size", "max_seq_len", "max_input_len", "max_num_tokens", "parallel", "tp_size",
                "pp_size", "context_phase", "runtime", "deployment", "fallback", "gate", "overrides", "name",
                "extends", "calibration", "generation_phase", "description"]
EXTENDS = ["../../etc", "../../etc/passwd", "/etc/passwd", "/dev/null", "fp8-h100", "bf16-h100", "nope", "..", ".",
           "./self.yaml", "./other.yaml", "é", "", "a" * 300, "a/" * 200 + "b.yaml", "x" * 5000 + ".yaml",
           "fp8-h100\x00", "./\x00.yaml", "C:\\x.yaml", "~/p.yaml"]

scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=-(10**40), max_value=10**40)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20)
           | st.sampled_from(["FP8", "NVFP4", "h100", "NONE", "W4A16_AWQ", "auto", "-1", "1e400", "nan", "☃", "\u202e"]))
keys = st.sampled_from(PROFILE_KEYS) | st.text(max_size=12)
values = st.recursive(scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(keys, c, max_size=5), max_leaves=25)
profile_like = st.dictionaries(keys, values, max_size=8)
counter = itertools.count()


def _check_load(path: str) -> None:
    try:
        out = load_profile(path)
    except UserError as e:
        assert e.problems and all(p.field is not None for p in e.problems)
        assert isinstance(e.message, str)
    else:
        assert isinstance(out, Profile)


FUZZ = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                           HealthCheck.function_scoped_fixture])


@FUZZ
@given(data=profile_like, parent=st.none() | st.sampled_from(EXTENDS) | st.text(max_size=30) | scalars,
       other=profile_like, cyc=st.booleans())
def test_fuzz_loader_only_user_errors(tmp_path_factory, data, parent, other, cyc):
    d = tmp_path_factory.mktemp("fz")
    data = dict(data)
    if parent is not None:
        data["extends"] = parent
    if cyc:
        other = dict(other, extends="./self.yaml")
        write(d, "other.yaml", yaml.safe_dump(other, allow_unicode=True))
    write(d, "self.yaml", yaml.safe_dump(data, allow_unicode=True))
    _check_load(str(d / "self.yaml"))


@FUZZ
@given(text=st.text(max_size=300) | st.sampled_from(["{", "[", "a: &x [*x]", "? [a]\n: 1", "target: !!binary AAAA",
                                                     "a: 1\na: 2", "%YAML 9.9\n---\n", "\t", "---\n---\n"]))
def test_fuzz_raw_text(tmp_path_factory, text):
    d = tmp_path_factory.mktemp("fzt")
    p = d / "t.yaml"
    p.write_text(text, encoding="utf-8", errors="surrogatepass") if "\ud800" not in text else p.write_bytes(text.encode("utf-8", "surrogatepass"))
    _check_load(str(p))


@FUZZ
@given(blob=st.binary(max_size=200))
def test_fuzz_raw_bytes(tmp_path_factory, blob):
    d = tmp_path_factory.mktemp("fzb")
    p = d / "b.yaml"
    p.write_bytes(blob)
    _check_load(str(p))


@FUZZ
@given(name=st.text(max_size=80))
def test_fuzz_names(name):
    _check_load(name)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(depth=st.integers(min_value=1, max_value=1500), kind=st.sampled_from(["[", "{a: ", "- "]))
def test_fuzz_deep_nesting(tmp_path_factory, depth, kind):
    d = tmp_path_factory.mktemp("fzd")
    if kind == "[":
        text = "target: " + "[" * depth + "]" * depth
    elif kind == "{a: ":
        text = "target: " + "{a: " * depth + "1" + "}" * depth
    else:
        text = "".join("  " * i + "- \n" for i in range(min(depth, 400)))
    p = d / "d.yaml"
    p.write_text(text)
    _check_load(str(p))


def test_otlp_endpoint_default_none_and_traces_url():
    base = load_raw_fp8()
    assert validate_profile(base).deployment.otlp_traces_url is None  # default: no spans
    prof = validate_profile(deep_merge(base, {"deployment": {"otlp_endpoint": "http://otel-collector.monitoring:4318/"}}))
    assert prof.deployment.otlp_endpoint == "http://otel-collector.monitoring:4318/"
    assert prof.deployment.otlp_traces_url == "http://otel-collector.monitoring:4318/v1/traces"
    prefixed = validate_profile(deep_merge(base, {"deployment": {"otlp_endpoint": "https://gw.example/otlp"}}))
    assert prefixed.deployment.otlp_traces_url == "https://gw.example/otlp/v1/traces"


@pytest.mark.parametrize("bad,why", [("otel-collector:4318", "not an http(s) URL"), ("grpc://c:4317", "not an http(s) URL"),
                                     ("http://c:4318/v1/traces", "ends with /v1/traces"), ("http://c:4318?x=1", "query"),
                                     ("http://u:p@c:4318", "credentials"), ("http://c :4318", "not a URL"), ("", "not a URL")])
def test_bad_otlp_endpoint_is_a_user_error(bad, why):
    with pytest.raises(UserError) as e:
        validate_profile(deep_merge(load_raw_fp8(), {"deployment": {"otlp_endpoint": bad}}))
    assert e.value.exit_code == EXIT_INVALID and "deployment.otlp_endpoint" in str(e.value) and why in str(e.value)


def load_raw_fp8():
    from precision_pipeline.spec.profile import load_raw

    data = load_raw("fp8-h100")
    data["name"] = "fp8-h100"
    return data


@pytest.mark.parametrize("bad,why", [("http://c:99999", "port"), ("http://c:abc", "port"), ("http://c:0", "port"),
                                     ("http://[::1", "not a URL"), ("http://c:4318\u200b", "not a URL"),
                                     ("http://c\x00:4318", "not a URL"), ("http://" + "a" * 300 + ":4318", "host name"),
                                     ("http://c:4318/" + "p" * 3000, "characters"),
                                     # issue 25 item 15: a percent-escaped newline and a five-part "address"
                                     ("http://otel%0a:4318", "is not a DNS name"),
                                     ("http://1.2.3.4.5:4318", "neither an IPv4 address"),
                                     ("http://10.0.0.256:4318", "neither an IPv4 address"),
                                     ("http://otel..svc:4318", "is not a DNS name"),
                                     ("http://[fe80::zz]:4318", "not a URL")])
def test_otlp_endpoint_port_length_and_invisible_characters_are_user_errors(bad, why):
    from precision_pipeline.spec.profile import otlp_endpoint_problem

    assert why in (otlp_endpoint_problem(bad) or "")
    with pytest.raises(UserError) as e:
        validate_profile(deep_merge(load_raw_fp8(), {"deployment": {"otlp_endpoint": bad}}))
    assert "deployment.otlp_endpoint" in str(e.value)
    assert otlp_endpoint_problem("http://[::1]:4318") is None and otlp_endpoint_problem("http://c:65535") is None
    for ok in ("http://10.0.0.7:4318", "http://otel-collector.monitoring.svc.cluster.local:4318", "https://Otel.Example.com"):
        assert otlp_endpoint_problem(ok) is None, ok


TOOL_TEXT = "# Written by `invoke recommend`.\nextends: fp8-h100\n"


def test_save_profile_keeps_a_hand_written_or_shipped_profile(tmp_path):
    from precision_pipeline.spec.profile import PROFILES_DIR, save_profile

    mine = tmp_path / "mine.yaml"
    mine.write_text("extends: fp8-h100\ndescription: hand-written\n")
    with pytest.raises(UserError, match="not written by invoke") as e:
        save_profile(mine, TOOL_TEXT)
    assert e.value.problems[0].field == "--write" and "new file name" in e.value.problems[0].fix
    assert mine.read_text() == "extends: fp8-h100\ndescription: hand-written\n"
    shipped = PROFILES_DIR / "bf16-h100.yaml"
    before = shipped.read_bytes()
    with pytest.raises(UserError, match="is a shipped profile"):
        save_profile(shipped, TOOL_TEXT.replace("extends: fp8-h100", "extends: fp8-h100\nname: bf16-h100"))
    assert shipped.read_bytes() == before
    tool = tmp_path / "tool.yaml"
    save_profile(tool, TOOL_TEXT)
    save_profile(tool, TOOL_TEXT.replace("recommend`", "recommend` (again)"))  # its own earlier output: replaced
    assert "(again)" in tool.read_text()


def test_save_profile_under_a_file_or_into_an_unwritable_place_is_a_user_error(tmp_path, monkeypatch):
    from precision_pipeline.core import store
    from precision_pipeline.spec.profile import save_profile

    f = tmp_path / "f.yaml"
    f.write_text("x")
    with pytest.raises(UserError, match="is a file, not a folder") as e:
        save_profile(f / "sub" / "t.yaml", TOOL_TEXT, field="--write-profile")
    assert e.value.problems[0].field == "--write-profile" and f.read_text() == "x"

    def boom(path, text):
        raise FileNotFoundError(2, "No such file or directory", str(path))

    monkeypatch.setattr(store, "atomic_write_text", boom)
    with pytest.raises(UserError, match="cannot write") as e:
        save_profile(tmp_path / "t.yaml", TOOL_TEXT)
    assert "No such file or directory" in e.value.problems[0].reason


def test_save_profile_never_replaces_a_shipped_profile_even_with_the_written_by_header(tmp_path, monkeypatch):
    # issue 25 item 2: the tuned shipped profiles begin with the "Written by `invoke" line; they are shipped all the same
    import shutil

    from precision_pipeline.spec import profile as P

    shipped = tmp_path / "precision_profiles"
    shutil.copytree(P.PROFILES_DIR, shipped)
    monkeypatch.setattr(P, "PROFILES_DIR", shipped)
    target = shipped / "int8-sq-l4-smollm2.yaml"
    before = target.read_bytes()
    assert before.startswith(P.WRITTEN_BY.encode())
    text = "# Written by `invoke recommend`.\nextends: int8-sq-l4\n"
    for field in ("--write", "--write-profile"):
        with pytest.raises(UserError, match="is a shipped profile") as e:
            P.save_profile(target, text, field=field)
        assert e.value.problems[0].field == field and "delete it first" in e.value.problems[0].fix
        with pytest.raises(UserError, match="is a shipped profile"):
            P.check_profile_target(target, field, name_from_stem=True)
    link = tmp_path / "elsewhere.yaml"
    link.symlink_to(target)  # a symlink to a shipped file is the shipped file
    with pytest.raises(UserError, match="is a shipped profile"):
        P.save_profile(link, text)
    assert target.read_bytes() == before
    assert P.is_shipped_profile(target) and not P.is_shipped_profile(shipped / "new.yaml")
    P.save_profile(shipped / "new.yaml", text)  # a new file in the folder may be written once
    assert P.is_shipped_profile(shipped / "new.yaml")
