"""Rollback benchmark: promotes and rollbacks on a real tritonserver under client load.

What it measures: the SWITCHING MACHINERY (build/precision_pipeline/serving/release.py: unit install, load, direct smoke test,
ensemble/BLS re-pointing, releases.json commit) with the CPU REFERENCE stand-in backend
(triton_repo/backends/tensorrtllm). It does not measure TensorRT-LLM's engine load time, GPU memory
or throughput: a promote's load here is a torch + transformers model load on CPU.

Set-up: three engine units of the default model (different plans, hence different engine hashes):
A and B (releases) and F (fallback, kept loaded: warm_fallback). Then, ``--cycles`` times:
promote the other release unit (cold: load + smoke test + switch), then roll back to the warm
fallback. N client threads send chat requests in bounded loops for the whole run (even threads
through the ensemble, odd ones through the BLS). A request fails when it errors, when its text
differs from the expected greedy text (truncated or changed), or when it would need a retry (no
retries are made).

Last line: ``promote_ms_median=… rollback_ms_median=… rollback_ms_max=… requests=… failed=…``
(rollback_ms: from the rollback call until ensemble and BLS route to the fallback).
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

from precision_pipeline.serving import release, release_recover, release_state, release_units  # noqa: E402
from _load import ClientLoad, ask  # noqa: E402  (benchmarks/ is this script's folder, first on sys.path)
from precision_pipeline.spec.default_model import ensure_default_model  # noqa: E402
from precision_pipeline.serving.triton_server import TritonServer, free_port, models_to_load  # noqa: E402

PROMPT = "What is the capital of France?"


def make_units(base: Path, model_dir: Path) -> list[Path]:
    """Three packed bf16-h100 repositories of the default model (max_batch_size 64 / 48 / 32: three
    engine hashes), made as ``invoke bench rollout`` makes its units (one home: ``rollout.make_unit``)."""
    from rollout import make_unit  # benchmarks/ is this script's folder, first on sys.path

    return [make_unit(base, f"build{i}", model_dir, mb) for i, mb in enumerate((64, 48, 32))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cycles", type=int, default=10, help="promotes (and as many rollbacks)")
    ap.add_argument("--max-tokens", type=int, default=6)
    ap.add_argument("--max-requests-per-thread", type=int, default=100000)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = ap.parse_args(argv)

    print("rollback benchmark: measures the switching machinery (build/precision_pipeline/serving/release.py) on a real tritonserver 2.51 "
          "with the CPU reference stand-in backend, NOT TensorRT-LLM's engine load.", flush=True)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-rollback-"))
    model_dir = ensure_default_model()
    a, b, f = make_units(work, model_dir)
    repo = work / "serving" / "model_repository"
    release_recover.init_serving_repo(repo, a, profile="bf16-h100", fallback_repo=f, warm_fallback=True, keep_releases=2)
    srv = TritonServer(repo, models_to_load(repo), log_file=work / "server.log",
                       http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    srv.start()
    print(f"server ready in {srv.start_s:.1f} s (2 engine units loaded); log {srv.log_file}", flush=True)


    c0 = srv.http_client()
    t = time.perf_counter()
    expected = ask(c0, "ensemble", PROMPT, args.max_tokens)
    first_ms = (time.perf_counter() - t) * 1e3
    c0.close()
    print(f"expected text ({args.max_tokens} tokens max, {first_ms:.0f} ms): {expected!r}", flush=True)

    def send(cl, i: int):
        model = "ensemble" if i % 2 == 0 else "tensorrt_llm_bls"
        try:
            text = ask(cl, model, PROMPT, args.max_tokens)
        except Exception as e:
            return f"{model}: {type(e).__name__}: {str(e)[:200]}"
        return None if text == expected else f"{model}: text {text!r} != expected"

    load = ClientLoad(srv.http_url, args.threads, args.max_requests_per_thread, send).start()
    stats = load.stats
    promotes, rollbacks, warm = [], [], []
    units = [a, b]
    try:
        for k in range(args.cycles):
            cur = release_state.read_state(repo)["current"]
            nxt = next(u for u in units if release_units.resolve_unit_source(u).name != cur)
            tp = release.promote(repo, nxt, server=srv, promoted_by="bench", expect=None)
            promotes.append(tp["switched_ms"])
            tr = release.rollback(repo, fallback=True, server=srv, by="bench")
            rollbacks.append(tr["switched_ms"])
            warm.append(tr["warm"])
            print(f"cycle {k + 1}/{args.cycles}: promote {tp['switched_ms']:.0f} ms (load {tp.get('load_ms', 0):.0f}, "
                  f"smoke {tp.get('smoke', {}).get('ms', 0):.0f}, ensemble {tp.get('ensemble_load_ms', 0):.1f}); "
                  f"rollback {tr['switched_ms']:.1f} ms (warm={tr['warm']}, ensemble {tr.get('ensemble_load_ms', 0):.1f}, "
                  f"total with commit+retention {tr['total_ms']:.0f}); requests so far {stats['requests']}", flush=True)
    finally:
        load.stop()
        srv.stop()
    lat = sorted(stats["lat_ms"]) or [0.0]
    for e in stats["errors"]:
        print(f"failure: {e}")
    res = {"promote_ms_median": statistics.median(promotes) if promotes else None,
           "rollback_ms_median": statistics.median(rollbacks) if rollbacks else None,
           "rollback_ms_max": max(rollbacks) if rollbacks else None, "rollbacks_warm": all(warm),
           "requests": stats["requests"], "failed": stats["failed"], "server_start_s": srv.start_s,
           "request_ms_median": statistics.median(lat), "request_ms_p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
           "threads": args.threads, "cycles": args.cycles}
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    print(f"server_start_s={srv.start_s:.1f} request_ms_median={res['request_ms_median']:.0f} "
          f"request_ms_p99={res['request_ms_p99']:.0f} rollbacks_warm={res['rollbacks_warm']}")
    print(f"promote_ms_median={res['promote_ms_median']:.0f} rollback_ms_median={res['rollback_ms_median']:.1f} "
          f"rollback_ms_max={res['rollback_ms_max']:.1f} requests={res['requests']} failed={res['failed']}")
    return 0 if stats["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
