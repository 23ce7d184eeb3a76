"""Test doubles of the GPU-only tools (they live only under tests/): a stand-in ``trtllm-build``,
a fake ``nvidia-smi`` and a ``tensorrt_llm`` package that is only metadata.

``install(tmp_path, monkeypatch, gpus=..., version=..., mode=...)`` puts them on PATH / sys.path.

* ``trtllm-build``: ``--help`` prints an argparse-like help listing ``HELP_FLAGS`` (minus
  ``FAKE_TRTLLM_HELP_DROP``); otherwise it appends its argv to ``FAKE_TRTLLM_CALLS``, logs a few
  phase lines and, by ``FAKE_TRTLLM_MODE``: ``ok`` writes ``config.json`` (``version`` =
  ``FAKE_TRTLLM_VERSION``, the build_config limits of its argv, the mapping of ``--workers``) and
  ``rank<i>.engine`` for each worker; ``fail`` logs an error and exits 1; ``hang`` sleeps;
  ``missing-rank`` writes only rank0 of a multi-rank engine.
* ``nvidia-smi``: ``FAKE_GPUS`` = ``name|cap|MiB;...`` (empty: no GPU) in the query's CSV form; plain
  ``nvidia-smi`` prints a header with ``CUDA Version: 12.9``.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

H100 = "NVIDIA H100 80GB HBM3|9.0|81559"
A100 = "NVIDIA A100-SXM4-80GB|8.0|81920"
L4 = "NVIDIA L4|8.9|23034"

HELP_FLAGS = ("--checkpoint_dir", "--output_dir", "--workers", "--max_batch_size", "--max_input_len", "--max_seq_len",
              "--max_num_tokens", "--max_beam_width", "--kv_cache_type", "--tokens_per_block", "--logits_dtype",
              "--gemm_plugin", "--context_fmha", "--use_paged_context_fmha", "--use_fp8_context_fmha",
              "--gpt_attention_plugin", "--remove_input_padding", "--gather_context_logits", "--log_level")

TRTLLM_BUILD = r'''#!/usr/bin/env python3
"""Test double for trtllm-build (tests/engine/doubles.py)."""
import json, os, sys, time
argv = sys.argv[1:]
if argv == ["--help"]:
    drop = set(os.environ.get("FAKE_TRTLLM_HELP_DROP", "").split(","))
    print("usage: trtllm-build [-h] ...\n\noptions:")
    for f in FLAGS:
        if f not in drop:
            print(f"  {f} {f[2:].upper()}   (stand-in)")
    sys.exit(0)
calls = os.environ.get("FAKE_TRTLLM_CALLS")
if calls:
    with open(calls, "a") as f:
        f.write(json.dumps(argv) + "\n")
a = {argv[i]: argv[i + 1] for i in range(0, len(argv) - 1) if argv[i].startswith("--") and not argv[i + 1].startswith("--")}
mode = os.environ.get("FAKE_TRTLLM_MODE", "ok")
print("[TensorRT-LLM] TensorRT-LLM version: " + os.environ.get("FAKE_TRTLLM_VERSION", "1.2.1"), flush=True)
print("[TRT-LLM] [I] Loading checkpoint from " + a.get("--checkpoint_dir", "?"), flush=True)
if mode == "hang":
    print("[TRT-LLM] [I] Build TensorRT engine for rank 0", flush=True)
    time.sleep(600)
if mode == "fail":
    print("[TRT-LLM] [I] Build TensorRT engine for rank 0", flush=True)
    print("", flush=True)
    print("[TRT] [E] 2: [virtualMemoryBuffer.cpp::resizePhysical::140] Error Code 2: OutOfMemory", flush=True)
    print("RuntimeError: Engine building failed, please check the error log.", flush=True)
    sys.exit(1)
out = a["--output_dir"]
os.makedirs(out, exist_ok=True)
world = int(a["--workers"])
bc = {k: int(a["--" + k]) for k in ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens", "max_beam_width")}
bc["kv_cache_type"] = a["--kv_cache_type"].upper()
bc["plugin_config"] = {"use_paged_context_fmha": a["--use_paged_context_fmha"] == "enable", "paged_kv_cache": True}
bc["gather_context_logits"] = "--gather_context_logits" in argv
cfg = {"version": os.environ.get("FAKE_TRTLLM_VERSION", "1.2.1"), "build_config": bc,
       "pretrained_config": {"architecture": "LlamaForCausalLM", "logits_dtype": a["--logits_dtype"],
                             "mapping": {"world_size": world, "tp_size": world, "pp_size": 1}}}
open(os.path.join(out, "config.json"), "w").write(json.dumps(cfg))
for r in range(1 if mode == "missing-rank" else world):
    open(os.path.join(out, f"rank{r}.engine"), "wb").write(b"stand-in, not an engine %d" % r)
print("[TRT-LLM] [I] Serializing engine to " + out, flush=True)
print("[TRT-LLM] [I] Total time of building all engines: 00:00:01", flush=True)
'''

NVIDIA_SMI = r'''#!/usr/bin/env python3
"""Test double for nvidia-smi (tests/engine/doubles.py)."""
import os, sys
gpus = [g.split("|") for g in os.environ.get("FAKE_GPUS", "").split(";") if g]
if os.environ.get("FAKE_SMI_FAIL"):
    print("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", file=sys.stderr)
    sys.exit(9)
if any(a.startswith("--query-gpu=") for a in sys.argv[1:]):
    for i, (name, cap, mem) in enumerate(gpus):
        print(f"{i}, GPU-{i:08d}-fake, {name}, {cap}, {mem}, 575.57.08")
    sys.exit(0)
print("| NVIDIA-SMI 575.57.08    Driver Version: 575.57.08    CUDA Version: 12.9 |")
if not gpus:
    print("No devices were found")
'''


def install(tmp_path: Path, monkeypatch, *, gpus: list[str] = (H100,), version: str = "1.2.1", mode: str = "ok",
            help_drop: str = "", with_trtllm: bool = True) -> dict[str, Path]:
    """Put the doubles on PATH (and the metadata-only tensorrt_llm on sys.path); returns their paths."""
    bin_dir, lib_dir = tmp_path / "fake-bin", tmp_path / "fake-lib"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "trtllm-build").write_text(TRTLLM_BUILD.replace("for f in FLAGS", f"for f in {HELP_FLAGS!r}"))
    (bin_dir / "nvidia-smi").write_text(NVIDIA_SMI)
    for p in bin_dir.iterdir():
        p.chmod(p.stat().st_mode | stat.S_IXUSR)
    if with_trtllm:
        (lib_dir / "tensorrt_llm").mkdir(parents=True, exist_ok=True)
        (lib_dir / "tensorrt_llm" / "__init__.py").write_text("# metadata-only stand-in for the toolchain probe\n")
        dist = lib_dir / f"tensorrt_llm-{version}.dist-info"
        dist.mkdir(exist_ok=True)
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: tensorrt_llm\nVersion: {version}\n")
        monkeypatch.syspath_prepend(str(lib_dir))
    calls = tmp_path / "trtllm-build.calls"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_GPUS", ";".join(gpus))
    monkeypatch.setenv("FAKE_TRTLLM_VERSION", version)
    monkeypatch.setenv("FAKE_TRTLLM_MODE", mode)
    monkeypatch.setenv("FAKE_TRTLLM_CALLS", str(calls))
    monkeypatch.setenv("FAKE_TRTLLM_HELP_DROP", help_drop)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return {"bin": bin_dir, "calls": calls}


def calls(paths: dict[str, Path]) -> list[list[str]]:
    import json

    p = paths["calls"]
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def stage_runner(tmp_path: Path):
    """A ``StageRunner`` on ``tmp_path/out`` with stand-in quantize/gate upstream records (keys ``1..1``,
    ``2..2``; checkpoint folder ``tmp_path/ckpt``) and a request: ``(out, runner, upstream, request)``."""
    from precision_pipeline.core.stage import Done, Manifest, StageRecord, StageRunner
    from tests.conftest import request

    out = tmp_path / "out"
    out.mkdir()
    runner = StageRunner(out, Manifest.open(out / "manifest.json", profile="p", profile_source="p", model_dir="m",
                                            out_dir=str(out)))
    up = {n: Done(artifact=None, key=c * 64, dir=tmp_path / "ckpt", record=StageRecord(n, "done"))
          for n, c in (("quantize", "1"), ("gate", "2"))}
    return out, runner, up, request(out_dir=out)
