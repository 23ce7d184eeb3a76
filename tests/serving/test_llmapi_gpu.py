"""On a GPU node with TensorRT-LLM: a packed LLM-API unit loads through ``LLM(**args)`` as TensorRT-LLM's Triton
LLM-API model loads it (every model.yaml key but ``triton_config``; serving/llmapi_contract.py fact 3) and generates.

Skips on this CPU machine (no TensorRT-LLM: the CPU stand-in serves the unit here, tests/serving/test_llmapi_serve.py).
Set ``PRECISION_LLMAPI_UNIT`` to a packed ``llm_api_<h12>`` folder (e.g. ``<out>/model_repository/llm_api_...``)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("tensorrt_llm") is None,
    reason="TensorRT-LLM is not installed (CPU machine): here the LLM-API unit is served by the CPU stand-in")]


def test_unit_loads_through_the_llm_api():
    unit = os.environ.get("PRECISION_LLMAPI_UNIT")
    if not unit:
        pytest.skip("PRECISION_LLMAPI_UNIT is not set (a packed llm_api_<h12> folder)")
    from tensorrt_llm import LLM, SamplingParams

    from precision_pipeline.serving import llmapi_contract, llmapi_unit

    d = yaml.safe_load((Path(unit) / llmapi_unit.MODEL_YAML_FILE).read_text())
    assert llmapi_contract.check_model_yaml(d) == []
    args = {k: v for k, v in d.items() if k != llmapi_contract.TRITON_CONFIG_KEY}
    args["model"] = str(Path(unit) / llmapi_unit.CHECKPOINT_DIR)  # this machine's path of the unit's checkpoint
    llm = LLM(**args)
    try:
        out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))
        assert out[0].outputs[0].text.strip()
    finally:
        llm.shutdown()
