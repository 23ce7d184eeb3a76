"""A finished build's output folder, read through its typed stage records (``.stages/``, the authority; never
``manifest.json`` or ``metrics.json`` as dicts), and the one promote of a build used by ``invoke promote`` and
``invoke nightly --promote``.

``open_build(profile, out)`` -> ``BuildOutput``: the profile, the resolved plan, the gate's verdict
(``GateArtifact``: passed, numbers, the record of what it holds for), the packed repository
(``RepositoryArtifact``), the rendered manifests (``ManifestsArtifact``: the serving image) and the
checkpoint (``CheckpointArtifact``). Raises UserError (exit 2) when the folder holds no finished build of that
profile, or (``require_passed``) one whose checkpoint failed its gate: a failed build is never promoted.

``promote_build(build, repo_dir, by=...)``: acceptance (``serving/acceptance.py``, with the serving image and
the GPU's SM for the skew checks), then the first release (``release.init_serving_repo`` with the profile's
fallback build, accepted the same way (``_accepted_fallback``), ``warm_fallback`` and ``keep_releases``) or a
promote (``release.promote``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from precision_pipeline.core.errors import Problem, UserError
from precision_pipeline.core.outputs import default_out_dir
from precision_pipeline.core.stage import RECORDS_DIR, Stage, read_manifest, read_record, unfinished_build
from precision_pipeline.gate.stage import GateArtifact, GateStage
from precision_pipeline.quantize.stage import CheckpointArtifact, QuantizeStage
from precision_pipeline.resolve.plan import ResolvedPlan
from precision_pipeline.resolve.stage import ResolveStage
from precision_pipeline.serving.stage import DeployStage, ManifestsArtifact, PackStage, RepositoryArtifact


@dataclass(frozen=True)
class BuildOutput:
    """What a finished build holds (module docstring); every field typed."""

    out_dir: Path
    profile: Any
    """The profile as loaded by the caller (``spec.profile.Profile``)."""
    plan: ResolvedPlan
    gate: GateArtifact
    repository: RepositoryArtifact
    manifests: Optional[ManifestsArtifact] = None
    checkpoint: Optional[CheckpointArtifact] = None
    ref: str = ""
    """The ``--profile`` the caller gave (a shipped name or a file path): what a printed rebuild command names."""

    @property
    def passed(self) -> bool:
        """The checkpoint passed its accuracy gate."""
        return self.gate.status == "done" and self.gate.passed

    @property
    def packed(self) -> Path:
        """The packed Triton repository (``<out>/model_repository``)."""
        return self.out_dir / PackStage.output

    @property
    def image(self) -> Optional[str]:
        """The serving image the build's manifests run (``--image``), or None when its deploy record predates it."""
        return (self.manifests.image or None) if self.manifests is not None else None

    @property
    def layout(self) -> dict[str, int]:
        """tp_size / pp_size / moe_ep_size the release will serve (the plan's mapping)."""
        m = self.plan.mapping
        return {"tp_size": m.tp_size, "pp_size": m.pp_size, "moe_ep_size": m.moe_ep_size or 1}

    def serving_facts(self) -> dict[str, Any]:
        """The skew checks' facts of the serving side: the image and the deployment GPU's SM."""
        return {"image": self.image, "sm": self.plan.gpu.sm if self.plan.gpu else None}

    def model_fingerprint(self) -> str:
        """The gated model's content fingerprint (the gate's record), "" when the record has none."""
        return str((self.gate.record or {}).get("model_fingerprint") or "")

    def probe_set(self, prompts: int):
        """The accuracy probe's prompts and reference from the build's gate folder, thresholds from the profile's
        gate section for the gated model (``serving.probe.load_probe_set``)."""
        from precision_pipeline.serving import probe

        bar = self.profile.gate.for_model(self.model_fingerprint())
        return probe.load_probe_set(self.out_dir / GateStage.output, prompts, thresholds=bar.thresholds())


class NotBuilt(UserError):
    """``open_build``: the folder holds no build of the profile at all (a record missing); every other refusal of
    ``open_build`` (another profile's build, a failed gate, a build that did not finish) is a plain UserError."""


def _typed(out_dir: Path, stage: Stage):
    d = read_record(out_dir, stage)
    return d.artifact if d is not None and d.artifact.status in ("done", "failed") else None


def open_build(profile_ref: str, out: Optional[Path | str] = None, require_passed: bool = True) -> BuildOutput:
    """The finished build of ``profile_ref`` in ``out`` (default ``artifacts/<profile>``). See the module docstring."""
    from precision_pipeline.resolve.dataset import load_build_profile

    prof = load_build_profile(profile_ref)  # a relative calibration.dataset as the build read it (hostile s15b F6)
    out_dir = Path(out).expanduser().resolve() if out else default_out_dir(prof.name)
    if out_dir.exists() and not out_dir.is_dir():  # hostile s17 F18: "holds no finished build ... run invoke build --out"
        raise UserError("--out" if out else "--profile", f"{out_dir} is a file, not a build output folder.",
                        "pass the folder a build wrote (`invoke build --profile P --out DIR`), e.g. artifacts/<profile>.")
    resolved = _typed(out_dir, ResolveStage())
    built = resolved.plan.profile.name if resolved is not None else None
    if built not in (None, prof.name):
        raise UserError("--profile", f"{out_dir} holds a build of {built!r}, not of {prof.name!r}; its release would be "
                        "recorded under the wrong profile.", f"pass --profile {built}, or the output folder of {prof.name}'s build.")
    gate, repo = _typed(out_dir, GateStage()), _typed(out_dir, PackStage())
    failed_gate = gate is not None and not (gate.status == "done" and gate.passed)
    if require_passed and resolved is not None and failed_gate and (repo is None or repo.status != "done"):
        # a failed gate stops the build before pack: say that, not "pack.json is missing" (hostile s16b T134)
        raise UserError("--profile", f"the build of {prof.name} in {out_dir} did not pass its accuracy gate, so it "
                        f"packed no unit ({out_dir / GateStage.output / 'report.md'} says why).",
                        "fix the profile and rebuild; a failed build is never promoted.")
    if resolved is None or gate is None or repo is None or repo.status != "done":
        bad = [f"{RECORDS_DIR}/{st.name}.json is " + ("missing" if not (out_dir / RECORDS_DIR / f"{st.name}.json").exists()
                                                      else "damaged (not a valid record)")
               for st, d in ((ResolveStage(), resolved), (GateStage(), gate), (PackStage(), repo)) if d is None]
        why = "; ".join(bad) or "its pack stage did not pack a unit"
        raise NotBuilt("--out" if out else "--profile", f"{out_dir} holds no finished build of {prof.name} ({why}).",
                       f"run `invoke build --profile {profile_ref} --out {out_dir}` (it reuses every stage still right)"
                       + ("" if out else ", or pass --out with the folder of its build") + ".")
    b = BuildOutput(out_dir=out_dir, profile=prof, plan=resolved.plan, gate=gate, repository=repo,
                    manifests=_typed(out_dir, DeployStage()), checkpoint=_typed(out_dir, QuantizeStage()),
                    ref=str(profile_ref))
    if require_passed and not b.passed:
        raise UserError("--profile", f"the build of {prof.name} did not pass its accuracy gate.",
                        "fix the profile and rebuild; a failed build is never promoted.")
    why = unfinished_build(read_manifest(out_dir / "manifest.json"))
    if why is not None:  # its plan, checkpoint, gate and packed unit may come from two builds (hostile s15 F5, s15b F2)
        raise UserError("--out", f"{out_dir}: {why}, so its plan, checkpoint, gate verdict and packed unit may not "
                        "belong together.", f"run `invoke build --profile {profile_ref} --out {out_dir}` again: it reuses "
                        "every stage that is still right and finishes the build.")
    return b


@dataclass
class Promotion:
    """What ``promote_build`` did: the unit now current, whether the serving repository was created (first
    release: ``fallback`` is then the fallback unit), the warnings (acceptance's first), notes, and milliseconds."""

    unit: str
    created: bool
    fallback: Optional[str] = None
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    total_ms: float = 0.0


def promote_build(build: BuildOutput, repo_dir: Path, *, by: str, server=None,
                  fallback_out: Optional[Path] = None) -> Promotion:
    """Make ``build`` the current release of serving repository ``repo_dir`` (module docstring). ``server``: a
    running Triton to load beside, smoke-test and switch (None: the repository only); ``fallback_out``: where the
    profile's fallback build is (default ``artifacts/<fallback>``). Raises UserError for what acceptance refuses."""
    from precision_pipeline.serving import acceptance, release

    repo_dir = Path(repo_dir)
    ok = acceptance.check_promotable(build.profile, build.out_dir, build.packed, profile_ref=build.ref,
                                     **build.serving_facts())  # before any write
    warnings = list(ok.warnings)
    dep = build.profile.deployment
    if release.read_state(repo_dir) is None:
        notes: list[str] = []
        fb_repo = _accepted_fallback(dep.fallback, fallback_out, warnings, notes) if dep.fallback else None
        state = release.init_serving_repo(repo_dir, build.packed, profile=build.profile.name, gate=ok.gate, by=by,
                                          fallback_repo=fb_repo, warm_fallback=dep.warm_fallback,
                                          keep_releases=dep.keep_releases)
        return Promotion(unit=str(state["current"]), created=True, fallback=state.get("fallback"), warnings=warnings,
                         notes=notes)
    warnings += repository_settings_warnings(build.profile, repo_dir) + _rejected_warning(build, repo_dir)
    t = release.promote(repo_dir, build.packed, server=server, profile=build.profile.name, gate=ok.gate,
                        promoted_by=by)  # the one skew check of a release: check_promotable, above
    return Promotion(unit=str(t["unit"]), created=False, warnings=warnings, total_ms=float(t.get("total_ms", 0) or 0))


def _rejected_warning(build: BuildOutput, repo_dir: Path) -> list[str]:
    """A warning when the build's unit is one whose rollout a failed live check rolled back in ``repo_dir``
    (``release_state.rejected_units``): a promote makes it current without those checks (hostile s17 F12: silent)."""
    from precision_pipeline.serving import release_state
    from precision_pipeline.serving.release_units import resolve_unit_source

    try:
        unit = resolve_unit_source(build.packed).name
        why = release_state.rejected_units(release_state.read_state(repo_dir) or {}).get(unit)
    except (UserError, OSError, ValueError):
        return []
    return [f"{unit} was rolled back by its rollout in this repository ({why}); a promote makes it current at once, "
            "without the rollout's live checks (`invoke rollout` judges it again)."] if why else []


def repository_settings_warnings(profile, repo_dir: Path) -> list[str]:
    """What ``profile``'s ``deployment.fallback`` / ``warm_fallback`` / ``keep_releases`` ask that the serving
    repository ``repo_dir`` does not do: its ``releases.json`` keeps the settings of the promote that created it, and
    a later promote or rollout applies none of a profile's (hostile s8 #102: an edit was ignored without a word).
    One warning naming each difference (warm_fallback only where both have a fallback), or [] (also for a repository
    that does not exist yet)."""
    from precision_pipeline.core.store import read_json_safe
    from precision_pipeline.serving import pack, release

    state = release.read_state(repo_dir)
    if state is None:
        return []
    dep, fb = profile.deployment, state.get("fallback")
    fb_path = read_json_safe(Path(repo_dir) / fb / pack.PRECISION_PATH_FILE) if fb else None
    fb_profile = (str(fb_path.get("profile") or "?") if isinstance(fb_path, dict) else "?") if fb else None
    kept = {"deployment.fallback": (fb_profile, f"{fb_profile} ({fb})" if fb else "none"),
            "deployment.warm_fallback": (bool(state.get("warm_fallback")) if fb and dep.fallback else dep.warm_fallback,
                                         str(bool(state.get("warm_fallback"))).lower()),
            "deployment.keep_releases": (int(state.get("keep_releases", 2)), str(state.get("keep_releases", 2)))}
    asked = {"deployment.fallback": (dep.fallback, dep.fallback or "none"),
             "deployment.warm_fallback": (dep.warm_fallback, str(dep.warm_fallback).lower()),
             "deployment.keep_releases": (dep.keep_releases, str(dep.keep_releases))}
    diff = [f"{k} {asked[k][1]} (the repository: {kept[k][1]})" for k in kept if kept[k][0] != asked[k][0]]
    if not diff:
        return []
    return [f"{profile.name} asks " + ", ".join(diff) + f"; not applied: {Path(repo_dir).parent / 'releases.json'} keeps "
            "the fallback and retention of the promote that created the repository, and no later promote or rollout "
            "changes them (a new --repo takes the profile's at its first promote)."]


def _accepted_fallback(name: str, fallback_out: Optional[Path], warnings: list[str], notes: list[str]) -> Optional[Path]:
    """The packed repository of the fallback build ``name`` (at ``fallback_out``, default ``artifacts/<name>``)
    once it passed the acceptance a promoted build passes (``acceptance.check_promotable``; its warnings are
    appended, prefixed); None with a note when it is not built at all (``NotBuilt``). A fallback becomes current by
    ``rollback --fallback`` without any other check of its build, so one that is refused (acceptance, a failed
    gate, another profile's build at its place, an unreadable output) refuses the first promote (UserError on
    ``deployment.fallback``, exit 2, nothing created) with the real reason; promoting without a fallback is said
    in the profile (``deployment: {fallback: null, warm_fallback: false}``)."""
    from precision_pipeline.serving import acceptance

    try:
        fb = open_build(name, fallback_out)
        ok = acceptance.check_promotable(fb.profile, fb.out_dir, fb.packed, profile_ref=fb.ref, **fb.serving_facts())
    except NotBuilt:
        notes.append(f"fallback {name} is not built; run `invoke build --profile {name}` to keep it on disk.")
        return None
    except UserError as e:
        problems = e.problems
    except (OSError, ValueError) as e:  # an output it cannot read: the reason, never "not built"
        problems = [Problem("--out", f"its output cannot be read ({type(e).__name__}: {str(e)[:200]})", "rebuild it.")]
    else:
        warnings += [f"fallback {name}: {w}" for w in ok.warnings]
        return fb.packed
    without = (f"(the fallback's output: `invoke build --profile {name}` rebuilds it at its place). Or promote without "
               "a fallback: a profile that extends this one with `deployment: {fallback: null, warm_fallback: false}` "
               "(rollback --fallback is then refused).")
    raise UserError([Problem("deployment.fallback", f"the fallback build {name} is not accepted as the fallback (it "
                             f"becomes current by `rollback --fallback` without another check): {p.field}: {p.reason}",
                             f"{p.fix.rstrip('.')} {without}".strip(), rule=p.rule) for p in problems])


__all__ = ["BuildOutput", "NotBuilt", "open_build", "Promotion", "promote_build", "repository_settings_warnings"]
