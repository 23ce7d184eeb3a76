"""GPU nodes only (marker ``gpu``): the argv we write is one the installed trtllm-build accepts.

Skipped here (no tensorrt_llm, no NVIDIA GPU). On a GPU node with ``tensorrt_llm>=1.2,<1.3``:
the toolchain probe finds it buildable, and every flag ``build_args`` writes (and every choice it
passes) appears in ``trtllm-build --help`` of the installed release.
"""

from __future__ import annotations

import subprocess

import pytest

from precision_pipeline.engine.toolchain import detect_toolchain
from precision_pipeline.engine.trtllm_build import build_args
from tests.engine.test_planted import CK, OUT, _fp8_paged_without_fp8_fmha, _mixed_fp8kv_paged

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def toolchain():
    tc = detect_toolchain()
    if not tc.tensorrt_llm or tc.trtllm_build is None or not tc.gpu_sms:
        pytest.skip("needs tensorrt_llm, trtllm-build on PATH and an NVIDIA GPU")
    return tc


def test_toolchain_is_buildable_on_this_gpu(toolchain):
    assert toolchain.reason_not_buildable(toolchain.gpu_sms[0]) is None
    assert toolchain.tensorrt_llm_version and toolchain.tensorrt_llm_version.startswith("1.2")


@pytest.mark.parametrize("make", [_mixed_fp8kv_paged, _fp8_paged_without_fp8_fmha])
def test_every_flag_we_write_is_known_to_trtllm_build(toolchain, make):
    help_text = subprocess.run([toolchain.trtllm_build, "--help"], capture_output=True, text=True, timeout=600).stdout
    argv = build_args(make(), CK, OUT)
    flags = [a for a in argv if a.startswith("--")]
    missing = [f for f in flags if f not in help_text]
    assert not missing, missing
