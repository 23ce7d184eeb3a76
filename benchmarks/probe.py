"""Probe benchmark: what one accuracy-probe run (``invoke probe``) costs on a real tritonserver.

What it measures: the PROBE MACHINERY (build/precision_pipeline/serving/probe.py: one request per
golden prompt to the engine unit with ``return_context_logits``, scoring against the gate's stored
FP32 reference, the releases.json record, the exporter update) with the CPU REFERENCE stand-in
backend (triton_repo/backends/tensorrtllm). Not TensorRT-LLM's speed: a request here is a torch
forward on CPU, so seconds per run are an upper bound of the probe's own overhead on a GPU server.

Set-up (as ``invoke bench rollout`` makes them, one home: benchmarks/rollout.py): the default model's
FP32 unit of the bf16-h100 plan as the current release and a small gate run of the model itself (its
FP32 reference in the gate's cache). Then ``--runs`` probe runs of ``--prompts`` golden prompts each,
every one recorded in releases.json and set on a ProbeExporter.

Last line: ``requests_per_run=… seconds_per_run=… seconds_per_run_max=… runs=… prompts=… failed=…``
(requests_per_run: inference requests one run sends, one per prompt; failed: runs that did not pass).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "build"))

from precision_pipeline.serving import probe, release_recover, release_state  # noqa: E402
from precision_pipeline.serving.rollout import COUNTERS, metrics_url, scrape  # noqa: E402
from precision_pipeline.serving.triton_server import TritonServer, models_to_load  # noqa: E402
from precision_pipeline.spec.default_model import ensure_default_model  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=probe.DEFAULT_PROMPTS)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = ap.parse_args(argv)
    from rollout import make_gate, make_unit  # benchmarks/ is this script's folder, first on sys.path

    print("probe benchmark: measures serving/probe.py on a real tritonserver 2.51 with the CPU reference "
          "stand-in backend, NOT TensorRT-LLM's speed.", flush=True)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-probe-"))
    model_dir = ensure_default_model()
    t = time.perf_counter()
    gate_dir, thr = make_gate(work, model_dir)
    pset = probe.load_probe_set(gate_dir, args.prompts, thresholds=thr)
    print(f"probe set: {len(pset.prompts)} prompts, {pset.gate_numbers()['tokens']} answer tokens "
          f"({time.perf_counter() - t:.0f} s)", flush=True)
    repo = work / "serving" / "model_repository"
    release_recover.init_serving_repo(repo, make_unit(work, "stable", model_dir, 32), profile="bf16-h100")
    unit = release_state.read_state(repo)["current"]
    srv = TritonServer(repo, models_to_load(repo), log_file=work / "server.log")
    srv.start()
    print(f"server ready in {srv.start_s:.1f} s; log {srv.log_file}", flush=True)
    ex = probe.ProbeExporter(None)
    secs, reqs, failed = [], [], 0
    try:
        for k in range(args.runs):
            a = scrape(metrics_url(srv))
            t = time.perf_counter()
            rec = probe.probe_and_record(srv, unit, pset, repo_dir=repo, profile="bf16-h100", exporter=ex, by="bench")
            secs.append(time.perf_counter() - t)
            b = scrape(metrics_url(srv))
            reqs.append(int(sum(b.get((c, unit), 0.0) - a.get((c, unit), 0.0) for c in COUNTERS[:2])))
            s = rec["probe"]
            failed += not s.get("passed", False)
            print(f"run {k + 1}/{args.runs}: {reqs[-1]} requests, {secs[-1]:.2f} s, KL P99 {s.get('kl_p99', float('nan')):.5f} "
                  f"top-1 {s.get('top1', float('nan')):.3f} -> {'pass' if s.get('passed') else 'FAIL ' + s.get('error', '')}",
                  flush=True)
    finally:
        srv.stop()
    res = {"requests_per_run": statistics.median(reqs), "seconds_per_run": statistics.median(secs),
           "seconds_per_run_max": max(secs), "runs": args.runs, "prompts": len(pset.prompts), "failed": failed}
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items()))
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
