"""What promote and rollout accept (serving/acceptance.py), on small build outputs made here: a packed
repository of the default model (no engine), a plan.json, a manifest and a gate/metrics.json from the
synthetic gate numbers of tests/gate/test_report.py (3 prompts per category, judged by the real rule).
No quantization, no server; one CLI promote per refusal that must exit 2 before anything is written."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from precision_pipeline.core.errors import UserError
from precision_pipeline.gate.verdict import judge_metrics
from precision_pipeline.serving import pack
from precision_pipeline.serving.acceptance import check_promotable
from precision_pipeline.spec.profile import load_profile

REPO_ROOT = Path(__file__).resolve().parents[2]
INVOKE = [sys.executable, "-m", "invoke"]

# bf16-h100 with a bar the synthetic numbers (KL mean 0.074 overall, 0.024..0.114 per category) meet,
# and a minimum the 18 synthetic prompts reach
PROFILE = """extends: bf16-h100
parallel:
  tp_size: {tp}
gate:
  kl_mean_max: {kl}
  kl_p99_max: null
  top1_min: null
  ppl_delta_pct_max: null
  min_prompts: {min_prompts}
"""


def write_profile(d: Path, name: str = "mybf16", *, tp: int = 1, kl: float = 0.1, min_prompts: int = 18) -> Path:
    p = d / f"{name}.yaml"
    p.write_text(PROFILE.format(tp=tp, kl=kl, min_prompts=min_prompts))
    return p


def fake_build(out: Path, prof, fingerprint: str, *, layout: dict | None = None, manifest_profile: str | None = None,
               prompts_per_category: int | None = None, packed: Path | None = None) -> Path:
    """A finished build of ``prof`` in ``out`` whose gate judged the synthetic numbers with ``prof``'s bar
    (``packed``: a model_repository already packed into ``out``, e.g. with a built engine; else one is packed)."""
    from tests.gate.test_report import _synthetic
    from tests.serving.test_pack import make_plan

    metrics, _ = _synthetic(prof.gate.for_model(fingerprint))
    q = prof.quantization
    metrics["checkpoint_quantization"] = ({} if q.quant_algo.value == "NO_QUANT" else
                                          {"quant_algo": q.quant_algo.value, "kv_cache_quant_algo": q.kv_cache_quant_algo.value})
    metrics["golden"]["prompts_per_category"] = prompts_per_category
    metrics["record"] = {"layout": layout or {"tp_size": prof.parallel.tp_size, "pp_size": 1, "moe_ep_size": 1},
                         "model_fingerprint": fingerprint, "runtime": {"tensorrt_llm": None},
                         "golden": {"prompts_per_category": prompts_per_category}}
    (out / "gate").mkdir(parents=True)
    (out / "gate" / "metrics.json").write_text(json.dumps(metrics))
    from precision_pipeline.spec.default_model import ensure_default_model

    if packed is None:
        res = pack.pack_repository(make_plan(prof), prof, ensure_default_model(), out / "no-checkpoint", out / "engine",
                                   False, out / "model_repository", str(out))
        models, unit, engine_hash = tuple(res.models), res.engine_unit, res.engine_hash
    else:
        info = json.loads((Path(packed) / pack.PACK_FILE).read_text())  # the packed repository's pack.json
        models, unit, engine_hash = tuple(info["models"]), info["engine_unit"], info["engine_hash"]
    (out / "plan.json").write_text(json.dumps({"profile": prof.name}))
    numbers = {k: v["value"] for k, v in metrics["metrics"].items()}
    passed = bool(metrics["passed"] or manifest_profile)
    (out / "manifest.json").write_text(json.dumps({
        "profile": manifest_profile or prof.name,
        "stages": {"gate": {"status": "done" if passed else "failed", "numbers": numbers},
                   "pack": {"status": "done"}}}))
    # the typed stage records the readers go by (a killed build of manifest_profile wrote its resolve record first)
    from precision_pipeline.core.stage import RECORDS_DIR, write_record
    from precision_pipeline.gate.stage import GateArtifact
    from precision_pipeline.resolve.stage import PlanArtifact
    from precision_pipeline.serving.stage import RepositoryArtifact

    planned = load_profile(manifest_profile) if manifest_profile else prof
    for name, art in (("resolve", PlanArtifact(plan=make_plan(planned))),
                      ("gate", GateArtifact(status="done" if passed else "failed", passed=passed, numbers=numbers,
                                            record=metrics["record"])),
                      ("pack", RepositoryArtifact(models=models, engine_present=packed is not None,
                                                  engine_unit=unit, engine_hash=engine_hash))):
        write_record(out / RECORDS_DIR / f"{name}.json", name, "0" * 64, art)
    return out


@pytest.fixture(scope="module")
def fp(default_model_dir) -> str:
    from precision_pipeline.core.fingerprint import model_fingerprint

    return model_fingerprint(default_model_dir).sha256


def refusal(prof, out: Path) -> str:
    with pytest.raises(UserError) as e:
        check_promotable(prof, out, out / "model_repository")
    return str(e.value)


def promote_cli(profile: Path | str, out: Path, repo: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="300")
    return subprocess.run([*INVOKE, "promote", "--profile", str(profile), "--out", str(out), "--repo", str(repo)],
                          cwd=REPO_ROOT, capture_output=True, text=True, env=env, timeout=300)


def test_a_good_build_is_accepted_with_its_record(tmp_path, fp):
    prof = load_profile(str(write_profile(tmp_path)))
    out = fake_build(tmp_path / "out", prof, fp)
    ok = check_promotable(prof, out, out / "model_repository")
    assert ok.gate["passed"] is True and ok.gate["prompts"] == 18
    assert ok.gate["record"]["layout"] == {"tp_size": 1, "pp_size": 1, "moe_ep_size": 1}
    assert ok.gate["record"]["model_fingerprint"] == fp
    assert ok.gate["judged_against"]["kl_mean_max"] == 0.1 and ok.gate["judged_against"]["min_prompts"] == 18
    assert ok.warnings == []


def test_cli_promote_refuses_a_build_gated_at_tp1_for_a_profile_serving_tp3(tmp_path, fp):
    path = write_profile(tmp_path)
    out = fake_build(tmp_path / "out", load_profile(str(path)), fp)
    write_profile(tmp_path, tp=3)  # the profile now serves tp 3; no rebuild
    repo = tmp_path / "serving" / "model_repository"
    r = promote_cli(path, out, repo)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "the gate ran at tp_size 1 but mybf16 serves tp_size 3" in (r.stdout + r.stderr), (r.stdout + r.stderr)
    assert "runs on 1 GPU(s) but mybf16 serves tp x pp = 3" in (r.stdout + r.stderr)
    assert not repo.exists() and not (repo.parent / "releases.json").exists()  # nothing written


def test_cli_promote_refuses_a_golden_limit_build_with_the_reason(tmp_path, fp):
    path = write_profile(tmp_path, min_prompts=19)  # the 18 prompts of the build are too few
    out = fake_build(tmp_path / "out", load_profile(str(path)), fp, prompts_per_category=3)
    repo = tmp_path / "serving" / "model_repository"
    r = promote_cli(path, out, repo)
    assert r.returncode == 2, r.stdout + r.stderr
    assert ("not promotable: the verdict covers 18 golden prompt(s), fewer than gate.min_prompts 19 (--golden-limit 3)"
            in (r.stdout + r.stderr)), (r.stdout + r.stderr)
    assert not repo.exists()
    # hostile s18b F5: the fix named `invoke build --profile P` without --out: that built elsewhere
    assert f"rebuild without --golden-limit (invoke build --profile {path} --out {out})" in " ".join((r.stdout + r.stderr).split())


def test_the_default_minimum_is_the_whole_golden_set(tmp_path, fp):
    prof = load_profile(str(write_profile(tmp_path)))
    out = fake_build(tmp_path / "out", prof, fp, prompts_per_category=3)
    dflt = prof.model_copy(update={"gate": prof.gate.model_copy(update={"min_prompts": None})})
    assert "fewer than the whole golden set (65 prompts) (--golden-limit 3)" in refusal(dflt, out)


def test_promote_refuses_an_output_holding_another_profiles_build(tmp_path, fp):
    """Issue 25 item 8: a bf16-h100 build killed early into an output holding fp8-h100's build leaves
    the manifest naming bf16-h100 and fp8's unit, plan and gate in place."""
    fp8 = load_profile("fp8-h100")
    out = fake_build(tmp_path / "out", fp8, fp, manifest_profile="bf16-h100")
    msg = refusal(load_profile("bf16-h100"), out)
    assert "precision_path.json) in" in msg and "does not hold a build of bf16-h100" in msg
    assert "profile 'fp8-h100' (asked: 'bf16-h100'), gemm 'FP8' (asked: 'NO_QUANT'), kv 'FP8' (asked: 'NONE')" in msg
    assert "plan.json in" in msg and "gated checkpoint" in msg and "[rule accept.output]" in msg


def test_cli_promote_refuses_another_profiles_unit(tmp_path, fp):
    out = fake_build(tmp_path / "out", load_profile("fp8-h100"), fp, manifest_profile="bf16-h100")
    repo = tmp_path / "serving" / "model_repository"
    r = promote_cli("bf16-h100", out, repo)
    assert r.returncode == 2 and "does not hold a build of bf16-h100" in (r.stdout + r.stderr), r.stdout + r.stderr
    assert not repo.exists()


def test_a_tightened_bar_is_rejudged_and_refused(tmp_path, fp):
    """Issue 25 item 9: the stored measurements (KL mean 0.0743) passed the bar of the build (0.1);
    the profile now says 0.05: promote judges against the current bar and refuses, saying why."""
    path = write_profile(tmp_path)
    out = fake_build(tmp_path / "out", load_profile(str(path)), fp)
    write_profile(tmp_path, kl=0.05)
    msg = refusal(load_profile(str(path)), out)
    assert "the profile's gate bar changed since the build; the stored measurements fail the profile's current bar" in msg
    assert "kl_mean = 0.07432 (outside <= 0.05)" in msg and "[rule accept.verdict]" in msg


def test_a_tightened_category_bar_is_refused_naming_the_category(tmp_path, fp):
    path = write_profile(tmp_path)
    out = fake_build(tmp_path / "out", load_profile(str(path)), fp)
    path.write_text(path.read_text() + "  categories:\n    non_english:\n      kl_mean_max: 0.07\n")
    msg = refusal(load_profile(str(path)), out)
    assert "category non_english: kl_mean = 0.114 [0.08057, 0.1429] misses <= 0.07 (whole interval past the bar)" in msg


def test_a_loosened_bar_is_rejudged_and_said(tmp_path, fp):
    path = write_profile(tmp_path)
    out = fake_build(tmp_path / "out", load_profile(str(path)), fp)
    write_profile(tmp_path, kl=0.2)
    ok = check_promotable(load_profile(str(path)), out, out / "model_repository")
    assert ok.gate["judged_against"]["kl_mean_max"] == 0.2
    assert ok.warnings == ["the gate bar changed since the build; the stored measurements were re-judged against the "
                           "profile's current bar and pass it."]


def test_a_record_for_another_model_gets_that_models_bar(tmp_path, fp):
    """The bar is chosen by the recorded fingerprint: the default model's override does not apply to
    another model gated in a folder of the same name."""
    prof = load_profile("fp8-h100")
    m = {"metrics": {"kl_mean": {"value": 0.05}}, "tokens": {"prompts": 65}, "golden": {"set_prompts": 65},
         "per_category": {}}
    assert judge_metrics(m, prof.gate.for_model(fp))["passed"] is True          # 0.05 <= 0.07 (override)
    v = judge_metrics(m, prof.gate.for_model("0" * 64))                        # another model's content
    assert v["passed"] is False and v["failures"] == ["kl_mean"]                # 0.05 > 0.02 (production bar)


def test_a_build_without_a_gate_record_is_refused(tmp_path, fp):
    prof = load_profile(str(write_profile(tmp_path)))
    out = fake_build(tmp_path / "out", prof, fp)
    m = json.loads((out / "gate" / "metrics.json").read_text())
    del m["record"]
    (out / "gate" / "metrics.json").write_text(json.dumps(m))
    assert "the gate record has no model fingerprint, layout or runtime" in refusal(prof, out)


def _fake_runtime(bin_dir: Path, trtllm: str) -> None:
    """A ``docker`` that has the image and answers the version script like the image's python3 would."""
    bin_dir.mkdir()
    exe = bin_dir / "docker"
    exe.write_text("#!/bin/sh\n"
                   'if [ "$1" = image ]; then exit 0; fi\n'
                   'case "$*" in *importlib.metadata*) '
                   f'printf "tensorrt_llm={trtllm}\\ntensorrt=10.13.3.9\\n"; exit 0;; esac\n'
                   "exit 1\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)


def test_image_versions_inside_the_image_else_the_catalog(tmp_path, monkeypatch):
    from precision_pipeline.serving.images import image_versions

    tag = "nvcr.io/nvidia/tritonserver:26.05-trtllm-python-py3"
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    v = image_versions(tag)
    assert (v.source, v.tensorrt_llm, v.tensorrt) == ("catalog", "1.2.1", None)
    assert v.why.startswith("the tag catalog (serving/images.py: ") and "no container runtime (docker, podman) on PATH" in v.why
    _fake_runtime(tmp_path / "bin", "1.2.0rc5")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    v = image_versions(tag)
    assert (v.source, v.runtime, v.tensorrt_llm, v.tensorrt) == ("image", "docker", "1.2.0rc5", "10.13.3.9")
    assert v.why == "read inside the image with docker (package metadata)"
    assert image_versions("example.com/unknown:1").source == "image"  # the runtime has it: the tag does not matter


def test_image_versions_with_a_stand_in_runtime(monkeypatch):
    """``image inspect`` gets at most 30 s, ``run`` the whole timeout; a run that fails (even with output) falls back
    to the catalog saying why; a value is everything after the first ``=``. A catalog row is read-only."""
    import dataclasses
    import shutil
    import subprocess

    from precision_pipeline.engine import toolchain
    from precision_pipeline.serving import images

    tag = "nvcr.io/nvidia/tritonserver:26.05-trtllm-python-py3"
    calls, run_rc = [], [1]

    def run_quiet(argv, timeout):
        calls.append((argv[1], timeout))
        rc = 0 if argv[1] == "image" else run_rc[0]
        return subprocess.CompletedProcess(argv, rc, "tensorrt_llm=1.2.0+git=abc\ntensorrt=10.13\n", "")

    monkeypatch.setattr(shutil, "which", lambda rt: f"/usr/bin/{rt}" if rt == "docker" else None)
    monkeypatch.setattr(toolchain, "run_quiet", run_quiet)
    v = images.image_versions(tag, timeout_s=100)
    assert (v.source, v.tensorrt_llm) == ("catalog", "1.2.1") and "docker could not run python3 in it" in v.why
    assert calls == [("image", 30), ("run", 100)]
    run_rc[0] = 0
    v = images.image_versions(tag, timeout_s=100)
    assert (v.source, v.tensorrt_llm, v.tensorrt) == ("image", "1.2.0+git=abc", "10.13")
    with pytest.raises(dataclasses.FrozenInstanceError):
        images.CATALOG[0].tensorrt = "10.0"


def test_the_release_record_says_where_the_image_versions_came_from(tmp_path, fp, monkeypatch):
    prof = load_profile(str(write_profile(tmp_path)))
    out = fake_build(tmp_path / "out", prof, fp)
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    ok = check_promotable(prof, out, out / "model_repository", image="nvcr.io/nvidia/tritonserver:26.05-trtllm-python-py3")
    assert ok.gate["serving_image"]["source"] == "catalog" and ok.gate["serving_image"]["tensorrt_llm"] == "1.2.1"
    assert ok.warnings[0].startswith("serving image nvcr.io/nvidia/tritonserver:26.05-trtllm-python-py3: TensorRT-LLM "
                                     "1.2.1, TensorRT ?; the tag catalog (serving/images.py")


def test_cli_first_promote_shows_the_warnings(tmp_path, fp):
    """The first promote (it creates the serving repository) used to drop the skew warnings."""
    path = write_profile(tmp_path)
    out = fake_build(tmp_path / "out", load_profile(str(path)), fp)
    from precision_pipeline.core.stage import RECORDS_DIR, write_record
    from precision_pipeline.serving.stage import ManifestsArtifact

    # the serving image comes from the deploy stage's typed artifact (not parsed out of the rendered YAML)
    write_record(out / RECORDS_DIR / "deploy.json", "deploy", "0" * 64, ManifestsArtifact(
        files=("triton-deployment.yaml",), gpus_per_replica=1, replicas=1, launcher="tritonserver",
        image="example.com/triton:custom"))
    repo = tmp_path / "serving" / "model_repository"
    env = dict(os.environ, COLUMNS="300", PATH=f"{tmp_path / 'none'}:{os.path.dirname(sys.executable)}:/usr/bin:/bin")
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep)
                                  if not any((Path(p) / rt).exists() for rt in ("docker", "podman")))
    r = subprocess.run([*INVOKE, "promote", "--profile", str(path), "--out", str(out), "--repo", str(repo)],
                       cwd=REPO_ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert ("warning: serving image example.com/triton:custom: TensorRT-LLM ?, TensorRT ?; not in the tag catalog, and "
            "no container runtime (docker, podman) on PATH.") in r.stdout, r.stdout
    assert "created " in r.stdout
    rel = json.loads((repo.parent / "releases.json").read_text())["releases"][0]["gate"]
    assert rel["serving_image"]["source"] == "unknown" and rel["record"]["model_fingerprint"] == fp
    assert rel["judged_against"]["kl_mean_max"] == 0.1 and rel["prompts"] == 18


def test_cli_rollout_refuses_a_golden_limit_build_before_any_server_is_asked(tmp_path, fp):
    path = write_profile(tmp_path, min_prompts=19)
    out = fake_build(tmp_path / "out", load_profile(str(path)), fp, prompts_per_category=3)
    env = dict(os.environ, COLUMNS="300")
    r = subprocess.run([*INVOKE, "rollout", "--profile", str(path), "--out", str(out), "--repo",
                        str(tmp_path / "serving" / "model_repository"), "--url", "127.0.0.1:9"],
                       cwd=REPO_ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "not promotable: the verdict covers 18 golden prompt(s), fewer than gate.min_prompts 19" in (r.stdout + r.stderr), (r.stdout + r.stderr)


def test_a_verdict_about_another_model_is_refused(tmp_path, fp):
    prof = load_profile(str(write_profile(tmp_path)))
    out = fake_build(tmp_path / "out", prof, fp)
    m = json.loads((out / "gate" / "metrics.json").read_text())
    m["record"]["model_fingerprint"] = "0" * 64
    (out / "gate" / "metrics.json").write_text(json.dumps(m))
    msg = refusal(prof, out)
    assert "the gate judged the model with content fingerprint 000000000000…, but " in msg
    assert f"is now {fp[:12]}…" in msg and "[rule accept.model]" in msg


def test_a_profile_edited_since_the_build_is_refused_as_stale(tmp_path, fp):
    """Hostile s8 #102: deployment.keep_releases edited after the build was ignored without a word; a profile that
    no longer matches the build's (the resolve record) is refused naming each field, a gate-bar change alone is
    re-judged (above), and the description is text."""
    path = write_profile(tmp_path)
    out = fake_build(tmp_path / "out", load_profile(str(path)), fp)
    path.write_text(path.read_text() + "description: a new line of text\n")
    assert check_promotable(load_profile(str(path)), out, out / "model_repository").warnings == []
    path.write_text(path.read_text() + "deployment:\n  keep_releases: 0\n  canary_steps: [50, 100]\n")
    msg = refusal(load_profile(str(path)), out)
    assert (f"--profile: mybf16 changed since the build in {out} (built -> now): deployment.canary_steps: [5, 20, 50, 100] "
            "-> [50, 100]; deployment.keep_releases: 2 -> 0; the output was built, and its manifests rendered, from the "
            f"profile as it was. Fix: rebuild it: invoke build --profile mybf16 --out {out} (a change of the gate bar "
            "alone is re-judged without a rebuild). [rule accept.profile]") in msg, msg


def test_a_layout_mismatch_is_refused_in_process_and_long_values_are_cut(tmp_path, fp):
    """``check_promotable`` itself (the CLI test above runs it in a new process): the gate's layout against the
    profile's; a changed value longer than 60 characters is shown cut to 60 with an ellipsis."""
    from precision_pipeline.serving import acceptance

    path = write_profile(tmp_path)
    out = fake_build(tmp_path / "out", load_profile(str(path)), fp)
    msg = refusal(load_profile(str(write_profile(tmp_path, tp=3))), out)
    assert "the gate ran at tp_size 1 but mybf16 serves tp_size 3: the verdict is not about what the release would serve" in msg
    long = acceptance._short("x" * 100)
    assert long == '"' + "x" * 58 + "\u2026" and len(long) == 60
    assert acceptance._short("x" * 58) == '"' + "x" * 58 + '"'  # 60 characters: kept whole


def test_the_gated_checkpoint_is_checked_without_a_record(tmp_path, fp):
    """A metrics.json that names its checkpoint's quantization but has no ``record`` (a gate of an older version):
    the quantization it gated is still compared with the profile's."""
    fp8 = load_profile("fp8-h100")
    out = fake_build(tmp_path / "out", fp8, fp, manifest_profile="bf16-h100")
    m = json.loads((out / "gate" / "metrics.json").read_text())
    m.pop("record")
    (out / "gate" / "metrics.json").write_text(json.dumps(m))
    assert "the gated checkpoint (gate/metrics.json) in" in refusal(load_profile("bf16-h100"), out)


@pytest.mark.parametrize("gated, warned", [("1.1.0", True), ("1.2.1", False), (None, False)])
def test_a_gate_run_under_another_tensorrt_llm_is_said(tmp_path, fp, monkeypatch, gated, warned):
    prof = load_profile(str(write_profile(tmp_path)))
    out = fake_build(tmp_path / "out", prof, fp)
    m = json.loads((out / "gate" / "metrics.json").read_text())
    m["record"]["runtime"]["tensorrt_llm"] = gated
    (out / "gate" / "metrics.json").write_text(json.dumps(m))
    monkeypatch.setenv("PATH", str(tmp_path / "none"))  # no container runtime: the image catalog's 1.2.1
    image = "nvcr.io/nvidia/tritonserver:26.05-trtllm-python-py3"
    ok = check_promotable(prof, out, out / "model_repository", image=image)
    said = [w for w in ok.warnings if w.startswith("the gate ran where")]
    assert said == ([f"the gate ran where TensorRT-LLM 1.1.0 was installed; {image} ships 1.2.1."] if warned else [])
    assert check_promotable(prof, out, out / "model_repository").warnings == []  # no image: nothing to compare


def test_a_long_list_of_profile_changes_is_cut_after_six(tmp_path, fp, monkeypatch):
    from precision_pipeline.serving import acceptance

    path = write_profile(tmp_path)
    out = fake_build(tmp_path / "out", load_profile(str(path)), fp)
    monkeypatch.setattr(acceptance, "_changed", lambda a, b: [f"f{i}: 1 -> 2" for i in range(8)])
    msg = refusal(load_profile(str(path)), out)
    assert "(built -> now): f0: 1 -> 2; f1: 1 -> 2; f2: 1 -> 2; f3: 1 -> 2; f4: 1 -> 2; f5: 1 -> 2; and 2 more; " in msg
    monkeypatch.setattr(acceptance, "_changed", lambda a, b: [f"f{i}: 1 -> 2" for i in range(6)])
    assert "f5: 1 -> 2; the output was built" in refusal(load_profile(str(path)), out)


def test_image_versions_without_a_local_copy_never_runs_it(monkeypatch):
    """``image inspect`` failing (the runtime has no local copy) or not answering: the image is not run (nothing is
    pulled) and the catalog is used, saying so."""
    import shutil
    import subprocess

    from precision_pipeline.engine import toolchain
    from precision_pipeline.serving import images

    tag = "nvcr.io/nvidia/tritonserver:26.05-trtllm-python-py3"
    for inspect in (subprocess.CompletedProcess([], 1, "", "Error: No such image"), None):
        calls = []

        def run_quiet(argv, timeout, inspect=inspect):
            calls.append(argv[1])
            return inspect if argv[1] == "image" else subprocess.CompletedProcess(argv, 0, "tensorrt_llm=9.9\n", "")

        monkeypatch.setattr(shutil, "which", lambda rt: f"/usr/bin/{rt}" if rt == "docker" else None)
        monkeypatch.setattr(toolchain, "run_quiet", run_quiet)
        v = images.image_versions(tag, timeout_s=100)
        assert calls == ["image"] and (v.source, v.tensorrt_llm) == ("catalog", "1.2.1")
        assert "docker has no local copy of it" in v.why
