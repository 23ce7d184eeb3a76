"""tensorrt_llm_bls (Triton python backend): preprocessing -> tensorrt_llm_<h12> -> postprocessing via BLS calls.

The engine model's name comes from the ``tensorrt_llm_model_name`` parameter (tensorrtllm_backend's
name for it), overridden by ``<this model's dir>/route.json`` {"tensorrt_llm_model_name": ...} when
present. build/precision_pipeline/serving/release.py rewrites both when a release is promoted or rolled back: route.json is
checked (stat) on every request, so a running BLS switches engines without being reloaded.

Canary (a gradual rollout, build/precision_pipeline/serving/rollout.py): route.json may also hold
``"canary": {"tensorrt_llm_model_name": <candidate unit>, "percent": P}``; then P of every 100
requests of this BLS instance go to the candidate, spread evenly (a deterministic accumulator, not a
coin flip, so the share per instance is exact to one request). Without "canary" every request goes to
the stable unit. Non-streaming:
one response per request (in decoupled mode it is sent through the response sender with the FINAL flag;
``stream`` = true is refused, this BLS does not stream).
"""

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils


def _param(cfg, key, default=None):
    v = cfg.get("parameters", {}).get(key, {}).get("string_value")
    return default if v is None or v.startswith("${") else v


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        self.trt_name = _param(cfg, "tensorrt_llm_model_name")
        if not self.trt_name:
            raise pb_utils.TritonModelException("tensorrt_llm_bls: parameter tensorrt_llm_model_name is not set")
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(cfg)
        self.route_file = os.path.join(args.get("model_repository", ""), "route.json")
        self.route_mtime = None
        self.canary, self.percent, self.acc = None, 0, 0
        self._route()

    def _route(self):
        """The engine model to call: route.json when it exists (re-read when it changes), else the parameter;
        with a canary in route.json, the candidate for its percent of requests."""
        try:
            st = os.stat(self.route_file)
        except OSError:
            st = None
        key = None if st is None else (st.st_mtime_ns, st.st_ino, st.st_size)
        if st is not None and key != self.route_mtime:
            try:
                with open(self.route_file) as f:
                    route = json.load(f)
                name = route.get("tensorrt_llm_model_name")
                if name:
                    self.trt_name = name
                can = route.get("canary") or {}
                self.canary = can.get("tensorrt_llm_model_name") or None
                self.percent = max(0, min(100, int(can.get("percent", 0)))) if self.canary else 0
                self.route_mtime = key
            except (OSError, ValueError, TypeError):
                pass
        if self.canary and self.percent:
            self.acc += self.percent
            if self.acc >= 100:
                self.acc -= 100
                return self.canary
        return self.trt_name

    @staticmethod
    def _call(model, inputs, outputs):
        req = pb_utils.InferenceRequest(model_name=model, inputs=inputs, requested_output_names=outputs)
        resp = req.exec()
        if resp.has_error():
            raise RuntimeError(f"{model}: {resp.error().message()}")
        return {n: pb_utils.get_output_tensor_by_name(resp, n).as_numpy() for n in outputs}

    def _one(self, request):
        def opt(name):
            t = pb_utils.get_input_tensor_by_name(request, name)
            return None if t is None else t.as_numpy()

        stream = opt("stream")
        if stream is not None and bool(np.asarray(stream).reshape(-1)[0]):
            raise ValueError("stream=true is not supported by this BLS model")
        pre_in = [pb_utils.Tensor("QUERY", opt("text_input")),
                  pb_utils.Tensor("REQUEST_OUTPUT_LEN", opt("max_tokens").astype(np.int32))]
        for src, dst in (("bad_words", "BAD_WORDS_DICT"), ("stop_words", "STOP_WORDS_DICT"), ("end_id", "END_ID"), ("pad_id", "PAD_ID")):
            v = opt(src)
            if v is not None:
                pre_in.append(pb_utils.Tensor(dst, v))
        pre = self._call("preprocessing", pre_in, ["INPUT_ID", "REQUEST_INPUT_LEN", "REQUEST_OUTPUT_LEN", "STOP_WORDS_IDS",
                                                    "BAD_WORDS_IDS", "OUT_END_ID", "OUT_PAD_ID"])
        trt_in = [pb_utils.Tensor("input_ids", pre["INPUT_ID"]),
                  pb_utils.Tensor("input_lengths", pre["REQUEST_INPUT_LEN"]),
                  pb_utils.Tensor("request_output_len", pre["REQUEST_OUTPUT_LEN"]),
                  pb_utils.Tensor("end_id", pre["OUT_END_ID"]),
                  pb_utils.Tensor("pad_id", pre["OUT_PAD_ID"]),
                  pb_utils.Tensor("stop_words_list", pre["STOP_WORDS_IDS"]),
                  pb_utils.Tensor("bad_words_list", pre["BAD_WORDS_IDS"])]
        for name in ("exclude_input_in_output", "return_log_probs"):
            v = opt(name)
            if v is not None:
                trt_in.append(pb_utils.Tensor(name, v))
        trt = self._call(self._route(), trt_in, ["output_ids", "sequence_length", "cum_log_probs", "output_log_probs"])
        post = self._call("postprocessing", [pb_utils.Tensor("TOKENS_BATCH", trt["output_ids"]),
                                             pb_utils.Tensor("SEQUENCE_LENGTH", trt["sequence_length"])], ["OUTPUT"])
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("text_output", post["OUTPUT"]),
            pb_utils.Tensor("cum_log_probs", trt["cum_log_probs"]),
            pb_utils.Tensor("output_log_probs", trt["output_log_probs"]),
        ])

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                resp = self._one(request)
            except Exception as e:
                resp = pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(f"tensorrt_llm_bls: {e}"))
            if self.decoupled:
                request.get_response_sender().send(resp, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                responses.append(resp)
        return None if self.decoupled else responses

    def finalize(self):
        pass
