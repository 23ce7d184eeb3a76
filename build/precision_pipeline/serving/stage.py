"""Pack (Triton model repository) and deploy (Kubernetes manifests) as stages.

Keys: pack keys ``PackView`` (what ``serving/pack.py`` reads of the plan and the profile: limits, effective
settings, mapping, KV capacity, GPU, model, quantization, runtime, traces endpoint), so editing
``deployment.replicas`` or a gate threshold does not re-pack; deploy keys the plan it renders (the profile
as it applies to this model: gate bar, replicas, workload, ...) and the repository (the pack key)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

from pydantic import ConfigDict

from precision_pipeline.core.fingerprint import Fingerprint, fingerprint, model_fingerprint
from precision_pipeline.core.paths import REPO_ROOT
from precision_pipeline.core.stage import Artifact, Done, Frozen, Stage
from precision_pipeline.resolve.plan import Effective, Limits, Mapping as PlanMapping, ResolvedPlan
from precision_pipeline.resolve.stage import BuildRequest
from precision_pipeline.spec.profile import Quantization, Runtime


class PackView(Frozen):
    """Every field of the plan and profile that ``serving.pack.pack_repository`` reads (``compute_params``,
    ``precision_path``, ``engine_hash_of``, ``cross_check_plan``, ``skew.check_engine``), and nothing else."""

    model_name: str
    gpu_sm: Optional[int]
    mapping: PlanMapping
    limits: Limits
    effective: Effective
    kv_tokens_capacity: Optional[int]
    """``plan.memory.kv_tokens_capacity`` (None: no memory plan, which pack refuses)."""
    profile_name: str
    quantization: Quantization
    runtime: Runtime
    otlp_endpoint: Optional[str]

    @classmethod
    def of(cls, plan: ResolvedPlan) -> "PackView":
        p = plan.profile
        return cls(model_name=plan.model.name, gpu_sm=plan.gpu.sm if plan.gpu else None, mapping=plan.mapping,
                   limits=plan.limits, effective=plan.effective,
                   kv_tokens_capacity=plan.memory.kv_tokens_capacity if plan.memory else None, profile_name=p.name,
                   quantization=p.quantization, runtime=p.runtime, otlp_endpoint=p.deployment.otlp_endpoint)


class PackInputs(Frozen):
    """Keyed: what pack reads of the plan (``view``), the model's tokenizer/config files, the checkpoint and
    engine (their stage keys), where the repository is served from, the templates and the serving image."""

    model_config = ConfigDict(frozen=True, extra="forbid")  # every field a pydantic type

    view: PackView
    plan: ResolvedPlan
    unkeyed = {"plan": "carried only because serving.pack.pack_repository takes the whole plan; what it reads of "
                       "it is keyed in `view` (tests/core/test_keys.py packs two plans that differ outside the view "
                       "and finds the same repository)"}
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

    def inputs(self, plan: ResolvedPlan, request: BuildRequest, upstream: Mapping[str, Done]) -> PackInputs:
        q, e = upstream["quantize"], upstream["engine"]
        return PackInputs(view=PackView.of(plan), plan=plan, model=model_fingerprint(request.model_dir),
                          checkpoint=Fingerprint(sha256=q.key, path=q.dir), engine=Fingerprint(sha256=e.key, path=e.dir),
                          engine_built=bool(e.artifact.built), repo_root=request.repo_root,
                          repo_dir=str(Path(request.out_dir) / self.output), templates=fingerprint(REPO_ROOT / "triton_repo"),
                          image=request.image)

    def run(self, inputs: PackInputs, workdir: Path) -> RepositoryArtifact:
        from precision_pipeline.serving import pack

        res = pack.pack_repository(inputs.plan, inputs.plan.profile, inputs.model.path, inputs.checkpoint.path,
                                   inputs.engine.path, inputs.engine_built, Path(inputs.repo_dir), inputs.repo_root,
                                   workdir=workdir, image=inputs.image or None)
        return RepositoryArtifact(models=tuple(res.models), engine_present=bool(inputs.engine_built),
                                  engine_unit=res.engine_unit, engine_hash=res.engine_hash)


class LlmApiPackInputs(Frozen):
    """Keyed: what the llm_api route's pack reads (``serving/llmapi_unit.py`` ``pack_llm_api_repository``): the plan's
    view, the model's tokenizer/config files, the checkpoint and the rendered LLM-API configuration (their stage keys),
    where the repository is served from, the templates and the TensorRT-LLM line."""

    model_config = ConfigDict(frozen=True, extra="forbid")  # every field a pydantic type

    view: PackView
    plan: ResolvedPlan
    unkeyed = {"plan": "carried only because pack_llm_api_repository takes the whole plan; what it reads of it is keyed "
                       "in `view` and in the llm_api_config stage's key (the rendered model.yaml)"}
    model: Fingerprint
    checkpoint: Fingerprint
    llm_api_config: Fingerprint
    repo_root: str
    repo_dir: str
    templates: Fingerprint
    trtllm_version: str


class LlmApiPackStage(Stage[LlmApiPackInputs, RepositoryArtifact]):
    """Pack on the ``llm_api`` route: the LLM-API unit ``llm_api_<h12>`` (the gated HF checkpoint + ``1/model.yaml``
    from the ``llm_api_config`` stage) with the BLS and pre/postprocessing, in the same repository layout and
    ``pack.json`` the release machinery reads for engine units. Same stage name as the engine route's pack, so
    promote, rollout and deploy read either."""

    name = "pack"
    version = 1
    code = ("serving", "resolve", "core")
    needs = ("quantize", "llm_api_config")
    output = "model_repository"
    artifact_type = RepositoryArtifact

    def inputs(self, plan: ResolvedPlan, request: BuildRequest, upstream: Mapping[str, Done]) -> LlmApiPackInputs:
        q, c = upstream["quantize"], upstream["llm_api_config"]
        return LlmApiPackInputs(view=PackView.of(plan), plan=plan, model=model_fingerprint(request.model_dir),
                                checkpoint=Fingerprint(sha256=q.key, path=q.dir),
                                llm_api_config=Fingerprint(sha256=c.key, path=c.dir), repo_root=request.repo_root,
                                repo_dir=str(Path(request.out_dir) / self.output),
                                templates=fingerprint(REPO_ROOT / "triton_repo"), trtllm_version=plan.trtllm_version)

    def run(self, inputs: LlmApiPackInputs, workdir: Path) -> RepositoryArtifact:
        import yaml

        from precision_pipeline.engine.llm_api_config import MODEL_YAML_FILE
        from precision_pipeline.serving.llmapi_unit import pack_llm_api_repository

        model_yaml = yaml.safe_load((Path(inputs.llm_api_config.path) / MODEL_YAML_FILE).read_text(encoding="utf-8"))
        rec = pack_llm_api_repository(inputs.plan, Path(inputs.model.path), Path(inputs.checkpoint.path), model_yaml,
                                      Path(inputs.repo_dir), inputs.repo_root, version=inputs.trtllm_version,
                                      workdir=workdir)
        return RepositoryArtifact(models=tuple(rec["models"]), engine_present=False, engine_unit=rec["engine_unit"],
                                  engine_hash=rec["unit_key"])


class DeployInputs(Frozen):
    """What ``serving.deploy.render_manifests`` reads, all keyed: the plan with the profile as it applies to this
    model (its gate bar: the canary analysis and alerts; the model name, replicas, workload, ...), the repository
    (the pack stage's key and folder), the output folder, ``--repo-root`` and the image."""

    model_config = ConfigDict(frozen=True, extra="forbid")  # every field a pydantic type

    plan: ResolvedPlan
    repository: Fingerprint
    out_dir: str
    repo_root: str
    image: str


class ManifestsArtifact(Artifact):
    """``<out>/k8s``: Deployment, Service (+ PodDisruptionBudget), validated."""

    files: tuple[str, ...]
    gpus_per_replica: int
    replicas: int
    launcher: str
    image: str = ""
    """The serving image the Deployment runs (promote's and rollout's skew checks read it here)."""

    def summary(self) -> dict[str, Any]:
        return {"manifests": len(self.files), "gpus_per_replica": self.gpus_per_replica, "replicas": self.replicas,
                "launcher": self.launcher}

    def present(self, out_dir: Path) -> bool:
        return (Path(out_dir) / "k8s").is_dir()


class DeployStage(Stage[DeployInputs, ManifestsArtifact]):
    name = "deploy"
    version = 2  # 2: the artifact records the serving image
    code = ("serving", "resolve", "core")
    needs = ("pack",)
    output = "k8s"
    artifact_type = ManifestsArtifact

    def inputs(self, plan: ResolvedPlan, request: BuildRequest, upstream: Mapping[str, Done]) -> DeployInputs:
        p = upstream["pack"]
        # the gate bar of *this* model (keyed by its content) is what the canary analysis and alerts use
        applied = plan.model_copy(update={"profile": plan.profile.for_model(model_fingerprint(request.model_dir).sha256)})
        return DeployInputs(plan=applied, repository=Fingerprint(sha256=p.key, path=p.dir), out_dir=str(request.out_dir),
                            repo_root=request.repo_root, image=request.image)

    def run(self, inputs: DeployInputs, workdir: Path) -> ManifestsArtifact:
        from precision_pipeline.serving import deploy

        manifest = deploy.ManifestInputs(inputs.plan, inputs.plan.profile, inputs.repository.path, inputs.repo_root,
                                         image=inputs.image)
        res = deploy.render_manifests(manifest, Path(inputs.out_dir), workdir=workdir)
        return ManifestsArtifact(files=tuple(res.files), gpus_per_replica=res.gpus_per_replica, replicas=res.replicas,
                                 launcher=res.launcher, image=inputs.image)


class LlmApiDeployInputs(Frozen):
    """Keyed: the plan (the profile as it applies to this model), the rendered ``trtllm-serve --config`` YAML (the
    ``llm_api_config`` stage's key and folder), the repository (pack's key), ``--repo-root`` and the image."""

    model_config = ConfigDict(frozen=True, extra="forbid")  # every field a pydantic type

    plan: ResolvedPlan
    llm_api_config: Fingerprint
    repository: Fingerprint
    repo_root: str
    image: str


class LlmApiDeployStage(Stage[LlmApiDeployInputs, ManifestsArtifact]):
    """Deploy on the ``llm_api`` route, by ``deployment.server``: ``trtllm-serve`` renders the hardened trtllm-serve
    Deployment, Service and PodMonitor (``serving/trtllm_serve.py``) serving the build output's checkpoint with its
    rendered ``llm_api/trtllm-serve.yaml``; ``triton`` renders the Triton Deployment of the packed repository
    (``serving/deploy.py``, as the engine route's deploy) whose init container copies the image's LLM-API ``model.py``
    into a writable overlay of the read-only repository (``llmapi_unit.add_overlay``)."""

    name = "deploy"
    version = 2  # 2: deployment.server triton renders the Triton Deployment
    code = ("serving", "resolve", "core")
    needs = ("llm_api_config", "pack")
    output = "k8s"
    artifact_type = ManifestsArtifact

    def preflight(self, plan: ResolvedPlan, request: BuildRequest) -> None:
        """Before the first write: ``deployment.server: triton`` with a TensorRT-LLM line no Triton image ships (1.3)."""
        from precision_pipeline.core.errors import UserError
        from precision_pipeline.spec.llm_args import trtllm_line

        if plan.profile.deployment.server == "triton" and trtllm_line(plan.trtllm_version) != "1.2":
            raise UserError("deployment.server", f"is 'triton' with target.trtllm_version {plan.trtllm_version}: no Triton "
                            "image carries TensorRT-LLM 1.3 (Triton's trtllm-python-py3 images ship 1.2.1; server issue "
                            "#8805).", "set deployment.server: trtllm-serve, or target.trtllm_version: 1.2.1.")

    def inputs(self, plan: ResolvedPlan, request: BuildRequest, upstream: Mapping[str, Done]) -> LlmApiDeployInputs:
        c, p = upstream["llm_api_config"], upstream["pack"]
        applied = plan.model_copy(update={"profile": plan.profile.for_model(model_fingerprint(request.model_dir).sha256)})
        return LlmApiDeployInputs(plan=applied, llm_api_config=Fingerprint(sha256=c.key, path=c.dir),
                                  repository=Fingerprint(sha256=p.key, path=p.dir), repo_root=request.repo_root,
                                  image=request.image)

    def run(self, inputs: LlmApiDeployInputs, workdir: Path) -> ManifestsArtifact:
        import yaml

        from precision_pipeline.engine.llm_api_config import TRTLLM_SERVE_FILE
        from precision_pipeline.serving import deploy, trtllm_serve

        if inputs.plan.profile.deployment.server == "triton":
            manifest = deploy.ManifestInputs(inputs.plan, inputs.plan.profile, inputs.repository.path, inputs.repo_root,
                                             image=inputs.image)
            res = deploy.render_manifests(manifest, Path(workdir).parent, workdir=workdir)
            return ManifestsArtifact(files=tuple(res.files), gpus_per_replica=res.gpus_per_replica, replicas=res.replicas,
                                     launcher=res.launcher, image=inputs.image)
        llm_args = yaml.safe_load((Path(inputs.llm_api_config.path) / TRTLLM_SERVE_FILE).read_text(encoding="utf-8"))
        si = trtllm_serve.ServeInputs(plan=inputs.plan, profile=inputs.plan.profile, llm_args=llm_args,
                                      repo_root=inputs.repo_root, image=inputs.image)
        files = trtllm_serve.render_trtllm_serve(si, Path(workdir), workdir=workdir)
        return ManifestsArtifact(files=tuple(files), gpus_per_replica=int(inputs.plan.mapping.world_size),
                                 replicas=inputs.plan.profile.deployment.replicas, launcher=trtllm_serve.SERVER,
                                 image=inputs.image)


__all__ = ["PackView", "PackInputs", "RepositoryArtifact", "PackStage", "LlmApiPackInputs", "LlmApiPackStage", "DeployInputs", "ManifestsArtifact", "DeployStage", "LlmApiDeployInputs",
           "LlmApiDeployStage"]
