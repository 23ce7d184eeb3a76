"""Post-training quantization with NVIDIA ModelOpt 0.47 and export of a TensorRT-LLM checkpoint.

``run_quantize(job, model_dir, out_dir)`` (``job``: the resolved facts, ``quantize.job.QuantizeJob``, made
from the resolved plan by ``job_of``; nothing here re-checks them) loads the HF model, calibrates it with ModelOpt's
PTQ (``modelopt.torch.quantization.quantize``) on the profile's calibration set
(``precision_pipeline.quantize.calibration``), and writes a TensorRT-LLM checkpoint (``config.json`` +
``rank{i}.safetensors``, one per tensor-parallel rank) with
``modelopt.torch.export.export_tensorrt_llm_checkpoint(model, decoder, torch.bfloat16, dir,
inference_tensor_parallel=tp_size)`` (``decoder``: the family's ``export_decoder``, ``spec.families``), or, when the
job's ``export_format`` is ``hf_unified`` (the llm_api route), ModelOpt's unified HF checkpoint
(``export_hf_unified``: ``modelopt.torch.export.export_hf_checkpoint``; read by ``checkpoint.hf_unified``).

Formats (``quantization.quant_algo`` -> ModelOpt config, ``modelopt/torch/quantization/config.py``;
the facts are the registry's ``GemmFormat.modelopt_preset`` / ``modelopt_adjust`` / ``grouping``
and ``KvFormat.modelopt_preset`` / ``not_exported``, ``precision_pipeline.spec.formats``):

=====================  ============================================================
FP8                    ``FP8_DEFAULT_CFG`` (per-tensor E4M3 weights and activations)
NVFP4                  ``NVFP4_DEFAULT_CFG`` (E2M1, FP8 scale per 16 elements; group_size 16 only)
W4A16_AWQ              ``INT4_AWQ_CFG``; ``*weight_quantizer`` ``block_sizes[-1] = group_size``
W4A8_AWQ               ``W4A8_AWQ_BETA_CFG``; first (INT4) ``*weight_quantizer`` cfg ``block_sizes[-1] = group_size``
W8A8_SQ_PER_CHANNEL    ``INT8_SMOOTHQUANT_CFG``; ``algorithm = {"method": "smoothquant", "alpha": smoothquant_alpha}``
W8A16                  ``INT8_WEIGHT_ONLY_CFG``
NO_QUANT               no ModelOpt quantization; the BF16 checkpoint is still exported
MIXED_PRECISION        ``mtq.auto_quantize`` over ``auto_quantize_formats`` under the
                       ``auto_quantize_bits`` budget (``build/precision_pipeline/quantize/search.py``); one format per
                       TensorRT-LLM GEMM, written to ``quant_cfg.json``; the KV-cache quantizers
                       are then enabled and calibrated alone (``mtq.calibrate``, ``max``), as
                       ModelOpt's ``examples/llm_ptq/hf_ptq.py`` does after a search
=====================  ============================================================

KV cache (``quantization.kv_cache_quant_algo``), merged with
``modelopt.torch.quantization.utils.update_quant_cfg_with_kv_cache_quant``: FP8 -> ``FP8_KV_CFG``,
NVFP4 -> ``NVFP4_KV_CFG``. INT8: ModelOpt 0.47 ships no INT8 KV config, so it is refused with a
``UserError`` (field ``quantization.kv_cache_quant_algo``); see ``kv_config_for``.

Exclusions: ``quantization.exclude_modules`` are fnmatch patterns matched against each linear's
HF name (``model.layers.3.self_attn.q_proj``), its TensorRT-LLM name
(``transformer.layers.3.attention.qkv``) and its last name component (``lm_head``).
``keep_first_layers`` / ``keep_last_layers`` exclude every linear of those decoder layers. Fused
groups are excluded together (TensorRT-LLM fuses them into one GEMM): q/k/v -> ``attention.qkv``;
gate_proj/up_proj -> ``mlp.fc``/``mlp.gate``. Excluded linears get their weight and input
quantizers disabled; the KV-cache quantizers stay (TensorRT-LLM has one KV-cache dtype per
engine). ``config.json`` ``quantization.exclude_modules`` lists the TensorRT-LLM names of every
excluded linear (plus what ModelOpt wrote), sorted.

Name mapping (HF Llama -> TensorRT-LLM, ``modelopt/torch/export/layer_utils.py`` and verified
by comparing exported weights with the HF ones): q/k/v_proj -> ``attention.qkv`` (rows
[q; k; v]), o_proj -> ``attention.dense``, gate_proj -> ``mlp.fc``, up_proj -> ``mlp.gate``,
down_proj -> ``mlp.proj``.

MoE (Mixtral; ModelOpt exports it with the "llama" decoder type): with ``parallel.moe_ep_size > 1``
the tp_size export is re-sharded by ``precision_pipeline.quantize.moe_reshard.reshard_moe_checkpoint`` (experts split over
moe_ep_size, each expert's FFN over moe_tp_size) and ``config.json`` ``mapping`` says so;
``QuantizeResult.moe_mapping`` lists each rank's experts.

Calibration runs in FP32 on the CPU (on 2 CPU cores an FP32 forward is ~4x faster than BF16, and the
activation ranges are at least as accurate); the weights of the default model are BF16 values,
so quantizing their FP32 copies gives the same scales as BF16. With ``device="cuda"``
(``invoke build --device``, ``spec.device``) the model is loaded in the profile's dtype
(``quantization.dtype``) over the visible GPUs (``device_map="auto"``, as ModelOpt's
``examples/llm_ptq/hf_ptq.py`` loads it) and calibration, the search and the export run there. The export casts unquantized
tensors to BF16 (``dtype=torch.bfloat16``). ``config.json`` ``logits_dtype`` is then set to
``build.logits_dtype`` (ModelOpt writes ``float16``).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from precision_pipeline.quantize import search
from precision_pipeline.quantize.finite import refuse_non_finite
from precision_pipeline.quantize.calibration import CalibrationSet, build_calibration_set, load_tokenizer
from precision_pipeline.quantize.job import QuantizeJob
from precision_pipeline.spec.families import family, resolve_exclusions
from precision_pipeline.core.errors import UserError
from precision_pipeline.core.progress import StageProgress
from precision_pipeline.spec.formats import GEMM, KV, NO_MODELOPT_CONFIG, NVFP4_BLOCK
from precision_pipeline.spec.profile import KVCacheQuantAlgo, QuantAlgo
from precision_pipeline.core.store import atomic_dir, atomic_write_json

NVFP4_GROUP = NVFP4_BLOCK
NO_QUANT = QuantAlgo.NO_QUANT.value
# fused groups (TensorRT-LLM GEMMs): excluding one member excludes all


@dataclass
class QuantizeResult:
    """What ``run_quantize`` did. Times in seconds, sizes in bytes."""

    quant_algo: str
    kv_cache_quant_algo: str
    group_size: int | None
    exclude_modules: list[str]
    modelopt_config_name: str
    calibration: dict[str, Any]
    calibrate_s: float
    export_s: float
    checkpoint_bytes: int
    tp_size: int = 1
    out_dir: str = ""
    unmatched_exclude_patterns: list[str] = field(default_factory=list)
    calib_dtype: str = "float32"
    # MIXED_PRECISION only: {TRT-LLM linear: format} (NO_QUANT included) and the search's figures
    per_layer: dict[str, str] = field(default_factory=dict)
    search: dict[str, Any] = field(default_factory=dict)
    # MoE with moe_ep_size > 1: the re-sharded mapping (precision_pipeline.quantize.moe_reshard.reshard_moe_checkpoint's result)
    moe_mapping: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------------------------
# Names


def _linear_names(model: Any) -> list[str]:
    import torch.nn as nn

    names = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) or (type(mod).__name__.endswith("Linear") and hasattr(mod, "weight")):
            names.append(name)
    return names


# --------------------------------------------------------------------------------------------
# Configs


def kv_config_for(kv_algo: str) -> tuple[str | None, list[dict] | None]:
    """(name, quant_cfg list) of the ModelOpt KV-cache config for ``kv_cache_quant_algo``.

    Raises UserError for INT8: ModelOpt 0.47 has no INT8 KV-cache config
    (``modelopt/torch/quantization/config.py`` defines ``FP8_KV_CFG``, ``FP8_AFFINE_KV_CFG``,
    ``NVFP4_KV_CFG``, ``NVFP4_AFFINE_KV_CFG``, ``NVFP4_KV_ROTATE_CFG`` only).
    """
    import modelopt.torch.quantization as mtq

    fmt = KV[kv_algo]
    if not fmt.is_quantized:
        return None, None
    if fmt.not_exported:
        raise UserError("quantization.kv_cache_quant_algo", *fmt.not_exported)
    name = fmt.modelopt_preset
    return name, copy.deepcopy(getattr(mtq, name)["quant_cfg"])


def modelopt_config_for(job: QuantizeJob, model_dir: Path | None = None,
                        linear_names: list[str] | None = None,
                        num_hidden_layers: int | None = None) -> tuple[str, dict | None]:
    """The ModelOpt PTQ config (name, config dict) for ``job``; ``(name, None)`` for NO_QUANT.

    The dict is a deep copy of the ModelOpt preset (``quant_cfg`` is a list of
    ``{"quantizer_name", "cfg"/"enable"}`` entries in ModelOpt 0.47) with: the AWQ group size in
    the ``*weight_quantizer`` ``block_sizes[-1]``; the SmoothQuant ``alpha``; the KV-cache entries
    merged in; and one ``{"quantizer_name": "<hf linear>.weight_quantizer"/".input_quantizer",
    "enable": False}`` pair per excluded linear (resolved against ``linear_names``, or against a
    meta-device model built from ``model_dir``'s config -- default: the default model; the family's fused
    groups (``job.architecture``, ``spec.families``) are excluded whole).

    Name: e.g. ``"FP8_DEFAULT_CFG+FP8_KV_CFG"`` or ``"INT4_AWQ_CFG(group_size=64)"``.
    ``job`` is resolved (``quantize.job.job_of``): nothing here re-checks the profile.
    """
    import modelopt.torch.quantization as mtq
    from modelopt.torch.quantization.utils import update_quant_cfg_with_kv_cache_quant

    q = job.quantization
    algo = q.quant_algo.value
    fmt = GEMM[q.quant_algo]
    if fmt.per_layer:
        raise UserError("quantization.quant_algo", "MIXED_PRECISION has no single ModelOpt config: the per-layer "
                        "search (mtq.auto_quantize) picks one per layer.", "call quantize_model / run_quantize.")
    group = job.group_size
    kv_name, kv_cfg = kv_config_for(q.kv_cache_quant_algo.value)
    base_name = fmt.modelopt_preset
    if base_name is None:
        if kv_cfg is not None:
            raise UserError("quantization.kv_cache_quant_algo",
                            f"quant_algo {algo} with a {q.kv_cache_quant_algo.value} KV cache is not exported by this pipeline.",
                            "use kv_cache_quant_algo: NONE with NO_QUANT, or quant_algo FP8 with an FP8 KV cache.")
        return NO_MODELOPT_CONFIG, None
    cfg = copy.deepcopy(getattr(mtq, base_name))
    name = base_name
    if fmt.modelopt_adjust == "int4_block":
        hits = 0
        for entry in cfg["quant_cfg"]:
            if entry.get("quantizer_name") == "*weight_quantizer" and "cfg" in entry:
                c = entry["cfg"]
                first = c[0] if isinstance(c, list) else c
                if first.get("block_sizes") is not None and first.get("num_bits") == 4:
                    first["block_sizes"] = dict(first["block_sizes"])
                    first["block_sizes"][-1] = group
                    hits += 1
        if hits != 1:  # pragma: no cover - guards a ModelOpt layout change
            raise RuntimeError(f"{base_name}: expected one INT4 *weight_quantizer entry with block_sizes, found {hits}")
        name = f"{base_name}(group_size={group})"
    if fmt.modelopt_adjust == "smoothquant":
        cfg["algorithm"] = {"method": "smoothquant", "alpha": float(q.smoothquant_alpha)}
        name = f"{base_name}(alpha={q.smoothquant_alpha})"
    if kv_cfg is not None:
        with contextlib.redirect_stdout(io.StringIO()):  # it prints the whole config
            cfg = update_quant_cfg_with_kv_cache_quant(cfg, kv_cfg)
        name += f"+{kv_name}"
    if linear_names is None or num_hidden_layers is None:
        linear_names, num_hidden_layers = _meta_model_names(model_dir)
    excluded, _ = resolve_exclusions(linear_names, list(q.exclude_modules), q.keep_first_layers, q.keep_last_layers,
                                     num_hidden_layers, family(job.architecture))
    for n in excluded:
        cfg["quant_cfg"].append({"quantizer_name": f"{n}.weight_quantizer", "enable": False})
        cfg["quant_cfg"].append({"quantizer_name": f"{n}.input_quantizer", "enable": False})
    return name, cfg


def _meta_model_names(model_dir: Path | None) -> tuple[list[str], int]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if model_dir is None:
        from precision_pipeline.spec.default_model import ensure_default_model

        model_dir = ensure_default_model()
    hf_cfg = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(hf_cfg)
    return _linear_names(m), int(hf_cfg.num_hidden_layers)


# --------------------------------------------------------------------------------------------
# Calibration loop with a progress bar


def _calib_target(model: Any) -> Any:
    """The module to run for calibration: the decoder without ``lm_head`` (``model.model``) when
    every quantizer of ``lm_head`` is disabled (the logits are not needed then, and the
    49152 x 576 projection is ~21% of the FLOPs of the default model), else the whole model."""
    base = getattr(model, "model", None)
    head = getattr(model, "lm_head", None)
    if base is None or head is None:
        return model
    for name, sub in head.named_modules():
        if name.endswith("_quantizer") and getattr(sub, "is_enabled", False):
            return model
    return base


def make_forward_loop(calib: CalibrationSet, batch_size: int, show_progress: bool = True,
                      on_pass: Callable[[int], None] | None = None) -> Callable[[Any], None]:
    """ModelOpt ``forward_loop(model)``: runs every calibration sample through ``model`` under
    ``torch.no_grad()``, in equal-length batches of at most ``batch_size``, with a rich progress
    bar (samples, samples/s). Some algorithms (AWQ, SmoothQuant) call it more than once; each
    call is one numbered pass."""
    import torch

    batches = calib.batches(batch_size)
    state = {"pass": 0}

    def loop(model: Any) -> None:
        state["pass"] += 1
        if on_pass:
            on_pass(state["pass"])
        device = next(model.parameters()).device
        target = _calib_target(model)
        with torch.no_grad(), StageProgress("quantize", enabled=show_progress) as prog:
            ph = prog.phase(f"calibration pass {state['pass']}", total=len(calib.samples), unit="samples")
            for b in batches:
                target(torch.tensor(b, dtype=torch.long, device=device), use_cache=False)
                ph.advance(len(b))
            ph.finish()

    return loop


# --------------------------------------------------------------------------------------------
# Main entry


def _dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in Path(d).glob("rank*.safetensors"))


@dataclass
class QuantizedModel:
    """A ModelOpt-quantized (fake-quant) HF model plus what is needed to export it."""

    model: Any
    job: QuantizeJob
    config_name: str
    config: dict | None
    calibration: CalibrationSet | None
    excluded_hf: list[str]
    unmatched: list[str]
    calibrate_s: float
    group_size: int | None
    search: dict[str, Any] = field(default_factory=dict)  # MIXED_PRECISION: autoquant stats + per_layer_hf


def load_model(model_dir: Path, device: str = "cpu", dtype: str = "float32") -> Any:
    """The HF model of ``model_dir`` in ``dtype`` (a torch dtype name), in eval mode: on the CPU, or
    with ``device="cuda"`` over the visible GPUs (``device_map="auto"``: GPU 0 first, whole layers)."""
    import torch
    from transformers import AutoModelForCausalLM

    extra = {"device_map": "auto"} if device == "cuda" else {}
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype), **extra).eval()
    refuse_non_finite(model, model_dir)
    return model


def quantize_model(job: QuantizeJob, model_dir: Path, show_progress: bool = True,
                   calib_set: CalibrationSet | None = None, device: str = "cpu",
                   dtype: str = "float32") -> QuantizedModel:
    """Load the HF model of ``model_dir`` (``load_model``: FP32 on the CPU by default) and run ModelOpt PTQ as ``job`` says.

    Returns the fake-quant model (``mtq.quantize`` result; for NO_QUANT the plain model). ``job`` holds the
    resolved facts (``quantize.job.job_of`` of a plan the resolve rules passed): nothing is re-checked here.
    """
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    q = job.quantization
    fmt = GEMM[q.quant_algo]
    fam = family(job.architecture)
    hf_cfg = AutoConfig.from_pretrained(str(model_dir))
    calib = calib_set
    if calib is None and fmt.is_quantized:
        calib = build_calibration_set(job.calibration_to_read(), load_tokenizer(model_dir))
    if fmt.per_layer:
        return _search_model(job, model_dir, hf_cfg, calib, show_progress, device, dtype)

    model = load_model(model_dir, device, dtype)
    names = _linear_names(model)
    n_layers = int(hf_cfg.num_hidden_layers)
    excluded_hf, unmatched = resolve_exclusions(names, list(q.exclude_modules), q.keep_first_layers,
                                                q.keep_last_layers, n_layers, fam)
    cfg_name, cfg = modelopt_config_for(job, model_dir, linear_names=names, num_hidden_layers=n_layers)
    t0 = time.perf_counter()
    if cfg is not None:
        import modelopt.torch.quantization as mtq

        loop = make_forward_loop(calib, job.calibration.batch_size, show_progress)
        mtq.quantize(model, cfg, forward_loop=loop)
    calibrate_s = time.perf_counter() - t0
    return QuantizedModel(model=model, job=job, config_name=cfg_name, config=cfg, calibration=calib,
                          excluded_hf=excluded_hf if cfg is not None else [], unmatched=unmatched,
                          calibrate_s=calibrate_s, group_size=job.group_size if fmt.grouping != "none" else None)


def _search_model(job: QuantizeJob, model_dir: Path, hf_cfg: Any, calib: CalibrationSet,
                  show_progress: bool, device: str = "cpu", dtype: str = "float32") -> QuantizedModel:
    """MIXED_PRECISION: ``mtq.auto_quantize`` (``precision_pipeline.quantize.search.run_search``), then the KV cache.

    Layers kept in high precision (``exclude_modules``, ``keep_first/last_layers``, fused groups
    expanded) are the search's ``disabled_layers`` and stay unquantized; everything else, lm_head
    included unless excluded (the shipped profiles exclude it), is searched. After the search
    the KV-cache quantizers (``FP8_KV_CFG``) are enabled and calibrated with every other quantizer
    temporarily off, so the searched formats' scales are untouched.
    """
    import modelopt.torch.quantization as mtq

    q = job.quantization
    model = load_model(model_dir, device, dtype)
    names = _linear_names(model)
    excluded_hf, unmatched = resolve_exclusions(names, list(q.exclude_modules), q.keep_first_layers,
                                                q.keep_last_layers, int(hf_cfg.num_hidden_layers), family(job.architecture))
    disabled = list(excluded_hf)
    fmts = search.normalize_formats(q.auto_quantize_formats)
    t0 = time.perf_counter()
    batches = calib.batches(job.calibration.batch_size)
    with StageProgress("quantize", enabled=show_progress) as prog:
        prog.say(f"per-layer search (mtq.auto_quantize, gradient scores) over {', '.join(fmts)} at "
                 f"{q.auto_quantize_bits} bits: {len(calib.samples)} samples, {len(batches)} batches")
        model, per_layer_hf, stats = search.run_search(model, batches, float(q.auto_quantize_bits), fmts,
                                                       disabled_layers=disabled, group_size=job.group_size, progress=prog)
    kv_name, kv_cfg = kv_config_for(q.kv_cache_quant_algo.value)
    if kv_cfg is not None:
        mtq.set_quantizer_by_cfg(model, kv_cfg)
        loop = make_forward_loop(calib, job.calibration.batch_size, show_progress)
        with mtq.set_quantizer_by_cfg_context(model, [{"quantizer_name": "*", "enable": False}, *kv_cfg]):
            mtq.calibrate(model, algorithm="max", forward_loop=loop)
    calibrate_s = time.perf_counter() - t0
    name = "auto_quantize(" + ", ".join(
        GEMM[f].modelopt_preset + (f"(group_size={stats.group_size})" if GEMM[f].grouping == "per_group" else "")
        for f in fmts) + f"; effective_bits={q.auto_quantize_bits})" + (f"+{kv_name}" if kv_name else "")
    return QuantizedModel(model=model, job=job, config_name=name, config=None, calibration=calib,
                          excluded_hf=excluded_hf, unmatched=unmatched, calibrate_s=calibrate_s,
                          group_size=stats.group_size, search={**stats.to_dict(), "per_layer_hf": per_layer_hf})


def export_checkpoint(qm: QuantizedModel, out_dir: Path, show_progress: bool = True) -> QuantizeResult:
    """Export ``qm`` as a TensorRT-LLM checkpoint into ``out_dir`` (replaced atomically); with
    ``job.export_format == "hf_unified"`` as ModelOpt's unified HF checkpoint instead (``export_hf_unified``).

    ``export_tensorrt_llm_checkpoint(model, decoder, torch.bfloat16, tmp,
    inference_tensor_parallel=tp_size)`` (``decoder``: the family's ``export_decoder``: "llama", "qwen"), then
    config.json: ``logits_dtype`` = ``build.logits_dtype``; the family's ``trtllm_config`` fields where ModelOpt wrote
    none (Qwen2: ``qwen_type``, ``attn_bias``, ``mlp_bias``, ``spec.families``);
    ``quantization.exclude_modules`` = sorted union of what ModelOpt wrote and the TensorRT-LLM
    names of the excluded linears. Also writes ``calibration.json`` (the calibration composition).
    """
    import torch
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    job = qm.job
    if job.export_format == "hf_unified":
        return export_hf_unified(qm, out_dir, show_progress)
    out_dir = Path(out_dir)
    fam = family(job.architecture)
    excluded_trt = sorted({fam.trtllm_name(n) for n in qm.excluded_hf})
    layout = job.moe_layout
    reshard = layout is not None and layout[1] > 1
    moe_mapping: dict[str, Any] = {}
    with atomic_dir(out_dir) as tmp:
        stage = tmp / "modelopt-export" if reshard else tmp
        t1 = time.perf_counter()
        with torch.no_grad(), StageProgress("quantize", enabled=show_progress) as prog, \
                prog.phase("export the TensorRT-LLM checkpoint"):
            export_tensorrt_llm_checkpoint(qm.model, fam.export_decoder, torch.bfloat16,
                                           stage, inference_tensor_parallel=job.tp_size)
        if reshard:
            # ModelOpt writes moe_tp_size = tp_size, moe_ep_size = 1: regroup the experts over the
            # EP ranks as TensorRT-LLM's Mapping expects (build/precision_pipeline/quantize/moe_reshard.py) and write that mapping
            import os
            import shutil

            from precision_pipeline.quantize.moe_reshard import reshard_moe_checkpoint

            moe_mapping = reshard_moe_checkpoint(stage, layout[0], layout[1], tmp / "ep")
            shutil.rmtree(stage)
            for f in (tmp / "ep").iterdir():
                os.replace(f, tmp / f.name)
            (tmp / "ep").rmdir()
        export_s = time.perf_counter() - t1
        cfg_path = tmp / "config.json"
        conf = json.loads(cfg_path.read_text())
        conf["logits_dtype"] = job.logits_dtype
        for key, value in fam.trtllm_config.items():  # what TensorRT-LLM's <Config>.from_hugging_face would have written
            conf.setdefault(key, value)  # (ModelOpt does so only with tensorrt_llm installed; spec/families.py trtllm_config)
        quant = conf.get("quantization") or {}
        per_layer: dict[str, str] = {}
        if qm.search:
            per_layer = search.check_mixed_export(tmp, qm.search["per_layer_hf"])
            atomic_write_json(tmp / "autoquant.json", {**{k: v for k, v in qm.search.items() if k != "per_layer_hf"},
                                                       "per_layer": per_layer})
        if qm.config is not None:
            written = quant.get("exclude_modules") or []
            quant["exclude_modules"] = sorted(set(written) | set(excluded_trt))
        conf["quantization"] = quant
        atomic_write_json(cfg_path, conf)
        if qm.calibration is not None:
            atomic_write_json(tmp / "calibration.json", qm.calibration.composition)
        nbytes = _dir_bytes(tmp)
    return QuantizeResult(
        quant_algo=quant.get("quant_algo") or NO_QUANT,
        kv_cache_quant_algo=quant.get("kv_cache_quant_algo") or KVCacheQuantAlgo.NONE.value,
        group_size=quant.get("group_size", qm.group_size),
        exclude_modules=list(quant.get("exclude_modules") or []),
        modelopt_config_name=qm.config_name,
        calibration=qm.calibration.composition if qm.calibration is not None else {},
        calibrate_s=round(qm.calibrate_s, 3),
        export_s=round(export_s, 3),
        checkpoint_bytes=nbytes,
        tp_size=job.tp_size,
        out_dir=str(out_dir),
        unmatched_exclude_patterns=list(qm.unmatched),
        per_layer=per_layer,
        search={k: v for k, v in qm.search.items() if k != "per_layer_hf"},
        moe_mapping=moe_mapping,
    )


HF_EXPORT_DTYPE = "bfloat16"
"""The dtype of the unquantized tensors (embedding, norms, excluded linears) of an HF export and its config.json
``dtype``, as the TensorRT-LLM export writes them (``torch.bfloat16``); scales stay F32."""


def export_hf_unified(qm: QuantizedModel, out_dir: Path, show_progress: bool = True) -> QuantizeResult:
    """Export ``qm`` as ModelOpt's unified HF checkpoint into ``out_dir`` (replaced atomically): the same calibrated
    quantizers as ``export_checkpoint``, written by ``modelopt.torch.export.export_hf_checkpoint`` (config.json with
    ``quantization_config``, model.safetensors, hf_quant_config.json; ``checkpoint.hf_unified`` reads it). Then:
    unquantized F32 tensors are cast to ``HF_EXPORT_DTYPE`` and config.json's ``dtype`` says so (ModelOpt keeps
    the calibration dtype, FP32 here); config.json's ``quantization_config.group_size`` is set to
    hf_quant_config.json's (ModelOpt's flat inline form leaves it out, which TensorRT-LLM reports as a divergence);
    every excluded HF linear that ModelOpt's ``exclude_modules`` patterns miss is
    added to both ``hf_quant_config.json`` ``exclude_modules`` and config.json ``quantization_config.ignore``. Also
    writes ``calibration.json``. ``export_hf_checkpoint`` replaces the model's weights by their quantized form:
    ``qm.model`` is spent afterwards. Raises UserError for a format with no HF export
    (``quantize.job.check_export_format``)."""
    import fnmatch

    import torch
    from modelopt.torch.export import export_hf_checkpoint
    from safetensors.torch import load_file, save_file

    from precision_pipeline.checkpoint.hf_unified import HF_SUFFIX, KV_SCALE_OF, hf_files
    from precision_pipeline.checkpoint.reader import HF_QUANT_CONFIG
    from precision_pipeline.quantize.job import check_export_format

    job = qm.job
    check_export_format(job.quantization.quant_algo.value, job.export_format)
    out_dir = Path(out_dir)
    scale_leaves = set(HF_SUFFIX) | set(KV_SCALE_OF.values())
    with atomic_dir(out_dir) as tmp:
        t1 = time.perf_counter()
        with torch.no_grad(), StageProgress("quantize", enabled=show_progress) as prog, \
                prog.phase("export the unified HF checkpoint"):
            export_hf_checkpoint(qm.model, dtype=getattr(torch, HF_EXPORT_DTYPE), export_dir=tmp)
        for f in hf_files(tmp):
            st = load_file(str(f))
            cast = {k: (v.to(getattr(torch, HF_EXPORT_DTYPE)) if v.dtype == torch.float32
                        and k.rsplit(".", 1)[-1] not in scale_leaves else v) for k, v in st.items()}
            save_file(cast, str(f), metadata={"format": "pt"})
        export_s = time.perf_counter() - t1
        hfq = json.loads((tmp / HF_QUANT_CONFIG).read_text()) if (tmp / HF_QUANT_CONFIG).is_file() else None
        conf = json.loads((tmp / "config.json").read_text())
        conf["dtype"] = HF_EXPORT_DTYPE
        quant = (hfq or {}).get("quantization") or {}
        if hfq is not None and qm.config is not None:
            written = list(quant.get("exclude_modules") or [])
            missing = [n for n in qm.excluded_hf if not any(fnmatch.fnmatchcase(n, p) for p in written)]
            quant["exclude_modules"] = sorted(set(written) | set(missing))
            conf["quantization_config"]["ignore"] = list(quant["exclude_modules"])
            if quant.get("group_size") is not None:  # ModelOpt's flat inline config omits it (NVFP4: config_groups only):
                conf["quantization_config"]["group_size"] = quant["group_size"]  # the runtime would warn they differ
            atomic_write_json(tmp / HF_QUANT_CONFIG, hfq)
        atomic_write_json(tmp / "config.json", conf)
        if qm.calibration is not None:
            atomic_write_json(tmp / "calibration.json", qm.calibration.composition)
        nbytes = sum(f.stat().st_size for f in hf_files(tmp))
    return QuantizeResult(
        quant_algo=quant.get("quant_algo") or NO_QUANT,
        kv_cache_quant_algo=quant.get("kv_cache_quant_algo") or KVCacheQuantAlgo.NONE.value,
        group_size=quant.get("group_size", qm.group_size), exclude_modules=list(quant.get("exclude_modules") or []),
        modelopt_config_name=qm.config_name,
        calibration=qm.calibration.composition if qm.calibration is not None else {},
        calibrate_s=round(qm.calibrate_s, 3), export_s=round(export_s, 3), checkpoint_bytes=nbytes,
        tp_size=job.tp_size, out_dir=str(out_dir), unmatched_exclude_patterns=list(qm.unmatched),
        search={k: v for k, v in qm.search.items() if k != "per_layer_hf"})


def run_quantize(job: QuantizeJob, model_dir: Path, out_dir: Path, show_progress: bool = True,
                 calib_set: CalibrationSet | None = None, device: str = "cpu", dtype: str = "float32") -> QuantizeResult:
    """Quantize the HF model in ``model_dir`` as ``job`` (the resolved facts) says; write the TRT-LLM checkpoint to ``out_dir``.

    ``device`` / ``dtype``: where and in what the model is calibrated (``load_model``; the build's
    ``spec.device.DeviceChoice``: FP32 on the CPU, the profile's dtype on CUDA).

    ``quantize_model`` then ``export_checkpoint``. ``out_dir`` is replaced atomically
    (``precision_pipeline.core.store.atomic_dir``): it holds ``config.json``, ``rank{0..tp_size-1}.safetensors`` and
    ``calibration.json``. Timings are wall seconds; ``checkpoint_bytes`` sums rank*.safetensors.
    """
    log_path = Path(out_dir).parent / QUANTIZE_LOG
    expected: dict[str, str] = {}
    with captured_warnings(log_path, StageProgress("quantize", enabled=show_progress),
                           record_path=Path(out_dir) / QUANTIZE_WARNINGS, expected=expected), labelled_prints("quantize"):
        qm = quantize_model(job, model_dir, show_progress=show_progress, calib_set=calib_set, device=device, dtype=dtype)
        for name in qm.excluded_hf:  # SmoothQuant says so of every module it was told to leave alone
            expected[rf"\b{re.escape(name)} is not calibrated, skip smoothing"] = \
                "kept in high precision (exclude_modules): there is nothing to smooth"
        res = export_checkpoint(qm, out_dir, show_progress=show_progress)
        res.calib_dtype = dtype
        return res


class _LabelledLines(io.TextIOBase):
    """A stdout that passes our own lines (``[stage] ...``) through and labels every other line
    (ModelOpt's ``print``s: "Inserted 756 quantizers", "current rank: 0, tp rank: 0, pp rank: 0") as
    ``[stage] ModelOpt: ...``, so a log says whose line it is."""

    def __init__(self, out, stage: str):
        self._out, self._stage, self._buf = out, stage, ""

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        if s.startswith("[") and s.endswith("\n") and s.count("\n") == 1:  # one whole line of ours (a progress
            self._out.write(s)  # heartbeat from another thread): never mixed into a half-printed third-party line
            return len(s)
        self._buf += s
        *lines, self._buf = self._buf.split("\n")
        for line in lines:
            self._emit(line)
        return len(s)

    def _emit(self, line: str) -> None:
        if line.strip():
            self._out.write((line if line.startswith("[") else f"[{self._stage}] ModelOpt: {line.strip()}") + "\n")

    def flush(self) -> None:
        self._out.flush()

    def close_buffer(self) -> None:
        if self._buf:
            self._emit(self._buf)
            self._buf = ""
        self.flush()


@contextlib.contextmanager
def labelled_prints(stage: str) -> Iterator[None]:
    """Within the block, label third-party ``print`` output on stdout (``_LabelledLines``)."""
    out = _LabelledLines(sys.stdout, stage)
    try:
        with contextlib.redirect_stdout(out):
            yield
    finally:
        out.close_buffer()


QUANTIZE_LOG = "quantize.log"
"""Third-party warnings of a quantize run, next to its checkpoint folder (``<out>/quantize.log`` in a build)."""
QUANTIZE_WARNINGS = "quantize_warnings.json"
"""The same warnings as records, inside the checkpoint folder (the gate report shows them): ``{"source",
"warnings": [{"level" (warning category or log level), "origin" (file:line or logger), "message",
"expected" (why it is harmless, or null)}]}``. Written by every quantize run that finishes, empty or not."""
WARNINGS_SOURCE = "Python warnings and modelopt/transformers log records (WARNING and above) during quantize + export"

# Third-party warnings that are expected and say nothing about this build (regex -> why): kept in the
# log, not printed. ModelOpt's lm_head notice fires although the exported lm_head stays BF16 (it is
# excluded; checkpoint config.json lists it in exclude_modules); the TensorRT-LLM config notice fires
# on every machine without tensorrt_llm (ModelOpt then writes the config itself).
EXPECTED_WARNINGS: dict[str, str] = {
    r"Enable lm_head quantization": "lm_head stays BF16 in the exported checkpoint (excluded)",
    r"Cannot export tensorrt_llm checkpoint config[\s\S]*No module named 'tensorrt_llm'":
        "tensorrt_llm is not installed here; ModelOpt writes the checkpoint config itself",
}


@contextlib.contextmanager
def captured_warnings(log_path: Path, prog: StageProgress, record_path: Path | None = None,
                      expected: dict[str, str] | None = None) -> Iterator[list[str]]:
    """Collect Python warnings and ``modelopt``/``transformers`` log records raised in the block.

    Every one is appended to ``log_path`` (UTF-8 text, one block per warning with its category and
    origin), when the block finishes without an exception (a refused run writes nothing). Expected
    ones (``EXPECTED_WARNINGS``) print nothing; any other prints one line of
    ours per distinct message (``[quantize] warning: <first line> (see <log_path>)``). What is
    recorded is what the active warning filters would show (DeprecationWarnings of libraries stay
    hidden). Yields the list of log-record messages (warnings are added when the block ends).
    ``record_path``: also write them as ``QUANTIZE_WARNINGS`` records there (atomically, also when
    there were none), for the gate report (``read_quantize_warnings``). ``expected``: more regex -> why
    pairs beside ``EXPECTED_WARNINGS``, read when the block ends (so the block may add to it once it
    knows, e.g., which modules it kept in high precision).
    """
    import logging
    import re
    import warnings

    records: list[str] = []
    logged: list[dict[str, Any]] = []

    class _Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(f"{record.levelname} {record.name}: {record.getMessage()}")
            logged.append({"level": record.levelname, "origin": record.name, "message": record.getMessage()})

    handler = _Handler(level=logging.WARNING)
    loggers = [logging.getLogger(n) for n in ("modelopt", "transformers")]
    saved = [(lg, lg.propagate) for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.propagate = False
    try:
        with warnings.catch_warnings(record=True) as caught:  # the active filters decide what is recorded
            yield records
    finally:
        for lg, prop in saved:
            lg.removeHandler(handler)
            lg.propagate = prop
    # only after a run that finished: a refused or failed run leaves the output folder as it was
    known = {**EXPECTED_WARNINGS, **(expected or {})}
    msgs = [f"{w.category.__name__} ({Path(w.filename).name}:{w.lineno}): {w.message}" for w in caught] + records
    if record_path is not None:
        recs = [{"level": w.category.__name__, "origin": f"{Path(w.filename).name}:{w.lineno}", "message": str(w.message)}
                for w in caught] + logged
        for r, m in zip(recs, msgs):
            r["expected"] = next((why for rx, why in known.items() if re.search(rx, m)), None)
        atomic_write_json(Path(record_path), {"source": WARNINGS_SOURCE, "warnings": recs})
    if msgs:
        log_path = Path(log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "a", encoding="utf-8") as f:
            f.write(f"# quantize run {time.strftime('%Y-%m-%d %H:%M:%S')}: {len(msgs)} warning(s)\n")
            for m in msgs:
                f.write(m.rstrip() + "\n\n")
    unexpected: dict[str, int] = {}
    for m in msgs:
        if not any(re.search(rx, m) for rx in known):
            first = re.sub(r"^(\w+) \([^)]*\): ", r"\1: ", m.strip()).splitlines()[0][:200] if m.strip() else m
            unexpected[first] = unexpected.get(first, 0) + 1
    for first, count in unexpected.items():
        prog.say(f"warning: {first}{f' ({count} times)' if count > 1 else ''} (see {log_path})")


def read_quantize_warnings(ckpt_dir: Path) -> dict[str, Any] | None:
    """``QUANTIZE_WARNINGS`` of a checkpoint folder, or None when it has none (a checkpoint not made
    by this quantize stage, or made before it recorded them) or it is not a JSON object."""
    from precision_pipeline.core.store import read_json_safe

    d = read_json_safe(Path(ckpt_dir) / QUANTIZE_WARNINGS)
    return d if isinstance(d, dict) and isinstance(d.get("warnings"), list) else None


__all__ = ["QuantizeResult", "QUANTIZE_LOG", "QUANTIZE_WARNINGS", "read_quantize_warnings", "captured_warnings", "QuantizedModel", "run_quantize", "quantize_model", "export_checkpoint", "export_hf_unified", "HF_EXPORT_DTYPE", "modelopt_config_for", "kv_config_for",
           "make_forward_loop", "QuantizeJob"]
