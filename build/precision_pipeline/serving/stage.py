"""Pack (Triton model repository) and deploy (Kubernetes manifests) as stages."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from pydantic import ConfigDict

from precision_pipeline.core.fingerprint import Fingerprint, fingerprint, model_fingerprint
from precision_pipeline.core.paths import REPO_ROOT
from precision_pipeline.core.stage import Artifact, Done, Frozen, Stage
from precision_pipeline.resolve.plan import ResolvedPlan


class PackInputs(Frozen):
    """Keyed whole: the plan (its plan.json view), the model's tokenizer/config files, the checkpoint
    and engine (their stage keys), where the repository is served from, and the templates."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    plan: ResolvedPlan
    model: Fingerprint
    checkpoint: Fingerprint
    engine: Fingerprint
    engine_built: bool
    repo_root: str
    repo_dir: str
    templates: Fingerprint
    image: str = ""
    """The serving image (``--image``): an engine is checked against the versions it ships (serving/skew.py)."""


class RepositoryArtifact(Artifact):
    """``<out>/model_repository``: the Triton models and the engine unit."""

    models: tuple[str, ...]
    engine_present: bool
    engine_unit: str
    engine_hash: str

    def summary(self) -> dict[str, Any]:
        return {"models": list(self.models), "engine_present": self.engine_present}

    def present(self, out_dir: Path) -> bool:
        return (Path(out_dir) / "model_repository").is_dir()


class PackStage(Stage[PackInputs, RepositoryArtifact]):
    name = "pack"
    version = 1
    code = ("serving", "resolve", "core")
    needs = ("quantize", "engine")
    output = "model_repository"
    artifact_type = RepositoryArtifact

    def inputs(self, plan: ResolvedPlan, request, upstream: Mapping[str, Done]) -> PackInputs:
        q, e = upstream["quantize"], upstream["engine"]
        return PackInputs(plan=plan, model=model_fingerprint(request.model_dir),
                          checkpoint=Fingerprint(sha256=q.key, path=q.dir), engine=Fingerprint(sha256=e.key, path=e.dir),
                          engine_built=bool(e.artifact.built), repo_root=request.repo_root,
                          repo_dir=str(Path(request.out_dir) / self.output), templates=fingerprint(REPO_ROOT / "triton_repo"),
                          image=str(getattr(request, "image", "") or ""))

    def run(self, inputs: PackInputs, workdir: Path) -> RepositoryArtifact:
        from precision_pipeline.serving import pack

        res = pack.pack_repository(inputs.plan, inputs.plan.profile, inputs.model.path, inputs.checkpoint.path,
                                   inputs.engine.path, inputs.engine_built, Path(inputs.repo_dir), inputs.repo_root,
                                   workdir=workdir, image=inputs.image or None)
        return RepositoryArtifact(models=tuple(res.models), engine_present=bool(inputs.engine_built),
                                  engine_unit=res.engine_unit, engine_hash=res.engine_hash)


class DeployInputs(Frozen):
    """The plan is carried for rendering; the key sees ``serving.deploy.stage_inputs`` (what the
    manifests depend on) and the repository (the pack stage's key)."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    plan: ResolvedPlan
    repository: Fingerprint
    out_dir: str
    repo_root: str
    image: str
    manifest_inputs: dict[str, Any]

    def canonical(self) -> dict[str, Any]:
        return {"manifest_inputs": self.manifest_inputs, "repository": self.repository}


class ManifestsArtifact(Artifact):
    """``<out>/k8s``: Deployment, Service (+ PodDisruptionBudget), validated."""

    files: tuple[str, ...]
    gpus_per_replica: int
    replicas: int
    launcher: str

    def summary(self) -> dict[str, Any]:
        return {"manifests": len(self.files), "gpus_per_replica": self.gpus_per_replica, "replicas": self.replicas,
                "launcher": self.launcher}

    def present(self, out_dir: Path) -> bool:
        return (Path(out_dir) / "k8s").is_dir()


class DeployStage(Stage[DeployInputs, ManifestsArtifact]):
    name = "deploy"
    version = 1
    code = ("serving", "resolve", "core")
    needs = ("pack",)
    output = "k8s"
    artifact_type = ManifestsArtifact

    def inputs(self, plan: ResolvedPlan, request, upstream: Mapping[str, Done]) -> DeployInputs:
        from precision_pipeline.serving import deploy

        p = upstream["pack"]
        # the gate bar of *this* model (keyed by its content) is what the canary analysis and alerts use;
        # the key does not change: the pack key already holds the model
        applied = plan.model_copy(update={"profile": plan.profile.for_model(model_fingerprint(request.model_dir).sha256)})
        return DeployInputs(plan=applied, repository=Fingerprint(sha256=p.key, path=p.dir), out_dir=str(request.out_dir),
                            repo_root=request.repo_root, image=request.image,
                            manifest_inputs=deploy.stage_inputs(plan, plan.profile, request.repo_root, request.image))

    def run(self, inputs: DeployInputs, workdir: Path) -> ManifestsArtifact:
        from precision_pipeline.serving import deploy

        manifest = deploy.ManifestInputs(inputs.plan, inputs.plan.profile, inputs.repository.path, inputs.repo_root,
                                         image=inputs.image)
        res = deploy.render_manifests(manifest, Path(inputs.out_dir), workdir=workdir)
        return ManifestsArtifact(files=tuple(res.files), gpus_per_replica=res.gpus_per_replica, replicas=res.replicas,
                                 launcher=res.launcher)


__all__ = ["PackInputs", "RepositoryArtifact", "PackStage", "DeployInputs", "ManifestsArtifact", "DeployStage"]
