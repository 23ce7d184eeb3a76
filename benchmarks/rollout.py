"""Rollout benchmark: gradual rollouts with the live accuracy probe on a real tritonserver under load.

What it measures: the ROLLOUT MACHINERY (build/precision_pipeline/serving/rollout.py and probe.py:
canary routing in the BLS, the per-step checks from the server's metrics endpoint, the probe through
the server, the automatic rollback) with the CPU REFERENCE stand-in backend (triton_repo/backends/
tensorrtllm). Not TensorRT-LLM's speed: a request here is a torch forward on CPU.

Set-up: the default model. Stable release and healthy candidate: FP32 units of two plans (different
engine hashes, the same weights). Bad candidate: the same model with decoder layers 3 and 20 swapped
(an HF folder the stand-in serves; it loads and answers, but wrongly). Probe set: a small gate run of
the model (one golden prompt per category; the FP32 reference stored in the gate's cache).

Run: N client threads send short chat requests (``--max-tokens``) through the BLS (the canary path)
in bounded loops for the whole run; then (1) the bad candidate is rolled out (steps ``--steps``):
it must be rolled back at the first step; (2) the healthy one: it must reach 100 %. A request fails
when it errors or returns an empty text (no retries).

Last line: ``rollout_s=… decision_to_stable_ms=… requests=… failed=… canary_share_measured=…``
(rollout_s: the healthy rollout, begin to commit; decision_to_stable_ms: the bad rollout's decision to
the candidate's last request; canary_share_measured: per step of the healthy rollout, the candidate's
share of the BLS-routed requests from the server's metrics).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "build"))

from _load import ClientLoad, ask  # noqa: E402  (benchmarks/ is this script's folder, first on sys.path)
from precision_pipeline.serving import pack, probe, release_recover, rollout  # noqa: E402
from precision_pipeline.serving.triton_server import TritonServer, free_port, models_to_load  # noqa: E402
from precision_pipeline.spec.default_model import ensure_default_model  # noqa: E402
from precision_pipeline.spec.profile import load_profile  # noqa: E402

PROMPT = "What is 2 + 2?"


def swapped_model(src: Path, dst: Path, a: int = 3, b: int = 20) -> Path:
    """A copy of HF folder ``src`` whose decoder layers ``a`` and ``b`` trade weights."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.is_file() and p.suffix != ".safetensors" and not p.name.endswith(".index.json"):
            shutil.copy2(p, dst / p.name)
    t = load_file(str(src / "model.safetensors"))
    pa, pb = f"model.layers.{a}.", f"model.layers.{b}."
    out = {(pb + k[len(pa):] if k.startswith(pa) else pa + k[len(pb):] if k.startswith(pb) else k): v for k, v in t.items()}
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def make_unit(base: Path, name: str, model_dir: Path, mb: int) -> Path:
    """A packed repository of the bf16-h100 plan of the default model with ``max_batch_size`` ``mb``
    (a different engine hash per value), serving the weights of HF folder ``model_dir``."""
    from precision_pipeline.resolve import plan as P

    prof = load_profile("bf16-h100")
    b = prof.build
    plan = P.evaluate(prof, ensure_default_model())
    plan = plan.model_copy(update={"limits": plan.limits.model_copy(update={
        "max_batch_size": mb, "max_input_len": b.max_input_len or 1024, "max_seq_len": b.max_seq_len or 8192,
        "max_num_tokens": b.max_num_tokens or 8192, "max_beam_width": 1})})
    d = base / name
    pack.pack_repository(plan, prof, model_dir, d / "no-checkpoint", d / "engine", False, d / "model_repository", str(d))
    return d / "model_repository"


def make_gate(base: Path, model_dir: Path):
    """A small gate run of the model itself (its metrics.json, per_token.npz, cached FP32 reference)."""
    from precision_pipeline.gate import checkpoint_gate as cg
    from precision_pipeline.gate.candidates import TORCH_DTYPES, load_hf_model
    from precision_pipeline.gate.options import GateOptions, GateRuntime

    thr = load_profile("bf16-h100").gate.for_model(model_dir.name).model_copy(
        update={"ppl_delta_pct_max": None, "greedy_same_min": None})
    opts = GateOptions(prompts_per_category=1, heldout_tokens=0, greedy_new_tokens=0, noise_floor=False,
                       bootstrap_resamples=50)
    cg.run_gate(load_hf_model(model_dir, TORCH_DTYPES["float32"]), model_dir, thr, base / "gate", opts,
                GateRuntime(progress=False, write_report=False), candidate_name="FP32 model")
    return base / "gate", thr


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--steps", default="5,20,50,100")
    ap.add_argument("--hold", type=float, default=60.0, help="seconds per step")
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--probe-prompts", type=int, default=3)
    ap.add_argument("--min-requests", type=int, default=1000, help="keep the clients going until this many")
    ap.add_argument("--max-requests-per-thread", type=int, default=100000)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = ap.parse_args(argv)
    steps = rollout.parse_steps(args.steps)

    print("rollout benchmark: the rollout machinery (serving/rollout.py, probe.py) on a real tritonserver 2.51 with the "
          "CPU reference stand-in backend, NOT TensorRT-LLM.", flush=True)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-rollout-"))
    model_dir = ensure_default_model()
    stable = make_unit(work, "stable", model_dir, 64)
    healthy = make_unit(work, "healthy", model_dir, 48)
    bad = make_unit(work, "bad", swapped_model(model_dir, work / "swapped-model"), 32)
    t = time.perf_counter()
    gate_dir, thr = make_gate(work, model_dir)
    pset = probe.load_probe_set(gate_dir, args.probe_prompts, thresholds=thr)
    print(f"probe set: {len(pset.prompts)} prompts, {pset.gate_numbers()['tokens']} answer tokens ({time.perf_counter() - t:.0f} s)")
    repo = work / "serving" / "model_repository"
    release_recover.init_serving_repo(repo, stable, profile="bf16-h100")
    srv = TritonServer(repo, models_to_load(repo), log_file=work / "server.log",
                       http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    srv.start()
    print(f"server ready in {srv.start_s:.1f} s; log {srv.log_file}", flush=True)


    def send(cl, i: int):
        return None if ask(cl, "tensorrt_llm_bls", PROMPT, args.max_tokens) else "empty text"

    def show(s):
        pr = s.get("probe") or {}
        if s["percent"] == 100:
            print(f"  100 %: switched in {s.get('switched_ms')} ms", flush=True)
        else:
            print(f"  {s['percent']:>3} %: candidate {s['candidate']['success']} / stable {s['stable']['success']} requests, "
                  f"share {s.get('share_measured') or 0:.2f} %, probe KL P99 {pr.get('kl_p99', float('nan')):.4g} "
                  f"top-1 {pr.get('top1', float('nan')):.3f} -> {'pass' if s.get('passed') else 'FAIL'}", flush=True)

    load = ClientLoad(srv.http_url, args.threads, args.max_requests_per_thread, send).start()
    stats = load.stats
    ok = True
    try:
        time.sleep(1.0)
        print(f"bad candidate (layers 3 and 20 swapped), steps {args.steps}:", flush=True)
        rb = rollout.rollout(repo, bad, srv, pset, steps=steps, hold_s=args.hold, profile="bad", on_step=show)
        print(f"  -> {rb.status} at {rb.failed_step} % ({rb.failed_check}); decision to last candidate request "
              f"{rb.decision_to_stable_ms} ms", flush=True)
        ok &= rb.status == "rolled_back" and rb.failed_step == steps[0]
        print(f"healthy candidate, steps {args.steps}:", flush=True)
        rh = rollout.rollout(repo, healthy, srv, pset, steps=steps, hold_s=args.hold, profile="healthy", on_step=show)
        print(f"  -> {rh.status} in {rh.seconds:.1f} s", flush=True)
        ok &= rh.status == "promoted"
        while stats["requests"] < args.min_requests and load.alive():
            time.sleep(0.5)
    finally:
        load.stop()
        srv.stop()
    for e in stats["errors"]:
        print(f"failure: {e}")
    shares = [s.get("share_measured") for s in rh.steps if s["percent"] < 100]
    dev = max(abs((sh or 0) - s["percent"]) for sh, s in zip(shares, rh.steps))
    lat = sorted(stats["lat_ms"]) or [0.0]
    res = {"rollout_s": rh.seconds, "decision_to_stable_ms": rb.decision_to_stable_ms, "requests": stats["requests"],
           "failed": stats["failed"], "canary_share_measured": shares, "share_max_dev_points": dev,
           "bad": {"status": rb.status, "failed_step": rb.failed_step, "failed_check": rb.failed_check,
                   "probe": (rb.numbers.get("probe") or {}).get("kl_p99")},
           "healthy": rh.status, "request_ms_median": lat[len(lat) // 2],
           "request_ms_p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))], "threads": args.threads, "hold_s": args.hold}
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    print(f"request_ms_median={res['request_ms_median']:.0f} request_ms_p99={res['request_ms_p99']:.0f} "
          f"share_max_dev_points={dev:.2f} bad={rb.status}@{rb.failed_step}:{rb.failed_check} healthy={rh.status}")
    print(f"rollout_s={rh.seconds:.1f} decision_to_stable_ms={rb.decision_to_stable_ms} requests={stats['requests']} "
          f"failed={stats['failed']} canary_share_measured={'/'.join(f'{s or 0:.1f}' for s in shares)}")
    return 0 if ok and stats["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
