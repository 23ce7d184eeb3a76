"""A real tritonserver (2.51) serving a packed repository with the CPU reference tensorrtllm stand-in.

One server for the module. A chat request through the ensemble (HTTP and gRPC) and through the BLS
returns exactly the text of transformers' greedy ``generate`` on the same weights, prompt template,
max_new_tokens and stop id. The chat template is applied by the preprocessing model (server side).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import time
from pathlib import Path

import numpy as np
import pytest

from precision_pipeline.serving import pack
from precision_pipeline.spec.profile import load_profile
from precision_pipeline.serving.triton_server import TritonServer, text_request

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France?", "Write one sentence about the sea."]
MAX_NEW = 16


@pytest.fixture(scope="module")
def packed(tmp_path_factory, default_model_dir):
    from tests.serving.test_pack import make_plan

    out = tmp_path_factory.mktemp("serve") / "out"
    prof = load_profile("bf16-h100")
    # No checkpoint stored with the unit: the stand-in loads the HF folder in FP32, as the reference does.
    res = pack.pack_repository(make_plan(prof), prof, Path(default_model_dir), out / "no-checkpoint", out / "engine", False,
                               out / "model_repository", str(out))
    return res


@pytest.fixture(scope="module")
def server(packed):
    models = ["preprocessing", "postprocessing", packed.engine_unit, "ensemble", "tensorrt_llm_bls"]
    srv = TritonServer(packed.out_dir, models, log_file=packed.out_dir.parent / "server.log")
    srv.start()
    print(f"\n[serve] tritonserver ready in {srv.start_s:.1f} s")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(default_model_dir):
    """{prompt: (generated ids, text)} from transformers greedy generate, FP32, same stop id."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32).eval()
    gen = json.loads((Path(default_model_dir) / "generation_config.json").read_text())
    out = {}
    for p in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt")
        with torch.inference_mode():
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                               eos_token_id=gen["eos_token_id"], pad_token_id=gen["pad_token_id"])
        new = [int(t) for t in g[0, ids.shape[1]:]]
        if new and new[-1] == gen["eos_token_id"]:
            new = new[:-1]
        out[p] = (ids[0].tolist(), new, tok.decode(new, skip_special_tokens=True))
    return out


def _http_ask(srv, model, text, max_tokens=MAX_NEW, **extra):
    c = srv.http_client()
    try:
        r = c.infer(model, text_request(text, max_tokens, **extra))
        return r.as_numpy("text_output").reshape(-1)[0].decode()
    finally:
        c.close()


def test_ensemble_http_equals_transformers(server, reference):
    for p in PROMPTS:
        t0 = time.perf_counter()
        got = _http_ask(server, "ensemble", p)
        print(f"[serve] ensemble HTTP {time.perf_counter() - t0:.2f} s: {got!r}")
        assert got == reference[p][2]


def test_ensemble_grpc_equals_transformers(server, reference):
    import tritonclient.grpc as gc

    c = server.grpc_client()
    try:
        p = PROMPTS[0]
        r = c.infer("ensemble", text_request(p, MAX_NEW, client_module=gc))
        assert r.as_numpy("text_output").reshape(-1)[0].decode() == reference[p][2]
        lp = r.as_numpy("output_log_probs")
        assert lp.dtype == np.float32 and lp.shape[-1] >= len(reference[p][1])
    finally:
        c.close()


def test_bls_equals_transformers(server, reference):
    p = PROMPTS[1]
    assert _http_ask(server, "tensorrt_llm_bls", p) == reference[p][2]


def test_engine_unit_tensors_batched(server, packed, reference):
    """The unit itself: tensorrtllm_backend names/dtypes, two prompts of different length in one request."""
    import tritonclient.http as hc

    rows = [reference[p][0] for p in PROMPTS]
    width = max(len(r) for r in rows)
    ids = np.full((2, width), 2, np.int32)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
    ins = []
    for name, arr in (("input_ids", ids), ("input_lengths", np.array([[len(r)] for r in rows], np.int32)),
                      ("request_output_len", np.full((2, 1), MAX_NEW, np.int32)), ("end_id", np.full((2, 1), 2, np.int32)),
                      ("pad_id", np.full((2, 1), 2, np.int32))):
        t = hc.InferInput(name, list(arr.shape), "INT32")
        t.set_data_from_numpy(arr)
        ins.append(t)
    flag = hc.InferInput("exclude_input_in_output", [2, 1], "BOOL")
    flag.set_data_from_numpy(np.array([[False], [True]]))
    ins.append(flag)
    c = server.http_client()
    try:
        r = c.infer(packed.engine_unit, ins)
    finally:
        c.close()
    out, lens = r.as_numpy("output_ids"), r.as_numpy("sequence_length")
    assert out.dtype == np.int32 and out.shape[:2] == (2, 1) and lens.dtype == np.int32 and lens.shape == (2, 1)
    p0, p1 = PROMPTS
    assert out[0, 0, :lens[0, 0]].tolist() == reference[p0][0] + reference[p0][1]  # prompt included
    assert out[1, 0, :lens[1, 0]].tolist() == reference[p1][1]                   # completion only
    assert r.as_numpy("cum_log_probs").shape == (2, 1)


def test_concurrent_requests(server, reference):
    with cf.ThreadPoolExecutor(4) as ex:
        futs = {ex.submit(_http_ask, server, "ensemble", p): p for p in PROMPTS * 2}
        for f, p in futs.items():
            assert f.result() == reference[p][2]


def test_stop_word_and_refusals(server, reference):
    from tritonclient.utils import InferenceServerException

    p = PROMPTS[0]
    assert " Paris" in reference[p][2]
    got = _http_ask(server, "ensemble", p, stop_words=("BYTES", np.array([[b" Paris"]], dtype=object)))
    assert got == reference[p][2][:reference[p][2].index(" Paris") + len(" Paris")]
    with pytest.raises(InferenceServerException, match="cpu_reference"):
        _http_ask(server, "ensemble", p, beam_width=("INT32", np.array([[2]], np.int32)))
    assert "This is NOT TensorRT-LLM" in server.log_file.read_text()
