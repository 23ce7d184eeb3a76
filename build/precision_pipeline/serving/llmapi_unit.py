"""The **LLM-API unit** of the versioned Triton repository: one Triton model per HF checkpoint served through
TensorRT-LLM's LLM API (the llm_api route), beside the engine units (``tensorrt_llm_<h12>``, serving/pack.py).

Layout (``llm_api_<h12>/``; the consumer's facts: serving/llmapi_contract.py)::

    config.pbtxt          backend "python", text in / text out (triton_repo/all_models/llmapi/tensorrt_llm/config.pbtxt,
                          name filled in); no max_batch_size / transaction policy (model.yaml owns them)
    1/model.yaml          the LLM-API model's YAML: ``model`` = the serving-side path of ``checkpoint/``, ``backend:
                          pytorch``, ``triton_config {max_batch_size: 0, decoupled}``, the LLM arguments
    checkpoint/           the HF (unified) checkpoint: hard links of the build's ``checkpoint/``
    cpu_reference.json    read only by the CPU stand-in: the HF model folder (tokenizer, architecture), the
                          TensorRT-LLM line model.yaml was checked for, and the project root (for ``precision_pipeline.gate.model.load_checkpoint_model``)
    precision_path.json   the precision path this unit serves (as engine units: the BLS labels responses with it)

``1/model.py`` (and ``1/helpers.py``) are **not** part of the unit (not in ``unit_files``, not in the content key):
they are the server's code, put there where the unit is served (``SERVING_SIDE_FILES``):

* on NVIDIA's Triton TensorRT-LLM image (``trtllm-python-py3``, TensorRT-LLM 1.2.1): copied from the image's own
  LLM-API model folder (llmapi_contract.IMAGE_MODEL_DIRS) by ``overlay_command`` -- the Deployment's init step, into
  a writable overlay of the read-only repository -- so the model that serves is NVIDIA's, of the image's TensorRT-LLM
  version, and no NVIDIA code is copied into this repository;
* on this machine: ``install_stand_in`` copies the CPU stand-in ``triton_repo/backends/llmapi_cpu_reference/model.py``
  (NOT TensorRT-LLM: greedy decoding of the real model dequantized from the checkpoint, refusing what the real
  model refuses) as ``1/model.py``.

The unit's name is ``llm_api_`` + 12 hex digits of its **content key**: sha256 over every file of the unit written
under the placeholder name ``PLACEHOLDER`` (so model.yaml's ``model`` path, which contains the name, is keyed as the
placeholder's). A serving repository gets verified copies, as for engine units.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from precision_pipeline.core.errors import UserError
from precision_pipeline.core.paths import REPO_ROOT, SOURCE_ROOT
from precision_pipeline.core.store import hash_file, hash_obj, read_json
from precision_pipeline.serving import llmapi_contract as contract
from precision_pipeline.serving import pack, templates

PREFIX = "llm_api_"
PLACEHOLDER = f"{PREFIX}000000000000"
TEMPLATE = REPO_ROOT / "triton_repo" / "all_models" / "llmapi" / "tensorrt_llm" / "config.pbtxt"
STAND_IN = REPO_ROOT / "triton_repo" / "backends" / "llmapi_cpu_reference" / "model.py"
CHECKPOINT_DIR = "checkpoint"
SERVING_SIDE_FILES = tuple(f"1/{n}" for n in contract.IMAGE_MODEL_FILES)
"""Files of ``1/`` the serving side provides (never recorded in ``unit_files``)."""
ROUTE = "llm_api"


def unit_name(key: str) -> str:
    """Triton model name of an LLM-API unit: ``llm_api_`` + the first 12 hex digits of its content key."""
    return f"{PREFIX}{key[:12]}"


def is_llm_api_unit(name: str) -> bool:
    return name.startswith(PREFIX) and re.fullmatch(r"[0-9a-f]{12}", name[len(PREFIX):]) is not None


@dataclass
class LlmApiUnit:
    """What ``pack_llm_api_unit`` wrote: the unit's name, content key, ``unit_files`` ({path: [size, sha256]})
    and the model.yaml it holds (as written, with the serving-side ``model`` path)."""

    name: str
    key: str
    unit_files: dict[str, list]
    model_yaml: dict[str, Any]
    route: str = ROUTE
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"unit": self.name, "unit_key": self.key, "unit_files": self.unit_files, "route": self.route,
                "model_yaml": self.model_yaml, "notes": self.notes}


def render_config(name: str) -> str:
    """The unit's config.pbtxt text (the template with its name); parsed with the 2.51 schema and checked against
    the LLM-API model's contract (``llmapi_contract.check_unit_config``): UserError (exit 2) otherwise."""
    text = templates.render(TEMPLATE.read_text(), {"model_name": name}, f"{name}/config.pbtxt", templates.PBTXT)
    cfg = pack.parse_model_config(text, f"{name}/config.pbtxt")
    refused = contract.check_unit_config(cfg)
    if refused:
        raise UserError(f"{name}/config.pbtxt", "the LLM-API model would refuse it: " + "; ".join(refused),
                        "fix triton_repo/all_models/llmapi/tensorrt_llm/config.pbtxt.")
    return text


def unit_model_yaml(model_yaml: Mapping[str, Any], model_path: str, version: str) -> dict[str, Any]:
    """``model_yaml`` (the llm_api_config stage's ``llm_api/model.yaml``, parsed) with ``model`` set to
    ``model_path`` (the checkpoint's serving-side path); UserError (field ``llm_api/model.yaml``, exit 2) naming
    every key the real LLM-API model of TensorRT-LLM ``version`` would refuse (``llmapi_contract.check_model_yaml``)."""
    d = copy.deepcopy(dict(model_yaml))
    d["model"] = model_path
    refused = contract.check_model_yaml(d, version)
    if refused:
        raise UserError("llm_api/model.yaml", "the Triton LLM-API model would refuse it: " + "; ".join(refused),
                        "fix the profile's llm_api section (or the renderer) and build again.")
    return d


def dump_yaml(d: Mapping[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(dict(d), sort_keys=False, default_flow_style=False)


def write_unit(unit_dir: Path, config_text: str, model_yaml: Mapping[str, Any], checkpoint_dir: Path,
               model_dir: Path, path: Mapping[str, str], version: str) -> None:
    """Write one LLM-API unit into ``unit_dir`` (created): config.pbtxt, 1/model.yaml, checkpoint/ (hard links),
    cpu_reference.json, precision_path.json. No 1/model.py (``SERVING_SIDE_FILES``)."""
    (unit_dir / "1").mkdir(parents=True)
    (unit_dir / "config.pbtxt").write_text(config_text)
    (unit_dir / "1" / contract.MODEL_YAML).write_text(dump_yaml(model_yaml))
    pack.link_tree(checkpoint_dir, unit_dir / CHECKPOINT_DIR)
    (unit_dir / pack.CPU_REFERENCE_FILE).write_text(json.dumps({
        "note": "Read only by the CPU stand-in of the LLM-API model (triton_repo/backends/llmapi_cpu_reference); "
                "TensorRT-LLM's LLM-API model reads 1/model.yaml.",
        "checkpoint_dir": CHECKPOINT_DIR, "trtllm_version": version, "hf_model_dir": str(Path(model_dir).resolve()),
        "project_root": str(SOURCE_ROOT)}, indent=2) + "\n")
    (unit_dir / pack.PRECISION_PATH_FILE).write_text(json.dumps(dict(path), indent=2) + "\n")


def pack_llm_api_unit(repo_dir: Path, model_yaml: Mapping[str, Any], checkpoint_dir: Path, model_dir: Path,
                      repo_root: str, path: Mapping[str, str], *, version: str, repo_name: str | None = None,
                      routing: Mapping[str, Any] | None = None) -> LlmApiUnit:
    """Write the LLM-API unit for ``checkpoint_dir`` into the repository being written at ``repo_dir``.

    ``model_yaml``: the rendered Triton model.yaml (its ``model`` is replaced by the serving-side path
    ``<repo_root>/<repo_dir name>/<unit>/checkpoint``); ``path``: the precision path (``unit`` and ``route`` are
    filled in); ``version``: the TensorRT-LLM line the yaml is checked for; ``repo_name``: the repository's name in
    the serving container (default ``repo_dir``'s, which differs while it is staged); ``routing``: the profile's
    routing table (``pack.routing_files``), written as the unit's ``routing.json`` and part of its content key, as for
    an engine unit (the BLS reads the current release's table whichever kind the unit is). The unit is written under
    ``PLACEHOLDER``, keyed, then renamed to ``llm_api_<h12>``. Raises UserError (exit 2) for a relative
    ``repo_root``, a missing checkpoint, or a config/model.yaml the real model refuses."""
    repo_dir, checkpoint_dir = Path(repo_dir), Path(checkpoint_dir)
    if not str(repo_root).startswith("/"):
        raise UserError("--repo-root", f"{repo_root!r} is not an absolute path.",
                        "give the absolute path the output will have in the serving container.")
    if not (checkpoint_dir / "config.json").is_file():
        raise UserError("checkpoint", f"{checkpoint_dir} has no config.json.", "quantize again (the llm_api route "
                        "exports a unified HF checkpoint).")

    def render(name: str) -> tuple[str, dict, dict]:
        yml = unit_model_yaml(model_yaml, pack.serving_path(repo_root, repo_name or repo_dir.name, name, CHECKPOINT_DIR), version)
        return render_config(name), yml, {**path, "unit": name, "serving_route": ROUTE}

    staged = repo_dir / PLACEHOLDER
    text, yml, ppath = render(PLACEHOLDER)
    write_unit(staged, text, yml, checkpoint_dir, model_dir, ppath, version)
    if routing is not None:
        (staged / pack.ROUTING_FILE).write_text(json.dumps(dict(routing), indent=2) + "\n")
    key = hash_obj(pack.unit_digests(staged))
    name = unit_name(key)
    text, yml, ppath = render(name)
    (staged / "config.pbtxt").write_text(text)
    (staged / "1" / contract.MODEL_YAML).write_text(dump_yaml(yml))
    (staged / pack.PRECISION_PATH_FILE).write_text(json.dumps(ppath, indent=2) + "\n")
    os.rename(staged, repo_dir / name)
    return LlmApiUnit(name=name, key=key, unit_files=pack.unit_digests(repo_dir / name), model_yaml=yml)


MODEL_YAML_FILE = f"1/{contract.MODEL_YAML}"


def installed_model_yaml(unit_src: Path, files: Mapping[str, list], model_path: str) -> str:
    """The text of an LLM-API unit's ``1/model.yaml`` as installed in a serving repository: the build's (its size and
    sha256 as ``files`` records, else UserError) with ``model`` = ``model_path`` (the unit's ``checkpoint/`` there).
    The one rewrite an install makes to such a unit (an engine unit's is ``gpt_model_path``)."""
    import yaml

    src = Path(unit_src) / MODEL_YAML_FILE
    row = files.get(MODEL_YAML_FILE)
    if row is None or not src.is_file() or src.stat().st_size != row[0] or hash_file(src) != row[1]:
        raise UserError(str(src), "is not the model.yaml pack recorded (missing, truncated or edited after the pack).",
                        "rebuild the output (`invoke build --profile P --out OUT`), then promote it again.")
    d = yaml.safe_load(src.read_text())
    d["model"] = model_path
    return dump_yaml(d)


def llm_api_precision_path(plan) -> dict[str, str]:
    """The precision path of an LLM-API unit (``precision_path.json``; the BLS labels responses and metrics with it):
    ``model``, ``profile``, ``gemm`` (quant_algo), ``kv`` (kv_cache_quant_algo), ``dtype``. No kernel settings: on this
    route the runtime chooses them (reference llm-api-route.md "Kernels are the runtime's choice")."""
    q = plan.profile.quantization
    return {"model": plan.model.name, "profile": plan.profile.name, "gemm": q.quant_algo.value,
            "kv": q.kv_cache_quant_algo.value, "dtype": q.dtype}


REPO_MODELS = ("preprocessing", "postprocessing", "tensorrt_llm_bls")
"""The fixed models of an llm_api repository: the BLS (text in, dispatching to the LLM-API unit, or to an engine unit a
release falls back to, which needs pre/postprocessing). No ensemble: it can only chain token tensors."""


def pack_llm_api_repository(plan, model_dir: Path, checkpoint_dir: Path, model_yaml: Mapping[str, Any],
                            out_dir: Path, repo_root: str, *, version: str, workdir: Path | None = None) -> dict:
    """The llm_api route's pack: ``out_dir`` (``model_repository/``, atomic replace; ``workdir``: written there for
    the stage runner to rename) with ``REPO_MODELS`` rendered as for engine builds (``pack.compute_params`` /
    ``render_all``; the BLS's ``tensorrt_llm_model_name`` = the LLM-API unit), the unit (``pack_llm_api_unit``) and
    ``pack.json`` ({engine_unit: the unit's name (the key the release machinery reads), unit_key, unit_files,
    route: llm_api, models, model_yaml, trtllm_version}). The profile is the plan's. Returns pack.json's content.
    UserError as pack's."""
    import contextlib

    from precision_pipeline.core.store import atomic_dir, make_readable

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if not (model_dir / "tokenizer.json").is_file():
        raise UserError("model", f"{model_dir} has no tokenizer.json.", "use an HF model folder with a fast tokenizer.")
    with (contextlib.nullcontext(Path(workdir)) if workdir is not None else atomic_dir(out_dir)) as tmp:
        u = pack_llm_api_unit(tmp, model_yaml, checkpoint_dir, model_dir, repo_root, llm_api_precision_path(plan),
                              version=version, repo_name=out_dir.name,
                              routing=pack.routing_files(plan.profile).get(pack.ROUTING_FILE))
        params, _ = pack.compute_params(plan, plan.profile, model_dir, u.key, repo_root, out_dir.name, unit=u.name)
        texts = pack.render_all({m: params[m] for m in REPO_MODELS})
        for m in REPO_MODELS:
            (tmp / m / "1").mkdir(parents=True)
            for src in (pack.TEMPLATES_DIR / m / "1").glob("*.py"):
                shutil.copy2(src, tmp / m / "1" / src.name)
            (tmp / m / "config.pbtxt").write_text(texts[m])
        (tmp / "preprocessing" / "tokenizer").mkdir()
        for name in pack.TOKENIZER_FILES:
            if (model_dir / name).is_file():
                shutil.copy2(model_dir / name, tmp / "preprocessing" / "tokenizer" / name)
        record = {"engine_unit": u.name, "unit_key": u.key, "unit_files": u.unit_files, "route": ROUTE,
                  "models": sorted([*REPO_MODELS, u.name]), "model_yaml": u.model_yaml, "trtllm_version": version,
                  "out_dir": str(out_dir)}
        (tmp / pack.PACK_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        make_readable(tmp)
    return record


def install_stand_in(unit_dir: Path) -> Path:
    """Put the CPU stand-in (NOT TensorRT-LLM) at ``<unit_dir>/1/model.py`` so this machine's Triton serves the unit
    (a copy; the file is the serving side's, not the unit's). Returns the path written."""
    dst = Path(unit_dir) / "1" / "model.py"
    shutil.copyfile(STAND_IN, dst)
    return dst


OVERLAY_MOUNT = "/serving"
"""Where the Triton Deployment of an LLM-API release mounts its writable emptyDir (``deploy.py``)."""
OVERLAY_REPOSITORY = f"{OVERLAY_MOUNT}/model_repository"
"""The repository Triton serves there: the overlay ``OVERLAY_SCRIPT`` builds over the read-only one."""
OVERLAY_SCRIPT = """set -eu
src="$1"; dst="$2"; shift 2
code=""
for d in "$@"; do
  if [ -f "$d/model.py" ] && [ -f "$d/helpers.py" ]; then code="$d"; break; fi
done
if [ -z "$code" ]; then
  echo "llm-api-overlay: this image has no model.py + helpers.py of TensorRT-LLM's LLM-API model in: $*" >&2; exit 1
fi
rm -rf "$dst"; mkdir -p "$dst"
ln -sfn "${src%/*}/releases.json" "${dst%/*}/releases.json"
for p in "$src"/*; do
  [ -e "$p" ] || continue
  n="${p##*/}"
  case "$n" in
    llm_api_*)
      mkdir -p "$dst/$n/1"
      for f in "$p"/*; do
        [ -e "$f" ] || continue
        if [ "${f##*/}" != 1 ]; then ln -s "$f" "$dst/$n/${f##*/}"; fi
      done
      for f in "$p"/1/*; do
        [ -e "$f" ] || continue
        case "${f##*/}" in model.py|helpers.py|__pycache__) ;; *) ln -s "$f" "$dst/$n/1/${f##*/}" ;; esac
      done
      cp "$code/model.py" "$code/helpers.py" "$dst/$n/1/"
      echo "llm-api-overlay: $n/1/{model.py,helpers.py} from $code" ;;
    *) ln -s "$p" "$dst/$n" ;;
  esac
done
"""
"""The init step of a Triton Deployment serving LLM-API units (``sh -c OVERLAY_SCRIPT llm-api-overlay SRC DST DIR...``):
the repository volume ``SRC`` is read-only (the hardened pod), so it builds ``DST`` on a writable emptyDir: a symlink
per entry of ``SRC`` (models, pack.json; a model folder's later files, e.g. the BLS's route.json, show through), a
symlink ``DST/../releases.json`` to ``SRC/../releases.json`` (where the BLS reads the release's fallback: the parent of
its repository; it may not exist yet), and
for each ``llm_api_*`` unit a folder of symlinks to its files plus copies of ``model.py`` and ``helpers.py`` from the
first ``DIR`` holding both (the image's LLM-API model: ``llmapi_contract.IMAGE_MODEL_DIRS``; none: exit 1, the pod
does not start, and the log names the folders tried). A unit installed on the volume after the pod started is not
in ``DST``: a new release renders a new pod template (its unit label), whose init step sees it."""


def overlay_command(src_repo: str, dst_repo: str = OVERLAY_REPOSITORY,
                    code_dirs: tuple[str, ...] = contract.IMAGE_MODEL_DIRS) -> list[str]:
    """The init container's argv: ``OVERLAY_SCRIPT`` over the repository ``src_repo`` (its serving-side path) into
    ``dst_repo``, taking the LLM-API model files from the first of ``code_dirs`` that has them."""
    return ["/bin/sh", "-c", OVERLAY_SCRIPT, "llm-api-overlay", src_repo, dst_repo, *code_dirs]


# ---------------------------------------------------------------------------------------------------------------
# The Triton Deployment of LLM-API units (serving/deploy.py renders it; these are the LLM-API parts)

OVERLAY_VOLUME = "serving-repository"
OVERLAY_SIZE = "64Mi"
"""The overlay's emptyDir: symlinks, two copied .py files per unit and their bytecode, far below this."""
OTLP_PROTOCOL_ENV = {"name": "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "value": "http/protobuf"}
"""model.yaml's ``otlp_traces_endpoint`` is an OTLP/HTTP URL (``<deployment.otlp_endpoint>/v1/traces``), but TensorRT-LLM
sends spans over gRPC unless this variable says otherwise (``tensorrt_llm/llmapi/tracing.py`` ``get_span_exporter``:
``os.environ.get(OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, "grpc")``, NVIDIA/TensorRT-LLM @ 0fb7f758). The trtllm-serve
Deployment sets the same (``k8s/trtllm-serve/deployment.yaml``)."""
INIT_CONTAINER = "llm-api-model-code"
INIT_CPU, INIT_MEMORY = "500m", "256Mi"
"""The init step's requests (= memory limit): ``sh``, ``ln`` and ``cp`` of two small files per unit."""


def triton_deployment_notes(repo_dir: Path, units: list[str], world: int, engine_units: list[str], group: int,
                            image_trtllm: str | None, image: str) -> list[str]:
    """Refuse (UserError, exit 2) what a Triton Deployment cannot serve of the LLM-API ``units`` in ``repo_dir``; returns
    notes. ``world``: GPUs per replica (tp x pp of the plan); ``engine_units``: engine units loaded beside them;
    ``group``: pods per replica (> 1: a LeaderWorkerSet); ``image_trtllm``: the image's TensorRT-LLM version (None:
    unknown). Refused: a multi-pod group or engine units of world > 1 next to an LLM-API unit (the LLM API starts its
    own tp x pp workers inside the one tritonserver process, the engine ranks need mpirun), a unit whose model.yaml
    asks for another tp x pp, ``triton_config.decoupled: true`` (llmapi_contract fact 9), a unit packed for another
    TensorRT-LLM line than the image's."""
    import yaml

    if group > 1:
        raise UserError("deployment.gpus_per_node", f"splits a replica over {group} pods, but TensorRT-LLM's LLM-API model "
                        "starts its tp x pp workers inside the one tritonserver of its pod.",
                        "remove deployment.gpus_per_node (or raise it to tp_size x pp_size), or use route: engine.")
    if world > 1 and engine_units:
        raise UserError("deployment.warm_fallback", f"loads engine unit(s) {', '.join(engine_units)} beside the LLM-API "
                        f"unit(s) on {world} GPUs: engine ranks need mpirun, the LLM API runs its own workers.",
                        "set deployment.warm_fallback: false, or serve one route per Deployment.")
    notes = [f"LLM-API unit(s) {', '.join(units)}: the init container {INIT_CONTAINER} builds {OVERLAY_REPOSITORY} (a "
             "writable overlay of the read-only repository) with the image's LLM-API model.py/helpers.py; tritonserver "
             "serves the overlay."]
    for u in units:
        path = Path(repo_dir) / u / MODEL_YAML_FILE
        d = yaml.safe_load(path.read_text()) if path.is_file() else None
        if not isinstance(d, dict):
            raise UserError(str(path), "is missing or not a mapping.", "re-pack the build output.")
        tp, pp = int(d.get("tensor_parallel_size", 1) or 1), int(d.get("pipeline_parallel_size", 1) or 1)
        if tp * pp != world:
            raise UserError(str(path), f"asks for tp {tp} x pp {pp} = {tp * pp} GPU(s), the plan for {world}.",
                            "deploy with the plan the unit was built from.")
        if (d.get(contract.TRITON_CONFIG_KEY) or {}).get("decoupled") is True:
            raise UserError("runtime.decoupled_mode", f"is true for {u}, but the Triton Deployment starts tritonserver with "
                            "--disable-auto-complete-config, so model.yaml's triton_config.decoupled never reaches Triton and "
                            "streamed requests hang (serving/llmapi_contract.py fact 9).",
                            "set runtime.decoupled_mode: false, or deployment.server: trtllm-serve.")
        ref = read_json(Path(repo_dir) / u / pack.CPU_REFERENCE_FILE) or {}
        want = str(ref.get("trtllm_version") or "")
        if image_trtllm and want and want.split(".")[:2] != image_trtllm.split(".")[:2]:
            raise UserError("image", f"{image} ships TensorRT-LLM {image_trtllm}, but {u}'s model.yaml was checked for "
                            f"{want}.", "pass the trtllm-python-py3 image of that line (serving/images.py), or rebuild "
                            "with target.trtllm_version of the image's line.")
        if not image_trtllm:
            notes.append(f"{image}: its TensorRT-LLM version is unknown here; {u} was checked for {want or '?'}.")
    return notes


def add_overlay(pod: dict, src_repo: str) -> None:
    """Turn the hardened Triton pod template ``pod`` (``{"metadata", "spec"}``, mutated) into one serving LLM-API units:
    an init container (the main container's image, securityContext, env and read-only artifacts mount; argv
    ``overlay_command(src_repo)``), the ``OVERLAY_VOLUME`` emptyDir, mounted writable there and read-only at
    ``OVERLAY_MOUNT`` in the main container (whose ``--model-repository`` the caller points at
    ``OVERLAY_REPOSITORY``), and ``OTLP_PROTOCOL_ENV`` in the main container."""
    spec = pod["spec"]
    main = spec["containers"][0]
    artifacts = [m for m in main["volumeMounts"] if m["name"] == "artifacts"]
    spec["initContainers"] = [{
        "name": INIT_CONTAINER, "image": main["image"], "imagePullPolicy": main.get("imagePullPolicy", "IfNotPresent"),
        "command": overlay_command(src_repo), "securityContext": copy.deepcopy(main["securityContext"]),
        "env": copy.deepcopy(main.get("env", [])),
        "resources": {"requests": {"cpu": INIT_CPU, "memory": INIT_MEMORY}, "limits": {"memory": INIT_MEMORY}},
        "volumeMounts": [*copy.deepcopy(artifacts), {"name": OVERLAY_VOLUME, "mountPath": OVERLAY_MOUNT}]}]
    main["volumeMounts"].append({"name": OVERLAY_VOLUME, "mountPath": OVERLAY_MOUNT, "readOnly": True})
    main.setdefault("env", []).append(dict(OTLP_PROTOCOL_ENV))
    spec["volumes"].append({"name": OVERLAY_VOLUME, "emptyDir": {"sizeLimit": OVERLAY_SIZE}})
