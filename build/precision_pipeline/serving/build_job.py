"""``invoke build --profile P --on k8s``: a Kubernetes Job that builds the engine where it will be served.

The Job (template ``k8s/jobs/engine-build-job.yaml``) runs in the *serving image* (``--image``,
default ``deploy.DEFAULT_IMAGE``), so the TensorRT-LLM / TensorRT that build the engine are the ones
that load it; ``nodeSelector`` ``nvidia.com/gpu.product`` = the profile GPU's GFD label
(``k8s.gpu_product_label``), ``nvidia.com/gpu`` = tp x pp (``trtllm-build --workers`` = world size:
one build process per rank, capped by the visible GPUs; tensorrt_llm/commands/build.py), and the
artifacts PVC mounted read-write at the build output's own absolute path, so the engine stage's key
(which holds that path) is the same on both sides and the CPU side's next ``invoke build`` packs the
Job's engine as a cache hit (engine/stage.py ``built_elsewhere``). It runs
``python3 -m precision_pipeline.engine.job --out OUT [--strict]``: the engine stage alone from the
recorded, gated checkpoint (it refuses a checkpoint whose gate did not pass, and never quantizes),
with ``PYTHONPATH`` at the pipeline source on the same volume (``<out>/.precision-pipeline/build``,
copied there by the operator; the serving image has no copy of this project). Multi-GPU engines need
no MPI for the build: ``trtllm-build`` spawns its workers itself; MPI (``mpirun -n N``) is what the
engine *gate* and serving use (gate/engine_gate.py, serving/deploy.py).

The manifest is validated like the deploy stage's (``k8s.validate_manifest``: kubernetes-validate's
strict schemas for ``k8s.K8S_VERSION`` plus the API-server rules).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import yaml

from precision_pipeline.core.errors import UserError
from precision_pipeline.core.paths import REPO_ROOT
from precision_pipeline.engine.provenance import IMAGE_ENV
from precision_pipeline.serving import deploy, k8s

TEMPLATE = REPO_ROOT / "k8s" / "jobs" / "engine-build-job.yaml"
SOURCE_SUBDIR = ".precision-pipeline/build"
DEADLINE_S = 6 * 3600


def render_job(plan, out_dir: Path, image: str = deploy.DEFAULT_IMAGE, *, namespace: str = "default",
               pvc_name: str = deploy.DEFAULT_PVC, strict: bool = True, k8s_version: str = k8s.K8S_VERSION,
               model_dir: Optional[Path] = None, golden_limit: Optional[int] = None) -> str:
    """The validated Job manifest (YAML text) that runs the engine stage and the engine gate of ``plan``
    for build output ``out_dir``. ``model_dir``: the engine gate's reference model, passed as ``--model``
    (read at that path in the pod; None: the one the CPU build recorded); ``golden_limit``: as
    ``invoke build --golden-limit``."""
    deploy.check_image(image, "--image")
    out = str(Path(out_dir).resolve())
    gpu = plan.gpu
    world = int(plan.mapping.world_size)
    profile = plan.profile.name
    name = k8s.k8s_name(profile, prefix="engine-build-")
    labels = {"app.kubernetes.io/name": "engine-build", "app.kubernetes.io/instance": name,
              "app.kubernetes.io/part-of": k8s.LABEL_PREFIX, "app.kubernetes.io/managed-by": k8s.LABEL_PREFIX,
              f"{k8s.LABEL_PREFIX}/profile": profile[:63].rstrip("-._")}
    params = {
        "name": name, "namespace": namespace, "labels": labels,
        "annotations": {f"{k8s.LABEL_PREFIX}/profile": profile, f"{k8s.LABEL_PREFIX}/gpu": str(gpu.id),
                        f"{k8s.LABEL_PREFIX}/parallel": f"tp{plan.mapping.tp_size}xpp{plan.mapping.pp_size}"},
        "deadline_s": DEADLINE_S, "node_selector": {k8s.GPU_PRODUCT_LABEL: k8s.gpu_product_label(gpu.name)},
        "image": image, "command": ["python3", "-m", "precision_pipeline.engine.job"],
        "args": ["--out", out, *(["--strict"] if strict else []),
                 *(["--model", str(Path(model_dir).resolve())] if model_dir is not None else []),
                 *(["--golden-limit", str(int(golden_limit))] if golden_limit is not None else [])], "out_dir": out,
        "env": [{"name": "PYTHONPATH", "value": f"{out}/{SOURCE_SUBDIR}"}, {"name": IMAGE_ENV, "value": image},
                {"name": "OMP_WAIT_POLICY", "value": "PASSIVE"}],
        "gpus": world, "pvc_name": pvc_name, "shm_size": f"{max(2, 1 + world)}Gi",
    }
    where = "k8s/jobs/engine-build-job.yaml"
    text = k8s.render_template(TEMPLATE.read_text(), params, where)
    doc = k8s.parse_manifest(text, where)
    k8s.validate_manifest(doc, where, k8s_version)
    return (f"# Rendered by build/precision_pipeline/serving/build_job.py: engine build Job for {profile} "
            f"({gpu.name}, {world} GPU(s)).\n# Validated against Kubernetes {k8s_version} (strict).\n"
            + yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, width=1000))


def apply_and_follow(text: str, run=None) -> Optional[int]:
    """With a kubectl context: apply the Job, follow its logs, return the Job's exit (0 ok, 1 failed); None
    without kubectl or a current context (the caller prints the manifest instead). ``kubectl apply`` refusing
    the Job (RBAC, a missing namespace, admission) is a UserError (exit 2) quoting kubectl, never a traceback."""
    import shutil
    import subprocess

    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return None
    run = run or subprocess.run
    ctx = run([kubectl, "config", "current-context"], capture_output=True, text=True)
    if ctx.returncode != 0 or not ctx.stdout.strip():
        return None
    doc = yaml.safe_load(text)
    name, ns = doc["metadata"]["name"], doc["metadata"]["namespace"]
    applied = run([kubectl, "apply", "-f", "-"], input=text, text=True, capture_output=True)
    if applied.returncode != 0:
        why = " ".join(((applied.stderr or "") + " " + (applied.stdout or "")).split())[:400] or f"exit {applied.returncode}"
        raise UserError("--on", f"kubectl apply refused the Job {ns}/{name} (context {ctx.stdout.strip()!r}): {why}",
                        "fix what kubectl says (namespace, RBAC, the artifacts PVC), or run without a kubectl "
                        "context to print the manifest and apply it yourself.")
    run([kubectl, "-n", ns, "wait", "--for=condition=Ready", "pod", "-l", f"job-name={name}", "--timeout=30m"])
    run([kubectl, "-n", ns, "logs", "-f", f"job/{name}"])
    done = run([kubectl, "-n", ns, "wait", "--for=condition=Complete", f"job/{name}", "--timeout=1s"],
               capture_output=True, text=True)
    return 0 if done.returncode == 0 else 1


__all__ = ["render_job", "apply_and_follow", "TEMPLATE"]
