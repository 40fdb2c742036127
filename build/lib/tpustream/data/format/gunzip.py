"""A gzip stream read forward in large chunks, for .tar.gz shards streamed from storage (never seeks)."""

from __future__ import annotations

import io
import zlib
from typing import BinaryIO

from tpustream.errors import ShardFormatError

READ_CHUNK = 1 << 20
_GZIP_WBITS = 16 + zlib.MAX_WBITS  # zlib: expect a gzip header and trailer


class GunzipStream(io.RawIOBase):
    """The decompressed bytes of a gzip stream, read forward in large chunks; never seeks.

    Reads gzip files of several members (``cat a.gz b.gz``) and ignores zero
    padding after a member, as Python's gzip module does. A corrupt or
    truncated stream raises ShardFormatError naming the URL. close() closes
    the underlying stream.
    """

    def __init__(self, stream: BinaryIO, url: str):
        super().__init__()
        self._stream = stream
        self._url = url
        self._decompressor: zlib._Decompress | None = None  # None between members
        self._pending = b""  # compressed bytes read but not yet given to the decompressor
        self._input_done = False
        self._members = 0

    def readable(self) -> bool:
        return True

    def _read_input(self) -> bytes:
        chunk = self._stream.read(READ_CHUNK)
        if not chunk:
            self._input_done = True
        return chunk

    def _start_member(self) -> bool:
        """Set up the next member's decompressor; False at the end of the stream."""
        while True:
            if self._members:
                self._pending = self._pending.lstrip(b"\0")
            if self._pending:
                break
            if self._input_done:
                if not self._members:
                    raise ShardFormatError(f"{self._url}: empty gzip stream")
                return False
            self._pending = self._read_input()
        self._decompressor = zlib.decompressobj(_GZIP_WBITS)
        self._members += 1
        return True

    def read(self, size: int | None = -1) -> bytes:
        if self.closed:
            raise ValueError(f"{self._url}: read from a closed gzip stream")
        if size is None or size < 0:
            return self.readall()
        parts = []
        have = 0
        while have < size:
            if self._decompressor is None and not self._start_member():
                break
            decompressor = self._decompressor
            if not self._pending and not self._input_done:
                self._pending = self._read_input()
            try:
                # max_length bounds memory: the rest of the input waits in unconsumed_tail.
                out = decompressor.decompress(self._pending, size - have)
            except zlib.error as exc:
                raise ShardFormatError(f"{self._url}: corrupt gzip stream ({exc})") from None
            self._pending = decompressor.unconsumed_tail
            if out:
                parts.append(out)
                have += len(out)
            if decompressor.eof:
                self._pending = decompressor.unused_data + self._pending
                self._decompressor = None
            elif not out and not self._pending and self._input_done:
                raise ShardFormatError(f"{self._url}: truncated gzip stream")
        return b"".join(parts)

    def readall(self) -> bytes:
        parts = []
        while chunk := self.read(READ_CHUNK):
            parts.append(chunk)
        return b"".join(parts)

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            try:
                self._stream.close()
            finally:
                super().close()
