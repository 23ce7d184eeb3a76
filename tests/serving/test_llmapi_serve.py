"""A real tritonserver serves an LLM-API unit (llm_api_<h12>) with the CPU stand-in as its 1/model.py: text in,
text out equal to greedy decoding of the checkpoint's model (the gate's loader); it refuses what TensorRT-LLM's
LLM-API model refuses (a batched model.yaml, streaming without decoupled mode); the BLS dispatches to it or to an
engine unit of the same repository (stable / canary either way) and each response's precision_path names the unit
and its serving route. One server for the module."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from precision_pipeline.serving import llmapi_unit as U
from precision_pipeline.serving.triton_server import TritonServer
from tests.serving.test_llmapi_contract import MODEL_YAML

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is"
MAX_NEW = 8


@pytest.fixture(scope="module")
def units(tmp_path_factory, fp8_checkpoint, default_model_dir):
    """(repository, served unit, refused unit): the FP8 TRT-LLM test checkpoint (until hf28's HF unified
    checkpoint reader lands the stand-in's loader reads this layout) packed as an LLM-API unit, and a copy of it
    whose model.yaml asks for batching (written behind pack's back: pack refuses it)."""
    from precision_pipeline.serving import pack
    from precision_pipeline.spec.profile import load_profile
    from tests.serving.test_pack import make_plan

    out = tmp_path_factory.mktemp("llmapi") / "out"
    prof = load_profile("bf16-h100")  # an engine unit without checkpoint (the HF model in FP32), as test_serve.py
    res = pack.pack_repository(make_plan(prof), prof, Path(default_model_dir), out / "no-checkpoint", out / "engine", False,
                               out / "model_repository", str(out.resolve()))
    repo = res.out_dir
    u = U.pack_llm_api_unit(repo, MODEL_YAML, Path(fp8_checkpoint), Path(default_model_dir), str(out.resolve()),
                            {"profile": "fp8-test"}, version="1.2.1")
    bad = "llm_api_badbadbadbad"
    shutil.copytree(repo / u.name, repo / bad)
    cfg = (repo / bad / "config.pbtxt").read_text().replace(u.name, bad)
    (repo / bad / "config.pbtxt").write_text(cfg)
    y = yaml.safe_load((repo / bad / "1" / "model.yaml").read_text())
    y["triton_config"]["max_batch_size"] = 4
    (repo / bad / "1" / "model.yaml").write_text(yaml.safe_dump(y))
    return repo, u.name, bad, res.engine_unit


@pytest.fixture(scope="module")
def server(units):
    """Triton on the overlay the Triton Deployment's init container builds (``llmapi_unit.OVERLAY_SCRIPT``, run by dash
    over the repository), with the CPU stand-in in the place of the image's LLM-API model.py: Triton 2.51
    serves symlinked model folders, and route.json written into the repository later reaches the BLS."""
    import subprocess

    repo, unit, _, engine = units
    image = repo.parent / "image-llmapi"
    image.mkdir()
    shutil.copyfile(U.STAND_IN, image / "model.py")
    (image / "helpers.py").write_text("# the image's helpers.py (the stand-in imports none)\n")
    overlay = repo.parent / "serving" / "model_repository"
    subprocess.run([shutil.which("dash") or "/bin/sh", "-c", U.OVERLAY_SCRIPT, "x", str(repo), str(overlay), str(image)],
                   check=True, capture_output=True)
    srv = TritonServer(overlay, ["preprocessing", "postprocessing", engine, "tensorrt_llm_bls", unit],
                       log_file=repo.parent / "server.log")
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(fp8_checkpoint, default_model_dir):
    """Greedy decoding of the checkpoint's model (the loader the stand-in and the gate use), as text, on one torch
    thread as the server's model runs (FP8 fake-quant has near-ties: 1 vs 16 threads pick another 5th token here)."""
    import torch
    from transformers import AutoTokenizer

    from precision_pipeline.gate.model import load_checkpoint_model

    model = load_checkpoint_model(Path(fp8_checkpoint), Path(default_model_dir)).float().eval()
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                             pad_token_id=tok.eos_token_id)
    torch.set_num_threads(threads)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def _ask(srv, unit, text=PROMPT, **extra):
    import tritonclient.http as hc

    c = hc.InferenceServerClient(srv.http_url)
    inputs = []
    for name, (dt, arr) in {"text_input": ("BYTES", np.array([text.encode()], dtype=object)),
                            "sampling_param_max_tokens": ("INT32", np.array([MAX_NEW], np.int32)), **extra}.items():
        x = hc.InferInput(name, list(arr.shape), dt)
        x.set_data_from_numpy(arr)
        inputs.append(x)
    return c.infer(unit, inputs)


def test_text_in_text_out_equals_the_checkpoints_greedy_output(server, units, reference):
    _, unit, _, _ = units
    r = _ask(server, unit, return_finish_reason=("BOOL", np.array([True])))
    assert r.as_numpy("text_output").tolist() == [(PROMPT + reference).encode()]  # prompt included by default
    assert r.as_numpy("finish_reason").tolist() in ([b"length"], [b"stop"])
    r = _ask(server, unit, sampling_param_exclude_input_from_output=("BOOL", np.array([True])))
    assert r.as_numpy("text_output").tolist() == [reference.encode()]
    # as the real model sends it (str of the value, BYTES, though config.pbtxt says TYPE_FP32; Triton 2.51 lets it pass)
    r = _ask(server, unit, return_cumulative_logprob=("BOOL", np.array([True])))
    (c,) = r.as_numpy("cumulative_logprob").tolist()
    assert isinstance(c, bytes) and float(c.decode()) < 0
    assert [o["datatype"] for o in r.get_response()["outputs"] if o["name"] == "cumulative_logprob"] == ["BYTES"]
    cfg = server.model_config(unit)
    assert cfg["max_batch_size"] == 0 and cfg["model_transaction_policy"]["decoupled"] is False  # from model.yaml


def test_refusals(server, units):
    from tritonclient.utils import InferenceServerException

    _, unit, bad, _ = units
    with pytest.raises(InferenceServerException, match="Streaming is only supported in decoupled mode"):
        _ask(server, unit, streaming=("BOOL", np.array([True])))
    with pytest.raises(InferenceServerException, match="sampling_param_top_k=5 is not supported by the CPU stand-in"):
        _ask(server, unit, sampling_param_top_k=("INT32", np.array([5], np.int32)))
    with pytest.raises(RuntimeError, match="triton_config.max_batch_size: is 4; must be 0"):
        server.load(bad)
    assert server.loaded_models().get(unit) == "READY"


def _bls(srv):
    import json

    from precision_pipeline.serving.triton_server import text_request

    c = srv.http_client()
    try:
        r = c.infer("tensorrt_llm_bls", text_request(PROMPT, MAX_NEW))
        return r.as_numpy("text_output").reshape(-1)[0], json.loads(r.as_numpy("precision_path").reshape(-1)[0]), r
    finally:
        c.close()


def test_bls_dispatches_to_either_kind_of_unit(server, units, reference):
    from precision_pipeline.serving import release_configs

    repo, unit, _, engine = units
    text, path, _ = _bls(server)  # route.json absent: the BLS's parameter, the engine unit
    assert path["unit"] == engine and path["serving_route"] == "engine" and path["route"] == "stable"
    engine_text = text
    release_configs.point_bls(repo, unit)
    try:
        text, path, r = _bls(server)
        assert path == {"profile": "fp8-test", "unit": unit, "serving_route": "llm_api", "route": "stable"}
        assert text == reference.encode()  # the unit's text, the prompt excluded as for engine units
        assert r.as_numpy("cum_log_probs").shape == (1, 1) and r.as_numpy("cum_log_probs")[0, 0] < 0
        assert r.as_numpy("output_log_probs") is None  # the LLM-API model returns no per-token log probs
        release_configs.set_canary(repo, unit, engine, 50)  # an engine-route canary over an LLM-API release
        got = [_bls(server) for _ in range(4)]
        assert sorted((p["route"], p["unit"], p["serving_route"]) for _, p, _ in got) == sorted(
            [("canary", engine, "engine")] * 2 + [("stable", unit, "llm_api")] * 2)
        assert {t for t, p, _ in got if p["unit"] == engine} == {engine_text}
        release_configs.set_canary(repo, engine, unit, 50)  # and the other way round
        got = [_bls(server)[1] for _ in range(4)]
        assert sorted((p["route"], p["serving_route"]) for p in got) == sorted(
            [("canary", "llm_api")] * 2 + [("stable", "engine")] * 2)
    finally:
        release_configs.point_bls(repo, engine)
