"""Local paths and gs://, http(s):// and pipe: URLs: open, list, stat, read and atomic write.

Everything else passes URLs around as strings and calls the functions here, so
a local folder and a bucket prefix behave the same way everywhere in the
product. URL schemes are one table, SCHEMES, from a scheme to the module that
implements it (storage.local, storage.gcs, storage.remote); each function below
looks the URL's scheme up once. Only storage/gcs.py imports google-cloud-storage.
"""

from __future__ import annotations

import os
import re
import uuid
from typing import BinaryIO

from tpustream.errors import StorageError
from tpustream.storage import gcs, local, remote
from tpustream.storage.gcs import GCS_SCHEME, is_gcs
from tpustream.storage.scheme import ObjectStat, Scheme

__all__ = [
    "GCS_SCHEME",
    "SCHEMES",
    "ObjectStat",
    "Scheme",
    "absolute",
    "check_environment",
    "delete",
    "dirname",
    "exists",
    "find_scheme",
    "has_neighbours",
    "has_same_content",
    "interrupted_writes",
    "is_gcs",
    "join",
    "check_container",
    "list_names",
    "make_container",
    "open_read",
    "probe_writable",
    "read_bytes",
    "scheme_name",
    "stat",
    "write_bytes",
    "write_bytes_verified",
]

# "" is a plain local path. pipe: has no "//" (pipe:cat /data/x.tar), as in webdataset.
SCHEMES: dict[str, Scheme] = {
    "": local,
    "file": local,
    "gs": gcs,
    "http": remote,
    "https": remote,
    "pipe": remote,
}
# A scheme needs a letter first and no '/', so a local path that merely
# contains "://" further on stays a local path.
_URL_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
PROBE_PREFIX = ".tpustream-probe-"


def scheme_name(url: str) -> str:
    """The key of url in SCHEMES: "" for a local path, else the scheme ("gs", "pipe", ...)."""
    if url.startswith("pipe:"):
        return "pipe"
    match = _URL_SCHEME.match(url)
    return match.group(1) if match else ""


def check_environment() -> None:
    """The storage settings read from the environment, checked once at start (ConfigError if bad)."""
    gcs.retry_seconds()


def has_neighbours(url: str) -> bool:
    """Whether other objects can be addressed beside url by name (not for pipe: commands)."""
    return scheme_name(url) != "pipe"


def find_scheme(url: str) -> Scheme:
    """The module that handles url's scheme."""
    name = scheme_name(url)
    try:
        return SCHEMES[name]
    except KeyError:
        raise StorageError(
            f"{url}: unsupported URL scheme {name}://; use a local path, file://, gs://, http(s):// or pipe:"
        ) from None


def join(base: str, *parts: str) -> str:
    """Join path parts: '/' after a URL (keeping its scheme intact), os.path.join for a local path."""
    if scheme_name(base):
        out = base.rstrip("/")
        for part in parts:
            out = f"{out}/{part.strip('/')}"
        return out
    return os.path.join(base, *parts)


def dirname(url: str) -> str:
    if scheme_name(url):
        return url.rstrip("/").rsplit("/", 1)[0]
    return os.path.dirname(url)


def absolute(url: str) -> str:
    """URLs as they are; local paths made absolute (replicas do not share a cwd)."""
    return url if scheme_name(url) else os.path.abspath(os.path.expanduser(url))


def open_read(url: str) -> BinaryIO:
    """Open a file or an object for streaming binary reads."""
    return find_scheme(url).open_read(url)


def read_bytes(url: str) -> bytes:
    return find_scheme(url).read_bytes(url)


def exists(url: str) -> bool:
    return find_scheme(url).exists(url)


def list_names(prefix: str) -> list[str]:
    """Names (not URLs) of the files directly inside a local folder or gs:// prefix."""
    return find_scheme(prefix).list_names(prefix)


def stat(url: str) -> ObjectStat:
    """Size and version of a file or object, to notice that it changed since it was last seen."""
    return find_scheme(url).stat(url)


def write_bytes(url: str, data: bytes) -> None:
    """Write data so that readers see either the old content or all of the new.

    Local files go through a temporary file in the same folder and a rename;
    a GCS object only becomes visible when its upload completes.
    """
    find_scheme(url).write_bytes(url, data)


def write_bytes_verified(url: str, data: bytes) -> None:
    """write_bytes for data that must never be seen half-written or corrupted (checkpoints).

    Locally: temporary file, fsync, rename (as write_bytes). On GCS: a
    crc32c-checked upload under a temporary name, then a server-side copy under
    a generation precondition (see storage.gcs.write_bytes_verified).
    """
    find_scheme(url).write_bytes_verified(url, data)


def copy(source: str, url: str) -> None:
    """Copy source to url as write_bytes_verified writes: readers see the old url or all of the new.

    Within a scheme without the bytes passing through this process where the
    scheme allows (a hard link, a GCS server-side copy); across schemes, read
    and written.
    """
    scheme = find_scheme(url)
    if scheme is find_scheme(source):
        scheme.copy(source, url)
    else:
        scheme.write_bytes_verified(url, find_scheme(source).read_bytes(source))


def delete(url: str) -> bool:
    """Remove a file or object; False if it was not there."""
    return find_scheme(url).delete(url)


def interrupted_writes(folder_url: str) -> list[str]:
    """URLs of the temporary objects in folder_url that writes killed before their rename or copy left.

    Ours by name (each scheme's is_temporary), never removed by the write
    that made them: a process killed with SIGKILL (the OOM killer, a
    preempted VM) leaves them, up to a checkpoint's size each.
    """
    scheme = find_scheme(folder_url)
    if scheme is local and not os.path.isdir(local.path_of(folder_url)):
        return []  # nothing was written there yet (a bucket's prefix lists empty instead)
    return [join(folder_url, name) for name in scheme.list_names(folder_url) if scheme.is_temporary(name)]


def check_container(url: str) -> None:
    """StorageError naming the bucket if url's bucket does not exist (nothing is created)."""
    find_scheme(url).check_container(url)


def make_container(url: str) -> None:
    """Create what holds url's objects if it is not there: a local folder, a GCS bucket (tests, demo)."""
    find_scheme(url).make_container(url)


def has_same_content(url: str, data: bytes) -> bool:
    """True if url already holds exactly data (lets a rerun skip finished work)."""
    return find_scheme(url).has_same_content(url, data)


def probe_writable(folder_url: str) -> None:
    """Write and delete a small uniquely named object in folder_url, or raise
    StorageError naming the folder: a run learns at start, not at its first
    checkpoint, that it cannot write there. A missing local folder is created."""
    scheme = find_scheme(folder_url)
    probe = join(folder_url, f"{PROBE_PREFIX}{uuid.uuid4().hex[:12]}")
    try:
        scheme.write_bytes(probe, b"tpustream write probe\n")
        scheme.delete(probe)
    except StorageError as exc:
        # The scheme's message starts with the probe's URL; the folder is what the user named.
        reason = str(exc).removeprefix(f"{probe}: ")
        raise StorageError(f"{folder_url}: cannot write here ({reason})") from exc
