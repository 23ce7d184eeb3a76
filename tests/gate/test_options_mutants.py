"""gate/options.py pinned value by value (issue 26: the module's own fast tests; the import map selected the gate runs
and stage builds, minutes per mutant). Every number here is the module's documented default or rule."""

from pathlib import Path

import pydantic
import pytest

from precision_pipeline.core.errors import UserError
from precision_pipeline.gate import options as O


def test_defaults_are_the_documented_numbers():
    o = O.GateOptions()
    assert (O.DEFAULT_HELDOUT_TOKENS, O.DEFAULT_HELDOUT_WINDOW, O.DEFAULT_GREEDY_NEW_TOKENS, O.DEFAULT_GREEDY_BATCH,
            O.DEFAULT_BOOTSTRAP) == (2048, 512, 32, 48, 1000)
    assert o.model_dump() == {
        "prompts_per_category": None, "golden_path": None, "heldout_tokens": 2048, "heldout_window": 512,
        "greedy_new_tokens": 32, "greedy_batch": 48, "noise_floor": True, "bootstrap_resamples": 1000, "seed": 0,
        "device": "cpu", "reference_dtype": "float32", "candidate_dtype": "float32"}
    assert O.GateRuntime().model_dump() == {"threads": None, "progress": True, "reference_cache": None,
                                            "use_reference_cache": True, "write_report": True, "heatmap_png": None}


def test_reference_independent_and_compute_defaults_sets():
    assert O.REFERENCE_INDEPENDENT == frozenset({"bootstrap_resamples", "seed", "golden_path", "candidate_dtype"})
    assert O.COMPUTE_DEFAULTS == {"device": "cpu", "reference_dtype": "float32", "candidate_dtype": "float32"}


@pytest.mark.parametrize("cls", [O.GateOptions, O.GateRuntime])
def test_frozen_and_no_unknown_fields(cls):
    o = cls()
    with pytest.raises(pydantic.ValidationError):
        cls(not_a_field=1)
    first = next(iter(cls.model_fields))
    with pytest.raises(pydantic.ValidationError):
        setattr(o, first, 3)


@pytest.mark.parametrize("field, bad", [("prompts_per_category", 0), ("heldout_tokens", -1), ("heldout_window", 0),
                                        ("greedy_new_tokens", -1), ("greedy_batch", 0), ("bootstrap_resamples", -1),
                                        ("device", "tpu"), ("reference_dtype", "float16"), ("candidate_dtype", "int8")])
def test_field_bounds(field, bad):
    with pytest.raises(pydantic.ValidationError):
        O.GateOptions(**{field: bad})
    ok = {"prompts_per_category": 1, "heldout_tokens": 0, "heldout_window": 1, "greedy_new_tokens": 0,
          "greedy_batch": 1, "bootstrap_resamples": 0, "device": "cuda", "reference_dtype": "bfloat16",
          "candidate_dtype": "float16"}[field]
    assert getattr(O.GateOptions(**{field: ok}), field) == ok
    assert O.GateRuntime(threads=1).threads == 1
    with pytest.raises(pydantic.ValidationError):
        O.GateRuntime(threads=0)


@pytest.mark.parametrize("noise_floor, ref, want", [(True, "float32", True), (True, "bfloat16", False),
                                                    (False, "float32", False), (False, "bfloat16", False)])
def test_measures_floor(noise_floor, ref, want):
    assert O.GateOptions(noise_floor=noise_floor, reference_dtype=ref).measures_floor is want


def test_key_fields_drop_compute_defaults_only_at_their_default():
    base = {"prompts_per_category": None, "golden_path": None, "heldout_tokens": 2048, "heldout_window": 512,
            "greedy_new_tokens": 32, "greedy_batch": 48, "noise_floor": True, "bootstrap_resamples": 1000, "seed": 0}
    assert O.GateOptions().key_fields() == base
    assert O.GateOptions().canonical() == base
    o = O.GateOptions(device="cuda", reference_dtype="bfloat16", candidate_dtype="bfloat16",
                      golden_path=Path("/g/x.jsonl"), prompts_per_category=2)
    assert o.key_fields() == {**base, "device": "cuda", "reference_dtype": "bfloat16", "candidate_dtype": "bfloat16",
                              "golden_path": "/g/x.jsonl", "prompts_per_category": 2}
    assert o.canonical() == o.key_fields()


def test_reference_key_fields_leave_out_the_reference_independent_fields():
    o = O.GateOptions(device="cuda", candidate_dtype="bfloat16", golden_path=Path("/g/x.jsonl"), seed=3,
                      bootstrap_resamples=7, heldout_tokens=100)
    assert o.reference_key_fields() == {"prompts_per_category": None, "heldout_tokens": 100, "heldout_window": 512,
                                        "greedy_new_tokens": 32, "greedy_batch": 48, "noise_floor": True, "device": "cuda"}
    # the same reference for another seed, bootstrap, golden path or candidate dtype; another for another device
    assert O.GateOptions(heldout_tokens=100).reference_key_fields() != o.reference_key_fields()
    assert O.GateOptions(heldout_tokens=100, device="cuda").reference_key_fields() == o.reference_key_fields()


@pytest.mark.parametrize("ok", [None, 1, 2, 10**6])
def test_golden_limit_taken(ok):
    assert O.check_golden_limit(ok) is None


@pytest.mark.parametrize("bad", [0, -1, True, False, 1.0, "1", "x" * 100])
def test_golden_limit_refused(bad):
    with pytest.raises(UserError) as e:
        O.check_golden_limit(bad)
    (p,) = e.value.problems
    assert (p.field, p.reason) == ("--golden-limit", f"{str(bad)[:40]!r} is not a whole number >= 1.")
    assert p.fix == "pass e.g. --golden-limit 1, or leave it out for every golden prompt."
