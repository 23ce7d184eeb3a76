"""Time the main job cold and with a cached gate reference, stage by stage, in one run.

Two ``invoke build --profile PROFILE`` runs (the default model; what ``./run.sh build`` runs),
each in a fresh ``--out`` folder:

* ``cold``: a fresh cache root (``PRECISION_CACHE_DIR``): a copy of ``.cache`` without ``gate-ref``
  (its ``models/`` folder and other large folders linked, so the model is not re-converted): the
  gate computes the FP32 reference and the BF16 noise floor.
* ``warm``: the same cache root again, now holding that reference: the gate scores only the candidate.

Prints each build's own output (progress lines included), then one table of the stages' and the
gate's phases' seconds side by side (wall seconds from manifest.json and gate/metrics.json
``timings_s``; the gate's reference phases come from the cache entry's ``seconds``), and ends with
one line of ``key=value`` pairs::

    profile=fp8-h100 cold_s=... warm_s=... cold_gate_s=... warm_gate_s=... cold_budget_s=300 warm_gate_budget_s=120
    within_budget=1 kl_mean=... top1=... ppl_delta_pct=... threads=2 cores=2 load1_before=... load1_after=...

(shown on two lines here, printed as one). ``threads`` is the gate's torch thread count (metrics.json ``torch_threads``) of the
warm run; the load average is that of the whole machine before and after (a number above ~1.5
on 2 cores means the times are not those of an idle machine). Exit code 1 when a budget is missed.

Usage: ``invoke bench build [--args "--profile fp8-h100 --keep DIR --golden-limit N"]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "build") not in sys.path:
    sys.path.insert(0, str(ROOT / "build"))

COLD_BUDGET_S = 300.0
WARM_GATE_BUDGET_S = 120.0
SKIPPED = ("gate-ref",)


def fresh_cache(src: Path, dst: Path) -> Path:
    """``dst``: a copy of cache root ``src`` without the gate reference cache; large folders linked."""
    dst.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir() if src.is_dir() else ():
        if p.name in SKIPPED or p.name.startswith(".") and p.name.endswith(".lock"):
            continue
        if p.is_dir():  # models/, test-checkpoints/, the prepared server: linked, never written by a build
            (dst / p.name).symlink_to(p.resolve(), target_is_directory=True)
        else:
            shutil.copy2(p, dst / p.name)
    return dst


def load1() -> float:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return float("nan")


def run_build(profile: str, out: Path, cache: Path, golden_limit: int | None) -> tuple[float, int]:
    """One ``invoke build`` in a subprocess, its output streamed; returns (wall seconds, exit code)."""
    cmd = [sys.executable, "-m", "invoke", "-r", str(ROOT), "build", "--profile", profile, "--out", str(out)]
    if golden_limit:
        cmd += ["--golden-limit", str(golden_limit)]
    env = {**os.environ, "PRECISION_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT / "build"),
           "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(f"  {line}")
        sys.stdout.flush()
    rc = proc.wait()
    return time.perf_counter() - t0, rc


def stage_seconds(out: Path) -> dict[str, float]:
    """Stage name -> wall seconds from ``<out>/manifest.json``."""
    m = json.loads((out / "manifest.json").read_text())
    rows = m.get("stages", {})
    if isinstance(rows, list):
        rows = {r.get("name"): r for r in rows}
    return {k: float(v.get("seconds") or 0.0) for k, v in rows.items()}


def gate_phases(out: Path, cache: Path) -> tuple[dict[str, float], dict]:
    """The gate's phase seconds (metrics.json ``timings_s``, plus the reference's own phases when it
    was computed in this run) and metrics.json itself."""
    metrics = json.loads((out / "gate" / "metrics.json").read_text())
    ph = {k: float(v) for k, v in (metrics.get("timings_s") or {}).items()}
    ph["checkpoint_load"] = float(metrics.get("checkpoint_load_s") or 0.0)
    rc = metrics.get("reference_cache") or {}
    if not rc.get("hit"):
        for k, v in (rc.get("seconds_when_computed") or {}).items():
            ph[f"reference.{k}"] = float(v)
    return ph, metrics


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="fp8-h100")
    ap.add_argument("--golden-limit", type=int, default=None, help="prompts per category (default: all; the budget "
                    "applies to the full set)")
    ap.add_argument("--keep", default=None, help="folder to keep the outputs and cache root in (default: a temp dir)")
    args = ap.parse_args(argv)

    from precision_pipeline.core.paths import cache_dir

    src = cache_dir()
    if not (src / "models").is_dir():
        print(f"no models/ under {src}; run the set-up first (./run.sh test)", file=sys.stderr)
        return 2
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-build-"))
    base.mkdir(parents=True, exist_ok=True)
    cache = fresh_cache(src, base / "cache")
    la0 = load1()
    results: dict[str, dict] = {}
    for run in ("cold", "warm"):
        out = base / f"out-{run}"
        print(f"== {run} build: invoke build --profile {args.profile} --out {out} (PRECISION_CACHE_DIR={cache})",
              flush=True)
        wall, rc = run_build(args.profile, out, cache, args.golden_limit)
        if not (out / "manifest.json").is_file():
            print(f"{run} build wrote no manifest (exit {rc})", file=sys.stderr)
            return 2
        phases, metrics = gate_phases(out, cache) if (out / "gate" / "metrics.json").is_file() else ({}, {})
        results[run] = {"wall": wall, "rc": rc, "stages": stage_seconds(out), "phases": phases, "metrics": metrics}
    la1 = load1()

    cold, warm = results["cold"], results["warm"]
    print(f"\n{'':32s} {'cold s':>9s} {'warm s':>9s}")
    for name in list(dict.fromkeys([*cold["stages"], *warm["stages"]])):
        print(f"stage {name:26s} {cold['stages'].get(name, 0):9.1f} {warm['stages'].get(name, 0):9.1f}")
    for name in list(dict.fromkeys([*cold["phases"], *warm["phases"]])):
        c, w = cold["phases"].get(name), warm["phases"].get(name)
        print(f"  gate {name:25s} {'' if c is None else f'{c:9.1f}':>9s} {'' if w is None else f'{w:9.1f}':>9s}")
    print(f"{'build (wall, incl. start-up)':32s} {cold['wall']:9.1f} {warm['wall']:9.1f}")

    m = (warm["metrics"] or {}).get("metrics", {})
    cold_gate = cold["stages"].get("gate", float("nan"))
    warm_gate = warm["stages"].get("gate", float("nan"))
    ok = cold["wall"] <= COLD_BUDGET_S and warm_gate <= WARM_GATE_BUDGET_S and cold["rc"] == 0 == warm["rc"]

    def val(k: str) -> str:
        v = (m.get(k) or {}).get("value")
        return "nan" if v is None else f"{v:.4g}"

    print(f"profile={args.profile} golden_limit={args.golden_limit or 'all'} cold_s={cold['wall']:.1f} "
          f"warm_s={warm['wall']:.1f} cold_gate_s={cold_gate:.1f} warm_gate_s={warm_gate:.1f} "
          f"cold_quantize_s={cold['stages'].get('quantize', float('nan')):.1f} cold_budget_s={COLD_BUDGET_S:.0f} "
          f"warm_gate_budget_s={WARM_GATE_BUDGET_S:.0f} within_budget={int(ok)} kl_mean={val('kl_mean')} "
          f"top1={val('top1')} ppl_delta_pct={val('ppl_delta_pct')} "
          f"threads={(warm['metrics'] or {}).get('torch_threads', 'nan')} "
          f"cold_threads={(cold['metrics'] or {}).get('torch_threads', 'nan')} cores={os.cpu_count()} "
          f"load1_before={la0:.2f} load1_after={la1:.2f}")
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
