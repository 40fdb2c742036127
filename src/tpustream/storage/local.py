"""Local files, by plain path or file:// URL: read, list, stat and atomic write."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat as stat_mode
import uuid
from typing import BinaryIO
from urllib.parse import urlparse
from urllib.request import url2pathname

from tpustream import progress
from tpustream.errors import StorageError
from tpustream.storage.scheme import ObjectStat

FILE_SCHEME = "file://"
LOCAL_READ_BUFFER_BYTES = 1024 * 1024
# Writes go in pieces of this size, each one progress for the watchdog.
WRITE_CHUNK_BYTES = 64 * 1024 * 1024


def path_of(url: str) -> str:
    """The file system path of a plain path or a file:// URL (of this machine)."""
    if not url.startswith(FILE_SCHEME):
        return url
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise StorageError(
            f"{url}: file:// URLs must name this machine (file:///path), not {parsed.netloc!r}"
        )
    return url2pathname(parsed.path)


def open_read(url: str) -> BinaryIO:
    try:
        return open(path_of(url), "rb", buffering=LOCAL_READ_BUFFER_BYTES)  # noqa: SIM115
    except OSError as exc:
        raise StorageError(f"{url}: {exc.strerror or exc}") from exc


def read_bytes(url: str) -> bytes:
    try:
        with open(path_of(url), "rb") as f:
            return f.read()
    except OSError as exc:
        raise StorageError(f"{url}: {exc.strerror or exc}") from exc


def exists(url: str) -> bool:
    return os.path.exists(path_of(url))


def list_names(prefix: str) -> list[str]:
    path = path_of(prefix)
    try:
        return sorted(n for n in os.listdir(path) if os.path.isfile(os.path.join(path, n)))
    except OSError as exc:
        raise StorageError(f"{prefix}: {exc.strerror or exc}") from exc


def stat(url: str) -> ObjectStat:
    """Size, and the modification time in nanoseconds as the version."""
    try:
        info = os.stat(path_of(url))
    except OSError as exc:
        raise StorageError(f"{url}: {exc.strerror or exc}") from exc
    if not stat_mode.S_ISREG(info.st_mode):
        raise StorageError(f"{url}: not a regular file")
    # The inode as well: file times tick coarsely (a few ms), and a rewrite by
    # rename (ours, most tools') gets a new inode even within one tick.
    return ObjectStat(size=info.st_size, version=f"{info.st_ino}-{info.st_mtime_ns}")


# write_bytes's and copy's temporary names: ".<name>.<12 hex digits>.tmp".
_TEMPORARY = re.compile(r"^\..+\.[0-9a-f]{12}\.tmp$")


def temporary_name(path: str) -> str:
    """A temporary path beside `path`, for a write finished by a rename."""
    return os.path.join(
        os.path.dirname(path) or ".", f".{os.path.basename(path)}.{uuid.uuid4().hex[:12]}.tmp"
    )


def is_temporary(name: str) -> bool:
    return bool(_TEMPORARY.match(name))


def write_bytes(url: str, data: bytes) -> None:
    """Write through a temporary file in the same folder and a rename, so that
    readers see either the old content or all of the new."""
    path = path_of(url)
    folder = os.path.dirname(path) or "."
    tmp = temporary_name(path)
    try:
        os.makedirs(folder, exist_ok=True)
        # os.open with 0o666 applies the umask (mkstemp would force 0600).
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as exc:
        raise StorageError(f"{url}: {exc.strerror or exc}") from exc
    try:
        with os.fdopen(fd, "wb") as f:
            view = memoryview(data)
            for start in range(0, len(view), WRITE_CHUNK_BYTES):
                f.write(view[start : start + WRITE_CHUNK_BYTES])
                progress.beat("bytes written")  # a slow disk or network file system is no hang
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise StorageError(f"{url}: {exc.strerror or exc}") from exc
        raise


def write_bytes_verified(url: str, data: bytes) -> None:
    """Temporary file, fsync, rename: write_bytes already never shows a half-written file."""
    write_bytes(url, data)


def copy(source: str, url: str) -> None:
    """A hard link (or, where there is none, a copy) under a temporary name, then a rename.

    The link shares the source's bytes, fsynced when they were written: no
    second write of a checkpoint; readers of url see the old file or the new.
    """
    path = path_of(url)
    folder = os.path.dirname(path) or "."
    tmp = temporary_name(path)
    try:
        os.makedirs(folder, exist_ok=True)
        try:
            os.link(path_of(source), tmp)
        except OSError:  # another file system, or none that links (some FUSE mounts)
            shutil.copyfile(path_of(source), tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise StorageError(f"{url}: {exc.strerror or exc}") from exc


def delete(url: str) -> bool:
    try:
        os.unlink(path_of(url))
        return True
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise StorageError(f"{url}: {exc.strerror or exc}") from exc


def has_same_content(url: str, data: bytes) -> bool:
    path = path_of(url)
    try:
        if os.path.getsize(path) != len(data):
            return False
        with open(path, "rb") as f:
            return f.read() == data
    except OSError:
        return False


def make_container(url: str) -> None:
    """Create the folder url (and its parents) if it is not there."""
    os.makedirs(path_of(url), exist_ok=True)


def check_container(url: str) -> None:
    """A local folder is created when written to."""
