"""The tensorrtllm Triton backend's contract with the engine unit's ``config.pbtxt`` (one home).

What the real backend (C++, ``inflight_batcher_llm``) reads from the ``tensorrt_llm_<h12>`` model
config, taken from its source and never from our own code:

* ``REQUIRED_PARAMETERS``: parameters read WITHOUT a default. ``ModelState::GetParameter<std::string>``
  throws ``"Cannot find parameter with name: <name>"`` for a key that is not in ``parameters``
  (``inflight_batcher_llm/src/model_state.cc:249-269``), and these reads have no ``try``, so the model
  fails to load (UNAVAILABLE, and the ensemble and BLS that call it with it).
* ``DEFAULTED_PARAMETERS``: parameters read inside ``try``/``catch``: absent = the default named here.
* ``INPUTS`` / ``OUTPUTS``: tensor names (the backend's ``InputFieldsNames`` / ``OutputFieldsNames``)
  and the Triton data types upstream's template declares for them.

Sources. Line numbers are of triton-inference-server/tensorrtllm_backend at tag ``v0.19.0`` (c1e1963,
the last release whose repository held the C++ sources; from 0.20 on they live in NVIDIA/TensorRT-LLM
``triton_backend/`` under the same paths, read there at 0c8de69a for ``model_instance_state.cc`` and
the template, 14c3afec for ``utils.h``: ``getGuidedDecodingConfigFromParams`` is unchanged; the
sampling inputs ``min_length`` / ``random_seed`` were renamed ``min_tokens`` / ``seed``
(``InputFieldsNames::minTokens`` / ``::seed``), which is what TensorRT-LLM 1.2 reads and what is
listed here). ``MIS`` = ``inflight_batcher_llm/src/model_instance_state.cc``, ``TPL`` =
``all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt``.

``check_parameters`` applies the table to a config's parameters; the CPU stand-in backend
(``triton_repo/backends/tensorrtllm/model.py``) calls it in ``initialize`` and refuses to load, so a
repository the real backend would refuse cannot pass a test on the stand-in. ``check_tensors``
compares a parsed ModelConfig's inputs/outputs with the table (pack's contract test).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

MIS = "inflight_batcher_llm/src/model_instance_state.cc"
MS = "inflight_batcher_llm/src/model_state.cc"
TPL = "all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt"
UTILS = "inflight_batcher_llm/src/utils.h"

BATCHING_TYPES = ("V1", "v1", "inflight_batching", "inflight_fused_batching")  # MIS:62-77 getBatchingTypeFromParams
GUIDED_BACKENDS = ("xgrammar",)  # MIS:440-448: any other non-empty value throws
BOOL_TEXT = ("True", "true", "TRUE", "1", "False", "false", "FALSE", "0")  # MS:310-326 GetParameter<bool>
MISSING = "Cannot find parameter with name: {name}"  # MS:264, the backend's own message


@dataclass(frozen=True)
class Param:
    """One parameter of the engine unit: ``source`` (file:line of the read), ``template`` (TPL line),
    ``default`` (text; None = required), ``kind`` (``str`` / ``bool`` / ``int`` / ``float``)."""

    source: str
    template: int
    default: Optional[str] = None
    kind: str = "str"
    note: str = ""


REQUIRED_PARAMETERS: dict[str, Param] = {
    # getBatchingTypeFromParams: no try; a value outside BATCHING_TYPES throws too
    "gpt_model_type": Param(f"{MIS}:62", 599, note="one of " + ", ".join(BATCHING_TYPES)),
    # read in a try (MIS:744-754) but a missing or non-existent path leaves it empty and
    # MIS:771-772 throws "Both encoder and decoder model paths are empty" (no encoder here)
    "gpt_model_path": Param(f"{MIS}:746,771", 605, note="the engine folder; must exist"),
    # getGuidedDecodingConfigFromParams: all three read unconditionally (no try). Empty (or the
    # unfilled "${...}") backend or info path = guided decoding off (MIS:424-428); tokenizer_dir is only
    # logged as ignored when set (MIS:417-422).
    "tokenizer_dir": Param(f"{MIS}:413", 847, note="empty: guided decoding off"),
    "xgrammar_tokenizer_info_path": Param(f"{MIS}:414", 859, note="empty: off; else the file must exist (MIS:430-431)"),
    "guided_decoding_backend": Param(f"{MIS}:415", 853, note="empty: off; else 'xgrammar' (MIS:440-448)"),
}
"""Parameters the real backend reads without a default: a config without one does not load."""

DEFAULTED_PARAMETERS: dict[str, Param] = {
    "max_beam_width": Param(f"{MIS}:462", 587, "1", "int"),
    "max_tokens_in_paged_kv_cache": Param(f"{MIS}:86", 617, "unset (KV cache sized by the memory fraction)", "int"),
    "kv_cache_free_gpu_mem_fraction": Param(f"{MIS}:99", 641, "unset (the executor's 0.9)", "float"),
    "batch_scheduler_policy": Param(f"{MIS}:360", 635, "guaranteed_no_evict"),
    "enable_kv_cache_reuse": Param(f"{MIS}:170", 703, "true", "bool"),
    "multi_block_mode": Param(f"{MIS}:194", 823, "true", "bool"),
    "enable_chunked_context": Param(f"{MIS}:521", 715, "false", "bool"),
    "exclude_input_in_output": Param(f"{MIS}:800", 673, "false", "bool"),
    "gpu_device_ids": Param(f"{MS}:97", 721, "all visible GPUs"),
}
"""Parameters read inside try/catch: absent = ``default``. A malformed value is also swallowed by the
real backend (the default is used, with a warning); ``check_parameters`` refuses it instead (stricter)."""

# Tensor -> Triton data type. Names: utils.h InputFieldsNames / OutputFieldsNames (kStopInputTensorName,
# kStreamingInputTensorName for stop / streaming); dtypes: TPL at the line given. "logits": the
# template's ${logits_datatype} (TYPE_FP32 / TYPE_FP16 / TYPE_BF16, spec/formats.py TRITON_DTYPE).
INPUTS: dict[str, tuple[str, int]] = {
    "input_ids": ("TYPE_INT32", 43), "input_lengths": ("TYPE_INT32", 64), "request_output_len": ("TYPE_INT32", 70),
    "num_return_sequences": ("TYPE_INT32", 76), "end_id": ("TYPE_INT32", 118), "pad_id": ("TYPE_INT32", 125),
    "stop_words_list": ("TYPE_INT32", 132), "bad_words_list": ("TYPE_INT32", 139), "embedding_bias": ("TYPE_FP32", 146),
    "beam_width": ("TYPE_INT32", 153), "temperature": ("TYPE_FP32", 160), "runtime_top_k": ("TYPE_INT32", 167),
    "runtime_top_p": ("TYPE_FP32", 174), "len_penalty": ("TYPE_FP32", 202), "repetition_penalty": ("TYPE_FP32", 216),
    "min_tokens": ("TYPE_INT32", 223), "presence_penalty": ("TYPE_FP32", 237), "frequency_penalty": ("TYPE_FP32", 244),
    "seed": ("TYPE_UINT64", 251), "return_log_probs": ("TYPE_BOOL", 258), "return_context_logits": ("TYPE_BOOL", 265),
    "return_generation_logits": ("TYPE_BOOL", 272), "exclude_input_in_output": ("TYPE_BOOL", 286),
    "stop": ("TYPE_BOOL", 293), "streaming": ("TYPE_BOOL", 300),
}
"""Inputs we declare (a subset of upstream's), with upstream's dtype and TPL line (``min_tokens`` /
``seed``: the 1.x template, same lines as ``min_length`` / ``random_seed`` in v0.19.0)."""
REQUIRED_INPUTS = ("input_lengths", "request_output_len")  # not optional in TPL (64, 70)
OUTPUTS: dict[str, tuple[str, int]] = {
    "output_ids": ("TYPE_INT32", 485), "sequence_length": ("TYPE_INT32", 490), "cum_log_probs": ("TYPE_FP32", 495),
    "output_log_probs": ("TYPE_FP32", 500), "context_logits": ("logits", 505), "generation_logits": ("logits", 510),
    "batch_index": ("TYPE_INT32", 515),
}
LOGITS_TYPES = ("TYPE_FP32", "TYPE_FP16", "TYPE_BF16")


def _number(kind: str, text: str) -> bool:
    try:
        (int if kind == "int" else float)(text)
    except ValueError:
        return False
    return True


def check_parameters(params: Mapping[str, str], check_paths: bool = True) -> list[str]:
    """What the real backend would refuse in a model config's ``parameters`` (``{key: string_value}``),
    as messages (empty list: it loads). Missing required parameters get the backend's own message
    (``MISSING``). ``check_paths``: also require ``gpt_model_path`` (and a set xgrammar info path) to
    exist, as the backend does on its machine."""
    out = [MISSING.format(name=k) + f" ({p.source})" for k, p in REQUIRED_PARAMETERS.items() if k not in params]
    if out:
        return out
    if params["gpt_model_type"] not in BATCHING_TYPES:
        out.append(f"gpt_model_type {params['gpt_model_type']!r} is not one of {', '.join(BATCHING_TYPES)} ({MIS}:64-77)")
    if check_paths and not os.path.exists(params["gpt_model_path"]):
        out.append(f"gpt_model_path {params['gpt_model_path']!r} does not exist ({MIS}:747, 771)")
    backend, info = params["guided_decoding_backend"], params["xgrammar_tokenizer_info_path"]
    unset = ("", "${guided_decoding_backend}", "${xgrammar_tokenizer_info_path}")
    if backend not in unset and info not in unset:
        if backend not in GUIDED_BACKENDS:
            out.append(f"guided_decoding_backend {backend!r} is not 'xgrammar' ({MIS}:440-448)")
        if check_paths and not os.path.isfile(info):
            out.append(f"xgrammar_tokenizer_info_path {info!r} does not exist ({MIS}:430-431)")
    for k, p in DEFAULTED_PARAMETERS.items():
        v = params.get(k)
        if v is None or v == "":
            continue
        if p.kind == "bool" and v not in BOOL_TEXT:
            out.append(f"{k} {v!r} is not a boolean ({MS}:310-326)")
        elif p.kind in ("int", "float") and not _number(p.kind, v):
            out.append(f"{k} {v!r} is not a number ({p.source})")
    return out


def check_tensors(cfg: Any) -> list[str]:
    """Problems of a parsed engine-unit ModelConfig's ``input`` / ``output`` against ``INPUTS`` /
    ``OUTPUTS``: unknown names, other dtypes, required inputs marked optional or missing."""
    out = []
    have = {}
    for t in cfg.input:
        have[t.name] = t
        want = INPUTS.get(t.name)
        dt = _dtype_name(t.data_type)
        if want is None:
            out.append(f"input {t.name!r} is not read by the tensorrtllm backend ({UTILS} InputFieldsNames)")
        elif dt != want[0]:
            out.append(f"input {t.name!r} is {dt}; upstream declares {want[0]} ({TPL}:{want[1]})")
    for name in REQUIRED_INPUTS:
        if name not in have or have[name].optional:
            out.append(f"input {name!r} must be declared and not optional ({TPL}:{INPUTS[name][1]})")
    for t in cfg.output:
        want = OUTPUTS.get(t.name)
        dt = _dtype_name(t.data_type)
        if want is None:
            out.append(f"output {t.name!r} is not produced by the tensorrtllm backend ({UTILS} OutputFieldsNames)")
        elif (want[0] == "logits" and dt not in LOGITS_TYPES) or (want[0] != "logits" and dt != want[0]):
            out.append(f"output {t.name!r} is {dt}; upstream declares {want[0]} ({TPL}:{want[1]})")
    return out


def _dtype_name(value: int) -> str:
    from tritonclient.grpc import model_config_pb2

    return model_config_pb2.DataType.Name(value)


__all__ = ["Param", "REQUIRED_PARAMETERS", "DEFAULTED_PARAMETERS", "INPUTS", "OUTPUTS", "REQUIRED_INPUTS",
           "check_parameters", "check_tensors", "MISSING", "BATCHING_TYPES", "GUIDED_BACKENDS"]
