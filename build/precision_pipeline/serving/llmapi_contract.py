"""What TensorRT-LLM's Triton **LLM-API model** expects of a model folder (the consumer of an LLM-API unit).

The real consumer is ``triton_backend/all_models/llmapi/tensorrt_llm/`` in NVIDIA/TensorRT-LLM: ``config.pbtxt``,
``1/model.py``, ``1/helpers.py``, ``1/model.yaml``. Facts below name the file, the stored commit they were read
at (the search index's copy; the TensorRT-LLM mirror was too large to fetch, so the v1.2.1 / 1.3.0rc tag of each
commit is NOT verified here -- re-check at merge against the pinned tag) and the function or the text quoted.
Nothing of NVIDIA's code is copied into this repository: the unit names the real files in the image instead
(``IMAGE_MODEL_DIRS``).

Sources (NVIDIA/TensorRT-LLM unless said otherwise):

* ``MODEL_PY``  = triton_backend/all_models/llmapi/tensorrt_llm/1/model.py @ 044a90d209e380c95e23e8ae42f3583fa05ada78
* ``HELPERS``   = triton_backend/all_models/llmapi/tensorrt_llm/1/helpers.py @ 0df60f9ad779c4dc4f55da07e08b969fc4684e56
* ``CONFIG``    = triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt @ 0a71057313ec0626527e164a8fc0205c5822e2f5
* ``MODEL_YAML``= triton_backend/all_models/llmapi/tensorrt_llm/1/model.yaml @ 0ebb1536ac12bbe27201185de960df3ab00bcecc
* ``DOCKERFILE``= triton-inference-server/tensorrtllm_backend dockerfile/Dockerfile.triton.trt_llm_backend
  @ 0b9d7d5a195820d53abadfcf7208d0ccdbfd5332 lines 172 (``WORKDIR /app``) and 174
  (``COPY --from=tensorrt_llm_code /workspace/tensorrt_llm/triton_backend/all_models all_models``)
* ``LLMAPI_MD`` = triton-inference-server/tensorrtllm_backend docs/llmapi.md @ 0b9d7d5 lines 16-26 (copy
  ``all_models/llmapi/`` to a repository, edit ``tensorrt_llm/1/model.yaml``, launch; "No ensemble")

Facts (each one is asserted by tests/serving/test_llmapi_contract.py):

1. The folder is a **python-backend** model: CONFIG ``backend: "python"``, one ``KIND_CPU`` instance; the
   engine runs in the LLM API's own workers.
2. ``max_batch_size`` and ``model_transaction_policy.decoupled`` are NOT in config.pbtxt (CONFIG's comment
   "The below config arguments are specific in model.yaml / Please don't add it in config.pbtxt");
   MODEL_PY ``TritonPythonModel.auto_complete_config`` sets both from model.yaml ``triton_config``
   (``triton_config["decoupled"]``, ``triton_config["max_batch_size"]``: indexed, no default: both required).
3. model.yaml: MODEL_PY ``get_model_config`` reads ``<model dir>/<LLM_CONFIG_PATH or "model.yaml">``
   (``os.path.join(pb_utils.get_model_dir(), filename)``: the *version* directory, ``1/model.yaml``) with
   ``yaml.safe_load``; missing file -> assertion "containing TRT-LLM engine args not found". ``initialize``
   passes every key except ``triton_config`` to ``update_llm_args_with_extra_dict({}, ...)`` and then
   ``LLM(**args)``: so those keys are ``LLM`` arguments (TorchLlmArgs with ``backend: pytorch``; unknown keys
   are refused by pydantic ``extra="forbid"``, reference llm-api-route.md). ``triton_config`` keys read:
   ``decoupled``, ``max_batch_size``, optional ``cancellation_check_period_ms`` (default 100).
4. ``triton_config.max_batch_size`` must be 0: MODEL_YAML "The current implementation does not support
   batching"; with a batch dimension ``text_input`` arrives 2-D and MODEL_PY ``_convert_request`` refuses
   every request ("only supports text_input being a 1D tensor").
5. Streaming: a request with ``streaming`` true on a non-decoupled model is refused (MODEL_PY
   ``_execute_single_request``: "Streaming is only supported in decoupled mode.").
6. Several instances (``instance_group.count`` > 1) need the ``gpu_device_ids`` parameter ("0,1;2,3", one
   ``;``-separated set per instance), else ``initialize`` raises (MODEL_PY ``initialize``).
7. Inputs/outputs (CONFIG, ``INPUTS`` / ``OUTPUTS`` below): text in (``text_input`` STRING [-1], the prompt is
   ``text_input[0]``), text out (``text_output`` STRING [-1]); no token ids, no logits (the outputs are
   RequestOutput's text, finish/stop reason, cumulative logprob and the perf metrics; MODEL_PY
   ``_create_response``). Per-request sampling comes as ``sampling_param_*`` scalars (HELPERS
   ``get_sampling_params_from_request``: best_of, temperature, top_k, top_p, frequency_penalty,
   presence_penalty, max_tokens, seed, exclude_input_from_output, return_perf_metrics; ``stop`` a list).
   ``exclude_input_from_output`` defaults to False (HELPERS), so by default text_output holds the prompt too.
   ``finish_reason`` / ``stop_reason`` / ``cumulative_logprob`` are sent as ``str()`` of the value in an object array
   (MODEL_PY ``_create_response``), i.e. BYTES even where CONFIG declares TYPE_FP32 (Triton 2.51's python backend lets
   the mismatch through: tests/serving/test_llmapi_serve.py).
8. Where an image holds the files (``IMAGE_MODEL_DIRS``, tried in order): ``/app/all_models/llmapi/tensorrt_llm/1/``
   in an image built by tensorrtllm_backend's Dockerfile (DOCKERFILE lines 172, 174; its ``TENSORRTLLM_REPO_TAG`` is
   ``release/1.2.1``), ``/app/tensorrt_llm/triton_backend/all_models/llmapi/tensorrt_llm/1/`` in one built by
   TensorRT-LLM's own ``tritonrelease`` stage (MULTI). Which of the two NGC's ``tritonserver:<yy.mm>-trtllm-python-py3``
   tags hold was NOT confirmed from a source: NVIDIA's deployment guide for that image (GUIDE) clones the TensorRT-LLM
   tag of the image's ``tensorrt_llm.__version__`` to get the folder instead. So the Deployment's init step looks in
   each candidate and fails the pod, naming them, when none has both files. ``model.py`` imports ``helpers`` from its
   own folder (MODEL_PY ``from helpers import ...``), so both files must sit in the unit's ``1/``.
9. ``triton_config`` reaches Triton only through ``auto_complete_config`` (fact 2): a server started with
   ``--disable-auto-complete-config`` (tensorrtllm_backend's ``launch_triton_server.py`` passes it, and so does the
   Triton Deployment here, ``serving/deploy.py triton_command``) never applies ``decoupled: true``; the model then
   streams while Triton treats it as non-decoupled and the request hangs (GUIDE, "Streaming responses").

* ``MULTI``     = NVIDIA/TensorRT-LLM docker/Dockerfile.multi @ 00f74add6b0d51b1e7b34d5bdd48a9ed39b868f3, stage
  ``FROM release AS tritonrelease``: ``WORKDIR /app/tensorrt_llm`` + ``COPY ./triton_backend/all_models
  ./triton_backend/all_models``
* ``GUIDE``     = "Deploying an LLM with Triton and TRT-LLM" (NVIDIA, 2024-2026; search-index file id 58716727673, its
  repository path not resolved), sections "2. Get the model repository" and "Streaming responses"
"""

from __future__ import annotations

from typing import Any, Mapping

BACKEND = "python"  # CONFIG: backend: "python"
MODEL_DIR_NAME = "tensorrt_llm"  # CONFIG: name: "tensorrt_llm" (a unit renames it; the model reads no name)
IMAGE_MODEL_DIRS = ("/app/all_models/llmapi/tensorrt_llm/1",  # DOCKERFILE 172 + 174
                    "/app/tensorrt_llm/triton_backend/all_models/llmapi/tensorrt_llm/1")  # MULTI tritonrelease
IMAGE_MODEL_FILES = ("model.py", "helpers.py")  # MODEL_PY: `from helpers import (...)`
MODEL_YAML = "model.yaml"  # MODEL_PY get_model_config default filename
LLM_CONFIG_ENV = "LLM_CONFIG_PATH"  # MODEL_PY: os.environ.get('LLM_CONFIG_PATH', 'model.yaml')
TRITON_CONFIG_KEY = "triton_config"  # MODEL_PY: include_keys=["triton_config"] / exclude_keys=["triton_config"]
TRITON_CONFIG_REQUIRED = ("max_batch_size", "decoupled")  # MODEL_PY auto_complete_config: indexed, no default
TRITON_CONFIG_OPTIONAL = ("cancellation_check_period_ms",)  # MODEL_PY initialize: `if ... in triton_config`
PBTXT_OWNED_BY_YAML = ("max_batch_size", "model_transaction_policy")  # CONFIG comment; fact 2
GPU_IDS_PARAM = "gpu_device_ids"  # MODEL_PY initialize: required when instance count > 1

# name -> (Triton data type, dims, optional) (CONFIG input [...])
INPUTS: dict[str, tuple[str, tuple[int, ...], bool]] = {
    "text_input": ("TYPE_STRING", (-1,), False),
    "streaming": ("TYPE_BOOL", (1,), True),
    "sampling_param_best_of": ("TYPE_INT32", (1,), True),
    "sampling_param_temperature": ("TYPE_FP32", (1,), True),
    "sampling_param_top_k": ("TYPE_INT32", (1,), True),
    "sampling_param_top_p": ("TYPE_FP32", (1,), True),
    "sampling_param_frequency_penalty": ("TYPE_FP32", (1,), True),
    "sampling_param_presence_penalty": ("TYPE_FP32", (1,), True),
    "sampling_param_max_tokens": ("TYPE_INT32", (1,), True),
    "sampling_param_stop": ("TYPE_STRING", (-1,), True),
    "sampling_param_seed": ("TYPE_UINT64", (1,), True),
    "sampling_param_exclude_input_from_output": ("TYPE_BOOL", (1,), True),
    "sampling_param_return_perf_metrics": ("TYPE_BOOL", (1,), True),
    "return_finish_reason": ("TYPE_BOOL", (1,), True),
    "return_stop_reason": ("TYPE_BOOL", (1,), True),
    "return_cumulative_logprob": ("TYPE_BOOL", (1,), True),
    "stop": ("TYPE_BOOL", (1,), True),
}
# name -> (Triton data type, dims) (CONFIG output [...])
OUTPUTS: dict[str, tuple[str, tuple[int, ...]]] = {
    "text_output": ("TYPE_STRING", (-1,)),
    "finish_reason": ("TYPE_STRING", (-1,)),
    "stop_reason": ("TYPE_STRING", (-1,)),
    "cumulative_logprob": ("TYPE_FP32", (-1,)),
    "kv_cache_reused_block": ("TYPE_INT32", (-1,)),
    "kv_cache_missed_block": ("TYPE_INT32", (-1,)),
    "kv_cache_alloc_new_blocks": ("TYPE_INT32", (-1,)),
    "kv_cache_alloc_total_blocks": ("TYPE_INT32", (-1,)),
    "kv_cache_hit_rate": ("TYPE_FP32", (-1,)),
    "arrival_time_ns": ("TYPE_INT64", (1,)),
    "first_scheduled_time_ns": ("TYPE_INT64", (1,)),
    "first_token_time_ns": ("TYPE_INT64", (1,)),
    "last_token_time_ns": ("TYPE_INT64", (1,)),
    "acceptance_rate": ("TYPE_FP32", (1,)),
    "total_accepted_draft_tokens": ("TYPE_INT32", (1,)),
    "total_draft_tokens": ("TYPE_INT32", (1,)),
}
REQUIRED_INPUTS = tuple(n for n, (_t, _d, opt) in INPUTS.items() if not opt)


def check_llm_args(args: Mapping[str, Any], version: str) -> list[str]:
    """Why ``LLM(**args)`` would refuse ``args`` (the model.yaml keys other than triton_config), as messages:
    ``model`` must be a string, ``backend`` ``pytorch`` (MODEL_YAML), and every key a TorchLlmArgs field of
    ``version``'s line (``spec.llm_args.llm_args_problems``: the pinned field list, one home; unknown keys with
    "did you mean", legacy engine-route names with their replacement)."""
    from precision_pipeline.spec.llm_args import llm_args_problems

    out = []
    if not isinstance(args.get("model"), str) or not args.get("model"):
        out.append("model: must be the checkpoint folder's path (a non-empty string)")
    if args.get("backend") != "pytorch":
        out.append(f"backend: is {args.get('backend')!r}; the LLM-API model serves backend: pytorch (model.yaml)")
    rest = {k: v for k, v in args.items() if k not in ("model", "backend")}
    out += [f"{p.field}: {p.reason}" for p in llm_args_problems(rest, version, prefix="model.yaml")]
    return out


def check_model_yaml(d: Any, version: str = "1.2.1") -> list[str]:
    """What the real LLM-API model would refuse in a parsed ``1/model.yaml`` ``d`` (messages; empty: it loads).

    Facts 3-4 (module docstring): a mapping with ``triton_config`` holding ``max_batch_size`` (must be 0) and
    ``decoupled`` (bool); ``cancellation_check_period_ms`` a positive int when given; the other keys are LLM
    arguments (``check_llm_args``)."""
    if not isinstance(d, dict):
        return [f"model.yaml: must be a mapping, not {type(d).__name__}"]
    tc = d.get(TRITON_CONFIG_KEY)
    if not isinstance(tc, dict):
        return [f"{TRITON_CONFIG_KEY}: is missing (model.py reads triton_config['decoupled'] and ['max_batch_size'])"]
    out = [f"{TRITON_CONFIG_KEY}.{k}: is missing (model.py indexes it without a default)"
           for k in TRITON_CONFIG_REQUIRED if k not in tc]
    unknown = sorted(set(tc) - set(TRITON_CONFIG_REQUIRED) - set(TRITON_CONFIG_OPTIONAL))
    out += [f"{TRITON_CONFIG_KEY}.{k}: is not read by model.py" for k in unknown]
    mbs = tc.get("max_batch_size", 0)
    if isinstance(mbs, bool) or not isinstance(mbs, int) or mbs != 0:
        out.append(f"{TRITON_CONFIG_KEY}.max_batch_size: is {mbs!r}; must be 0 (the LLM-API model refuses a batched "
                   "text_input: 'only supports text_input being a 1D tensor')")
    if "decoupled" in tc and not isinstance(tc["decoupled"], bool):
        out.append(f"{TRITON_CONFIG_KEY}.decoupled: is {tc['decoupled']!r}; must be true or false")
    cp = tc.get("cancellation_check_period_ms", 100)
    if isinstance(cp, bool) or not isinstance(cp, int) or cp <= 0:
        out.append(f"{TRITON_CONFIG_KEY}.cancellation_check_period_ms: is {cp!r}; must be a positive int")
    return out + check_llm_args({k: v for k, v in d.items() if k != TRITON_CONFIG_KEY}, version)


def check_unit_config(cfg: Any) -> list[str]:
    """What the real LLM-API model would refuse in a parsed config.pbtxt ``cfg`` (``model_config_pb2.ModelConfig``
    or the JSON dict Triton hands ``initialize``), as messages: facts 1, 2, 6 and 7's required inputs/outputs
    with their data types and dims."""
    d = _as_dict(cfg)
    out = []
    if d.get("backend") != BACKEND:
        out.append(f"backend: is {d.get('backend')!r}; the LLM-API model is a {BACKEND!r}-backend model")
    if int(d.get("max_batch_size", 0) or 0) != 0:
        out.append("max_batch_size: is set in config.pbtxt; model.yaml triton_config owns it (config.pbtxt: "
                   "'Please don't add it in config.pbtxt')")
    groups = d.get("instance_group") or [{}]
    count = int(groups[0].get("count", 1) or 1)
    gpu_ids = (d.get("parameters") or {}).get(GPU_IDS_PARAM, {}).get("string_value", "")
    if count > 1 and len([s for s in gpu_ids.split(";") if s.strip()]) < count:
        out.append(f"instance_group.count: is {count} but parameter {GPU_IDS_PARAM} names "
                   f"{len([s for s in gpu_ids.split(';') if s.strip()])} GPU set(s) ('0,1;2,3': one per instance)")
    have_in = {i["name"]: i for i in d.get("input", [])}
    have_out = {o["name"]: o for o in d.get("output", [])}
    for name in REQUIRED_INPUTS:
        out += _check_tensor("input", name, have_in.get(name), INPUTS[name][:2])
    out += _check_tensor("output", "text_output", have_out.get("text_output"), OUTPUTS["text_output"])
    return out


def _check_tensor(kind: str, name: str, got: Mapping | None, want: tuple[str, tuple[int, ...]]) -> list[str]:
    if got is None:
        return [f"{kind} {name}: is missing (the LLM-API model reads/writes it)"]
    dims = tuple(int(x) for x in got.get("dims", []))
    if got.get("data_type") != want[0] or dims != want[1]:
        return [f"{kind} {name}: is {got.get('data_type')} {list(dims)}, the LLM-API model has {want[0]} {list(want[1])}"]
    return []


def _as_dict(cfg: Any) -> dict:
    """A ModelConfig message or Triton's JSON model config as a dict with protobuf JSON names."""
    if isinstance(cfg, dict):
        return cfg
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(cfg, preserving_proto_field_name=True)
