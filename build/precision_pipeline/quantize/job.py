"""What one quantize run reads: the resolved facts, made from the resolved plan (``job_of``), never re-checked.

The quantize stage's inputs hold a ``QuantizeJob``; ``ptq.run_quantize`` / ``quantize_model`` / ``export_checkpoint``
read it and nothing else of the profile. Every user-input check is a resolve rule (``invoke check``); the plan
that reaches quantize has none refused, so quantize does not validate, resolve or evaluate the plan again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal, Mapping, Optional

from pydantic import BaseModel, ConfigDict

from precision_pipeline.quantize.search import GROUP_CHOICES
from precision_pipeline.spec.algos import QuantAlgo
from precision_pipeline.spec.formats import AWQ_DEFAULT_GROUP, GEMM
from precision_pipeline.spec.profile import Calibration, Quantization


ExportFormat = Literal["trtllm_checkpoint", "hf_unified"]
EXPORT_FORMAT_OF_ROUTE = {"engine": "trtllm_checkpoint", "llm_api": "hf_unified"}
"""The checkpoint each serving route loads: ``trtllm-build`` reads a TensorRT-LLM checkpoint; the LLM API
(``LLM(...)``, ``trtllm-serve``) reads a HF folder (``tensorrt_llm/_torch/model_config.py``
``ModelConfig.from_pretrained``)."""
NO_HF_UNIFIED_EXPORT = {
    QuantAlgo.W8A8_SQ_PER_CHANNEL.value: ("the LLM API (TensorRT-LLM's PyTorch backend) has no INT8 SmoothQuant path "
                            "(docs/source/features/quantization.md; ModelOpt PR #345). ModelOpt 0.47's "
                            "export_hf_checkpoint does write one (measured), but nothing on this route loads it.",
                            "use quant_algo FP8 (Hopper, Ada, Blackwell) or W4A16_AWQ (Ampere) on the llm_api route, "
                            "or the engine route for W8A8_SQ_PER_CHANNEL."),
}
"""quant_algo -> (reason, fix) for formats the llm_api route's unified HF checkpoint cannot carry to the runtime."""


def check_export_format(quant_algo: str, export_format: str) -> None:
    """Refuse (UserError on ``quantization.quant_algo``) a format with no export in ``export_format``
    (``NO_HF_UNIFIED_EXPORT``)."""
    from precision_pipeline.core.errors import UserError

    if export_format == "hf_unified" and quant_algo in NO_HF_UNIFIED_EXPORT:
        reason, fix = NO_HF_UNIFIED_EXPORT[quant_algo]
        raise UserError("quantization.quant_algo", f"{quant_algo} cannot be exported as a unified HF checkpoint: "
                        f"{reason}", fix)


class QuantizeJob(BaseModel):
    """The resolved facts of one quantize run.

    ``architecture``: the model family (``spec.families``: export decoder, linear names, fused groups);
    ``quantization`` / ``calibration``: the profile's sections (a user calibration file's path is
    ``calibration_path``, unkeyed: its content is keyed by the stage); ``tp_size``: ranks the export writes;
    ``moe_layout``: ``(moe_tp_size, moe_ep_size)`` of a MoE model (the plan's mapping), None for a dense one;
    ``group_size``: the group (block) size the export uses (``group_size_for``); ``logits_dtype``: written to
    the checkpoint's config.json; ``export_format``: what the export writes: ``trtllm_checkpoint`` (config.json +
    rank*.safetensors for ``trtllm-build``, the engine route) or ``hf_unified`` (ModelOpt's unified HF checkpoint:
    config.json with ``quantization_config``, model*.safetensors, hf_quant_config.json, for the LLM API route).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    unkeyed: ClassVar[Mapping[str, str]] = {
        "calibration_path": "a user calibration file's path: its content is keyed (QuantizeInputs.calibration_data), "
                            "so the same file moved or copied does not re-quantize"}

    architecture: str
    quantization: Quantization
    calibration: Calibration
    calibration_path: Optional[str] = None
    tp_size: int = 1
    moe_layout: Optional[tuple[int, int]] = None
    group_size: Optional[int] = None
    logits_dtype: str = "float32"
    export_format: ExportFormat = "trtllm_checkpoint"

    def calibration_to_read(self) -> Calibration:
        """``calibration`` with the file path to read (``calibration_path``) when the dataset is a user file."""
        if self.calibration_path is None:
            return self.calibration
        return self.calibration.model_copy(update={"dataset": self.calibration_path})


def group_size_for(q: Quantization, input_widths: tuple[int, ...]) -> Optional[int]:
    """The group (block) size the export uses: NVFP4's fixed block; the AWQ group (the profile's, or the default);
    for MIXED_PRECISION with an AWQ candidate the profile's, else the largest of ``search.GROUP_CHOICES`` dividing
    every ``input_widths`` (hidden, attention output, MLP width); None for formats without groups. The resolve rule
    ``format.group_size`` has refused a size that does not apply or divide."""
    fmt = GEMM[q.quant_algo]
    if fmt.fixed_block:
        return fmt.fixed_block
    if fmt.grouping == "per_group":
        return q.group_size or AWQ_DEFAULT_GROUP
    if fmt.per_layer and any(GEMM[c].grouping == "per_group" for c in q.auto_quantize_formats):
        if q.group_size is not None:
            return q.group_size
        return next((g for g in GROUP_CHOICES if all(w % g == 0 for w in input_widths)), None)
    return None


def job_of(plan: Any) -> QuantizeJob:
    """The quantize job of a resolved plan (``resolve.plan.ResolvedPlan``: read by attribute, nothing re-resolved):
    the profile's quantization and calibration sections, the family, tp_size, the MoE layout of the plan's
    mapping, the group size, the logits dtype and the export format of the plan's route (``EXPORT_FORMAT_OF_ROUTE``;
    ``route`` absent: the engine route). Raises UserError for a format the route's export cannot write
    (``check_export_format``)."""
    p, m, mp = plan.profile, plan.model, plan.mapping
    cal, path = p.calibration, None
    if cal.dataset != "builtin":
        path = str(Path(cal.dataset).expanduser())
        cal = cal.model_copy(update={"dataset": "file"})
    export_format = EXPORT_FORMAT_OF_ROUTE[getattr(plan, "route", "engine")]
    check_export_format(p.quantization.quant_algo.value, export_format)
    widths = (m.hidden_size, m.num_heads * m.head_dim, m.moe_intermediate_size if m.is_moe else m.intermediate_size)
    return QuantizeJob(architecture=m.architecture, quantization=p.quantization, calibration=cal, calibration_path=path,
                       tp_size=p.parallel.tp_size,
                       moe_layout=(mp.moe_tp_size, mp.moe_ep_size) if m.is_moe else None,
                       group_size=group_size_for(p.quantization, widths), logits_dtype=p.build.logits_dtype,
                       export_format=export_format)


__all__ = ["QuantizeJob", "job_of", "group_size_for", "ExportFormat", "EXPORT_FORMAT_OF_ROUTE", "NO_HF_UNIFIED_EXPORT",
           "check_export_format"]
