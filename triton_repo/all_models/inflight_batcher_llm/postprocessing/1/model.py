"""postprocessing (Triton python backend): output token ids -> text.

Tensor names and dtypes follow tensorrtllm_backend (TOKENS_BATCH [batch, beam, len] int32,
SEQUENCE_LENGTH [batch, beam] int32 -> OUTPUT string). Decodes ``tokens[:sequence_length]`` of each
beam with the ``tokenizers`` library, skipping special tokens when ``skip_special_tokens`` is
"true", then applies transformers' tokenization-space clean-up when the tokenizer's
``clean_up_tokenization_spaces`` is true, so the text equals ``AutoTokenizer.decode``'s.
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


def _param(cfg, key, default=None):
    v = cfg.get("parameters", {}).get(key, {}).get("string_value")
    return default if v is None or v.startswith("${") else v


def clean_up_tokenization(s):
    """The same replacements as transformers' PreTrainedTokenizerBase.clean_up_tokenization."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                 (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        s = s.replace(a, b)
    return s


class TritonPythonModel:
    def initialize(self, args):
        from tokenizers import Tokenizer

        cfg = json.loads(args["model_config"])
        tdir = _param(cfg, "tokenizer_dir")
        if not tdir:
            raise pb_utils.TritonModelException("postprocessing: parameter tokenizer_dir is not set")
        self.tokenizer = Tokenizer.from_file(f"{tdir}/tokenizer.json")
        self.skip_special = str(_param(cfg, "skip_special_tokens", "true")).lower() in ("true", "1", "yes")
        self.cleanup = False
        try:
            with open(f"{tdir}/tokenizer_config.json") as f:
                self.cleanup = bool(json.load(f).get("clean_up_tokenization_spaces", False))
        except OSError:
            pass

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                toks = pb_utils.get_input_tensor_by_name(request, "TOKENS_BATCH").as_numpy()
                lens = pb_utils.get_input_tensor_by_name(request, "SEQUENCE_LENGTH").as_numpy()
                if toks.ndim == 2:  # [batch, len] -> one beam
                    toks = toks[:, None, :]
                    lens = lens.reshape(-1, 1)
                out = []
                for b in range(toks.shape[0]):
                    for k in range(toks.shape[1]):
                        n = int(lens[b, k])
                        text = self.tokenizer.decode([int(t) for t in toks[b, k, :n]], skip_special_tokens=self.skip_special)
                        out.append((clean_up_tokenization(text) if self.cleanup else text).encode("utf-8"))
                arr = np.array(out, dtype=object).reshape(toks.shape[0], toks.shape[1])
                responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", arr)]))
            except Exception as e:
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(f"postprocessing: {e}")))
        return responses

    def finalize(self):
        pass
