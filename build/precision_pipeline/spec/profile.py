"""Precision profiles: YAML files that state precision path by path.

A profile names the target GPU, the GEMM format (``quantization.quant_algo``), the KV-cache
format (``quantization.kv_cache_quant_algo``), the context-phase (prefill) attention kernels,
the generation-phase (decode) settings, FP32 logits, layers kept in high precision, the
parallel layout (tp_size/pp_size/moe_tp_size/moe_ep_size), build limits, calibration, the
runtime/deployment settings and the accuracy budget (``gate``).

Loading rules (``load_profile``):

* ``--profile`` is a shipped profile's name (``precision_profiles/<name>.yaml``) or a path to
  a YAML file. Names are ``[a-z0-9][a-z0-9._-]*``; anything else (``../../etc``) is refused.
* ``extends: NAME`` merges the profile over its parent: mappings merge key by key, lists and
  scalars replace; a gate field the child sets also replaces it in the overrides it inherits (``merge_profiles``). Cycles are refused. ``NAME`` is looked up as ``NAME.yaml`` beside the
  extending profile first (unless that is the extending file itself: a user's ``fp8-h100.yaml``
  with ``extends: fp8-h100`` extends the shipped one), then among the shipped profiles. ``extends: sub/base.yaml`` is a
  path relative to the extending profile's folder and must stay inside that folder tree or
  inside ``precision_profiles/`` (symlinks resolved; absolute paths and ``..`` escapes are
  refused), so a profile can never make the loader open an unrelated file.
* YAML is read strictly (spec/profile_yaml.py): a key given twice in one mapping is refused with both line numbers
  (PyYAML would keep the last one silently), anchors/aliases may expand to at most
  ``MAX_YAML_NODES`` nodes (a "billion laughs" file is refused before it is built), numbers and
  booleans are not converted into each other (``max_batch_size: true`` is refused), and
  non-finite numbers (``.inf``, ``.nan``) are refused.
* Numbers mean what YAML 1.2 says or are refused: PyYAML reads YAML 1.1, where ``064`` is octal 52,
  ``1:04`` is base-60 64 and ``1_000`` drops the ``_``; each of these is refused with the value it
  would silently have become (``_yaml11_number_problem``); so are the YAML 1.1 booleans ``yes``/``no``/``on``/``off``
  (any case: "write true or false"; ``y``/``n`` stay text, which a boolean field refuses), an unquoted date
  (a YAML 1.1 timestamp: "quote it if it is text") and ``0o10`` (YAML 1.2 octal, text to PyYAML: "write 8").
  ``!!binary`` is refused. Merge keys
  (``<<: *anchor``) are supported: the anchored mapping's keys, then the mapping's own keys win.
* Validation is pydantic with ``extra="forbid"``: an unknown key is an error that suggests the
  closest known key.

Field names follow TensorRT-LLM 1.2 (``tensorrt_llm/builder.py`` BuildConfig,
``tensorrt_llm/plugin/plugin.py`` PluginConfig, ``tensorrt_llm/quantization/mode.py`` QuantAlgo,
``tensorrt_llm/llmapi/llm_args.py`` KvCacheConfig) and tensorrtllm_backend's
``tensorrt_llm/config.pbtxt`` parameters.

Errors: every failure raises ``precision_pipeline.core.errors.UserError`` (exit code 2) naming the field.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from precision_pipeline.core.errors import Problem, UserError, closest
from precision_pipeline.core.paths import REPO_ROOT
from precision_pipeline.spec import formats as F
from precision_pipeline.spec.algos import KVCacheQuantAlgo, QuantAlgo
from precision_pipeline.spec.llm_args import DEFAULT_TRTLLM_VERSION, KNOWN_VERSIONS_TEXT, trtllm_line
from precision_pipeline.spec.profile_yaml import deep_merge  # noqa: F401  (spec.profile.deep_merge: its callers)
from precision_pipeline.spec.profile_yaml import merge_profiles, number_as_text, read_yaml, safe_load, short
from precision_pipeline.spec.routing import Routing

PROFILES_DIR = REPO_ROOT / "precision_profiles"
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
MAX_EXTENDS_DEPTH = 8


def _scalar_kind(annotation: Any) -> Optional[type]:
    """``bool``, ``int`` or ``float`` when a field holds that scalar (``Optional`` unwrapped), else None.

    Only a union is unwrapped: ``list[int]`` / ``tuple[int, ...]`` hold a sequence, not an int."""
    import types
    import typing

    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        kinds = {a for a in typing.get_args(annotation) if a is not type(None)}
        if len(kinds) == 1:
            annotation = kinds.pop()
    return annotation if annotation in (bool, int, float) else None


class _Strict(BaseModel):
    """Profile section: unknown keys refused; numbers and booleans never coerced into each other."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_enum_values=False, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _strict_scalars(cls, data: Any) -> Any:
        # pydantic's lax mode turns `true` into 1 and "8" into 8; a profile means what it says
        if not isinstance(data, dict):
            return data
        for name, f in cls.model_fields.items():
            if name not in data or data[name] is None:
                continue
            kind, v = _scalar_kind(f.annotation), data[name]
            if kind is bool and not isinstance(v, bool):
                raise ValueError(f"{name}: must be true or false, got {short(v)}")
            if kind in (int, float) and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise ValueError(f"{name}: must be a number, got {short(v)}{number_as_text(v)}")
            if kind is int and isinstance(v, float):
                raise ValueError(f"{name}: must be a whole number, got {short(v)}")
            if kind is float and isinstance(v, float) and not math.isfinite(v):
                raise ValueError(f"{name}: must be a finite number, got {short(v)}")
        return data


class Target(_Strict):
    """Where the engine runs."""

    gpu: str = Field(description="GPU id or alias from the hardware catalog, e.g. h100-sxm, h200, a100-80gb, b200, l4.")
    trtllm_version: str = Field(
        DEFAULT_TRTLLM_VERSION, description="TensorRT-LLM line targeted: 1.2.x (1.2.1: Triton's trtllm-python-py3 images; "
        "engine and llm_api routes) or 1.3.0rcN (trtllm-serve / Dynamo 1.6; llm_api route only).")

    @field_validator("trtllm_version")
    @classmethod
    def _known_version(cls, v: str) -> str:
        try:
            trtllm_line(v)
        except ValueError as e:
            raise ValueError(f"{e}. Fix: use {KNOWN_VERSIONS_TEXT}.")
        return v


class Quantization(_Strict):
    """Per-engine formats: GEMMs and KV cache. Attention kernels are per phase (see context_phase)."""

    quant_algo: QuantAlgo = Field(QuantAlgo.NO_QUANT, description="GEMM format of the decoder linears (checkpoint quant_algo).")
    kv_cache_quant_algo: KVCacheQuantAlgo = Field(KVCacheQuantAlgo.NONE, description="KV-cache format (checkpoint kv_cache_quant_algo).")
    group_size: Optional[int] = Field(None, ge=1, le=4096, description="Block size for AWQ (per-group scales), also for an AWQ candidate of the per-layer search. NVFP4 is fixed at 16.")
    exclude_modules: list[str] = Field(
        default_factory=lambda: ["lm_head"],
        description="Modules kept in high precision (fnmatch patterns on TRT-LLM/HF module names), e.g. lm_head, *router*, *embed*.",
    )
    keep_first_layers: int = Field(0, ge=0, le=1024, description="Keep the first N decoder layers in high precision.")
    keep_last_layers: int = Field(0, ge=0, le=1024, description="Keep the last N decoder layers in high precision.")
    smoothquant_alpha: float = Field(0.5, gt=0.0, le=1.0, description="SmoothQuant migration strength (W8A8_SQ_PER_CHANNEL only).")
    auto_quantize_bits: Optional[float] = Field(
        None, gt=0.0, le=16.0, description="Effective-bits budget for a per-layer search (mtq.auto_quantize); None = off."
    )
    auto_quantize_formats: list[QuantAlgo] = Field(
        default_factory=list, description="Candidate formats for the per-layer search."
    )
    dtype: Literal["bfloat16", "float16"] = Field("bfloat16", description="Dtype of unquantized tensors and activations.")

    @field_validator("quant_algo", "auto_quantize_formats", mode="before")
    @classmethod
    def _known_gemm_names(cls, v: Any) -> Any:
        # the refusal lists only formats TensorRT-LLM 1.2 builds (the registry), not every enum value
        for item in (v if isinstance(v, list) else [v]):
            bad = F.refuse_gemm_name(item)
            if bad:
                raise ValueError(f"{bad[0]} Fix: {bad[1]}")
        return v


class Calibration(_Strict):
    """Calibration data for PTQ (real text; never random tokens)."""

    dataset: str = Field("builtin", description="'builtin' (news, Python docs prose, Python source) or a path to a JSONL of {\"text\": ...}.")
    num_samples: int = Field(64, ge=1, le=65536, description="Number of calibration samples.")
    seq_len: int = Field(256, ge=8, le=131072, description="Tokens per calibration sample (longest).")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="Seed of the stratified sample choice (same seed, same tokens).")
    batch_size: int = Field(8, ge=1, le=1024, description="Samples per calibration forward pass.")


class Parallel(_Strict):
    """Parallel layout of one engine (TRT-LLM Mapping)."""

    tp_size: int = Field(1, ge=1, le=1024, description="Tensor-parallel GPUs per engine (splits heads and FFN width).")
    pp_size: int = Field(1, ge=1, le=1024, description="Pipeline-parallel stages per engine (splits layers).")
    moe_tp_size: Optional[int] = Field(None, ge=1, le=1024, description="Default: tp_size / moe_ep_size.")
    moe_ep_size: Optional[int] = Field(None, ge=1, le=1024, description="Default: 1.")
    use_parallel_embedding: bool = Field(False, description="Shard the embedding over tp ranks (otherwise replicated).")


class BuildLimits(_Strict):
    """trtllm-build shape limits. None = what TensorRT-LLM 1.2 derives (shown in the plan)."""

    max_batch_size: int = Field(64, ge=1, le=65536, description="Most sequences in flight per engine (also triton_max_batch_size).")
    max_input_len: Optional[int] = Field(None, ge=1, le=10_000_000, description="Default 1024 (BuildConfig).")
    max_seq_len: Optional[int] = Field(None, ge=1, le=10_000_000, description="Default max_position_embeddings x rope scaling factor.")
    max_num_tokens: Optional[int] = Field(None, ge=1, le=10_000_000, description="Default 8192 (BuildConfig).")
    max_beam_width: int = Field(1, ge=1, le=64, description="Beam search width (1 = greedy/sampling).")
    kv_cache_type: Literal["paged", "continuous", "disabled"] = Field("paged", description="--kv_cache_type; paged is needed for in-flight batching, reuse and chunked context.")
    tokens_per_block: int = Field(32, ge=1, le=1024, description="Tokens per paged KV block (--tokens_per_block).")
    logits_dtype: Literal["float32", "float16", "bfloat16"] = Field("float32", description="--logits_dtype; FP32 logits are the default.")
    gather_context_logits: bool = Field(False, description="Needed to run the golden set against the engine (second gate).")


class ContextPhase(_Strict):
    """Context (prefill) phase attention kernels and plugins."""

    context_fmha: bool = Field(True, description="Fused multi-head attention kernels in the context phase (--context_fmha).")
    use_paged_context_fmha: bool = Field(True, description="Needed for KV-cache reuse and chunked context.")
    use_fp8_context_fmha: bool = Field(False, description="FP8 Q/K/V and softmax in context FMHA (FP8/W4A8/NVFP4 on SM>=89).")
    enable_chunked_context: bool = Field(False, description="Runtime: split long prompts into max_num_tokens chunks.")


class GenerationPhase(_Strict):
    """Generation (decode) phase settings."""

    gpt_attention_plugin: Literal["auto", "float16", "bfloat16", "float32"] = Field("auto", description="Attention plugin dtype (XQA/MMHA decode kernels; auto = model dtype).")
    multi_block_mode: bool = Field(True, description="Runtime (ExtendedRuntimePerfKnobConfig): split long-context decode attention over blocks.")
    gemm_plugin: Literal["auto", "disable", "fp8", "nvfp4", "bfloat16", "float16"] = Field(
        "auto", description="GEMM plugin for both phases; 'auto' picks what the format needs."
    )


class Runtime(_Strict):
    """Serving runtime (tensorrtllm_backend config.pbtxt parameters)."""

    kv_cache_free_gpu_mem_fraction: float = Field(0.9, gt=0.0, le=1.0, description="Share of the GPU memory left after weights and activations given to the KV cache.")
    enable_kv_cache_reuse: bool = Field(True, description="Prefix caching across requests (needs paged context FMHA).")
    batch_scheduler_policy: Literal["max_utilization", "guaranteed_no_evict"] = Field("guaranteed_no_evict", description="In-flight batching scheduler policy.")
    decoupled_mode: bool = Field(False, description="Needed for streaming.")
    streaming: bool = Field(False, description="Stream tokens to clients (needs decoupled_mode).")
    max_queue_delay_microseconds: int = Field(0, ge=0, le=10_000_000, description="Triton dynamic batching delay (µs).")
    instance_count: int = Field(1, ge=1, le=64, description="Instances of preprocessing/postprocessing.")


def canary_steps_problem(steps) -> Optional[str]:
    """Why ``steps`` are not valid canary percentages (strictly increasing integers in 1..100 ending at
    100), or None when they are."""
    steps = list(steps)
    if not steps or steps[-1] != 100 or any(not isinstance(x, int) or not 1 <= x <= 100 for x in steps) \
            or steps != sorted(set(steps)):
        return f"{steps}: canary steps must be strictly increasing percentages in 1..100 ending at 100"
    return None


OTLP_TRACES_PATH = "/v1/traces"
"""Path of the OTLP/HTTP traces service under an endpoint (OpenTelemetry protocol specification, "OTLP/HTTP
Request": the default URL path for traces is ``/v1/traces``; OTEL_EXPORTER_OTLP_ENDPOINT appends it)."""


OTLP_ENDPOINT_MAX = 2048
"""Longest ``deployment.otlp_endpoint`` accepted (characters): a base URL; longer ones are pasted by mistake."""


_DNS_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")


def _otlp_host_problem(host: str, bracketed: bool) -> Optional[str]:
    """Why ``host`` (``urlsplit(...).hostname``: lower-cased, IPv6 brackets removed) names no host, or None.

    A host is a bracketed IPv6 address, an IPv4 address, or a DNS name of letters, digits and inner '-' per
    label (RFC 1123 2.1; RFC 3986 3.2.2 allows percent-encoding in reg-name, but no resolver takes ``otel%0a``:
    it is a newline). A name whose last label is all digits must be an IPv4 address (RFC 3696 2: a top-level
    label is never all-numeric), so ``1.2.3.4.5`` and ``1.2.3.999`` are refused."""
    import ipaddress

    if bracketed:
        try:
            ipaddress.IPv6Address(host)
            return None
        except ValueError:
            return f"[{short(host)}] is not an IPv6 address"
    labels = host[:-1].split(".") if host.endswith(".") else host.split(".")
    if labels and labels[-1].isdigit():
        try:
            ipaddress.IPv4Address(host)
            return None
        except ValueError:
            return (f"the host {short(host)} is neither an IPv4 address (four numbers 0..255) nor a DNS name "
                    "(whose last label is never all digits)")
    bad = next((lb for lb in labels if not _DNS_LABEL.match(lb)), None)
    if bad is not None:
        return (f"the host {short(host)} is not a DNS name: label {short(bad)} may hold only letters, digits and "
                "inner '-' (no '%' escapes, '_' or empty labels)")
    return None


def otlp_endpoint_problem(v: Optional[str]) -> Optional[str]:
    """Why ``deployment.otlp_endpoint`` is unusable (None when fine): an ``http``/``https`` URL with a host, no
    query, fragment, credentials or whitespace, and without ``/v1/traces`` (it is appended)."""
    from urllib.parse import urlsplit

    if v is None:
        return None
    if not v or any(c.isspace() or not c.isprintable() for c in v):  # also zero-width and control characters
        return f"{short(v)} is not a URL (e.g. http://otel-collector.monitoring:4318)"
    if len(v) > OTLP_ENDPOINT_MAX:
        return f"{short(v)} has {len(v):,} characters; at most {OTLP_ENDPOINT_MAX:,} (give the receiver's base URL)"
    try:
        u = urlsplit(v)
        port = u.port  # ValueError for a port that is not a number in 0..65535
    except ValueError as e:
        return f"{short(v)} is not a URL ({str(e).lower()}; e.g. http://otel-collector.monitoring:4318)"
    if u.scheme not in ("http", "https") or not u.hostname:
        return f"{short(v)} is not an http(s) URL with a host (OTLP/HTTP, e.g. http://otel-collector.monitoring:4318)"
    if port == 0:
        return f"{short(v)}: port 0 is not a usable port (1..65535; OTLP/HTTP listens on 4318)"
    if len(u.hostname) > 253 or any(len(label) > 63 for label in u.hostname.split(".")):
        return f"{short(v)}: the host name is longer than DNS allows (253 characters, 63 per label; RFC 1035 2.3.4)"
    host_why = _otlp_host_problem(u.hostname, bracketed="[" in u.netloc)
    if host_why:
        return f"{short(v)}: {host_why}"
    if u.query or u.fragment or u.username or u.password:
        return f"{short(v)} has a query, fragment or credentials (give the receiver's base URL)"
    if u.path.rstrip("/").endswith(OTLP_TRACES_PATH):
        return f"{short(v)} ends with {OTLP_TRACES_PATH}, which is appended (give the receiver's base URL)"
    return None


def otlp_traces_url(endpoint: Optional[str]) -> Optional[str]:
    """``<endpoint>/v1/traces`` (one home for the traces URL of the BLS and of Triton's own tracing), or None."""
    return None if endpoint is None else endpoint.rstrip("/") + OTLP_TRACES_PATH


class Deployment(_Strict):
    """Where and how the engine is served."""

    gpus_per_replica: Optional[int] = Field(None, ge=1, le=1024, description="Default tp_size x pp_size; must equal it.")
    replicas: int = Field(1, ge=1, le=10000, description="Pods of the Kubernetes Deployment.")
    fallback: Optional[str] = Field(None, description="Profile whose prebuilt engine is kept for rollback (usually a bf16 one): a name or path, found as extends is (beside this profile first, then shipped).")
    warm_fallback: bool = Field(False, description="Keep the fallback loaded (instant rollback; costs its GPU memory).")
    keep_releases: int = Field(2, ge=0, le=100, description="Previous releases kept on disk for rollback.")
    workload: Literal["deployment", "argo-rollout"] = Field(
        "deployment", description="Kubernetes workload that owns a release: a plain Deployment (rolling update), or an Argo "
        "Rollouts Rollout (canary steps with an accuracy/error-rate analysis) that references the Deployment.")
    canary_steps: tuple[int, ...] = Field((5, 20, 50, 100), min_length=1,
                                    description="Canary percentages (increasing, ending at 100) of `invoke rollout` and the Rollout.")
    canary_pause_s: int = Field(300, ge=0, le=86400, description="Seconds each canary step holds before it widens.")
    gpus_per_node: Optional[int] = Field(None, ge=1, le=64, description="GPUs one node has; when tp_size x pp_size exceeds it, "
                                         "the engine runs as a multi-node LeaderWorkerSet.")
    server: Literal["triton", "trtllm-serve"] = Field("triton", description="What serves the build: Triton (both routes) or trtllm-serve (llm_api route; serving/trtllm_serve.py).")
    otlp_endpoint: Optional[str] = Field(
        None, description="OTLP/HTTP receiver (an OpenTelemetry collector), e.g. http://otel-collector:4318: the BLS sends one "
        "span per request and Triton its own traces to <endpoint>/v1/traces. None: no traces.")

    @field_validator("otlp_endpoint")
    @classmethod
    def _otlp(cls, v: Optional[str]) -> Optional[str]:
        why = otlp_endpoint_problem(v)
        if why:
            raise ValueError(why)
        return v

    @property
    def otlp_traces_url(self) -> Optional[str]:
        """The URL spans are POSTed to (``otlp_traces_url``), or None."""
        return otlp_traces_url(self.otlp_endpoint)

    @field_validator("canary_steps")
    @classmethod
    def _steps(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        why = canary_steps_problem(v)
        if why:
            raise ValueError(why + " (e.g. [5, 20, 50, 100])")
        return v


class GateThresholds(_Strict):
    """Accuracy budget vs the FP32 reference. None = not checked."""

    kl_mean_max: Optional[float] = Field(None, ge=0.0, description="Mean per-token KL (nats).")
    kl_p99_max: Optional[float] = Field(None, ge=0.0, description="P99 per-token KL (nats).")
    top1_min: Optional[float] = Field(None, ge=0.0, le=1.0, description="Top-1 agreement (fraction of tokens).")
    ppl_delta_pct_max: Optional[float] = Field(None, ge=0.0, description="Perplexity increase on held-out text (%); a negative bar could never pass.")
    greedy_same_min: Optional[float] = Field(None, ge=0.0, le=1.0, description="Fraction of prompts whose greedy answer is unchanged.")


FINGERPRINT_RE = re.compile(r"^[0-9a-f]{64}$")

GOLDEN_CATEGORIES: tuple[str, ...] = ("facts", "reasoning", "code", "instructions", "long_context", "non_english")
"""The golden set's categories (``gate.golden.CATEGORIES`` is this tuple; ``gate.categories`` keys must be one)."""


def _known_categories(v: dict[str, GateThresholds]) -> dict[str, GateThresholds]:
    CATEGORIES = GOLDEN_CATEGORIES
    bad = [k for k in v if k not in CATEGORIES]
    if bad:
        raise ValueError(f"{short(bad[0])} is not a golden-set category. Fix: use one of: {', '.join(CATEGORIES)}.")
    return v


class ModelBar(GateThresholds):
    """One ``gate.overrides`` entry: a model's thresholds and, optionally, its own category bars
    (merged field by field over the profile's ``gate.categories``)."""

    categories: dict[str, GateThresholds] = Field(
        default_factory=dict, description="This model's category bars; set fields win over the profile's for that category.")

    @field_validator("categories")
    @classmethod
    def _known_categories(cls, v: dict[str, GateThresholds]) -> dict[str, GateThresholds]:
        return _known_categories(v)


class GateBar(GateThresholds):
    """The bar one gate verdict is judged against: the overall thresholds, per-category bars and the
    fewest prompts a promotable verdict needs (``Gate.for_model`` returns one)."""

    categories: dict[str, GateThresholds] = Field(
        default_factory=dict,
        description="Per golden-set category bars (keys: facts, reasoning, code, instructions, long_context, "
                    "non_english); a category's set fields win over the overall bar for that category. Every "
                    "category is judged against the overall bar when it has no entry (ppl_delta_pct_max is "
                    "overall only: the held-out text has no categories).")
    min_prompts: Optional[int] = Field(
        None, ge=1, description="Fewest golden prompts a verdict needs to be promotable (None: every prompt of the "
                                "golden set); a --golden-limit build below it is recorded as not promotable.")

    @field_validator("categories")
    @classmethod
    def _known_categories(cls, v: dict[str, GateThresholds]) -> dict[str, GateThresholds]:
        return _known_categories(v)

    def thresholds(self) -> GateThresholds:
        """The overall thresholds alone."""
        return GateThresholds(**{k: getattr(self, k) for k in GateThresholds.model_fields})

    def for_category(self, category: str) -> GateThresholds:
        """The bar of one category: the overall thresholds with the category's set fields winning;
        ``ppl_delta_pct_max`` is dropped (held-out perplexity is not measured per category)."""
        data = self.thresholds().model_dump()
        ov = self.categories.get(category)
        if ov is not None:
            data.update(ov.model_dump(exclude_unset=True))
        data["ppl_delta_pct_max"] = None
        return GateThresholds(**data)


class Gate(GateBar):
    """The profile's accuracy bar, plus per-model overrides keyed by the model's content fingerprint
    (``precision_pipeline.core.fingerprint.model_fingerprint(model_dir).sha256``: config and weights,
    never the folder's name; ``invoke check`` prints it)."""

    measured_on: str = Field("", description="Which model the shipped thresholds were measured on.")
    overrides: dict[str, ModelBar] = Field(
        default_factory=dict,
        description="Per-model thresholds keyed by the model's content fingerprint (64 hex digits, printed by "
                    "`invoke check --model DIR`): the same model in any folder gets them, another model in a "
                    "folder of the same name does not.")

    @field_validator("overrides")
    @classmethod
    def _fingerprint_keys(cls, v: dict[str, ModelBar]) -> dict[str, ModelBar]:
        for k in v:
            if not isinstance(k, str) or not FINGERPRINT_RE.match(k):
                raise ValueError(f"key {short(k)} is not a model fingerprint (64 lower-case hex digits); per-model bars "
                                 "are keyed by the model's content, not by a folder name. Fix: run `invoke check --model "
                                 "DIR` and use the 'model fingerprint' it prints as the key.")
        return v

    def for_model(self, model_fingerprint: str) -> GateBar:
        """The bar for the model whose content fingerprint is ``model_fingerprint`` (hex sha256 of
        ``core.fingerprint.model_fingerprint``): the override's set fields win over the profile's;
        ``min_prompts`` is the profile's. Anything that is not a fingerprint (a
        folder name) matches no override. The override's ``categories`` merge field by field over the
        profile's."""
        data: dict[str, Any] = {k: getattr(self, k) for k in GateThresholds.model_fields}
        cats = dict(self.categories)
        ov = self.overrides.get(str(model_fingerprint))
        if ov is not None:
            data.update(ov.model_dump(exclude_unset=True, exclude={"categories"}))
            for c, t in ov.categories.items():
                base = cats[c].model_dump(exclude_unset=True) if c in cats else {}
                cats[c] = GateThresholds(**{**base, **t.model_dump(exclude_unset=True)})
        return GateBar(**data, categories=cats, min_prompts=self.min_prompts)

    def for_model_dir(self, model_dir: Path | str) -> GateBar:
        """``for_model`` of the HF folder's content fingerprint (memoized per file: cheap after the first call)."""
        from precision_pipeline.core.fingerprint import model_fingerprint

        return self.for_model(model_fingerprint(model_dir).sha256)


class Profile(_Strict):
    """A precision profile (top level of the YAML)."""

    name: str = Field("", description="Set from the file name when empty.")
    description: str = Field("", description="One line on what the profile is for.")
    extends: Optional[str] = Field(None, description="Parent profile name (merged under this one).")
    route: Literal["engine", "llm_api"] = Field(
        "engine", description="Serving route: which stages build and serve it (pipeline.ROUTES). engine: a TensorRT-LLM "
        "engine built by trtllm-build, served by Triton's tensorrtllm backend. llm_api: the checkpoint served by "
        "TensorRT-LLM's LLM API (PyTorch backend) from rendered TorchLlmArgs (trtllm-serve --config, Triton's LLM-API "
        "model.yaml).")
    target: Target
    quantization: Quantization = Field(default_factory=Quantization)
    calibration: Calibration = Field(default_factory=Calibration)
    parallel: Parallel = Field(default_factory=Parallel)
    build: BuildLimits = Field(default_factory=BuildLimits)
    context_phase: ContextPhase = Field(default_factory=ContextPhase)
    generation_phase: GenerationPhase = Field(default_factory=GenerationPhase)
    runtime: Runtime = Field(default_factory=Runtime)
    deployment: Deployment = Field(default_factory=Deployment)
    gate: Gate = Field(default_factory=Gate)
    llm_api: dict[str, Any] = Field(
        default_factory=dict, description="route llm_api only: extra TorchLlmArgs fields (tensorrt_llm/llmapi/llm_args.py) "
        "passed through to the rendered YAML, e.g. cuda_graph_config; keys the profile renders from its own sections "
        "(max_batch_size, kv_cache_config.free_gpu_memory_fraction, ...) are set there. Checked at resolve.")
    routing: Optional[Routing] = Field(None, description="Per-request routing over the release's warm units "
                                       "(spec/routing.py); none: every request goes to the primary.")

    @field_validator("name")
    @classmethod
    def _name_ok(cls, v: str) -> str:
        if v and not NAME_RE.match(v):
            raise ValueError("must match [a-z0-9][a-z0-9._-]* (at most 64 characters)")
        return v

    @property
    def world_size(self) -> int:
        """GPUs per engine: tp_size x pp_size."""
        return self.parallel.tp_size * self.parallel.pp_size

    def for_model(self, model_fingerprint: str) -> "Profile":
        """This profile as it applies to one model (content fingerprint): its gate section holds that
        model's bar (``Gate.for_model``) and no overrides, so ``gate.for_model(anything)`` is the bar.
        What the deploy stage renders the canary analysis, alerts and dashboard from."""
        bar = self.gate.for_model(model_fingerprint)
        gate = Gate(**{k: getattr(bar, k) for k in GateThresholds.model_fields}, categories=dict(bar.categories),
                    min_prompts=bar.min_prompts, measured_on=self.gate.measured_on)
        return self.model_copy(update={"gate": gate})


# --------------------------------------------------------------------------------------------
# Loading


def shipped_profiles() -> list[str]:
    """Names of the profiles in ``precision_profiles/`` (sorted)."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))


def _is_file(p: Path) -> bool:
    """``Path.is_file`` that treats unusable names (too long, NUL bytes, loops) as missing."""
    try:
        return p.is_file()
    except (OSError, ValueError):
        return False


def resolve_profile_path(name_or_path: str, field: str = "--profile") -> Path:
    """Map a shipped name or a YAML path to a file. Raises UserError for unknown names."""
    s = str(name_or_path)
    if s.endswith((".yaml", ".yml")) or "/" in s or "\\" in s:
        p = Path(s)
        if not _is_file(p):
            if NAME_RE.match(Path(s).stem or "") and "/" in s and not p.exists():
                pass
            raise UserError(field, f"no profile file at {short(s)}.",
                            f"use a shipped profile ({', '.join(shipped_profiles())}) or an existing .yaml path.")
        return p
    if not NAME_RE.match(s):
        raise UserError(field, f"{short(s)} is not a profile name (allowed: lower-case letters, digits, '.', '_', '-').",
                        f"use one of: {', '.join(shipped_profiles())}.")
    p = PROFILES_DIR / f"{s}.yaml"
    if not _is_file(p):
        hint = closest(s, shipped_profiles())
        fix = f"did you mean {hint!r}? " if hint else ""
        raise UserError(field, f"no shipped profile named {short(s)}.",
                        f"{fix}Shipped: {', '.join(shipped_profiles())}; or pass a path to a .yaml file.")
    return p


def load_raw(name_or_path: str, _chain: tuple[str, ...] = ()) -> dict:
    """The merged YAML mapping of a profile and its ``extends`` chain (not yet validated)."""
    path = resolve_profile_path(name_or_path, field="extends" if _chain else "--profile")
    key = str(path.resolve())
    if key in _chain:
        names = " -> ".join(Path(c).stem for c in _chain + (key,))
        raise UserError("extends", f"profiles extend each other in a cycle: {names}.", "remove one 'extends:' so the chain ends.")
    if len(_chain) >= MAX_EXTENDS_DEPTH:
        raise UserError("extends", f"the extends chain is deeper than {MAX_EXTENDS_DEPTH}.", "shorten the chain.")
    return _merged_chain(path, read_yaml(path, "extends" if _chain else "--profile"), _chain + (key,), top=not _chain)


def _merged_chain(path: Path, data: dict, chain: tuple[str, ...], top: bool) -> dict:
    """``data`` (read from ``path``, whose resolved path ends ``chain``) merged over its ``extends`` chain."""
    data.setdefault("name", path.stem if NAME_RE.match(path.stem) else "")
    if top and not data["name"]:
        raise UserError("name", f"{path.name}: the file name is not a profile name and the file sets no 'name:'; "
                        "every such profile would share one output folder.",
                        "rename the file (lower-case letters, digits, '.', '_', '-'; at most 64 characters) "
                        "or add a 'name:' line.")
    parent = data.get("extends")
    if parent is not None:
        if not isinstance(parent, str):
            raise UserError("extends", f"must be a profile name, got {type(parent).__name__}.", "write e.g. 'extends: fp8-h100'.")
        parent_data = load_raw(str(_extends_path(parent, path)), chain)
        merged = merge_profiles(parent_data, data)
        merged["name"] = data["name"]
        return merged
    return data


def _inside(p: Path, folder: Path) -> bool:
    try:
        p.relative_to(folder)
        return True
    except ValueError:
        return False


def _extends_path(parent: str, child: Path) -> Path:
    """The file ``extends: parent`` names, for the profile at ``child`` (rule in the module docstring).

    Raises UserError (field ``extends``) for an absolute path, a path leaving the extending
    profile's folder tree and ``precision_profiles/``, or a name found nowhere.
    """
    here = child.resolve().parent
    roots = (here, PROFILES_DIR.resolve())
    fix = ("name a profile (NAME.yaml beside this one, or a shipped one), or a relative path inside this "
           "profile's folder.")
    if "/" in parent or "\\" in parent or parent.endswith((".yaml", ".yml")):
        if Path(parent).is_absolute() or parent.startswith("~"):
            raise UserError("extends", f"{short(parent)} is an absolute path; extends only reads profiles inside "
                            f"{here} or the shipped precision_profiles/.", fix)
        try:
            ppath = (here / parent).resolve()
        except (OSError, ValueError, RuntimeError):
            ppath = None
        if ppath is None or not any(_inside(ppath, r) for r in roots):
            raise UserError("extends", f"{short(parent)} leaves {here}; extends only reads profiles inside that "
                            "folder tree or the shipped precision_profiles/.", fix)
        if not _is_file(ppath):
            raise UserError("extends", f"no profile file at {short(parent)} (relative to {here}).", fix)
        return ppath
    if not NAME_RE.match(parent):
        raise UserError("extends", f"{short(parent)} is not a profile name (lower-case letters, digits, '.', '_', '-').", fix)
    beside = here / f"{parent}.yaml"
    if _is_file(beside) and beside.resolve() != child.resolve():  # a file never extends itself: NAME is then the shipped one
        return beside
    return resolve_profile_path(parent, field="extends")


def _loc_str(loc: tuple) -> str:
    return ".".join(str(x) for x in loc)


def _known_fields(model: type[BaseModel], loc: tuple) -> list[str]:
    """Field names at ``loc`` (minus its last element) of the Profile schema."""
    cur: Any = model
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        if not (isinstance(cur, type) and issubclass(cur, BaseModel)):
            return []
        f = cur.model_fields.get(str(part))
        if f is None:
            return []
        ann = f.annotation
        # unwrap Optional / dict
        args = getattr(ann, "__args__", ())
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            cur = ann
        else:
            cands = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
            cur = cands[0] if cands else None
    if isinstance(cur, type) and issubclass(cur, BaseModel):
        return list(cur.model_fields)
    return []


def _problems_from_validation(e: ValidationError) -> list[Problem]:
    problems = []
    for err in e.errors():
        loc = tuple(err.get("loc", ()))
        field = _loc_str(loc) or "(top level)"
        typ = err.get("type", "")
        if typ == "extra_forbidden":
            known = _known_fields(Profile, loc)
            hint = closest(str(loc[-1]), known) if loc else None
            fix = (f"did you mean '{hint}'?" if hint else f"known keys here: {', '.join(known)}." if known
                   else "remove it (see `invoke schema` for the profile's keys).")
            problems.append(Problem(field, "is not a known profile key.", fix))
        elif typ == "enum" or typ == "literal_error":
            problems.append(Problem(field, f"{err.get('msg')}; got {short(err.get('input'))}.".replace("Input should be", "must be"),
                                    "use one of the listed values."))
        elif typ == "missing":
            problems.append(Problem(field, "is required.", "add it (see `invoke schema`)."))
        else:
            msg = str(err.get("msg", "")).removeprefix("Value error, ")
            if typ == "value_error" and " Fix: " in msg:  # our validators: "reason Fix: fix"
                reason, _, fix = msg.partition(" Fix: ")
                problems.append(Problem(field, reason, fix))
                continue
            if typ == "value_error" and ": must be " in msg:  # from _Strict._strict_scalars: "name: must be ..."
                name, _, msg = msg.partition(": ")
                msg, _, fix = msg.partition(" | fix: ")
                field = _loc_str(loc + (name,))
                problems.append(Problem(field, f"{msg}.", fix or "write the value without quotes, as the schema's type."))
                continue
            problems.append(Problem(field, f"{msg} (got {short(err.get('input'))}).", "see `invoke schema` for the allowed values."))
    return problems


def validate_profile(data: dict, source: str = "") -> Profile:
    """Validate a merged mapping into a ``Profile``. Raises UserError listing every bad field."""
    try:
        return Profile.model_validate(data)
    except ValidationError as e:
        raise UserError(_problems_from_validation(e))
    except RecursionError:
        raise UserError("--profile", "the profile is nested too deeply.", "flatten the YAML.")


def load_profile(name_or_path: str) -> Profile:
    """Load, merge (``extends``) and validate a profile by shipped name or YAML path.

    Raises UserError (exit 2) with the field, the reason and a fix.
    """
    data = load_raw(name_or_path)
    dep, here = data.get("deployment"), resolve_profile_path(name_or_path).parent
    fb = dep.get("fallback") if isinstance(dep, dict) else None
    if isinstance(fb, str) and fb and not Path(fb).is_absolute() and not _inside(here, PROFILES_DIR.resolve()):
        beside = here / (fb if "/" in fb or fb.endswith((".yaml", ".yml")) else f"{fb}.yaml")
        if _is_file(beside):  # deployment.fallback is found as extends is: beside the profile first, then shipped
            data["deployment"] = {**dep, "fallback": str(beside.resolve())}
    return validate_profile(data, source=str(name_or_path))


WRITTEN_BY = "# Written by `invoke "
"""First line of every profile the pipeline writes (``invoke recommend --write``, ``invoke sensitivity
--write-profile``): ``save_profile`` replaces only such files, never a hand-written or shipped one."""


def is_shipped_profile(path: Path) -> bool:
    """Whether ``path`` is a shipped profile: an existing file whose resolved path lies directly in the resolved
    ``precision_profiles/`` folder beside the package (``PROFILES_DIR``, symlinks resolved on both sides).

    The rule needs no git and no list to keep in step: it holds the same in a clone, a tarball or an
    installed copy, because the folder *is* the shipped set (``shipped_profiles()`` lists it). A file a
    user writes into that folder becomes shipped by the same rule and is protected too."""
    try:
        p = Path(path).expanduser().resolve()
        return p.is_file() and p.parent == PROFILES_DIR.resolve()
    except (OSError, RuntimeError, ValueError):
        return False


def check_profile_target(path: Path, field: str = "--write", name_from_stem: bool = False) -> Path:
    """``path`` resolved, when a profile may be written there: it ends in ``.yaml``/``.yml``, is not a folder,
    no folder above it is a file, it is not a shipped profile (``is_shipped_profile``), and it does not exist or
    starts with ``WRITTEN_BY`` (a hand-written or shipped profile is never replaced); with ``name_from_stem`` (the text will set no ``name:``) its stem
    is a profile name. Raises UserError naming ``field`` otherwise. Callers check this before long work
    whose result goes there (``invoke sensitivity --write-profile``)."""
    path = Path(path).expanduser().resolve()
    if path.suffix not in (".yaml", ".yml"):
        raise UserError(field, f"{short(str(path))} does not end in .yaml.", "name the file e.g. my-profile.yaml.")
    if name_from_stem and not NAME_RE.match(path.stem):
        raise UserError(field, f"{short(path.name)}: the file name is the profile's name, and {short(path.stem)} is not "
                        "one (lower-case letters, digits, '.', '_', '-'; at most 64 characters).",
                        f"name the file e.g. {re.sub(r'[^a-z0-9._-]+', '-', path.stem.lower()).strip('-._')[:64] or 'my-profile'}.yaml.")
    if path.is_dir():
        raise UserError(field, f"{short(str(path))} is a folder.", "give a file path ending in .yaml.")
    blocker = next((a for a in path.parents if a.exists() and not a.is_dir()), None)
    if blocker is not None:
        raise UserError(field, f"{short(str(blocker))} is a file, not a folder, so {short(path.name)} cannot go under it.",
                        "give a path whose folders are folders.")
    if path.exists() and is_shipped_profile(path):
        raise UserError(field, f"{short(str(path))} is a shipped profile (an existing file in {PROFILES_DIR}); "
                        "shipped profiles are never replaced, whatever their first line says.",
                        "write to a file outside precision_profiles/ (e.g. profiles/my-profile.yaml, which may "
                        "'extends:' the shipped one); to regenerate a shipped profile on purpose, delete it first "
                        "(git rm) and write it again.")
    if path.exists():
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                ours = f.read(len(WRITTEN_BY)) == WRITTEN_BY
        except OSError:
            ours = False
        if not ours:
            raise UserError(field, f"{short(str(path))} exists and was not written by invoke (a hand-written or shipped "
                            "profile); it is kept as it is.", "write to a new file name, or move that file away first.")
    return path


def save_profile(path: Path, text: str, field: str = "--write") -> Profile:
    """Write the profile YAML ``text`` to ``path`` atomically, after the strict loader accepted it as if
    it were already there (so ``extends`` resolves from ``path``'s folder and the name is ``path``'s stem).

    Returns the loaded ``Profile``. Raises UserError (exit 2) when the loader refuses the text, when
    ``path`` does not end in ``.yaml``/``.yml``, lies under a file, cannot be written, or exists without
    the ``WRITTEN_BY`` first line (a hand-written or shipped profile is never replaced); nothing is
    written then, and an existing file stays.
    """
    from precision_pipeline.core.store import atomic_write_text

    path = check_profile_target(path, field)
    try:
        data = safe_load(text)
    except yaml.YAMLError as e:  # pragma: no cover - our own writers emit valid YAML
        raise UserError(field, f"the profile text is not valid YAML: {e}.", "report this as a bug.")
    prof = validate_profile(_merged_chain(path, dict(data or {}), (str(path),), top=True), source=str(path))
    try:
        atomic_write_text(path, text)
    except OSError as e:
        raise UserError(field, f"cannot write {short(str(path))}: {e.strerror or e}; nothing was written.",
                        "choose a folder you can write to.")
    return prof


def profile_json_schema() -> dict:
    """The JSON Schema of a profile (for editors: ``invoke schema``)."""
    return Profile.model_json_schema()
