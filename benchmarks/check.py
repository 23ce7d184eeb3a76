"""Time the resolve stage: ``check_all`` over every shipped profile, after import.

The resolve stage must refuse bad profiles in well under a second, before any GPU time.
Prints one line per run and ends with one line of ``key=value`` pairs, e.g.
``profiles=6 ok=6 import_ms=... check_all_ms=... per_profile_ms=... budget_ms=1000 within_budget=1``.

Usage: ``python benchmarks/check.py [--model DIR] [--repeat N]`` (default: the default model).
Exit code 1 when the median check_all time is over the 1 s budget.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "build") not in sys.path:
    sys.path.insert(0, str(ROOT / "build"))

BUDGET_MS = 1000.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF model folder (default: the converted default model)")
    ap.add_argument("--repeat", type=int, default=5, help="timed runs (median reported)")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    from precision_pipeline.resolve import plan as plan_mod  # noqa: E402  (timed)
    from precision_pipeline.spec.default_model import default_model_dir
    import_ms = (time.perf_counter() - t0) * 1000

    model_dir = Path(args.model) if args.model else default_model_dir()
    if not (model_dir / "config.json").is_file():
        print(f"no config.json in {model_dir}; run the set-up first (./run.sh test) or pass --model", file=sys.stderr)
        return 2
    torch_loaded = "torch" in sys.modules

    times = []
    results = []
    for i in range(max(1, args.repeat)):
        t = time.perf_counter()
        results = plan_mod.check_all(model_dir)
        ms = (time.perf_counter() - t) * 1000
        times.append(ms)
        print(f"run {i + 1}: check_all {ms:.1f} ms over {len(results)} profiles")
    for name, ok, line in results:
        print(f"  {'ok     ' if ok else 'refused'} {name}: {line}")
    n = len(results)
    med = statistics.median(times)
    first = times[0]
    ok = sum(1 for _, good, _ in results if good)
    within = med < BUDGET_MS
    print(f"profiles={n} ok={ok} import_ms={import_ms:.1f} first_check_all_ms={first:.1f} check_all_ms={med:.1f} "
          f"per_profile_ms={med / max(1, n):.2f} budget_ms={BUDGET_MS:.0f} within_budget={int(within)} "
          f"torch_imported={int(torch_loaded)}")
    return 0 if within else 1


if __name__ == "__main__":
    sys.exit(main())
