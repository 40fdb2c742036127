"""Streaming tar reading and deterministic tar writing for WebDataset shards.

Python's tarfile builds a TarInfo object per member with many fields we never
use, which made it the largest cost of the stock WebDataset chain. The reader
here parses only what grouping needs (name, size, type, pax/GNU long names),
reads the stream in large chunks and never seeks, so it works the same on a
local file and on a GCS download stream.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterable, Iterator
from typing import BinaryIO

from tpustream.errors import DataError

BLOCK = 512
READ_CHUNK = 1 << 20
_ZERO_BLOCK = bytes(BLOCK)
_REGULAR_TYPES = (b"0", b"\0", b"7")


class ShardFormatError(DataError):
    """A shard is truncated or is not a tar file."""


Sample = dict  # {"__key__": str, "__url__": str, "__index__": int (in the shard), "<ext>": bytes, ...}


def _parse_number(field: bytes, url: str, offset: int) -> int:
    if field and field[0] & 0x80:  # GNU base-256 encoding for sizes >= 8 GiB
        return int.from_bytes(field[1:], "big")
    digits = field.strip(b"\0 ")
    try:
        return int(digits, 8) if digits else 0
    except ValueError:
        raise ShardFormatError(f"{url}: corrupt tar header at byte {offset}") from None


def _parse_pax(data: bytes) -> dict[bytes, bytes]:
    records: dict[bytes, bytes] = {}
    pos = 0
    while pos < len(data):
        space = data.find(b" ", pos)
        if space < 0:
            break
        length = int(data[pos:space])
        if length <= 0:
            break
        key, _, value = data[space + 1 : pos + length - 1].partition(b"=")
        records[key] = value
        pos += length
    return records


def iter_shard_samples(
    stream: BinaryIO, url: str, start: int = 0, stop: int | None = None
) -> Iterator[Sample]:
    """Yield samples start..stop-1 of a WebDataset tar stream, in order.

    Members are grouped into samples by key, WebDataset's convention: the
    member name up to the first dot of its base name; the rest, lower-cased,
    is the field name. Samples before `start` are parsed but their bytes are
    not copied. Raises ShardFormatError on a truncated or corrupt stream after
    yielding every complete sample before the fault.
    """
    buf = b""
    pos = 0
    consumed = 0  # stream offset of buf[0], for error messages
    read = stream.read

    def fill(need: int) -> bool:
        """Make buf[pos:] hold at least `need` bytes; False at end of stream."""
        nonlocal buf, pos, consumed
        parts = [buf[pos:]]
        have = len(parts[0])
        while have < need:
            chunk = read(max(READ_CHUNK, need - have))
            if not chunk:
                break
            parts.append(chunk)
            have += len(chunk)
        consumed += pos
        buf = b"".join(parts) if len(parts) > 1 else parts[0]
        pos = 0
        return have >= need

    index = -1  # index of the sample being assembled
    key: str | None = None
    sample: Sample | None = None
    long_name: bytes | None = None
    pax: dict[bytes, bytes] = {}
    verify = True

    while True:
        if len(buf) - pos < BLOCK and not fill(BLOCK):
            if len(buf) - pos:
                raise ShardFormatError(f"{url}: truncated tar header at byte {consumed + pos}")
            # tarfile tolerates a missing end-of-archive marker, but every tar
            # writer emits one: without it the shard was cut at a member
            # boundary, and the sample being assembled may be incomplete.
            raise ShardFormatError(f"{url}: truncated (no end-of-archive marker) at byte {consumed + pos}")
        header = buf[pos : pos + BLOCK]
        if header == _ZERO_BLOCK:
            break
        magic = header[257:262]
        if magic != b"ustar":
            if magic != b"\0\0\0\0\0":
                raise ShardFormatError(f"{url}: not a tar header at byte {consumed + pos}")
            verify = True  # v7 headers have no magic: only the checksum tells garbage
        if verify:
            # The checksum costs about half of the per-member parsing time, so
            # after the first header the ustar magic is what catches garbage:
            # a corrupted size misaligns the next header, whose magic then fails.
            checksum = _parse_number(header[148:156], url, consumed + pos)
            if checksum != sum(header[:148]) + 256 + sum(header[156:]):
                raise ShardFormatError(f"{url}: tar header checksum mismatch at byte {consumed + pos}")
            verify = False
        size = _parse_number(header[124:136], url, consumed + pos)
        typeflag = header[156:157]
        padded = (size + BLOCK - 1) & ~(BLOCK - 1)
        member_offset = consumed + pos
        pos += BLOCK

        if typeflag in (b"x", b"L", b"g"):
            if len(buf) - pos < padded and not fill(padded):
                raise ShardFormatError(f"{url}: truncated tar member at byte {member_offset}")
            data = buf[pos : pos + size]
            pos += padded
            if typeflag == b"x":
                pax = _parse_pax(data)
            elif typeflag == b"L":
                long_name = data.rstrip(b"\0")
            continue

        if long_name is not None:
            name = long_name
        elif b"path" in pax:
            name = pax[b"path"]
        else:
            name = header[:100].split(b"\0", 1)[0]
            prefix = header[345:500].split(b"\0", 1)[0] if header[257:262] == b"ustar" else b""
            if prefix:
                name = prefix + b"/" + name
        if b"size" in pax:
            size = int(pax[b"size"])
            padded = (size + BLOCK - 1) & ~(BLOCK - 1)
        long_name = None
        pax = {}

        want = typeflag in _REGULAR_TYPES
        if want:
            text = name.decode("utf-8", "surrogateescape")
            slash = text.rfind("/")
            dot = text.find(".", slash + 1)
            want = dot > slash + 1
        if want:
            member_key = text[:dot]
            if member_key != key:
                if sample is not None:
                    yield sample
                    sample = None
                index += 1
                key = member_key
                if stop is not None and index >= stop:
                    return
                if index >= start:
                    sample = {"__key__": member_key, "__url__": url, "__index__": index}
            if sample is not None:
                if len(buf) - pos < size and not fill(size):
                    raise ShardFormatError(f"{url}: truncated tar member {text} at byte {member_offset}")
                sample[text[dot + 1 :].lower()] = buf[pos : pos + size]
        # Skip the member's data (or the rest of its padding).
        if len(buf) - pos < padded:
            skip = padded - (len(buf) - pos)
            consumed += len(buf)
            buf, pos = b"", 0
            while skip:
                chunk = read(min(skip, READ_CHUNK))
                if not chunk:
                    if sample is not None and want:
                        raise ShardFormatError(f"{url}: truncated tar member at byte {member_offset}")
                    raise ShardFormatError(f"{url}: truncated tar at byte {consumed}")
                skip -= len(chunk)
                consumed += len(chunk)
        else:
            pos += padded
    if sample is not None:
        yield sample


def write_tar(members: Iterable[tuple[str, bytes]]) -> bytes:
    """A tar archive of (name, data) members, byte-identical for identical input.

    Fixed mtime, owner and mode make reruns of shard creation reproduce the
    same bytes, so a rerun can skip shards that are already in place.
    """
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 0
            info.mode = 0o644
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()
