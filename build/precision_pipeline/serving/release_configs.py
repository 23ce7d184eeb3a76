"""The configs a release switch rewrites: the ensemble's engine step, the BLS's unit (config and route.json),
a canary share (route.json). Every write is atomic (protobuf text format, ``atomic_write_text``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from precision_pipeline.core.errors import UserError
from precision_pipeline.core.store import atomic_write_json, atomic_write_text, read_json
from precision_pipeline.serving import pack
from precision_pipeline.serving.release_state import ROUTE_FILE, ensemble_serves


_CFG_CACHE: dict[str, tuple[tuple, Any]] = {}


def _stat_key(path: Path) -> tuple:
    st = os.stat(path)
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def load_config(path: Path):
    """Parsed config.pbtxt (a fresh copy), cached by (mtime, size, inode): protobuf's text parser is
    pure Python and a rollback should not spend its budget re-parsing unchanged files."""
    path = Path(path)
    key = _stat_key(path)
    hit = _CFG_CACHE.get(str(path))
    if hit is None or hit[0] != key:
        try:
            hit = (key, pack.parse_model_config(path.read_text(), str(path)))
        except UserError as e:  # a serving repository's config: no template involved (hostile s17b F5)
            model = path.parent.name
            raise UserError(str(path), e.problems[0].reason.rstrip(".") + ": it was edited by hand or damaged, and this "
                            "command changed nothing.", f"restore it from a backup, or copy {model}/config.pbtxt from the "
                            "packed repository of a build (`<build out>/model_repository/" + model + "/config.pbtxt`; "
                            "a unit's folder: promote its build again), then run `invoke rollback --repo REPO --to "
                            "<current>`, which re-points it at the current release.") from None
        _CFG_CACHE[str(path)] = hit
    cfg = type(hit[1])()
    cfg.CopyFrom(hit[1])
    return cfg


def _rewrite_config(path: Path, mutate) -> bool:
    """Parse a config.pbtxt, apply ``mutate(cfg)``, write it back atomically if it changed."""
    from google.protobuf import text_format

    path = Path(path)
    cfg = load_config(path)
    before = cfg.SerializeToString()
    mutate(cfg)
    if cfg.SerializeToString() == before:
        return False
    atomic_write_text(path, "# Rewritten by build/precision_pipeline/serving/release.py (protobuf text format).\n" + text_format.MessageToString(cfg))
    _CFG_CACHE[str(path)] = (_stat_key(path), cfg)
    return True


def current_of_configs(repo_dir: Path) -> tuple[str | None, str | None]:
    """(unit named by the ensemble, unit named by the BLS; "param|route.json:X" when the two disagree)."""
    repo_dir = Path(repo_dir)
    ens = bls = None
    p = repo_dir / "ensemble" / "config.pbtxt"
    if p.is_file():
        cfg = load_config(p)
        ens = next((s.model_name for s in cfg.ensemble_scheduling.step if pack.is_unit(s.model_name)), None)
    p = repo_dir / "tensorrt_llm_bls" / "config.pbtxt"
    if p.is_file():
        bls = pack.config_params(load_config(p)).get("tensorrt_llm_model_name")
        try:
            route = (read_json(repo_dir / "tensorrt_llm_bls" / ROUTE_FILE, {}) or {}).get("tensorrt_llm_model_name")
        except (ValueError, AttributeError, OSError):  # hand-edited, a FIFO (the next recovery rewrites it)
            route = "(unreadable)"
        if route and route != bls:
            bls = f"{bls}|route.json:{route}"
    return ens, bls


def _max_batch(repo_dir: Path, model: str) -> int | None:
    p = Path(repo_dir) / model / "config.pbtxt"
    if not p.is_file():
        return None
    return load_config(p).max_batch_size


def configs_agree(repo_dir: Path, current: str) -> bool:
    """Whether the configs name ``current`` (``current_of_configs``): the BLS (config and route.json) always, the
    ensemble when it can serve it (``release_state.ensemble_serves``; while an LLM-API unit is current the ensemble's
    config keeps its last engine unit and the ensemble is not loaded)."""
    ens, bls = current_of_configs(repo_dir)
    return bls == current and (ens == current or not ensemble_serves(current))


def point_ensemble(repo_dir: Path, unit: str) -> bool:
    """Point the ensemble's engine step at ``unit``. Triton refuses an ensemble whose max_batch_size
    exceeds a step's, so it becomes min(unit, preprocessing, postprocessing). An LLM-API unit changes nothing
    (False): the ensemble cannot call it (``release_state.ensemble_serves``)."""
    if not ensemble_serves(unit):
        return False
    sizes = [m for m in (_max_batch(repo_dir, unit), _max_batch(repo_dir, "preprocessing"),
                         _max_batch(repo_dir, "postprocessing")) if m]

    def mut(cfg):
        for s in cfg.ensemble_scheduling.step:
            if pack.is_unit(s.model_name):
                s.model_name = unit
        if sizes:
            cfg.max_batch_size = min(sizes)
    return _rewrite_config(Path(repo_dir) / "ensemble" / "config.pbtxt", mut)


def point_bls(repo_dir: Path, unit: str) -> bool:
    """Point the BLS at ``unit``: its config parameter (what a fresh load reads) and route.json (what
    the running BLS reads on each request, so no reload is needed)."""
    def mut(cfg):
        cfg.parameters["tensorrt_llm_model_name"].string_value = unit
    changed = _rewrite_config(Path(repo_dir) / "tensorrt_llm_bls" / "config.pbtxt", mut)
    route = Path(repo_dir) / "tensorrt_llm_bls" / ROUTE_FILE
    if (read_json(route, {}) or {}) != {"tensorrt_llm_model_name": unit}:  # also ends a canary
        atomic_write_json(route, {"tensorrt_llm_model_name": unit})
        changed = True
    return changed


def set_canary(repo_dir: Path, stable: str, candidate: str, percent: int) -> None:
    """route.json: ``percent`` (0..100) of the BLS's requests to ``candidate``, the rest to ``stable``
    (the running BLS reads it on its next request; see tensorrt_llm_bls/1/model.py)."""
    if not 0 <= int(percent) <= 100:
        raise ValueError(f"percent {percent} outside 0..100")
    atomic_write_json(Path(repo_dir) / "tensorrt_llm_bls" / ROUTE_FILE,
                      {"tensorrt_llm_model_name": stable,
                       "canary": {"tensorrt_llm_model_name": candidate, "percent": int(percent)}})


def set_params(path: Path, values: dict[str, str]) -> None:
    def mut(cfg):
        for k, v in values.items():
            cfg.parameters[k].string_value = v
    _rewrite_config(path, mut)
