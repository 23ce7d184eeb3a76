"""A real tritonserver serves an LLM-API unit (llm_api_<h12>) with the CPU stand-in as its 1/model.py: text in,
text out equal to greedy decoding of the checkpoint's model (the gate's loader); it refuses what TensorRT-LLM's
LLM-API model refuses (a batched model.yaml, streaming without decoupled mode). One server for the module."""

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
    out = tmp_path_factory.mktemp("llmapi") / "out"
    repo = out / "model_repository"
    repo.mkdir(parents=True)
    u = U.pack_llm_api_unit(repo, MODEL_YAML, Path(fp8_checkpoint), Path(default_model_dir), str(out.resolve()),
                            {"profile": "fp8-test"}, version="1.2.1")
    U.install_stand_in(repo / u.name)
    bad = "llm_api_badbadbadbad"
    shutil.copytree(repo / u.name, repo / bad)
    cfg = (repo / bad / "config.pbtxt").read_text().replace(u.name, bad)
    (repo / bad / "config.pbtxt").write_text(cfg)
    y = yaml.safe_load((repo / bad / "1" / "model.yaml").read_text())
    y["triton_config"]["max_batch_size"] = 4
    (repo / bad / "1" / "model.yaml").write_text(yaml.safe_dump(y))
    return repo, u.name, bad


@pytest.fixture(scope="module")
def server(units):
    repo, unit, _ = units
    srv = TritonServer(repo, [unit], log_file=repo.parent / "server.log")
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
    _, unit, _ = units
    r = _ask(server, unit, return_finish_reason=("BOOL", np.array([True])))
    assert r.as_numpy("text_output").tolist() == [(PROMPT + reference).encode()]  # prompt included by default
    assert r.as_numpy("finish_reason").tolist() in ([b"length"], [b"stop"])
    r = _ask(server, unit, sampling_param_exclude_input_from_output=("BOOL", np.array([True])))
    assert r.as_numpy("text_output").tolist() == [reference.encode()]
    cfg = server.model_config(unit)
    assert cfg["max_batch_size"] == 0 and cfg["model_transaction_policy"]["decoupled"] is False  # from model.yaml


def test_refusals(server, units):
    from tritonclient.utils import InferenceServerException

    _, unit, bad = units
    with pytest.raises(InferenceServerException, match="Streaming is only supported in decoupled mode"):
        _ask(server, unit, streaming=("BOOL", np.array([True])))
    with pytest.raises(InferenceServerException, match="sampling_param_top_k=5 is not supported by the CPU stand-in"):
        _ask(server, unit, sampling_param_top_k=("INT32", np.array([5], np.int32)))
    with pytest.raises(RuntimeError, match="triton_config.max_batch_size: is 4; must be 0"):
        server.load(bad)
    assert server.loaded_models().get(unit) == "READY"
