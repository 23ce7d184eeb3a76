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

import importlib.util
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from precision_pipeline.core.store import atomic_dir, atomic_write_json

ARGS_FILE = "trtllm-build.args.json"
TRTLLM_PIN = "tensorrt_llm>=1.2,<1.3"


def _flag(v: bool) -> str:
    return "enable" if v else "disable"


def build_args(plan: dict, checkpoint_dir: Path, output_dir: Path, workers: int | None = None) -> list[str]:
    """The ``trtllm-build`` argv (without the program name) for ``plan``.

    ``plan`` is plan.json's dict: ``limits`` (max_batch_size, max_input_len, max_seq_len,
    max_num_tokens, max_beam_width: tokens / sequences), ``effective`` (the per-phase plugin
    values after the builder's own overrides) and ``mapping`` (world_size). Every limit is
    passed explicitly, so nothing is left for ``trtllm-build`` to derive silently.
    """
    lim = plan["limits"]
    eff = plan["effective"]
    world = int(plan.get("mapping", {}).get("world_size", 1))
    args = [
        "--checkpoint_dir", str(checkpoint_dir),
        "--output_dir", str(output_dir),
        "--workers", str(workers or world),
        # shapes / limits (tokens, sequences)
        "--max_batch_size", str(lim["max_batch_size"]),
        "--max_input_len", str(lim["max_input_len"]),
        "--max_seq_len", str(lim["max_seq_len"]),
        "--max_num_tokens", str(lim["max_num_tokens"]),
        "--max_beam_width", str(lim.get("max_beam_width", 1)),
        # KV cache (both phases)
        "--kv_cache_type", str(eff.get("kv_cache_type", "paged")),
        "--tokens_per_block", str(eff.get("tokens_per_block", 32)),
        # logits
        "--logits_dtype", str(eff.get("logits_dtype", "float32")),
        # GEMMs (both phases)
        "--gemm_plugin", str(eff.get("gemm_plugin") or "disable"),
        # context phase (prefill) attention
        "--context_fmha", _flag(bool(eff.get("context_fmha", True))),
        "--use_paged_context_fmha", _flag(bool(eff.get("use_paged_context_fmha", True))),
        "--use_fp8_context_fmha", _flag(bool(eff.get("use_fp8_context_fmha", False))),
        # generation phase (decode) attention
        "--gpt_attention_plugin", str(eff.get("gpt_attention_plugin") or "auto"),
        "--remove_input_padding", "enable",
    ]
    if eff.get("gather_context_logits"):
        args.append("--gather_context_logits")
    return args


def per_phase_summary(plan: dict) -> dict[str, Any]:
    """The plan's engine settings grouped by phase (for args.json and the README)."""
    eff = plan["effective"]
    return {
        "context_phase": {k: eff.get(k) for k in ("context_fmha", "use_paged_context_fmha", "use_fp8_context_fmha", "enable_chunked_context")},
        "generation_phase": {k: eff.get(k) for k in ("gpt_attention_plugin", "multi_block_mode")},
        "both_phases": {k: eff.get(k) for k in ("gemm_plugin", "kv_cache_type", "tokens_per_block", "logits_dtype")},
        "limits": plan["limits"],
    }


@dataclass
class Toolchain:
    """What this machine offers for building: whether ``tensorrt_llm`` imports, the GPUs' SMs."""

    tensorrt_llm: bool
    trtllm_build: str | None
    gpu_sms: list[int] = field(default_factory=list)

    def reason_not_buildable(self, sm: int) -> str | None:
        """Why an engine for compute capability ``sm`` (e.g. 90) cannot be built here, or None."""
        if not self.tensorrt_llm:
            return "tensorrt_llm is not installed (NVIDIA's package index only; build on a GPU node with TensorRT-LLM 1.2)"
        if self.trtllm_build is None:
            return "the trtllm-build command is not on PATH"
        if not self.gpu_sms:
            return "no NVIDIA GPU is visible (nvidia-smi found none)"
        if sm not in self.gpu_sms:
            return f"the profile targets SM {sm} but this node has SM {sorted(set(self.gpu_sms))}"
        return None


def detect_toolchain() -> Toolchain:
    """Probe for ``tensorrt_llm`` and GPUs without importing torch (``nvidia-smi``)."""
    has_trtllm = importlib.util.find_spec("tensorrt_llm") is not None
    sms: list[int] = []
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20).stdout
            for line in out.split():
                major, _, minor = line.strip().partition(".")
                if major.isdigit():
                    sms.append(int(major) * 10 + int(minor or 0))
        except (OSError, subprocess.SubprocessError):
            sms = []
    return Toolchain(has_trtllm, shutil.which("trtllm-build"), sms)


@dataclass
class EngineResult:
    """Outcome of the engine stage: ``status`` is done / skipped / failed."""

    status: str
    reason: str
    argv: list[str]
    seconds: float
    engine_dir: Path


def run_engine(plan: dict, checkpoint_dir: Path, engine_dir: Path, toolchain: Toolchain | None = None,
               container_engine_dir: str | None = None) -> EngineResult:
    """Write ``engine/trtllm-build.args.json``; run ``trtllm-build`` when possible.

    The args file holds ``argv``, the shell ``command`` and the per-phase summary. When the
    build cannot run here (see ``Toolchain.reason_not_buildable``) the stage is ``skipped``
    and ``engine_dir`` holds only the args file and ``ENGINE_ABSENT`` with the reason.
    A failed ``trtllm-build`` leaves the previous engine directory untouched (atomic swap).
    """
    toolchain = toolchain or detect_toolchain()
    sm = int(plan["gpu"]["sm"])
    t0 = time.perf_counter()
    engine_dir = Path(engine_dir)
    reason = toolchain.reason_not_buildable(sm)
    with atomic_dir(engine_dir) as tmp:
        argv = build_args(plan, Path(checkpoint_dir).resolve(), tmp if reason is None else engine_dir.resolve())
        record = {
            "program": "trtllm-build",
            "requires": TRTLLM_PIN,
            "argv": argv,
            "command": "trtllm-build " + " ".join(shlex.quote(a) for a in argv),
            "per_phase": per_phase_summary(plan),
            "status": "skipped" if reason else "run",
            "reason": reason,
        }
        if reason is None:
            proc = subprocess.run([toolchain.trtllm_build or "trtllm-build", *argv], capture_output=True, text=True)
            (tmp / "trtllm-build.log").write_text(proc.stdout + proc.stderr)
            if proc.returncode != 0:
                raise RuntimeError(f"trtllm-build exited with {proc.returncode}; see the log:\n{proc.stderr[-2000:]}")
            record["argv"] = build_args(plan, Path(checkpoint_dir).resolve(), engine_dir.resolve())
            record["command"] = "trtllm-build " + " ".join(shlex.quote(a) for a in record["argv"])
        else:
            (tmp / "ENGINE_ABSENT").write_text(f"No engine was built: {reason}.\n")
        atomic_write_json(tmp / ARGS_FILE, record)
    return EngineResult("done" if reason is None else "skipped", reason or "", record["argv"],
                        time.perf_counter() - t0, engine_dir)
