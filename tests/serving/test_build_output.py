"""The typed reader of a build output (``serving/build_output.py``) and the one promote of a build that
``invoke promote`` and ``invoke nightly --promote`` share (issue 24: nightly's copy passed no fallback repository,
warm_fallback, keep_releases or skew facts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from precision_pipeline.core.errors import UserError
from precision_pipeline.core.outputs import write_output_marker
from precision_pipeline.core.stage import RECORDS_DIR, write_record
from precision_pipeline.serving import build_output
from precision_pipeline.spec.profile import deep_merge, load_raw, validate_profile


def _fake_build(out: Path, profile, passed: bool = True, image: str = "nvcr.io/nvidia/tritonserver:25.10-trtllm-python-py3"):
    """A build output as the stages leave it: the typed records of resolve, gate, pack and deploy."""
    from precision_pipeline.gate.stage import GateArtifact
    from precision_pipeline.resolve import plan as P
    from precision_pipeline.resolve.stage import PlanArtifact
    from precision_pipeline.serving.stage import ManifestsArtifact, RepositoryArtifact
    from precision_pipeline.spec.default_model import default_model_dir

    (out / "model_repository").mkdir(parents=True)
    write_output_marker(out, profile.name)
    arts = {"resolve": PlanArtifact(plan=P.evaluate(profile, default_model_dir())),
            "gate": GateArtifact(status="done" if passed else "failed", passed=passed, numbers={"kl_p99": 0.1},
                                 record={"model_fingerprint": "a" * 64}),
            "pack": RepositoryArtifact(models=("ensemble",), engine_present=False, engine_unit="u", engine_hash="0" * 64),
            "deploy": ManifestsArtifact(files=("triton-deployment.yaml",), gpus_per_replica=1, replicas=1,
                                        launcher="tritonserver", image=image)}
    for name, art in arts.items():
        write_record(out / RECORDS_DIR / f"{name}.json", name, "1" * 64, art)
    return out


def _profile(**sections):
    return validate_profile(deep_merge(load_raw("fp8-h100"), {"name": "fp8-h100", **sections}))


def test_the_reader_gives_typed_facts_and_refuses_what_is_not_a_finished_passed_build(tmp_path, monkeypatch):
    prof = _profile()
    monkeypatch.setattr("precision_pipeline.spec.profile.load_profile", lambda ref: prof)
    out = _fake_build(tmp_path / "b", prof)
    b = build_output.open_build("fp8-h100", out)
    assert b.passed and b.packed == out.resolve() / "model_repository"
    assert b.serving_facts() == {"image": "nvcr.io/nvidia/tritonserver:25.10-trtllm-python-py3", "sm": 90}
    assert b.layout == {"tp_size": 1, "pp_size": 1, "moe_ep_size": 1} and b.model_fingerprint() == "a" * 64
    assert b.gate.numbers == {"kl_p99": 0.1}
    failed = _fake_build(tmp_path / "f", prof, passed=False)
    with pytest.raises(UserError, match="did not pass its accuracy gate"):
        build_output.open_build("fp8-h100", failed)
    assert build_output.open_build("fp8-h100", failed, require_passed=False).passed is False
    (failed / RECORDS_DIR / "pack.json").unlink()  # a failed gate stops the build before pack (hostile s16b T134)
    with pytest.raises(UserError) as ei:
        build_output.open_build("fp8-h100", failed)
    assert ei.value.problems[0].reason == (f"the build of fp8-h100 in {failed.resolve()} did not pass its accuracy gate, "
                                           f"so it packed no unit ({failed.resolve() / 'gate' / 'report.md'} says why).")
    assert not isinstance(ei.value, build_output.NotBuilt)
    (out / RECORDS_DIR / "gate.json").write_text('{"stage": "gate", "ke')    # hostile s15 F8: damaged, named; --out kept
    (out / RECORDS_DIR / "pack.json").unlink()
    with pytest.raises(UserError) as ei:
        build_output.open_build("fp8-h100", out)
    assert ei.value.problems[0].reason == (f"{out.resolve()} holds no finished build of fp8-h100 (.stages/gate.json is "
                                           "damaged (not a valid record); .stages/pack.json is missing).")
    assert ei.value.problems[0].fix == (f"run `invoke build --profile fp8-h100 --out {out.resolve()}` (it reuses every "
                                        "stage still right).") and ei.value.problems[0].field == "--out"
    other = _fake_build(tmp_path / "o", _profile(name="bf16-h100"))
    with pytest.raises(UserError, match="holds a build of 'bf16-h100', not of 'fp8-h100'"):
        build_output.open_build("fp8-h100", other)


def test_the_first_release_gets_the_fallback_warmth_retention_and_skew_facts(tmp_path, monkeypatch):
    from precision_pipeline.serving import acceptance, release

    prof = _profile(deployment={"fallback": "bf16-h100", "warm_fallback": True, "keep_releases": 5})
    fb = _profile(name="bf16-h100")
    monkeypatch.setattr("precision_pipeline.spec.profile.load_profile", lambda ref: fb if "bf16" in str(ref) else prof)
    b = build_output.open_build("fp8-h100", _fake_build(tmp_path / "fp8-h100", prof))
    _fake_build(tmp_path / "bf16-h100", fb)
    seen = {}
    monkeypatch.setattr(acceptance, "check_promotable", lambda *a, **k: seen.setdefault("accept", k) and
                        acceptance.Acceptance(gate={"kl_p99": 0.1}, warnings=["w"]))
    monkeypatch.setattr(release, "read_state", lambda repo: None)

    def init(repo, packed, **k):
        seen["init"] = k
        return {"current": "tensorrt_llm_000000000001", "fallback": "tensorrt_llm_000000000002"}
    monkeypatch.setattr(release, "init_serving_repo", init)
    p = build_output.promote_build(b, tmp_path / "serving", by="invoke promote", fallback_out=tmp_path / "bf16-h100")
    assert p.created and p.unit == "tensorrt_llm_000000000001" and p.notes == []
    assert p.warnings == ["w", "fallback bf16-h100: w"]  # the fallback's acceptance too (hostile s8 #48)
    assert seen["accept"] == {"image": b.image, "sm": 90, "profile_ref": "fp8-h100"}  # the --profile as given (s15c T26)
    k = seen["init"]
    assert (k["fallback_repo"], k["warm_fallback"], k["keep_releases"]) == (
        (tmp_path / "bf16-h100").resolve() / "model_repository", True, 5)
    assert "image" not in k and "sm" not in k  # the one skew check is acceptance's (above)
    p = build_output.promote_build(b, tmp_path / "serving", by="x", fallback_out=tmp_path / "nowhere")
    assert seen["init"]["fallback_repo"] is None and "fallback bf16-h100 is not built" in p.notes[0]
    # an existing repository: promote, with the settings it keeps said
    monkeypatch.setattr(release, "read_state", lambda repo: {"current": "tensorrt_llm_000000000001"})
    monkeypatch.setattr(build_output, "repository_settings_warnings", lambda profile, repo: ["kept settings"])
    monkeypatch.setattr(release, "promote", lambda repo, packed, **k: {"unit": "tensorrt_llm_000000000003", "total_ms": 12.5})
    p = build_output.promote_build(b, tmp_path / "serving", by="x")
    assert (p.created, p.unit, p.warnings, p.total_ms) == (False, "tensorrt_llm_000000000003", ["w", "kept settings"], 12.5)
    assert b.layout == {"tp_size": 1, "pp_size": 1, "moe_ep_size": 1}
    no_ep = b.plan.model_copy(update={"mapping": b.plan.mapping.model_copy(update={"moe_ep_size": None})})
    monkeypatch.setattr(type(b), "plan", property(lambda self: no_ep), raising=False)
    assert b.layout["moe_ep_size"] == 1  # no expert parallelism recorded: 1


def test_nightly_promotes_through_the_same_function(tmp_path, monkeypatch):
    from precision_pipeline import nightly as nl

    prof = _profile(deployment={"fallback": "bf16-h100"})
    monkeypatch.setattr("precision_pipeline.spec.profile.load_profile", lambda ref: prof)
    out = _fake_build(tmp_path / "fp8-h100", prof)
    calls = []
    monkeypatch.setattr(build_output, "promote_build",
                        lambda b, repo, **k: calls.append((b.out_dir, repo, k)) or build_output.Promotion("u1", True))
    opts = nl.NightlyOptions(profiles=["fp8-h100"], out_root=tmp_path)
    assert nl._promote(nl.Row(profile="fp8-h100", source="fp8-h100", out_dir=str(out)), opts) == "u1"
    assert calls == [(out.resolve(), tmp_path / "serving" / "model_repository",
                      {"by": "invoke nightly", "server": None, "fallback_out": tmp_path / "bf16-h100"})]
    assert json.loads((out / RECORDS_DIR / "gate.json").read_text())["artifact"]["passed"] is True


def test_the_fallback_goes_through_the_same_acceptance_or_the_first_promote_is_refused(tmp_path, monkeypatch):
    """Hostile s8 #47-#49: the first promote installed the profile's deployment.fallback build with no acceptance
    (a failed gate, a --golden-limit build that `promote --profile bf16-h100` itself refuses), and any error
    opening it was reported as "not built". Now: check_promotable judges the fallback build as it judges a
    promoted one; a refusal, a failed gate or another profile's build there refuses the promote (exit 2, nothing
    created) with the real reason; only a fallback that is not built at all is a note."""
    from precision_pipeline.core.errors import Problem
    from precision_pipeline.serving import acceptance, release

    prof = _profile(deployment={"fallback": "bf16-h100"})
    fb = _profile(name="bf16-h100")
    monkeypatch.setattr("precision_pipeline.spec.profile.load_profile", lambda ref: fb if "bf16" in str(ref) else prof)
    b = build_output.open_build("fp8-h100", _fake_build(tmp_path / "fp8-h100", prof))
    judged = []

    def check(profile, out_dir, packed, **k):
        judged.append(profile.name)
        if profile.name == "bf16-h100" and (Path(out_dir) / "golden-limit").exists():
            raise UserError([Problem("gate", "not promotable: the verdict covers 6 golden prompt(s)", "rebuild it.",
                                     rule="accept.golden")])
        return acceptance.Acceptance(gate={"kl_p99": 0.1}, warnings=[f"w {profile.name}"])
    monkeypatch.setattr(acceptance, "check_promotable", check)
    monkeypatch.setattr(release, "read_state", lambda repo: None)
    inits = []
    monkeypatch.setattr(release, "init_serving_repo", lambda repo, packed, **k: inits.append(k) or
                        {"current": "tensorrt_llm_000000000001", "fallback": "tensorrt_llm_000000000002"})
    good = _fake_build(tmp_path / "bf16-h100", fb)
    p = build_output.promote_build(b, tmp_path / "serving", by="x", fallback_out=good)
    assert judged == ["fp8-h100", "bf16-h100"] and inits[-1]["fallback_repo"] == good.resolve() / "model_repository"
    assert p.warnings == ["w fp8-h100", "fallback bf16-h100: w bf16-h100"]

    (good / "golden-limit").touch()                                 # acceptance refuses the fallback build
    failed = _fake_build(tmp_path / "bf16-failed", fb, passed=False)  # its gate failed
    other = _fake_build(tmp_path / "bf16-other", prof)                # another profile's build at its place
    for out, why in ((good, "not promotable: the verdict covers 6 golden prompt(s)"),
                     (failed, "did not pass its accuracy gate"), (other, "holds a build of 'fp8-h100'")):
        n = len(inits)
        with pytest.raises(UserError) as ei:
            build_output.promote_build(b, tmp_path / "serving", by="x", fallback_out=out)
        p0 = ei.value.problems[0]
        assert p0.field == "deployment.fallback" and why in p0.reason and "bf16-h100" in p0.reason, p0.reason
        assert "fallback: null" in p0.fix and len(inits) == n       # nothing created


def test_the_manifests_are_present_when_k8s_is_a_folder(tmp_path):
    from precision_pipeline.serving.stage import ManifestsArtifact

    art = ManifestsArtifact(files=("triton-deployment.yaml",), gpus_per_replica=1, replicas=1, launcher="tritonserver")
    assert art.present(tmp_path) is False
    (tmp_path / "k8s").mkdir()
    assert art.present(tmp_path) is True


def test_an_output_whose_last_build_did_not_finish_is_not_promoted(tmp_path, monkeypatch):
    """Hostile s15 F5 / s15b F2: after a rebuild killed between its gate and pack (or after its resolve), promote
    shipped the old packed unit under the new gate's verdict (or the old checkpoint as the edited profile). Its
    manifest.json has ``started`` without ``finished`` (``Manifest.open`` + a stage row, no ``finish``): refused,
    naming the rebuild; a failed gate is still said first; the engine Job's own manifest (``keep_finished``) keeps a finished CPU build finished while it runs."""
    from precision_pipeline.core.stage import Manifest, StageRecord, read_manifest

    prof = _profile()
    monkeypatch.setattr("precision_pipeline.spec.profile.load_profile", lambda ref: prof)
    out = _fake_build(tmp_path / "b", prof)
    m = Manifest.open(out / "manifest.json", profile="fp8-h100", profile_source="", model_dir="", out_dir=str(out))
    m.record(StageRecord("resolve", "done", 0.1, key="k"))    # a rebuild's first row, then killed
    with pytest.raises(UserError) as ei:
        build_output.open_build("fp8-h100", out)
    p = ei.value.problems[0]
    assert p.field == "--out" and p.reason.startswith(f"{out.resolve()}: the last build into this folder (started ")
    assert p.reason.endswith("did not finish (interrupted or killed), so its plan, checkpoint, gate verdict and packed "
                             "unit may not belong together.")
    assert p.fix.startswith(f"run `invoke build --profile fp8-h100 --out {out.resolve()}` again")
    assert not isinstance(ei.value, build_output.NotBuilt)  # a fallback in this state refuses the first promote
    failed = _fake_build(tmp_path / "f", prof, passed=False)
    Manifest.open(failed / "manifest.json", profile="fp8-h100", profile_source="", model_dir="", out_dir="").save()
    with pytest.raises(UserError, match="did not pass its accuracy gate"):
        build_output.open_build("fp8-h100", failed)
    m.finish(engine_present=False)
    assert build_output.open_build("fp8-h100", out).passed
    job = Manifest.open(out / "manifest.json", keep_finished=True, profile="fp8-h100", profile_source="", model_dir="",
                        out_dir=str(out))
    job.record(StageRecord("engine", "skipped", 0.1, key="e"))
    kept = read_manifest(out / "manifest.json")
    assert kept["finished"] == m.finished and kept["started"] == m.started and kept["engine_present"] is False
    assert build_output.open_build("fp8-h100", out).passed


def test_a_relative_calibration_dataset_is_read_as_built_and_its_content_is_checked(tmp_path):
    """Hostile s15b F6: a profile with a relative ``calibration.dataset`` (read from the profile's folder) could never
    be promoted: promote compared the build's absolute path with the raw relative one ("changed since the build") and
    the advised rebuild looped. F7: a dataset file rewritten after the build was promoted as if unchanged. Now
    ``open_build`` loads the profile as the build does and ``accept.dataset`` compares the file's sha256 with the
    quantize record's."""
    from precision_pipeline.core.fingerprint import file_digests
    from precision_pipeline.quantize.stage import CheckpointArtifact
    from precision_pipeline.resolve.dataset import load_build_profile
    from precision_pipeline.serving import acceptance

    d = tmp_path / "profiles"
    d.mkdir()
    data = d / "cal.jsonl"
    data.write_text('{"text": "the first calibration text"}\n')
    (d / "mine.yaml").write_text("extends: fp8-h100\ncalibration:\n  dataset: cal.jsonl\n")
    built = load_build_profile(str(d / "mine.yaml"))
    assert built.calibration.dataset == str(data)
    out = _fake_build(tmp_path / "b", built)
    b = build_output.open_build(str(d / "mine.yaml"), out)
    assert b.profile.calibration.dataset == str(data) and acceptance._profile_problems(b.profile, out, "r") == []
    write_record(out / RECORDS_DIR / "quantize.json", "quantize", "3" * 64, CheckpointArtifact(
        quant_algo="FP8", kv_cache_quant_algo="FP8", logits_dtype=None, checkpoint_bytes=0, layers={},
        calibration={"sources": {"user": {"file": str(data), "sha256": file_digests(data)["cal.jsonl"]}}}))
    assert acceptance._dataset_problems(b.profile, out, "rebuild it") == []
    data.write_text('{"text": "a different calibration text"}\n')
    [p] = acceptance._dataset_problems(b.profile, out, "rebuild it")
    assert p.field == "calibration.dataset" and p.rule == "accept.dataset"
    assert p.reason.startswith(f"{data} changed since the build in {out} (sha256 ")
    assert p.fix == "rebuild it (it calibrates and gates on the file as it is now), or put the file back."
    assert b.ref == str(d / "mine.yaml")  # hostile s15c T26: what check_promotable's rebuild command names
    data.unlink()
    assert acceptance._dataset_problems(b.profile, out, "rebuild it") == []
