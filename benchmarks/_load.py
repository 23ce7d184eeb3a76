"""Client load for the serving benchmarks (``bench rollback``, ``bench rollout``): threads in bounded
loops against a real Triton server, counting requests, failures and latencies. No retries: a failure
is a failure. (A helper module, not a benchmark: ``invoke bench`` skips names starting with ``_``.)"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional


class ClientLoad:
    """``threads`` clients, each calling ``send(client, i)`` up to ``max_requests`` times until ``stop``.

    ``send`` returns None for a good answer or an error text; an exception counts as a failure too.
    ``client`` is a ``tritonclient.http.InferenceServerClient`` of ``url`` (one per thread). ``stats``:
    ``requests``, ``failed``, ``lat_ms`` (one per request) and the first 10 ``errors``.
    """

    def __init__(self, url: str, threads: int, max_requests: int, send: Callable[[Any, int], Optional[str]]):
        self.url, self.max_requests, self.send = url, max_requests, send
        self.stop_event = threading.Event()
        self.lock = threading.Lock()
        self.stats: dict[str, Any] = {"requests": 0, "failed": 0, "lat_ms": [], "errors": []}
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(threads)]

    def _client(self, i: int) -> None:
        import tritonclient.http as hc

        cl = hc.InferenceServerClient(self.url, connection_timeout=300.0, network_timeout=300.0)
        try:
            for _ in range(self.max_requests):
                if self.stop_event.is_set():
                    break
                t0 = time.perf_counter()
                try:
                    err = self.send(cl, i)
                except Exception as e:  # no retries: a failure is a failure
                    err = f"{type(e).__name__}: {str(e)[:200]}"
                with self.lock:
                    self.stats["requests"] += 1
                    self.stats["lat_ms"].append((time.perf_counter() - t0) * 1e3)
                    if err:
                        self.stats["failed"] += 1
                        if len(self.stats["errors"]) < 10:
                            self.stats["errors"].append(err)
        finally:
            cl.close()

    def start(self) -> "ClientLoad":
        for th in self.threads:
            th.start()
        return self

    def alive(self) -> bool:
        return all(th.is_alive() for th in self.threads)

    def stop(self, timeout_s: float = 600) -> None:
        self.stop_event.set()
        for th in self.threads:
            th.join(timeout_s)


def ask(client, model: str, prompt: str, max_tokens: int) -> str:
    """One text request to ``model`` (the ensemble or the BLS: ``text_input`` / ``max_tokens`` ->
    ``text_output``) through a ``tritonclient.http`` client; the decoded text."""
    from precision_pipeline.serving.triton_server import text_request

    return client.infer(model, text_request(prompt, max_tokens)).as_numpy("text_output").reshape(-1)[0].decode()
