"""Per-layer precision search (``quantization.auto_quantize_bits``) with ModelOpt 0.47 ``auto_quantize``.

``mtq.auto_quantize`` calibrates every candidate format, scores each layer group's sensitivity
(``method="gradient"``: the next-token loss of the calibration text, so the calibration batches
double as labels), and picks one format per group -- or no quantization -- so that the weight
bits stay within a budget. The result exports (``export_tensorrt_llm_checkpoint(...,
inference_tensor_parallel=1)``; ModelOpt 0.47 needs the 1 passed explicitly here) as a
TensorRT-LLM checkpoint with ``quantization.quant_algo = MIXED_PRECISION`` in ``config.json`` and
``quant_cfg.json`` = ``{"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": ...,
"quantized_layers": {"transformer.layers.0.attention.qkv": {"quant_algo": "W4A16_AWQ",
"group_size": 64, ...}, "transformer.layers.0.mlp.fc": {"quant_algo": "FP8"}, ...}}``. Layers not
listed there (``lm_head``, layers the search left unquantized) stay in the checkpoint dtype.

Candidate formats (profile names, ``precision_pipeline.spec.profile.QuantAlgo``) -> ModelOpt configs
(the registry's ``GemmFormat.search_bits`` / ``modelopt_preset`` / ``aliases`` /
``search_cuda_only``, ``precision_pipeline.spec.formats``):

=============  =======================================================================
FP8            ``FP8_DEFAULT_CFG`` (8 bits in the search's cost model)
W4A16_AWQ      ``INT4_AWQ_CFG`` with ``*weight_quantizer`` ``block_sizes[-1] = group_size``
               (4 bits); alias ``INT4_AWQ``
NVFP4          ``NVFP4_DEFAULT_CFG``: refused without CUDA -- ModelOpt's fake-quant forward
               asserts "amax must be a CUDA tensor for dynamic block quantization" on CPU
=============  =======================================================================

Other formats are refused (not verified in a MIXED_PRECISION checkpoint here).

Budget semantics -- ``effective_bits`` is the average bits per weight over the *searched* linear
layers (every linear not matched by ``disabled_layers``), with 16 for a layer left unquantized.
ModelOpt's own constraint averages over every linear including the disabled ones, counted at 16
bits; with ``lm_head`` disabled on SmolLM2-135M (tied 49152 x 576 head = 21% of the linear
weights) no ModelOpt budget below ~6.5 would be feasible. So the budget is translated:
``modelopt_bits = (effective_bits * W_searched + 16 * W_disabled) / W_total`` (W = weight
element counts), and the achieved figure is translated back. Both are reported. The cost model
counts weight elements only (no block scales), as ModelOpt's does.

Grouping: ModelOpt ties q/k/v and gate/up to one format (TensorRT-LLM fuses them), so the
per-layer table has one format per TensorRT-LLM GEMM.

Group size (AWQ): the largest of 128, 64, 32, 16 that divides the input width of every searched
linear, unless given; an explicit group size that does not divide is a ``UserError``
(``quantization.group_size``). The default model's hidden size 576 gives 64.

Calibration runs the model in FP32 (as build/precision_pipeline/quantize/ptq.py does; faster than BF16 on CPU); export
writes unquantized tensors in BF16.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from precision_pipeline.core.errors import UserError
from precision_pipeline.core.store import atomic_dir, atomic_write_json
from precision_pipeline.spec.families import family_of_model_type, trtllm_name
from precision_pipeline.spec.formats import (FIELD_SEARCH_BITS, FIELD_SEARCH_FORMATS, GEMM, SEARCH_BITS,
                                             SEARCH_CANDIDATES, check_search_bits, normalize_candidates)
from precision_pipeline.spec.profile import QuantAlgo

FIELD_BITS = FIELD_SEARCH_BITS
FIELD_FORMATS = FIELD_SEARCH_FORMATS
FIELD_GROUP = "quantization.group_size"
FIELD_CALIB = "calibration.dataset"

# profile format -> (ModelOpt config name, weight bits in the search cost model), from the registry
CANDIDATES: dict[str, tuple[str, int]] = {f.value: (f.modelopt_preset, f.search_bits) for f in SEARCH_CANDIDATES}
GROUP_CHOICES = (128, 64, 32, 16)
NO_QUANT = QuantAlgo.NO_QUANT.value
FORMAT_BITS = SEARCH_BITS  # {format: bits in the search's cost model}, NO_QUANT = 16

# ModelOpt export's per-module format string (modelopt/torch/export/model_config.py) -> profile name
MODELOPT_FORMAT = {None: NO_QUANT, **{f.modelopt_format: f.value for f in GEMM.values() if f.modelopt_format}}
check_bits = check_search_bits  # the search budget's input check (one home: spec/formats.py)


@dataclass
class AutoQuantStats:
    """What the search did (times in seconds)."""

    effective_bits_budget: float
    effective_bits_achieved: float  # over the searched layers (our definition)
    modelopt_effective_bits_budget: float  # ModelOpt's constraint (all linears, disabled at 16)
    modelopt_effective_bits_achieved: float
    constraint_satisfied: bool
    formats: list[str]
    group_size: int | None
    disabled_layers: list[str]
    method: str
    score: float
    weights_searched: int
    weights_disabled: int
    counts: dict[str, int] = field(default_factory=dict)  # HF linears per format
    search_s: float = 0.0
    calibration_batches: int = 0
    calibration_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------------------------
# Inputs


def normalize_formats(formats: Iterable[Any], cuda_available: bool | None = None) -> list[str]:
    """Profile format names (``QuantAlgo`` members or strings, aliases accepted), validated.

    Raises ``UserError`` (``quantization.auto_quantize_formats``) for an empty list, an unknown
    or unsupported format, or NVFP4 without CUDA (``spec.formats.normalize_candidates``; this
    wrapper only asks torch whether CUDA is there when ``cuda_available`` is None).
    """
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    return normalize_candidates(formats, cuda_available)


def _linears(model: Any) -> list[tuple[str, Any]]:
    import torch

    return [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def _is_disabled(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatch(name, p) for p in patterns)


def choose_group_size(model: Any, disabled_layers: Sequence[str], group_size: int | None = None) -> int:
    """The AWQ block size: ``group_size`` if it divides every searched linear's input width (else
    UserError), or the largest of 128/64/32/16 that does."""
    widths = sorted({m.in_features for n, m in _linears(model) if not _is_disabled(n, disabled_layers)})
    if group_size is not None:
        bad = [w for w in widths if w % group_size]
        if group_size < 1 or bad:
            ok = [g for g in GROUP_CHOICES if all(w % g == 0 for w in widths)]
            raise UserError(FIELD_GROUP, f"AWQ group size {group_size} does not divide the input width(s) "
                            f"{bad or widths} of the searched layers.",
                            f"use {ok[0]}." if ok else "use a group size that divides every layer width.")
        return group_size
    for g in GROUP_CHOICES:
        if all(w % g == 0 for w in widths):
            return g
    raise UserError(FIELD_GROUP, f"no AWQ group size in {GROUP_CHOICES} divides the layer widths {widths}.",
                    "drop W4A16_AWQ from the candidates.")


def _modelopt_config(fmt: str, group_size: int | None) -> dict:
    import modelopt.torch.quantization as mtq

    cfg = copy.deepcopy(getattr(mtq, CANDIDATES[fmt][0]))
    if GEMM[fmt].modelopt_adjust == "int4_block":
        for e in cfg["quant_cfg"]:
            if isinstance(e, dict) and e.get("quantizer_name") == "*weight_quantizer":
                e["cfg"] = dict(e["cfg"], block_sizes={**e["cfg"]["block_sizes"], -1: group_size})
    return cfg


def _as_batches(calib_batches: Any, vocab_size: int | None) -> list[Any]:
    """LongTensor batches [b, seq] from a CalibrationSet, tensors or lists of token-id lists."""
    import torch

    if hasattr(calib_batches, "batches") and hasattr(calib_batches, "samples"):
        calib_batches = calib_batches.batches(8)
    out = []
    for i, b in enumerate(calib_batches or []):
        t = b if isinstance(b, torch.Tensor) else torch.tensor(b, dtype=torch.long)
        if t.dim() == 1:
            t = t.unsqueeze(0)
        if t.dim() != 2 or t.numel() == 0 or t.dtype not in (torch.long, torch.int32, torch.int64):
            raise UserError(FIELD_CALIB, f"calibration batch {i} is not a non-empty [batch, seq] array of token ids.",
                            "pass batches of equal-length token-id lists (precision_pipeline.quantize.calibration CalibrationSet.batches).")
        if t.shape[1] < 2:
            raise UserError(FIELD_CALIB, f"calibration batch {i} has sequences of {t.shape[1]} token(s); the "
                            "search's next-token loss needs at least 2.", "use longer calibration samples.")
        if vocab_size is not None and (int(t.min()) < 0 or int(t.max()) >= vocab_size):
            raise UserError(FIELD_CALIB, f"calibration batch {i} has token ids outside [0, {vocab_size}).",
                            "encode the calibration text with the model's own tokenizer.")
        out.append(t.long())
    if not out:
        raise UserError(FIELD_CALIB, "no calibration batches for the per-layer search.",
                        "give real-text calibration samples (calibration.num_samples >= 1).")
    return out


# --------------------------------------------------------------------------------------------
# Search


def _per_layer_formats(model: Any) -> dict[str, str]:
    from modelopt.torch.export.quant_utils import get_quantization_format

    out = {}
    for n, m in _linears(model):
        fmt = get_quantization_format(m)
        out[n] = MODELOPT_FORMAT.get(fmt, str(fmt).upper())
    return out


def run_search(model: Any, calib_batches: Any, effective_bits: float, formats: Sequence[Any],
                disabled_layers: Sequence[str] = ("*lm_head*",), group_size: int | None = None,
                method: str = "gradient", verbose: bool = False,
                progress: Any = None) -> tuple[Any, dict[str, str], AutoQuantStats]:
    """``auto_quantize_model`` plus the search's figures: ``(model, {hf linear: format}, AutoQuantStats)``.

    ``progress``: a ``core.progress.StageProgress``; each ``forward_step`` of the search counts as
    one step of its ``per-layer search`` phase (total: one calibration pass per format plus one
    scoring pass, ``len(batches) * (len(formats) + 1)``, ModelOpt's count as configured below).
    """
    import modelopt.torch.quantization as mtq

    fmts = normalize_formats(formats)
    eb = check_bits(effective_bits, fmts)
    if method not in ("gradient", "kl_div"):
        raise UserError("method", f"{method!r} is not an auto_quantize method.", "use 'gradient' or 'kl_div'.")
    disabled = [disabled_layers] if isinstance(disabled_layers, str) else list(disabled_layers or [])
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    batches = _as_batches(calib_batches, vocab)
    dev = next(model.parameters()).device  # the model's first device (device_map models: the embedding's GPU)
    batches = [b.to(dev) for b in batches]  # a no-op on the CPU

    lin = _linears(model)
    w_dis = sum(m.weight.numel() for n, m in lin if _is_disabled(n, disabled))
    w_all = sum(m.weight.numel() for n, m in lin)
    w_srch = w_all - w_dis
    if w_srch == 0:
        raise UserError("disabled_layers", f"the patterns {disabled} exclude every linear layer.", "exclude fewer layers.")
    group = choose_group_size(model, disabled, group_size) if any(GEMM[f].grouping == "per_group" for f in fmts) else None
    mo_budget = (eb * w_srch + 16.0 * w_dis) / w_all
    cfgs = [_modelopt_config(f, group) for f in fmts]

    data = [{"input_ids": b} for b in batches]
    if method == "gradient":
        extra = {"loss_func": lambda out, batch: out.loss}

        def forward_step(m, batch):
            return m(input_ids=batch["input_ids"], labels=batch["input_ids"], use_cache=False)
    else:
        extra = {}

        def forward_step(m, batch):
            return m(input_ids=batch["input_ids"], use_cache=False).logits

    if progress is not None:
        phase = progress.phase("per-layer search", total=len(data) * (len(cfgs) + 1), unit="steps")
        inner = forward_step

        def forward_step(m, batch):  # noqa: F811 - the counted wrapper of the step above
            out = inner(m, batch)
            phase.advance()
            return out

    t0 = time.perf_counter()
    try:
        model, state = mtq.auto_quantize(
            model, constraints={"effective_bits": mo_budget}, quantization_formats=cfgs, data_loader=data,
            forward_step=forward_step, disabled_layers=disabled, num_calib_steps=len(data),
            num_score_steps=len(data), verbose=verbose, method=method, **extra)
    except ValueError as e:
        if "infeasible" in str(e):
            raise UserError(FIELD_BITS, f"ModelOpt finds the budget infeasible: {e}",
                            "raise quantization.auto_quantize_bits or disable fewer layers.")
        raise
    search_s = time.perf_counter() - t0
    if progress is not None:
        phase.finish()
    # auto_quantize turns on gradient checkpointing for HF models (its gradient scoring); undo it
    if getattr(model, "is_gradient_checkpointing", False) and hasattr(model, "gradient_checkpointing_disable"):
        model.gradient_checkpointing_disable()
    per_layer = _per_layer_formats(model)
    for n in per_layer:
        if _is_disabled(n, disabled) and per_layer[n] != NO_QUANT:
            raise RuntimeError(f"disabled layer {n} came back quantized as {per_layer[n]}")
    achieved = sum(FORMAT_BITS.get(per_layer[n], 16) * m.weight.numel() for n, m in lin
                   if not _is_disabled(n, disabled)) / w_srch
    best = state.get("best", {})
    mo_achieved = float((best.get("constraints") or {}).get("effective_bits", float("nan")))
    counts: dict[str, int] = {}
    for f in per_layer.values():
        counts[f] = counts.get(f, 0) + 1
    stats = AutoQuantStats(
        effective_bits_budget=eb, effective_bits_achieved=round(achieved, 6),
        modelopt_effective_bits_budget=round(mo_budget, 6), modelopt_effective_bits_achieved=round(mo_achieved, 6),
        constraint_satisfied=bool(best.get("is_satisfied", False)) and achieved <= eb + 1e-9,
        formats=fmts, group_size=group, disabled_layers=disabled, method=method,
        score=float(best.get("score", float("nan"))), weights_searched=int(w_srch), weights_disabled=int(w_dis),
        counts=dict(sorted(counts.items())), search_s=round(search_s, 3), calibration_batches=len(batches),
        calibration_tokens=int(sum(b.numel() for b in batches)))
    return model, per_layer, stats


def auto_quantize_model(model: Any, calib_batches: Any, effective_bits: float, formats: list[str],
                        disabled_layers: Sequence[str] = ("*lm_head*",), group_size: int | None = None,
                        method: str = "gradient") -> tuple[Any, dict[str, str]]:
    """Search one format per layer group of ``model`` under an ``effective_bits`` budget.

    ``calib_batches``: real-text token ids -- a ``precision_pipeline.quantize.calibration.CalibrationSet``, or a list of
    ``[batch, seq]`` LongTensors / lists of equal-length token-id lists. ``formats``: candidates
    (``FP8``, ``W4A16_AWQ``; ``NVFP4`` only with CUDA). ``effective_bits``: average weight bits
    over the searched layers (module docstring). Returns ``(model, {hf_linear_name: format})``
    with every ``nn.Linear`` listed (``NO_QUANT`` for disabled or unquantized ones); the model is
    quantized in place (fake-quant) and ready for ``export_tensorrt_llm_checkpoint``.
    Raises ``UserError`` (exit 2) for unsupported formats, NVFP4 on CPU, a budget below the
    cheapest candidate or infeasible, a group size that does not divide, bad calibration batches.
    """
    model, per_layer, _ = run_search(model, calib_batches, effective_bits, formats, disabled_layers, group_size,
                                      method)
    return model, per_layer


# --------------------------------------------------------------------------------------------
# Export


def auto_quantize_export(model_dir: Path, calib_token_batches: Any, effective_bits: float, formats: list[str],
                         out_dir: Path, logits_dtype: str = "float32",
                         disabled_layers: Sequence[str] = ("*lm_head*",), group_size: int | None = None,
                         method: str = "gradient") -> dict:
    """Load the HF Llama model in ``model_dir`` (FP32), search per-layer formats, export a
    MIXED_PRECISION TensorRT-LLM checkpoint (tp 1) to ``out_dir`` (atomic).

    ``out_dir`` gets ModelOpt's ``config.json`` (``logits_dtype`` set), ``quant_cfg.json``,
    ``rank0.safetensors`` and ``autoquant.json`` (the returned dict). Returns, for the plan and
    manifest: ``quant_algo`` ("MIXED_PRECISION"), ``per_layer`` ({TensorRT-LLM module name:
    format}, unquantized ones included as NO_QUANT), ``per_layer_hf`` ({HF linear: format}),
    ``quantized_layers`` (quant_cfg.json's table), the stats (``effective_bits_budget``,
    ``effective_bits_achieved``, ModelOpt's whole-model figures, ``constraint_satisfied``,
    ``counts``, ``group_size``, ``search_s``...), ``export_s``, ``checkpoint_bytes``, ``tp_size`` 1.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    fmts = normalize_formats(formats)  # refuse before loading anything
    check_bits(effective_bits, fmts)
    if logits_dtype not in ("float32", "float16", "bfloat16"):
        raise UserError("build.logits_dtype", f"{logits_dtype!r} is not a logits dtype.", "use float32 or float16.")
    hf_cfg = AutoConfig.from_pretrained(str(model_dir))
    fam = family_of_model_type(getattr(hf_cfg, "model_type", ""))
    if fam is None or fam.export_decoder is None or fam.moe is not None:  # spec/families.py: dense exported families
        raise UserError("model", f"{model_dir} is a {getattr(hf_cfg, 'model_type', '?')} model; the per-layer "
                        "search exports Llama-architecture models only.", "use a Llama-family model.")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    from precision_pipeline.quantize.finite import refuse_non_finite

    refuse_non_finite(model, model_dir)
    model, per_layer_hf, stats = run_search(model, calib_token_batches, effective_bits, fmts, disabled_layers,
                                             group_size, method)

    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    with atomic_dir(out_dir) as tmp:
        t0 = time.perf_counter()
        with torch.no_grad():
            export_tensorrt_llm_checkpoint(model, fam.export_decoder, torch.bfloat16, tmp, inference_tensor_parallel=1)
        export_s = time.perf_counter() - t0
        conf = json.loads((tmp / "config.json").read_text())
        conf["logits_dtype"] = logits_dtype
        atomic_write_json(tmp / "config.json", conf)
        qpath = tmp / "quant_cfg.json"
        quant_cfg = json.loads(qpath.read_text()) if qpath.is_file() else {}
        quantized = dict(quant_cfg.get("quantized_layers") or {})
        per_layer = check_mixed_export(tmp, per_layer_hf)  # RuntimeError if the export lost a decision
        result = {
            "quant_algo": (conf.get("quantization") or {}).get("quant_algo"),
            "kv_cache_quant_algo": (conf.get("quantization") or {}).get("kv_cache_quant_algo"),
            "per_layer": dict(sorted(per_layer.items(), key=lambda kv: _layer_sort_key(kv[0]))),
            "per_layer_hf": per_layer_hf,
            "quantized_layers": quantized,
            **stats.to_dict(),
            "export_s": round(export_s, 3),
            "checkpoint_bytes": sum(p.stat().st_size for p in tmp.glob("rank*.safetensors")),
            "tp_size": 1,
            "logits_dtype": logits_dtype,
        }
        atomic_write_json(tmp / "autoquant.json", result)
    result["out_dir"] = str(out_dir)
    return result


def check_mixed_export(ckpt: Path, per_layer_hf: dict[str, str]) -> dict[str, str]:
    """{TRT-LLM linear: format} from the exported ``quant_cfg.json``, checked against the search's
    per-HF-linear result (RuntimeError when they disagree: the export lost a decision)."""
    path = Path(ckpt) / "quant_cfg.json"
    quantized = (json.loads(path.read_text()).get("quantized_layers") or {}) if path.is_file() else {}
    out: dict[str, str] = {}
    bad = []
    for hf, fmt in per_layer_hf.items():
        trt = trtllm_name(hf)
        got = quantized.get(trt, {}).get("quant_algo", NO_QUANT)
        out[trt] = got
        if got != fmt:
            bad.append(f"{hf} ({fmt}) -> {trt} ({got})")
    if bad:
        raise RuntimeError("quant_cfg.json disagrees with the per-layer search: " + "; ".join(bad[:5]))
    for trt, e in quantized.items():
        out.setdefault(trt, e.get("quant_algo", "?"))
    return out


def _layer_sort_key(name: str) -> tuple:
    parts = name.split(".")
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in parts)


__all__ = ["AutoQuantStats", "CANDIDATES", "FORMAT_BITS", "MODELOPT_FORMAT", "auto_quantize_model", "auto_quantize_export",
           "normalize_formats", "check_bits", "choose_group_size", "run_search", "check_mixed_export"]
