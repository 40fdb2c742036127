"""What every URL scheme's module provides, and the metadata that stat returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import BinaryIO, Protocol


@dataclass(frozen=True)
class ObjectStat:
    """Size and version of a stored object; a changed version means the content may have changed.

    version is opaque: a GCS generation, a local mtime in nanoseconds, an HTTP
    ETag or Last-Modified. Compare it only with a version of the same URL.
    """

    size: int
    version: str


class Scheme(Protocol):
    """The operations of one URL scheme. storage.local, storage.gcs and
    storage.remote are modules that implement it; tpustream.storage.SCHEMES
    maps each URL scheme to one of them."""

    def open_read(self, url: str) -> BinaryIO: ...

    def read_bytes(self, url: str) -> bytes: ...

    def exists(self, url: str) -> bool: ...

    def list_names(self, prefix: str) -> list[str]: ...

    def stat(self, url: str) -> ObjectStat: ...

    def write_bytes(self, url: str, data: bytes) -> None: ...

    def write_bytes_verified(self, url: str, data: bytes) -> None: ...

    def copy(self, source: str, url: str) -> None:
        """Copy source (same scheme) to url so that readers see the old url or all of the new."""

    def delete(self, url: str) -> bool: ...

    def is_temporary(self, name: str) -> bool:
        """Whether a name in a folder is one of this scheme's atomic writes' temporary objects."""

    def has_same_content(self, url: str, data: bytes) -> bool: ...

    def make_container(self, url: str) -> None:
        """Create what holds url's objects if it is not there: a local folder, a GCS bucket."""

    def check_container(self, url: str) -> None:
        """StorageError unless objects can be written under url without creating a bucket."""
