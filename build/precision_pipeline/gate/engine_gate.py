"""The engine gate: the golden set against a built TensorRT-LLM engine, on a GPU node.

The CPU gate (``build/precision_pipeline/gate/checkpoint_gate.py``) scores the *checkpoint* (dequantized weights, fake-quantized
activations and KV cache in PyTorch). It cannot see the engine's own kernels: FP8 context FMHA
(Q, K, V and the softmax output quantized inside attention), the GEMM plugins' accumulation
order and tactics, fused kernels, paged/chunked context. This module runs the same golden
prompts, the same held-out windows and the same metric code (``gate.run_gate`` with an
``EngineCandidate``, the same ``GateOptions``) against the engine itself:

* teacher-forced logits: the engine's **context logits** of the full formatted conversation.
  The engine must be built with ``--gather_context_logits`` (profile: ``build.gather_context_logits:
  true``); ``ModelRunnerCpp.generate(..., max_new_tokens=1)`` then returns
  ``outputs["context_logits"]`` (``[batch, max_input_len, vocab_padded]``, padded per request);
* greedy generations: ``generate(..., max_new_tokens=N, top_k=1, end_id=<|im_end|>)``, several
  prompts per call;
* the reference is the same FP32 HF folder on the CPU (cached, shared with the CPU gate).

TensorRT-LLM 1.2 API used (``tensorrt_llm.runtime``): ``ModelRunnerCpp.from_dir(engine_dir=...,
rank=..., max_output_len=...)`` (falls back to the Python-session ``ModelRunner.from_dir`` when the
C++ runner is missing), ``runner.gather_context_logits``, ``runner.generate(batch_input_ids:
list[IntTensor], max_new_tokens=..., end_id=..., pad_id=..., top_k=1, temperature=1.0,
output_sequence_lengths=True, return_dict=True)`` -> dict with ``output_ids``
``[batch, beams, max_seq]``, ``sequence_lengths`` ``[batch, beams]`` and ``context_logits``.
Engines with tp/pp > 1 are launched under ``mpirun -n <world_size>``; rank 0 scores and writes,
the other ranks only host their shards.

Where ``tensorrt_llm`` does not import or no CUDA device is visible (every CPU machine),
``run_engine_gate`` returns an ``EngineGateSkipped`` ("skipped: needs tensorrt_llm and a GPU")
and writes ``metrics.json`` with ``"status": "skipped"``; with ``strict=True`` it raises
``StrictSkip`` (exit 4). Not run in this repository's CI (no GPU); the golden-set plumbing and the
metric code it calls are the tested ``gate.py`` ones.

How the engine gate gets context logits (decision). Shipped profiles do not gather them: with
``--gather_context_logits`` the engine keeps a ``[max_num_tokens, vocab]`` logits buffer (for the
default model at FP32: 8192 x 49152 x 4 B = 1.5 GiB per GPU, reserved by the memory plan, see
``resolve/rules.activation_bytes``) for every request in production. So the engine gate uses a
**second, gate-only build of the same checkpoint** (``gate_build_args``: the served argv plus
``--gather_context_logits`` and its own ``--output_dir``, ``<out>/engine_gate/engine``), built by the
same toolchain on the same node right after the served engine and never packed. Everything that
decides the numbers (GEMM format, KV format, context/generation attention plugins, limits) is the
same argv, so the kernels scored are the served kernels; the one difference is the logits output
copy. Cost: a second ``trtllm-build`` (about the served build's time; minutes for 8B models) and
its disk, on the build node only. Rejected: generation log-probs (``output_log_probs``) give only
the sampled token's probability, not the full distribution the KL / top-1 metrics need; gathering
in the served engine costs the buffer above in production. A profile with
``build.gather_context_logits: true`` is gated on its served engine directly. Status: the gate-only
argv and this runner exist; the build does not yet run it (it reports the engine gate "skipped"
until a GPU node can exercise it).

CLI: ``python -m precision_pipeline.gate.engine_gate --engine-dir E --model-dir M --profile fp8-h100 --out-dir D``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from precision_pipeline.core.errors import PipelineError, StrictSkip, UserError
from precision_pipeline.core.store import atomic_write_json
from precision_pipeline.gate.options import GateOptions, GateRuntime
from precision_pipeline.spec.profile import GateThresholds

SKIP_REASON = "skipped: needs tensorrt_llm and a GPU"


@dataclass
class EngineGateSkipped:
    """The engine gate could not run here (no tensorrt_llm or no CUDA device)."""

    reason: str
    status: str = "skipped"
    passed: Optional[bool] = None

    def failed_metrics(self) -> list[str]:
        return []

    def summary(self) -> dict[str, Any]:
        return {"status": self.status, "reason": self.reason}


def engine_available() -> tuple[bool, str]:
    """(True, "") when tensorrt_llm imports and a CUDA device is visible; else (False, why)."""
    if importlib.util.find_spec("tensorrt_llm") is None:
        return False, f"{SKIP_REASON} (tensorrt_llm is not installed)"
    try:
        import torch

        if not torch.cuda.is_available():
            return False, f"{SKIP_REASON} (no CUDA device visible)"
    except Exception as e:  # pragma: no cover
        return False, f"{SKIP_REASON} (torch.cuda failed: {e})"
    try:
        import tensorrt_llm  # noqa: F401
    except Exception as e:  # ImportError, missing libs, CUDA driver mismatch
        return False, f"{SKIP_REASON} (import tensorrt_llm failed: {type(e).__name__}: {e})"
    return True, ""


def _engine_config(engine_dir: Path) -> dict:
    p = Path(engine_dir) / "config.json"
    if not p.is_file():
        raise UserError("--engine-dir", f"{engine_dir} has no config.json; it is not a TensorRT-LLM engine folder.",
                        "pass the folder trtllm-build wrote (config.json + rank*.engine).")
    return json.loads(p.read_text())


def _gathers_context_logits(cfg: dict) -> Optional[bool]:
    bc = cfg.get("build_config", {}) or {}
    if "gather_context_logits" in bc:
        return bool(bc["gather_context_logits"])
    if "gather_all_token_logits" in bc:
        return bool(bc["gather_all_token_logits"])
    return None


class EngineCandidate:
    """The ``gate.Candidate`` protocol on top of a TensorRT-LLM runner (rank 0 of the engine)."""

    def __init__(self, engine_dir: Path, max_new_tokens: int = 64, rank: int = 0, name: str = ""):
        import torch
        from tensorrt_llm import runtime as trt_rt

        self.torch = torch
        self.name = name or f"engine {Path(engine_dir).name}"
        runner_cls = getattr(trt_rt, "ModelRunnerCpp", None)
        kwargs: dict[str, Any] = {"engine_dir": str(engine_dir), "rank": rank}
        if runner_cls is not None:
            kwargs["max_output_len"] = max(1, max_new_tokens)
        else:  # pragma: no cover - python session only
            runner_cls = trt_rt.ModelRunner
        self.runner = runner_cls.from_dir(**kwargs)
        if not getattr(self.runner, "gather_context_logits", False):
            raise UserError("engine", f"{engine_dir} was built without --gather_context_logits.",
                            "set build.gather_context_logits: true in the profile and rebuild the engine.")

    def _generate(self, ids: Sequence[int], max_new_tokens: int, stop_id: int) -> dict:
        t = self.torch
        with t.inference_mode():
            out = self.runner.generate([t.tensor(list(ids), dtype=t.int32)], max_new_tokens=max_new_tokens,
                                       end_id=stop_id, pad_id=stop_id, top_k=1, top_p=0.0, temperature=1.0,
                                       num_beams=1, output_sequence_lengths=True, return_dict=True)
        if t.cuda.is_available():
            t.cuda.synchronize()
        return out

    def logits(self, ids: Sequence[int]) -> Any:
        out = self._generate(ids, 1, stop_id=0)
        cl = out["context_logits"]
        if isinstance(cl, (list, tuple)):
            cl = cl[0]
        elif cl.dim() == 3:
            cl = cl[0]
        cl = cl[: len(ids)]
        if cl.shape[0] != len(ids):
            raise RuntimeError(f"engine returned {cl.shape[0]} context-logit rows for {len(ids)} tokens")
        return cl.detach().float().cpu()

    def greedy(self, ids: Sequence[int], max_new_tokens: int, stop_id: int) -> list[int]:
        return self.greedy_batch([ids], max_new_tokens, stop_id)[0]

    def greedy_batch(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop_id: int) -> list[list[int]]:
        """Several prompts in one ``generate`` call (in-flight batching; no padding involved)."""
        t = self.torch
        with t.inference_mode():
            out = self.runner.generate([t.tensor(list(p), dtype=t.int32) for p in prompts],
                                       max_new_tokens=max_new_tokens, end_id=stop_id, pad_id=stop_id, top_k=1,
                                       top_p=0.0, temperature=1.0, num_beams=1, output_sequence_lengths=True,
                                       return_dict=True)
        res = []
        for i, p in enumerate(prompts):
            seq_len = int(out["sequence_lengths"][i][0])
            toks = out["output_ids"][i][0][len(p):seq_len].tolist()
            if stop_id in toks:
                toks = toks[: toks.index(stop_id) + 1]
            res.append(toks)
        return res


GATE_ENGINE_DIR = "engine_gate/engine"
"""Where the gate-only engine is built, relative to the build output (never packed)."""


def gate_build_args(served_argv: list[str], gate_engine_dir: Path) -> list[str]:
    """The argv of the gate-only build: ``served_argv`` (trtllm-build's, without the program) with its
    ``--output_dir`` replaced by ``gate_engine_dir`` and ``--gather_context_logits`` added (once)."""
    argv = list(served_argv)
    if "--output_dir" in argv:
        i = argv.index("--output_dir")
        argv[i + 1] = str(gate_engine_dir)
    else:
        argv += ["--output_dir", str(gate_engine_dir)]
    if "--gather_context_logits" not in argv:
        argv.append("--gather_context_logits")
    return argv


def run_engine_gate(engine_dir: Path, reference_model_dir: Path, thresholds: GateThresholds, out_dir: Path,
                    options: GateOptions = GateOptions(), runtime: GateRuntime = GateRuntime(), *,
                    strict: bool = False):
    """Run the golden set against a built engine; a ``gate.GateResult`` or ``EngineGateSkipped``.

    ``options`` / ``runtime``: as for ``checkpoint_gate.run_gate``; ``options.heldout_window`` is
    lowered to the engine's ``max_input_len`` and ``options.greedy_batch`` to its ``max_batch_size``. ``out_dir`` is the engine gate's folder (e.g.
    ``artifacts/<profile>/engine_gate``). Raises ``StrictSkip`` (exit 4) instead of skipping when ``strict``.
    """
    ok, why = engine_available()
    out_dir = Path(out_dir)
    if not ok:
        if strict:
            raise StrictSkip(f"engine gate {why}")
        atomic_write_json(out_dir / "metrics.json", {"status": "skipped", "reason": why, "passed": None,
                                                    "engine_dir": str(engine_dir), "time": time.time()})
        return EngineGateSkipped(why)
    cfg = _engine_config(engine_dir)
    if _gathers_context_logits(cfg) is False:
        raise UserError("engine", f"{engine_dir} was built without gather_context_logits.",
                        "set build.gather_context_logits: true in the profile and rebuild the engine.")
    from precision_pipeline.gate import checkpoint_gate as gate

    try:
        from tensorrt_llm._utils import mpi_barrier, mpi_rank  # type: ignore
    except Exception:  # pragma: no cover
        mpi_rank, mpi_barrier = (lambda: 0), (lambda: None)
    rank = mpi_rank()
    cand = EngineCandidate(Path(engine_dir), max_new_tokens=options.greedy_new_tokens, rank=rank)
    if rank != 0:  # the other ranks host their shards; rank 0 enqueues requests and scores
        mpi_barrier()
        return EngineGateSkipped(f"rank {rank}: scoring happens on rank 0", status="worker")
    bc = cfg.get("build_config", {}) or {}
    max_in, max_bs = bc.get("max_input_len"), bc.get("max_batch_size")
    options = options.model_copy(update={"heldout_window": min(options.heldout_window, int(max_in or options.heldout_window)),
                                         "greedy_batch": min(options.greedy_batch, int(max_bs or options.greedy_batch))})
    extra = {"engine_dir": str(engine_dir), "engine_build_config": cfg.get("build_config", {}),
             "gate_kind": "engine"}
    try:
        res = gate.run_gate(cand, Path(reference_model_dir), thresholds, out_dir, options, runtime, extra=extra)
    finally:
        mpi_barrier()
    return res


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m precision_pipeline.gate.engine_gate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine-dir", required=True, type=Path)
    ap.add_argument("--model-dir", type=Path, default=None, help="FP32 reference HF folder (default: the default model)")
    ap.add_argument("--profile", required=True, help="profile whose gate thresholds apply")
    ap.add_argument("--out-dir", required=True, type=Path)
    ap.add_argument("--golden-limit", type=int, default=None)
    ap.add_argument("--strict", action="store_true")
    a = ap.parse_args(argv)
    from precision_pipeline.spec.default_model import default_model_dir
    from precision_pipeline.spec.profile import load_profile

    try:
        model_dir = a.model_dir or default_model_dir()
        thr = load_profile(a.profile).gate.for_model_dir(model_dir)
        res = run_engine_gate(a.engine_dir, model_dir, thr, a.out_dir, GateOptions(prompts_per_category=a.golden_limit),
                              strict=a.strict)
    except PipelineError as e:
        print(str(e), file=sys.stderr)
        return e.exit_code
    if isinstance(res, EngineGateSkipped):
        print(res.reason)
        return 0
    print(f"engine gate {'passed' if res.passed else 'FAILED'}; see {res.report_md}")
    if not res.passed:
        return 3
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
