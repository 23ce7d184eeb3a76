"""gate/candidates.py's batching choices pinned with recording stand-ins (issue 26): ``greedy_all`` sends a batch of
several prompts to ``greedy_batch`` and a lone prompt to ``greedy``; ``HFCandidate.greedy_batch`` decodes one prompt
alone and several in one left-padded ``generate`` call with greedy settings."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from precision_pipeline.gate import candidates as C
from precision_pipeline.gate.golden import EncodedPrompt


def enc(n_prompt: int, pid: str) -> EncodedPrompt:
    ids = list(range(1, n_prompt + 3))
    return EncodedPrompt(pid, "facts", "q", "a", ids, 1, n_prompt, n_prompt + 2)


class Recorder:
    def __init__(self):
        self.calls = []

    def greedy(self, ids, n, stop):
        self.calls.append(("greedy", [len(ids)]))
        return [len(ids)]

    def greedy_batch(self, prompts, n, stop):
        self.calls.append(("batch", [len(p) for p in prompts]))
        return [[len(p)] for p in prompts]


def test_greedy_all_batches_only_groups_of_several():
    encoded = [enc(5, "a"), enc(3, "b"), enc(9, "c")]  # generation prompts of 5, 3, 9 tokens
    rec = Recorder()
    done = []
    out = C.greedy_all(rec, encoded, 4, 0, batch=2, on_done=done.append)
    # sorted by length (3, 5, 9) and cut into 2 groups of near-equal size: (3, 5) batched, (9) alone
    assert rec.calls == [("batch", [3, 5]), ("greedy", [9])]
    assert out == [[5], [3], [9]] and done == [2, 1]  # prompt order, progress per group
    rec = Recorder()
    C.greedy_all(rec, encoded, 4, 0, batch=1)  # batch 1: never batched
    assert [c[0] for c in rec.calls] == ["greedy"] * 3


class FakeLM(torch.nn.Module):
    """An HF-like model: ``generate`` records its inputs and appends tokens 7, 0 (the stop id), 8."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.calls = []

    def generate(self, input_ids, attention_mask, max_new_tokens, **kw):
        self.calls.append((input_ids.tolist(), attention_mask.tolist(), max_new_tokens, kw))
        tail = torch.tensor([[7, 0, 8]] * input_ids.shape[0])
        return torch.cat([input_ids, tail], dim=1)


GREEDY = {"do_sample": False, "num_beams": 1, "eos_token_id": 0, "pad_token_id": 0, "temperature": None, "top_p": None,
          "top_k": None}


def test_hf_greedy_batch_left_pads_several_and_decodes_one_alone():
    lm = FakeLM()
    cand = C.HFCandidate(lm, "fake")
    assert cand.greedy_batch([[4, 5, 6]], 3, 0) == [[7, 0]]
    assert lm.calls == [([[4, 5, 6]], [[1, 1, 1]], 3, GREEDY)]
    lm.calls.clear()
    assert cand.greedy_batch([[4, 5, 6], [9]], 3, 0) == [[7, 0], [7, 0]]
    assert lm.calls == [([[4, 5, 6], [0, 0, 9]], [[1, 1, 1], [0, 0, 1]], 3, GREEDY)]


class NoGenerate(torch.nn.Module):
    """A causal LM without ``generate`` (a plain callable model): logits favour token (last + 1) % 10."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, use_cache=False):
        return torch.nn.functional.one_hot((input_ids + 1) % 10, 10).float()


def test_a_model_without_generate_decodes_prompt_by_prompt():
    cand = C.HFCandidate(NoGenerate())
    assert cand.greedy_batch([[1, 2], [7]], 4, stop_id=9) == [[3, 4, 5, 6], [8, 9]]


def test_heldout_nll_of_no_windows_is_empty():
    out = C.heldout_nll(lambda w: pytest.fail("no window to score"), [])
    assert out.shape == (0,) and out.dtype == np.float64
