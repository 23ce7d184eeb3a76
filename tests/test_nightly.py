"""The nightly on real builds (CPU, one golden prompt per category, the FP8 test checkpoint reused
through --checkpoint so nothing is re-quantized): two profiles from scratch, a no-op second run, one
profile edited, a planted regression against the baseline, a refused profile among good ones.

One from-scratch nightly (``scratch``, module scope) is shared; the tests after it run on the same
output root in file order, and each asserts only what its own run changed. The gate stage measures the
stage-flow tests' ``SMALL_GATE`` (tests/conftest.py: 128 held-out and 3 greedy tokens; its reference is
theirs): these tests are about the nightly's verdicts, rebuilds and findings, and the planted fault's KL
(answer positions only) is the same on any held-out length.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from precision_pipeline import nightly as nl

ROOT = Path(__file__).resolve().parent.parent
LOOSE = ("extends: fp8-h100\ngate:\n  kl_mean_max: 5.0\n  kl_p99_max: 50.0\n  top1_min: 0.1\n  ppl_delta_pct_max: 500.0\n"
         "  greedy_same_min: 0.0\n  overrides: {}\n")


@pytest.fixture(scope="module", autouse=True)
def small_gate_module():
    from tests.conftest import use_small_gate

    with pytest.MonkeyPatch.context() as mp:
        yield use_small_gate(mp)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory, fp8_checkpoint):
    root = tmp_path_factory.mktemp("nightly")
    profs = root / "profiles"
    profs.mkdir()
    (profs / "night-a.yaml").write_text(LOOSE)
    (profs / "night-b.yaml").write_text(LOOSE)
    lines: list[str] = []
    opts = nl.NightlyOptions(profiles=[str(profs / "night-a.yaml"), str(profs / "night-b.yaml")], out_root=root / "out",
                             golden_limit=1, checkpoints={"night-a": str(fp8_checkpoint), "night-b": str(fp8_checkpoint)})
    summary = nl.run_nightly(opts, say=lines.append)
    return {"root": root, "opts": opts, "summary": summary, "lines": lines, "ckpt": fp8_checkpoint}


def _rows(summary) -> dict[str, nl.Row]:
    return {r.profile: r for r in summary.rows}


@pytest.mark.slow
def test_two_profiles_from_scratch(scratch):
    s = scratch["summary"]
    rows = _rows(s)
    assert s.exit_code == 0 and set(rows) == {"night-a", "night-b"}
    for r in rows.values():
        assert r.verdict == "pass" and r.rebuilt == ["quantize", "verify", "gate", "pack", "deploy"], r
        assert "tensorrt_llm" in r.skipped["engine"]  # the engine is skipped on CPU and said so
        assert r.baseline is None and r.findings == []
        assert r.gate["kl_mean"]["value"] > 0 and len(r.gate["kl_mean"]["ci95"]) == 2 and r.checkpoint_bytes > 10**8
        assert r.provenance["producer"]["name"] == "modelopt" and r.provenance["scales_sha256"]
    nd = scratch["opts"].nightly_dir
    data = json.loads((nd / "summary.json").read_text())
    assert [p["profile"] for p in data["profiles"]] == ["night-a", "night-b"] and data["exit_code"] == 0
    assert "| night-a | quantize, verify, gate, pack, deploy |" in (nd / "summary.md").read_text()
    assert any(ln.startswith("[nightly] night-a gate: done") for ln in scratch["lines"])  # a line per stage


@pytest.mark.slow
def test_second_run_rebuilds_nothing_and_says_so(scratch):
    lines: list[str] = []
    s = nl.run_nightly(scratch["opts"], say=lines.append)
    assert s.exit_code == 0
    for r in s.rows:
        assert r.rebuilt == [] and r.verdict == "pass" and r.findings == []
        assert r.baseline["source"].startswith("nightly ")  # the previous nightly
        assert r.stages["gate"] == "cached" and r.stages["quantize"] == "cached"
    assert sum("nothing rebuilt (every stage's key unchanged)" in ln for ln in lines) == 2
    assert "| night-a | nothing |" in (scratch["opts"].nightly_dir / "summary.md").read_text()


@pytest.mark.slow
def test_editing_one_profile_rebuilds_only_that_one(scratch):
    b = scratch["root"] / "profiles" / "night-b.yaml"
    b.write_text(LOOSE + "deployment:\n  replicas: 2\n")
    try:
        rows = _rows(nl.run_nightly(scratch["opts"], say=lambda m: None))
    finally:
        b.write_text(LOOSE)
    assert rows["night-a"].rebuilt == []
    # not re-quantized, not re-gated, not re-packed (pack keys only what it reads: issue 24): the manifests only
    assert rows["night-b"].rebuilt == ["deploy"], rows["night-b"].rebuilt
    assert rows["night-b"].verdict == "pass"


def _planted(src: Path, dst: Path) -> Path:
    """A copy of checkpoint ``src`` with one weight scale (layer 10 mlp.fc) multiplied by 10."""
    import shutil

    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy2(f, dst / f.name)
    t = load_file(str(src / "rank0.safetensors"))
    # both GEMMs of the fused gate/up pair, so the verify stage (fused scales must agree) lets it through to the gate
    for name in ("transformer.layers.10.mlp.fc.weights_scaling_factor", "transformer.layers.10.mlp.gate.weights_scaling_factor"):
        t[name] = t[name] * 10
    save_file(t, str(dst / "rank0.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.slow
def test_planted_regression_is_reported_against_the_baseline(scratch, tmp_path):
    planted = _planted(Path(scratch["ckpt"]), tmp_path / "planted")
    opts = nl.NightlyOptions(profiles=[str(scratch["root"] / "profiles" / "night-a.yaml")], out_root=tmp_path / "out",
                             golden_limit=1, checkpoints={"night-a": str(planted)},
                             baseline=scratch["opts"].nightly_dir)
    s = nl.run_nightly(opts, say=lambda m: None)
    good = _rows(scratch["summary"])["night-a"]
    r = s.rows[0]
    assert s.exit_code == nl.EXIT_REGRESSED and r.verdict == "regressed"
    f = {(x["kind"], x["what"]): x for x in r.findings}
    reg = f[("regression", "kl_mean")]
    assert reg["before"] == pytest.approx(good.gate["kl_mean"]["value"]) and reg["after"] > 10 * reg["before"]
    assert ("newly_failing", "kl_mean") in f  # kl_mean above the profile's 5.0 bar
    assert ("provenance", "scales_sha256") in f
    size = f.get(("checkpoint_size", "checkpoint_bytes"))  # the rewritten safetensors header may differ by a few bytes
    assert size is None or abs(size["after"] - size["before"]) < 1024
    md = (opts.nightly_dir / "summary.md").read_text()
    assert "**regressed (" in md and "regression: kl_mean" in md
    # an unchanged failed gate is read back, not measured again
    lines: list[str] = []
    again = nl.run_nightly(opts, say=lines.append)
    assert again.rows[0].rebuilt == [] and again.exit_code == nl.EXIT_REGRESSED
    assert any("failed gate verdict is read back" in ln for ln in lines)


@pytest.mark.slow
def test_refused_profile_does_not_stop_the_others(scratch):
    bad = scratch["root"] / "profiles" / "night-bad.yaml"
    bad.write_text("extends: fp8-h100\ntarget:\n  gpu: a100-80gb\n")  # FP8 needs SM >= 89
    a = scratch["root"] / "profiles" / "night-a.yaml"
    out = scratch["opts"].out_root
    env = dict(os.environ, COLUMNS="200")
    env.pop("GITHUB_STEP_SUMMARY", None)
    from tests.conftest import SMALL_GATE_INVOKE

    r = subprocess.run([sys.executable, "-c", SMALL_GATE_INVOKE, "nightly", "--profiles", f"{bad},{a}", "--out", str(out),
                        "--golden-limit", "1", "--checkpoint", f"night-a={scratch['ckpt']}"],
                       cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    data = json.loads((out / "nightly" / "summary.json").read_text())
    rows = {p["profile"]: p for p in data["profiles"]}
    assert rows["night-bad"]["verdict"] == "refused" and "quantization.quant_algo" in rows["night-bad"]["reason"]
    assert rows["night-a"]["verdict"] == "pass" and rows["night-a"]["rebuilt"] == []
    assert "| night-bad | - |" in r.stdout
