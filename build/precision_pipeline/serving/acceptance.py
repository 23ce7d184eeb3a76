"""What promote and rollout check before a build may become (or start to become) a release.

``check_promotable(profile, out_dir, packed_repo, image=..., sm=...)`` is called by ``invoke promote``
and ``invoke rollout`` before anything is written to the serving repository. It trusts nothing the
output folder claims without checking it against the profile asked for and against what the release
will serve:

* **what the output holds** (``accept.output``): the output's marker, ``manifest.json``, ``plan.json``,
  the packed unit's ``precision_path.json`` (profile, ``gemm`` = quant_algo, ``kv`` =
  kv_cache_quant_algo) and the gate's ``checkpoint_quantization`` all name the profile asked for and
  its formats (a build killed early into another profile's output leaves that profile's unit there);
* **the verdict** (``accept.verdict``): the gate's stored measurements (``gate/metrics.json``) are
  judged again against the profile's *current* bar for the gated model
  (``gate.checkpoint_gate.judge_metrics``, the rule the gate itself uses; the bar is
  ``profile.gate.for_model(record.model_fingerprint)``): a bar tightened since the build refuses the
  promote, naming the metric or category, and a loosened one is recorded as re-judged;
* **promotable** (``accept.golden``): the verdict covers at least the bar's ``min_prompts`` golden
  prompts (default: the whole set); a ``--golden-limit`` build is refused with the reason;
* **model** (``accept.model``): the model folder the unit serves (``cpu_reference.json``
  ``hf_model_dir``) still has the content fingerprint the gate recorded;
* **layout** (``accept.layout``): the gate record's tp_size / pp_size / moe_ep_size equal the
  profile's ``parallel`` section, and the unit's GPU count (``gpu_device_ids``) equals tp x pp;
* **runtime** (``accept.runtime``): the serving image's TensorRT-LLM / TensorRT versions, read inside
  the image where a container runtime has it (``engine.toolchain.image_versions``), else from the tag
  catalog (the record says which); a unit with a built engine is checked by ``serving.skew.check_engine``
  (provenance, SM, world size, limits, and against the image's versions when an image is known): the one skew
  check of a release, made here once (``release.promote`` and ``init_serving_repo`` make none of their own);
  a gate that ran with another TensorRT-LLM than the image's is a warning.

Refusals: ``UserError`` (exit 2) listing every problem with its fix; nothing is written. Returns an
``Acceptance``: the gate record for ``releases.json`` and the skew warnings, which promote prints
every time (the first promote too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from precision_pipeline.core.errors import Problem, UserError
from precision_pipeline.core.store import read_json
from precision_pipeline.spec.algos import KVCacheQuantAlgo, QuantAlgo


@dataclass
class Acceptance:
    """``gate``: the record stored with the release (headline numbers, the verdict as re-judged, the
    gate record, the serving image's versions and their source); ``warnings``: to print."""

    gate: dict[str, Any]
    warnings: list[str] = field(default_factory=list)


def _read(path: Path) -> dict:
    try:
        d = read_json(path, {})
    except Exception:  # a damaged file is a refusal below, not a traceback
        return {}
    return d if isinstance(d, dict) else {}


def _layout_of(profile) -> dict[str, int]:
    p = profile.parallel
    return {"tp_size": int(p.tp_size), "pp_size": int(p.pp_size), "moe_ep_size": int(p.moe_ep_size or 1)}


def check_promotable(profile, out_dir: Path, packed_repo: Path, *, image: Optional[str] = None,
                     sm: Optional[int] = None, action: str = "promote", profile_ref: Optional[str] = None) -> Acceptance:
    """Refuse (UserError, exit 2) a build that does not hold for the release (module doc); return the
    release's gate record and the warnings. ``image``: the serving image (the build's rendered
    Deployment); ``sm``: the deployment GPU's SM; ``action``: ``promote`` or ``rollout`` (messages);
    ``profile_ref``: the ``--profile`` as given (a file path), named in the printed rebuild command (hostile s15c
    T26: the profile's stem was refused as no shipped profile); default ``profile.name``."""
    from precision_pipeline.gate.verdict import verdict_failures
    from precision_pipeline.serving import pack, release_units

    out_dir = Path(out_dir)
    rebuild = f"rebuild it: invoke build --profile {profile_ref or profile.name} --out {out_dir}"
    problems: list[Problem] = []
    warnings: list[str] = []
    unit = release_units.resolve_unit_source(packed_repo)
    metrics = _read(out_dir / "gate" / "metrics.json")
    record = metrics.get("record") or {}
    problems += _output_problems(profile, out_dir, unit, metrics, rebuild)
    problems += _profile_problems(profile, out_dir, rebuild)
    problems += _dataset_problems(profile, out_dir, rebuild)
    verdict = _check_verdict(profile, out_dir, unit, metrics, rebuild, problems, warnings)
    gpus = pack.unit_gpus(unit.parent, unit.name)
    if gpus != profile.world_size:
        problems.append(Problem("--profile", f"the packed unit {unit.name} runs on {gpus} GPU(s) but {profile.name} "
                                f"serves tp x pp = {profile.world_size}.", rebuild, rule="accept.layout"))
    image_info = _check_runtime(unit, gpus, record, image, sm, problems, warnings)
    if problems:
        raise UserError(problems)
    gate = {k: v for k, v in ((metrics.get("metrics") or {}).items())}
    numbers = {k: r.get("value") for k, r in gate.items() if isinstance(r, dict)}
    return Acceptance(gate={**numbers, "passed": True, "failures": verdict_failures(verdict),
                            "judged_against": verdict.get("judged_against"),
                            "rejudged_at": action, "prompts": (metrics.get("tokens") or {}).get("prompts"),
                            "record": record, "serving_image": image_info or None},
                      warnings=warnings)


def _output_problems(profile, out_dir: Path, unit: Path, metrics: dict, rebuild: str) -> list[Problem]:
    """What the output holds (the packed unit, plan.json, the gated checkpoint) against the profile promoted."""
    from precision_pipeline.serving import pack

    name = profile.name
    path = _read(unit / pack.PRECISION_PATH_FILE)
    plan = _read(out_dir / "plan.json")
    q = profile.quantization
    want = {"profile": name, "gemm": q.quant_algo.value, "kv": q.kv_cache_quant_algo.value}
    held: dict[str, dict[str, Any]] = {
        f"the packed unit {unit.name} (precision_path.json)": {k: path.get(k) for k in want},
        "plan.json": {"profile": plan.get("profile")}}
    if metrics.get("checkpoint_quantization") is not None or metrics.get("record"):
        ckq = metrics.get("checkpoint_quantization") or {}
        held["the gated checkpoint (gate/metrics.json)"] = {  # absent: an unquantized checkpoint
            "gemm": ckq.get("quant_algo") or QuantAlgo.NO_QUANT.value,
            "kv": ckq.get("kv_cache_quant_algo") or KVCacheQuantAlgo.NONE.value}
    problems = []
    for what, vals in held.items():
        bad = {k: v for k, v in vals.items() if str(v) != want[k]}
        if bad:
            shown = ", ".join(f"{k} {v!r} (asked: {want[k]!r})" for k, v in bad.items())
            problems.append(Problem("--out", f"{what} in {out_dir} does not hold a build of {name}: {shown}; promoted, "
                                    f"it would be recorded as {name}.",
                                    f"promote the profile that output holds, or {rebuild}.", rule="accept.output"))
    return problems


REJUDGED_FIELDS = frozenset({"gate", "description", "extends"})
"""Profile fields a promote does not hold against a build made before they changed: ``gate`` (the stored
measurements are judged again against the current bar, ``_check_verdict``), ``description`` (text) and
``extends`` (the merged values are compared, not where they came from)."""


def _changed(built: Any, now: Any, path: str = "") -> list[str]:
    """Dotted field paths (``deployment.keep_releases: 2 -> 0``) where two JSON dumps of a profile differ."""
    if isinstance(built, dict) and isinstance(now, dict):
        return [c for k in sorted(set(built) | set(now), key=str)
                for c in _changed(built.get(k), now.get(k), f"{path}.{k}" if path else str(k))]
    return [] if built == now else [f"{path}: {_short(built)} -> {_short(now)}"]


def _short(v: Any, limit: int = 60) -> str:
    import json

    text = json.dumps(v, sort_keys=True)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _profile_problems(profile, out_dir: Path, rebuild: str) -> list[Problem]:
    """The profile as the build resolved it (the resolve stage's typed record) against the profile promoted now: a
    profile edited since the build (``deployment.keep_releases``, the fallback, limits, ...) is refused as a stale
    build (``accept.profile``), except the fields in ``REJUDGED_FIELDS`` (hostile s8 #102: edits were ignored
    silently). Another profile's build is ``accept.output``'s refusal, not this one's."""
    from precision_pipeline.core.stage import read_record
    from precision_pipeline.resolve.stage import ResolveStage

    rec = read_record(out_dir, ResolveStage())
    if rec is None or rec.artifact.plan.profile.name != profile.name:
        return []
    drop = set(REJUDGED_FIELDS)
    diff = _changed(rec.artifact.plan.profile.model_dump(mode="json", exclude=drop),
                    profile.model_dump(mode="json", exclude=drop))
    if not diff:
        return []
    shown = "; ".join(diff[:6]) + (f"; and {len(diff) - 6} more" if len(diff) > 6 else "")
    return [Problem("--profile", f"{profile.name} changed since the build in {out_dir} (built -> now): {shown}; the "
                    "output was built, and its manifests rendered, from the profile as it was.",
                    f"{rebuild} (a change of the gate bar alone is re-judged without a rebuild).", rule="accept.profile")]


def _dataset_problems(profile, out_dir: Path, rebuild: str) -> list[Problem]:
    """A user calibration file whose content changed since the build (``accept.dataset``): the quantize record's
    ``calibration.sources.user.sha256`` (the whole file's, ``resolve.dataset``) against the file now
    (``core.fingerprint.file_digests``, memoized). The build keys the file by content, so a rebuild would quantize
    and gate again with the new data; promoting the old unit as a build of the profile would not (hostile s15b F7: the
    rebuild with the file as it was then failed its gate). A file that is gone now refuses nothing (the unit is what
    was built and gated)."""
    from precision_pipeline.core.fingerprint import file_digests
    from precision_pipeline.core.stage import read_record
    from precision_pipeline.quantize.stage import QuantizeStage

    ds = profile.calibration.dataset
    rec = read_record(out_dir, QuantizeStage()) if ds and ds != "builtin" else None
    user = (((rec.artifact.calibration or {}).get("sources") or {}).get("user") or {}) if rec is not None else {}
    built = user.get("sha256")
    path = Path(ds).expanduser()
    if not isinstance(built, str) or not path.is_file():
        return []
    try:
        now = file_digests(path)[path.name]
    except OSError:
        return []
    if now == built:
        return []
    return [Problem("calibration.dataset", f"{path} changed since the build in {out_dir} (sha256 {built[:12]}... then, "
                    f"{now[:12]}... now): its checkpoint was calibrated, and gated, on the file as it was.",
                    f"{rebuild} (it calibrates and gates on the file as it is now), or put the file back.",
                    rule="accept.dataset")]


def _check_verdict(profile, out_dir: Path, unit: Path, metrics: dict, rebuild: str, problems: list[Problem],
                   warnings: list[str]) -> dict[str, Any]:
    """The verdict, re-judged against the profile's current bar, then the layout and the model it is about
    (appended to ``problems`` / ``warnings``). Returns the verdict ({} when there is none to judge)."""
    from precision_pipeline.gate.verdict import judge_metrics, verdict_reasons

    record = metrics.get("record") or {}
    if not metrics or "metrics" not in metrics:
        problems.append(Problem("--out", f"{out_dir / 'gate' / 'metrics.json'} is missing or unreadable: no verdict to "
                                "check.", rebuild, rule="accept.verdict"))
        return {}
    if not record.get("model_fingerprint"):
        problems.append(Problem("--out", "the gate record has no model fingerprint, layout or runtime (a build from "
                                "before gate records): the verdict cannot be checked against what the release "
                                "serves.", rebuild, rule="accept.verdict"))
        return {}
    bar = profile.gate.for_model(record["model_fingerprint"])
    verdict = judge_metrics(metrics, bar)
    was = {"passed": metrics.get("passed"), "judged_against": metrics.get("judged_against")}
    changed = was["judged_against"] is not None and was["judged_against"] != verdict["judged_against"]
    if not verdict["passed"]:
        how = ("the profile's gate bar changed since the build; " if changed else "")
        problems.append(Problem("gate", f"{how}the stored measurements fail the profile's current bar: "
                                f"{verdict_reasons(verdict)}.",
                                "loosen the bar only if that is meant, or fix the profile and rebuild.",
                                rule="accept.verdict"))
    elif changed or not was["passed"]:
        warnings.append("the gate bar changed since the build; the stored measurements were re-judged against "
                        "the profile's current bar and pass it.")
    if not verdict["promotable"]:
        problems.append(Problem("gate", f"not promotable: {verdict['not_promotable']}.",
                                f"rebuild without --golden-limit ({rebuild.removeprefix('rebuild it: ')}), or set "  # with --out: s18b F5
                                "gate.min_prompts in the profile if fewer prompts are enough for this release.",
                                rule="accept.golden"))
    problems += _layout_and_model_problems(profile, unit, record, rebuild)
    return verdict


def _layout_and_model_problems(profile, unit: Path, record: dict, rebuild: str) -> list[Problem]:
    """What was gated against what the profile serves (layout) and what the unit serves or was built from (model)."""
    from precision_pipeline.serving import pack

    problems = []
    gated = record.get("layout") or {}
    serves = _layout_of(profile)
    diff = {k: (gated.get(k), v) for k, v in serves.items() if gated.get(k) is not None and int(gated[k]) != v}
    if diff:
        problems.append(Problem("--profile", "the gate ran at " + ", ".join(f"{k} {a}" for k, (a, _) in diff.items())
                                + f" but {profile.name} serves " + ", ".join(f"{k} {b}" for k, (_, b) in diff.items())
                                + ": the verdict is not about what the release would serve.", rebuild,
                                rule="accept.layout"))
    # the model: the unit serves (CPU stand-in) or was built from the model the verdict is about
    served = Path(str(_read(unit / "engine" / pack.CPU_REFERENCE_FILE).get("hf_model_dir") or ""))
    if str(served) not in ("", ".") and (served / "config.json").is_file():
        from precision_pipeline.core.fingerprint import model_fingerprint

        now = model_fingerprint(served).sha256
        if now != record["model_fingerprint"]:
            problems.append(Problem("--model", f"the gate judged the model with content fingerprint "
                                    f"{record['model_fingerprint'][:12]}…, but {served} (what the unit serves) is now "
                                    f"{now[:12]}…: the verdict is about another model (or the folder changed since "
                                    "the build).", rebuild, rule="accept.model"))
    return problems


def _check_runtime(unit: Path, gpus: int, record: dict, image: Optional[str], sm: Optional[int],
                   problems: list[Problem], warnings: list[str]) -> dict[str, Any]:
    """The serving image's versions (inside the image, else the catalog) against the engine and the gate
    (appended to ``problems`` / ``warnings``). Returns the image's versions ({} without ``image``)."""
    from precision_pipeline.serving import images, pack, skew

    image_info: dict[str, Any] = {}
    catalog = images.CATALOG
    iv = None
    if image:
        iv = images.image_versions(image)
        image_info = iv.model_dump(mode="json")
        warnings.append(f"serving image {image}: TensorRT-LLM {iv.tensorrt_llm or '?'}, TensorRT {iv.tensorrt or '?'}; "
                        f"{iv.why}.")
        if iv.source == "image":
            catalog = (images.ServingImage(image, iv.tensorrt_llm, iv.tensorrt, f"inside the image ({iv.runtime})"),)
    # the one skew check of a release (promote, rollout, the first promote, nightly --promote): the unit's built
    # engine (provenance, SM, world size, limits, and with ``image`` its TensorRT-LLM / TensorRT) -- also without an image
    eng = unit / "engine"
    if (eng / "config.json").is_file():
        try:
            warnings += skew.check_engine(eng, image=image, sm=sm, world_size=gpus, where=f"{unit.name}/engine",
                                          limits=pack.unit_limits(unit.parent, unit.name), catalog=catalog)
        except UserError as e:
            problems += e.problems
    gated_trtllm = (record.get("runtime") or {}).get("tensorrt_llm")
    if iv is not None and gated_trtllm and iv.tensorrt_llm and gated_trtllm != iv.tensorrt_llm:
        warnings.append(f"the gate ran where TensorRT-LLM {gated_trtllm} was installed; {image} ships "
                        f"{iv.tensorrt_llm}.")
    return image_info


__all__ = ["Acceptance", "check_promotable"]
