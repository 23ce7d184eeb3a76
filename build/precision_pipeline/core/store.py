"""Artifact store: content hashing, atomic writes and directory swaps, and locks.

Every stage writes its artifact directory aside (``<dir>.tmp-<pid>``) and renames it into
place, so a crash mid-stage leaves the previous artifact intact. A stage's *content key* is
the sha256 of the strict canonical JSON of its inputs (``canonical``: unknown types are a
TypeError, never hashed by their ``str()``); the runner in ``core/stage.py`` computes it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import shutil
import socket
import stat as stat_mod
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

from filelock import FileLock

_CHUNK = 1 << 20


def canonical(obj: Any, where: str = "$") -> Any:
    """The strict canonical form of ``obj``: plain JSON values only, or ``TypeError``.

    Allowed: None, bool, int, finite float, str, list/tuple (-> list), dict with str keys,
    enums (-> their value), pydantic models (-> their fields, by name, less those named in the model's
    ``unkeyed`` class attribute, each with the reason it must not change a key (``core.stage.Frozen.unkeyed``); a model with a ``canonical()`` method, such as
    ``core.fingerprint.Fingerprint``, is replaced by what that returns). Anything else -- a Path outside a
    Fingerprint, a set, bytes, NaN or infinity, an
    arbitrary object -- raises ``TypeError`` naming the path of the value (``$.inputs.model``),
    so nothing is ever hashed by its ``str()``.
    """
    from enum import Enum

    from pydantic import BaseModel

    if isinstance(obj, Enum):
        return canonical(obj.value, where)
    if obj is None or isinstance(obj, bool):
        return obj
    if isinstance(obj, str):
        return str(obj)
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        if not math.isfinite(obj):
            raise TypeError(f"{where}: {obj!r} is not a finite float; keys hash only finite numbers")
        return obj
    if isinstance(obj, (list, tuple)):
        return [canonical(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: dict key {k!r} is a {type(k).__name__}, not a str")
            out[k] = canonical(v, f"{where}.{k}")
        return out
    if isinstance(obj, BaseModel):
        custom = getattr(obj, "canonical", None)
        if callable(custom):
            return canonical(custom(), where)
        unkeyed_names = getattr(type(obj), "unkeyed", None) or {}  # Frozen.unkeyed: name -> reason
        return {name: canonical(getattr(obj, name), f"{where}.{name}") for name in type(obj).model_fields
                if name not in unkeyed_names}
    raise TypeError(f"{where}: {type(obj).__module__}.{type(obj).__qualname__} is not a canonical type "
                    "(None, bool, int, finite float, str, list, dict with str keys, enum, pydantic model, "
                    "Fingerprint for paths)")


def canonical_json(obj: Any) -> str:
    """JSON of ``canonical(obj)`` with sorted keys and no whitespace variation (the form that is hashed).

    Raises TypeError for any value ``canonical`` refuses."""
    return json.dumps(canonical(obj), sort_keys=True, separators=(",", ":"), allow_nan=False)


def hash_obj(obj: Any) -> str:
    """sha256 hex digest of ``canonical_json(obj)`` (TypeError for non-canonical values)."""
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()


def hash_file(path: Path) -> str:
    """sha256 hex digest of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def hash_dir(path: Path, exclude: tuple[str, ...] = (), suffixes: tuple[str, ...] | None = None) -> str:
    """sha256 over the relative paths and contents of every regular file under ``path``.

    Files whose top-level name is in ``exclude`` are skipped; with ``suffixes`` only files
    whose name ends with one of them are hashed. Order-independent of the
    filesystem (paths are sorted).
    """
    path = Path(path)
    h = hashlib.sha256()
    for p in sorted(q for q in path.rglob("*") if q.is_file()):
        rel = p.relative_to(path).as_posix()
        if rel.split("/")[0] in exclude or (suffixes is not None and not p.name.endswith(suffixes)):
            continue
        h.update(rel.encode() + b"\0")
        h.update(hash_file(p).encode())
    return h.hexdigest()


def current_umask() -> int:
    """The process's umask, read without changing it where Linux shows it (``/proc/self/status``
    ``Umask:``, kernel >= 4.7); elsewhere set and restored at once (``os.umask`` has no getter)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def make_readable(root: Path) -> None:
    """Give every file and folder under ``root`` (and ``root``) the read (folders: read + search) bits the
    umask allows, keeping the bits it has: a file that arrived 0600 (``mkstemp``, a hard link of one)
    becomes 0644 under umask 022, so a server running as another user can read the tree."""
    mask = current_umask()
    for p in [Path(root), *Path(root).rglob("*")]:
        if p.is_symlink():
            continue
        mode = p.stat().st_mode
        add = (0o555 if p.is_dir() else 0o444) & ~mask
        if mode & add != add:
            os.chmod(p, (mode & 0o7777) | add)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically (``atomic_write_bytes``)."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temp file in the same directory + rename); its mode follows
    the umask (0644 under the usual 022), as a file ``open()`` creates."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~current_umask())  # mkstemp makes 0600; a written file follows the umask as open() does
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(e, OSError) and not e.filename:  # write() on a full disk names no file: name the target
            e.filename = str(path)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    """``atomic_write_text`` of ``obj`` as indented, key-sorted JSON."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


SWAP_JOURNAL = ".swap.json"
"""Suffix of a directory swap's journal, ``.<name>.swap.json`` beside the target (see ``atomic_dir``)."""

CRASH_ENV = "PRECISION_STORE_CRASH_AT"
"""Test hook: ``PRECISION_STORE_CRASH_AT=<step>`` makes ``atomic_dir`` exit the process (status
``CRASH_EXIT``) right after that step of a swap (``SWAP_STEPS``), as a kill there would."""
CRASH_EXIT = 97
SWAP_STEPS = ("journal", "swap", "commit")


def _crash_point(step: str) -> None:
    if os.environ.get(CRASH_ENV) == step:
        os._exit(CRASH_EXIT)


def _journal_path(target: Path) -> Path:
    return target.parent / f".{target.name}{SWAP_JOURNAL}"


def _dir_id(path: Path) -> list[int]:
    """[st_dev, st_ino] of a folder: a rename keeps both, so it names the new copy wherever it moved."""
    st = os.stat(path)
    return [st.st_dev, st.st_ino]


def _is_copy(target: Path, tmp_id: Any) -> bool:
    """Whether ``target`` is the journal's new copy (its ``tmp_id``), i.e. the rename onto it happened."""
    try:
        return isinstance(tmp_id, list) and target.is_dir() and _dir_id(target) == tmp_id
    except OSError:
        return False


def _finish_swap(parent: Path, journal: dict, crash: Callable[[str], None]) -> None:
    """Roll a journaled swap forward: the complete new copy becomes ``target``, then the commit files are
    written, then the journal is removed (the commit), then the old copy is deleted. Idempotent.

    When the new copy is neither at its temporary name nor at ``target`` (the journal's ``tmp_id``: device and
    inode of the copy, which a rename keeps), it was removed after a kill: the swap is dropped instead, the
    previous copy stays (or is put back from ``old``) and no commit file is written."""
    target = parent / journal["target"]
    tmp = parent / journal["tmp"]
    old = parent / journal["old"]
    if tmp.is_dir():
        if target.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(target, old)
        crash("swap")
        os.replace(tmp, target)
    elif not _is_copy(target, journal.get("tmp_id")):
        # the new copy is gone and the target is not it (someone removed the temporary folder after a kill):
        # the swap never happened. Keep (or put back) the previous copy and write none of the commit files, so
        # no record ever describes a folder that is not there.
        if not target.exists() and old.is_dir():
            os.replace(old, target)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_journal_path(target))
        return
    for rel, obj in (journal.get("files") or {}).items():
        atomic_write_json(parent / rel, obj)
    crash("commit")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_journal_path(target))
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(target: Path, commit_files: Optional[dict[Path, Any]] = None,
               crash: Optional[Callable[[str], None]] = None) -> Iterator[Path]:
    """Yield a fresh temporary directory (mode per the umask: 0755 under 022); on success it replaces
    ``target``, recoverably.

    On an exception the temporary directory is removed and ``target`` is left untouched.
    The swap, once the body has returned:

    1. write the journal ``.<name>.swap.json`` beside ``target`` (the mark that the temporary copy
       is complete; it names the copies and the ``commit_files`` to write);
    2. rename ``target`` to ``.<name>.old-<pid>`` (when it exists), 3. rename the temporary copy to
       ``target``; 4. write each of ``commit_files`` ({path in ``target.parent``'s tree: JSON
       object}, e.g. the stage record that describes the new folder) atomically; 5. remove the
       journal (the commit); 6. delete the old copy.

    A kill before step 1 leaves the previous ``target`` (the incomplete copy is removed by
    ``clean_stale``); a kill after it is rolled forward by ``clean_stale`` (``recover_swaps``): no
    state ever has no ``target`` with both copies deleted. ``crash``: test hook called with each
    of ``SWAP_STEPS`` (default: the ``PRECISION_STORE_CRASH_AT`` environment hook).
    """
    target = Path(target)
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    crash = crash or _crash_point
    tmp = Path(tempfile.mkdtemp(dir=parent, prefix=f".{target.name}.tmp-"))
    os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes 0700; the folder becomes target: follow the umask
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    files = {}
    for path, obj in (commit_files or {}).items():
        rel = os.path.relpath(Path(path), parent)
        if rel.startswith(".."):
            raise ValueError(f"commit file {path} is outside {parent}")
        files[rel] = obj
    journal = {"target": target.name, "tmp": tmp.name, "old": f".{target.name}.old-{os.getpid()}", "files": files,
               "tmp_id": _dir_id(tmp)}
    try:
        atomic_write_json(_journal_path(target), journal)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    crash("journal")
    _finish_swap(parent, journal, crash)


def recover_swaps(parent: Path, names: Optional[Iterable[str]] = None) -> list[str]:
    """Finish the directory swaps a kill interrupted in ``parent`` (their journals, see ``atomic_dir``).

    Each journaled swap is rolled forward (its complete copy becomes the target, its commit files are
    written). ``names``: only swaps of these target names. Returns the target names recovered."""
    parent = Path(parent)
    if not parent.is_dir():
        return []
    wanted = None if names is None else set(names)
    done = []
    for j in sorted(parent.glob(f".*{SWAP_JOURNAL}")):
        name = j.name[1:-len(SWAP_JOURNAL)]
        if wanted is not None and name not in wanted:
            continue
        try:
            journal = json.loads(j.read_text())
            ok = isinstance(journal, dict) and journal.get("target") == name and all(
                isinstance(journal.get(k), str) and journal[k].startswith(f".{name}.") and "/" not in journal[k]
                for k in ("tmp", "old"))
        except (OSError, ValueError):
            ok = False
        if not ok:  # a journal we did not write completely: atomic_write_json makes this impossible
            continue
        _finish_swap(parent, journal, lambda step: None)
        done.append(name)
    return done


def clean_stale(parent: Path, names: Optional[Iterable[str]] = None) -> list[str]:
    """Recover interrupted swaps (``recover_swaps``), then remove leftovers of interrupted atomic
    writes (``.NAME.tmp-*`` / ``.NAME.old-*``, and ``..NAME.tmp-*`` of a swap into such a copy) in ``parent``. ``names``: only leftovers of these
    targets (a build output passes its stage folders, so no other dot-file is ever touched).
    Returns the names removed."""
    parent = Path(parent)
    if not parent.is_dir():
        return []
    wanted = None if names is None else tuple(names)
    recover_swaps(parent, wanted)
    removed = []
    for p in parent.iterdir():
        n = p.name
        if not (n.startswith(".") and (".tmp-" in n or ".old-" in n)):
            continue
        # ``..NAME.tmp-*``: the copies and journal of a swap whose target was itself a temporary copy (a folder the
        # stage wrote with atomic_dir inside its own temporary folder; hostile s15b F3: 210 MB left per killed build)
        if wanted is not None and not any(n.startswith((f".{w}.tmp-", f".{w}.old-", f"..{w}.tmp-", f"..{w}.old-"))
                                          for w in wanted):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        removed.append(n)
    return removed


LOCK_INFO_SUFFIX = ".json"
"""The lock's sidecar, ``<lock>.json``: who holds it (``pid``, ``host``, ``since``, ``what``)."""


def lock_holder(path: Path) -> dict:
    """What the sidecar of lock ``path`` says about its holder ({} when unknown)."""
    info = read_json_safe(Path(str(path) + LOCK_INFO_SUFFIX))
    return info if isinstance(info, dict) else {}


def process_state(pid: int, proc: Path = Path("/proc")) -> str:
    """Process ``pid``'s state as ``ps`` shows it (``/proc/<pid>/stat`` field 3: ``T (stopped)``, ``S (sleeping)``,
    ``D (disk sleep)``, ...); ``unknown`` when it cannot be read."""
    names = {"R": "running", "S": "sleeping", "D": "disk sleep", "T": "stopped", "t": "tracing stop", "Z": "zombie"}
    try:
        code = (proc / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "unknown"
    return f"{code} ({names.get(code, '?')})"


def describe_holder(info: dict) -> str:
    """``pid 123 on host x since 2026-01-01T10:00:00 (invoke build ...)``, or ``an unknown process``."""
    if not info.get("pid"):
        return "an unknown process"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["since"])) if isinstance(info.get("since"), (int, float)) else "?"
    what = f" ({info['what']})" if info.get("what") else ""
    stopped = ""  # hostile s15c T100/T106: a stopped holder was waited on in silence
    if info.get("host") == socket.gethostname() and str(info["pid"]).isdigit() and process_state(int(info["pid"]))[0] in "Tt":
        stopped = f", STOPPED (resume it: kill -CONT {info['pid']})"
    return f"pid {info['pid']} on {info.get('host', '?')} since {since}{what}{stopped}"


class _DirLock:
    """An exclusive ``flock(2)`` on a folder's own file descriptor (Linux/BSD allow flock on a directory fd).

    Unlike a lock *file*, it cannot be sidestepped by deleting a file: the folder cannot be removed while
    it holds the build's files, and a new process locks the same inode. Released when closed or when the
    process dies (the kernel drops flock locks with the last descriptor)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.fd: Optional[int] = None

    def try_acquire(self) -> bool:
        import fcntl

        fd = os.open(self.folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        except OSError as e:
            import errno

            os.close(fd)
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):  # a filesystem without flock (some NFS)
                return True  # the lock file alone, as before
            raise
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        return True

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the last descriptor drops the flock
            self.fd = None


def _lock_file_fix(path: Path, e: OSError) -> str:
    """The fix for a lock file ``path`` that cannot be opened (``e``), by what is there (hostile s17c F5: an
    immutable file and a link to a missing target were both told to use a writable folder)."""
    import errno

    if path.is_symlink():
        return (f"{path} is a symbolic link to {os.readlink(path)}, which cannot be opened: remove the link (rm {path}; "
                "the lock holds no data) and run this again.")
    if path.is_file() and e.errno in (errno.EPERM, errno.EACCES):
        return (f"make {path} writable for this user (`ls -l`, `lsattr`: chmod u+w, chattr -i), or remove it (it holds "
                "no data) and run this again.")
    if e.errno == errno.EROFS:
        return "the file system is mounted read-only: use a copy of the folder on a writable one."
    return "use a folder this user can write to (the lock lives beside what it protects)."


@contextlib.contextmanager
def locked(path: Path, timeout_s: Optional[float] = 600, *, what: str = "", field: str = "lock",
           on_wait: Optional[Callable[[str], None]] = None, interval_s: float = 5.0,
           busy_fix: str = "wait for it to finish, then run again.", folder_lock: bool = False) -> Iterator[None]:
    """Hold an inter-process file lock at ``path`` (``filelock``: ``fcntl.flock`` on the file) for the duration.

    The holder writes ``<path>.json`` (pid, host, start time, ``what``) so a process that finds the
    lock taken can say who holds it. ``timeout_s``: seconds to wait (None: for ever; 0: not at all);
    ``on_wait(message)`` is called every ``interval_s`` seconds while waiting, and once when the lock is taken over
    from a holder that died without releasing it (its sidecar was still there: hostile s11, SIGTERM during quantize). When the time is up,
    raises ``UserError(field, "... held by pid N on HOST since T ...", busy_fix)`` (exit 2), never a
    timeout traceback; a lock file that cannot be created (a read-only folder, ``/proc``) raises ``UserError`` at
    once instead of waiting (filelock would retry it as if it were held). ``folder_lock``: also hold an exclusive ``flock`` on ``path``'s folder itself
    (``_DirLock``), taken after the file lock: deleting the lock file (``rm .build.lock``) then lets no
    second holder in, because the folder's lock is still held."""
    from filelock import Timeout

    from precision_pipeline.core.errors import UserError

    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o644))  # filelock retries a file it cannot create for ever
    except OSError as e:
        if path.is_dir():  # hostile s15c T83: the fix said to use a writable folder; this one is writable
            raise UserError(field, f"cannot open the lock file {path}: a folder of that name is there, not a file.",
                            f"remove that folder (rmdir {path}; nothing of this pipeline is in it) and run this again.") from None
        raise UserError(field, f"cannot create the lock file {path}: {e.strerror or e}.", _lock_file_fix(path, e)) from None
    lock = FileLock(str(path))
    folder = _DirLock(path.parent) if folder_lock else None
    t0 = time.monotonic()
    while True:
        left = None if timeout_s is None else max(0.0, timeout_s - (time.monotonic() - t0))
        step = interval_s if left is None else min(interval_s, left)
        try:
            lock.acquire(timeout=step)
            if folder is None:
                break
            got = folder.try_acquire()
            t_dir = time.monotonic()
            while not got and time.monotonic() - t_dir < step:
                time.sleep(min(0.1, step))
                got = folder.try_acquire()
            if got:
                break
            lock.release()
            raise Timeout(str(path))
        except Timeout:
            who = describe_holder(lock_holder(path))
            if left is not None and left <= step:
                raise UserError(field, f"{path} is held by {who}.", busy_fix)
            if on_wait is not None:
                on_wait(f"waiting for {path}: held by {who} ({time.monotonic() - t0:.0f} s so far)")
    info = Path(str(path) + LOCK_INFO_SUFFIX)
    stale = lock_holder(path)  # a sidecar left while nobody holds the lock: its holder died (SIGTERM, kill -9)
    if stale and stale.get("pid") != os.getpid() and on_wait is not None:
        on_wait(f"{path}: taken over from {describe_holder(stale)}, which ended without releasing it (killed?); "
                "the system released its lock when it died")
    try:
        atomic_write_json(info, {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), "what": what})
        yield
    finally:
        with contextlib.suppress(OSError):
            info.unlink()
        if folder is not None:
            folder.release()
        lock.release()


def read_json_safe(path: Path) -> Any:
    """``read_json`` that returns None for a missing, unreadable or invalid file."""
    try:
        return read_json(path)
    except (OSError, ValueError):
        return None


MAX_JSON_BYTES = 256 * 1024 * 1024
"""Largest JSON file ``read_json`` parses (the pipeline's records are at most a few MB)."""


def read_json(path: Path, default: Any = None) -> Any:
    """Parse JSON at ``path``; ``default`` when the file does not exist. A FIFO, device or socket at ``path`` (a
    ``mkfifo releases.json`` hung every command; a link to /dev/zero filled memory) raises OSError (EINVAL) before
    it is opened, and a file over ``MAX_JSON_BYTES`` ValueError, as invalid JSON does."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return default
    if not stat_mod.S_ISREG(st.st_mode) and not stat_mod.S_ISDIR(st.st_mode):  # a folder: IsADirectoryError below
        raise OSError(errno.EINVAL, "not a regular file (a FIFO, device or socket)", str(path))
    if st.st_size > MAX_JSON_BYTES:
        raise ValueError(f"{st.st_size:,} bytes, more than the {MAX_JSON_BYTES:,} a record may have")
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return default
