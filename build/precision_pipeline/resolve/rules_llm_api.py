"""The rules of the route and the TensorRT-LLM line (issue 28), registered after ``rules_fit.py``'s.

* ``route.trtllm_version``: the route runs on the targeted line (the engine route needs trtllm-build: 1.2 only).
* ``model.family_route``: the model's family runs on that route, line and format (``spec/capability.py``
  ``FAMILY_TABLE``; Qwen3 on route llm_api only), refused at ``invoke check`` naming where it runs.
* ``llm_api.args``: the ``llm_api:`` section holds TorchLlmArgs keys of that line ("did you mean"; legacy engine names
  name their replacement), none of the keys the profile renders from its own sections, none that would serve something
  other than what the gate measured (``spec/llm_args.py`` ``NOT_GATED``: model, backend, tokenizer, weights, dtype,
  code), and only on route llm_api.
* ``deployment.server``: ``trtllm-serve`` only on route llm_api (an engine build renders Triton manifests; hostile s9
  F4: the setting was ignored without a word).
* ``llm_api.kv_dtype``: a runtime ``kv_cache_config.dtype`` equals the checkpoint's ``kv_cache_quant_algo`` (auto is
  fine): the runtime would override the checkpoint's KV format with one warning and serve an uncalibrated KV cache the
  gate never measured (``tensorrt_llm/_torch/pyexecutor/model_loader.py``).
* ``llm_api.engine_settings``: engine-only settings a profile sets (``spec/llm_args.py`` ``ENGINE_ONLY_SETTINGS``):
  kernel flags recorded as runtime-chosen (a warning), settings that cannot be honoured refused.
* ``llm_api.chunked_prefill``: max_num_tokens < max_input_len needs chunked prefill (the llm_api counterpart of the
  engine-only ``limits.num_tokens_vs_input``).

The format x SM refusals of the route live in ``format.gemm_sm`` / ``format.kv_sm`` (``spec/capability.py``).
"""

from __future__ import annotations

from precision_pipeline.resolve.registry import Context, Finding, refuse, rule, warn
from precision_pipeline.spec import llm_args as LA
from precision_pipeline.spec.capability import ROUTE_LINES, SRC_ROUTE_LINES, route_runs_line

LLM_API_ONLY = ("llm_api",)
SRC_ARGS = f"{LA.LLM_ARGS_FILE} (BaseLlmArgs extra='forbid'); spec/llm_args.py"


@rule("route.trtllm_version", "the route runs on the targeted TensorRT-LLM line", SRC_ROUTE_LINES, needs_gpu=False)
def _route_version(ctx: Context) -> list[Finding]:
    if route_runs_line(ctx.route, ctx.trtllm_version):
        return []
    lines = " or ".join(f"{x}.x" for x in ROUTE_LINES.get(ctx.route, ()))
    return [refuse("target.trtllm_version", f"route {ctx.route} does not run on TensorRT-LLM {ctx.trtllm_version}: "
                   f"it needs {lines} (trtllm-build and the TensorRT engine backend were removed after the 1.2 line).",
                   "use trtllm_version 1.2.1 with route engine, or route: llm_api for 1.3.0rcN (trtllm-serve).")]


@rule("deployment.server", "trtllm-serve serves the llm_api route only",
      "spec/profile.py Deployment.server; serving/stage.py (only the llm_api deploy stage reads it)", needs_gpu=False)
def _server_route(ctx: Context) -> list[Finding]:
    if ctx.profile.deployment.server != "trtllm-serve" or ctx.route == "llm_api":
        return []
    return [refuse("deployment.server", f"trtllm-serve serves the llm_api route only (the LLM API from a rendered "
                   f"--config); this profile's route is {ctx.route}, whose build renders Triton manifests, so the setting "
                   "would be ignored.", "remove deployment.server (Triton serves the engine route), or set route: "
                   "llm_api.")]


@rule("model.sliding_window", "a model's attention window covers the served sequence, or a warning says it does not",
      "tensorrtllm_backend docs/model_config.md:115 (max_attention_window_size: default max_sequence_length, every "
      "token); spec/families.py (Mistral sources)", needs_gpu=False)
def _sliding_window(ctx: Context) -> list[Finding]:
    w, msl = ctx.model.sliding_window, ctx.limits["max_seq_len"]
    if not w or w >= msl:
        return []
    return [warn("build.max_seq_len", f"{ctx.model.architecture} attends to its last {w:,} tokens (sliding_window) but "
                 f"max_seq_len is {msl:,}: the served runtime attends to every token (this pipeline renders no "
                 "max_attention_window_size / kv_cache_config.max_attention_window), so prompts longer than the window "
                 "are served unlike the trained model; the gate's prompts are shorter and do not see it.",
                 f"set build.max_seq_len <= {w}, or serve a model revision without a window (Mistral-7B from v0.2).")]


def _dotted(d: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        key = f"{prefix}{k}"
        out.append(key)
        if isinstance(v, dict) and k in ("kv_cache_config", "scheduler_config"):
            out.extend(_dotted(v, key + "."))
    return out


@rule("llm_api.args", "the llm_api section holds TorchLlmArgs keys of the targeted line, none rendered from the profile",
      SRC_ARGS, needs_gpu=False)
def _llm_api_args(ctx: Context) -> list[Finding]:
    extra = ctx.profile.llm_api
    if not extra:
        return []
    if ctx.route != "llm_api":
        return [refuse("llm_api", f"is only read on route llm_api; this profile's route is {ctx.route}, so it would be "
                       "ignored.", "set route: llm_api, or remove the llm_api section.")]
    out = [refuse(p.field, p.reason, p.fix) for p in LA.llm_args_problems(extra, ctx.trtllm_version)]
    if out:
        return out
    for key in _dotted(extra):
        if key in LA.NOT_GATED:
            out.append(refuse(f"llm_api.{key}", f"would serve something other than what the gate measured: "
                              f"{LA.NOT_GATED[key]}.", "remove it; to serve another model or checkpoint, build a "
                              "profile for it (`invoke build --profile P`, or --checkpoint DIR), so the gate measures it."))
            continue
        src = LA.RENDERED_FROM.get(key)
        if src is None or key == "kv_cache_config.dtype":  # the dtype: rule llm_api.kv_dtype
            continue
        fix = f"set {src} instead." if "." in src else "remove it: the pipeline always renders it."
        out.append(refuse(f"llm_api.{key}", f"is rendered from {src}; a second home for it would let the two disagree.",
                          fix))
    return out


KV_DTYPE_OF = {a.value: d for a, d in LA.KV_DTYPE_OF_ALGO.items()}
"""``spec/llm_args.py`` ``KV_DTYPE_OF_ALGO`` by ``kv_cache_quant_algo`` value."""


@rule("llm_api.kv_dtype", "a runtime kv_cache_config.dtype equals the checkpoint's kv_cache_quant_algo (auto is fine)",
      "tensorrt_llm/_torch/pyexecutor/model_loader.py (an explicit dtype overrides the checkpoint's KV algo with one "
      "warning); " + SRC_ARGS, needs_gpu=False, routes=LLM_API_ONLY)
def _kv_dtype(ctx: Context) -> list[Finding]:
    kvc = ctx.profile.llm_api.get("kv_cache_config")
    asked = kvc.get("dtype") if isinstance(kvc, dict) else None
    if asked is None or asked == "auto" or asked not in LA.KV_CACHE_DTYPES:  # unknown values: llm_api.args
        return []
    ckpt = ctx.kv
    if KV_DTYPE_OF.get(ckpt) == asked:
        return []
    want = KV_DTYPE_OF.get(ckpt)
    return [refuse("llm_api.kv_cache_config.dtype",
                   f"{asked!r} differs from the checkpoint's kv_cache_quant_algo {ckpt}: the runtime would override the "
                   "checkpoint's KV format with only a warning and serve a KV cache the calibration never scaled and the "
                   "gate never measured.",
                   f"remove it (auto keeps the checkpoint's {ckpt})" + (f", or write {want!r}" if want and want != "auto"
                                                                         else "") +
                   f"; to serve a {asked} KV cache, set quantization.kv_cache_quant_algo: {asked.upper()} (calibrated "
                   "and gated).")]


@rule("llm_api.engine_settings", "engine-only settings: kernel flags recorded as runtime-chosen, the rest refused",
      "spec/llm_args.py ENGINE_ONLY_SETTINGS; PR #8862, #15417 (kernels are the runtime's choice)", needs_gpu=False,
      routes=LLM_API_ONLY)
def _engine_settings(ctx: Context) -> list[Finding]:
    p = ctx.profile
    runtime_chosen: list[str] = []
    out: list[Finding] = []
    for path, (treatment, why) in LA.ENGINE_ONLY_SETTINGS.items():
        section_name, name = path.split(".")
        section = getattr(p, section_name)
        value, default = getattr(section, name), type(section).model_fields[name].default
        if treatment == "runtime":
            if name in section.model_fields_set:
                runtime_chosen.append(f"{path}: {value!r}")
        elif value != default:
            out.append(refuse(path, f"{value!r} cannot be honoured on route llm_api: {why}.",
                              f"remove it (or set it to {default!r}), or use route: engine."))
    if runtime_chosen:
        out.append(warn("context_phase", "recorded as runtime-chosen, not applied on route llm_api (the PyTorch runtime "
                        "picks its attention and GEMM kernels itself, PR #8862, #15417): " + "; ".join(runtime_chosen)
                        + ".", "remove them from an llm_api profile, or use route: engine to set them."))
    return out


@rule("llm_api.chunked_prefill", "max_num_tokens < max_input_len needs enable_chunked_prefill",
      f"{LA.LLM_ARGS_FILE} (enable_chunked_prefill)", needs_gpu=False, routes=LLM_API_ONLY)
def _chunked_prefill(ctx: Context) -> list[Finding]:
    lim = ctx.limits
    if lim["max_num_tokens"] >= lim["max_input_len"] or ctx.profile.context_phase.enable_chunked_context:
        return []
    return [refuse("build.max_num_tokens", f"{lim['max_num_tokens']:,} is less than max_input_len {lim['max_input_len']:,}: "
                   "a prompt that long only fits if it is prefilled in chunks.",
                   "set context_phase.enable_chunked_context: true (rendered as enable_chunked_prefill), or raise "
                   f"max_num_tokens to >= {lim['max_input_len']:,}.")]


__all__ = ["KV_DTYPE_OF", "LLM_API_ONLY"]
