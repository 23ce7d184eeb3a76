"""The accuracy gate's readers of MoE (and Qwen3) checkpoints: the unified HF checkpoint of a family read in its own HF
names (``spec.families`` ``Family.hf_read``: Qwen3 (dense, QK-norm), Qwen3-MoE, Mixtral, Qwen2-MoE; ``load_hf_moe_model``,
run by the gate stage through ``load_gate_model``) and gpt-oss's
HF checkpoint as shipped with MXFP4 experts (``load_gpt_oss_mxfp4``, run by the gate stage for a ``--checkpoint`` of that
layout, ``checkpoint.reader.checkpoint_layout`` ``hf_mxfp4``).

``load_hf_moe_model(ckpt_dir, hf_model_dir)`` builds the family's HF class (``transformers.<architecture>``, from
``hf_model_dir``'s ``config.json``) and fills it with the checkpoint, dequantized to float32
(``checkpoint.hf_unified.dequantize_hf_moe``): every linear (attention, each expert, ``lm_head``) becomes the gate's
``QuantLinear`` with its input fake-quant (FP8: the checkpoint's ``input_scale``; fused q/k/v and each expert's
gate/up and a shared expert's gate/up with the max of the group's scales, as TensorRT-LLM's PyTorch backend loads
them); the embedding, the norms (Qwen3's q/k norms included), the router and a shared-expert gate (kept unquantized by
the export, ``hf.router``) are loaded as stored. The router's top-k routing (and Qwen2-MoE's sigmoid shared-expert
gate) is the HF class's own. ``invoke build`` runs it on route llm_api (``Family.build_gaps``); the slow tests
``tests/quantize/test_moe_families.py`` build a tiny random model of each family through it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from precision_pipeline.checkpoint.codecs import FIELD
from precision_pipeline.core.errors import UserError
from precision_pipeline.gate.model import QuantLinear, act_fake_quant

_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
          "num_experts", "num_local_experts", "moe_intermediate_size", "shared_expert_intermediate_size", "vocab_size")


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor, dtype: torch.dtype) -> None:
    """``model``'s parameter ``name`` (dotted) := ``value``; UserError when the model has none or its shape differs."""
    mod_name, _, leaf = name.rpartition(".")
    try:
        mod = model.get_submodule(mod_name)
        old = getattr(mod, leaf)
    except AttributeError:
        raise UserError(FIELD, f"{name} is not a tensor of the HF {type(model).__name__}.", "re-export the checkpoint.")
    if not isinstance(old, torch.Tensor) or tuple(old.shape) != tuple(value.shape):
        raise UserError(FIELD, f"{name} has shape {tuple(value.shape)}; the model expects "
                        f"{tuple(getattr(old, 'shape', ()))}.", "use the HF folder the checkpoint was made from.")
    setattr(mod, leaf, nn.Parameter(value.to(dtype), requires_grad=False))


def load_hf_moe_model(ckpt_dir: Path, hf_model_dir: Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The HF model (a ``Family.hf_read`` family's class) that computes what the unified HF checkpoint ``ckpt_dir`` says, on CPU, in ``dtype`` (module
    doc). ``hf_model_dir``: the HF folder it was exported from (its config; sizes checked against the checkpoint's).
    Raises UserError for another family or format (``dequantize_hf_moe``), disagreeing sizes, a tensor the model
    lacks, a linear the checkpoint lacks, or a parameter left unfilled."""
    import transformers
    from transformers import AutoConfig

    from precision_pipeline.checkpoint.hf_unified import dequantize_hf_moe

    cfg, linears, plain = dequantize_hf_moe(Path(ckpt_dir))
    hf_cfg = AutoConfig.from_pretrained(str(hf_model_dir))
    bad = {k: (cfg.get(k), getattr(hf_cfg, k, None)) for k in _SIZES if cfg.get(k) != getattr(hf_cfg, k, None)}
    if bad or (cfg.get("architectures") or [None])[0] != (hf_cfg.architectures or [None])[0]:
        raise UserError(FIELD, "checkpoint and HF config disagree: " + ", ".join(f"{k} {a} vs {b}" for k, (a, b) in
                        bad.items()) + f" (architectures {cfg.get('architectures')} vs {hf_cfg.architectures}).",
                        "pass the HF folder the checkpoint was exported from.")
    hf_cfg.tie_word_embeddings = False
    with torch.device("meta"):
        model = getattr(transformers, hf_cfg.architectures[0])(hf_cfg)
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, nn.Linear):
            continue
        spec = linears.pop(name, None)
        if spec is None and name + ".weight" in plain:  # the router: stored unquantized, loaded as a plain Linear
            continue
        if spec is None:
            raise UserError(FIELD, f"{name}.weight is missing.", "re-export the checkpoint.")
        if tuple(spec.weight.shape) != tuple(mod.weight.shape) or (spec.bias is None) != (mod.bias is None):
            raise UserError(FIELD, f"{name} is {tuple(spec.weight.shape)} (bias {spec.bias is not None}); the model "
                            f"expects {tuple(mod.weight.shape)} (bias {mod.bias is not None}).",
                            "use the HF folder the checkpoint was made from.")
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr,
                QuantLinear(spec, act_fake_quant(spec.quant_algo) if spec.quantized else None, dtype))
    if linears:
        raise UserError(FIELD, f"{', '.join(sorted(linears)[:5])} are linears the HF model does not have.",
                        "use the HF folder the checkpoint was made from.")
    for name, t in plain.items():
        _set_tensor(model, name, t, dtype)
    for name, mod in list(model.named_modules()):  # the family's own RoPE (Qwen2-MoE also keeps one per attention layer)
        if name.endswith("rotary_emb"):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, type(mod)(config=hf_cfg, device="cpu"))
    left = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p is not None and p.is_meta]
    if left:
        raise UserError(FIELD, f"no checkpoint tensor for {', '.join(left[:5])}.", "re-export the checkpoint.")
    return model.eval()


def load_gpt_oss_mxfp4(ckpt_dir: Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """gpt-oss's HF checkpoint as shipped (``spec.families`` ``GPT_OSS``: ``config.json`` ``quantization_config.quant_method``
    ``mxfp4``; each expert projection stored as ``<stem>_blocks`` uint8 ``[E, out, in/32, 16]`` and ``<stem>_scales``
    uint8 ``[E, out, in/32]``, transformers ``integrations/mxfp4.py``) as an HF ``GptOssForCausalLM`` on CPU in ``dtype``:
    every expert weight decoded by the MXFP4 codec (``codecs.dequant_mx_blocks``, E2M1 x 2^(E8M0 - 127)) and transposed
    to the HF parameter's ``[E, in, out]``; every other tensor (attention with its biases and sinks, router, norms,
    embedding, lm_head, expert biases) loaded as stored. Weight-only: no activation fake-quant (what W4A16_MXFP4 runs on
    Hopper, spec/formats.py SRC_MX_MOE). The gate stage runs it through ``load_gate_model``. Raises
    UserError for another architecture, a checkpoint that is not mxfp4, a block without its scales, a tensor the
    model lacks or a parameter left unfilled."""
    import json

    import transformers
    from safetensors.torch import load_file

    from precision_pipeline.checkpoint.codecs import dequant_mx_blocks
    from precision_pipeline.spec.families import GPT_OSS

    d = Path(ckpt_dir)
    raw = json.loads((d / "config.json").read_text())
    if (raw.get("architectures") or [None])[0] != GPT_OSS.architecture or \
            (raw.get("quantization_config") or {}).get("quant_method") != "mxfp4":
        raise UserError(FIELD, f"{d} is not a {GPT_OSS.architecture} checkpoint with quant_method mxfp4 (architectures "
                        f"{raw.get('architectures')}, quantization_config {raw.get('quantization_config')}).",
                        "pass gpt-oss's HF folder as shipped.")
    st: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        st.update(load_file(str(f)))
    hf_cfg = transformers.AutoConfig.from_pretrained(str(d))
    with torch.device("meta"):
        model = transformers.GptOssForCausalLM(hf_cfg)
    for name in sorted(n for n in st if n.endswith("_blocks")):
        stem = name[: -len("_blocks")]
        if stem + "_scales" not in st:
            raise UserError(FIELD, f"{name} has no {stem}_scales beside it.", "re-export the checkpoint.")
        w = dequant_mx_blocks(st.pop(name), st.pop(stem + "_scales"), stem)  # [E, out, in]
        _set_tensor(model, stem, w.transpose(1, 2).contiguous(), dtype)
    for name, t in st.items():
        _set_tensor(model, name, t.to(torch.float32), dtype)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=hf_cfg, device="cpu")
    left = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p is not None and p.is_meta]
    if left:
        raise UserError(FIELD, f"no checkpoint tensor for {', '.join(left[:5])}.", "re-export the checkpoint.")
    return model.eval()


def load_gate_model(ckpt_dir: Path, hf_model_dir: Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> nn.Module:
    """The gate stage's candidate model of ``ckpt_dir``: ``load_gpt_oss_mxfp4`` for an HF checkpoint with MXFP4
    experts as gpt-oss ships it (``checkpoint.reader.checkpoint_layout`` ``hf_mxfp4``; ``hf_model_dir`` is then only
    the reference's folder), ``load_hf_moe_model`` for the unified HF checkpoint of a MoE
    family with ``Family.hf_read`` (``spec.families``; Qwen3, Qwen3-MoE, Mixtral, Qwen2-MoE), else ``gate.model.load_checkpoint_model`` (either layout of the
    dense families); ``device="cuda"``: placed over the visible GPUs (``place_on_cuda``). Raises UserError as they do."""
    import json

    from precision_pipeline.checkpoint.reader import checkpoint_layout
    from precision_pipeline.gate.model import load_checkpoint_model, place_on_cuda
    from precision_pipeline.spec.families import FAMILIES

    d = Path(ckpt_dir)
    if checkpoint_layout(d) == "hf_mxfp4":  # gpt-oss's MXFP4 checkpoint as shipped (--checkpoint)
        model = load_gpt_oss_mxfp4(d, dtype)
        return place_on_cuda(model) if device == "cuda" else model
    if checkpoint_layout(d) == "hf_unified":
        arch = (json.loads((d / "config.json").read_text()).get("architectures") or [None])[0]
        fam = FAMILIES.get(arch)
        if fam is not None and fam.hf_read:
            model = load_hf_moe_model(d, Path(hf_model_dir), dtype)
            return place_on_cuda(model) if device == "cuda" else model
    return load_checkpoint_model(d, Path(hf_model_dir), dtype=dtype, device=device)


__all__ = ["load_hf_moe_model", "load_gpt_oss_mxfp4", "load_gate_model"]
