"""Benchmark: our quantize stage vs calling ModelOpt directly on the same model and data.

Both sides load the default model in FP32, run ``mtq.quantize`` with the same config (from
``precision_pipeline.quantize.ptq.modelopt_config_for``) over the same calibration samples, and export with
``export_tensorrt_llm_checkpoint``. Ours adds the calibration-set bookkeeping, exclusions,
the progress bar, the config fix-ups and the atomic write. Target: overhead <= 10 %.

    invoke bench quantize [--args "--profile fp8-h100 --samples 32 --seq-len 256 --repeat 2"]

Last line: ``profile=... samples=... ours_s=... direct_s=... overhead_pct=...``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "build"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default="fp8-h100")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    from precision_pipeline.quantize.calibration import build_calibration_set, load_tokenizer
    from precision_pipeline.spec.default_model import ensure_default_model
    from precision_pipeline.spec.profile import load_profile
    from precision_pipeline.quantize.ptq import modelopt_config_for, run_quantize

    model_dir = ensure_default_model()
    prof = load_profile(a.profile)
    prof.calibration.num_samples = a.samples
    prof.calibration.seq_len = a.seq_len
    calib = build_calibration_set(prof.calibration, load_tokenizer(model_dir))
    _, cfg = modelopt_config_for(prof, model_dir)
    bs = prof.calibration.batch_size

    def direct(out: Path) -> float:
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        batches = calib.batches(bs)

        def loop(m):
            with torch.no_grad():
                for b in batches:
                    m(torch.tensor(b, dtype=torch.long))

        mtq.quantize(model, cfg, forward_loop=loop)
        with torch.no_grad():
            export_tensorrt_llm_checkpoint(model, "llama", torch.bfloat16, out,
                                           inference_tensor_parallel=prof.parallel.tp_size)
        return time.perf_counter() - t0

    def ours(out: Path) -> float:
        t0 = time.perf_counter()
        run_quantize(prof, model_dir, out, show_progress=False, calib_set=calib)
        return time.perf_counter() - t0

    ours_t, direct_t = [], []
    with tempfile.TemporaryDirectory() as d:
        # warm-up (imports, ModelOpt plugin registration, file cache) not timed, then interleaved
        # rounds in alternating order, so drift and first-run costs hit both sides alike
        direct(Path(d) / "warmup")
        for i in range(a.repeat):
            if i % 2 == 0:
                direct_t.append(direct(Path(d) / f"direct{i}"))
                ours_t.append(ours(Path(d) / f"ours{i}"))
            else:
                ours_t.append(ours(Path(d) / f"ours{i}"))
                direct_t.append(direct(Path(d) / f"direct{i}"))
            print(f"round {i}: ours {ours_t[-1]:.1f} s, direct {direct_t[-1]:.1f} s", flush=True)
    o, dd = min(ours_t), min(direct_t)
    print(f"profile={a.profile} samples={a.samples} seq_len={a.seq_len} ours_s={o:.2f} direct_s={dd:.2f} "
          f"overhead_pct={100 * (o / dd - 1):.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
