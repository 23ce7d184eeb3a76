"""The inputs of one text request to a served repository's entry points (a module of its own: both
``serving.triton_server`` and the serve watchdog, which that server's loop runs, send such requests)."""

from __future__ import annotations

from typing import Any


def text_request(text: str, max_tokens: int, client_module: Any = None, **extra: tuple[str, Any]) -> list:
    """The inputs of one text request to the ensemble or the BLS: ``text_input`` (BYTES [1, 1]) and
    ``max_tokens`` (INT32 [1, 1]), as the repository's config.pbtxt templates declare them
    (``triton_repo/all_models/inflight_batcher_llm/{ensemble,tensorrt_llm_bls}``), plus ``extra``
    optional inputs as ``name=(triton dtype, numpy array)`` (e.g. ``stream=("BOOL", [[True]])``).
    ``client_module``: ``tritonclient.http`` (default) or ``tritonclient.grpc``."""
    import numpy as np

    if client_module is None:
        import tritonclient.http as client_module

    def one(name: str, dtype: str, arr: Any) -> Any:
        x = client_module.InferInput(name, list(arr.shape), dtype)
        x.set_data_from_numpy(arr)
        return x

    return [one("text_input", "BYTES", np.array([[text.encode()]], dtype=object)),
            one("max_tokens", "INT32", np.array([[max_tokens]], np.int32)),
            *(one(k, dt, np.asarray(v)) for k, (dt, v) in extra.items())]


__all__ = ["text_request"]
