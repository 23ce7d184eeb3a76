"""Engine stage: the exact ``trtllm-build`` command line for a plan, run only where it can run.

``trtllm-build`` (TensorRT-LLM 1.2, ``tensorrt_llm/commands/build.py``) needs the
``tensorrt_llm`` package (only on NVIDIA's own package index) and a CUDA GPU even to start
(workers = min(torch.cuda.device_count(), --workers)). Everywhere else this stage writes the
command line to ``engine/trtllm-build.args.json`` and reports ``skipped`` with the reason.
It never writes a fake engine.

Flag facts (names, choices, defaults) come from ``shared/reference/trtllm-1.2-build-reference.md``
sections 1-3 (``commands/build.py``, ``plugin/plugin.py``, ``builder.py``):

* context phase (prefill): ``--context_fmha``, ``--use_paged_context_fmha``,
  ``--use_fp8_context_fmha`` (plugin flags, enable/disable);
* generation phase (decode): ``--gpt_attention_plugin`` (XQA/MMHA kernels);
  ``multi_block_mode`` is a runtime knob in 1.x, not a build flag, so it is passed to the
  serving config instead;
* both phases: ``--gemm_plugin``, ``--kv_cache_type``, ``--tokens_per_block``,
  ``--max_num_tokens``, ``--logits_dtype``.
"""

from __future__ import annotations

import shlex
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from precision_pipeline.core.store import atomic_dir, atomic_write_json
from precision_pipeline.engine.toolchain import Toolchain, detect_toolchain
from precision_pipeline.resolve.plan import Effective, Limits, Mapping

ARGS_FILE = "trtllm-build.args.json"
TRTLLM_PIN = "tensorrt_llm>=1.2,<1.3"


def _flag(v: bool) -> str:
    return "enable" if v else "disable"


class EnginePlan(Protocol):
    """What the command line is made of: a ``ResolvedPlan`` or the engine stage's inputs."""

    mapping: Mapping
    limits: Limits
    effective: Effective


def build_args(plan: EnginePlan, checkpoint_dir: Path, output_dir: Path, workers: int | None = None) -> list[str]:
    """The ``trtllm-build`` argv (without the program name) for ``plan``.

    ``plan.limits`` (max_batch_size, max_input_len, max_seq_len, max_num_tokens, max_beam_width:
    tokens / sequences), ``plan.effective`` (the per-phase plugin values after the builder's own
    overrides, gather_context_logits included) and ``plan.mapping.world_size``: the argv is a
    function of these effective values only, never of the profile's requested ones. Every limit is passed explicitly, so nothing is
    left for ``trtllm-build`` to derive silently; every value is a typed plan field (no defaults here).
    """
    lim, eff = plan.limits, plan.effective
    args = [
        "--checkpoint_dir", str(checkpoint_dir),
        "--output_dir", str(output_dir),
        "--workers", str(workers or plan.mapping.world_size),
        # shapes / limits (tokens, sequences)
        "--max_batch_size", str(lim.max_batch_size),
        "--max_input_len", str(lim.max_input_len),
        "--max_seq_len", str(lim.max_seq_len),
        "--max_num_tokens", str(lim.max_num_tokens),
        "--max_beam_width", str(lim.max_beam_width),
        # KV cache (both phases)
        "--kv_cache_type", str(eff.kv_cache_type),
        "--tokens_per_block", str(eff.tokens_per_block),
        # logits
        "--logits_dtype", str(eff.logits_dtype),
        # GEMMs (both phases)
        "--gemm_plugin", str(eff.gemm_plugin or "disable"),
        # context phase (prefill) attention
        "--context_fmha", _flag(eff.context_fmha),
        "--use_paged_context_fmha", _flag(eff.use_paged_context_fmha),
        "--use_fp8_context_fmha", _flag(eff.use_fp8_context_fmha),
        # generation phase (decode) attention
        "--gpt_attention_plugin", str(eff.gpt_attention_plugin or "auto"),
        "--remove_input_padding", "enable",
    ]
    if eff.gather_context_logits:
        args.append("--gather_context_logits")
    return args


def per_phase_summary(plan: EnginePlan) -> dict[str, Any]:
    """The plan's engine settings grouped by phase (for args.json and the README)."""
    eff = plan.effective
    return {
        "context_phase": {k: getattr(eff, k) for k in ("context_fmha", "use_paged_context_fmha", "use_fp8_context_fmha", "enable_chunked_context")},
        "generation_phase": {k: getattr(eff, k) for k in ("gpt_attention_plugin", "multi_block_mode")},
        "both_phases": {k: getattr(eff, k) for k in ("gemm_plugin", "kv_cache_type", "tokens_per_block", "logits_dtype")},
        "limits": plan.limits.model_dump(mode="json"),
    }


@dataclass
class EngineResult:
    """Outcome of the engine stage: ``status`` is done / skipped / failed."""

    status: str
    reason: str
    argv: list[str]
    seconds: float
    engine_dir: Path


def run_engine(plan: EnginePlan, checkpoint_dir: Path, engine_dir: Path, sm: int, toolchain: Toolchain | None = None,
               workdir: Path | None = None) -> EngineResult:
    """Write ``engine/trtllm-build.args.json``; run ``trtllm-build`` when possible.

    ``sm``: the target GPU's compute capability (e.g. 90). The args file holds ``argv``, the shell
    ``command`` and the per-phase summary, with ``engine_dir`` as the output folder. When the
    build cannot run here (see ``Toolchain.reason_not_buildable``) the stage is ``skipped`` and
    ``engine_dir`` holds only the args file and ``ENGINE_ABSENT`` with the reason. ``workdir``:
    write there instead (the stage runner renames it onto ``engine_dir``); without it the
    folder is replaced atomically here. A failed ``trtllm-build`` raises RuntimeError and leaves
    the previous engine directory untouched.
    """
    toolchain = toolchain or detect_toolchain()
    if workdir is None:
        with atomic_dir(engine_dir) as tmp:
            return run_engine(plan, checkpoint_dir, engine_dir, sm, toolchain, workdir=tmp)
    t0 = time.perf_counter()
    engine_dir, tmp = Path(engine_dir), Path(workdir)
    reason = toolchain.reason_not_buildable(int(sm))
    final_argv = build_args(plan, Path(checkpoint_dir).resolve(), engine_dir.resolve())
    record = {
        "program": "trtllm-build",
        "requires": TRTLLM_PIN,
        "argv": final_argv,
        "command": "trtllm-build " + " ".join(shlex.quote(a) for a in final_argv),
        "per_phase": per_phase_summary(plan),
        "status": "skipped" if reason else "run",
        "reason": reason,
    }
    if reason is None:
        argv = build_args(plan, Path(checkpoint_dir).resolve(), tmp.resolve())
        proc = subprocess.run([toolchain.trtllm_build or "trtllm-build", *argv], capture_output=True, text=True)
        (tmp / "trtllm-build.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise RuntimeError(f"trtllm-build exited with {proc.returncode}; see the log:\n{proc.stderr[-2000:]}")
    else:
        (tmp / "ENGINE_ABSENT").write_text(f"No engine was built: {reason}.\n")
    atomic_write_json(tmp / ARGS_FILE, record)
    return EngineResult("done" if reason is None else "skipped", reason or "", record["argv"],
                        time.perf_counter() - t0, engine_dir)


__all__ = ["ARGS_FILE", "TRTLLM_PIN", "EnginePlan", "build_args", "per_phase_summary", "EngineResult", "run_engine",
           "Toolchain", "detect_toolchain"]
