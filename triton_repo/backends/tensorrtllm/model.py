"""CPU REFERENCE stand-in for the ``tensorrtllm`` Triton backend (NOT TensorRT-LLM).

A Triton "Python-based backend": installed as ``<backend-directory>/tensorrtllm/model.py``, it serves
every model whose config says ``backend: "tensorrtllm"``, so the *unchanged* config.pbtxt of an engine
unit (``tensorrt_llm_<h12>``) loads on a machine without a GPU or NVIDIA's container. It exists to test
the serving machinery (ensemble/BLS wiring, tensor names and dtypes, releases and rollbacks) for real;
it does not measure TensorRT-LLM's speed, memory or numerics.

It refuses to load a config the real backend would refuse: a parameter the backend reads without a
default (``tokenizer_dir``, ``xgrammar_tokenizer_info_path``, ``guided_decoding_backend``,
``gpt_model_type``, ...) missing or malformed, per ``precision_pipeline.serving.backend_contract``
(``check_contract``), with the backend's own message ("Cannot find parameter with name: ...").

Like the real backend it takes the engine location from the ``gpt_model_path`` parameter and ignores
Triton version directories. From that directory it reads ``cpu_reference.json`` (written by
build/precision_pipeline/serving/pack.py) naming the TRT-LLM checkpoint stored with the engine and the HF model folder, and loads
weights with ``precision_pipeline.gate.model.load_checkpoint_model(checkpoint_dir, hf_model_dir)`` (weights
dequantized from the checkpoint); when that function or the checkpoint is unavailable it loads the HF
folder with transformers in FP32 and says so in the log.

Generation: greedy, batched over every request of an ``execute`` call (left-padded, KV cache), with
tensorrtllm_backend's tensors: input_ids, input_lengths, request_output_len, end_id, pad_id,
stop_words_list, bad_words_list (single-token bad words), exclude_input_in_output ->
output_ids [batch, 1, len] (padded with end_id), sequence_length [batch, 1], cum_log_probs [batch, 1],
output_log_probs [batch, 1, len]. end_id is not part of the output (as in TensorRT-LLM); a matched stop
word is. Sampling (top_k > 1, top_p, temperature != 1 with sampling), beam search and streaming are
refused with an error rather than silently ignored.

Logits outputs, as tensorrtllm_backend names them (inputs ``return_context_logits`` /
``return_generation_logits``, BOOL):

* ``context_logits`` [batch, input_len, vocab] FP32: the logits of every prompt position (row ``t``
  predicts token ``t + 1``), rows past a request's own ``input_lengths`` are 0. Computed by one
  unpadded forward pass per request, so they equal a plain FP32 forward of that prompt. The real
  backend returns them only for an engine built with ``trtllm-build --gather_context_logits`` (profile
  ``build.gather_context_logits: true``) and with ``logits_datatype`` TYPE_FP32 in the unit's config;
* ``generation_logits`` [batch, 1, output_len, vocab] FP32: the logits each generated token was
  chosen from (real backend: ``--gather_generation_logits``).
Both are sent only when asked for (they are large: vocab floats per position).
"""

import json
import os
import sys
import time

import numpy as np
import triton_python_backend_utils as pb_utils

TAG = "[cpu_reference tensorrtllm stand-in]"


def _param(cfg, key, default=None):
    v = cfg.get("parameters", {}).get(key, {}).get("string_value")
    return default if v is None or v == "" or v.startswith("${") else v


def _log(msg):
    print(f"{TAG} {msg}", file=sys.stderr, flush=True)


def load_model(engine_dir):
    """(model, how) for the engine location: checkpoint via precision_pipeline.gate.model, else HF FP32."""
    import torch

    with open(os.path.join(engine_dir, "cpu_reference.json")) as f:
        ref = json.load(f)
    hf_dir = ref["hf_model_dir"]
    ck = ref.get("checkpoint_dir")
    if ck and not os.path.isabs(ck):
        ck = os.path.join(engine_dir, ck)
    root = ref.get("project_root")
    if root and root not in sys.path:
        sys.path.insert(0, root)
    why = f"no TRT-LLM checkpoint stored with the engine ({ck})"
    if ck and os.path.isfile(os.path.join(ck, "config.json")):
        try:
            from precision_pipeline.gate.model import load_checkpoint_model  # the project's loader
        except ImportError as e:
            why = f"precision_pipeline.gate.model.load_checkpoint_model unavailable ({e})"
        else:
            model = load_checkpoint_model(ck, hf_dir)
            return model.float().eval(), f"checkpoint {ck} (dequantized by precision_pipeline.gate.model.load_checkpoint_model)"
    from transformers import AutoModelForCausalLM

    _log(f"{why}: loading the HF model {hf_dir} with transformers in FP32")
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    return model.eval(), f"HF model {hf_dir} in FP32 ({why})"


def check_contract(engine_dir, params):
    """What the real tensorrtllm backend would refuse in this config's parameters (messages; empty: it loads),
    from the project's contract table (precision_pipeline.serving.backend_contract, found through the
    engine's cpu_reference.json ``project_root``). Without the table nothing can be vouched for: refused."""
    try:
        with open(os.path.join(engine_dir, "cpu_reference.json")) as f:
            root = json.load(f).get("project_root")
        if root and root not in sys.path:
            sys.path.insert(0, root)
        from precision_pipeline.serving.backend_contract import check_parameters
    except (OSError, ValueError, ImportError) as e:
        return [f"the contract table precision_pipeline.serving.backend_contract cannot be read ({e})"]
    return check_parameters(params)


class TritonPythonModel:
    def initialize(self, args):
        t0 = time.perf_counter()
        cfg = json.loads(args["model_config"])
        self.name = cfg.get("name", args.get("model_name", "?"))
        self.engine_dir = _param(cfg, "gpt_model_path")
        if not self.engine_dir:
            raise pb_utils.TritonModelException(f"{TAG} {self.name}: parameter gpt_model_path is not set")
        if not os.path.isfile(os.path.join(self.engine_dir, "cpu_reference.json")):
            raise pb_utils.TritonModelException(
                f"{TAG} {self.name}: {self.engine_dir}/cpu_reference.json not found (gpt_model_path must be this "
                "machine's path of the engine unit; pack with --repo-root left at its default to serve locally)")
        refused = check_contract(self.engine_dir, {k: v.get("string_value", "") for k, v in cfg.get("parameters", {}).items()})
        if refused:
            raise pb_utils.TritonModelException(f"{TAG} {self.name}: the tensorrtllm backend would not load this "
                                                f"config: {'; '.join(refused)}")
        threads = int(_param(cfg, "cpu_reference_threads", "1"))
        import torch

        torch.set_num_threads(max(1, threads))
        self.torch = torch
        self.exclude_default = str(_param(cfg, "exclude_input_in_output", "false")).lower() == "true"
        self.max_beam = int(_param(cfg, "max_beam_width", "1"))
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(cfg)
        with open(os.path.join(self.engine_dir, "cpu_reference.json")) as f:
            limits = json.load(f).get("limits") or {}
        self.max_input_len, self.max_seq_len = int(limits.get("max_input_len") or 0), int(limits.get("max_seq_len") or 0)
        self.model, how = load_model(self.engine_dir)
        _log(f"{self.name}: serving {how}; engine location {self.engine_dir}; {threads} thread(s); "
             f"loaded in {time.perf_counter() - t0:.1f} s. This is NOT TensorRT-LLM.")

    # ---- request parsing

    @staticmethod
    def _opt(request, name):
        t = pb_utils.get_input_tensor_by_name(request, name)
        return None if t is None else t.as_numpy()

    def _scalar(self, request, name, row, default):
        v = self._opt(request, name)
        if v is None:
            return default
        v = np.asarray(v).reshape(v.shape[0], -1) if v.ndim else v.reshape(1, 1)
        return v[min(row, v.shape[0] - 1)].reshape(-1)[0].item()

    @staticmethod
    def _words(arr, row):
        """Decode a [batch, 2, L] word list into a list of token-id lists."""
        if arr is None:
            return []
        a = np.asarray(arr)
        if a.ndim == 2:
            a = a[None]
        ids, offs = a[min(row, a.shape[0] - 1), 0], a[min(row, a.shape[0] - 1), 1]
        out, start = [], 0
        for o in offs:
            if o < 0:
                break
            out.append([int(x) for x in ids[start:o]])
            start = int(o)
        return [w for w in out if w]

    def _rows(self, request):
        ids = self._opt(request, "input_ids")
        if ids is None:
            raise ValueError("input_ids is required")
        ids = np.asarray(ids)
        if ids.ndim == 1:
            ids = ids[None]
        lens = self._opt(request, "input_lengths")
        out_len = self._opt(request, "request_output_len")
        if lens is None or out_len is None:
            raise ValueError("input_lengths and request_output_len are required")
        lens = np.asarray(lens).reshape(-1)
        out_len = np.asarray(out_len).reshape(-1)
        for name, bad in (("beam_width", lambda v: int(v) > 1), ("num_return_sequences", lambda v: int(v) > 1),
                          ("runtime_top_k", lambda v: int(v) > 1), ("runtime_top_p", lambda v: 0.0 < float(v) < 1.0),
                          ("streaming", bool)):
            v = self._opt(request, name)
            if v is not None and any(bad(x) for x in np.asarray(v).reshape(-1)):
                raise ValueError(f"{name}={np.asarray(v).reshape(-1).tolist()} is not supported by the CPU reference "
                                 "stand-in (greedy, one beam, no streaming)")
        stops = self._opt(request, "stop_words_list")
        bads = self._opt(request, "bad_words_list")
        rows = []
        for r in range(ids.shape[0]):
            n = int(lens[min(r, len(lens) - 1)])
            if n <= 0 or n > ids.shape[1]:
                raise ValueError(f"input_lengths[{r}]={n} is outside 1..{ids.shape[1]}")
            m = int(out_len[min(r, len(out_len) - 1)])
            if m < 1:
                raise ValueError(f"request_output_len[{r}]={m} must be >= 1")
            # the engine's limits as TensorRT-LLM's request validation applies them (GenericLlmRequest::validate,
            # cpp/include/tensorrt_llm/batch_manager/llmRequest.h): a prompt longer than max_input_len is refused
            # ("Prompt length (%d) exceeds maximum input length (%d)."); prompt + output past max_seq_len gets its
            # output shortened to max_seq_len - prompt, with a warning
            if self.max_input_len and n > self.max_input_len:
                raise ValueError(f"Prompt length ({n}) exceeds maximum input length ({self.max_input_len}).")
            if self.max_seq_len and n + m > self.max_seq_len:
                _log(f"{self.name}: prompt length + number of requested output tokens ({n} + {m}) exceeds maximum "
                     f"sequence length ({self.max_seq_len}); number of requested output tokens is changed to "
                     f"({self.max_seq_len - n}).")
                m = self.max_seq_len - n
            end_id = int(self._scalar(request, "end_id", r, -1))
            pad_id = int(self._scalar(request, "pad_id", r, end_id if end_id >= 0 else 0))
            excl = bool(self._scalar(request, "exclude_input_in_output", r, self.exclude_default))
            rows.append({"ids": [int(x) for x in ids[r, :n]], "max_new": m, "end_id": end_id, "pad_id": pad_id,
                         "stops": self._words(stops, r), "bad": [w[0] for w in self._words(bads, r) if len(w) == 1],
                         "exclude": excl, "want_ctx": bool(self._scalar(request, "return_context_logits", r, False)),
                         "want_gen": bool(self._scalar(request, "return_generation_logits", r, False))})
        return rows

    # ---- generation

    def generate(self, rows):
        """Greedy decoding of all rows together; fills row['gen'] and row['logprobs'] (and row['ctx'],
        row['genlog'] when asked for)."""
        torch = self.torch
        with torch.inference_mode():
            for r in rows:
                if r["want_ctx"]:  # one unpadded forward: exactly the prompt's FP32 logits
                    x = torch.tensor([r["ids"]], dtype=torch.long)
                    r["ctx"] = self.model(input_ids=x, use_cache=False).logits[0].float().numpy()
        B = len(rows)
        L = max(len(r["ids"]) for r in rows)
        inp = torch.zeros((B, L), dtype=torch.long)
        mask = torch.zeros((B, L), dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r["ids"])
            inp[i, L - n:] = torch.tensor(r["ids"])
            inp[i, :L - n] = max(r["pad_id"], 0)
            mask[i, L - n:] = 1
            r["gen"], r["logprobs"], r["done"] = [], [], False
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        steps = max(r["max_new"] for r in rows)
        with torch.inference_mode():
            out = self.model(input_ids=inp, attention_mask=mask, position_ids=pos, use_cache=True)
            past = out.past_key_values
            logits = out.logits[:, -1, :].float()
            for _ in range(steps):
                for i, r in enumerate(rows):
                    if r["bad"]:
                        logits[i, r["bad"]] = float("-inf")
                nxt = logits.argmax(-1)
                lp = torch.log_softmax(logits, -1).gather(-1, nxt[:, None])[:, 0]
                for i, r in enumerate(rows):
                    if r["done"]:
                        continue
                    t = int(nxt[i])
                    if t == r["end_id"]:
                        r["done"] = True
                        continue
                    r["gen"].append(t)
                    r["logprobs"].append(float(lp[i]))
                    if r["want_gen"]:
                        r.setdefault("genlog", []).append(logits[i].numpy().copy())
                    if len(r["gen"]) >= r["max_new"] or any(r["gen"][-len(s):] == s for s in r["stops"]):
                        r["done"] = True
                if all(r["done"] for r in rows):
                    break
                mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype)], dim=1)
                pos = pos[:, -1:] + 1
                out = self.model(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos,
                                 past_key_values=past, use_cache=True)
                past = out.past_key_values
                logits = out.logits[:, -1, :].float()

    def _response(self, rows):
        seqs = [(([] if r["exclude"] else r["ids"]) + r["gen"]) for r in rows]
        width = max(1, max(len(s) for s in seqs))
        gw = max(1, max(len(r["gen"]) for r in rows))
        out_ids = np.zeros((len(rows), 1, width), np.int32)
        lps = np.zeros((len(rows), 1, gw), np.float32)
        for i, (r, s) in enumerate(zip(rows, seqs)):
            out_ids[i, 0, :] = r["end_id"] if r["end_id"] >= 0 else r["pad_id"]
            out_ids[i, 0, :len(s)] = s
            lps[i, 0, :len(r["logprobs"])] = r["logprobs"]
        tensors = [
            pb_utils.Tensor("output_ids", out_ids),
            pb_utils.Tensor("sequence_length", np.array([[len(s)] for s in seqs], np.int32)),
            pb_utils.Tensor("cum_log_probs", np.array([[sum(r["logprobs"])] for r in rows], np.float32)),
            pb_utils.Tensor("output_log_probs", lps),
            pb_utils.Tensor("batch_index", np.arange(len(rows), dtype=np.int32).reshape(-1, 1)),
        ]
        if any(r["want_ctx"] for r in rows):
            v = next(r["ctx"].shape[1] for r in rows if r["want_ctx"])
            ctx = np.zeros((len(rows), max(len(r["ids"]) for r in rows), v), np.float32)
            for i, r in enumerate(rows):
                if r["want_ctx"]:
                    ctx[i, :len(r["ids"])] = r["ctx"]
            tensors.append(pb_utils.Tensor("context_logits", ctx))
        if any(r["want_gen"] for r in rows):
            v = next((r["genlog"][0].shape[0] for r in rows if r.get("genlog")), 1)
            gen = np.zeros((len(rows), 1, gw, v), np.float32)
            for i, r in enumerate(rows):
                for k, row in enumerate(r.get("genlog", [])):
                    gen[i, 0, k] = row
            tensors.append(pb_utils.Tensor("generation_logits", gen))
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def execute(self, requests):
        parsed, responses = [], [None] * len(requests)
        for k, request in enumerate(requests):
            try:
                parsed.append((k, self._rows(request)))
            except Exception as e:
                responses[k] = pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(f"{TAG} {e}"))
        all_rows = [r for _, rows in parsed for r in rows]
        if all_rows:
            try:
                self.generate(all_rows)
                for k, rows in parsed:
                    responses[k] = self._response(rows)
            except Exception as e:
                for k, _ in parsed:
                    responses[k] = pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(f"{TAG} {e}"))
        if self.decoupled:
            for request, resp in zip(requests, responses):
                request.get_response_sender().send(resp, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return None
        return responses

    def finalize(self):
        _log(f"{self.name}: unloaded")
        # The stub process exits next: Python's last garbage collections walk every object torch and transformers
        # made (~1 s of CPU, ~2 s on 2 shared cores, of every unload: measured); the exit frees them all anyway.
        import gc

        gc.freeze()
