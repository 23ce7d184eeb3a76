"""Start and stop a real Triton Inference Server (2.51, from the nvidia-pytriton wheel) on this machine.

How it runs (facts in shared/reference/triton-on-cpu.md):

* ``server_dir()`` copies ``pytriton/tritonserver`` once to ``<cache>/tritonserver-2.51`` and puts the
  python-backend stub of the running Python at ``backends/python/triton_python_backend_stub``. The CPU
  reference stand-in for the tensorrtllm backend (``triton_repo/backends/tensorrtllm/model.py``) is
  installed as ``backends/tensorrtllm/model.py`` (a Python-based backend).
* The server runs with ``LD_LIBRARY_PATH`` = the wheel's ``nvidia_pytriton.libs`` + the interpreter's
  LIBDIR, ``PATH`` with the venv's ``bin`` first (the stub finds its packages through ``python3``),
  ``OMP_NUM_THREADS=1``, explicit model control, 127.0.0.1 only and free ports.
* ``TritonServer.stop()`` sends SIGTERM and waits (SIGKILL only after a timeout).
* Leaks: the python backend's shared-memory regions are named ``/dev/shm/<SHM_PREFIX><token>_...``
  (``--backend-config=python,shm-region-prefix-name``, python_backend's option that deploy.py uses
  too); ``stop()`` removes its own, ``start()`` removes those no running process maps any more
  (servers killed with -9). A server's own temporary log (no ``log_file`` given) is removed by a clean
  ``stop()``; ``serve`` logs to one file per HTTP port (``serve_log_path``), rewritten by each serve.

``serve(model_repository, ...)`` is what ``invoke serve`` calls: it loads the current release (or every
model of a freshly packed repository), prints the endpoints and runs until Ctrl-C.

Tracing: when the repository's BLS config carries an ``otlp_traces_url`` (``deployment.otlp_endpoint`` +
``/v1/traces``, written at pack time), ``serve`` turns on Triton's OpenTelemetry tracing to it (``trace_args``;
2.51 supports ``--trace-config mode=opentelemetry``: ``GET /v2/trace/setting`` reports it).
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterable

from precision_pipeline.core.errors import LoadNotFinished, ServerStopped, UserError
from precision_pipeline.core.signals import terminate_as_interrupt  # noqa: F401  (its users import it from here too)
from precision_pipeline.serving.infer_request import text_request  # noqa: F401  (its callers import it from here)
from precision_pipeline.serving.server_procs import (local_metrics_port, other_servers, process_state,  # noqa: F401
                                                     repository_at, same_directory, same_endpoint, server_processes,
                                                     servers_of)
from precision_pipeline.core.paths import REPO_ROOT, cache_dir

SHM_PREFIX = "precision_pipeline_"
"""Prefix of the python backend's shared-memory regions of the servers started here (``/dev/shm``)."""
SHM_MIN_AGE_S = 30.0
"""A region younger than this is never removed as stale: a server that is starting may not map it yet."""
STANDIN_BACKEND = REPO_ROOT / "triton_repo" / "backends" / "tensorrtllm"
SERVER_VERSION = "2.51"
TRACE_SERVICE_NAME = "precision-pipeline"
"""``service.name`` of the spans Triton and the BLS export (OpenTelemetry resource semantic conventions)."""


def trace_args(traces_url: str | None) -> list[str]:
    """Triton's own OpenTelemetry tracing: ``--trace-config`` flags (``tritonserver --help`` of 2.51: global
    ``mode``/``rate``/``level``, ``opentelemetry,url=`` and ``opentelemetry,resource=``) that trace every
    request (rate 1, timestamps) and export to ``traces_url`` over OTLP/HTTP (Triton's exporter sends OTLP/JSON)
    every ``TRITON_BSP_DELAY_MS``. ``[]`` when ``traces_url`` is empty."""
    if not traces_url:
        return []
    return ["--trace-config=mode=opentelemetry", "--trace-config=rate=1", "--trace-config=level=TIMESTAMPS",
            f"--trace-config=opentelemetry,url={traces_url}",
            f"--trace-config=opentelemetry,resource=service.name={TRACE_SERVICE_NAME}",
            f"--trace-config=opentelemetry,bsp_schedule_delay={TRITON_BSP_DELAY_MS}"]


TRITON_BSP_DELAY_MS = 5000
"""Triton's batch span processor delay (its default, ``GET /v2/trace/setting`` ``bsp_schedule_delay``), given
explicitly: Triton also reads ``OTEL_BSP_SCHEDULE_DELAY``, which is meant for the BLS's OTel SDK."""


def repository_traces_url(model_repository: Path) -> str | None:
    """The BLS's ``otlp_traces_url`` parameter in ``model_repository`` (None when unset or there is no BLS)."""
    from precision_pipeline.serving import pack

    p = Path(model_repository) / "tensorrt_llm_bls" / "config.pbtxt"
    if not p.is_file():
        return None
    return pack.config_params(pack.parse_model_config(p.read_text(), str(p))).get("otlp_traces_url") or None


def _pytriton_paths() -> tuple[Path, Path]:
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("tritonserver", "the nvidia-pytriton package is not installed.", "run ./run.sh (installs nvidia-pytriton==0.7.0).")
    pkg = Path(list(spec.submodule_search_locations)[0])
    return pkg / "tritonserver", pkg.parent / "nvidia_pytriton.libs"


def _write_if_changed(src: Path, dst: Path) -> None:
    data = src.read_bytes()
    if dst.is_file() and dst.read_bytes() == data:
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, dst)


def server_dir() -> Path:
    """The prepared copy of the server (made once; the stand-in backend is refreshed every call)."""
    src, _ = _pytriton_paths()
    pyver = f"{sys.version_info.major}.{sys.version_info.minor}"
    dst = cache_dir() / f"tritonserver-{SERVER_VERSION}-py{pyver}"
    if not (dst / "bin" / "tritonserver").is_file():
        stub = src / "python_backend_stubs" / pyver / "triton_python_backend_stub"
        if not stub.is_file():
            raise UserError("tritonserver", f"the pytriton wheel has no python-backend stub for Python {pyver}.", "use Python 3.8-3.13.")
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=dst.parent, prefix=f".{dst.name}.tmp-"))
        shutil.copytree(src, tmp / "s", symlinks=True)
        shutil.copy2(stub, tmp / "s" / "backends" / "python" / "triton_python_backend_stub")
        os.chmod(tmp / "s" / "backends" / "python" / "triton_python_backend_stub", 0o755)
        (tmp / "s" / "caches").mkdir(exist_ok=True)
        try:
            os.replace(tmp / "s", dst)
        except OSError:  # another process made it first
            pass
        shutil.rmtree(tmp, ignore_errors=True)
    _write_if_changed(STANDIN_BACKEND / "model.py", dst / "backends" / "tensorrtllm" / "model.py")
    return dst


def _die_with_parent() -> None:
    """In the forked child: ask Linux to SIGTERM us when the parent dies (``prctl(PR_SET_PDEATHSIG)``)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG (linux/prctl.h)
    except (OSError, AttributeError):  # not Linux: a crashed parent may leave the server running
        pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


METRICS_URL_ENV = "PRECISION_PIPELINE_METRICS_URL"
"""The server's own metrics URL, for the BLS's routing signals (tensorrt_llm_bls/1/model.py, same name; a test checks)."""


def server_env(threads: int = 1) -> dict[str, str]:
    _, libs = _pytriton_paths()
    env = dict(os.environ)
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    env["LD_LIBRARY_PATH"] = ":".join(p for p in (str(libs), libdir, env.get("LD_LIBRARY_PATH", "")) if p)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[k] = str(threads)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    return env


def check_distinct_ports(flags: Iterable[tuple[str, int]]) -> None:
    """UserError (exit 2) naming the flag when two of ``flags`` (``(flag, port)``: HTTP, gRPC, metrics) share a
    port: tritonserver then exits 1 with its usage text (hostile s8 #99), so it is refused before anything starts."""
    seen: dict[int, str] = {}
    for flag, port in flags:
        if port in seen:
            raise UserError(flag, f"{port} is also {seen[port]}; HTTP, gRPC and metrics each need a port of their own "
                            "(tritonserver does not start otherwise); nothing was started.",
                            "pass three different ports (the defaults: --http-port 8000 --grpc-port 8001 "
                            "--metrics-port 8002).")
        seen[port] = flag


LOAD_STALL_S = 60.0
"""Seconds a model load waits on a server that does not answer ``/v2/health/live`` before it gives up
(``ServerStopped``, exit 7): a frozen or deadlocked server (SIGSTOP, hostile s12 F-L) answers nothing, while a server
that loads a large unit for minutes still answers its liveness endpoint (Triton serves HTTP on other threads)."""
LOAD_PROGRESS_S, LOAD_POLL_S = 10.0, 1.0
"""Seconds between a long load's progress lines ("loading X on U: 30 s ..."), and between its liveness checks."""

LOAD_POST_SLACK_S = 30.0
"""How much longer than ``load_timeout_s`` the load request itself may wait: ``load`` gives up first, with "did not
finish" (RuntimeError) while the server still answers. With equal limits the request's socket timeout won and a load
Triton keeps pending for good (a python stub that fails to start: measured, it never ends in 2.51) read as the server
stopping (hostile s17c H17: serve's watchdog then retried it silently every 5 s, holding the releases lock)."""


class TritonServer:
    """A tritonserver process (explicit model control, 127.0.0.1)."""

    def __init__(self, model_repository: Path, models: Iterable[str] = (), *, http_port: int | None = None,
                 grpc_port: int | None = None, metrics_port: int | None = None, log_file: Path | None = None,
                 threads: int = 1, stub_timeout_s: int = 120, verbose: bool = False, trace_url: str | None = None):
        self.model_repository = Path(model_repository).resolve()
        self.models = list(models)
        self.http_port = http_port or free_port()
        self.grpc_port = grpc_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self._own_log = not log_file  # a temporary log of our own: made by start(), removed by a clean stop()
        self.log_file: Path | None = Path(log_file) if log_file else None  # None until start() (hostile s17 F3)
        self.log_mode = "ab"
        """How start() opens the log: "ab" appends, "wb" starts it afresh (serve's per-port log)."""
        self.shm_token = f"{os.getpid()}_{os.urandom(4).hex()}_"
        """This server's part of its shared-memory region names (``SHM_PREFIX`` + token)."""
        self.threads = threads
        self.stub_timeout_s = stub_timeout_s
        self.verbose = verbose
        self.trace_url = trace_url
        """OTLP/HTTP traces URL for Triton's own tracing (``trace_args``); None: Triton does not trace."""
        self.proc: subprocess.Popen | None = None
        self.start_s: float | None = None

    host: str = "127.0.0.1"
    load_timeout_s: float = 900.0
    """How long ``load`` waits for a model to load (a large unit loads for minutes); ``invoke serve``'s watchdog
    waits ``HEAL_LOAD_S`` (it holds the releases lock meanwhile)."""

    @classmethod
    def attach(cls, http_url: str) -> "TritonServer":
        """A handle on a server that is already running (``HOST:PORT`` of its HTTP endpoint).

        ``load``/``unload``/``loaded_models``/``http_client`` work on it; ``stop`` does nothing.
        ``http://HOST:PORT`` (and a trailing ``/``) is taken as HOST:PORT; another scheme is refused.
        Raises UserError (``--url``, exit 2) when ``http_url`` is empty or not HOST:PORT, when nothing answers
        there, or when what answers is not Triton's HTTP/JSON API (v2): its metrics port (text), its gRPC port
        (HTTP/2), another web server.
        """
        if not (http_url or "").strip():
            # an unset $URL must not silently mean "no server": the live server would keep serving the old unit
            raise UserError("--url", "is empty.", "pass HOST:PORT of the server's HTTP endpoint (e.g. --url "
                            "127.0.0.1:8000), or leave --url out to only rewrite the repository.")
        http_url = http_url.strip()
        scheme, sep, rest = http_url.partition("://")
        if sep:  # how URLs are written: http://HOST:PORT[/] is the same endpoint (hostile s9 F8)
            if scheme.lower() != "http":
                raise UserError("--url", f"{http_url[:100]!r}: the server's HTTP endpoint speaks plain http, not "
                                f"{scheme[:20]}.", "pass HOST:PORT (e.g. --url 127.0.0.1:8000).")
            http_url = rest.rstrip("/")
        host, _, port = http_url.rpartition(":")
        if not port.isdigit():
            raise UserError("--url", f"{http_url!r} is not HOST:PORT.", "e.g. --url 127.0.0.1:8000")
        if not 1 <= int(port) <= 65535:  # hostile s8 #35: was "no Triton server answers"
            raise UserError("--url", f"port {int(port)} is out of range (1..65535).",
                            "pass the HTTP port of the server (default 8000; `invoke serve` prints it).")
        srv = cls(Path("."), http_port=int(port), grpc_port=1, metrics_port=1)
        srv.host = host or "127.0.0.1"
        # live, not ready: Triton reports not-ready while any model is still UNLOADING (after an abort)
        live = srv._get("/v2/health/live")
        if live == 0:
            local = next(((pid, repo) for pid, repo, at in server_processes() if same_endpoint(at, f"{srv.host}:{port}")), None)
            if local is not None:  # hostile s15 F10: a stopped or hung local server; its three fixes were each refused
                pid, repo = local
                state = process_state(pid)
                raise UserError("--url", f"tritonserver (pid {pid}, serving {repo or '?'}) listens at {http_url} but does "
                                f"not answer (process state {state}); nothing was changed.",
                                (f"resume it (kill -CONT {pid})" if state.startswith("T") else "wait for it")
                                + f", or stop it (kill {pid}) and start it again (`invoke serve --repo {repo or 'REPO'}`).")
            raise UserError("--url", f"no Triton server answers at http://{http_url}.",
                            "start one with `invoke serve`, or leave --url out to only rewrite the repository.")
        if live != 200 or not srv._is_triton_http():
            raise UserError("--url", f"the server at {http_url} does not answer Triton's HTTP API (v2) (its metrics or "
                            "gRPC port, or another server?).", "pass the HTTP port (default 8000; `invoke serve` "
                            "prints it).")
        return srv

    @classmethod
    def from_url(cls, url: str | None) -> "TritonServer | None":
        """The server a command's ``--url`` names: None when the option was not given (``url`` None), else
        ``attach(url)``, which refuses an empty or blank ``url`` (an unset ``$URL`` is not "no server")."""
        return None if url is None else cls.attach(url)

    def _is_triton_http(self) -> bool:
        """Whether ``GET /v2`` answers the KServe v2 server-metadata JSON object ``{"name", "version",
        "extensions"}`` (Triton docs/protocol, "Server Metadata"), as Triton's HTTP endpoint does."""
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2", timeout=5) as r:
                meta = json.loads(r.read())
        except (OSError, ValueError, http.client.HTTPException):
            return False
        return isinstance(meta, dict) and isinstance(meta.get("version"), str) and isinstance(meta.get("extensions"), list)

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def argv(self) -> list[str]:
        d = server_dir()
        argv = [str(d / "bin" / "tritonserver"), f"--model-repository={self.model_repository}",
                f"--backend-directory={d / 'backends'}", f"--cache-directory={d / 'caches'}",
                "--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1",
                f"--http-port={self.http_port}", f"--grpc-port={self.grpc_port}", f"--metrics-port={self.metrics_port}",
                "--allow-gpu-metrics=false", "--model-control-mode=explicit", "--exit-timeout-secs=10",
                f"--backend-config=python,stub-timeout-seconds={self.stub_timeout_s}",
                f"--backend-config=python,shm-region-prefix-name={SHM_PREFIX}{self.shm_token}"]
        argv += [f"--load-model={m}" for m in self.models]
        argv += trace_args(self.trace_url)
        if self.verbose:
            argv.append("--log-verbose=1")
        return argv

    def port_flags(self) -> tuple[tuple[str, int], ...]:
        """``((flag, port), ...)`` of the server's three listeners, as ``argv`` passes them."""
        return (("--http-port", self.http_port), ("--grpc-port", self.grpc_port), ("--metrics-port", self.metrics_port))

    def ports_in_use(self) -> list[tuple[str, int]]:
        """``[(flag, port)]`` of this server's ports that another process already listens on (127.0.0.1).

        The probe binds with ``SO_REUSEADDR``, as tritonserver's HTTP and gRPC servers do: a port that
        only has TIME-WAIT connections left (a server stopped a minute ago) is free for them, so it is
        not reported; a listening socket still is (Linux refuses that bind even with SO_REUSEADDR)."""
        busy = []
        for flag, port in self.port_flags():
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind((self.host, port))
                except OSError:
                    busy.append((flag, port))
        return busy

    def start(self, timeout_s: float = 300) -> "TritonServer":
        """Start the process and wait until it is ready.

        Raises UserError (exit 2) when two of its ports are the same (``check_distinct_ports``) or a port is
        already taken -- otherwise the readiness probe
        could be answered by the other server. The child gets ``PR_SET_PDEATHSIG`` (Linux), so it
        is terminated when the process that started it dies, even by ``kill -9``.
        """
        check_distinct_ports(self.port_flags())
        busy = self.ports_in_use()
        if busy:
            raise UserError(busy[0][0], "port(s) already in use on 127.0.0.1: "
                            + ", ".join(f"{p} ({f})" for f, p in busy) + "; another server is probably running.",
                            "stop that server, or pass free ports (--http-port/--grpc-port/--metrics-port).")
        t0 = time.perf_counter()
        clean_stale_shm()
        if self.log_file is None:
            fd, tmp = tempfile.mkstemp(prefix="tritonserver-", suffix=".log")
            os.close(fd)
            self.log_file = Path(tmp)
        log = open(self.log_file, self.log_mode)
        env = {**server_env(self.threads), METRICS_URL_ENV: f"http://127.0.0.1:{self.metrics_port}/metrics"}
        self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                     cwd=str(self.model_repository.parent), start_new_session=True,
                                     preexec_fn=_die_with_parent)
        log.close()
        try:
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.perf_counter() - t0
        return self

    log_file: Path | None
    """The server's log; None until ``start`` makes a temporary one (a handle from ``attach`` never has one: hostile
    s17 F3, each --url command left an empty /tmp/tritonserver-*.log, and a full /tmp was a traceback)."""

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-n:]) if self.log_file else ""
        except OSError:
            return ""

    def _get(self, path: str, timeout: float = 2.0) -> int:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}{path}", timeout=timeout) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except (urllib.error.URLError, OSError):
            return 0
        except http.client.HTTPException:  # an answer that is not HTTP/1 (e.g. a gRPC port's HTTP/2 frames)
            return -1

    def wait_ready(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self._get("/v2/health/ready") == 200:
                return
            time.sleep(0.1)
        raise TimeoutError(f"tritonserver not ready after {timeout_s} s:\n{self.log_tail()}")

    def is_model_ready(self, name: str) -> bool:
        return self._get(f"/v2/models/{name}/ready") == 200

    def http_client(self, **kw):
        import tritonclient.http as httpclient

        kw.setdefault("connection_timeout", 600.0)
        kw.setdefault("network_timeout", 600.0)
        return httpclient.InferenceServerClient(self.http_url, **kw)

    def grpc_client(self):
        import tritonclient.grpc as grpcclient

        return grpcclient.InferenceServerClient(self.grpc_url)

    def stopped(self, doing: str, exc: BaseException | None = None) -> ServerStopped:
        """The ``ServerStopped`` of this server, while ``doing`` (e.g. "loading tensorrt_llm_ab12"), with the cause."""
        why = f" ({type(exc).__name__}: {str(exc)[:160]})" if exc is not None else ""
        self.gone = True  # later requests of this command fail at once (a frozen server would hold each one)
        return ServerStopped(f"the Triton server at {self.http_url} stopped answering while {doing}{why}.")

    def _post(self, path: str, body: bytes, timeout: float, doing: str) -> bytes:
        """POST ``body`` to ``path``; an HTTP error answer raises ``urllib.error.HTTPError``; no answer at all (refused,
        reset, closed without an answer, a timeout) ``ServerStopped``, as does every request after one did (``gone``)."""
        if getattr(self, "gone", False):
            raise self.stopped(doing)
        req = urllib.request.Request(f"http://{self.http_url}{path}", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.read()
        except urllib.error.HTTPError:
            raise
        except (OSError, http.client.HTTPException) as e:  # URLError and socket timeouts are OSErrors
            raise self.stopped(doing, e) from None

    def load(self, name: str, config: str | None = None, *, stall_s: float | None = None,
             progress_s: float | None = None) -> float:
        """Load (or reload) a model; returns seconds. Raises RuntimeError when the server refuses it (the old model
        keeps serving), ``ServerStopped`` when the server stops answering: the load request fails without an
        answer (it died: hostile s12 F-N), or ``/v2/health/live`` gets no answer for ``stall_s`` seconds
        (``LOAD_STALL_S`` by default: it froze, hostile s12 F-L; a load itself may take up to 900 s). A line
        on stderr every ``progress_s`` (``LOAD_PROGRESS_S``) seconds while it loads (a large unit loads for minutes)."""
        import threading

        t0, doing, box = time.perf_counter(), f"loading {name}", {}
        stall_s, progress_s = LOAD_STALL_S if stall_s is None else stall_s, LOAD_PROGRESS_S if progress_s is None else progress_s
        body = json.dumps({"parameters": {"config": config}} if config else {}).encode()

        def post():
            try:
                box["ok"] = self._post(f"/v2/repository/models/{name}/load", body,  # the request's own limit is
                                       self.load_timeout_s + LOAD_POST_SLACK_S, doing)  # later: its timeout is no stop
            except BaseException as e:  # handed to the waiting thread
                box["err"] = e

        worker = threading.Thread(target=post, name=f"load-{name}", daemon=True)  # left to the process's exit when
        worker.start()  # a frozen server never answers
        said, silent_since = t0, None
        while worker.is_alive():
            worker.join(LOAD_POLL_S)
            if not worker.is_alive():
                break
            now = time.perf_counter()
            if now - t0 >= self.load_timeout_s:  # a load that never ends (a stub that cannot start: hostile s16 H10)
                raise LoadNotFinished(f"loading {name} did not finish in {now - t0:.0f} s (the server keeps that load "
                                      "pending and queues every later load of it behind that one; its log says why)")
            if now - said >= progress_s:
                said = now
                print(f"  loading {name} on {self.http_url}: {now - t0:.0f} s ...", file=sys.stderr, flush=True)
            if self._get("/v2/health/live", timeout=LOAD_POLL_S) == 200:
                silent_since = None
            elif (silent_since := silent_since or now) and now - silent_since >= stall_s:
                raise self.stopped(doing + f" (no answer on /v2/health/live for {now - silent_since:.0f} s)")
        if isinstance(err := box.get("err"), urllib.error.HTTPError):
            raise RuntimeError(f"loading {name} failed ({err.code}): {err.read().decode(errors='replace')}") from None
        if err is not None:
            raise err
        return time.perf_counter() - t0

    def unload(self, name: str, wait_s: float = 120.0, post_s: float = 300.0) -> float:
        """Unload a model and wait (up to ``wait_s``) until it has left state UNLOADING, i.e. its instances
        (python-backend stubs) are gone and their memory is free; returns seconds. A line on stderr every
        ``LOAD_PROGRESS_S`` seconds while it waits, and one when it gives up (an instance whose process died stays
        UNLOADING: hostile s16 H5 waited 120 s in silence). ``post_s``: the unload request's own time limit.
        ``ServerStopped`` when the server does not answer."""
        t0 = time.perf_counter()
        try:
            self._post(f"/v2/repository/models/{name}/unload", b"{}", post_s, f"unloading {name}")
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"unloading {name} failed ({e.code}): {e.read().decode(errors='replace')}") from None
        deadline, said = time.monotonic() + wait_s, time.monotonic()
        while self.loaded_models().get(name) == "UNLOADING":
            now = time.monotonic()
            if now >= deadline:
                print(f"  {name} is still UNLOADING on {self.http_url} after {time.perf_counter() - t0:.0f} s (an instance that does not "
                      "exit, e.g. its process died); not waited on further: the server frees it when it can",
                      file=sys.stderr, flush=True)
                break
            if now - said >= LOAD_PROGRESS_S:
                said = now
                print(f"  unloading {name} on {self.http_url}: {time.perf_counter() - t0:.0f} s (waiting for its instances to exit) ...",
                      file=sys.stderr, flush=True)
            time.sleep(0.1)
        return time.perf_counter() - t0

    def model_config(self, name: str) -> dict | None:
        """The configuration the server uses for loaded model ``name`` (``GET /v2/models/<name>/config``,
        JSON), or None when it has no such model loaded. Raises OSError when the server does not answer."""
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/models/{name}/config", timeout=30) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            if e.code in (400, 404):
                return None
            raise

    def loaded_models(self) -> dict[str, str]:
        """{name: state} from the repository index."""
        return {m["name"]: m.get("state", "") for m in json.loads(self._post("/v2/repository/index", b"{}", 30,
                                                                              "reading its repository index"))}

    def stop(self, timeout_s: float = 30, say=None) -> int | None:
        """Unload every loaded model (all at once, each given ``STOP_UNLOAD_S``), SIGTERM, wait ``timeout_s``; SIGKILL
        the process group if it does not exit in time, and what is left of its group once it has (backend stubs that
        were still starting). ``say`` (e.g. ``print``): told each step that may wait (`invoke serve`'s stop of a server
        with a load Triton keeps pending took 62 s after "stopping", in silence: hostile s17c H17)."""
        if self.proc is None:
            return None
        say = say or (lambda text: None)
        if self.proc.poll() is None:
            # Unload first so every python-backend stub exits gracefully; then SIGTERM. The unloads run side by
            # side: each waits 1-2.5 s for its stubs to exit (measured on 2 cores), one after the other ~9 s for 5.
            with contextlib.suppress(Exception):
                from concurrent.futures import ThreadPoolExecutor

                names = [name for name, state in self.loaded_models().items() if state == "READY"]
                say(f"  unloading {len(names)} models (each at most {STOP_UNLOAD_S:.0f} s, side by side) ...")
                pool = ThreadPoolExecutor(max_workers=max(1, len(names)))
                futs = [pool.submit(self.unload, name, STOP_UNLOAD_S, STOP_UNLOAD_S) for name in names]
                for fut in futs:  # an instance that never exits (blocked: hostile s16 H13c) is not waited on for minutes
                    with contextlib.suppress(Exception):
                        fut.result(STOP_UNLOAD_S + 5)
                pool.shutdown(wait=False)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(min(timeout_s, LOAD_PROGRESS_S))
            except subprocess.TimeoutExpired:
                say(f"  tritonserver (pid {self.proc.pid}) has not exited {min(timeout_s, LOAD_PROGRESS_S):.0f} s after "
                    f"SIGTERM (a model load or unload it waits on?); SIGKILL in {max(0.0, timeout_s - LOAD_PROGRESS_S):.0f} s")
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(max(0.0, timeout_s - LOAD_PROGRESS_S))
            if self.proc.poll() is None:
                say(f"  tritonserver (pid {self.proc.pid}): SIGKILL")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        with contextlib.suppress(ProcessLookupError, PermissionError):  # backend stubs still starting when it exited
            os.killpg(self.proc.pid, signal.SIGKILL)  # stay in its process group, orphaned (hostile s15c T144)
        clean_stale_shm(self.shm_token, min_age_s=0.0)
        if self._own_log and self.proc.returncode == 0 and self.log_file is not None:
            with contextlib.suppress(OSError):
                self.log_file.unlink()
        return self.proc.returncode

    def __enter__(self) -> "TritonServer":
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _mapped_shm() -> set[str]:
    """Names under /dev/shm that some process (whose maps this user can read) has mapped."""
    names = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            i = line.find("/dev/shm/")
            if i >= 0:
                names.add(line[i + len("/dev/shm/"):].removesuffix(" (deleted)").strip())
    return names


def clean_stale_shm(token: str = "", *, min_age_s: float = SHM_MIN_AGE_S, shm_dir: Path = Path("/dev/shm")) -> list[str]:
    """Remove the python backend's shared-memory regions ``<shm_dir>/<SHM_PREFIX><token>*`` that no
    process maps and that are at least ``min_age_s`` old (left by servers killed with -9: a server
    stopped with SIGTERM removes its own). Returns the names removed; never raises."""
    removed = []
    try:
        found = [p for p in shm_dir.glob(f"{SHM_PREFIX}{token}*") if p.is_file()]
    except OSError:
        return removed
    if not found:
        return removed
    mapped = _mapped_shm()
    now = time.time()
    for p in found:
        try:
            st = p.stat()
            if p.name in mapped or now - max(st.st_mtime, st.st_ctime) < min_age_s:
                continue
            p.unlink()
            removed.append(p.name)
        except OSError:
            continue
    return removed


def models_to_load(model_repository: Path) -> list[str]:
    """The models a server should load: the current release's (releases.json) or, for a packed
    repository without releases, every model directory (one engine unit)."""
    from precision_pipeline.serving import release_state

    repo = Path(model_repository)
    state = release_state.read_state(repo)
    if state and state.get("current"):
        return release_state.serving_models(repo, state)
    names = sorted(p.name for p in repo.iterdir() if (p / "config.pbtxt").is_file())
    order = {"preprocessing": 0, "postprocessing": 1, "ensemble": 9, "tensorrt_llm_bls": 9}
    return sorted(names, key=lambda n: (order.get(n, 5), n))


HEAL_EVERY_S = 5.0
"""How often ``invoke serve`` makes its server and repository agree with releases.json when no release command holds
the lock (``release_recover.heal``): a command killed mid-switch is repaired within this many seconds."""

STOP_UNLOAD_S = 15.0
"""How long ``TritonServer.stop`` waits for each model's unload (side by side) before SIGTERM: an instance blocked for
good made `invoke serve`'s stop silent for ~140 s (hostile s16 H13c); the signals end what is left."""

HEAL_LOAD_S = 60.0
"""How long a load by ``invoke serve``'s watchdog may take (it holds the releases lock meanwhile): a model that never
leaves LOADING (its stub cannot start: hostile s16 H10) is given up, and release commands get the lock."""

SERVER_DIED_EXIT = 1
"""Exit status of ``invoke serve`` when its tritonserver ends on its own (killed, crashed): an
unexpected failure, reported with the server's log tail and no traceback."""


def _run_until_stopped(srv: "TritonServer", repo: Path, heal: bool) -> int | None:
    """Block while ``srv`` runs, healing ``repo`` every ``HEAL_EVERY_S`` s (``heal``: ``release_recover.heal``, what it
    repaired printed); stop the server on Ctrl-C, SIGTERM or SIGHUP. Returns its exit status when it ended on its
    own, None when it was stopped."""
    from precision_pipeline.serving import release_recover, release_state
    from precision_pipeline.serving.serve_watchdog import (revive_dead_instances, say_disagreements, say_stalled_rollout,
                                                           server_stopped)

    died, seen, said = None, {}, set()
    srv.load_timeout_s = HEAL_LOAD_S  # from now on its loads are the watchdog's, under the lock: never without end
    try:
        with terminate_as_interrupt():  # SIGTERM/SIGHUP of the task: stop the server like Ctrl-C does
            next_heal = time.monotonic() + HEAL_EVERY_S
            while srv.proc.poll() is None:
                time.sleep(0.5)
                if time.monotonic() < next_heal:
                    continue
                next_heal = time.monotonic() + HEAL_EVERY_S
                if server_stopped(srv.proc.pid, said):
                    continue
                srv.gone = False  # it runs: a pass starts afresh (s17 X3: a timeout while it was stopped kept every
                # later pass failing at once, and the watchdog silent, for good)
                fixed = release_recover.heal(repo, srv) if heal else say_disagreements(repo, said)
                say_stalled_rollout(repo, said)
                with contextlib.suppress(UserError, OSError, RuntimeError):  # a release command holds the lock: later
                    with release_state.lock(repo, timeout_s=0) if heal else contextlib.nullcontext():
                        fixed += revive_dead_instances(srv, seen)
                for f in fixed:
                    print(f"[serve] repaired: {f}", flush=True)
            died = srv.proc.returncode
    except KeyboardInterrupt:
        print("stopping (SIGTERM) ...", flush=True)
    finally:
        srv.stop(say=lambda text: print(text, flush=True))
    return died


def serve_log_path(http_port: int) -> Path:
    """``invoke serve``'s server log: one file per HTTP port under the cache (``logs/tritonserver-<port>.log``),
    rewritten by each serve on that port, so logs neither pile up nor need a writable repository."""
    return cache_dir() / "logs" / f"tritonserver-{int(http_port)}.log"


def _read_only_check(repo: Path, err: OSError) -> str:
    """serve() of a repository it cannot write (``err``): fine when the files already agree with
    releases.json (nothing to recover); UserError naming what would need fixing otherwise. Returns a note."""
    from precision_pipeline.serving import release_configs, release_state

    state = release_state.read_state(repo)
    if not state or not state.get("current"):
        return f"note: {repo.parent} is read-only ({err.strerror}); serving it as it is"
    cur = state["current"]
    problems = []
    if not (repo / cur / "config.pbtxt").is_file():
        problems.append(f"the current release {cur} is missing")
    ens, bls = release_configs.current_of_configs(repo)
    if not release_configs.configs_agree(repo, cur):
        problems.append(f"ensemble/BLS name {ens}/{bls}, releases.json {cur} (an interrupted change)")
    if state.get("rollout"):
        problems.append(f"a rollout of {state['rollout'].get('candidate')} is recorded as in progress")
    if problems:
        raise UserError("--repo", f"{repo} is read-only ({err.strerror}: {err.filename}) and needs a recovery "
                        f"before it can be served: {'; '.join(problems)}.",
                        "serve it once where it is writable (serve recovers it), or copy it to a writable place.")
    return (f"note: {repo.parent} is read-only ({err.strerror}); it agrees with releases.json ({cur}), so it is "
            "served as it is")


def _refuse_unservable(repo: Path, names: list[str]) -> None:
    """Before serve starts tritonserver on ``repo`` with models ``names``: UserError on ``--repo`` (exit 2, nothing
    started) when a unit's file changed since its install (``release_units.check_sizes``) or an entry model's file is
    gone (``release_units.entry_model_problems``: its load would never finish, hostile s17c H16)."""
    from precision_pipeline.serving import release_state, release_units

    release_units.check_sizes(repo, names, release_state.read_state(repo), "--repo")
    if gone := release_units.entry_model_problems(repo, [n for n in names if n in release_units.ENTRY_FILES]):
        raise UserError("--repo", f"{'; '.join(gone.values())}: tritonserver would never finish loading "
                        f"{', '.join(gone)} (its python stub cannot start; hostile s17c H16); nothing was started.",
                        "restore the file(s) as said, then start serve again.")


def serve(model_repository: Path, *, http_port: int = 8000, grpc_port: int = 8001, metrics_port: int = 8002,
          models: Iterable[str] | None = None, block: bool = True, log_file: Path | None = None) -> TritonServer:
    """Start tritonserver on ``model_repository``, print the endpoints, and (``block``) run until Ctrl-C,
    SIGTERM or SIGHUP (then the server is stopped and this returns).

    A read-only repository is served as it is when its files agree with releases.json (UserError
    when it would need a recovery). A repository whose path Triton's Python stubs cannot start from
    (core/outputs.py ``serving_path_problem``: a space, non-ASCII, shell characters) is refused on ``--repo``
    before anything starts. Raises ``PipelineError`` (exit ``SERVER_DIED_EXIT``, the log tail
    in the message) when the server ends on its own while blocking."""
    import errno as _errno

    from precision_pipeline.core.errors import PipelineError
    from precision_pipeline.core.outputs import SERVING_PATH_CHARS, check_serving_path
    from precision_pipeline.serving import release_recover

    repo = Path(model_repository)
    if not repo.is_dir():
        raise UserError("--repo", f"{repo} does not exist.", f"create it with `invoke promote --profile P --repo {repo}` "
                        "(a serving repository), or serve a build's output (`invoke build --profile P`, then "
                        "`invoke serve --profile P`).")
    check_serving_path(repo.resolve(), "--repo", f"serve a repository at a path of {SERVING_PATH_CHARS} (promote into such a "
                       "--repo: promote refuses the others), or move this one back where it was made; nothing was started.")
    check_distinct_ports((("--http-port", http_port), ("--grpc-port", grpc_port), ("--metrics-port", metrics_port)))
    from precision_pipeline.serving.release_live import refuse_copied_repository

    refuse_copied_repository(repo, "a server of it would load the original's files (its units' gpt_model_path), and "
                             "a change to the original would not know of it; nothing was started.")
    if live := servers_of(repo):  # before the recovery: that would rewrite the files the other one serves
        pid, at = live[0]
        raise UserError("--repo", f"tritonserver (pid {pid}) already serves {repo.resolve()} at {at}; a second server of "
                        "one repository would not follow a promote or rollback made through the first (its BLS, which "
                        "reads the shared route.json, would send requests to a unit it never loaded); nothing was "
                        "started.", f"use that server (--url {at}), or stop it first (kill {pid}); to scale, give each "
                        "server its own repository (promote into each).")
    note = None
    try:
        if os.statvfs(repo.resolve().parent).f_flag & os.ST_RDONLY:  # a read-only mount: not even the lock can be
            # opened for writing (hostile s15 F14: refused at the lock, never reaching the read-only check)
            raise OSError(_errno.EROFS, os.strerror(_errno.EROFS), str(repo.resolve().parent))
        release_recover.recover(repo)
    except OSError as e:
        if e.errno not in (_errno.EROFS, _errno.EACCES, _errno.EPERM):
            raise
        note = _read_only_check(repo, e)
    names = list(models) if models is not None else models_to_load(repo)
    _refuse_unservable(repo, names)
    srv = TritonServer(repo, names, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
                       log_file=log_file or serve_log_path(http_port), trace_url=repository_traces_url(repo))
    if log_file is None:
        srv.log_mode = "wb"
        srv.log_file.parent.mkdir(parents=True, exist_ok=True)
    if note:
        print(note, flush=True)
    print(f"starting tritonserver {SERVER_VERSION} (CPU reference stand-in for tensorrtllm) on {repo} ...", flush=True)
    try:
        srv.start()
    except (RuntimeError, TimeoutError) as e:  # it exited or never became ready: its log says why
        raise PipelineError(f"tritonserver did not start on {repo}: {e}\nLog: {srv.log_file}") from None
    print(f"ready in {srv.start_s:.1f} s; models: {', '.join(names)}")
    print(f"  HTTP    http://{srv.http_url}/v2/models/ensemble/generate")
    print(f"  gRPC    {srv.grpc_url}")
    print(f"  metrics http://127.0.0.1:{srv.metrics_port}/metrics")
    print(f"  log     {srv.log_file}")
    if srv.trace_url:
        print(f"  traces  {srv.trace_url} (Triton's and the BLS's spans, OTLP/HTTP)")
    if not block:
        return srv

    died = _run_until_stopped(srv, repo, heal=note is None)  # a read-only repository is not healed
    if died is not None:
        how = f"was killed by signal {-died}" if died < 0 else f"exited with status {died}"
        raise PipelineError(f"tritonserver {how} while serving {repo}; nothing serves on port {srv.http_port} now. "
                            f"Log {srv.log_file}, last lines:\n{srv.log_tail()}")
    return srv
