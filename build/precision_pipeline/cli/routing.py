"""``invoke route explain``: which warm unit would serve a request under a profile's ``routing`` section, and which
rule decided, without a server. The decision is the BLS's own file (``spec.routing.evaluator``)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from precision_pipeline.cli.console import console, float_arg, int_arg
from precision_pipeline.core.errors import UserError

ACTIONS = ("explain",)


def prompt_token_count(prompt: str, model_dir: Path) -> tuple[int, bool]:
    """(tokens, chat template applied) of ``prompt`` as the serving preprocessing counts them -- the BLS routes on
    its ``REQUEST_INPUT_LEN``: with the model's chat template (pack sets ``apply_chat_template`` when the tokenizer
    has one) the prompt as one user message rendered with ``add_generation_prompt``, then tokenized without special
    tokens (what ``apply_chat_template(tokenize=True)`` returns); else the text alone, no special tokens. Hostile s12
    F-B: the template (~30 tokens for SmolLM2) was left out, so prompts just under a threshold were explained wrong."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    if getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
        return len(ids["input_ids"] if isinstance(ids, dict) else ids), True
    return len(tok(prompt, add_special_tokens=False)["input_ids"]), False


PROMPT_FILE_MAX_BYTES = 16 * 2**20
"""The largest ``--prompt-file`` read: 16 MiB, above any prompt a served model takes (1M tokens at ~4 bytes a token
is ~4 MB); a bigger file, a device (``/dev/zero``), a FIFO or a folder is refused before it is read (hostile s9 F7:
``/dev/zero`` was read whole, MemoryError)."""


def _read_prompt_file(prompt_file: str) -> str:
    """The text of ``--prompt-file`` (UTF-8, a regular file of at most ``PROMPT_FILE_MAX_BYTES``); UserError else."""
    import stat

    p, shown = Path(prompt_file).expanduser(), str(prompt_file)[:200]
    try:
        st = p.stat()
        if not stat.S_ISREG(st.st_mode):
            raise UserError("--prompt-file", f"{shown} is not a regular file (a device, a FIFO or a folder).",
                            "give a UTF-8 text file holding the prompt.")
        with open(p, "rb") as f:
            data = f.read(PROMPT_FILE_MAX_BYTES + 1)
        if len(data) > PROMPT_FILE_MAX_BYTES:
            raise UserError("--prompt-file", f"{shown} is over {PROMPT_FILE_MAX_BYTES // 2**20} MiB, longer than any "
                            "prompt a served model takes.", "give the prompt itself, or --prompt-tokens N.")
        return data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError("--prompt-file", f"cannot read {shown}: {e.__class__.__name__}.",
                        "give a readable UTF-8 text file.") from None


def _prompt_tokens(prompt: Optional[str], prompt_file: Optional[str], prompt_tokens, model) -> tuple[int, str]:
    given = [x for x in (prompt, prompt_file, prompt_tokens) if x is not None]
    if len(given) != 1:
        raise UserError("--prompt", "give exactly one of --prompt TEXT, --prompt-file PATH or --prompt-tokens N.",
                        "e.g. invoke route explain --profile fp8-h100-routed --prompt 'Hello'.")
    if prompt_tokens is not None:
        return int_arg("--prompt-tokens", prompt_tokens, 1), "given"
    if prompt_file is not None:
        prompt = _read_prompt_file(prompt_file)
    from precision_pipeline.spec.default_model import model_dir

    md = model_dir(model)
    n, templated = prompt_token_count(prompt, md)
    return n, f"counted with the tokenizer of {md.name}" + (", its chat template included, as the served preprocessing "
                                                             "applies it" if templated else "")


def explain(action: str, profile: str, prompt: Optional[str] = None, prompt_file: Optional[str] = None,
            prompt_tokens=None, tier: Optional[str] = None, max_tokens=None, inflight=None, kv_util=None,
            model: Optional[str] = None) -> int:
    """Print the unit and rule for one request; exit 0. Signals (``--inflight``, ``--kv-util``) are taken as steady
    (held longer than any rule's dwell); a signal not given is unknown (its rule keeps its initial state: off).
    Raises UserError (exit 2) for a bad flag, a profile the resolve rules refuse, or one without routing."""
    from precision_pipeline.gate.verdict import load_build_profile
    from precision_pipeline.resolve import plan as plan_mod
    from precision_pipeline.spec.default_model import plan_model_dir
    from precision_pipeline.spec.routing import SIGNAL_MAX, evaluator, routing_table

    if action not in ACTIONS:
        raise UserError("action", f"{str(action)[:40]!r} is not a route action.", f"use one of: {', '.join(ACTIONS)}.")
    prof = load_build_profile(profile)
    plan = plan_mod.resolve(prof, plan_model_dir(model), for_build=False)  # the routing rule too: refusals raise
    r = plan.profile.routing
    if r is None:
        raise UserError("--profile", f"{prof.name} has no routing section: every request goes to its primary unit "
                        "(a canary aside).", "use a profile with routing: (e.g. fp8-h100-routed) or add one "
                        "(README, Per-request routing).")
    n, how = _prompt_tokens(prompt, prompt_file, prompt_tokens, model)
    signals = {k: v for k, v in (("inflight_requests", float_arg("--inflight", inflight, example="4")),
                                 ("kv_cache_utilization", float_arg("--kv-util", kv_util, SIGNAL_MAX["kv_cache_utilization"])))
               if v is not None}
    request = {"prompt_tokens": n, "max_tokens": int_arg("--max-tokens", max_tokens, 1), "tier": tier}
    ev = evaluator()
    d = ev.decide(routing_table(r), request, signals, ev.RoutingState(), now=0.0)
    unit = prof.name if d.target == "primary" else prof.deployment.fallback
    con = console()
    con.print(f"[bold]{d.target}[/] ({unit}) by rule [bold]{d.rule}[/]: {d.reason}", soft_wrap=True)
    con.print(f"  request: prompt_tokens {n} ({how}), max_tokens {request['max_tokens']}, tier {tier}; signals "
              + (", ".join(f"{k} {v:g}" for k, v in signals.items()) or "none given (signal rules off)"), soft_wrap=True)
    for rr in r.rules:
        mark = "->" if rr.name == d.rule else "  "
        con.print(f"  {mark} {rr.name}: {rr.conditions() or 'default'} => {rr.target}", soft_wrap=True)
    target_plan = plan if d.target == "primary" else plan_mod.resolve(load_build_profile(unit), plan_model_dir(model),
                                                                      for_build=False)
    for line in limit_notes(n, request["max_tokens"], target_plan.limits, unit):
        con.print(line, soft_wrap=True)
    return 0


def limit_notes(prompt_tokens: int, max_tokens: Optional[int], limits, unit: str) -> list[str]:
    """What the engine of ``unit`` does with a request past its ``limits`` (hostile s15b F10: explained as routed
    although the engine refuses it), as TensorRT-LLM's request validation does (GenericLlmRequest::validate,
    cpp/include/tensorrt_llm/batch_manager/llmRequest.h): a prompt over ``max_input_len`` is refused; prompt +
    ``max_tokens`` over ``max_seq_len`` has its output shortened to ``max_seq_len - prompt``."""
    if limits.max_input_len and prompt_tokens > limits.max_input_len:
        return [f"  [red]refused by the engine[/]: prompt_tokens {prompt_tokens} > max_input_len {limits.max_input_len} "
                f"of {unit} (TensorRT-LLM: \"Prompt length ({prompt_tokens}) exceeds maximum input length "
                f"({limits.max_input_len}).\")"]
    if max_tokens and limits.max_seq_len and prompt_tokens + max_tokens > limits.max_seq_len:
        return [f"  note: prompt_tokens {prompt_tokens} + max_tokens {max_tokens} > max_seq_len {limits.max_seq_len} of "
                f"{unit}: the engine shortens the output to {limits.max_seq_len - prompt_tokens} tokens"]
    return []


__all__ = ["explain", "prompt_token_count", "limit_notes", "ACTIONS"]
