"""The LLM-API route's runtime configuration, rendered from the plan (issue 28): the ``trtllm-serve --config`` YAML
(``render_llm_args``) and the Triton LLM-API unit's ``1/model.yaml`` (``render_model_yaml``), plus the stage that writes
both (``LlmApiConfigStage``, folder ``llm_api/``).

Keys are ``TorchLlmArgs`` fields of the targeted TensorRT-LLM line (``spec/llm_args.py``; ``check_llm_args`` is
re-exported here and refuses anything else). What each key is rendered from: ``spec/llm_args.py`` ``RENDERED_FROM``.

``model.yaml`` (TensorRT-LLM ``triton_backend/all_models/llmapi/tensorrt_llm/1/model.yaml`` and ``1/model.py``, commit
044a90d): ``model.py`` reads ``triton_config.decoupled`` and ``triton_config.max_batch_size`` (both required;
``auto_complete_config``) and optionally ``triton_config.cancellation_check_period_ms``; every other key goes to
``LLM(**args)`` through ``update_llm_args_with_extra_dict``. ``triton_config.max_batch_size`` is Triton's batch dimension,
which that model does not support ("max_batch_size: 0 # The current implementation does not support batching"), so it is
always 0; the LLM's own ``max_batch_size`` is the top-level key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from precision_pipeline.core.stage import Artifact, Done, Frozen, Stage
from precision_pipeline.resolve.plan import ResolvedPlan
from precision_pipeline.resolve.rules_llm_api import KV_DTYPE_OF
from precision_pipeline.resolve.stage import BuildRequest
from precision_pipeline.spec.llm_args import check_llm_args, trtllm_line

TRTLLM_SERVE_FILE = "trtllm-serve.yaml"
MODEL_YAML_FILE = "model.yaml"
RECORD_FILE = "llm_api.json"
TRITON_MAX_BATCH_SIZE = 0
"""``triton_config.max_batch_size`` of the LLM-API model: 0 (model.yaml: the model does not support Triton batching)."""
POLICY = {"max_utilization": "MAX_UTILIZATION", "guaranteed_no_evict": "GUARANTEED_NO_EVICT"}
"""``runtime.batch_scheduler_policy`` -> ``SchedulerConfig.capacity_scheduler_policy`` (CapacitySchedulerPolicy values)."""


def _merge(base: dict, extra: Mapping) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(out.get(k), dict) and isinstance(v, Mapping) else v
    return out


def render_llm_args(plan: ResolvedPlan) -> dict:
    """The TorchLlmArgs mapping of ``plan`` (the ``trtllm-serve --config`` YAML): limits, parallel sizes, KV cache
    (dtype = the checkpoint's KV format, memory fraction, block reuse, tokens per block), chunked prefill, scheduler
    policy, ``return_perf_metrics: true`` (``/prometheus/metrics``), the OTLP endpoint when set, then the profile's
    ``llm_api`` extras. Raises UserError (exit 2) when a key is not a field of the plan's TensorRT-LLM line."""
    p, lim, mp = plan.profile, plan.limits, plan.mapping
    kv = {"dtype": KV_DTYPE_OF.get(p.quantization.kv_cache_quant_algo.value, "auto"),
          "free_gpu_memory_fraction": p.runtime.kv_cache_free_gpu_mem_fraction,
          "enable_block_reuse": p.runtime.enable_kv_cache_reuse,
          "tokens_per_block": p.build.tokens_per_block}
    d: dict[str, Any] = {
        "max_batch_size": lim.max_batch_size, "max_num_tokens": lim.max_num_tokens, "max_seq_len": lim.max_seq_len,
        "max_beam_width": lim.max_beam_width,
        "tensor_parallel_size": mp.tp_size, "pipeline_parallel_size": mp.pp_size,
        "moe_tensor_parallel_size": mp.moe_tp_size, "moe_expert_parallel_size": mp.moe_ep_size,
        "kv_cache_config": kv, "enable_chunked_prefill": p.context_phase.enable_chunked_context,
        "scheduler_config": {"capacity_scheduler_policy": POLICY[p.runtime.batch_scheduler_policy]},
        "return_perf_metrics": True,
    }
    if p.build.max_input_len is not None:
        d["max_input_len"] = lim.max_input_len
    if p.deployment.otlp_traces_url:
        d["otlp_traces_endpoint"] = p.deployment.otlp_traces_url
    d = _merge(d, p.llm_api)
    check_llm_args(d, plan.trtllm_version, prefix="rendered")
    return d


def render_model_yaml(plan: ResolvedPlan, model_path: str) -> dict:
    """The Triton LLM-API unit's ``1/model.yaml``: ``model`` (the checkpoint folder as the server sees it),
    ``backend: pytorch``, every key of ``render_llm_args(plan)``, and ``triton_config`` {max_batch_size: 0,
    decoupled: runtime.decoupled_mode}. Raises UserError as ``render_llm_args``."""
    args = render_llm_args(plan)
    return {"model": str(model_path), "backend": "pytorch", **args,
            "triton_config": {"max_batch_size": TRITON_MAX_BATCH_SIZE, "decoupled": plan.profile.runtime.decoupled_mode}}


# ---------------------------------------------------------------------------------------------------------------
# The stage


class LlmApiConfigInputs(Frozen):
    """Keyed: what is rendered (the LLM args and the model.yaml), the runtime line, and the checkpoint it serves."""

    llm_args: dict
    model_yaml: dict
    trtllm_version: str
    checkpoint_key: str
    out_dir: str
    """Absolute final folder (``<out>/llm_api``) the artifact's paths name."""


class LlmApiConfigArtifact(Artifact):
    """``<out>/llm_api``: ``trtllm-serve.yaml``, ``model.yaml`` and ``llm_api.json`` (runtime version, checkpoint key)."""

    trtllm_serve_yaml: str
    model_yaml: str
    trtllm_version: str

    def summary(self) -> dict[str, Any]:
        return {"trtllm_version": self.trtllm_version}

    def present(self, out_dir: Path) -> bool:
        return Path(self.trtllm_serve_yaml).is_file() and Path(self.model_yaml).is_file()

    def plan_view(self) -> dict[str, Any]:
        return {"llm_api": {"trtllm_serve_yaml": self.trtllm_serve_yaml, "model_yaml": self.model_yaml,
                            "trtllm_version": self.trtllm_version}}


class LlmApiConfigStage(Stage[LlmApiConfigInputs, LlmApiConfigArtifact]):
    """Renders the LLM-API runtime configuration after the gate passed (``needs``: quantize, gate). The model path in
    ``model.yaml`` is the checkpoint folder (``<out>/checkpoint``); pack re-points it inside the repository unit."""

    name = "llm_api_config"
    version = 1
    code = ("engine/llm_api_config.py", "spec/llm_args.py", "core")
    needs = ("quantize", "gate")
    output = "llm_api"
    artifact_type = LlmApiConfigArtifact

    def inputs(self, plan: ResolvedPlan, request: BuildRequest, upstream: Mapping[str, Done]) -> LlmApiConfigInputs:
        q = upstream["quantize"]
        return LlmApiConfigInputs(llm_args=render_llm_args(plan), model_yaml=render_model_yaml(plan, str(q.dir)),
                                  trtllm_version=plan.trtllm_version, checkpoint_key=q.key,
                                  out_dir=str((Path(request.out_dir) / self.output).resolve()))

    def preflight(self, plan: ResolvedPlan, request: BuildRequest) -> None:
        """Render once before the first write: a key the line does not know is refused before quantize runs."""
        render_llm_args(plan)

    def run(self, inputs: LlmApiConfigInputs, workdir: Path) -> LlmApiConfigArtifact:
        import json

        import yaml

        from precision_pipeline.core.store import atomic_write_text

        workdir = Path(workdir)
        head = (f"# Rendered by precision-pipeline (stage llm_api_config) for TensorRT-LLM {inputs.trtllm_version} "
                f"(line {trtllm_line(inputs.trtllm_version)}); checkpoint key {inputs.checkpoint_key[:12]}\n")
        atomic_write_text(workdir / TRTLLM_SERVE_FILE, head + yaml.safe_dump(inputs.llm_args, sort_keys=False))
        atomic_write_text(workdir / MODEL_YAML_FILE, head + yaml.safe_dump(inputs.model_yaml, sort_keys=False))
        atomic_write_text(workdir / RECORD_FILE, json.dumps({"trtllm_version": inputs.trtllm_version,
                                                             "checkpoint_key": inputs.checkpoint_key}, indent=2) + "\n")
        final = Path(inputs.out_dir)  # the runner renames workdir there
        return LlmApiConfigArtifact(trtllm_serve_yaml=str(final / TRTLLM_SERVE_FILE), model_yaml=str(final / MODEL_YAML_FILE),
                                    trtllm_version=inputs.trtllm_version)


__all__ = ["render_llm_args", "render_model_yaml", "check_llm_args", "TRTLLM_SERVE_FILE", "MODEL_YAML_FILE",
           "TRITON_MAX_BATCH_SIZE", "LlmApiConfigInputs", "LlmApiConfigArtifact", "LlmApiConfigStage"]
