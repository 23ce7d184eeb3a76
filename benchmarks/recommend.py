"""Time ``invoke recommend``'s planner (``analysis.choose.recommend``, ~300 candidates) after import.

Cases: the config-only Llama-3.1-70B (tests/data/models/Llama-3.1-70B) on H100 and on H200, and the
default model on H100, no constraints, the default workload. Each case runs in a fresh Python process,
as the CLI does, so nothing memoised by an earlier case helps it; side by side per case: the first call
(cold: every ``exclude_modules`` match and shipped profile computed once) and a second call in the same
process (warm), wall and CPU seconds. With ``--baseline DIR`` (the ``build`` folder of another commit,
e.g. ``git archive 5ee926e build | tar -x -C /tmp/old``, run from a checkout whose precision_profiles/ and
models it shares) the same cases run under that source too, and the full recommendations (every
candidate's JSON) must be equal.

Accuracy comes from the priors only: ``artifacts`` is an empty temporary folder, so a local build cannot
change the choice. The chosen profile of each case must equal ``EXPECTED`` (the choice before the
matching was memoised, commit 5ee926e). Prints one line per case and ends with one line of ``key=value``
pairs, e.g. ``cases=3 candidates=304 h100_70b_s=... h200_70b_s=... h100_default_s=... max_s=...
budget_s=10 within_budget=1 same_choice=1``.

Usage: ``python benchmarks/recommend.py [--baseline DIR]`` (``invoke bench recommend``). Exit 1 when a case
takes over ``BUDGET_S`` (first call, wall) or chooses another profile, or the baseline's results differ.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "build") not in sys.path:
    sys.path.insert(0, str(ROOT / "build"))

BUDGET_S = 10.0
M70 = ROOT / "tests" / "data" / "models" / "Llama-3.1-70B"
CASES = (("h100_70b", "h100", "70B"), ("h200_70b", "h200", "70B"), ("h100_default", "h100", "default"))
EXPECTED = {"h100_70b": "fp8/kv-fp8/tp2/fb-none", "h200_70b": "fp8/kv-fp8/tp1/fb-none",
            "h100_default": "fp8/kv-fp8/tp1/fb-same-gpus"}
"""The choice of each case at commit 5ee926e (before the matching was memoised), priors only."""


def _child(src: str, gpu: str, model: str, artifacts: str, warm: bool) -> None:
    """One case in this process: import from ``src``, recommend (twice when ``warm``); one JSON line."""
    import hashlib

    sys.path.insert(0, src)
    t0 = time.perf_counter()
    from precision_pipeline.analysis import choose as ch
    import_s = time.perf_counter() - t0
    out = {"import_s": round(import_s, 3), "src": ch.__file__}
    for run in ("first", "warm") if warm else ("first",):
        t, c = time.perf_counter(), time.process_time()
        rec = ch.recommend(gpu, Path(model), Path(artifacts), ch.Constraints())
        out[f"{run}_s"] = round(time.perf_counter() - t, 3)
        out[f"{run}_cpu_s"] = round(time.process_time() - c, 3)
    out["best"] = rec.best.label if rec.best else None
    out["candidates"] = len(rec.candidates)
    out["sha256"] = hashlib.sha256(json.dumps(rec.to_json(), sort_keys=True, default=str).encode()).hexdigest()
    print(json.dumps(out))


def _run_case(src: Path, gpu: str, model: Path, artifacts: Path, warm: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, __file__, "--child", str(src), gpu, str(model), str(artifacts), str(int(warm))],
                       capture_output=True, text=True, env=env, cwd=str(ROOT))
    if r.returncode:
        raise SystemExit(f"case {gpu} {model} under {src} failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        _child(argv[1], argv[2], argv[3], argv[4], argv[5] == "1")
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default=None, help="a build/ folder of another commit, timed side by side")
    args = ap.parse_args(argv)
    from precision_pipeline.spec.default_model import default_model_dir

    models = {"70B": M70, "default": default_model_dir()}
    for name, d in models.items():
        if not (d / "config.json").is_file():
            print(f"no config.json in {d} ({name}); run the set-up first (./run.sh test)", file=sys.stderr)
            return 2
    base = Path(args.baseline).resolve() if args.baseline else None
    if base is not None and not (base / "precision_pipeline" / "analysis" / "choose.py").is_file():
        print(f"--baseline {base}: not a build/ folder with precision_pipeline/analysis/choose.py", file=sys.stderr)
        return 2
    kv: dict[str, object] = {"cases": len(CASES)}
    firsts, same_choice, same_result, n_cand = [], True, True, set()
    with tempfile.TemporaryDirectory(prefix="bench-recommend-") as tmp:
        artifacts = Path(tmp) / "artifacts"  # empty: priors only
        for key, gpu, model in CASES:
            now = _run_case(ROOT / "build", gpu, models[model], artifacts, warm=True)
            same = now["best"] == EXPECTED[key]
            same_choice &= same
            n_cand.add(now["candidates"])
            firsts.append(now["first_s"])
            line = (f"{key}: first {now['first_s']:.2f} s (cpu {now['first_cpu_s']:.2f}), warm {now['warm_s']:.2f} s "
                    f"(cpu {now['warm_cpu_s']:.2f}), import {now['import_s']:.2f} s; {now['candidates']} candidates, "
                    f"best {now['best']} ({'as before' if same else 'EXPECTED ' + EXPECTED[key]})")
            kv[f"{key}_s"] = now["first_s"]
            kv[f"{key}_cpu_s"] = now["first_cpu_s"]
            kv[f"{key}_warm_s"] = now["warm_s"]
            if base is not None:
                old = _run_case(base, gpu, models[model], artifacts, warm=False)
                eq = old["sha256"] == now["sha256"]
                same_result &= eq
                kv[f"baseline_{key}_s"] = old["first_s"]
                kv[f"baseline_{key}_cpu_s"] = old["first_cpu_s"]
                line += (f"; baseline {old['first_s']:.2f} s (cpu {old['first_cpu_s']:.2f}), best {old['best']}, "
                         f"{'same' if eq else 'DIFFERENT'} recommendation JSON")
            print(line, flush=True)
    mx = max(firsts)
    kv.update({"candidates": "/".join(str(n) for n in sorted(n_cand)), "max_s": mx, "budget_s": f"{BUDGET_S:g}",
               "within_budget": int(mx < BUDGET_S), "same_choice": int(same_choice)})
    if base is not None:
        kv["same_result"] = int(same_result)
    kv["load1"] = f"{os.getloadavg()[0]:.2f}"
    print(" ".join(f"{k}={v}" for k, v in kv.items()))
    return 0 if mx < BUDGET_S and same_choice and same_result else 1


if __name__ == "__main__":
    sys.exit(main())
