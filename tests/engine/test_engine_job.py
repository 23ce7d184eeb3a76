"""The Kubernetes build Job's entry point (``python3 -m precision_pipeline.engine.job``): the engine stage
and then the engine gate, from a CPU build's records, with the GPU-only tools as test doubles
(``tests/engine/doubles.py``) and the TensorRT-LLM runner as a stand-in verdict."""

from __future__ import annotations

import json

import pytest
import yaml

from precision_pipeline.core.errors import GateFailed, StrictSkip, UserError
from precision_pipeline.core.stage import RECORDS_DIR
from precision_pipeline.engine import job
from tests.engine import doubles


@pytest.fixture
def cpu_build(tmp_path, default_model_dir):
    """A build output as the CPU side leaves it: resolve/quantize/gate records, a checkpoint folder, a manifest."""
    from precision_pipeline.resolve import plan as P
    from precision_pipeline.resolve.stage import PlanArtifact
    from precision_pipeline.spec.profile import load_profile

    out = tmp_path / "out"
    (out / RECORDS_DIR).mkdir(parents=True)
    (out / "checkpoint").mkdir()
    plan = P.evaluate(load_profile("fp8-h100"), default_model_dir)
    recs = {"resolve": {"key": "0" * 64, "artifact": PlanArtifact(plan=plan).model_dump(mode="json")},
            "quantize": {"key": "1" * 64, "artifact": {"status": "done", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
                                                       "logits_dtype": None, "checkpoint_bytes": 0, "layers": {}}},
            "gate": {"key": "2" * 64, "artifact": {"status": "done", "passed": True, "numbers": {}}}}
    for name, rec in recs.items():
        (out / RECORDS_DIR / f"{name}.json").write_text(json.dumps({"stage": name, **rec}))
    (out / "manifest.json").write_text(json.dumps({"profile": "fp8-h100", "model_dir": str(default_model_dir), "stages": {}}))
    from precision_pipeline.core.outputs import write_output_marker

    write_output_marker(out, "fp8-h100")
    return out


def test_build_on_k8s_refuses_an_output_with_no_build_a_failed_gate_or_the_root(tmp_path, cpu_build, default_model_dir):
    """Issue 25 item 12: ``build --on k8s`` rendered a Job for ``--out /``, an empty folder, a failed gate."""
    import subprocess
    import sys
    from pathlib import Path

    assert job.check_gated_output(cpu_build, "fp8-h100") == cpu_build.resolve()
    cases = [(Path("/"), "filesystem root"), (tmp_path / "empty", "not a build output"),
             (tmp_path / "nowhere", "not a build output")]
    (tmp_path / "empty").mkdir()
    for out, says in cases:
        with pytest.raises(UserError, match=says):
            job.check_gated_output(out, "fp8-h100")
    with pytest.raises(UserError, match="holds the build of profile 'fp8-h100', not 'bf16-h100'"):
        job.check_gated_output(cpu_build, "bf16-h100")
    manifest = (cpu_build / "manifest.json").read_text()   # hostile s15 F5: a rebuild interrupted after its first row
    (cpu_build / "manifest.json").write_text(json.dumps({**json.loads(manifest), "started": 1.8e9}))
    with pytest.raises(UserError) as ei:
        job.check_gated_output(cpu_build, "fp8-h100")
    assert ei.value.problems[0].reason == (f"{cpu_build.resolve()}: the last build into this folder (started 2027-01-15 "
                                           "08:00:00 UTC) did not finish (interrupted or killed); its checkpoint and gate "
                                           "records may not belong to its plan.")
    (cpu_build / "manifest.json").write_text(json.dumps({**json.loads(manifest), "started": 1.8e9, "finished": 1.8e9 + 5}))
    assert job.check_gated_output(cpu_build, "fp8-h100") == cpu_build.resolve()
    (cpu_build / "manifest.json").write_text(manifest)
    (cpu_build / RECORDS_DIR / "gate.json").write_text(json.dumps({"stage": "gate", "key": "2" * 64,
                                                                    "artifact": {"status": "failed", "passed": False}}))
    with pytest.raises(UserError, match="did not pass its accuracy gate"):
        job.check_gated_output(cpu_build, "fp8-h100")
    (cpu_build / RECORDS_DIR / "gate.json").unlink()
    with pytest.raises(UserError, match="gate.json is missing"):
        job.check_gated_output(cpu_build, "fp8-h100")
    # through the task: exit 2, a sentence, no Job printed
    root = Path(__file__).resolve().parents[2]
    for out in ("/", str(cpu_build)):
        p = subprocess.run([sys.executable, "-m", "invoke", "build", "--profile", "fp8-h100", "--on", "k8s", "--out", out,
                            "--model", str(default_model_dir)], cwd=root, capture_output=True, text=True, timeout=120,
                           env={**__import__("os").environ, "PATH": "/usr/bin:/bin"})
        assert p.returncode == 2 and "kind: Job" not in p.stdout and "Traceback" not in p.stderr, (p.stdout, p.stderr)


def test_build_on_k8s_refuses_a_checkpoint_changed_after_its_build(cpu_build):
    """Hostile round s11: `build --on k8s` rendered the Job (exit 0) for an output whose checkpoint was truncated
    after its build, which promote refuses. The quantize record's inventory (what a build records) is checked."""
    from precision_pipeline.core.fingerprint import inventory

    shard = cpu_build / "checkpoint" / "rank0.safetensors"
    shard.write_bytes(b"\x01" * 4096)
    qrec = json.loads((cpu_build / RECORDS_DIR / "quantize.json").read_text())
    qrec["files"] = inventory(cpu_build / "checkpoint")
    (cpu_build / RECORDS_DIR / "quantize.json").write_text(json.dumps(qrec))
    assert job.check_gated_output(cpu_build, "fp8-h100") == cpu_build.resolve()
    with open(shard, "r+b") as f:
        f.truncate(1000)
    with pytest.raises(UserError) as e:
        job.check_gated_output(cpu_build, "fp8-h100")
    p = e.value.problems[0]
    assert p.field == "--out" and "is not the checkpoint its quantize record describes" in p.reason
    assert "rank0.safetensors" in p.reason and "on the CPU side first" in p.fix


def test_build_on_k8s_refuses_a_damaged_manifest(cpu_build):
    """Hostile s12 F-F: `build --on k8s` rendered the Job for an output whose manifest.json was truncated; the
    Job's entry point refuses it (``read_manifest``), so the refusal came in the pod, after a GPU node was scheduled.
    ``check_gated_output``, the one rule of both sides, reads it too."""
    m = cpu_build / "manifest.json"
    m.write_bytes(m.read_bytes()[: len(m.read_bytes()) // 2])  # truncated (a full disk, a bad copy)
    with pytest.raises(UserError) as e:
        job.check_gated_output(cpu_build, "fp8-h100")
    assert str(m) in e.value.message and "not valid JSON" in e.value.message, e.value.message


def test_apply_and_follow_runs_kubectl_in_order(monkeypatch):
    """No context (an error, or none set): None, nothing applied; else apply, wait for the pod, follow the logs and
    read the Job's completion: 0 when Complete, 1 otherwise. The context and the completion are read as text."""
    import shutil
    import subprocess

    from precision_pipeline.serving import build_job

    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/kubectl")
    text = "apiVersion: batch/v1\nkind: Job\nmetadata: {name: engine-build-x, namespace: ml}\n"

    def runner(ctx_rc, ctx_out, complete_rc=0):
        seen = []

        def run(argv, **kw):
            seen.append((argv[1:3], kw))
            if argv[1:3] == ["config", "current-context"]:
                return subprocess.CompletedProcess(argv, ctx_rc, ctx_out, "")
            rc = complete_rc if "--for=condition=Complete" in argv else 0
            return subprocess.CompletedProcess(argv, rc, "", "")
        return run, seen

    for rc, out in ((1, "kind-test\n"), (0, "  \n")):
        run, seen = runner(rc, out)
        assert build_job.apply_and_follow(text, run=run) is None and len(seen) == 1
    run, seen = runner(0, "kind-test\n")
    assert build_job.apply_and_follow(text, run=run) == 0
    as_text = {"capture_output": True, "text": True}
    assert seen == [(["config", "current-context"], as_text),
                    (["apply", "-f"], {"input": text, "text": True, "capture_output": True}),
                    (["-n", "ml"], {}), (["-n", "ml"], {}), (["-n", "ml"], as_text)]
    run, seen = runner(0, "kind-test\n", complete_rc=1)
    assert build_job.apply_and_follow(text, run=run) == 1


def test_kubectl_apply_refused_is_a_user_error(tmp_path, monkeypatch):
    """Issue 25 item 17: a refused ``kubectl apply`` was a CalledProcessError traceback."""
    import shutil
    import subprocess

    from precision_pipeline.serving import build_job

    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/kubectl")
    seen = []

    def run(argv, **kw):
        seen.append(argv[1:3])
        if argv[1:3] == ["config", "current-context"]:
            return subprocess.CompletedProcess(argv, 0, "kind-test\n", "")
        if argv[1] == "apply":
            assert not kw.get("check")
            return subprocess.CompletedProcess(argv, 1, "", 'Error from server (Forbidden): jobs.batch is forbidden: '
                                               'User "dev" cannot create resource "jobs"')
        raise AssertionError(f"nothing runs after a refused apply: {argv}")
    text = "apiVersion: batch/v1\nkind: Job\nmetadata: {name: engine-build-x, namespace: ml}\n"
    with pytest.raises(UserError, match=r"kubectl apply refused the Job ml/engine-build-x .*Forbidden") as e:
        build_job.apply_and_follow(text, run=run)
    assert e.value.problems[0].field == "--on" and seen == [["config", "current-context"], ["apply", "-f"]]


def test_engine_then_engine_gate_skipped_without_a_runner(tmp_path, monkeypatch, cpu_build):
    paths = doubles.install(tmp_path, monkeypatch)
    d = job.run_engine_job(cpu_build)
    assert d.record.status == "done" and len(doubles.calls(paths)) == 1
    m = json.loads((cpu_build / "manifest.json").read_text())
    rows = m["stages"]
    assert rows["engine"]["status"] == "done"
    assert m["finished"] >= m["started"] and m["engine_present"] is True  # the Job finishes the manifest it extends
    assert rows["engine_gate"]["status"] == "skipped" and "no CUDA device visible" in rows["engine_gate"]["reason"]
    with pytest.raises(StrictSkip, match=r"--strict: stage\(s\) skipped: engine_gate \(skipped: .*no CUDA device visible"):
        job.run_engine_job(cpu_build, strict=True)


def test_failing_engine_gate_is_exit_3(tmp_path, monkeypatch, cpu_build):
    from precision_pipeline.gate import engine_gate

    class Failing:
        passed = False

        def failed_metrics(self):
            return ["top1"]

        def summary(self):
            return {"top1": 0.1}

    doubles.install(tmp_path, monkeypatch)
    monkeypatch.setattr(engine_gate, "engine_available", lambda: (True, ""))
    monkeypatch.setattr(engine_gate, "run_engine_gate", lambda *a, **k: Failing())
    with pytest.raises(GateFailed, match=r"engine gate failed for fp8-h100 \(top1\)") as e:
        job.run_engine_job(cpu_build, golden_limit=1)
    assert e.value.exit_code == 3


def test_unreadable_reference_model_is_refused(tmp_path, monkeypatch, cpu_build):
    doubles.install(tmp_path, monkeypatch)
    with pytest.raises(UserError, match="not readable here") as e:
        job.run_engine_job(cpu_build, model_dir=tmp_path / "nowhere")
    assert e.value.problems[0].field == "--model"
    assert job.main(["--out", str(cpu_build), "--model", str(tmp_path / "nowhere")]) == 2


def test_rendered_job_passes_the_model_and_golden_limit(tmp_path, default_model_dir):
    from precision_pipeline.resolve import plan as P
    from precision_pipeline.serving import build_job
    from precision_pipeline.spec.profile import load_profile

    plan = P.evaluate(load_profile("fp8-h100"), default_model_dir)
    doc = yaml.safe_load(build_job.render_job(plan, tmp_path / "o", model_dir=default_model_dir, golden_limit=2))
    assert doc["spec"]["template"]["spec"]["containers"][0]["args"] == [
        "--out", str((tmp_path / "o").resolve()), "--strict", "--model", str(default_model_dir.resolve()), "--golden-limit", "2"]


def test_the_job_runs_the_engine_route_stages_through_the_build_loop(tmp_path, monkeypatch, cpu_build):
    """Issue 24: the Job was a second driver (its own Done(artifact=None), SimpleNamespace request, GateFailed /
    StrictSkip mapping). Now it runs the engine route's own stage objects through ``core.route``: their preflight
    first (a refusal there writes nothing and starts no trtllm-build), then ``run_stages`` with typed upstream."""
    from precision_pipeline.core import route
    from precision_pipeline.engine.stage import EngineStage
    from precision_pipeline.pipeline import ROUTES
    from precision_pipeline.resolve.stage import BuildRequest

    assert all(any(s is r for r in ROUTES["engine"].stages) for s in job.JOB_STAGES)
    assert [s.name for s in job.JOB_STAGES] == ["engine", "engine_gate"]
    paths = doubles.install(tmp_path, monkeypatch)
    seen = []
    real = route.run_stages

    def spy(stages, plan, req, runner, done, subject, *a, **k):
        seen.append(([s.name for s in stages], type(req), {n: type(d.artifact).__name__ for n, d in done.items()}))
        return real(stages, plan, req, runner, done, subject, *a, **k)

    monkeypatch.setattr(job, "run_stages", spy)
    job.run_engine_job(cpu_build)
    assert seen == [(["engine", "engine_gate"], BuildRequest, {"quantize": "CheckpointArtifact", "gate": "GateArtifact"})]

    def refuse(self, plan, request):
        raise UserError("engine.sm", "the node's GPUs are SM 89, the plan's SM 90.", "run on an H100 node.")

    monkeypatch.setattr(EngineStage, "preflight", refuse)
    (cpu_build / "engine").rename(tmp_path / "engine-before")
    n = len(doubles.calls(paths))
    with pytest.raises(UserError, match="SM 89"):
        job.run_engine_job(cpu_build)
    assert len(doubles.calls(paths)) == n and not (cpu_build / "engine").exists()


def test_build_on_k8s_refuses_an_empty_image_and_warns_of_one_outside_the_catalog(cpu_build, capsys):
    """Hostile s15b F8: ``--image ''`` (an unset $IMAGE) rendered the Job with the default image; F9: ``--image busybox``
    (no TensorRT-LLM) was rendered without a word."""
    from precision_pipeline.cli.build import build_on

    with pytest.raises(UserError) as ei:
        build_on("k8s", "fp8-h100", out=str(cpu_build), image="")
    assert ei.value.problems[0].field == "--image" and "not a container image reference" in ei.value.problems[0].reason
    assert build_on("k8s", "fp8-h100", out=str(cpu_build), image="busybox") == 0
    out, err = capsys.readouterr()
    assert "image: busybox" in out and "warning: busybox is not in the catalog of Triton + TensorRT-LLM images" in err
    assert build_on("k8s", "fp8-h100", out=str(cpu_build), image="nvcr.io/nvidia/tritonserver:26.05-trtllm-python-py3") == 0
    assert "warning" not in capsys.readouterr().err
