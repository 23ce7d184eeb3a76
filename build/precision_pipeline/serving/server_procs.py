"""The tritonserver processes of this machine, read from ``/proc`` (Linux): which repository each serves, at which
HTTP endpoint and metrics port, and in what process state. The one home of "which servers run here" (``serve`` refuses a
second server of a repository, ``--url`` changes refuse while another serves it, ``attach`` names a local server that
does not answer, a rollout checks its ``--metrics-port``). Moved out of ``serving/triton_server.py``, which re-exports
these names."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
from pathlib import Path

from precision_pipeline.core.store import process_state  # noqa: F401  (the one home; re-exported)


def server_processes(proc: Path = Path("/proc")) -> list[tuple[int, str, str]]:
    """``[(pid, repository, "HOST:PORT")]`` of the tritonserver processes on this machine: each ``--model-repository``
    (or ``--model-store``; ``=value`` or a separate value: ``_server_options``) each serves, one row each (resolved: symlinks, and a relative path against the process's working directory) and its HTTP
    endpoint (``--http-address`` / ``--http-port``, tritonserver's defaults 0.0.0.0 -> 127.0.0.1 and 8000). Read from
    ``/proc/<pid>/cmdline`` (Linux; [] where there is no ``proc``): the live processes themselves, so no pid file can
    go stale. A process is a tritonserver when its argv[0] or its executable (``/proc/<pid>/exe``) is named so
    (hostile s16 H1: started through a symlink ``tritonserver-2.51``, ``exec -a`` or a wrapper's ``exec``), or when it
    is given a model repository and has Triton's core library mapped (a renamed copy of the binary: s16b F1). The one home of "which servers run here" (``servers_of``, ``other_servers``, ``repository_at``)."""
    found = []
    for d in proc.glob("[0-9]*"):
        try:
            argv = (d / "cmdline").read_bytes().decode("utf-8", "replace").split("\0")
        except OSError:  # ended meanwhile, or not ours to read
            continue
        if not argv or not _is_tritonserver(d, argv):
            continue
        opts = _server_options(argv[1:])
        host = (opts.get("http-address") or ["0.0.0.0"])[-1]
        at = f"{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{(opts.get('http-port') or ['8000'])[-1]}"
        for served in opts.get("model-repository", []) + opts.get("model-store", []) or [""]:
            with contextlib.suppress(OSError):  # a relative path is relative to the server's working directory
                served = os.path.realpath(os.path.join(os.readlink(d / "cwd"), served)) if served else served
            found.append((int(d.name), served.rstrip("/"), at))
    return sorted(found)


def backend_stubs(server_pid: int, proc: Path = Path("/proc")) -> dict[str, int]:
    """``{model instance name: pid}`` of the live python-backend stub processes (``triton_python_backend_stub``) of
    the tritonserver ``server_pid``: one per instance of a python-backend model (the BLS, pre/postprocessing, the CPU
    stand-in of a unit). Their argv, as Triton 2.51's python backend starts them (read from /proc/<pid>/cmdline on
    this machine): stub, model.py, shm region, shm default size, shm growth size, parent pid, backend directory, IPC
    handle, instance name (``<model>_<group>_<index>``), runtime model directory. A dead stub not yet reaped (a
    zombie: empty cmdline) is not listed. {} where there is no ``proc``."""
    found: dict[str, int] = {}
    for d in proc.glob("[0-9]*"):
        try:
            argv = (d / "cmdline").read_bytes().decode("utf-8", "replace").split("\0")
        except OSError:
            continue
        if len(argv) > 8 and Path(argv[0]).name == "triton_python_backend_stub" and argv[5] == str(server_pid):
            found[argv[8]] = int(d.name)
    return found


def _is_tritonserver(d: Path, argv: list[str]) -> bool:
    """Whether the process of ``/proc/<pid>`` folder ``d`` with command line ``argv`` is a tritonserver: argv[0] or
    ``exe`` named ``tritonserver``; else, when it has a ``--model-repository``/``--model-store`` option, whether
    ``/proc/<pid>/maps`` maps Triton's core library (``libtritonserver*.so``, which the tritonserver binary links
    whatever its file is called)."""
    if "tritonserver" in (Path(argv[0]).name, _exe_name(d)):
        return True
    if not any(a.startswith(("--model-repository", "--model-store")) for a in argv[1:]):
        return False
    try:
        return "/libtritonserver" in (d / "maps").read_text(errors="replace")
    except OSError:
        return False


def _exe_name(d: Path) -> str:
    """The file name of ``/proc/<pid>/exe`` (the executable itself, whatever argv[0] says); '' when unreadable."""
    try:
        return Path(os.readlink(d / "exe")).name
    except OSError:
        return ""


def local_metrics_port(http_url: str, proc: Path = Path("/proc")) -> tuple[int, int] | None:
    """``(pid, metrics port)`` of the tritonserver of this machine listening at ``http_url`` (``server_processes``;
    its ``--metrics-port``, tritonserver's default 8002); None when no local process listens there (a remote server)."""
    for pid, _repo, at in server_processes(proc):
        if same_endpoint(at, http_url):
            try:
                argv = (proc / str(pid) / "cmdline").read_bytes().decode("utf-8", "replace").split("\0")
            except OSError:
                return None
            port = (_server_options(argv[1:]).get("metrics-port") or ["8002"])[-1]
            return (pid, int(port)) if port.isdigit() else None
    return None


def _server_options(args: list[str]) -> dict[str, list[str]]:
    """tritonserver's long options as ``{name: [values]}``: ``--name=value`` and ``--name value`` (its getopt_long
    parser takes both; hostile s15 F2b: a server started by hand as ``--model-repository repo`` was not seen as one of
    the repository's), a name given twice keeping both (``--model-repository`` may repeat)."""
    out: dict[str, list[str]] = {}
    i = 0
    while i < len(args):
        a = args[i]
        if a.startswith("--") and "=" in a:
            k, v = a[2:].split("=", 1)
            out.setdefault(k, []).append(v)
        elif a.startswith("--") and len(a) > 2 and i + 1 < len(args) and not args[i + 1].startswith("--"):
            out.setdefault(a[2:], []).append(args[i + 1])
            i += 1
        i += 1
    return out


def servers_of(model_repository: Path, proc: Path = Path("/proc")) -> list[tuple[int, str]]:
    """``[(pid, "HOST:PORT")]`` of the tritonserver processes on this machine that serve ``model_repository``
    (``server_processes``). Used to refuse a promote or rollback without ``--url`` while a server serves the
    repository (hostile s8 #56: only the files switched, the server kept serving the old unit), and a second
    ``serve`` of it (hostile s12 F-Q)."""
    want = str(Path(model_repository).resolve())
    return [(pid, at) for pid, served, at in server_processes(proc) if served == want or same_directory(served, want)]


def same_directory(a: str, b: str) -> bool:
    """Whether paths ``a`` and ``b`` are one directory by identity (``st_dev``, ``st_ino``), not only by name: the
    same volume bind-mounted at two paths (ordinary in containers) is one repository (hostile s15 F2: a second
    server of it through the other mount point was started, and a promote through the first broke its BLS). False
    when either cannot be read."""
    try:
        sa, sb = os.stat(a), os.stat(b)
    except (OSError, ValueError):
        return False
    return stat.S_ISDIR(sa.st_mode) and (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def _host_key(host: str) -> str:
    """``host`` as an address to compare endpoints by: every loopback name (localhost, 127.x, 0.0.0.0) is 127.0.0.1;
    one that does not resolve (an IPv6 literal among them) as written."""
    with contextlib.suppress(OSError):
        ip = socket.gethostbyname(host.strip("[]")) if host.strip("[]") else "127.0.0.1"
        return "127.0.0.1" if ip.startswith("127.") or ip == "0.0.0.0" else ip
    return host.strip("[]")


def same_endpoint(a: str, b: str) -> bool:
    """Whether ``HOST:PORT`` ``a`` and ``b`` name one endpoint (the port the same, the hosts one address)."""
    return a.rpartition(":")[2] == b.rpartition(":")[2] and _host_key(a.rpartition(":")[0]) == _host_key(b.rpartition(":")[0])


def other_servers(model_repository: Path, http_url: str, proc: Path = Path("/proc")) -> list[tuple[int, str]]:
    """``servers_of(model_repository)`` but the one at ``http_url`` (``--url``): a server that a change through
    ``--url`` would not switch (hostile s12 F-Q: the other's BLS then routed to a unit it never loaded, HTTP 400)."""
    return [(pid, at) for pid, at in servers_of(model_repository, proc) if not same_endpoint(at, http_url)]


def repository_at(http_url: str, proc: Path = Path("/proc")) -> str | None:
    """The repository the tritonserver of this machine at ``http_url`` serves (``server_processes``); None when
    no local tritonserver listens there (a remote server, or one in a container)."""
    return next((served for _pid, served, at in server_processes(proc) if same_endpoint(at, http_url)), None)
