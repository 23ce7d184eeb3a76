"""What the accuracy gate measures (``GateOptions``, hashed) and how it runs (``GateRuntime``, never hashed).

Torch-free on purpose: a stage key can be computed from these objects without importing the gate.

``GateOptions`` holds every setting that changes a number in ``metrics.json``; two gates with equal
options, the same candidate, the same reference folder and the same golden prompts give the same
report. ``GateRuntime`` holds only how the work is done (threads, progress bars, where the
reference cache lives, whether the reports are rendered): changing it never changes a number.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, NonNegativeInt, PositiveInt

DEFAULT_HELDOUT_TOKENS = 2048
DEFAULT_HELDOUT_WINDOW = 512
DEFAULT_GREEDY_NEW_TOKENS = 32
DEFAULT_GREEDY_BATCH = 48
DEFAULT_BOOTSTRAP = 1000

# GateOptions fields the FP32 reference / BF16 floor results do not depend on: the bootstrap only
# resamples per-token numbers computed after the reference, the golden file's *content* (its
# token ids) is hashed into the reference key instead of its path, and the candidate's dtype is
# the candidate's alone.
REFERENCE_INDEPENDENT = frozenset({"bootstrap_resamples", "seed", "golden_path", "candidate_dtype"})
# Fields added with device selection: keyed only when not at these values, so every key computed
# before them (CPU, FP32 reference, FP32 candidate) stays the same and CPU results are reused.
COMPUTE_DEFAULTS: dict[str, str] = {"device": "cpu", "reference_dtype": "float32", "candidate_dtype": "float32"}


class GateOptions(BaseModel):
    """How the gate measures. Every field can change the numbers, so every field is part of a key."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prompts_per_category: Optional[PositiveInt] = None
    """Only the first N golden prompts of each category (file order); None evaluates all of them."""
    golden_path: Optional[Path] = None
    """Golden prompt file (JSON lines); None = the shipped ``gate/data/golden_prompts.jsonl``."""
    heldout_tokens: NonNegativeInt = DEFAULT_HELDOUT_TOKENS
    """Tokens of held-out news for the perplexity change; 0 skips that metric."""
    heldout_window: PositiveInt = DEFAULT_HELDOUT_WINDOW
    """Held-out tokens per forward pass (the engine gate lowers it to the engine's max_input_len)."""
    greedy_new_tokens: NonNegativeInt = DEFAULT_GREEDY_NEW_TOKENS
    """New tokens per greedy generation; 0 skips ``greedy_same``."""
    greedy_batch: PositiveInt = DEFAULT_GREEDY_BATCH
    """Most prompts decoded together (HF models; an engine gate caps it at the engine's max_batch_size).

    The prompts, sorted by length, are split into ``ceil(n / greedy_batch)`` batches of near-equal
    size. Left padding changes float rounding, so a near-tie can flip between batch sizes: the
    reference and the candidate are batched alike, and the value is part of the reference key."""
    noise_floor: bool = True
    """Also score the reference folder loaded in BF16 (the noise floor in the report)."""
    bootstrap_resamples: NonNegativeInt = DEFAULT_BOOTSTRAP
    """Percentile-bootstrap resamples over prompts for the 95% intervals; 0 gives no intervals."""
    seed: int = 0
    """Seed of the bootstrap's resampling."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the reference, the noise floor and the candidate run (``spec.device.DeviceChoice.device``);
    CUDA kernels round differently, so it is keyed (the reference cache too)."""
    reference_dtype: Literal["float32", "bfloat16"] = "float32"
    """The reference's dtype. FP32 is the default and its BF16 copy is the noise floor; a BF16
    reference (``--reference-dtype bfloat16``, when FP32 does not fit) has no floor to measure."""
    candidate_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute dtype of the dequantized checkpoint: FP32 on the CPU, the profile's dtype on CUDA."""

    @property
    def measures_floor(self) -> bool:
        """The BF16 noise floor is measured: asked for, and the reference is FP32."""
        return self.noise_floor and self.reference_dtype == "float32"

    def _keyed(self, exclude: frozenset[str] = frozenset()) -> dict[str, Any]:
        d = self.model_dump(mode="json", exclude=set(exclude))
        for k, v in COMPUTE_DEFAULTS.items():
            if d.get(k) == v:
                d.pop(k)
        return d

    def key_fields(self) -> dict[str, Any]:
        """All fields as JSON values (what a stage key hashes); ``COMPUTE_DEFAULTS`` fields only when not default."""
        return self._keyed()

    def canonical(self) -> dict[str, Any]:
        """What a stage key sees (``core.store.canonical``): ``key_fields()``."""
        return self.key_fields()

    def reference_key_fields(self) -> dict[str, Any]:
        """The fields the cached reference and BF16 floor depend on: all but ``REFERENCE_INDEPENDENT``
        (and ``COMPUTE_DEFAULTS`` fields at their defaults). Device and reference dtype are part of it.

        A new field is part of the reference key unless it is added to ``REFERENCE_INDEPENDENT``.
        """
        return self._keyed(REFERENCE_INDEPENDENT)


class GateRuntime(BaseModel):
    """How the gate runs. Never hashed: the same inputs give the same numbers whatever is set here."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    threads: Optional[PositiveInt] = None
    """Torch CPU threads; None = the cores other processes leave free (``gate.threads.thread_choice``)."""
    progress: bool = True
    """Progress: rich bars in a terminal, a line at least every 10 s in a log (``core.progress``)."""
    reference_cache: Optional[Path] = None
    """Root of the reference cache; None = ``spec.default_model.cache_dir()/gate-ref``."""
    use_reference_cache: bool = True
    """False recomputes the reference and floor and stores nothing."""
    write_report: bool = True
    """Render report.md and report.html next to metrics.json."""
    heatmap_png: Optional[Path] = None
    """A sensitivity heatmap to embed in the reports; None looks for one next to the gate folder."""



def check_golden_limit(golden_limit) -> None:
    """``--golden-limit``: None or a whole number >= 1 (prompts per golden category). UserError if not."""
    from precision_pipeline.core.errors import UserError

    if golden_limit is None:
        return
    if isinstance(golden_limit, bool) or not isinstance(golden_limit, int) or golden_limit < 1:
        raise UserError("--golden-limit", f"{str(golden_limit)[:40]!r} is not a whole number >= 1.",
                        "pass e.g. --golden-limit 1, or leave it out for every golden prompt.")


__all__ = ["GateOptions", "GateRuntime", "REFERENCE_INDEPENDENT", "COMPUTE_DEFAULTS", "DEFAULT_HELDOUT_TOKENS", "DEFAULT_HELDOUT_WINDOW",
           "DEFAULT_GREEDY_NEW_TOKENS", "DEFAULT_GREEDY_BATCH", "DEFAULT_BOOTSTRAP", "check_golden_limit"]
