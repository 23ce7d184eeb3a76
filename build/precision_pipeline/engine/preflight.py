"""Preflight of a build node, before any GPU time: the GPUs, the TensorRT-LLM line, the flags.

Run by the build right after resolve (before quantize) and again by the engine stage before it
starts ``trtllm-build`` (the ``--help`` text is read once per process and command file). Only
on a node that *has* a toolchain (``Toolchain.present()``: tensorrt_llm, trtllm-build and a
visible GPU); elsewhere the engine stage is skipped with its reason, as before. Checks:

* ``engine.gpus``: every visible GPU (``CUDA_VISIBLE_DEVICES`` respected, see ``toolchain.visible``)
  is one model: a node that sees two GPU models builds tactics for whichever GPU a worker lands on;
* ``engine.sm``: their SM is the profile's target SM (engines are built per SM:
  ``tensorrt_llm/builder.py``; a plan for SM 90 does not load on SM 89);
* ``engine.memory``: each has at least the plan's per-GPU weights + activation estimate
  (``plan.memory``; the build holds the weights and the builder's workspace);
* ``engine.trtllm_line``: the installed ``tensorrt_llm`` is on ``TRTLLM_PIN`` (1.2.x, the last line
  with ``trtllm-build``; shared/reference/upstream-2026-12.md);
* ``engine.flags``: every flag of the argv appears in this ``trtllm-build --help``. An unknown flag
  is a refusal under ``strict`` and a warning otherwise (argparse would stop the build anyway);
  a help text that cannot be read is a warning (a refusal under ``strict``).

Each refusal is a ``UserError`` (exit 2) with field, reason and fix, raised before anything is
written. Returns ``Preflight`` (warnings, the help text's sha256 and size for the provenance).
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import subprocess
from dataclasses import dataclass, field
from typing import Iterable, Optional

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from precision_pipeline.core.errors import Problem, UserError
from precision_pipeline.engine.toolchain import Toolchain

TRTLLM_SPEC = SpecifierSet(">=1.2,<1.3")
"""The pinned TensorRT-LLM line (same as ``trtllm_build.TRTLLM_PIN``)."""
HELP_TIMEOUT_S = 600  # ``trtllm-build --help`` imports tensorrt_llm (and torch, CUDA): tens of seconds


@dataclass
class HelpText:
    text: str
    sha256: str
    size: int
    error: str = ""


@dataclass
class Preflight:
    """What preflight saw: ``warnings`` (printed and recorded), the ``--help`` text's hash and size."""

    warnings: list[str] = field(default_factory=list)
    help: Optional[HelpText] = None


@functools.lru_cache(maxsize=8)
def _help_cached(path: str, mtime_ns: int, size: int) -> HelpText:
    try:
        p = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=HELP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return HelpText("", "", 0, f"`{path} --help` did not finish in {HELP_TIMEOUT_S} s")
    except OSError as e:
        return HelpText("", "", 0, f"`{path} --help` could not start ({e.strerror or e})")
    text = p.stdout
    data = text.encode()
    err = "" if p.returncode == 0 and text.strip() else f"`{path} --help` exited with {p.returncode}: {p.stderr.strip()[-300:]}"
    return HelpText(text, hashlib.sha256(data).hexdigest(), len(data), err)


def help_text(trtllm_build: str) -> HelpText:
    """``trtllm-build --help`` output (sha256 and size of its bytes); read once per command file."""
    try:
        st = os.stat(trtllm_build)
    except OSError:
        return HelpText("", "", 0, f"{trtllm_build} does not exist")
    return _help_cached(str(trtllm_build), st.st_mtime_ns, st.st_size)


def known_flags(help_out: str) -> set[str]:
    """Every ``--flag`` named in an argparse help text."""
    return set(re.findall(r"(?<![\w-])(--[A-Za-z0-9][\w-]*)", help_out))


def argv_flags(argv: Iterable[str]) -> list[str]:
    return [a for a in argv if a.startswith("--")]


def preflight(toolchain: Toolchain, *, sm: int, gpu_name: str, need_bytes: int, argv: list[str],
              strict: bool = False) -> Preflight:
    """Check the node for a plan (see the module docstring). ``sm``: target compute capability x 10;
    ``gpu_name``: the profile's catalog GPU (for messages); ``need_bytes``: per-GPU bytes the plan needs.
    Raises UserError (exit 2) naming every refused field; returns warnings otherwise."""
    res = Preflight()
    problems: list[Problem] = []
    gpus = list(toolchain.gpus)
    names = sorted({g.name for g in gpus})
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = "; ".join(f"GPU {g.index}: {g.name} (SM {g.sm}, {g.memory_mib} MiB)" for g in gpus)
    if len(names) > 1:
        problems.append(Problem("engine.gpus", f"this node's visible GPUs are not one model ({shown}); trtllm-build "
                                "would tune the engine for whichever GPU a worker lands on.",
                                "restrict CUDA_VISIBLE_DEVICES to GPUs of the target model (e.g. CUDA_VISIBLE_DEVICES="
                                + ",".join(str(g.index) for g in gpus if g.sm == sm) + "), or build on a node with one GPU model.",
                                rule="engine.gpus"))
    wrong = [g for g in gpus if g.sm != sm]
    if wrong:
        problems.append(Problem("target.gpu", f"the profile targets {gpu_name} (SM {sm}) but visible "
                                + "; ".join(f"GPU {g.index} ({g.name}) is SM {g.sm}" for g in wrong)
                                + (f" (CUDA_VISIBLE_DEVICES={vis})" if vis is not None else "") + "; engines are built per SM.",
                                f"build on a node with {gpu_name} GPUs, or choose a profile for this GPU (invoke profiles --gpu ...).",
                                rule="engine.sm"))
    small = [g for g in gpus if g.memory_mib and g.memory_mib * (1 << 20) < need_bytes]
    if small:
        problems.append(Problem("engine.memory", "; ".join(f"GPU {g.index} ({g.name}) has {g.memory_mib} MiB" for g in small)
                                + f" but the plan needs {need_bytes / (1 << 20):.0f} MiB per GPU (weights + activations).",
                                "build on GPUs with more memory, or raise parallel.tp_size.", rule="engine.memory"))
    v = toolchain.tensorrt_llm_version
    try:
        on_line = v is not None and Version(v) in TRTLLM_SPEC
    except InvalidVersion:
        on_line = False
    if not on_line:
        problems.append(Problem("tensorrt_llm", f"the installed TensorRT-LLM is {v or 'of unknown version (no package metadata)'}; "
                                f"this pipeline builds with the {TRTLLM_SPEC} line (the last with trtllm-build).",
                                "use a serving image with TensorRT-LLM 1.2 (e.g. nvcr.io/nvidia/tritonserver:26.05-trtllm-python-py3), "
                                "or pip install 'tensorrt_llm>=1.2,<1.3' from NVIDIA's index.", rule="engine.trtllm_line"))
    if problems:
        raise UserError(problems)
    h = help_text(toolchain.trtllm_build or "trtllm-build")
    res.help = h
    if h.error:
        msg = f"cannot check the trtllm-build flags: {h.error}"
        if strict:
            raise UserError("engine.flags", msg + ".", "fix trtllm-build (run it with --help), or leave out --strict.",
                            rule="engine.flags")
        res.warnings.append(msg)
        return res
    known = known_flags(h.text)
    unknown = [f for f in argv_flags(argv) if f not in known]
    if unknown:
        msg = (f"trtllm-build {v} does not list {', '.join(unknown)} in its --help; argparse will refuse them")
        if strict:
            raise UserError("engine.flags", msg + ".", "build with the TensorRT-LLM 1.2 line this pipeline targets "
                            "(shared/reference/trtllm-1.2-build-reference.md), or leave out --strict.", rule="engine.flags")
        res.warnings.append(msg)
    return res


def plan_need_bytes(plan) -> int:
    """Per-GPU bytes the plan needs to build and load: weights + activation estimate (``plan.memory``); 0 without a memory plan."""
    mem = getattr(plan, "memory", None)
    return int(mem.weight_bytes_per_gpu + mem.activation_bytes_estimate) if mem is not None else 0


__all__ = ["TRTLLM_SPEC", "Preflight", "HelpText", "help_text", "known_flags", "preflight", "plan_need_bytes"]
