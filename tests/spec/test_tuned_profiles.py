"""The shipped ``*-smollm2`` profiles (written by ``invoke sensitivity --write-profile`` for the
default model): each extends its base, changes only ``exclude_modules``, every pattern names linears
of SmolLM2-135M, the plan resolves, and the default model's gate bar is its base's. That they pass
their gates is measured by building them (README, "Tuned 4-bit profiles"), not here: a build costs
minutes."""

from __future__ import annotations

import pytest

from precision_pipeline.spec.families import LLAMA, resolve_exclusions
from precision_pipeline.spec.profile import load_profile, load_raw, shipped_profiles

TUNED = {"nvfp4-b200-smollm2": ("nvfp4-b200", 44), "int4-awq-a100-smollm2": ("int4-awq-a100", 16),
         "int8-sq-l4-smollm2": ("int8-sq-l4", 2)}


def test_the_tuned_profiles_are_shipped():
    assert set(TUNED) <= set(shipped_profiles())


@pytest.mark.parametrize("name", sorted(TUNED))
def test_tuned_profile_only_adds_exclusions_that_name_real_modules(name, default_model_dir):
    from precision_pipeline.resolve.plan import evaluate
    from precision_pipeline.spec.model_arch import read_model_arch

    base_name, cells = TUNED[name]
    tuned, base = load_profile(name), load_profile(base_name)
    assert load_raw(name)["extends"] == base_name
    dump = tuned.model_dump(mode="json")
    want = base.model_dump(mode="json")
    dump["quantization"].pop("exclude_modules")
    assert want["quantization"].pop("exclude_modules") == ["lm_head"]
    for d in (dump, want):
        d.pop("name"), d.pop("description"), d.pop("extends")
    assert dump == want  # nothing but the exclusions differs
    arch = read_model_arch(default_model_dir)
    names = LLAMA.linear_names(arch.num_layers)
    pats = tuned.quantization.exclude_modules
    excluded, unmatched = resolve_exclusions(names, pats, 0, 0, arch.num_layers)
    assert unmatched == [] and pats[0] == "lm_head"
    # a cell is one TensorRT-LLM linear (qkv = q/k/v, fc+gate = gate/up fused): count them back
    trt_cells = {p for p in pats[1:] if not p.endswith(".mlp.gate")}
    assert len(trt_cells) == cells
    assert tuned.gate.for_model_dir(default_model_dir) == base.gate.for_model_dir(default_model_dir)
    assert evaluate(tuned, default_model_dir).ok
