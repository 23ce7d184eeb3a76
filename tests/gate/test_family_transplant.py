"""Real weights in other families' classes (issue 29): the default model (SmolLM2-135M, a LlamaForCausalLM) transplanted
at test time into ``Qwen2ForCausalLM`` (the same weights, zero q/k/v biases) and ``MistralForCausalLM`` (a sliding window
longer than any prompt) computes the same function, so quantizing and gating them with the Llama build's profile
(fp8-h100 with the test checkpoints' 8 x 64 calibration) must give the Llama build's gate numbers, on both serving
routes: the TensorRT-LLM checkpoint (engine route; Qwen2 exported with ModelOpt's "qwen" decoder, Mistral with
"llama") and ModelOpt's unified HF checkpoint (llm_api route). Each family's checkpoint passes its verification
rules (``verify.family`` / ``hf.biases``) and the gate's model is the family's HF class with its biases / window.

Cost: the transplanted models and their checkpoints are cached like the other test checkpoints (``cached_transplant``;
the checkpoints keyed by the transplant's content fingerprint) and the gate's FP32 reference and BF16 floor of each
transplant in the gate's reference cache; one golden subset (tests/conftest.py ``GATE_SUBSET``: 1 prompt per category,
128 held-out tokens, 3 greedy tokens) is shared by the three families (``family_gates``), and the Llama build's two gate
runs are those of ``fp8_gates`` (shared with tests/gate/test_gate.py and tests/checkpoint/test_hf_unified.py)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from precision_pipeline.gate.options import GateOptions, GateRuntime
from tests.conftest import GATE_SUBSET

SUBSET = GateOptions(**GATE_SUBSET)
SLIDING_WINDOW = 8192
"""The Mistral transplant's window: the default model's max_position_embeddings, longer than any golden prompt."""
COPIED = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "num_key_value_heads",
          "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_theta", "tie_word_embeddings",
          "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act")


def transplant(model_dir: Path, arch: str, out: Path) -> Path:
    """``model_dir``'s weights (a Llama) in HF class ``arch`` (Qwen2ForCausalLM: zero q/k/v biases added;
    MistralForCausalLM: ``sliding_window`` = ``SLIDING_WINDOW``), saved with the tokenizer files into ``out``.
    Deterministic (same bytes each time: its fingerprint keys the caches). Raises when a weight has no place."""
    import torch
    import transformers
    from safetensors.torch import load_file

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    extra = {"Qwen2ForCausalLM": {"use_sliding_window": False},
             "MistralForCausalLM": {"sliding_window": SLIDING_WINDOW}}[arch]
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    conf = config_cls(**{k: cfg[k] for k in COPIED}, **extra, architectures=[arch], dtype="bfloat16")
    with torch.device("meta"):
        model = getattr(transformers, arch)(conf)
    src = load_file(str(Path(model_dir) / "model.safetensors"))
    state = {}
    for name, p in model.state_dict().items():
        if name in src:
            state[name] = src[name]
        elif name == "lm_head.weight" and conf.tie_word_embeddings:
            state[name] = src["model.embed_tokens.weight"]
        else:
            assert name.endswith(".bias"), f"{arch} has {name}, which the Llama weights do not fill"
            state[name] = torch.zeros(p.shape, dtype=torch.bfloat16)
    assert set(src) <= set(state), sorted(set(src) - set(state))[:3]
    model.load_state_dict(state, assign=True, strict=True)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    for p in Path(model_dir).iterdir():
        if p.is_file() and p.name not in ("config.json", "model.safetensors", "generation_config.json"):
            shutil.copy2(p, out / p.name)
    return out


def cached_transplant(model_dir: Path, arch: str, root: Path) -> Path:
    """``transplant(model_dir, arch, ...)`` made once per machine under ``root`` (the test checkpoints' cache,
    ``checkpoint_cache_root``) as ``transplant-<arch>-<key>/model``, keyed by the model's content fingerprint, the
    transformers version, ``transplant``'s source, ``COPIED`` and ``SLIDING_WINDOW``; built under a
    file lock into a folder swapped in whole (``atomic_dir``), as ``build_test_checkpoint`` does. Returns the folder."""
    import importlib.metadata as md
    import inspect

    from precision_pipeline.core.fingerprint import model_fingerprint
    from precision_pipeline.core.store import atomic_dir, hash_obj, locked

    key = hash_obj({"model": model_fingerprint(model_dir).sha256, "transformers": md.version("transformers"),
                    "src": inspect.getsource(transplant), "copied": COPIED, "window": SLIDING_WINDOW})[:16]
    folder = Path(root) / f"transplant-{arch}-{key}"
    with locked(Path(root) / f".transplant-{arch}.lock", timeout_s=3600):
        if not (folder / "done").is_file():
            with atomic_dir(folder) as tmp:
                transplant(model_dir, arch, tmp / "model")
                (tmp / "done").write_text("ok\n")
    return folder / "model"


@pytest.fixture(scope="session")
def transplants(default_model_dir, checkpoint_cache_root) -> dict[str, Path]:
    return {arch: cached_transplant(default_model_dir, arch, checkpoint_cache_root)
            for arch in ("Qwen2ForCausalLM", "MistralForCausalLM")}


@pytest.fixture(scope="session")
def family_gates(default_model_dir, transplants, fp8_gates, checkpoint_cache_root,
                 tmp_path_factory) -> dict[tuple[str, str], dict]:
    """{(architecture, route): {"metrics" (metrics.json), "verify" (the verifier's summary), "ckpt"}} for the Llama
    build (``fp8_gates``) and both transplants on both routes, gated on ``SUBSET`` against each model's own FP32
    reference (the transplants' runs write no reports: nothing here reads them)."""
    from precision_pipeline.checkpoint.verify import verify_checkpoint
    from precision_pipeline.gate.checkpoint_gate import gate_checkpoint
    from precision_pipeline.spec.profile import load_profile
    from tests.conftest import build_hf_export, build_test_checkpoint

    cache = tmp_path_factory.mktemp("gate-ref") if os.environ.get("PRECISION_TEST_CKPT_CACHE", "1") == "0" else None
    runtime = GateRuntime(progress=False, reference_cache=cache, write_report=False)
    fp8 = {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}
    out: dict[tuple[str, str], dict] = {}
    for route, res in fp8_gates.items():
        ckpt = Path(res.metrics["checkpoint_dir"])
        out[("LlamaForCausalLM", route)] = {"metrics": res.metrics, "verify": verify_checkpoint(ckpt, fp8), "ckpt": ckpt}
    for arch, model_dir in transplants.items():
        builds = {"engine": build_test_checkpoint("fp8", model_dir, checkpoint_cache_root),
                  "llm_api": build_hf_export("fp8", model_dir, checkpoint_cache_root)}
        for route, ckpt in builds.items():
            summary = verify_checkpoint(ckpt, fp8)
            thr = load_profile("fp8-h100").gate.for_model_dir(model_dir)
            res = gate_checkpoint(ckpt, model_dir, thr, tmp_path_factory.mktemp("gate") / "gate", SUBSET, runtime)
            out[(arch, route)] = {"metrics": res.metrics, "verify": summary, "ckpt": ckpt}
    return out


def _numbers(m: dict) -> dict[str, float]:
    return {k: m["metrics"][k]["value"] for k in ("kl_mean", "kl_p99", "top1")}


@pytest.mark.slow
@pytest.mark.parametrize("route", ["engine", "llm_api"])
@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "MistralForCausalLM"])
def test_transplant_gives_the_llama_builds_numbers(family_gates, arch, route):
    """KL mean, KL P99 and top-1 of the transplanted build equal the Llama build's to 1e-3 (issue 29 done-when)."""
    llama = _numbers(family_gates[("LlamaForCausalLM", route)]["metrics"])
    got = _numbers(family_gates[(arch, route)]["metrics"])
    assert got == pytest.approx(llama, abs=1e-3), (arch, route, got, llama)
    assert llama["kl_mean"] > 1e-3  # a real quantization error, not two unquantized models agreeing
    rules = family_gates[(arch, route)]["verify"]["rules"]
    assert ("verify.family" if route == "engine" else "hf.biases") in rules


@pytest.mark.slow
def test_transplant_checkpoints_are_the_familys(family_gates, transplants):
    """Qwen2: the TensorRT-LLM checkpoint says qwen_type qwen2 (else TensorRT-LLM builds Qwen 1's half-width MLP) and
    stores one unquantized [q; k; v] bias per layer; the HF export keeps q/k/v biases; the gate's model is
    Qwen2ForCausalLM with those (zero) biases. Mistral: exported as "llama", gated as MistralForCausalLM with the window."""
    from safetensors import safe_open

    from precision_pipeline.gate.model import load_checkpoint_model

    qwen = family_gates[("Qwen2ForCausalLM", "engine")]["ckpt"]
    cfg = json.loads((qwen / "config.json").read_text())
    assert (cfg["architecture"], cfg["qwen_type"], cfg["attn_bias"], cfg["mlp_bias"]) == ("Qwen2ForCausalLM", "qwen2", True, False)
    with safe_open(str(qwen / "rank0.safetensors"), "pt") as f:
        bias = f.get_tensor("transformer.layers.0.attention.qkv.bias")
        assert str(bias.dtype) == "torch.bfloat16" and list(bias.shape) == [(9 + 2 * 3) * 64] and not bias.any()
        assert not any(k.endswith("dense.bias") or k.endswith("mlp.fc.bias") for k in f.keys())
    hf = family_gates[("Qwen2ForCausalLM", "llm_api")]["ckpt"]
    with safe_open(str(hf / "model.safetensors"), "pt") as f:
        assert {k.rsplit(".", 2)[-2] for k in f.keys() if k.endswith(".bias")} == {"q_proj", "k_proj", "v_proj"}
    model = load_checkpoint_model(qwen, transplants["Qwen2ForCausalLM"])
    attn = model.model.layers[0].self_attn
    assert type(model).__name__ == "Qwen2ForCausalLM" and attn.k_proj.bias.shape == (192,) and attn.o_proj.bias is None
    mis = family_gates[("MistralForCausalLM", "engine")]["ckpt"]
    assert json.loads((mis / "config.json").read_text())["architecture"] == "MistralForCausalLM"
    model = load_checkpoint_model(mis, transplants["MistralForCausalLM"])
    assert type(model).__name__ == "MistralForCausalLM" and model.config.sliding_window == SLIDING_WINDOW
