"""preprocessing (Triton python backend): text -> token ids, stop/bad word lists, end/pad ids.

Tensor names and dtypes follow tensorrtllm_backend's inflight_batcher_llm preprocessing model.
Uses the ``tokenizers`` library on ``<tokenizer_dir>/tokenizer.json`` (no transformers import: it
keeps this process small and quick to start) and renders the chat template with jinja2 the way
transformers' ``apply_chat_template`` does (sandboxed, trim_blocks, lstrip_blocks, loopcontrols).

Chat template: applied here when parameter ``apply_chat_template`` is "true". QUERY is then the
user message, or a JSON list of {"role": ..., "content": ...} messages; the templated prompt ends
with the assistant generation prompt and is encoded with ``add_special_tokens`` (rendered "false":
the template carries its own markers). When "false", QUERY is encoded as raw text.

end_id / pad_id: a request's END_ID / PAD_ID win; otherwise the ``end_id`` / ``pad_id`` parameters
(rendered from the model's generation_config.json; the tokenizer's eos_token is not used because
some tokenizers, e.g. SmolLM2's GGUF-derived one, name the wrong token). ``stop_words`` (JSON list of
strings) are added to every request's STOP_WORDS_DICT.
"""

import json
from datetime import datetime

import numpy as np
import triton_python_backend_utils as pb_utils


def _param(cfg, key, default=None):
    v = cfg.get("parameters", {}).get(key, {}).get("string_value")
    return default if v is None or v.startswith("${") else v


def _bool(v):
    return str(v).strip().lower() in ("true", "1", "yes")


def render_chat(template_text, messages, special):
    """Render a chat template like transformers' apply_chat_template(add_generation_prompt=True)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template_text).render(messages=messages, add_generation_prompt=True, **special)


def to_word_list(tokenizer, words_per_row):
    """[batch, 2, L] int32: flat ids of the words, then end offsets (padded 0 / -1)."""
    rows = []
    for words in words_per_row:
        ids, offsets = [], []
        for w in words:
            t = tokenizer.encode(w, add_special_tokens=False).ids
            if not t:
                continue
            ids += t
            offsets.append(len(ids))
        rows.append((ids, offsets))
    width = max(1, max(max(len(i), len(o)) for i, o in rows))
    out = np.zeros((len(rows), 2, width), dtype=np.int32)
    out[:, 1, :] = -1
    for r, (ids, offs) in enumerate(rows):
        out[r, 0, :len(ids)] = ids
        out[r, 1, :len(offs)] = offs
    return out


class TritonPythonModel:
    def initialize(self, args):
        from tokenizers import Tokenizer

        cfg = json.loads(args["model_config"])
        tdir = _param(cfg, "tokenizer_dir")
        if not tdir:
            raise pb_utils.TritonModelException("preprocessing: parameter tokenizer_dir is not set")
        self.tokenizer = Tokenizer.from_file(f"{tdir}/tokenizer.json")
        self.add_special_tokens = _bool(_param(cfg, "add_special_tokens", "true"))
        self.apply_chat_template = _bool(_param(cfg, "apply_chat_template", "false"))
        self.end_id = int(_param(cfg, "end_id"))
        self.pad_id = int(_param(cfg, "pad_id", self.end_id))
        self.stop_words = json.loads(_param(cfg, "stop_words", "[]") or "[]")
        self.template = None
        self.special = {}
        if self.apply_chat_template:
            try:
                with open(f"{tdir}/chat_template.jinja") as f:
                    self.template = f.read()
            except OSError:
                with open(f"{tdir}/tokenizer_config.json") as f:
                    self.template = json.load(f).get("chat_template")
            if not self.template:
                raise pb_utils.TritonModelException("preprocessing: apply_chat_template is true but the tokenizer has no chat template")
            try:
                with open(f"{tdir}/tokenizer_config.json") as f:
                    tc = json.load(f)
                self.special = {k: v for k, v in tc.items() if k.endswith("_token") and isinstance(v, str)}
            except OSError:
                pass

    def _prompt(self, text):
        if not self.apply_chat_template:
            return text
        messages = None
        s = text.strip()
        if s.startswith("["):
            try:
                cand = json.loads(s)
                if isinstance(cand, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in cand):
                    messages = cand
            except ValueError:
                pass
        if messages is None:
            messages = [{"role": "user", "content": text}]
        return render_chat(self.template, messages, self.special)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(self._one(request))
            except Exception as e:  # a bad request must not take the model down
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(f"preprocessing: {e}")))
        return responses

    def _one(self, request):
        query = pb_utils.get_input_tensor_by_name(request, "QUERY").as_numpy()
        out_len = pb_utils.get_input_tensor_by_name(request, "REQUEST_OUTPUT_LEN").as_numpy().astype(np.int32)
        batch = query.shape[0]

        def opt(name):
            t = pb_utils.get_input_tensor_by_name(request, name)
            return None if t is None else t.as_numpy()

        end = opt("END_ID")
        pad = opt("PAD_ID")
        end = np.full((batch, 1), self.end_id, np.int32) if end is None else end.reshape(batch, 1).astype(np.int32)
        pad = np.full((batch, 1), self.pad_id, np.int32) if pad is None else pad.reshape(batch, 1).astype(np.int32)

        ids = []
        for r in range(batch):
            v = query[r].reshape(-1)[0]
            text = v.decode("utf-8") if isinstance(v, bytes) else str(v)
            enc = self.tokenizer.encode(self._prompt(text), add_special_tokens=self.add_special_tokens).ids
            if not enc:
                raise ValueError("empty prompt after tokenization")
            ids.append(enc)
        width = max(len(x) for x in ids)
        input_ids = np.zeros((batch, width), np.int32)
        for r, x in enumerate(ids):
            input_ids[r, :] = pad[r, 0]
            input_ids[r, :len(x)] = x
        lens = np.array([[len(x)] for x in ids], np.int32)

        def words(name, extra):
            arr = opt(name)
            rows = []
            for r in range(batch):
                got = [] if arr is None else [w.decode("utf-8") if isinstance(w, bytes) else str(w) for w in arr[r].reshape(-1)]
                rows.append([w for w in got if w] + list(extra))
            return rows

        stop = to_word_list(self.tokenizer, words("STOP_WORDS_DICT", self.stop_words))
        bad = to_word_list(self.tokenizer, words("BAD_WORDS_DICT", []))
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("INPUT_ID", input_ids),
            pb_utils.Tensor("REQUEST_INPUT_LEN", lens),
            pb_utils.Tensor("BAD_WORDS_IDS", bad),
            pb_utils.Tensor("STOP_WORDS_IDS", stop),
            pb_utils.Tensor("REQUEST_OUTPUT_LEN", out_len.reshape(batch, 1)),
            pb_utils.Tensor("OUT_END_ID", end),
            pb_utils.Tensor("OUT_PAD_ID", pad),
        ])

    def finalize(self):
        pass
