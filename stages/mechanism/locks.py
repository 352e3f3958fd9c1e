"""Lock files that work across processes and hosts on a shared filesystem.

A lock is a file created with a hard link from a fully written temporary file (``link``
fails if the target exists, atomically, also on NFS), so a reader never sees a half-written
lock. It holds JSON with the holder's ``host``, ``pid``, ``token`` (unique per holder, so a
holder recognises its own lock from any process), ``started`` and ``heartbeat`` (both Unix
times at creation). The live heartbeat is the file's modification time: the holder sets it
to its own clock with ``os.utime`` (``refresh``), which never recreates a lock someone broke.

A pipeline driver's lock also names its ``run``: the marker ``<host>:<pid>:<start time>``
that the driver exports as ``FRONTIER_LLM_RUN`` (``RUN_ENV``) and every process it starts
inherits (Parsl's interchanges and workers, the launcher, the ranks). A driver
killed with ``kill -9`` may leave such processes writing into the stage's ``.partial``
directory for a while (until the driver's watchdog, ``workflows.watchdog``, has stopped
them), so its pid alone does not say the attempt is over.

A lock of this host is stale when no process of its run is alive here (neither the driver,
same pid and start time, nor any process carrying the run's marker); a lock of this host
without a run, when its pid is dead or its heartbeat is older than ``stale_after`` seconds;
a lock of another host, when its heartbeat is older than ``stale_after`` seconds. A stale
lock is broken by renaming it aside (one breaker wins the rename), checking it is still the
lock judged stale, and removing it; a lock that is not stale is waited for.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

RUN_ENV = "FRONTIER_LLM_RUN"  # the driver's run marker, inherited by every process it starts
STALE_AFTER_S = 600.0  # a holder that has not refreshed for this long is taken as gone
POLL_S = 0.5


def run_marker(pid: int | None = None) -> str:
    """``<host>:<pid>:<start time>`` of a live process (default: this one): names one driver's
    run, and no other process even when the pid is reused later."""
    process = psutil.Process(os.getpid() if pid is None else pid)
    return f"{socket.gethostname()}:{process.pid}:{process.create_time():.2f}"


def run_processes(run: str, exclude: tuple[int, ...] = ()) -> list[psutil.Process]:
    """The live processes of this host (not zombies) whose environment carries ``run`` as
    ``RUN_ENV``: everything a driver started, and what those started in turn."""
    found = []
    for process in psutil.process_iter():
        if process.pid in exclude:
            continue
        try:
            if process.environ().get(RUN_ENV) == run and \
                    process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def run_alive(run: str) -> bool:
    """Whether a process of ``run`` lives on this host: its driver (same pid and start time)
    or a process that inherited its marker. False for a run of another host (unknowable)."""
    host, _, rest = run.partition(":")
    pid, _, started = rest.partition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        if f"{psutil.Process(int(pid)).create_time():.2f}" == started:
            return True
    except psutil.NoSuchProcess:
        pass
    return bool(run_processes(run))


@dataclass(frozen=True)
class Owner:
    """Who holds a lock: a process on a host, a token unique to that holder, and the run it
    belongs to (``RUN_ENV`` where a driver exported one, else empty: liveness by pid)."""

    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    run: str = field(default_factory=lambda: os.environ.get(RUN_ENV, ""))

    def __str__(self) -> str:
        return f"{self.host}:{self.pid}"


class LockTimeout(TimeoutError):
    """A lock stayed held by a live holder for longer than the caller would wait."""


def read(path: str | Path) -> tuple[dict[str, Any], float] | None:
    """The lock's content and heartbeat (mtime), or None when there is no (readable) lock."""
    try:
        with open(path) as handle:
            info = json.load(handle)
            heartbeat = os.fstat(handle.fileno()).st_mtime
    except (OSError, ValueError):
        return None
    return (info, heartbeat) if isinstance(info, dict) else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def is_stale(info: dict[str, Any], heartbeat: float, stale_after: float = STALE_AFTER_S,
             now: float | None = None) -> bool:
    """On this host: no process of the holder's run is alive (a lock without a run: its pid
    is dead); the heartbeat is not asked, since a driver killed with ``kill -9`` stops beating
    while its ranks may train on. Another host's lock: heartbeat older than ``stale_after``."""
    if info.get("host") == socket.gethostname():
        if info.get("run"):
            return not run_alive(str(info["run"]))
        if not _pid_alive(int(info.get("pid", -1))):
            return True
    return (time.time() if now is None else now) - heartbeat > stale_after


def _create(path: Path, owner: Owner) -> bool:
    """Create the lock for ``owner`` if there is none; True when created."""
    now = time.time()
    content = {**asdict(owner), "started": now, "heartbeat": now}
    tmp = path.with_name(f".{path.name}.tmp-{owner.host}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_text(json.dumps(content))
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError:
        # NFS may report an error for a link that was made: the link count tells.
        return os.stat(tmp).st_nlink == 2
    finally:
        tmp.unlink(missing_ok=True)


def _break(path: Path, judged: dict[str, Any]) -> None:
    """Remove the stale lock ``judged``; put back a lock that replaced it meanwhile."""
    aside = path.with_name(f".{path.name}.broken-{socket.gethostname()}-{os.getpid()}-"
                           f"{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return  # another process broke it first
    moved = read(aside)
    if moved is not None and moved[0].get("token") != judged.get("token"):
        with contextlib.suppress(FileExistsError):
            os.link(aside, path)  # a fresh lock: restore it unless a newer one exists
    aside.unlink(missing_ok=True)


def try_acquire(path: str | Path, owner: Owner, stale_after: float = STALE_AFTER_S
                ) -> dict[str, Any] | None:
    """Take the lock, breaking a stale one; None when ``owner`` holds it now, else the
    live holder's content."""
    path = Path(path)
    for _ in range(10):  # each pass either takes it, finds a live holder, or breaks one
        if _create(path, owner):
            return None
        found = read(path)
        if found is None:
            continue  # released (or half-broken) between our attempt and the read
        info, heartbeat = found
        if info.get("token") == owner.token:
            touch(path, owner)
            return None
        if not is_stale(info, heartbeat, stale_after):
            return info
        print(f"[lock] breaking stale lock {path} held by {info.get('host')}:{info.get('pid')} "
              f"(heartbeat {time.time() - heartbeat:.0f}s ago)", flush=True)
        _break(path, info)
    found = read(path)
    return found[0] if found else {"host": "?", "pid": "?"}


def acquire(path: str | Path, owner: Owner, stale_after: float = STALE_AFTER_S,
            wait_s: float | None = None, poll_s: float = POLL_S,
            on_wait: Callable[[dict[str, Any]], None] | None = None) -> None:
    """Take the lock, waiting while a live holder has it; ``on_wait(holder)`` is called once
    when waiting starts. Raises LockTimeout after ``wait_s`` seconds (None: no limit)."""
    started = time.monotonic()
    told = False
    while True:
        holder = try_acquire(path, owner, stale_after)
        if holder is None:
            return
        if not told and on_wait is not None:
            on_wait(holder)
            told = True
        if wait_s is not None and time.monotonic() - started > wait_s:
            raise LockTimeout(f"{path} is still held by {holder.get('host')}:{holder.get('pid')} "
                              f"after {wait_s:.0f}s")
        time.sleep(poll_s)


def holds(path: str | Path, owner: Owner) -> bool:
    """Whether ``owner`` holds the lock at ``path``."""
    found = read(path)
    return found is not None and found[0].get("token") == owner.token


def touch(path: str | Path, owner: Owner) -> bool:
    """Refresh the heartbeat of a lock ``owner`` holds; False when it holds none there."""
    if not holds(path, owner):
        return False
    now = time.time()
    try:
        os.utime(path, (now, now))
    except FileNotFoundError:
        return False
    return True


def release(path: str | Path, owner: Owner) -> bool:
    """Remove the lock if ``owner`` holds it; True when removed."""
    if not holds(path, owner):
        return False
    Path(path).unlink(missing_ok=True)
    return True


@contextlib.contextmanager
def hold(path: str | Path, owner: Owner | None = None, stale_after: float = STALE_AFTER_S,
         wait_s: float | None = None,
         on_wait: Callable[[dict[str, Any]], None] | None = None) -> Iterator[Owner]:
    """Hold the lock at ``path`` for the block (as this process unless ``owner`` is given)."""
    owner = owner or Owner()
    acquire(path, owner, stale_after, wait_s, on_wait=on_wait)
    try:
        yield owner
    finally:
        release(path, owner)


def held(runs_dir: str | Path, owner: Owner) -> list[Path]:
    """The stage locks (``<runs_dir>/stages/<stage>/<key>.lock``) that ``owner`` holds."""
    return [p for p in sorted(Path(runs_dir).glob("stages/*/*.lock")) if holds(p, owner)]


def refresh(runs_dir: str | Path, owner: Owner) -> int:
    """Refresh the heartbeat of every stage lock ``owner`` holds; return how many."""
    return sum(touch(p, owner) for p in held(runs_dir, owner))


def release_all(runs_dir: str | Path, owner: Owner) -> int:
    """Release every stage lock ``owner`` still holds (a driver that stops); how many."""
    return sum(release(p, owner) for p in held(runs_dir, owner))


class Heartbeat:
    """A daemon thread that refreshes ``owner``'s stage locks every ``period_s`` seconds.

    The pipeline driver runs one: stage locks are held in the driver's name while the
    stage's work runs in other processes (Parsl workers, ranks)."""

    def __init__(self, runs_dir: str | Path, owner: Owner,
                 period_s: float = STALE_AFTER_S / 10) -> None:
        self.runs_dir, self.owner, self.period_s = Path(runs_dir), owner, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="lock-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                refresh(self.runs_dir, self.owner)
            except OSError as error:  # a filesystem hiccup must not kill the heartbeat
                print(f"[lock] heartbeat refresh failed: {error}", flush=True)

    def stop(self) -> None:
        """Stop refreshing (the driver is done; its locks are released or left to go stale)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
