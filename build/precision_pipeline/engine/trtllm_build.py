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

import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from precision_pipeline.core.errors import EngineBuildFailed, UserError
from precision_pipeline.core.progress import fmt_duration
from precision_pipeline.core.store import atomic_dir, atomic_write_json
from precision_pipeline.engine.preflight import preflight
from precision_pipeline.engine.provenance import verify_engine_dir, write_provenance
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
    """Outcome of the engine stage: ``status`` is done / skipped / failed; ``warnings`` from preflight."""

    status: str
    reason: str
    argv: list[str]
    seconds: float
    engine_dir: Path
    warnings: list[str] = field(default_factory=list)


TIMEOUT_ENV = "PRECISION_ENGINE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 4 * 3600
"""Wall-clock limit of one ``trtllm-build`` run (environment ``PRECISION_ENGINE_TIMEOUT_S`` overrides)."""
LOG_NAME = "trtllm-build.log"
LOG_DIR = "logs"
"""The build log is ``<out>/logs/trtllm-build.log`` (beside the engine folder, so it survives a failed build)."""
PROGRESS_EVERY_S = 10.0

PHASES: tuple[tuple[str, re.Pattern], ...] = (
    # (phase, pattern on a log line); the last matching line wins. Heuristic: trtllm-build 1.2 logs
    # through tensorrt_llm.logger ("[TRT-LLM] [I] ...") and TensorRT's logger ("[TRT] [I] ...").
    ("loading checkpoint", re.compile(r"(?i)load(ing)?\b.*(checkpoint|weights)")),
    ("building network", re.compile(r"(?i)(build(ing)? (the )?(tensorrt )?(engine|network)|set (dtype|plugin))")),
    ("optimizing (TensorRT tactics)", re.compile(r"(?i)(tactic|timing cache|\[TRT\].*(optimi[sz]|layer))")),
    ("serializing engine", re.compile(r"(?i)serializ")),
    ("done", re.compile(r"(?i)(total time of building|engine generation completed|build.*finished)")),
)
MEANINGFUL = re.compile(r"(?i)(error|exception|traceback|failed|assert|out of memory|killed|\[E\])")


def phase_of(lines: list[str], current: str = "starting") -> str:
    """The build phase the newest matching log line says (``current`` when none matches)."""
    for line in lines:
        for name, pat in PHASES:
            if pat.search(line):
                current = name
    return current


def meaningful_tail(text: str, n: int = 12) -> list[str]:
    """The last ``n`` log lines worth showing: error lines (and what follows the last one) first choice,
    else the last non-empty lines; progress-bar and blank lines dropped."""
    lines = [ln.rstrip() for ln in text.replace("\r", "\n").splitlines() if ln.strip() and not set(ln.strip()) <= set("=-#.|")]
    hits = [i for i, ln in enumerate(lines) if MEANINGFUL.search(ln)]
    if hits:
        first = max(0, hits[-1] - n + 1) if len(lines) - hits[-1] < n else hits[-1]
        lines = lines[first:]
    return lines[-n:]


def _timeout_s() -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return float(DEFAULT_TIMEOUT_S)
    try:
        v = float(raw)
    except ValueError:
        v = -1.0
    if not v > 0:
        raise UserError(TIMEOUT_ENV, f"{raw[:40]!r} is not a positive number of seconds.", f"e.g. {TIMEOUT_ENV}=14400, or unset it.")
    return v


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_trtllm_build(program: str, argv: list[str], log_path: Path, *, timeout_s: float,
                     on_progress: Callable[[str], None] = _say, every_s: float = PROGRESS_EVERY_S) -> float:
    """Run ``program argv`` with its output in ``log_path``; a progress line (elapsed, phase) every ``every_s``.

    Returns the seconds it took. Raises ``EngineBuildFailed`` (exit 5) on a non-zero exit or after
    ``timeout_s`` (the whole process group is killed), with the log's last meaningful lines and its path.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    phase, last = "starting", t0
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([program, *argv], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            with open(log_path, "rb") as reader:
                while True:
                    try:
                        rc = proc.wait(timeout=min(1.0, every_s))
                    except subprocess.TimeoutExpired:
                        rc = None
                    new = reader.read().decode("utf-8", "replace").splitlines()
                    phase = phase_of(new, phase)
                    now = time.monotonic()
                    if rc is not None:
                        break
                    if now - t0 > timeout_s:
                        _kill_group(proc)
                        raise _failure(f"trtllm-build ran past its time limit of {fmt_duration(timeout_s)} "
                                       f"(phase: {phase}) and was stopped", log_path)
                    if now - last >= every_s:
                        last = now
                        on_progress(f"[engine] trtllm-build: {phase} ({fmt_duration(now - t0)})")
        except BaseException:
            if proc.poll() is None:
                _kill_group(proc)
            raise
    if rc != 0:
        raise _failure(f"trtllm-build exited with status {rc} after {fmt_duration(time.monotonic() - t0)} (phase: {phase})",
                       log_path)
    return time.monotonic() - t0


def _kill_group(proc: subprocess.Popen) -> None:
    import signal

    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def _failure(what: str, log_path: Path) -> EngineBuildFailed:
    try:
        tail = meaningful_tail(log_path.read_text(errors="replace"))
    except OSError:
        tail = []
    body = "\n".join(f"    {ln[:300]}" for ln in tail) or "    (the log is empty)"
    return EngineBuildFailed(f"{what}; the previous engine (if any) is intact.\n  last log lines:\n{body}\n"
                             f"  full log: {log_path}")


def run_engine(plan: EnginePlan, checkpoint_dir: Path, engine_dir: Path, sm: int, toolchain: Toolchain | None = None,
               workdir: Path | None = None, *, checkpoint_key: str = "", gpu_name: str = "", need_bytes: int = 0,
               strict: bool = False, on_progress: Callable[[str], None] = _say) -> EngineResult:
    """Write ``engine/trtllm-build.args.json``; run ``trtllm-build`` when possible.

    ``sm``: the target GPU's compute capability (e.g. 90). The args file holds ``argv``, the shell
    ``command`` and the per-phase summary, with ``engine_dir`` as the output folder. When the
    build cannot run here (see ``Toolchain.reason_not_buildable``; no tensorrt_llm, no trtllm-build,
    no GPU) the stage is ``skipped`` and ``engine_dir`` holds only the args file and
    ``ENGINE_ABSENT`` with the reason. On a build node, ``preflight.preflight`` runs first
    (``gpu_name``, ``need_bytes``: the plan's GPU and per-GPU bytes; ``strict``: refuse unknown
    flags); a refusal is a UserError (exit 2). Then ``trtllm-build`` runs with its log in
    ``<engine_dir>/../logs/trtllm-build.log``, a progress line every few seconds and the limit
    ``PRECISION_ENGINE_TIMEOUT_S``; a failure or time-out raises ``EngineBuildFailed`` (exit 5). After
    a successful build ``provenance.json`` is written (``engine/provenance.py``; ``checkpoint_key``:
    the quantize stage's key). ``workdir``: write there instead (the stage runner renames it onto
    ``engine_dir``); without it the folder is replaced atomically here. On any error the previous
    engine directory is left untouched.
    """
    toolchain = toolchain or detect_toolchain()
    if workdir is None:
        with atomic_dir(engine_dir) as tmp:
            return run_engine(plan, checkpoint_dir, engine_dir, sm, toolchain, workdir=tmp, checkpoint_key=checkpoint_key,
                              gpu_name=gpu_name, need_bytes=need_bytes, strict=strict, on_progress=on_progress)
    t0 = time.perf_counter()
    engine_dir, tmp = Path(engine_dir), Path(workdir)
    final_argv = build_args(plan, Path(checkpoint_dir).resolve(), engine_dir.resolve())
    warnings: list[str] = []
    pre = None
    if toolchain.present():
        pre = preflight(toolchain, sm=int(sm), gpu_name=gpu_name or f"SM {sm}", need_bytes=need_bytes, argv=final_argv,
                        strict=strict)
        warnings = pre.warnings
    reason = toolchain.reason_not_buildable(int(sm))
    record = {
        "program": "trtllm-build",
        "requires": TRTLLM_PIN,
        "argv": final_argv,
        "command": "trtllm-build " + " ".join(shlex.quote(a) for a in final_argv),
        "per_phase": per_phase_summary(plan),
        "status": "skipped" if reason else "run",
        "reason": reason,
    }
    if warnings:
        record["warnings"] = warnings
    if reason is None:
        argv = build_args(plan, Path(checkpoint_dir).resolve(), tmp.resolve())
        program = toolchain.trtllm_build or "trtllm-build"
        log_path = engine_dir.parent / LOG_DIR / LOG_NAME
        for w in warnings:
            on_progress(f"[engine] warning: {w}")
        seconds = run_trtllm_build(program, argv, log_path, timeout_s=_timeout_s(), on_progress=on_progress)
        help_ = pre.help if pre is not None else None
        write_provenance(tmp, toolchain=toolchain, sm=int(sm), world_size=int(plan.mapping.world_size),
                         checkpoint_key=checkpoint_key, argv=["trtllm-build", *argv],
                         help_sha256=help_.sha256 if help_ else "", help_size=help_.size if help_ else 0,
                         log=str(log_path), seconds=seconds)
        try:
            verify_engine_dir(tmp)  # the rank files trtllm-build wrote are the ones the mapping needs
        except UserError as e:
            raise EngineBuildFailed(f"trtllm-build returned 0 but its output is not a complete engine: {e.message}; "
                                    f"the previous engine (if any) is intact. Log: {log_path}")
    else:
        (tmp / "ENGINE_ABSENT").write_text(f"No engine was built: {reason}.\n")
    atomic_write_json(tmp / ARGS_FILE, record)
    return EngineResult("done" if reason is None else "skipped", reason or "", record["argv"],
                        time.perf_counter() - t0, engine_dir, warnings)


__all__ = ["ARGS_FILE", "TRTLLM_PIN", "EnginePlan", "build_args", "per_phase_summary", "EngineResult", "run_engine",
           "run_trtllm_build", "phase_of", "meaningful_tail", "TIMEOUT_ENV", "DEFAULT_TIMEOUT_S", "LOG_DIR", "LOG_NAME",
           "Toolchain", "detect_toolchain"]
