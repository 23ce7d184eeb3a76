"""Time the nightly cold and as a no-op over the shipped profiles, in one run.

Two ``invoke nightly`` runs into one fresh ``--out`` root (the default model, the gate reference
cache as it is):

* ``cold``: every profile from scratch: quantize (each profile's own calibration), gate, pack,
  deploy (the engine is skipped without TensorRT-LLM and a GPU; a failed gate ends that profile's
  build, as in ``invoke build``);
* ``noop``: the same again: every stage's content key is unchanged, so nothing is rebuilt (failed
  gates are read back from their records).

Ends with one line of ``key=value`` pairs::

    profiles=7 golden_limit=1 cold_s=... noop_s=... ratio_pct=... goal_pct=2 within_goal=1 rebuilt_noop=0
    cold_exit=... noop_exit=... load1_before=... load1_after=...

(shown on two lines here, printed as one). ``ratio_pct`` = no-op / cold wall time x 100 (goal < 2 %);
``rebuilt_noop`` counts the stages the no-op run rebuilt (0 expected). Exit code 1 when the goal is
missed or the no-op run rebuilt anything.

Usage: ``invoke bench nightly [--args "--profiles all --golden-limit 1 --keep DIR"]``.
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
GOAL_PCT = 2.0


def load1() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def run_nightly(out: Path, profiles: str, golden_limit: int | None) -> tuple[float, int, dict]:
    cmd = [sys.executable, "-m", "invoke", "nightly", "--out", str(out), "--profiles", profiles]
    if golden_limit:
        cmd += ["--golden-limit", str(golden_limit)]
    env = dict(os.environ, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
    env.pop("GITHUB_STEP_SUMMARY", None)
    t0 = time.perf_counter()
    rc = subprocess.run(cmd, cwd=ROOT, env=env).returncode
    wall = time.perf_counter() - t0
    summary = json.loads((out / "nightly" / "summary.json").read_text()) if (out / "nightly" / "summary.json").is_file() else {}
    return wall, rc, summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profiles", default="all")
    ap.add_argument("--golden-limit", type=int, default=1, help="prompts per golden category (default 1; 0 = all)")
    ap.add_argument("--keep", default=None, help="output root to keep (default: a temp dir)")
    args = ap.parse_args()
    out = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-nightly-"))
    lb = load1()
    print(f"== cold nightly: invoke nightly --out {out} --profiles {args.profiles}", flush=True)
    cold_s, cold_rc, cold = run_nightly(out, args.profiles, args.golden_limit or None)
    print("== no-op nightly (the same again)", flush=True)
    noop_s, noop_rc, noop = run_nightly(out, args.profiles, args.golden_limit or None)
    rebuilt = sum(len(r.get("rebuilt", [])) for r in noop.get("profiles", []))
    print(f"\n{'profile':24s} {'cold verdict':14s} {'cold rebuilt':40s} no-op rebuilt")
    noop_rows = {r["profile"]: r for r in noop.get("profiles", [])}
    for r in cold.get("profiles", []):
        n = noop_rows.get(r["profile"], {})
        print(f"{r['profile']:24s} {r['verdict']:14s} {','.join(r['rebuilt']) or '-':40s} {','.join(n.get('rebuilt', [])) or '-'}")
    ratio = 100.0 * noop_s / cold_s if cold_s > 0 else float("nan")
    ok = ratio < GOAL_PCT and rebuilt == 0
    print(f"profiles={len(cold.get('profiles', []))} golden_limit={args.golden_limit or 'all'} cold_s={cold_s:.1f} "
          f"noop_s={noop_s:.1f} ratio_pct={ratio:.2f} goal_pct={GOAL_PCT:g} within_goal={int(ok)} rebuilt_noop={rebuilt} "
          f"cold_exit={cold_rc} noop_exit={noop_rc} load1_before={lb:.2f} load1_after={load1():.2f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
