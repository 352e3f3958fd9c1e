"""Atomic file writes: the one way this project writes a file that another process may read.

Every write goes to a temporary file with a unique name in the target's directory (two
writers never share one), is flushed and fsync'ed, then renamed over the target. A reader
sees the old file or the new one, never half of one, and a crash leaves at most a
``.<name>.tmp-*`` file that no reader looks at.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})
"""The errnos of a storage that takes no more writes (full, over quota, read-only): a retry
fails the same way until someone frees space."""


@contextlib.contextmanager
def atomic_path(path: str | Path, fsync: bool = True) -> Iterator[Path]:
    """Yield a unique temporary path beside ``path``; rename it to ``path`` if the block succeeds.

    For writers that want a path (``savefig``, ``torch.save``). On an exception the
    temporary file is removed and ``path`` is left as it was.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.tmp-")
    os.fchmod(fd, 0o666 & ~_umask())  # as a plain open() would: others on a shared FS can read
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        if fsync:
            with open(tmp, "rb") as handle:
                os.fsync(handle.fileno())
        os.replace(tmp, target)
    except OSError as error:
        tmp.unlink(missing_ok=True)
        if error.filename is None:  # e.g. a full disk: say which file could not be written
            raise OSError(error.errno, f"{error.strerror} while writing {target}") from error
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        _fsync_dir(target.parent)


def write_bytes_atomic(path: str | Path, data: bytes, fsync: bool = True) -> Path:
    """Write ``data`` to ``path`` atomically; return ``path``."""
    with atomic_path(path, fsync) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def write_text_atomic(path: str | Path, text: str, fsync: bool = True) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically; return ``path``."""
    return write_bytes_atomic(path, text.encode("utf-8"), fsync)


def write_json_atomic(
    path: str | Path, obj: Any, fsync: bool = True, indent: int | None = 2
) -> Path:
    """Write ``obj`` as JSON (non-JSON values as ``str``) to ``path`` atomically.

    Returns ``path``.
    """
    return write_text_atomic(path, json.dumps(obj, indent=indent, default=str), fsync)


def _umask() -> int:
    """The process's umask (reading it means setting it, so set it straight back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(directory: Path) -> None:
    """Make a rename durable (some filesystems refuse to open a directory: then skip)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def storage_error(error: BaseException,
                  errnos: Collection[int] | None = STORAGE_ERRNOS) -> OSError | None:
    """The full-disk (quota, read-only) OSError behind ``error``, if any: ``error`` itself, in
    its cause or context chain, or among a distributed checkpoint's per-rank failures.
    ``errnos=None`` finds an OSError of any errno."""
    seen: set[int] = set()
    todo: list[Any] = [error]
    while todo:
        item = todo.pop()
        if isinstance(item, tuple):  # DCP's failures: rank -> (exception, traceback)
            todo.extend(item)
            continue
        if not isinstance(item, BaseException) or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, OSError) and (errnos is None or item.errno in errnos):
            return item
        failures = getattr(item, "failures", None)
        if isinstance(failures, dict):
            todo.extend(failures.values())
        todo.extend([item.__cause__, item.__context__])
    return None
