"""The LLM-API route's vocabulary: the TensorRT-LLM lines a profile may target, the ``TorchLlmArgs`` field list per
line (the keys of a ``trtllm-serve --config`` YAML and of a Triton LLM-API ``model.yaml``), the legacy engine-only
names with their replacements, and ``check_llm_args`` (one home for "is this key a TorchLlmArgs field").

Source of the field list: NVIDIA/TensorRT-LLM ``tensorrt_llm/llmapi/llm_args.py`` -- ``BaseLlmArgs`` (its fields are
``TorchLlmArgs``'s too), ``TorchLlmArgs`` and the nested ``KvCacheConfig`` / ``SchedulerConfig`` / ``CudaGraphConfig``. ``BaseLlmArgs`` is a
``StrictBaseModel`` with ``extra="forbid"`` there, so an unknown or legacy key makes ``LLM(...)`` / ``trtllm-serve``
fail at start-up; this module refuses it at ``invoke check`` instead, with "did you mean".

What was read (``LINES[...].source``): the stored 1.2-line version of the file (it still holds ``TrtLlmArgs`` and
``BuildConfig``, which PR #15918 removed after 1.2, and already ``custom_tokenizer`` and
``KvCacheConfig.use_kv_cache_manager_v2``, which date it to the late 1.2.0rc / 1.2.x line); its search-index id is
recorded. The v1.2.1 and 1.3.0rcN tag commits themselves could not be read here (the repository snapshot is over the
fetch limit and the index names no tags): a GPU node should confirm with
``python -c "from tensorrt_llm.llmapi import TorchLlmArgs; print(sorted(TorchLlmArgs.model_fields))"``
(``tests/engine/test_llm_api_config.py`` has that check; it skips without TensorRT-LLM). The 1.3 line uses the 1.2
list: every key this pipeline renders is on the published 1.3.0rc / 1.4.0rc ``TorchLlmArgs`` reference pages
(nvidia.github.io/TensorRT-LLM/<version>/llm-api/reference/TorchLlmArgs.html).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

from precision_pipeline.core.errors import Problem, UserError, closest
from precision_pipeline.spec.algos import KVCacheQuantAlgo

LLM_ARGS_FILE = "tensorrt_llm/llmapi/llm_args.py"
DEFAULT_TRTLLM_VERSION = "1.2.1"
"""The line Triton's ``trtllm-python-py3`` images ship (26.04-26.07; server docs/introduction/compatibility.md) and the
tensorrtllm_backend Dockerfile pins (``TENSORRTLLM_VER=1.2.1``, dockerfile/Dockerfile.triton.trt_llm_backend)."""

_VERSION_RE = re.compile(r"^(?P<line>1\.2)\.\d{1,3}$|^(?P<line3>1\.3)\.0rc\d{1,3}$")

# BaseLlmArgs fields (llm_args.py, class BaseLlmArgs, stored 1.2-line version): the keys shared by both backends.
_BASE_FIELDS = (
    "model", "tokenizer", "tokenizer_mode", "custom_tokenizer", "skip_tokenizer_init", "trust_remote_code",
    "tensor_parallel_size", "dtype", "revision", "tokenizer_revision", "model_kwargs", "pipeline_parallel_size",
    "context_parallel_size", "gpus_per_node", "moe_cluster_parallel_size", "moe_tensor_parallel_size",
    "moe_expert_parallel_size", "enable_attention_dp", "enable_lm_head_tp_in_adp", "pp_partition", "cp_config",
    "load_format", "enable_lora", "lora_config", "kv_cache_config", "enable_chunked_prefill", "guided_decoding_backend",
    "batched_logits_processor", "iter_stats_max_iterations", "request_stats_max_iterations", "peft_cache_config",
    "scheduler_config", "cache_transceiver_config", "sparse_attention_config", "speculative_config", "max_batch_size",
    "max_input_len", "max_seq_len", "max_beam_width", "max_num_tokens", "gather_generation_logits",
    "num_postprocess_workers", "postprocess_tokenizer_dir", "reasoning_parser", "decoding_config", "mpi_session",
    "otlp_traces_endpoint", "backend", "return_perf_metrics", "perf_metrics_max_requests", "orchestrator_type",
    "env_overrides",
)
# TorchLlmArgs's own fields (class TorchLlmArgs(BaseLlmArgs), same file and version).
_TORCH_FIELDS = (
    "garbage_collection_gen0_threshold", "cuda_graph_config", "attention_dp_config", "disable_overlap_scheduler",
    "moe_config", "nvfp4_gemm_config", "attn_backend", "sampler_type", "sampler_force_async_worker",
    "enable_iter_perf_stats", "enable_iter_req_stats", "print_iter_log", "batch_wait_timeout_ms",
    "batch_wait_timeout_iters", "batch_wait_max_tokens_ratio", "torch_compile_config", "enable_autotuner",
    "enable_layerwise_nvtx_marker", "enable_min_latency", "stream_interval", "force_dynamic_quantization",
    "allreduce_strategy", "checkpoint_loader", "checkpoint_format", "kv_connector_config", "mm_encoder_only",
    "ray_worker_extension_cls", "ray_placement_config", "enable_sleep", "use_cute_dsl_blockscaling_mm",
    "use_cute_dsl_blockscaling_bmm", "disable_flashinfer_sampling", "max_stats_len", "layer_wise_benchmarks_config",
)
# class KvCacheConfig(StrictBaseModel, PybindMirror) (same file and version).
_KV_CACHE_FIELDS = (
    "enable_block_reuse", "max_tokens", "max_attention_window", "sink_token_length", "free_gpu_memory_fraction",
    "host_cache_size", "onboard_blocks", "cross_kv_cache_fraction", "secondary_offload_min_priority",
    "event_buffer_max_size", "attention_dp_events_gather_period_ms", "enable_partial_reuse", "copy_on_partial_reuse",
    "use_uvm", "max_gpu_total_bytes", "dtype", "mamba_ssm_cache_dtype", "tokens_per_block", "use_kv_cache_manager_v2",
    "max_util_for_resume",
)
# class SchedulerConfig (llm_args.py): capacity_scheduler_policy (CapacitySchedulerPolicy: MAX_UTILIZATION,
# GUARANTEED_NO_EVICT, STATIC_BATCH), context_chunking_policy, dynamic_batch_config.
_SCHEDULER_FIELDS = ("capacity_scheduler_policy", "context_chunking_policy", "dynamic_batch_config")
# class CudaGraphConfig(StrictBaseModel) (same file and version, search-index id 7019226376): batch_sizes,
# max_batch_size, enable_padding (hostile s9 F3: a typo below cuda_graph_config passed check).
_CUDA_GRAPH_FIELDS = ("batch_sizes", "max_batch_size", "enable_padding")

KV_CACHE_DTYPES = ("auto", "fp8", "nvfp4")
"""``kv_cache_config.dtype`` values the PyTorch backend takes (``tensorrt_llm/_torch/pyexecutor/model_loader.py``; auto keeps
the checkpoint's ``kv_cache_quant_algo``; ``TorchLlmArgs.sync_quant_config_with_kv_cache_config_dtype`` copies fp8 into the
quant config). No INT8 KV cache on this backend (PR #18953 open)."""

KV_DTYPE_OF_ALGO = {KVCacheQuantAlgo.NONE: "auto", KVCacheQuantAlgo.FP8: "fp8", KVCacheQuantAlgo.NVFP4: "nvfp4"}
"""The ``kv_cache_config.dtype`` that serves a checkpoint's ``kv_cache_quant_algo`` (NONE: auto keeps the model dtype;
INT8 has none: refused by rule ``format.kv_sm`` on the llm_api route)."""


@dataclass(frozen=True)
class ArgsList:
    """The keys of one TensorRT-LLM line: ``fields`` (top level), ``nested`` (section -> its fields) and where they
    were read (``source``)."""

    line: str
    fields: frozenset[str]
    nested: dict[str, frozenset[str]]
    source: str


_SOURCE_12 = (f"NVIDIA/TensorRT-LLM {LLM_ARGS_FILE} (BaseLlmArgs, TorchLlmArgs, KvCacheConfig, SchedulerConfig), stored "
              "1.2-line version, search-index id 7019226376 (TrtLlmArgs still present: before PR #15918); the v1.2.1 tag "
              "commit was not readable here")
_NESTED = {"kv_cache_config": frozenset(_KV_CACHE_FIELDS), "scheduler_config": frozenset(_SCHEDULER_FIELDS),
           "cuda_graph_config": frozenset(_CUDA_GRAPH_FIELDS)}
LINES: dict[str, ArgsList] = {
    "1.2": ArgsList("1.2", frozenset(_BASE_FIELDS + _TORCH_FIELDS), _NESTED, _SOURCE_12),
    "1.3": ArgsList("1.3", frozenset(_BASE_FIELDS + _TORCH_FIELDS), _NESTED,
                    _SOURCE_12 + "; the 1.3.0rc line takes the same list (not re-read: no 1.3.0rc tag commit was "
                    "readable; the rendered keys are on the 1.3.0rc/1.4.0rc TorchLlmArgs reference pages)"),
}
"""TensorRT-LLM line -> its ``TorchLlmArgs`` keys."""

KNOWN_VERSIONS_TEXT = "1.2.x (e.g. 1.2.1, Triton's trtllm-python-py3 images) or 1.3.0rcN (e.g. 1.3.0rc29, trtllm-serve / Dynamo 1.6)"


def trtllm_line(version: str) -> str:
    """The line (``"1.2"`` or ``"1.3"``) of a ``target.trtllm_version`` string. Raises ValueError (text: reason)
    for a version this pipeline has no facts for."""
    m = _VERSION_RE.match(str(version))
    if not m:
        raise ValueError(f"{str(version)[:40]!r} is not a TensorRT-LLM version this pipeline has facts for: "
                         f"{KNOWN_VERSIONS_TEXT}")
    return m.group("line") or m.group("line3")


def args_list(version: str) -> ArgsList:
    """The ``ArgsList`` of ``version``'s line (ValueError as ``trtllm_line``)."""
    return LINES[trtllm_line(version)]


@dataclass(frozen=True)
class Legacy:
    """A name from the engine route (trtllm-build / tensorrtllm_backend config.pbtxt) that is not a TorchLlmArgs key:
    its replacement on the LLM API (None: no setting; the runtime chooses) and why."""

    replacement: Optional[str]
    why: str


_RUNTIME = "the PyTorch runtime chooses its attention kernels itself (PR #8862, #15417); there is no LLM-API setting"
LEGACY: dict[str, Legacy] = {
    # tensorrtllm_backend config.pbtxt parameters -> llm_args.py fields
    "kv_cache_free_gpu_mem_fraction": Legacy("kv_cache_config.free_gpu_memory_fraction", "KvCacheConfig field"),
    "enable_kv_cache_reuse": Legacy("kv_cache_config.enable_block_reuse", "KvCacheConfig field"),
    "max_tokens_in_paged_kv_cache": Legacy("kv_cache_config.max_tokens", "KvCacheConfig field"),
    "max_attention_window_size": Legacy("kv_cache_config.max_attention_window", "KvCacheConfig field"),
    "enable_chunked_context": Legacy("enable_chunked_prefill", "BaseLlmArgs field"),
    "batch_scheduler_policy": Legacy("scheduler_config.capacity_scheduler_policy", "SchedulerConfig field"),
    "kv_cache_dtype": Legacy("kv_cache_config.dtype", "KvCacheConfig field"),
    "tokens_per_block": Legacy("kv_cache_config.tokens_per_block", "KvCacheConfig field"),
    "decoupled_mode": Legacy("triton_config.decoupled", "the Triton LLM-API model.yaml's triton_config (model.py)"),
    # trtllm-build / Mapping names -> BaseLlmArgs fields
    "tp_size": Legacy("tensor_parallel_size", "BaseLlmArgs field"),
    "pp_size": Legacy("pipeline_parallel_size", "BaseLlmArgs field"),
    "moe_tp_size": Legacy("moe_tensor_parallel_size", "BaseLlmArgs field"),
    "moe_ep_size": Legacy("moe_expert_parallel_size", "BaseLlmArgs field"),
    # trtllm-build flags (PluginConfig / BuildConfig) with no LLM-API setting
    "context_fmha": Legacy(None, _RUNTIME),
    "use_paged_context_fmha": Legacy(None, _RUNTIME + " (its KV cache is always paged)"),
    "use_fp8_context_fmha": Legacy(None, _RUNTIME),
    "gpt_attention_plugin": Legacy(None, _RUNTIME),
    "multi_block_mode": Legacy(None, _RUNTIME + " (ExtendedRuntimePerfKnobConfig is TrtLlmArgs-only)"),
    "gemm_plugin": Legacy(None, "a trtllm-build plugin flag; the PyTorch backend picks its GEMM kernels per format and SM"),
    "kv_cache_type": Legacy(None, "a trtllm-build flag; the PyTorch backend's KV cache is paged"),
    "logits_dtype": Legacy(None, "a trtllm-build flag with no TorchLlmArgs field"),
    "gather_context_logits": Legacy(None, "a trtllm-build flag; the LLM API returns context logits per request "
                                          "(SamplingParams.return_context_logits)"),
    "build_config": Legacy(None, "TrtLlmArgs only (the TensorRT engine backend)"),
    "quant_config": Legacy(None, "read from the checkpoint's hf_quant_config.json (ModelConfig.from_pretrained), not "
                                 "set in the YAML"),
}
"""Engine-route names that are not TorchLlmArgs keys (``check_llm_args`` names the replacement). Sources: tensorrtllm_backend
``all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt`` (the engine route's runtime parameters), TensorRT-LLM 1.2
``tensorrt_llm/commands/build.py`` and ``plugin/plugin.py`` (build flags), and the llm_args.py fields they map to."""


def _key_problem(key: Any, known: frozenset[str], where: str, field: str, line: str) -> Optional[Problem]:
    if not isinstance(key, str):
        return Problem(field, f"{key!r} is not a key name.", "write the TorchLlmArgs field name as text.")
    if key in known:
        return None
    short_key = key.rsplit(".", 1)[-1]
    leg = LEGACY.get(short_key)
    if leg is not None:
        if leg.replacement:
            return Problem(field, f"is an engine-route name, not a {where} key on TensorRT-LLM {line} ({leg.why}).",
                           f"use {leg.replacement}.")
        return Problem(field, f"is an engine-route setting with no {where} key on TensorRT-LLM {line}: {leg.why}.",
                       "remove it.")
    hint = closest(key, known)
    return Problem(field, f"is not a {where} key on TensorRT-LLM {line} ({LLM_ARGS_FILE}).",
                   f"did you mean {hint!r}?" if hint else "see the TorchLlmArgs reference for the keys.")


def llm_args_problems(d: Any, version: str, prefix: str = "llm_api") -> list[Problem]:
    """Every problem of ``d`` as a set of TorchLlmArgs keys for ``version`` (``prefix``: the field path shown):
    unknown keys ("did you mean"), legacy engine-route names (their replacement), unknown keys inside
    ``kv_cache_config`` / ``scheduler_config`` / ``cuda_graph_config``, and a ``kv_cache_config.dtype`` outside
    ``KV_CACHE_DTYPES``. Other nested sections are passed through unchecked below their top-level key."""
    try:
        al = args_list(version)
    except ValueError as e:
        return [Problem("target.trtllm_version", str(e) + ".", f"use {KNOWN_VERSIONS_TEXT}.")]
    if not isinstance(d, dict):
        return [Problem(prefix, f"must be a mapping of TorchLlmArgs keys, got {type(d).__name__}.",
                        "write e.g. 'llm_api: {cuda_graph_config: {enable_padding: true}}'.")]
    out: list[Problem] = []
    for k, v in d.items():
        pr = _key_problem(k, al.fields, "TorchLlmArgs", f"{prefix}.{k}", al.line)
        if pr is not None:
            out.append(pr)
            continue
        if k in al.nested and v is not None:
            if not isinstance(v, dict):
                out.append(Problem(f"{prefix}.{k}", f"must be a mapping, got {type(v).__name__}.", "write its fields."))
                continue
            for nk in v:
                npr = _key_problem(nk, al.nested[k], k, f"{prefix}.{k}.{nk}", al.line)
                if npr is not None:
                    out.append(npr)
    kvd = (d.get("kv_cache_config") or {}).get("dtype") if isinstance(d.get("kv_cache_config"), dict) else None
    if kvd is not None and kvd not in KV_CACHE_DTYPES:
        out.append(Problem(f"{prefix}.kv_cache_config.dtype", f"{str(kvd)[:40]!r} is not a KV-cache dtype of the PyTorch "
                           "backend (model_loader.py; no INT8 KV cache).", f"use one of: {', '.join(KV_CACHE_DTYPES)}."))
    return out


def check_llm_args(d: dict, version: str, prefix: str = "llm_api") -> None:
    """Raise ``UserError`` (exit 2) listing every problem of ``llm_args_problems(d, version, prefix)``; None if clean."""
    problems = llm_args_problems(d, version, prefix)
    if problems:
        raise UserError(problems)


__all__ = ["LLM_ARGS_FILE", "DEFAULT_TRTLLM_VERSION", "KV_CACHE_DTYPES", "KV_DTYPE_OF_ALGO", "ArgsList", "LINES", "Legacy", "LEGACY",
           "KNOWN_VERSIONS_TEXT", "trtllm_line", "args_list", "llm_args_problems", "check_llm_args"]


RENDERED_FROM: dict[str, str] = {
    "max_batch_size": "build.max_batch_size",
    "max_num_tokens": "build.max_num_tokens",
    "max_seq_len": "build.max_seq_len",
    "max_input_len": "build.max_input_len",
    "max_beam_width": "build.max_beam_width",
    "tensor_parallel_size": "parallel.tp_size",
    "pipeline_parallel_size": "parallel.pp_size",
    "moe_tensor_parallel_size": "parallel.moe_tp_size",
    "moe_expert_parallel_size": "parallel.moe_ep_size",
    "kv_cache_config.free_gpu_memory_fraction": "runtime.kv_cache_free_gpu_mem_fraction",
    "kv_cache_config.enable_block_reuse": "runtime.enable_kv_cache_reuse",
    "kv_cache_config.tokens_per_block": "build.tokens_per_block",
    "kv_cache_config.dtype": "quantization.kv_cache_quant_algo",
    "enable_chunked_prefill": "context_phase.enable_chunked_context",
    "scheduler_config.capacity_scheduler_policy": "runtime.batch_scheduler_policy",
    "otlp_traces_endpoint": "deployment.otlp_endpoint",
    "return_perf_metrics": "(always true: /prometheus/metrics needs it)",
}
"""TorchLlmArgs key (dotted for nested) -> the profile field it is rendered from (``engine/llm_api_config.py``). A profile's
``llm_api:`` section may not set these (one home per setting), except ``kv_cache_config.dtype`` equal to the checkpoint's
KV format (rule ``llm_api.kv_dtype``)."""

_WEIGHTS = "the served weights are the gated checkpoint's, as the gate loaded them"
_TOKENIZER = "the served tokenizer is the gated checkpoint's own"
NOT_GATED: dict[str, str] = {
    "model": "the pipeline serves the gated checkpoint (model.yaml's model, trtllm-serve's argument)",
    "backend": "route llm_api serves on the PyTorch backend (model.yaml's backend: pytorch); another backend is "
               "another route",
    "tokenizer": _TOKENIZER, "custom_tokenizer": _TOKENIZER, "skip_tokenizer_init": _TOKENIZER,
    "tokenizer_revision": _TOKENIZER, "revision": _WEIGHTS, "load_format": _WEIGHTS, "checkpoint_format": _WEIGHTS,
    "checkpoint_loader": _WEIGHTS, "model_kwargs": _WEIGHTS + " (config.json as written)",
    "dtype": _WEIGHTS + " (its dtype)",
    "trust_remote_code": "code from the model folder would run in the server; the gate ran the pipeline's own reader",
    "enable_lora": "LoRA adapters change the served model; the gate measured the checkpoint without them",
    "lora_config": "LoRA adapters change the served model; the gate measured the checkpoint without them",
    "env_overrides": "the server process's environment (LD_PRELOAD, library paths, kernel switches) is the image's",
}
"""TorchLlmArgs keys a profile's ``llm_api:`` section may not set because they would serve something other than what the
gate measured (another model, backend, tokenizer, weights, dtype or code; hostile s9 F1): key -> why. Refused by rule
``llm_api.args`` (``resolve/rules_llm_api.py``) before anything is rendered."""

ENGINE_ONLY_SETTINGS: dict[str, tuple[str, str]] = {
    "context_phase.context_fmha": ("runtime", LEGACY["context_fmha"].why),
    "context_phase.use_paged_context_fmha": ("runtime", LEGACY["use_paged_context_fmha"].why),
    "context_phase.use_fp8_context_fmha": ("runtime", LEGACY["use_fp8_context_fmha"].why),
    "generation_phase.gpt_attention_plugin": ("runtime", LEGACY["gpt_attention_plugin"].why),
    "generation_phase.multi_block_mode": ("runtime", LEGACY["multi_block_mode"].why),
    "generation_phase.gemm_plugin": ("runtime", LEGACY["gemm_plugin"].why),
    "build.kv_cache_type": ("refuse", LEGACY["kv_cache_type"].why),
    "build.logits_dtype": ("refuse", LEGACY["logits_dtype"].why),
    "build.gather_context_logits": ("refuse", LEGACY["gather_context_logits"].why),
}
"""Profile settings of the engine route with no LLM-API key, and what the llm_api route does when a profile sets one
(explicitly or through ``extends``): ``runtime`` -- kernel choices the PyTorch runtime makes itself: recorded as
runtime-chosen (a warning in plan.json naming the setting; it is not applied), never dropped silently; ``refuse`` -- a
value other than the default cannot be honoured (there is no such setting), so the profile is refused. Every other
profile field is rendered (``RENDERED_FROM``) or is not a runtime setting (quantize, gate, deployment)."""

__all__ += ["RENDERED_FROM", "NOT_GATED", "ENGINE_ONLY_SETTINGS"]
