"""The trtllm-build command line we render, against TensorRT-LLM 1.2's parser (engine/build_contract.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from precision_pipeline.engine.build_contract import FLAGS, check_build_args
from precision_pipeline.engine.trtllm_build import build_args
from precision_pipeline.spec.profile import load_profile, shipped_profiles


@pytest.mark.parametrize("name", shipped_profiles())
def test_every_shipped_profile_renders_options_trtllm_build_accepts(name):
    from precision_pipeline.resolve import plan as P
    from precision_pipeline.spec.default_model import ensure_default_model

    plan = P.evaluate(load_profile(name), ensure_default_model())
    argv = build_args(plan, Path("/ckpt"), Path("/eng"))
    assert check_build_args(argv) == []
    assert {a for a in argv if a.startswith("--")} <= set(FLAGS)


def test_the_parser_contract_finds_refusals():
    assert check_build_args(["--multi_block_mode", "enable"])[0].startswith("'--multi_block_mode' is not a trtllm-build option")
    assert check_build_args(["--logits_dtype", "bfloat16"]) == [
        "--logits_dtype 'bfloat16' is not one of float16, float32 (tensorrt_llm/commands/build.py parse_arguments())"]
    assert check_build_args(["--gemm_plugin", "fp4"])[0].startswith("--gemm_plugin 'fp4' is not one of")
    assert check_build_args(["--kv_cache_type", "PAGED", "--tokens_per_block", "32", "--gather_context_logits"]) == []
    assert check_build_args(["--max_batch_size"]) == [
        "--max_batch_size needs a value (tensorrt_llm/commands/build.py parse_arguments())"]
    assert check_build_args(["--context_fmha", "true"])[0].startswith("--context_fmha 'true' is not one of enable, disable")
