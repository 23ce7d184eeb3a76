"""``trtllm-build``'s options that ``engine/trtllm_build.py`` renders, as TensorRT-LLM 1.2 parses them.

Each rendered flag with its kind and accepted values, from the source (and the same in
``shared/reference/trtllm-1.2-build-reference.md`` sections 1-2, checked against it):

* ``tensorrt_llm/commands/build.py`` ``parse_arguments()``: ``--checkpoint_dir``, ``--output_dir``
  (str), ``--workers``, ``--max_batch_size``, ``--max_input_len``, ``--max_seq_len``,
  ``--max_num_tokens``, ``--max_beam_width`` (int), ``--kv_cache_type`` (``enum_type(KVCacheType)``:
  the name, any case: continuous / paged / disabled), ``--logits_dtype`` (choices float16, float32),
  ``--gather_context_logits`` (``store_true``: no value).
* ``tensorrt_llm/plugin/plugin.py`` ``cli_plugin_args`` + ``add_plugin_argument()`` (the pydantic
  ``PluginConfig`` of 1.x): a field typed ``Optional[Literal[...]]`` takes its literals plus
  ``disable`` for None (``--gemm_plugin``: auto, float16, float32, bfloat16, int32, fp8, nvfp4;
  ``--gpt_attention_plugin``: ``DefaultPluginDtype`` auto, float16, float32, bfloat16, int32); a bool
  field takes ``enable`` / ``disable`` (``--context_fmha``, ``--use_paged_context_fmha``,
  ``--use_fp8_context_fmha``, ``--remove_input_padding``); an int field its type (``--tokens_per_block``).

``check_build_args(argv)`` returns what argparse would refuse (unknown flag, bad choice, missing or
extra value) so the rendered command line is checked on machines without ``tensorrt_llm``.
"""

from __future__ import annotations

from typing import Optional, Sequence

SRC_BUILD = "tensorrt_llm/commands/build.py parse_arguments()"
SRC_PLUGIN = "tensorrt_llm/plugin/plugin.py cli_plugin_args, add_plugin_argument()"
PLUGIN_DTYPES = ("auto", "float16", "float32", "bfloat16", "int32")  # DefaultPluginDtype literals
ENABLE = ("enable", "disable")

FLAGS: dict[str, tuple[str, Optional[tuple[str, ...]], str]] = {
    # flag: (kind: str | int | choice | ci_choice | store_true, choices, source)
    "--checkpoint_dir": ("str", None, SRC_BUILD),
    "--output_dir": ("str", None, SRC_BUILD),
    "--workers": ("int", None, SRC_BUILD),
    "--max_batch_size": ("int", None, SRC_BUILD),
    "--max_input_len": ("int", None, SRC_BUILD),
    "--max_seq_len": ("int", None, SRC_BUILD),
    "--max_num_tokens": ("int", None, SRC_BUILD),
    "--max_beam_width": ("int", None, SRC_BUILD),
    "--kv_cache_type": ("ci_choice", ("continuous", "paged", "disabled"), SRC_BUILD + " enum_type(KVCacheType)"),
    "--logits_dtype": ("choice", ("float16", "float32"), SRC_BUILD),
    "--gather_context_logits": ("store_true", None, SRC_BUILD),
    "--gemm_plugin": ("choice", PLUGIN_DTYPES + ("fp8", "nvfp4", "disable"), SRC_PLUGIN),
    "--gpt_attention_plugin": ("choice", PLUGIN_DTYPES + ("disable",), SRC_PLUGIN),
    "--context_fmha": ("choice", ENABLE, SRC_PLUGIN),
    "--use_paged_context_fmha": ("choice", ENABLE, SRC_PLUGIN),
    "--use_fp8_context_fmha": ("choice", ENABLE, SRC_PLUGIN),
    "--remove_input_padding": ("choice", ENABLE, SRC_PLUGIN),
    "--tokens_per_block": ("int", None, SRC_PLUGIN),
}


def check_build_args(argv: Sequence[str]) -> list[str]:
    """What ``trtllm-build`` 1.2's parser would refuse in ``argv`` (without the program name), as messages."""
    out: list[str] = []
    i = 0
    seen: set[str] = set()
    while i < len(argv):
        flag = argv[i]
        spec = FLAGS.get(flag)
        if spec is None:
            out.append(f"{flag!r} is not a trtllm-build option rendered here (known: {', '.join(FLAGS)})")
            i += 1
            continue
        if flag in seen:
            out.append(f"{flag} is given twice")
        seen.add(flag)
        kind, choices, source = spec
        if kind == "store_true":
            i += 1
            continue
        if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
            out.append(f"{flag} needs a value ({source})")
            i += 1
            continue
        v = argv[i + 1]
        if kind == "int" and not v.lstrip("-").isdigit():
            out.append(f"{flag} {v!r} is not an integer ({source})")
        elif kind == "choice" and v not in (choices or ()):
            out.append(f"{flag} {v!r} is not one of {', '.join(choices or ())} ({source})")
        elif kind == "ci_choice" and v.lower() not in (choices or ()):
            out.append(f"{flag} {v!r} is not one of {', '.join(choices or ())} ({source})")
        i += 2
    return out


__all__ = ["FLAGS", "check_build_args", "SRC_BUILD", "SRC_PLUGIN"]
