"""The nightly's logic without builds: comparison, exit codes, the summary table, the upgrade canary's
report (through its installer seam: nothing is created or installed), the CronJob and the workflows."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from precision_pipeline import nightly as nl
from precision_pipeline.core.errors import UserError

ROOT = Path(__file__).resolve().parent.parent


def _row(**gate) -> nl.Row:
    return nl.Row(profile="p", source="p", gate={k: dict(v) for k, v in gate.items()}, checkpoint_bytes=100,
                  provenance={"producer": {"version": "0.47.0"}})


def test_regression_only_beyond_the_interval_and_in_the_right_direction():
    base = {"gate": {"kl_mean": 0.05, "top1": 0.90}, "checkpoint_bytes": 100, "provenance": {"producer": {"version": "0.47.0"}}}
    inside = _row(kl_mean={"value": 0.06, "ci95": [0.045, 0.07], "passed": True, "op": "<="},
                  top1={"value": 0.89, "ci95": [0.88, 0.91], "passed": True, "op": ">="})
    assert nl.compare(inside, base) == []
    worse = _row(kl_mean={"value": 0.09, "ci95": [0.07, 0.11], "passed": True, "op": "<="},
                 top1={"value": 0.85, "ci95": [0.83, 0.87], "passed": True, "op": ">="})
    f = {x["what"]: x for x in nl.compare(worse, base)}
    assert f["kl_mean"]["kind"] == "regression" and (f["kl_mean"]["before"], f["kl_mean"]["after"]) == (0.05, 0.09)
    assert f["top1"]["kind"] == "regression" and f["top1"]["before"] == 0.90
    better = _row(kl_mean={"value": 0.01, "ci95": [0.005, 0.02], "passed": True, "op": "<="},
                  top1={"value": 0.99, "ci95": [0.98, 1.0], "passed": True, "op": ">="})
    assert nl.compare(better, base) == []  # improvements are not findings


def test_newly_failing_size_and_provenance_are_findings():
    base = {"gate": {"kl_mean": {"value": 0.2, "passed": True}}, "checkpoint_bytes": 100,
            "provenance": {"producer": {"version": "0.47.0"}}}
    row = _row(kl_mean={"value": 0.21, "ci95": None, "passed": False, "op": "<="})
    row.checkpoint_bytes, row.provenance = 120, {"producer": {"version": "0.48.0"}}
    kinds = {(x["kind"], x["what"]): x for x in nl.compare(row, base)}
    assert set(kinds) == {("newly_failing", "kl_mean"), ("checkpoint_size", "checkpoint_bytes"), ("provenance", "producer")}
    assert kinds[("checkpoint_size", "checkpoint_bytes")]["after"] == 120 and "+20.00%" in kinds[("checkpoint_size", "checkpoint_bytes")]["detail"]
    # a metric that already failed in the baseline is not "newly" failing
    base["gate"]["kl_mean"]["passed"] = False
    assert ("newly_failing", "kl_mean") not in {(x["kind"], x["what"]) for x in nl.compare(row, base)}


def test_a_baseline_value_that_is_no_number_is_said_not_compared():
    """Hostile s15b F13: a baseline whose kl_mean was "NaN" and top1 null was compared on the rest without a word."""
    base = {"gate": {"kl_mean": {"value": "NaN"}, "top1": {"value": None}, "kl_p99": 0.1}, "checkpoint_bytes": 100,
            "provenance": {"producer": {"version": "0.47.0"}}}
    row = _row(kl_mean={"value": 0.06, "ci95": [0.045, 0.07], "passed": True, "op": "<="},
               top1={"value": 0.9, "ci95": [0.88, 0.91], "passed": True, "op": ">="},
               kl_p99={"value": 0.1, "ci95": [0.09, 0.11], "passed": True, "op": "<="})
    found = nl.compare(row, base)
    assert [(f["kind"], f["what"]) for f in found] == [("not_compared", "kl_mean"), ("not_compared", "top1")]
    assert found[0]["detail"] == ('kl_mean not compared: the baseline\'s value is {"value": "NaN"}, not a number (a '
                                  'damaged baseline?)')


@pytest.mark.parametrize("verdicts,code", [
    (["pass", "pass"], 0), (["pass", "skipped"], 4), (["skipped", "refused"], 2), (["refused", "failed"], 3),
    (["failed", "regressed"], 6), (["regressed", "engine_failed"], 5), (["regressed", "error", "pass"], 1), ([], 0)])
def test_exit_code_is_the_most_severe_row(verdicts, code):
    assert nl.exit_code(verdicts) == code


def test_release_baseline_comes_before_the_previous_nightly():
    releases = {"releases": [{"profile": "p", "unit": "u1", "gate": {"kl_mean": 0.1}, "kind": "release"},
                             {"profile": "p", "unit": "fb", "gate": {"kl_mean": 0.9}, "kind": "fallback"},
                             {"profile": "q", "unit": "u2", "gate": {"kl_mean": 0.3}}]}
    prev = {"last_measured": {"p": {"time": "t", "gate": {"kl_mean": 0.2}}, "r": {"time": "t2", "gate": {"kl_mean": 0.4}}}}
    assert nl.find_baseline("p", releases, prev)["gate"] == {"kl_mean": 0.1}
    assert nl.find_baseline("r", releases, prev)["source"] == "nightly t2"
    assert nl.find_baseline("z", releases, prev) is None


def test_summary_markdown_renders_one_table(tmp_path, monkeypatch):
    row = _row(kl_mean={"value": 0.09, "ci95": [0.07, 0.11], "passed": True, "op": "<="},
               kl_p99={"value": 0.5, "ci95": [0.4, 0.6], "passed": True, "op": "<="})
    row.rebuilt, row.stages, row.skipped = ["gate"], {"gate": "done", "engine": "skipped"}, {"engine": "tensorrt_llm is not installed"}
    row.baseline = {"source": "nightly t", "gate": {"kl_mean": 0.05}}
    row.findings = nl.compare(row, row.baseline)
    row.verdict = "regressed"
    refused = nl.Row(profile="bad", source="bad.yaml", verdict="refused", reason="target.gpu: unknown")
    s = nl.NightlySummary(rows=[row, refused], started=0.0, finished=1.0, baseline_source="previous nightly", last_measured={})
    step = tmp_path / "step.md"
    step.write_text("earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(step))
    js, md = nl.write_summary(s, tmp_path / "nightly")
    text = md.read_text()
    table = [ln for ln in text.splitlines() if ln.startswith("|")]
    assert table[0] == "| profile | stages rebuilt | kl_mean | kl_p99 | top1 | ppl_delta_pct | delta vs baseline | verdict |"
    assert table[2] == "| p | gate | 0.09 | 0.5 | - | - | kl_mean +0.04 | **regressed (1 finding)** |"
    assert table[3] == "| bad | - | - | - | - | - | - | **refused** |"
    assert "- `p` engine skipped: tensorrt_llm is not installed" in text
    assert "- `bad` refused: target.gpu: unknown" in text
    assert json.loads(js.read_text())["exit_code"] == 6
    assert step.read_text() == "earlier step\n" + text + "\n"


def test_profile_and_checkpoint_options():
    from precision_pipeline.spec.profile import shipped_profiles

    assert nl.select_profiles("all") == nl.select_profiles(None) == shipped_profiles()
    assert nl.select_profiles(" a, b ,a") == ["a", "b"]
    with pytest.raises(UserError):
        nl.select_profiles(",")
    for blank in ("", "  "):  # issue 25 item 11: an empty --profiles built all 10 profiles
        with pytest.raises(UserError, match="names no profile"):
            nl.select_profiles(blank)
    assert nl.parse_checkpoints("x=/c1,y=/c2", ["x", "y"]) == {"x": "/c1", "y": "/c2"}
    assert nl.parse_checkpoints("/c", ["x"]) == {"*": "/c"}
    with pytest.raises(UserError, match="ambiguous"):
        nl.parse_checkpoints("/c", ["x", "y"])
    # hostile s12 F-K: a NAME that is not selected was ignored (the nightly quantized again)
    with pytest.raises(UserError) as ei:
        nl.parse_checkpoints("nosuch=/tmp", ["fp8-h100"])
    assert ei.value.message == ("--checkpoint: 'nosuch' is not among the selected profiles: fp8-h100. Fix: name a "
                                "selected profile (NAME=DIR), or select it with --profiles.")
    assert nl.parse_checkpoints("k-fp8=/c", ["/tmp/u/k-fp8.yaml"]) == {"k-fp8": "/c"}  # a YAML path: its stem


def test_nightly_out_inside_a_serving_repository_is_refused(tmp_path, invoke_here):
    """Hostile s12 F-R: `nightly --out <a live model repository>` wrote fp8-h100/ and nightly/ into it (Triton lists
    them as models). Refused before anything is built, as for the folder beside it (releases.json)."""
    repo = tmp_path / "srv" / "repo"
    (repo / "ensemble").mkdir(parents=True)
    (repo / "ensemble" / "config.pbtxt").write_text('name: "ensemble"\n')
    (tmp_path / "srv" / "releases.json").write_text("{}")
    for out, hit in ((repo, repo / "ensemble" / "config.pbtxt"), (tmp_path / "srv", tmp_path / "srv" / "releases.json"),
                     (repo / "ensemble" / "x", repo / "ensemble" / "config.pbtxt")):
        r = invoke_here("nightly", "--profiles", "fp8-h100", "--out", str(out))
        assert r.returncode == 2, r.stdout + r.stderr
        assert f"--out: {out} is {'' if out.name != 'x' else 'inside '}a serving repository ({hit} is there)" in (r.stdout + r.stderr), (r.stdout + r.stderr)
    assert sorted(p.name for p in repo.iterdir()) == ["ensemble"] and not (repo / "ensemble" / "x").exists()


def test_a_regressed_night_does_not_become_the_baseline_of_the_re_run(tmp_path, monkeypatch):
    """Issue 25 item 11: exit 6, then a re-run with the same (regressed) numbers passed against them."""
    good = {"value": 0.05, "ci95": [0.045, 0.055], "passed": True, "op": "<="}
    bad = {"value": 0.09, "ci95": [0.08, 0.10], "passed": True, "op": "<="}
    tonight = {"gate": good}
    from types import SimpleNamespace

    monkeypatch.setattr(nl, "_check", lambda ref, opts: (SimpleNamespace(profile=SimpleNamespace(name=ref)), None))

    def build_row(ref, req, plan, opts, build, say):
        return nl.Row(profile="p", source="p", gate={"kl_mean": dict(tonight["gate"])}, checkpoint_bytes=100)
    monkeypatch.setattr(nl, "_build_row", build_row)
    opts = nl.NightlyOptions(profiles=["p"], out_root=tmp_path, serving_repo=tmp_path / "none" / "model_repository")
    assert nl.run_nightly(opts, say=lambda m: None).exit_code == 0
    tonight["gate"] = bad
    s1 = nl.run_nightly(opts, say=lambda m: None)
    assert s1.exit_code == 6 and s1.rows[0].verdict == "regressed"
    s2 = nl.run_nightly(opts, say=lambda m: None)  # the re-run, same numbers
    assert s2.exit_code == 6 and s2.rows[0].baseline["gate"]["kl_mean"]["value"] == 0.05
    saved = json.loads((tmp_path / "nightly" / "summary.json").read_text())
    assert saved["last_measured"]["p"]["gate"]["kl_mean"]["value"] == 0.05
    tonight["gate"] = good  # fixed: passes, and is the baseline again
    assert nl.run_nightly(opts, say=lambda m: None).exit_code == 0


def test_promote_needs_exactly_one_profile(tmp_path):
    with pytest.raises(UserError, match="one profile"):
        nl.run_nightly(nl.NightlyOptions(profiles=["a", "b"], out_root=tmp_path, promote=True), build=lambda *a, **k: None)


def test_promote_of_an_unchanged_night_is_said_and_the_summary_written(tmp_path, monkeypatch):
    """Issue 25 item 18: ``nightly --promote`` on a night where nothing changed exited 2 and wrote no summary (the
    promote refused: the unit is already current). The refusal is said; the night's verdict stands (exit 0)."""
    from types import SimpleNamespace

    from precision_pipeline.serving import build_output

    gate = {"kl_mean": {"value": 0.05, "ci95": [0.045, 0.055], "passed": True, "op": "<="}}
    monkeypatch.setattr(nl, "_check", lambda ref, opts: (SimpleNamespace(profile=SimpleNamespace(name=ref)), None))
    monkeypatch.setattr(nl, "_build_row", lambda ref, req, plan, opts, build, say: nl.Row(
        profile="p", source="p", gate={k: dict(v) for k, v in gate.items()}, checkpoint_bytes=100))
    opened = SimpleNamespace(profile=SimpleNamespace(deployment=SimpleNamespace(fallback=None)))
    monkeypatch.setattr(build_output, "open_build", lambda ref, out=None: opened)
    calls = []

    def promote_build(b, repo, **k):  # what release.promote says of the unit that is already current
        calls.append(repo)
        raise UserError("engine_unit", "tensorrt_llm_0123456789ab is already the current release.", "nothing to promote.")
    monkeypatch.setattr(build_output, "promote_build", promote_build)
    said = []
    opts = nl.NightlyOptions(profiles=["p"], out_root=tmp_path, promote=True,
                             serving_repo=tmp_path / "serving" / "model_repository")
    s = nl.run_nightly(opts, say=said.append)
    assert s.exit_code == 0 and s.promoted is None and calls == [tmp_path / "serving" / "model_repository"]
    assert any(m.startswith("[nightly] not promoted: ") and "already the current release" in m for m in said), said
    saved = json.loads((tmp_path / "nightly" / "summary.json").read_text())
    assert saved["exit_code"] == 0 and saved["promoted"] is None and saved["profiles"][0]["verdict"] == "pass"
    assert saved["not_promoted"] == s.not_promoted == str(UserError(
        "engine_unit", "tensorrt_llm_0123456789ab is already the current release.", "nothing to promote."))
    assert f"Not promoted: {s.not_promoted}" in (tmp_path / "nightly" / "summary.md").read_text()
    gate["kl_mean"]["passed"] = False  # a failing night: no promote asked, and why is said
    s = nl.run_nightly(opts, say=said.append)
    assert s.exit_code == 6 and len(calls) == 1 and s.not_promoted == "not every check passed"  # newly failing: regressed


# ---- the upgrade canary, through its seam


@pytest.mark.parametrize("version,word", [("0.47.0", None), ("0.48.0", "DEPRECATES"), ("0.48.1", "DEPRECATES"),
                                          ("0.49.0", "REMOVES"), ("1.0.0", "REMOVES")])
def test_export_notice(version, word):
    n = nl.export_notice(version)
    assert (n is None) if word is None else (word in n and "export_tensorrt_llm_checkpoint" in n)


class FakeInstaller:
    """Records what the canary asks; writes the canary nightly's summary instead of running it."""

    def __init__(self, versions, canary_rows, rc=0):
        self.versions, self.canary_rows, self.rc, self.calls = versions, canary_rows, rc, []

    def create(self, venv_dir):
        self.calls.append(("create", Path(venv_dir)))

    def install(self, packages):
        self.calls.append(("install", tuple(packages)))
        return dict(self.versions)

    def run(self, argv, cwd):
        self.calls.append(("run", list(argv)))
        out = Path(argv[argv.index("--out") + 1]) / "nightly"
        if self.canary_rows is not None:
            out.mkdir(parents=True)
            (out / "summary.json").write_text(json.dumps({"profiles": self.canary_rows}))
        return self.rc


def test_upgrade_canary_reports_per_profile_and_says_when_the_export_is_removed(tmp_path):
    nd = tmp_path / "out" / "nightly"
    nd.mkdir(parents=True)
    gate = {"kl_mean": {"value": 0.05, "ci95": [0.04, 0.06], "passed": True, "op": "<="}}
    (nd / "summary.json").write_text(json.dumps({"profiles": [
        {"profile": "a", "verdict": "pass", "gate": gate, "checkpoint_bytes": 10, "provenance": {}},
        {"profile": "b", "verdict": "pass", "gate": gate, "checkpoint_bytes": 10, "provenance": {}},
        {"profile": "c", "route": "llm_api", "verdict": "pass", "gate": gate, "checkpoint_bytes": 10, "provenance": {}}]}))
    canary = [{"profile": "a", "route": "engine", "verdict": "pass",
               "gate": {"kl_mean": {"value": 0.09, "ci95": [0.08, 0.1], "passed": True, "op": "<="}},
               "checkpoint_bytes": 10, "provenance": {}},
              {"profile": "b", "route": "engine", "verdict": "error", "reason": "AttributeError: export_tensorrt_llm_checkpoint",
               "gate": {}},
              {"profile": "c", "route": "llm_api", "verdict": "pass", "gate": gate, "checkpoint_bytes": 10, "provenance": {}}]
    fake = FakeInstaller({"nvidia-modelopt": "0.49.0", "transformers": "5.1.0"}, canary)
    before = sorted(p.name for p in (ROOT / ".venv").iterdir()) if (ROOT / ".venv").exists() else []
    rep = nl.run_upgrade(nl.NightlyOptions(profiles=["a", "b"], out_root=tmp_path / "out", golden_limit=1), installer=fake,
                         workdir=tmp_path / "work", say=lambda m: None)
    assert fake.calls[0] == ("create", tmp_path / "work" / "venv") and fake.calls[1] == ("install", nl.UPGRADED)
    assert fake.calls[2][1][:5] == ["nightly", "--out", str(tmp_path / "work" / "artifacts"), "--profiles", "a,b"]
    by = {r["profile"]: r for r in rep["profiles"]}
    assert by["a"]["verdict"] == "changes" and by["a"]["changes"][0]["what"] == "kl_mean"
    assert by["b"]["verdict"] == "breaks" and by["b"]["route"] == "engine"
    assert by["c"]["verdict"] == "unchanged" and by["c"]["route"] == "llm_api"  # the route the removal does not touch
    assert "REMOVES" in rep["notice"] and "llm_api route" in rep["notice"] and rep["exit_code"] == 6
    md = (nd / "upgrade.md").read_text()
    assert "**ModelOpt 0.49.0 REMOVES export_tensorrt_llm_checkpoint" in md and "| b | engine | breaks |" in md
    assert "| c | llm_api | unchanged | - |" in md
    assert json.loads((nd / "upgrade.json").read_text())["versions"]["nvidia-modelopt"] == "0.49.0"
    after = sorted(p.name for p in (ROOT / ".venv").iterdir()) if (ROOT / ".venv").exists() else []
    assert before == after  # the pinned venv is not touched


def test_upgrade_canary_without_a_summary_breaks(tmp_path):
    fake = FakeInstaller({"nvidia-modelopt": "0.47.1", "transformers": "4.57.6"}, None, rc=1)
    rep = nl.run_upgrade(nl.NightlyOptions(profiles=["a"], out_root=tmp_path), installer=fake, workdir=tmp_path / "w",
                         say=lambda m: None)
    assert rep["notice"] is None and rep["profiles"][0]["verdict"] == "breaks" and rep["exit_code"] == 6


# ---- the CronJob


def test_cronjob_renders_valid_with_forbid_and_history_limits(tmp_path):
    from precision_pipeline.serving import deploy

    path = nl.render_cronjob("h100", tmp_path)
    doc = yaml.safe_load(path.read_text())
    deploy.validate_manifest(doc, "cronjob")  # the Kubernetes schemas, strict
    spec = doc["spec"]
    assert (doc["kind"], spec["concurrencyPolicy"]) == ("CronJob", "Forbid")
    assert spec["successfulJobsHistoryLimit"] == 3 and spec["failedJobsHistoryLimit"] == 5
    pod = spec["jobTemplate"]["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["command"][:3] == ["./run.sh", "nightly", "--strict"]
    assert c["command"][c["command"].index("--profiles") + 1] == "bf16-h100,fp8-h100,fp8-h100-llmapi,fp8-h100-routed,fp8-h200,mixed-fp8-int4-h100"
    assert c["image"] == deploy.DEFAULT_IMAGE and c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == deploy.DEFAULT_PVC
    assert c["volumeMounts"][0]["mountPath"] == c["command"][c["command"].index("--out") + 1]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms[0]["matchExpressions"][0]["values"] == ["NVIDIA-H100-80GB-HBM3"]
    with pytest.raises(UserError):
        nl.render_cronjob("h100", tmp_path, image="not an image")


def test_cronjob_template_is_not_a_deploy_template():
    assert nl.CRONJOB_TEMPLATE.parent != ROOT / "k8s" and nl.CRONJOB_TEMPLATE.is_file()


# ---- the workflows


WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))


def _actionlint() -> str:
    exe = Path(sys.executable).parent / "actionlint"
    return str(exe) if exe.is_file() else (shutil.which("actionlint") or pytest.fail("actionlint is not installed "
                                                                                      "(requirements.lock pins it)"))


def test_workflows_pass_actionlint():
    assert [w.name for w in WORKFLOWS] == ["ci.yml", "nightly.yml"]
    r = subprocess.run([_actionlint(), "-config-file", str(ROOT / ".github" / "actionlint.yaml"), *map(str, WORKFLOWS)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def _run_lines():
    for w in WORKFLOWS:
        doc = yaml.safe_load(w.read_text())
        for job_name, job in doc["jobs"].items():
            for step in job.get("steps", []):
                if "run" in step:
                    yield w.name, job_name, step["run"]


def test_workflow_steps_call_only_commands_that_exist(invoke_here):
    import tasks

    task_names = {n for n in dir(tasks) if hasattr(getattr(tasks, n), "body")}
    lines = list(_run_lines())
    assert lines
    for wf, job, run in lines:
        for cmd in run.strip().splitlines():
            m = re.fullmatch(r"\./run\.sh (\w+)(?: .*)?", cmd.strip())
            assert m, f"{wf} {job}: {cmd!r} is not a ./run.sh TASK call"
            assert m.group(1) in task_names, f"{wf} {job}: no task {m.group(1)!r}"
    assert ("ci.yml", "test", "./run.sh test") in lines  # the README's test command
    # every flag given to the nightly task exists
    help_text = invoke_here("--help", "nightly").stdout
    for wf, job, run in lines:
        for flag in re.findall(r"(--[a-z-]+)", run):
            assert flag in help_text, f"{wf} {job}: {flag} is not a flag of invoke nightly"


def test_upgrade_canary_job_runs_one_profile_of_each_serving_route():
    """Issue 28: the night the engine route's export disappears is a red night -- the canary builds a profile of every
    serving route with the newest ModelOpt."""
    from precision_pipeline.pipeline import ROUTES
    from precision_pipeline.spec.profile import load_profile

    doc = yaml.safe_load((ROOT / ".github" / "workflows" / "nightly.yml").read_text())
    runs = [st["run"] for st in doc["jobs"]["upgrade"]["steps"] if "run" in st]
    assert len(runs) == 1 and "--upgrade" in runs[0]
    names = re.search(r"--profiles (\S+)", runs[0]).group(1).split(",")
    assert sorted(load_profile(n).route for n in names) == sorted(ROUTES)


def test_gpu_matrix_covers_every_profile_once_by_its_sm():
    from precision_pipeline.spec.profile import shipped_profiles

    doc = yaml.safe_load((ROOT / ".github" / "workflows" / "nightly.yml").read_text())
    gpu = doc["jobs"]["gpu"]
    assert gpu["runs-on"] == ["self-hosted", "gpu", "sm${{ matrix.sm }}"]
    seen = []
    for entry in gpu["strategy"]["matrix"]["include"]:
        names = entry["profiles"].split(",")
        assert names == nl.profiles_for_sm(int(entry["sm"])), entry
        seen += names
    assert sorted(seen) == shipped_profiles()
    labels = yaml.safe_load((ROOT / ".github" / "actionlint.yaml").read_text())["self-hosted-runner"]["labels"]
    assert sorted(labels) == sorted(["gpu"] + [f"sm{e['sm']}" for e in gpu["strategy"]["matrix"]["include"]])
    assert "--strict" in gpu["steps"][1]["run"] and "tritonserver" in gpu["container"]["image"]


def test_scales_digest_reads_any_dtype_and_sees_one_changed_byte(tmp_path):
    """INT4 AWQ checkpoints store BF16 per-group scales: the digest reads raw bytes (no numpy decode),
    ignores weights, and changes when one scale changes."""
    import torch
    from safetensors.torch import save_file

    t = {"transformer.layers.0.mlp.fc.weight": torch.zeros(4, 4, dtype=torch.int8),
         "transformer.layers.0.mlp.fc.weights_scaling_factor": torch.ones(4, 2, dtype=torch.bfloat16),
         "transformer.layers.0.mlp.fc.prequant_scaling_factor": torch.ones(4, dtype=torch.float16)}
    save_file(t, str(tmp_path / "rank0.safetensors"))
    d0 = nl._scales_digest(tmp_path)
    assert d0 is not None and len(d0) == 64
    t["transformer.layers.0.mlp.fc.weight"] = torch.ones(4, 4, dtype=torch.int8)  # a weight: not a scale
    save_file(t, str(tmp_path / "rank0.safetensors"))
    assert nl._scales_digest(tmp_path) == d0
    t["transformer.layers.0.mlp.fc.weights_scaling_factor"][0, 0] = 2.0
    save_file(t, str(tmp_path / "rank0.safetensors"))
    assert nl._scales_digest(tmp_path) != d0
    (tmp_path / "rank0.safetensors").unlink()
    save_file({"w": torch.zeros(2)}, str(tmp_path / "rank0.safetensors"))
    assert nl._scales_digest(tmp_path) is None


def test_an_empty_profile_entry_and_the_filesystem_root_are_refused(tmp_path, invoke_here):
    """Hostile round #138/#134: `--profiles fp8-h100,,bf16-h100` built both (the empty entry skipped, while
    rollout's `--steps 5,,100` is refused); `nightly --out /` built into /fp8-h100."""
    for spec in ("fp8-h100,,bf16-h100", "fp8-h100,", ",fp8-h100"):
        with pytest.raises(UserError, match="has an empty entry") as ei:
            nl.select_profiles(spec)
        assert ei.value.problems[0].field == "--profiles"
    root = Path(__file__).resolve().parents[1]
    # arguments that build nothing if the refusal broke (unknown names, an unknown GPU), never into /
    for args in (["--profiles", "nosuch-a,,nosuch-b", "--out", str(tmp_path)], ["--cronjob", "nosuch-gpu", "--out", "/"]):
        r = (subprocess.run([sys.executable, "-m", "invoke", "nightly", *args], cwd=root, capture_output=True, text=True,
                            timeout=120) if "," in args[1] else invoke_here("nightly", *args))  # the first in a new process
        assert r.returncode == 2 and "Traceback" not in r.stdout + r.stderr, (args, (r.stdout + r.stderr), r.stderr)
        assert ("has an empty entry" if "," in args[1] else "/ is the filesystem root") in (r.stdout + r.stderr)
    from precision_pipeline.core.outputs import validate_out_dir

    with pytest.raises(UserError, match="/ is the filesystem root"):  # the one rule, build's --out too
        validate_out_dir(Path("/"))


def test_an_output_root_in_a_system_folder_is_refused(invoke_here):
    """Hostile s7 #37: `nightly --out /etc` built into /etc/fp8-h100. The one rule (core/outputs.py
    ``refuse_filesystem_root``) for nightly's output root, build's --out and the engine Job."""
    from precision_pipeline.core.outputs import refuse_filesystem_root
    from precision_pipeline.core.outputs import validate_out_dir

    for p, why in (("/etc", "/etc is a system folder"), ("/etc/fp8-h100", "inside the system folder /etc"),
                   ("/usr", "/usr is a system folder"), ("/proc/x", "inside the system folder /proc")):
        with pytest.raises(UserError, match=why):
            refuse_filesystem_root(Path(p), "--out", "an output root")
        with pytest.raises(UserError, match=why):
            validate_out_dir(Path(p))
    assert refuse_filesystem_root(Path("/usr/local/x")) == Path("/usr/local/x")  # only /usr itself
    r = invoke_here("nightly", "--profiles", "nosuch-a", "--out", "/etc")
    assert r.returncode == 2 and "/etc is a system folder" in (r.stdout + r.stderr), ((r.stdout + r.stderr), r.stderr)


def test_nightly_promote_switches_the_live_server(tmp_path, monkeypatch, invoke_here):
    """Hostile s16 H9: ``nightly --promote`` promoted the files only into a repository a local tritonserver served
    (`invoke promote` refuses that without --url): every BLS request failed until serve's watchdog loaded the unit.
    Now it is refused before any build without ``--url``, and with ``--url`` the server is loaded, smoke-tested and
    switched (``attach``, again at the promote)."""
    from types import SimpleNamespace

    from precision_pipeline.serving import build_output
    from tests.serving.test_server_stopped import fake_tritonserver

    monkeypatch.setattr(nl, "_check", lambda ref, opts: (SimpleNamespace(profile=SimpleNamespace(name=ref)), None))
    monkeypatch.setattr(nl, "_build_row", lambda ref, req, plan, opts, build, say: nl.Row(profile="p", source="p"))
    monkeypatch.setattr(build_output, "open_build", lambda ref, out=None: SimpleNamespace(
        profile=SimpleNamespace(deployment=SimpleNamespace(fallback=None))))
    servers = []
    monkeypatch.setattr(build_output, "promote_build", lambda b, repo, **k: servers.append(k["server"]) or
                        SimpleNamespace(unit="tensorrt_llm_0123456789ab"))
    s = nl.run_nightly(nl.NightlyOptions(profiles=["p"], out_root=tmp_path, promote=True), say=lambda m: None,
                       attach=lambda: "the server at --url")
    assert s.promoted == "tensorrt_llm_0123456789ab" and servers == ["the server at --url"]
    repo = tmp_path / "serving" / "model_repository"
    repo.mkdir(parents=True)
    with fake_tritonserver(f"--model-repository={repo}") as srv:
        r = invoke_here("nightly", "--profiles", "fp8-h100", "--promote", "--out", str(tmp_path))
        assert r.returncode == 2 and f"--url: is not given, but tritonserver (pid {srv.pid}) serves {repo}" in r.stderr, \
            r.stdout + r.stderr
    assert not (tmp_path / "fp8-h100").exists()        # refused before any build
    r = invoke_here("nightly", "--profiles", "fp8-h100", "--url", "127.0.0.1:8000", "--out", str(tmp_path))
    assert r.returncode == 2 and "--url: is read only with --promote." in r.stderr, r.stdout + r.stderr


def test_the_promoted_repository_is_resolved_through_a_symbolic_link(tmp_path):
    """Hostile s17 F19: `nightly --promote` with OUT/serving/model_repository a link to a live repository installed a
    unit whose gpt_model_path named the link's folder (not loadable) and read the baseline from the link's folder's
    releases.json; `invoke promote` through the same link resolves it."""
    real = tmp_path / "srv" / "r1" / "repo"
    real.mkdir(parents=True)
    (tmp_path / "out" / "serving").mkdir(parents=True)
    (tmp_path / "out" / "serving" / "model_repository").symlink_to(real)
    opts = nl.NightlyOptions(profiles=["p"], out_root=tmp_path / "out", promote=True)
    assert opts.repo == real and opts.releases_file == tmp_path / "srv" / "r1" / "releases.json"
