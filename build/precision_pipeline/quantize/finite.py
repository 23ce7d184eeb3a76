"""Non-finite weights refused before quantization (one home; used by ``ptq`` and ``search``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from precision_pipeline.core.errors import UserError


def refuse_non_finite(model: Any, model_dir: Path) -> None:
    """UserError (field ``--model``, exit 2) naming the first parameters holding NaN or infinity, before any
    calibration: ModelOpt would otherwise stop on an assertion deep in its calibrators (a traceback), and a
    non-finite weight has no scale. One pass over the loaded weights (``torch.isfinite``)."""
    import torch

    bad = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not bool(torch.isfinite(p).all()):
                n_nan, n_inf = int(torch.isnan(p).sum()), int(torch.isinf(p).sum())
                bad.append(f"{name} ({n_nan:,} NaN, {n_inf:,} infinite of {p.numel():,})")
                if len(bad) >= 5:
                    break
    if bad:
        raise UserError("--model", f"{model_dir} has non-finite weights: {'; '.join(bad)}"
                        f"{' (first 5 shown)' if len(bad) >= 5 else ''}; they cannot be quantized.",
                        "use an intact copy of the model (a download or conversion went wrong).")


__all__ = ["refuse_non_finite"]
