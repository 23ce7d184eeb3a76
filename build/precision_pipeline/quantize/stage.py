"""Quantize as a stage: typed inputs (what changes the checkpoint) and the checkpoint artifact.

Two input kinds: ``QuantizeInputs`` (ModelOpt PTQ + export of the model) and ``ReuseInputs``
(``--checkpoint``: the reused checkpoint is copied, and its content fingerprint is the key).
The code key covers quantize/ (ptq, search, calibration, moe_reshard), checkpoint/, spec/, core/.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from precision_pipeline.core.fingerprint import Fingerprint, fingerprint, model_fingerprint
from precision_pipeline.core.stage import Artifact, Done, Frozen, Stage
from precision_pipeline.quantize.job import QuantizeJob, job_of
from precision_pipeline.spec.formats import GEMM
from precision_pipeline.spec.profile import Profile


class QuantizeInputs(Frozen):
    """Exactly what the quantize run reads: the model, the resolved job (``quantize.job.QuantizeJob``: family,
    quantization and calibration sections, tp_size, MoE layout, group size, logits dtype), a calibration file's
    content, and where and in what dtype it runs. Every field is keyed except those declared ``unkeyed`` with their
    reason (a user dataset's path: its content is keyed here, so the same file moved or copied does not re-quantize)."""

    model: Fingerprint
    job: QuantizeJob
    calibration_data: Optional[Fingerprint] = None
    device: str = "cpu"
    """Where calibration and the search run (``spec.device.DeviceChoice.device``)."""
    compute_dtype: str = "float32"
    """Their dtype: FP32 on the CPU, the profile's ``quantization.dtype`` on CUDA."""


class ReuseInputs(Frozen):
    """``--checkpoint``: the reused checkpoint's content is all that decides the artifact."""

    checkpoint: Fingerprint


class CheckpointArtifact(Artifact):
    """The exported checkpoint (``<out>/checkpoint``: a TensorRT-LLM checkpoint, or on the llm_api route ModelOpt's
    unified HF checkpoint, ``checkpoint.reader.checkpoint_layout``), as read back from its files."""

    quant_algo: Optional[str]
    kv_cache_quant_algo: Optional[str]
    logits_dtype: Optional[str]
    checkpoint_bytes: int
    calibration: Optional[dict[str, Any]] = None
    effective_bits: Optional[float] = None
    per_layer_counts: Optional[dict[str, int]] = None
    layers: dict[str, Any]
    """The checkpoint GEMM by GEMM (``checkpoint.reader.layer_table``): plan.json shows it as ``layers``."""

    def summary(self) -> dict[str, Any]:
        out = {"quant_algo": self.quant_algo, "kv_cache_quant_algo": self.kv_cache_quant_algo,
               "logits_dtype": self.logits_dtype, "checkpoint_bytes": self.checkpoint_bytes, "calibration": self.calibration}
        if self.quant_algo is not None and GEMM.get(self.quant_algo) is not None and GEMM[self.quant_algo].per_layer:
            out["effective_bits"] = self.effective_bits
            out["per_layer_counts"] = self.per_layer_counts
        return out

    def present(self, out_dir: Path) -> bool:
        return (Path(out_dir) / "checkpoint" / "config.json").is_file()

    def plan_view(self) -> dict[str, Any]:
        return {"layers": self.layers}


def _calibration_file(profile: Profile) -> Optional[Fingerprint]:
    ds = profile.calibration.dataset
    if ds == "builtin":
        return None
    p = Path(ds).expanduser()
    return fingerprint(p) if p.exists() else None


def copy_checkpoint(src: Path, dst: Path) -> None:
    """Copy the ``--checkpoint`` folder ``src`` into the stage's temporary folder ``dst``, stopping at the first
    failure. A full disk (ENOSPC), a file-size limit (``ulimit -f``: EFBIG) or any other OSError is a UserError
    (exit 2) naming the file and the cause; the runner then removes the partial copy (``core.store.atomic_dir``),
    so nothing is left half-written and the previous checkpoint stays. (``shutil.copytree`` would go on after a
    failure and raise ``shutil.Error`` with every file at the end.)"""
    from precision_pipeline.core.errors import UserError

    src, dst = Path(src), Path(dst)
    for f in sorted(src.rglob("*")):
        target = dst / f.relative_to(src)
        try:
            if f.is_dir():
                target.mkdir(parents=True, exist_ok=True)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, target)
        except OSError as e:
            import errno

            hint = {errno.ENOSPC: "free space on that filesystem (df -h)", errno.EDQUOT: "free space in your quota",
                    errno.EFBIG: "raise the file-size limit (ulimit -f) or write the output elsewhere"}.get(
                        e.errno, "check that folder's permissions and free space")
            raise UserError("--checkpoint", f"copying {f} to {target} failed: {e.strerror or e}; nothing was written "
                            "(the partial copy is removed and the previous checkpoint is intact).", f"{hint}, then run again.")


def check_dataset_tokens(calibration, model_dir: Path, say=None) -> None:
    """The calibration checks that need the tokenizer (texts longer than ``calibration.seq_len`` tokens, with
    their token counts), on the lines a build reads; ``invoke build`` (the stage's preflight, before any write) and
    ``invoke check`` run it. Nothing for ``builtin``. ``say``: progress lines while reading/tokenizing (default:
    stderr). Raises UserError."""
    from precision_pipeline.resolve.dataset import BUILTIN

    if calibration.dataset == BUILTIN:
        return
    import sys

    from precision_pipeline.quantize.calibration import build_calibration_set, load_tokenizer

    build_calibration_set(calibration, load_tokenizer(model_dir),
                          say=say or (lambda m: print(m, file=sys.stderr, flush=True)))


class QuantizeStage(Stage[Union[QuantizeInputs, ReuseInputs], CheckpointArtifact]):
    name = "quantize"
    version = 1
    code = ("quantize", "checkpoint", "spec", "core")
    needs = ()
    output = "checkpoint"
    artifact_type = CheckpointArtifact

    def preflight(self, plan, request) -> None:
        """A user dataset's token lengths (``check_dataset_tokens``), before the build writes anything."""
        if request.checkpoint is None:
            check_dataset_tokens(plan.profile.calibration, request.model_dir)

    def inputs(self, plan, request, upstream: Mapping[str, Done]) -> Union[QuantizeInputs, ReuseInputs]:
        if request.checkpoint is not None:
            return ReuseInputs(checkpoint=fingerprint(request.checkpoint))
        d = request.device
        return QuantizeInputs(model=model_fingerprint(request.model_dir), job=job_of(plan),
                              calibration_data=_calibration_file(plan.profile),
                              device=d.device if d is not None else "cpu",
                              compute_dtype=d.compute_dtype(plan.profile.quantization.dtype) if d is not None else "float32")

    def run(self, inputs: Union[QuantizeInputs, ReuseInputs], workdir: Path) -> CheckpointArtifact:
        from precision_pipeline.checkpoint.reader import checkpoint_layout, layer_table
        from precision_pipeline.core.store import read_json

        calibration = None
        reason = ""
        if isinstance(inputs, ReuseInputs):
            copy_checkpoint(inputs.checkpoint.path, workdir)
            reason = f"reused {inputs.checkpoint.path}"
        else:
            from precision_pipeline.quantize import ptq

            calibration = ptq.run_quantize(inputs.job, inputs.model.path, workdir, device=inputs.device,
                                           dtype=inputs.compute_dtype).calibration
        aq = read_json(workdir / "autoquant.json", None)
        if checkpoint_layout(workdir) == "hf_unified":
            from precision_pipeline.checkpoint.hf_unified import hf_checkpoint_bytes, hf_layer_table, read_hf_quant

            q = read_hf_quant(workdir)
            return CheckpointArtifact(
                reason=reason, quant_algo=q["quant_algo"], kv_cache_quant_algo=q["kv_cache_quant_algo"], logits_dtype=None,
                checkpoint_bytes=hf_checkpoint_bytes(workdir),
                calibration=json.loads(json.dumps(calibration, default=str)) if calibration is not None else None,
                effective_bits=(aq or {}).get("effective_bits_achieved"), per_layer_counts=(aq or {}).get("counts"),
                layers=hf_layer_table(workdir))
        if checkpoint_layout(workdir) == "hf_mxfp4":  # gpt-oss's MXFP4 checkpoint as shipped (--checkpoint)
            from precision_pipeline.checkpoint.mxfp4_verify import mxfp4_layer_table

            table = mxfp4_layer_table(workdir)
            return CheckpointArtifact(reason=reason, quant_algo=table["quant_algo"], kv_cache_quant_algo=None,
                                      logits_dtype=None, checkpoint_bytes=table["bytes"], layers=table)
        cfg = json.loads((workdir / "config.json").read_text())
        qz = cfg.get("quantization", {}) or {}
        return CheckpointArtifact(
            reason=reason, quant_algo=qz.get("quant_algo"), kv_cache_quant_algo=qz.get("kv_cache_quant_algo"),
            logits_dtype=cfg.get("logits_dtype"),
            checkpoint_bytes=sum(p.stat().st_size for p in workdir.glob("rank*.safetensors")),
            calibration=json.loads(json.dumps(calibration, default=str)) if calibration is not None else None,
            effective_bits=(aq or {}).get("effective_bits_achieved"), per_layer_counts=(aq or {}).get("counts"),
            layers=layer_table(workdir, aq))


__all__ = ["QuantizeInputs", "ReuseInputs", "CheckpointArtifact", "QuantizeStage", "check_dataset_tokens"]
