"""The tasks as a user runs them: exit codes and one-paragraph errors for bad input.

Each bad input must end with exit code 2, name the field, give a fix, print no traceback,
and leave the output directory exactly as it was. One case (``unknown-profile``) and ``--list`` run in a new
process as a user runs them; the others through Invoke's own ``program`` in this process (fixture
``invoke_here``: same parsing, tasks.py, exit codes and text, without a new Python per case).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from precision_pipeline.core.store import hash_dir

ROOT = Path(__file__).resolve().parent.parent
INVOKE = [sys.executable, "-m", "invoke"]


def run_task(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="200")
    return subprocess.run([*INVOKE, *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture()
def previous_output(tmp_path) -> Path:
    """An output directory holding a previous build (must be left untouched)."""
    from precision_pipeline.core.outputs import write_output_marker

    out = tmp_path / "out"
    (out / "checkpoint").mkdir(parents=True)
    write_output_marker(out, "fp8-h100")  # what a build writes first: the folder is a build output
    (out / "manifest.json").write_text('{"profile": "earlier"}\n')
    (out / "plan.json").write_text("{}\n")
    (out / "checkpoint" / "config.json").write_text('{"quantization": {"quant_algo": "FP8"}}\n')
    return out


def _profile(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    return p


CASES = {
    "unknown-profile": (lambda d: "nope", ["--profile", "no shipped profile named 'nope'"]),
    "misspelt-key": (lambda d: str(_profile(d, "extends: fp8-h100\nquantization:\n  kv_cache_quant_alg: FP8\n")),
                     ["quantization.kv_cache_quant_alg", "did you mean 'kv_cache_quant_algo'"]),
    "fp8-on-a100": (lambda d: str(_profile(d, "extends: fp8-h100\ntarget:\n  gpu: a100-80gb\n")),
                    ["quantization.quant_algo", "FP8"]),
    "nvfp4-on-h100": (lambda d: str(_profile(d, "extends: nvfp4-b200\ntarget:\n  gpu: h100-sxm\n")),
                      ["quantization.quant_algo", "NVFP4"]),
    "tp2-with-9-heads": (lambda d: str(_profile(d, "extends: fp8-h100\nparallel:\n  tp_size: 2\ndeployment:\n  gpus_per_replica: 2\n")),
                         ["parallel.tp_size", "9"]),
    "input-above-seq": (lambda d: str(_profile(d, "extends: fp8-h100\nbuild:\n  max_input_len: 9000\n  max_seq_len: 8192\n")),
                        ["build.max_input_len", "8,192"]),
}


MIXED = "extends: mixed-fp8-int4-h100\nquantization:\n"
CASES.update({
    "mixed-bits-below-candidates": (lambda d: str(_profile(d, MIXED + "  auto_quantize_bits: 3.0\n")),
                                    ["quantization.auto_quantize_bits", "below the cheapest candidate"]),
    "mixed-sq-candidate": (lambda d: str(_profile(d, MIXED + "  auto_quantize_formats: [FP8, W8A8_SQ_PER_CHANNEL]\n")),
                           ["quantization.auto_quantize_formats", "cannot be a per-layer search candidate"]),
    "int8-kv": (lambda d: str(_profile(d, "extends: fp8-h100\nquantization:\n  kv_cache_quant_algo: INT8\n"
                                       "context_phase:\n  use_paged_context_fmha: false\n  use_fp8_context_fmha: false\n"
                                       "runtime:\n  enable_kv_cache_reuse: false\n")),
                ["quantization.kv_cache_quant_algo", "INT8"]),
    "keep-every-layer": (lambda d: str(_profile(d, "extends: fp8-h100\nquantization:\n  keep_first_layers: 999\n")),
                         ["quantization.keep_first_layers", "nothing would be quantized"]),
})


def _model_folder(d: Path, kind: str) -> str:
    import shutil

    from precision_pipeline.spec.default_model import ensure_default_model

    m = d / f"model-{kind}"
    m.mkdir()
    src = ensure_default_model()
    if kind == "json-list":  # weights and tokenizer present: only config.json is wrong
        (m / "config.json").write_text("[1, 2]")
        for f in src.iterdir():
            if f.is_file() and f.name != "config.json":
                (m / f.name).symlink_to(f)
    else:
        shutil.copy2(src / "config.json", m / "config.json")
        if kind == "no-tokenizer":
            (m / "model.safetensors").symlink_to(src / "model.safetensors")
    return str(m)


# --model folders that are not usable models (previously: a traceback after plan.json was written)
MODEL_CASES = {
    "json-list": ["--model", "is not a JSON object"],
    "no-weights": ["--model", "has no *.safetensors weights"],
    "no-tokenizer": ["--model", "has no tokenizer"],
}


def _broken_mixed_checkpoint(d: Path) -> str:
    """config.json says MIXED_PRECISION, quant_cfg.json is missing."""
    import json

    from safetensors.torch import save_file
    import torch

    c = d / "ckpt"
    c.mkdir()
    (c / "config.json").write_text(json.dumps({"architecture": "LlamaForCausalLM", "mapping": {"world_size": 1, "tp_size": 1},
                                               "quantization": {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": "FP8"}}))
    save_file({"lm_head.weight": torch.zeros(2, 2, dtype=torch.bfloat16)}, str(c / "rank0.safetensors"))
    return str(c)


def _check_bad_build(args: list[str], expected: list[str], previous_output: Path, run=run_task) -> None:
    before = hash_dir(previous_output)
    r = run("build", *args, "--out", str(previous_output))
    text = r.stdout + r.stderr
    assert r.returncode == 2, text
    assert "Traceback" not in text
    for needle in expected:
        assert needle in text, f"{needle!r} not in:\n{text}"
    assert "fix:" in text
    assert hash_dir(previous_output) == before


@pytest.mark.parametrize("kind", sorted(MODEL_CASES))
def test_bad_model_folder_exits_2_and_changes_nothing(kind, tmp_path, previous_output, invoke_here):
    _check_bad_build(["--profile", "fp8-h100", "--model", _model_folder(tmp_path, kind)], MODEL_CASES[kind], previous_output,
                     invoke_here)


def test_broken_reused_checkpoint_exits_2_and_changes_nothing(tmp_path, previous_output, invoke_here):
    _check_bad_build(["--profile", "mixed-fp8-int4-h100", "--checkpoint", _broken_mixed_checkpoint(tmp_path)],
                     ["quant_cfg.json is missing"], previous_output, invoke_here)


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_exits_2_and_changes_nothing(case, tmp_path, previous_output, invoke_here):
    make, expected = CASES[case]
    _check_bad_build(["--profile", make(tmp_path)], expected, previous_output,
                     run_task if case == "unknown-profile" else invoke_here)
    assert sorted(p.name for p in previous_output.parent.iterdir()) == ["bad.yaml", "out"] or \
        sorted(p.name for p in previous_output.parent.iterdir()) == ["out"]


def test_list_shows_every_task_with_help():
    r = run_task("--list")
    assert r.returncode == 0
    for name in ("build", "check", "schema", "profiles", "bench", "test"):
        line = next((ln for ln in r.stdout.splitlines() if ln.strip().startswith(name + " ")), "")
        assert len(line.split()) > 1, f"task {name} has no one-line help: {r.stdout}"
