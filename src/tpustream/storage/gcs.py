"""gs:// objects: the GCS client, its retry policy, streaming reads and verified writes."""

from __future__ import annotations

import base64
import contextlib
import io
import os
import re
import threading
import uuid
from typing import BinaryIO
from urllib.parse import quote

import google_crc32c

from tpustream.config.environment import positive_seconds
from tpustream.errors import StorageError
from tpustream.progress import ProgressStream
from tpustream.storage.gcs_streams import GcsObjectStream, ReadAheadStream
from tpustream.storage.scheme import ObjectStat

GCS_SCHEME = "gs://"
# google-cloud-storage clients hold a requests session, which must not be
# shared across a fork (DataLoader workers) and is not documented as thread
# safe (replicas can be threads). One client per (process, thread).
_clients = threading.local()


def retry_seconds() -> float:
    """TPUSTREAM_GCS_RETRY_SECONDS (default 120); ConfigError naming the variable if it is not seconds."""
    return positive_seconds("TPUSTREAM_GCS_RETRY_SECONDS", 120.0)


def gcs_retry():
    """The retry policy of every GCS call: the client's default (exponential backoff on
    429, 5xx and dropped connections), for at most TPUSTREAM_GCS_RETRY_SECONDS (120)."""
    from google.cloud.storage.retry import DEFAULT_RETRY

    return DEFAULT_RETRY.with_timeout(retry_seconds())


def gcs_failures() -> tuple[type[Exception], ...]:
    """What a GCS call raises once its retries are spent: API errors (RetryError
    included, which is not a GoogleAPICallError), and transport errors that
    surface unwrapped (a connection refused or reset on the last attempt)."""
    import google.auth.exceptions
    import requests
    from google.api_core import exceptions as gexc

    transport = (requests.RequestException, google.auth.exceptions.TransportError, ConnectionError)
    return (gexc.GoogleAPIError, *transport)


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
        with contextlib.suppress(*gcs_failures()):
            if not bucket_exists(bucket):
                return StorageError(f"{url}: bucket gs://{bucket} does not exist")
        return StorageError(f"{url}: no such object (404)")
    if isinstance(exc, gexc.Forbidden):
        return StorageError(f"{url}: permission denied (403); check the credentials' IAM roles")
    return StorageError(f"{url}: {exc.__class__.__name__}: {exc}")


def _read_error(url: str, exc: Exception) -> StorageError:
    """A failed streaming read: missing or forbidden as _gcs_error says it, else "read failed"."""
    from google.api_core import exceptions as gexc

    if isinstance(exc, gexc.NotFound | gexc.Forbidden):
        return _gcs_error(url, exc)
    return StorageError(f"{url}: read failed ({exc.__class__.__name__}: {exc})")


def bucket_exists(bucket: str) -> bool:
    from google.api_core import exceptions as gexc

    try:
        return gcs_client().bucket(bucket).exists(retry=gcs_retry())
    except gexc.Forbidden:
        # Object access without bucket metadata access is a normal IAM setup;
        # assume the bucket is there and let object calls report the details.
        return True


def make_container(url: str) -> None:
    """Create the bucket of gs://bucket/... if it does not exist (the demo, tests and benchmarks)."""
    bucket, _ = split_gcs_url(url)
    if not bucket_exists(bucket):
        gcs_client().create_bucket(bucket)


def check_container(url: str) -> None:
    bucket, _ = split_gcs_url(url)
    if not bucket_exists(bucket):
        raise StorageError(f"{url}: bucket gs://{bucket} does not exist; create it first")


def open_read(url: str) -> BinaryIO:
    """Open a gs:// object for streaming binary reads, read ahead by a thread."""
    bucket, name = split_gcs_url(url)
    # Fetching metadata first turns a missing object into a clear error here
    # (after the client's retries) instead of on the first read, and pins the
    # generation so a concurrent rewrite cannot mix two versions.
    blob = _reloaded_blob(url)
    # The JSON API's media download of exactly this generation, on the
    # client's own endpoint (blob.media_link would bypass a configured
    # endpoint: the emulator names itself there).
    client = gcs_client()
    media_url = (
        f"{client.api_endpoint}/download/storage/v1/b/{bucket}/o/{quote(name, safe='')}"
        f"?alt=media&generation={blob.generation}"
    )
    stream = GcsObjectStream(client._http, media_url, blob.size, url)
    return ReadAheadStream(stream, url, describe_error=_read_error)


def read_bytes(url: str) -> bytes:
    bucket, name = split_gcs_url(url)
    try:
        return gcs_client().bucket(bucket).blob(name).download_as_bytes(retry=gcs_retry())
    except gcs_failures() as exc:
        raise _gcs_error(url, exc) from exc


def exists(url: str) -> bool:
    bucket, name = split_gcs_url(url)
    try:
        return gcs_client().bucket(bucket).blob(name).exists(retry=gcs_retry())
    except gcs_failures() as exc:
        raise _gcs_error(url, exc) from exc


def list_names(prefix: str) -> list[str]:
    """Names (not URLs) of the objects directly inside a gs:// prefix."""
    bucket, name = split_gcs_url(prefix)
    folder = name.rstrip("/") + "/" if name else ""
    try:
        blobs = gcs_client().list_blobs(bucket, prefix=folder, delimiter="/", retry=gcs_retry())
        # Skip the folder's own placeholder object ("prefix/"), which consoles create.
        return sorted(b.name[len(folder) :] for b in blobs if b.name != folder)
    except gcs_failures() as exc:
        raise _gcs_error(prefix, exc) from exc


def stat(url: str) -> ObjectStat:
    """Size and generation: GCS gives every write of an object a new generation."""
    blob = _reloaded_blob(url)
    return ObjectStat(size=blob.size, version=str(blob.generation))


def _reloaded_blob(url: str):
    """The object's blob with its metadata fetched (size, generation); StorageError naming url if it fails."""
    bucket, name = split_gcs_url(url)
    blob = gcs_client().bucket(bucket).blob(name)
    try:
        # reload() raises NotFound for a missing object (get_blob would
        # return None), so _gcs_error can tell a missing bucket apart.
        blob.reload(retry=gcs_retry())
    except gcs_failures() as exc:
        raise _gcs_error(url, exc) from exc
    return blob


def write_bytes(url: str, data: bytes) -> None:
    """Upload data; a GCS object only becomes visible when its upload completes."""
    bucket, name = split_gcs_url(url)
    try:
        blob = gcs_client().bucket(bucket).blob(name)
        # The client retries uploads only under a generation precondition.
        # Ours are whole-object writes of the same bytes, so repeating one
        # is harmless: retry transient errors (429, 5xx, resets) always.
        blob.upload_from_file(_uploaded(data), size=len(data), rewind=True, retry=gcs_retry())
    except gcs_failures() as exc:
        raise _gcs_error(url, exc) from exc


def _uploaded(data: bytes) -> ProgressStream:
    """data as the stream an upload reads, each read (a chunk of a resumable upload) progress."""
    return ProgressStream(io.BytesIO(data), "bytes uploaded")


# write_bytes_verified's temporary objects: "<name>.tmp-<12 hex digits>".
_TEMPORARY = re.compile(r"^.+\.tmp-[0-9a-f]{12}$")


def is_temporary(name: str) -> bool:
    return bool(_TEMPORARY.match(name))


def write_bytes_verified(url: str, data: bytes) -> None:
    """write_bytes for data that must never be seen half-written or corrupted (checkpoints).

    Upload under a temporary name with a crc32c the service checks, then a
    server-side copy to the final name under a generation precondition (the
    final object is still the one we looked at, or absent), then delete the
    temporary object. Readers see the previous complete object or the new one.
    """
    from google.api_core import exceptions as gexc

    bucket_name, name = split_gcs_url(url)
    bucket = gcs_client().bucket(bucket_name)
    temp = bucket.blob(f"{name}.tmp-{uuid.uuid4().hex[:12]}")
    expected = base64.b64encode(google_crc32c.Checksum(data).digest()).decode()
    try:
        temp.upload_from_file(
            _uploaded(data), size=len(data), rewind=True, checksum="crc32c", retry=gcs_retry()
        )
        if temp.crc32c != expected:
            raise StorageError(f"{url}: uploaded crc32c {temp.crc32c} differs from the data's {expected}")
        current = bucket.get_blob(name, retry=gcs_retry())
        bucket.copy_blob(
            temp, bucket, name, if_generation_match=current.generation if current else 0, retry=gcs_retry()
        )
    except gexc.PreconditionFailed as exc:
        # A retried copy whose first attempt went through (its answer was lost
        # on the way back) fails its own precondition: the object is then ours.
        if not _holds(bucket, name, expected, len(data)):
            raise StorageError(
                f"{url}: changed by another writer while we were saving; not overwritten"
            ) from exc
    except gcs_failures() as exc:
        raise _gcs_error(url, exc) from exc
    finally:
        with contextlib.suppress(Exception):
            temp.delete(retry=gcs_retry())


def copy(source: str, url: str) -> None:
    """A server-side copy (no bytes through this host), under the same generation precondition as
    write_bytes_verified: the destination is still the object we looked at, or absent."""
    from google.api_core import exceptions as gexc

    source_bucket, source_name = split_gcs_url(source)
    bucket_name, name = split_gcs_url(url)
    client = gcs_client()
    bucket = client.bucket(bucket_name)
    try:
        blob = client.bucket(source_bucket).get_blob(source_name, retry=gcs_retry())
        if blob is None:
            raise StorageError(f"{source}: no such object to copy to {url}")
        current = bucket.get_blob(name, retry=gcs_retry())
        client.bucket(source_bucket).copy_blob(
            blob, bucket, name, if_generation_match=current.generation if current else 0, retry=gcs_retry()
        )
    except gexc.PreconditionFailed as exc:
        # As in write_bytes_verified: a retried copy whose first attempt went through.
        if not _holds(bucket, name, blob.crc32c, blob.size):
            raise StorageError(f"{url}: changed by another writer while we copied; not overwritten") from exc
    except gcs_failures() as exc:
        raise _gcs_error(url, exc) from exc


def _holds(bucket, name: str, crc32c: str, size: int) -> bool:
    """Whether the object bucket/name has exactly this crc32c and size."""
    try:
        blob = bucket.get_blob(name, retry=gcs_retry())
    except gcs_failures():
        return False
    return blob is not None and blob.crc32c == crc32c and blob.size == size


def delete(url: str) -> bool:
    """Remove an object; False if it was not there."""
    from google.api_core import exceptions as gexc

    bucket, name = split_gcs_url(url)
    try:
        gcs_client().bucket(bucket).blob(name).delete(retry=gcs_retry())
        return True
    except gexc.NotFound:
        return False
    except gcs_failures() as exc:
        raise _gcs_error(url, exc) from exc


def has_same_content(url: str, data: bytes) -> bool:
    """Compare size and the service's crc32c, without downloading the object."""
    from google.api_core import exceptions as gexc

    bucket, name = split_gcs_url(url)
    try:
        blob = gcs_client().bucket(bucket).get_blob(name, retry=gcs_retry())
    except gexc.NotFound:
        return False
    except gcs_failures() as exc:
        raise _gcs_error(url, exc) from exc
    if blob is None or blob.size != len(data) or not blob.crc32c:
        return False
    local = base64.b64encode(google_crc32c.Checksum(data).digest()).decode()
    return local == blob.crc32c
