"""Skew between a built engine and where it will be served, refused before anything reaches a server.

One home for the checks that pack, deploy and promote run on an engine folder (``check_engine``):

* ``skew.provenance``: the folder verifies against ``provenance.json`` (engine/provenance.py: every
  file's size and sha256, one build id, rank0..rank{N-1}.engine for world size N);
* ``skew.world_size``: the provenance's world size and the engine config's mapping equal the
  deployment's tp x pp;
* ``skew.sm``: the SM the engine was built for (and every GPU that built it) is the deployment GPU's
  SM (engines are built per SM: tensorrt_llm/builder.py);
* ``skew.tensorrt_llm`` / ``skew.tensorrt``: the engine's TensorRT-LLM (config.json ``version``,
  provenance) and TensorRT versions equal the serving image's (serving/images.py). An image not in
  the catalog, or a catalog row without a confirmed TensorRT version, is a warning naming what to check;
* ``skew.limits``: max_batch_size / max_seq_len / max_beam_width of the rendered configs are within the
  engine config.json's build_config (``limits``: the values the configs were rendered with).

Refusals: ``UserError`` (exit 2) with every problem; returns the warnings otherwise.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Optional

from precision_pipeline.core.errors import Problem, UserError
from precision_pipeline.engine.provenance import verify_engine_dir
from precision_pipeline.serving import images


def check_engine(engine_dir: Path, *, image: Optional[str], sm: Optional[int], world_size: int,
                 limits: Optional[Mapping[str, int]] = None, where: str = "engine",
                 catalog: tuple = images.CATALOG) -> list[str]:
    """Refuse (UserError) an engine that does not match the serving side; return warnings."""
    engine_dir = Path(engine_dir)
    rec = verify_engine_dir(engine_dir, field=where)
    try:
        cfg = json.loads((engine_dir / "config.json").read_text())
    except (OSError, ValueError):
        cfg = {}
    problems: list[Problem] = []
    warnings: list[str] = []
    rebuild = "rebuild the engine for this deployment (invoke build --on k8s builds it in the serving image on the serving GPU)."
    pw = int(rec.get("world_size") or 0)
    m = ((cfg.get("pretrained_config") or {}).get("mapping") or {})
    cw = m.get("world_size") or (int(m.get("tp_size", 1)) * int(m.get("pp_size", 1)) if m else None)
    if pw != world_size or (cw is not None and int(cw) != world_size):
        problems.append(Problem(f"{where}: world size", f"the engine has {pw} rank engine(s) (config.json mapping: {cw}) "
                                f"but the deployment runs tp x pp = {world_size}.", rebuild, rule="skew.world_size"))
    built_sms = sorted({int(rec.get("sm") or 0), *(int(g.get("sm") or 0) for g in rec.get("gpus") or [])})
    if sm is not None and built_sms != [int(sm)]:
        names = ", ".join(sorted({g.get("name", "?") for g in rec.get("gpus") or []})) or "?"
        problems.append(Problem(f"{where}: SM", f"the engine was built for SM {rec.get('sm')} on {names} but the deployment "
                                f"GPU is SM {sm}; a TensorRT engine runs only on the SM it was built for.", rebuild, rule="skew.sm"))
    eng_trtllm = str(cfg.get("version") or rec.get("engine_version") or (rec.get("versions") or {}).get("tensorrt_llm") or "")
    eng_trt = (rec.get("versions") or {}).get("tensorrt")
    if image:
        row = images.lookup(image, catalog)
        if row is None:
            warnings.append(f"serving image {image} is not in the catalog (serving/images.py): cannot confirm it ships "
                            f"TensorRT-LLM {eng_trtllm or '?'} / TensorRT {eng_trt or '?'} like the engine; check with "
                            f"{images.CHECK_INSIDE}.")
        else:
            if eng_trtllm and eng_trtllm != row.tensorrt_llm:
                problems.append(Problem(f"{where}: TensorRT-LLM version", f"the engine was built by TensorRT-LLM {eng_trtllm} but "
                                        f"{image} ships {row.tensorrt_llm} ({row.source}); it would fail to deserialize.",
                                        f"serve with the image the engine was built in, or {rebuild}", rule="skew.tensorrt_llm"))
            if row.tensorrt is None:
                warnings.append(f"the TensorRT version of {image} is not confirmed in the catalog; the engine was built with "
                                f"TensorRT {eng_trt or '?'}; check with {images.CHECK_INSIDE}.")
            elif eng_trt and eng_trt != row.tensorrt:
                problems.append(Problem(f"{where}: TensorRT version", f"the engine was built with TensorRT {eng_trt} but {image} "
                                        f"ships {row.tensorrt} ({row.source}).", f"serve with the image the engine was built in, or {rebuild}",
                                        rule="skew.tensorrt"))
    bc = cfg.get("build_config") or {}
    for k, v in (limits or {}).items():
        ev = bc.get(k)
        if ev is not None and v is not None and int(v) > int(ev):
            problems.append(Problem(f"{where}: config.json build_config.{k}", f"is {ev} but the rendered configs use {v}.",
                                    "render the configs from the plan the engine was built with, or rebuild the engine.",
                                    rule="skew.limits"))
    if problems:
        raise UserError(problems)
    return warnings


__all__ = ["check_engine"]
