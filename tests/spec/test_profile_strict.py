"""Strict profile YAML (issue 11, items 7-10 and 15): alias bombs, duplicate keys, coerced scalars,
non-finite and impossible thresholds, where ``extends`` may read, unnamed profiles, and a fuzz test
of the loader and ``check`` under a time and memory budget.
"""

from __future__ import annotations

import resource
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from precision_pipeline.core.errors import UserError
from precision_pipeline.spec.profile import PROFILES_DIR, load_profile
from precision_pipeline.spec.profile_yaml import MAX_YAML_NODES

BASE = "target:\n  gpu: h100-sxm\n"


def write(d: Path, name: str, text: str) -> Path:
    p = d / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text, encoding="utf-8")
    return p


def refusal(path) -> UserError:
    with pytest.raises(UserError) as ei:
        load_profile(str(path))
    return ei.value


def bomb(levels: int = 9, width: int = 9) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]")
    return "\n".join(lines)


def test_alias_bomb_refused_fast_and_small(tmp_path):
    """A ~500-byte billion-laughs file as description / exclude_modules: refused in well under a second."""
    for where in ("description: *a8", "quantization:\n  exclude_modules: *a8"):
        text = bomb() + "\n" + BASE + where + "\n"
        assert len(text) < 700
        p = write(tmp_path, "bomb.yaml", text)
        t0 = time.perf_counter()
        e = refusal(p)
        assert time.perf_counter() - t0 < 2.0
        assert f"expand to more than {MAX_YAML_NODES:,} nodes" in e.message
        assert len(e.message) < 600  # never the whole input formatted into the message


def test_small_aliases_still_allowed(tmp_path):
    p = write(tmp_path, "anchors.yaml", BASE + "quantization:\n  quant_algo: FP8\n  exclude_modules: &keep [lm_head, '*router*']\n"
              "gate:\n  measured_on: x\n")
    assert load_profile(str(p)).quantization.exclude_modules == ["lm_head", "*router*"]


def test_duplicate_keys_refused_with_both_lines(tmp_path):
    p = write(tmp_path, "dup.yaml", BASE + "quantization:\n  kv_cache_quant_algo: FP8\nbuild:\n  max_batch_size: 8\n"
              "quantization:\n  quant_algo: FP8\n")
    e = refusal(p)
    assert "duplicate key 'quantization' (first at line 3, again at line 7)" in e.message
    p = write(tmp_path, "dup2.yaml", BASE + "build:\n  max_batch_size: 8\n  max_batch_size: 16\n")
    assert "duplicate key 'max_batch_size' (first at line 4, again at line 5)" in refusal(p).message


@pytest.mark.parametrize("value, says", [
    ("064", "reads it as octal 52, YAML 1.2 as 64"), ("012", "reads it as octal 10, YAML 1.2 as 12"),
    ("1:04", "base-60 number in YAML 1.1 (PyYAML reads it as 64)"), ("1_024", "drops the '_' and reads 1024"),
    ("0b101", "YAML 1.1 binary number"), ("-010", "reads it as octal -8")])
def test_yaml_1_1_numbers_are_refused_not_reread(tmp_path, value, says):
    """Issue 25 item 15: ``064`` became 52, ``012`` 10 and ``1:04`` 64 without a word."""
    e = refusal(write(tmp_path, "n.yaml", BASE + f"build:\n  max_batch_size: {value}\n"))
    assert says in e.message and "line 4" in e.message, e.message
    assert load_profile(str(write(tmp_path, "ok.yaml", BASE + "build:\n  max_batch_size: 64\n"))).build.max_batch_size == 64
    assert load_profile(str(write(tmp_path, "f.yaml", BASE + "runtime:\n  kv_cache_free_gpu_mem_fraction: 0.85\n"
                                  ))).runtime.kv_cache_free_gpu_mem_fraction == 0.85


@pytest.mark.parametrize("value, reads", [("yes", "true"), ("Yes", "true"), ("NO", "false"), ("on", "true"),
                                          ("OFF", "false"), ("Off", "false")])
def test_yaml_1_1_booleans_are_refused_not_reread(tmp_path, value, reads):
    """Hostile round #112: ``warm_fallback: yes`` was read as true (YAML 1.2 reads text); the YAML 1.1 rule says so."""
    e = refusal(write(tmp_path, "b.yaml", BASE + f"deployment:\n  warm_fallback: {value}\n"))
    assert f"{value!r} is a YAML 1.1 boolean (PyYAML reads it as {reads})" in e.message and "write true or false" in e.message
    assert "line 4" in e.message, e.message
    for ok, want in (("true", True), ("True", True), ("FALSE", False)):  # YAML 1.2 core booleans stay
        assert load_profile(str(write(tmp_path, f"ok-{ok.lower()}.yaml", BASE + f"deployment:\n  warm_fallback: {ok}\n"
                                      ))).deployment.warm_fallback is want
    for text in ("y", "n"):  # text in both YAML versions: the boolean field refuses it
        assert "must be true or false" in refusal(write(tmp_path, "t.yaml", BASE + f"deployment:\n  warm_fallback: {text}\n")).message


def test_yaml_1_1_float_forms_and_binary_are_refused(tmp_path):
    e = refusal(write(tmp_path, "f.yaml", BASE + "runtime:\n  kv_cache_free_gpu_mem_fraction: 0:0.5\n"))
    assert "base-60" in e.message
    e = refusal(write(tmp_path, "b.yaml", BASE + "description: !!binary aGVsbG8=\n"))
    assert "!!binary (base64 bytes) is not a profile value" in e.message
    for text in ("2001-12-14", "2001-12-14 21:59:43.10"):  # a date: PyYAML made datetime.date, refused as 'valid string'
        e = refusal(write(tmp_path, "d.yaml", BASE + f"description: {text}\n"))
        assert f"{text!r} is a YAML 1.1 timestamp (PyYAML reads it as a date) and text in YAML 1.2; quote it if it is text" \
            in e.message and "line 3" in e.message, e.message
    assert load_profile(str(write(tmp_path, "q.yaml", BASE + "description: '2001-12-14'\n"))).description == "2001-12-14"


def test_a_user_profile_named_like_a_shipped_one_extends_the_shipped_one(tmp_path):
    """Issue 25 item 21: a user's fp8-h100.yaml with ``extends: fp8-h100`` was reported as a cycle."""
    p = write(tmp_path / "mine", "fp8-h100.yaml", "extends: fp8-h100\nbuild:\n  max_batch_size: 16\n")
    prof = load_profile(str(p))
    shipped = load_profile("fp8-h100")
    assert prof.name == "fp8-h100" and prof.build.max_batch_size == 16
    assert prof.quantization == shipped.quantization and prof.target == shipped.target
    write(tmp_path / "c", "a.yaml", "extends: b\n")  # a real cycle is still one
    write(tmp_path / "c", "b.yaml", "extends: a\n")
    assert "cycle: a -> b -> a" in refusal(tmp_path / "c" / "a.yaml").message


def test_yaml_merge_keys_are_supported(tmp_path):
    """Issue 25 item 21: ``<<: *anchor`` was refused as 'could not determine a constructor for the tag ...merge'.
    (gate.overrides keys are model fingerprints: 64 hex digits.)"""
    a, b = "a" * 64, "b" * 64
    p = write(tmp_path, "m.yaml", BASE + f"gate:\n  overrides:\n    {a}: &a {{kl_mean_max: 0.3, top1_min: 0.7}}\n"
              f"    {b}:\n      <<: *a\n      top1_min: 0.5\n")
    ov = load_profile(str(p)).gate.overrides
    assert (ov[b].kl_mean_max, ov[b].top1_min, ov[a].top1_min) == (0.3, 0.5, 0.7)
    e = refusal(write(tmp_path, "d.yaml", BASE + f"gate:\n  overrides:\n    {a}: &a {{kl_mean_max: 0.3}}\n"
                      f"    {b}:\n      <<: *a\n      top1_min: 0.5\n      top1_min: 0.6\n"))
    assert "duplicate key 'top1_min'" in e.message


@pytest.mark.parametrize("snippet, field, says", [
    ("build:\n  max_batch_size: true\n", "build.max_batch_size", "must be a number, got True"),
    ("build:\n  max_batch_size: '8'\n", "build.max_batch_size", "must be a number, got '8'"),
    ("build:\n  max_batch_size: 8.5\n", "build.max_batch_size", "must be a whole number"),
    ("build:\n  gather_context_logits: 1\n", "build.gather_context_logits", "must be true or false, got 1"),
    ("runtime:\n  kv_cache_free_gpu_mem_fraction: .nan\n", "runtime.kv_cache_free_gpu_mem_fraction", "finite"),
    ("gate:\n  kl_mean_max: .inf\n", "gate.kl_mean_max", "finite"),
    ("gate:\n  ppl_delta_pct_max: -100\n", "gate.ppl_delta_pct_max", "greater than or equal to 0"),
])
def test_strict_scalars(tmp_path, snippet, field, says):
    e = refusal(write(tmp_path, "p.yaml", BASE + snippet))
    assert [p.field for p in e.problems] == [field]
    assert says in e.problems[0].reason


def test_huge_integer_is_a_refusal(tmp_path):
    e = refusal(write(tmp_path, "p.yaml", BASE + "build:\n  max_batch_size: " + "9" * 5000 + "\n"))
    assert e.problems[0].field == "--profile" and "cannot be read" in e.message and len(e.message) < 600


def test_extends_outside_the_profile_tree_refused(tmp_path):
    outside = write(tmp_path, "outside/base.yaml", BASE)
    for parent in ("../outside/base.yaml", str(outside), "../../etc/passwd", "/etc/passwd", "~/x.yaml"):
        e = refusal(write(tmp_path, "mine/child.yaml", f"extends: {parent}\n"))
        assert e.problems[0].field == "extends"
        assert "absolute path" in e.message or "leaves" in e.message
    # a symlink inside the tree pointing out of it is resolved and refused too
    (tmp_path / "mine" / "link.yaml").symlink_to(outside)
    assert "leaves" in refusal(write(tmp_path, "mine/child.yaml", "extends: link.yaml\n")).message


def test_extends_inside_the_tree_and_name_beside_first(tmp_path):
    write(tmp_path, "mine/sub/base.yaml", BASE + "build:\n  max_batch_size: 7\n")
    assert load_profile(str(write(tmp_path, "mine/a.yaml", "extends: sub/base.yaml\n"))).build.max_batch_size == 7
    # NAME finds NAME.yaml beside the extending profile before the shipped one of the same name
    assert (PROFILES_DIR / "fp8-h100.yaml").is_file()
    write(tmp_path, "mine/fp8-h100.yaml", BASE + "build:\n  max_batch_size: 3\n")
    assert load_profile(str(write(tmp_path, "mine/b.yaml", "extends: fp8-h100\n"))).build.max_batch_size == 3
    # and falls back to the shipped profiles
    shipped = load_profile(str(write(tmp_path, "other/c.yaml", "extends: fp8-h100\n")))
    assert shipped.quantization.quant_algo.value == "FP8" and shipped.name == "c"


def test_unnamed_profile_file_refused(tmp_path):
    e = refusal(write(tmp_path, "My Profile.yaml", BASE))
    assert e.problems[0].field == "name" and "share one output folder" in e.message
    assert load_profile(str(write(tmp_path, "My Other.yaml", BASE + "name: my-other\n"))).name == "my-other"


def test_unknown_key_with_nothing_to_suggest(tmp_path):
    e = refusal(write(tmp_path, "p.yaml", BASE + "gate:\n  overrides:\n    m:\n      zzzz: 1\n"))
    assert "known keys here: ." not in e.message


# ---------------------------------------------------------------------------------------------
# fuzz: random YAML with duplicate keys, anchors and aliases; the loader and `check` answer with a
# Profile or a UserError, within a time and memory budget, never another exception

_keys = st.sampled_from(["target", "gpu", "quantization", "quant_algo", "build", "max_batch_size", "gate",
                         "kl_mean_max", "description", "extends", "name", "exclude_modules", "x"])
_scalars = st.one_of(st.integers(-10**30, 10**30), st.floats(allow_nan=True), st.booleans(), st.none(),
                     st.text(max_size=12), st.sampled_from(["FP8", "h100-sxm", ".inf", "~", "[a]", "*a"]))


def _render(value, indent=0):
    pad = "  " * indent
    if isinstance(value, list):
        return "".join(f"{pad}{k}:\n{_render(v, indent + 1)}" if isinstance(v, list)
                       else f"{pad}{k}: {v!r}\n" for k, v in value)
    return f"{pad}{value!r}\n"


_mapping = st.recursive(st.lists(st.tuples(_keys, _scalars), max_size=5),
                        lambda inner: st.lists(st.tuples(_keys, st.one_of(_scalars, inner)), max_size=4), max_leaves=20)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=_mapping, levels=st.integers(0, 10), width=st.integers(1, 12), use=st.booleans())
def test_fuzz_loader_and_check(tmp_path, body, levels, width, use):
    from precision_pipeline.resolve.plan import evaluate

    text = _render(body)
    if levels:
        text = bomb(levels, width) + "\n" + text + (f"description: *a{levels - 1}\n" if use else "")
    p = tmp_path / "fuzz.yaml"
    p.write_text(text, encoding="utf-8")
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    try:
        prof = load_profile(str(p))
    except UserError as e:
        assert len(e.message) < 20_000
    else:
        try:
            evaluate(prof, _tiny_model())
        except UserError:
            pass
    assert time.perf_counter() - t0 < 5.0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0 < 200 * 1024  # KiB: < 200 MiB growth


def _tiny_model():
    from precision_pipeline.spec.model_arch import arch_from_config

    return arch_from_config({"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
                             "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                             "vocab_size": 49152, "max_position_embeddings": 8192, "torch_dtype": "bfloat16"},
                            name="tiny")


@pytest.mark.parametrize("value, says", [
    ("INT8", "per-tensor INT8 (ModelOpt INT8_DEFAULT_CFG)"),
    ("w8a8_sq_per_tensor", "per-tensor INT8"),
    ("FP9", "'FP9' is not a quant_algo"),
])
def test_quant_algo_refusal_lists_only_buildable_formats(tmp_path, value, says):
    e = refusal(write(tmp_path, "p.yaml", BASE + f"quantization:\n  quant_algo: {value}\n"))
    pr = e.problems[0]
    assert pr.field == "quantization.quant_algo" and says in pr.reason
    assert "W4A16_NVFP4" not in pr.reason + pr.fix  # never offered: the resolve stage would refuse it
    assert "W8A8_SQ_PER_CHANNEL" in pr.fix


def test_unbuildable_quantalgo_is_refused_by_its_rule(default_model_dir, tmp_path):
    from precision_pipeline.resolve.plan import evaluate

    prof = load_profile(str(write(tmp_path, "p.yaml", BASE + "quantization:\n  quant_algo: W4A16_NVFP4\n")))
    (pr,) = [p for p in evaluate(prof, default_model_dir).problems if p.rule == "format.trtllm_buildable"]
    assert "W4A16_NVFP4" in pr.reason and "W4A16_AWQ" in pr.fix


def test_a_6kb_profile_path_is_refused_briefly():
    e = refusal("/tmp/" + "a" * 6000 + ".yaml")
    assert e.problems[0].field == "--profile" and len(e.message) < 600


def test_scalar_strictness_unwraps_optional_only():
    """``Optional[int]`` is checked as an int; ``list[int]`` / ``tuple[int, ...]`` are sequences, not ints
    (they used to be unwrapped as if they were ``Optional[int]``, so a list field was refused as "must be a number")."""
    from typing import Optional

    from precision_pipeline.spec.profile import _scalar_kind

    assert _scalar_kind(Optional[int]) is int and _scalar_kind(Optional[bool]) is bool and _scalar_kind(float) is float
    assert _scalar_kind(list[int]) is None and _scalar_kind(tuple[int, ...]) is None and _scalar_kind(Optional[str]) is None


@pytest.mark.parametrize("snippet, field, fix", [
    ("deployment:\n  keep_releases: 1e2\n", "deployment.keep_releases", "write 100 (YAML 1.1, which PyYAML reads, takes"),
    ("gate:\n  kl_mean_max: 5e-2\n", "gate.kl_mean_max", "write 0.05 (YAML 1.1"),
    ("deployment:\n  keep_releases: '3'\n", "deployment.keep_releases", "write the value without quotes"),
    ("build:\n  max_batch_size: 0o10\n", "build.max_batch_size",  # issue 25 item 15/21: was told to drop quotes
     "write 8 (0o10 is YAML 1.2's octal form; YAML 1.1, which PyYAML reads, takes it as text"),
    ("build:\n  max_batch_size: -0o17\n", "build.max_batch_size", "write -15 (-0o17 is YAML 1.2's octal form"),
])
def test_a_number_pyyaml_reads_as_text_is_refused_with_the_plain_number(tmp_path, snippet, field, fix):
    """Hostile s8 #22: ``keep_releases: 1e2`` (not quoted; PyYAML reads 1e2 as text) was told to drop the quotes."""
    e = refusal(write(tmp_path, "n.yaml", BASE + snippet))
    assert [p.field for p in e.problems] == [field] and e.problems[0].fix.startswith(fix), e.problems[0].fix
