"""Local paths and gs:// URLs: open, list, read and atomic write.

This is the only module that imports google-cloud-storage. Everything else
passes URLs around as strings and calls the functions here, so a local folder
and a bucket prefix behave the same way everywhere in the product.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
import uuid
from typing import BinaryIO

from tpustream.errors import StorageError

GCS_SCHEME = "gs://"
# One streamed range request per chunk. Large enough that the per-request
# latency of real GCS (tens of ms) is small against the transfer time.
GCS_READ_CHUNK_BYTES = 16 * 1024 * 1024
LOCAL_READ_BUFFER_BYTES = 1024 * 1024

# google-cloud-storage clients hold a requests session, which must not be
# shared across a fork (DataLoader workers) and is not documented as thread
# safe (replicas can be threads). One client per (process, thread).
_clients = threading.local()


def is_gcs(url: str) -> bool:
    return url.startswith(GCS_SCHEME)


def split_gcs_url(url: str) -> tuple[str, str]:
    """Return (bucket, object name) of a gs:// URL."""
    if not is_gcs(url):
        raise StorageError(f"not a gs:// URL: {url!r}")
    rest = url[len(GCS_SCHEME) :]
    bucket, _, name = rest.partition("/")
    if len(bucket) < 3:
        raise StorageError(f"{url}: bucket name {bucket!r} is too short (GCS needs 3+ characters)")
    return bucket, name


def join(base: str, *parts: str) -> str:
    """Join path parts with '/', keeping a gs:// or absolute local prefix intact."""
    if is_gcs(base):
        out = base.rstrip("/")
        for part in parts:
            out = f"{out}/{part.strip('/')}"
        return out
    return os.path.join(base, *parts)


def dirname(url: str) -> str:
    if is_gcs(url):
        return url.rstrip("/").rsplit("/", 1)[0]
    return os.path.dirname(url)


def absolute(url: str) -> str:
    """gs:// URLs as they are; local paths made absolute (replicas do not share a cwd)."""
    return url if is_gcs(url) else os.path.abspath(os.path.expanduser(url))


def gcs_client():
    """The storage client of this process and thread.

    With STORAGE_EMULATOR_HOST set (tests, the local demo) the client talks to
    the emulator with anonymous credentials; otherwise it uses Application
    Default Credentials, which on a TPU VM are the VM's service account.
    """
    key = (os.getpid(), os.environ.get("STORAGE_EMULATOR_HOST"))
    cached = getattr(_clients, "entry", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    from google.cloud import storage

    if os.environ.get("STORAGE_EMULATOR_HOST"):
        from google.auth.credentials import AnonymousCredentials

        client = storage.Client(project="tpustream-local", credentials=AnonymousCredentials())
    else:
        try:
            client = storage.Client()
        except Exception as exc:  # google.auth.exceptions.DefaultCredentialsError and kin
            raise StorageError(
                f"cannot create a GCS client ({exc.__class__.__name__}: {exc}); "
                "run `gcloud auth application-default login` or use a VM service account"
            ) from exc
    _clients.entry = (key, client)
    return client


def _gcs_error(url: str, exc: Exception) -> StorageError:
    from google.api_core import exceptions as gexc

    if isinstance(exc, gexc.NotFound):
        bucket, _ = split_gcs_url(url)
        if not bucket_exists(bucket):
            return StorageError(f"{url}: bucket gs://{bucket} does not exist")
        return StorageError(f"{url}: no such object (404)")
    if isinstance(exc, gexc.Forbidden):
        return StorageError(f"{url}: permission denied (403); check the credentials' IAM roles")
    return StorageError(f"{url}: {exc.__class__.__name__}: {exc}")


def bucket_exists(bucket: str) -> bool:
    from google.api_core import exceptions as gexc

    try:
        return gcs_client().bucket(bucket).exists()
    except gexc.Forbidden:
        # Object access without bucket metadata access is a normal IAM setup;
        # assume the bucket is there and let object calls report the details.
        return True


def open_read(url: str) -> BinaryIO:
    """Open a local file or a gs:// object for streaming binary reads."""
    if not is_gcs(url):
        try:
            return open(url, "rb", buffering=LOCAL_READ_BUFFER_BYTES)  # noqa: SIM115
        except OSError as exc:
            raise StorageError(f"{url}: {exc.strerror or exc}") from exc
    from google.api_core import exceptions as gexc

    bucket, name = split_gcs_url(url)
    blob = gcs_client().bucket(bucket).blob(name)
    try:
        # Fetching metadata first turns a missing object into a clear error
        # here (after the client's retries) instead of on the first read, and
        # pins the generation so a concurrent rewrite cannot mix two versions.
        blob.reload()
        return blob.open("rb", chunk_size=GCS_READ_CHUNK_BYTES)
    except gexc.GoogleAPICallError as exc:
        raise _gcs_error(url, exc) from exc


def read_bytes(url: str) -> bytes:
    if not is_gcs(url):
        try:
            with open(url, "rb") as f:
                return f.read()
        except OSError as exc:
            raise StorageError(f"{url}: {exc.strerror or exc}") from exc
    from google.api_core import exceptions as gexc

    bucket, name = split_gcs_url(url)
    try:
        return gcs_client().bucket(bucket).blob(name).download_as_bytes()
    except gexc.GoogleAPICallError as exc:
        raise _gcs_error(url, exc) from exc


def exists(url: str) -> bool:
    if not is_gcs(url):
        return os.path.exists(url)
    from google.api_core import exceptions as gexc

    bucket, name = split_gcs_url(url)
    try:
        return gcs_client().bucket(bucket).blob(name).exists()
    except gexc.GoogleAPICallError as exc:
        raise _gcs_error(url, exc) from exc


def list_names(prefix: str) -> list[str]:
    """Names (not URLs) of the files directly inside a local folder or gs:// prefix."""
    if not is_gcs(prefix):
        try:
            return sorted(n for n in os.listdir(prefix) if os.path.isfile(os.path.join(prefix, n)))
        except OSError as exc:
            raise StorageError(f"{prefix}: {exc.strerror or exc}") from exc
    from google.api_core import exceptions as gexc

    bucket, name = split_gcs_url(prefix)
    folder = name.rstrip("/") + "/" if name else ""
    try:
        blobs = gcs_client().list_blobs(bucket, prefix=folder, delimiter="/")
        # Skip the folder's own placeholder object ("prefix/"), which consoles create.
        return sorted(b.name[len(folder) :] for b in blobs if b.name != folder)
    except gexc.GoogleAPICallError as exc:
        raise _gcs_error(prefix, exc) from exc


def write_bytes(url: str, data: bytes) -> None:
    """Write data so that readers see either the old content or all of the new.

    Local files go through a temporary file in the same folder and a rename;
    a GCS object only becomes visible when its upload completes.
    """
    if is_gcs(url):
        from google.api_core import exceptions as gexc
        from google.cloud.storage.retry import DEFAULT_RETRY

        bucket, name = split_gcs_url(url)
        try:
            blob = gcs_client().bucket(bucket).blob(name)
            # The client retries uploads only under a generation precondition.
            # Ours are whole-object writes of the same bytes, so repeating one
            # is harmless: retry transient errors (429, 5xx, resets) always.
            blob.upload_from_file(io.BytesIO(data), size=len(data), rewind=True, retry=DEFAULT_RETRY)
        except gexc.GoogleAPICallError as exc:
            raise _gcs_error(url, exc) from exc
        return
    folder = os.path.dirname(url) or "."
    tmp = os.path.join(folder, f".{os.path.basename(url)}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        os.makedirs(folder, exist_ok=True)
        # os.open with 0o666 applies the umask (mkstemp would force 0600).
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as exc:
        raise StorageError(f"{url}: {exc.strerror or exc}") from exc
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, url)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise StorageError(f"{url}: {exc.strerror or exc}") from exc
        raise


def delete(url: str) -> bool:
    """Remove a file or object; False if it was not there."""
    if not is_gcs(url):
        try:
            os.unlink(url)
            return True
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise StorageError(f"{url}: {exc.strerror or exc}") from exc
    from google.api_core import exceptions as gexc

    bucket, name = split_gcs_url(url)
    try:
        gcs_client().bucket(bucket).blob(name).delete()
        return True
    except gexc.NotFound:
        return False
    except gexc.GoogleAPICallError as exc:
        raise _gcs_error(url, exc) from exc


def has_same_content(url: str, data: bytes) -> bool:
    """True if url already holds exactly data (lets a rerun skip finished work)."""
    if not is_gcs(url):
        try:
            if os.path.getsize(url) != len(data):
                return False
            with open(url, "rb") as f:
                return f.read() == data
        except OSError:
            return False
    import base64

    import google_crc32c
    from google.api_core import exceptions as gexc

    bucket, name = split_gcs_url(url)
    try:
        blob = gcs_client().bucket(bucket).get_blob(name)
    except gexc.NotFound:
        return False
    except gexc.GoogleAPICallError as exc:
        raise _gcs_error(url, exc) from exc
    if blob is None or blob.size != len(data) or not blob.crc32c:
        return False
    local = base64.b64encode(google_crc32c.Checksum(data).digest()).decode()
    return local == blob.crc32c
