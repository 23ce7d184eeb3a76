"""CPU STAND-IN for TensorRT-LLM's Triton LLM-API model (NOT TensorRT-LLM, NOT the LLM API).

Installed as ``<llm_api_<h12>>/1/model.py`` on this machine only (build/precision_pipeline/serving/llmapi_unit.py
``install_stand_in``); on NVIDIA's image the unit's ``1/model.py`` is the image's own LLM-API model. It serves the
*unchanged* unit (config.pbtxt + 1/model.yaml) so the serving machinery (packing, the BLS's dispatch, releases,
rollouts) runs for real without a GPU. It does not measure TensorRT-LLM's speed, memory or numerics.

What it does like the real model (facts: build/precision_pipeline/serving/llmapi_contract.py):

* ``auto_complete_config`` takes ``max_batch_size`` and the decoupled policy from ``1/model.yaml`` ``triton_config``;
* it refuses to load what the real one refuses: the config (``check_unit_config``) and model.yaml
  (``check_model_yaml``: triton_config keys, ``max_batch_size`` 0, the LLM arguments) per the contract module,
  found through the unit's ``cpu_reference.json`` ``project_root``; without that module it refuses (nothing vouched);
* requests: ``text_input`` (1-D, the prompt is element 0) -> ``text_output`` [1] STRING = prompt + generated text
  (``sampling_param_exclude_input_from_output`` false, the real default) or the generated text only;
  ``sampling_param_max_tokens`` (default 32: TensorRT-LLM ``SamplingParams.max_tokens``'s default, unverified);
  ``return_finish_reason`` / ``return_cumulative_logprob`` add ``finish_reason`` / ``cumulative_logprob``, both as
  the real model sends them: ``str()`` of the value in an object (BYTES) array (MODEL_PY ``_create_response``), though
  config.pbtxt declares cumulative_logprob TYPE_FP32;
  ``streaming`` true on a non-decoupled model: the real model's error ("Streaming is only supported in decoupled
  mode.").

Where it is stricter (it cannot do these, so it says so instead of answering differently): sampling
(temperature > 0, top_k > 1, 0 < top_p < 1, best_of > 1), streaming at all, ``stop`` requests.

Weights: ``precision_pipeline.gate.moe_model.load_gate_model(<unit>/checkpoint, hf_model_dir)`` (the real model
dequantized from the unit's checkpoint; the same loader as the gate stage: ``load_checkpoint_model`` for the dense
families, the MoE reader for a MoE family's unified HF checkpoint). No fallback: a checkpoint the loader cannot
read refuses the load. Tokenizer: the HF model folder's (``cpu_reference.json`` ``hf_model_dir``).
"""

import json
import os
import sys
import time

import numpy as np
import triton_python_backend_utils as pb_utils

TAG = "[cpu stand-in of the TensorRT-LLM LLM-API model]"
DEFAULT_MAX_TOKENS = 32
REFUSED_SAMPLING = (("sampling_param_temperature", lambda v: float(v) > 0.0),
                    ("sampling_param_top_k", lambda v: int(v) > 1),
                    ("sampling_param_top_p", lambda v: 0.0 < float(v) < 1.0),
                    ("sampling_param_best_of", lambda v: int(v) > 1),
                    ("stop", bool))


def _log(msg):
    print(f"{TAG} {msg}", file=sys.stderr, flush=True)


def _unit_dir():
    return os.path.dirname(os.path.abspath(pb_utils.get_model_dir()))


def _read_yaml():
    import yaml

    path = os.path.join(pb_utils.get_model_dir(), os.environ.get("LLM_CONFIG_PATH", "model.yaml"))
    if not os.path.isfile(path):
        raise pb_utils.TritonModelException(f"{TAG} {path} not found (the LLM-API model reads its LLM args there)")
    with open(path) as f:
        return yaml.safe_load(f)


def _reference():
    with open(os.path.join(_unit_dir(), "cpu_reference.json")) as f:
        ref = json.load(f)
    root = ref.get("project_root")
    if root and root not in sys.path:
        sys.path.insert(0, root)
    return ref


def _contract():
    try:
        from precision_pipeline.serving import llmapi_contract
    except ImportError as e:
        raise pb_utils.TritonModelException(f"{TAG} the contract module precision_pipeline.serving.llmapi_contract "
                                            f"cannot be imported ({e}): nothing can be vouched for, refused")
    return llmapi_contract


class TritonPythonModel:
    @classmethod
    def auto_complete_config(cls, auto_complete_model_config):
        tc = (_read_yaml() or {}).get("triton_config") or {}
        if "decoupled" in tc and "max_batch_size" in tc:  # else initialize refuses with the contract's message
            auto_complete_model_config.set_model_transaction_policy(dict(decoupled=bool(tc["decoupled"])))
            auto_complete_model_config.set_max_batch_size(int(tc["max_batch_size"]))
        return auto_complete_model_config

    def initialize(self, args):
        t0 = time.perf_counter()
        cfg = json.loads(args["model_config"])
        self.name = cfg.get("name", "?")
        ref = _reference()
        contract = _contract()
        yml = _read_yaml()
        refused = contract.check_model_yaml(yml, ref.get("trtllm_version", "1.2.1")) + contract.check_unit_config(cfg)
        if refused:
            raise pb_utils.TritonModelException(f"{TAG} {self.name}: the LLM-API model would not load this unit: "
                                                + "; ".join(refused))
        self.decoupled = bool(yml["triton_config"]["decoupled"])
        import torch
        from transformers import AutoTokenizer

        torch.set_num_threads(1)
        self.torch = torch
        ck = os.path.join(_unit_dir(), ref.get("checkpoint_dir") or "checkpoint")
        from precision_pipeline.gate.moe_model import load_gate_model  # the project's loader (the gate stage's)

        self.model = load_gate_model(ck, ref["hf_model_dir"]).float().eval()
        self.tok = AutoTokenizer.from_pretrained(ref["hf_model_dir"])
        self.eos = self._eos(ref["hf_model_dir"])
        _log(f"{self.name}: serving {ck} (dequantized by precision_pipeline.gate.moe_model.load_gate_model) in "
             f"{time.perf_counter() - t0:.1f} s. This is NOT TensorRT-LLM.")

    @staticmethod
    def _eos(hf_dir):
        ids = set()
        for name in ("generation_config.json", "config.json"):
            try:
                with open(os.path.join(hf_dir, name)) as f:
                    e = json.load(f).get("eos_token_id")
            except (OSError, ValueError):
                continue
            if e is not None:
                ids.update(e if isinstance(e, list) else [e])
                break
        return {int(i) for i in ids}

    @staticmethod
    def _scalar(request, name, default):
        t = pb_utils.get_input_tensor_by_name(request, name)
        if t is None:
            return default
        a = t.as_numpy()
        if a.size != 1:
            raise ValueError(f"Expected a scalar tensor for tensor {name}")
        return a.reshape(-1)[0].item()

    def _parse(self, request):
        t = pb_utils.get_input_tensor_by_name(request, "text_input")
        if t is None:
            raise ValueError("text_input is missing from the request")
        a = t.as_numpy()
        if a.ndim > 1:
            raise ValueError("The current implementation only supports text_input being a 1D tensor.")
        prompt = a.reshape(-1)[0]
        prompt = prompt.decode("utf-8") if isinstance(prompt, bytes) else str(prompt)
        if self._scalar(request, "streaming", False):
            raise ValueError("Streaming is only supported in decoupled mode." if not self.decoupled else
                             "streaming is not supported by the CPU stand-in")
        for name, bad in REFUSED_SAMPLING:
            v = self._scalar(request, name, None)
            if v is not None and bad(v):
                raise ValueError(f"{name}={v} is not supported by the CPU stand-in (greedy decoding only)")
        return {"prompt": prompt, "max_tokens": int(self._scalar(request, "sampling_param_max_tokens", DEFAULT_MAX_TOKENS)),
                "exclude": bool(self._scalar(request, "sampling_param_exclude_input_from_output", False)),
                "finish": bool(self._scalar(request, "return_finish_reason", False)),
                "cum": bool(self._scalar(request, "return_cumulative_logprob", False))}

    def generate(self, r):
        """Greedy decoding of one prompt; returns (generated ids, cumulative logprob, finish reason)."""
        torch = self.torch
        if r["max_tokens"] < 1:
            raise ValueError(f"sampling_param_max_tokens={r['max_tokens']} must be >= 1")
        ids = self.tok(r["prompt"], return_tensors="pt").input_ids
        gen, cum, reason = [], 0.0, "length"
        with torch.inference_mode():
            out = self.model(input_ids=ids, use_cache=True)
            for _ in range(r["max_tokens"]):
                logits = out.logits[0, -1].float()
                t = int(logits.argmax())
                if t in self.eos:
                    reason = "stop"
                    break
                gen.append(t)
                cum += float(torch.log_softmax(logits, -1)[t])
                if len(gen) == r["max_tokens"]:  # no forward whose logits nobody reads (half a 1-token request's cost)
                    break
                out = self.model(input_ids=torch.tensor([[t]]), past_key_values=out.past_key_values, use_cache=True)
        return gen, cum, reason

    def _one(self, request):
        r = self._parse(request)
        gen, cum, reason = self.generate(r)
        text = self.tok.decode(gen, skip_special_tokens=True)
        text = text if r["exclude"] else r["prompt"] + text
        tensors = [pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=object))]
        if r["finish"]:
            tensors.append(pb_utils.Tensor("finish_reason", np.array([reason.encode()], dtype=object)))
        if r["cum"]:  # as the real model sends it: str() of the value in an object array, whatever config.pbtxt says
            tensors.append(pb_utils.Tensor("cumulative_logprob", np.array([str(cum).encode()], dtype=object)))
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                resp = self._one(request)
            except Exception as e:
                resp = pb_utils.InferenceResponse(output_tensors=[],
                                                  error=pb_utils.TritonError(f"Error generating request: {e}"))
            if self.decoupled:
                request.get_response_sender().send(resp, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                responses.append(resp)
        return None if self.decoupled else responses

    def finalize(self):
        _log(f"{self.name}: unloaded")
        # The stub process exits next: Python's last garbage collections walk every object torch and transformers
        # made (~1 s of CPU, ~2 s on 2 shared cores, of every unload: measured); the exit frees them all anyway.
        import gc

        gc.freeze()
