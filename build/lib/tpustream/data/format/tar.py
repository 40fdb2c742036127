"""Streaming tar reading (plain or gzipped: ``gunzip``) and deterministic tar writing for WebDataset shards.

Python's tarfile builds a TarInfo object per member with many fields we never
use, which made it the largest cost of the stock WebDataset chain. The reader
here parses only what grouping needs (name, size, type, pax/GNU long names),
reads the stream in large chunks and never seeks, so it works the same on a
local file and on a GCS download stream. It yields the samples WebDataset's
``tarfile_to_samples`` yields for the same bytes (tests/test_tar_stream.py
compares them), except that macOS resource forks are skipped (see
``split_member_name``), GNU sparse members are refused, and a damaged archive
raises ShardFormatError where tarfile may end quietly.
"""

from __future__ import annotations

import io
import re
import sys
import tarfile
from collections.abc import Generator, Iterable, Iterator
from typing import BinaryIO

from tpustream.data.format.gunzip import GunzipStream
from tpustream.errors import ShardFormatError

BLOCK = 512
READ_CHUNK = 1 << 20
_ZERO_BLOCK = bytes(BLOCK)

# What a header's type flag (byte 156) makes of it, looked up in one table:
# a chain of tuple tests cost more per member.
_REGULAR = 0  # tarfile.REGULAR_TYPES less GNU sparse: "0", "7" and v7's NUL
_OTHER = 1  # unknown types: tarfile skips their data and they are not regular
# Hard and symbolic links, devices, directories, FIFOs: tarfile skips no data after
# them whatever their size field says, so neither do we (tarfile._proc_builtin).
_NO_DATA = 2
_RECORD = 3  # describes the next member (pax, GNU long name/link); not a member itself
_SPARSE = 4  # GNU sparse: refused
_TYPE_KINDS = bytes(
    {ord("0"): _REGULAR, 0: _REGULAR, ord("7"): _REGULAR, ord("S"): _SPARSE}.get(
        flag, _NO_DATA if chr(flag) in "123456" else _RECORD if chr(flag) in "LKxXg" else _OTHER
    )
    for flag in range(256)
)
_LONG_NAME, _LONG_LINK, _PAX_GLOBAL = (ord(c) for c in "LKg")
_PAX_SPARSE_KEYS = (b"GNU.sparse.map", b"GNU.sparse.size", b"GNU.sparse.major")

# webdataset.tariterators: tar_file_iterator's default skip_meta, and base_plus_ext.
_META_NAME = re.compile(r"__[^/]*__($|/)")
_BASE_PLUS_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
# Fields every sample dict starts with: a member named "<key>.__url__" collides with them.
_RESERVED_FIELDS = frozenset(("__key__", "__url__", "__index__"))

_GZIP_SUFFIXES = (".tar.gz", ".tgz", ".gz")


Sample = dict  # {"__key__": str, "__url__": str, "__index__": int (in the shard), "<ext>": bytes, ...}


def split_member_name(name: str) -> tuple[str, str] | None:
    """(sample key, field) of a regular member's name as WebDataset groups it, or None to skip it.

    The key is the name up to the first dot of its base name, the field the
    rest, lower-cased (``dir/a.seg.PNG`` -> ``dir/a``, ``seg.png``). Names
    WebDataset skips: meta members (``__*__`` folders or top-level names) and
    names whose base name has no dot. The one difference: macOS resource forks
    (``._*`` base names, from tar on a Mac) are skipped here, while WebDataset
    makes ``dir/._a.jpg`` a sample "dir/" with a field "_a.jpg" (its
    base_plus_ext regex lets the key end at a slash); other names with a
    leading dot (``dir/.DS_Store``) go WebDataset's way.

    The reader's loop inlines the common case and calls this only for the rest.
    """
    if name.startswith("__") and (
        ("/" not in name and name.endswith("__")) or _META_NAME.match(name) is not None
    ):
        return None
    if name.startswith("._", name.rfind("/") + 1):
        return None
    match = _BASE_PLUS_EXT.match(name)
    if match is None:
        return None
    return match.group(1), match.group(2).lower()


def _parse_number(field: bytes, url: str, offset: int) -> int:
    """A numeric header field, as tarfile.nti reads it (octal text up to a NUL, or base-256)."""
    if field and field[0] == 0o200:  # GNU base-256, for sizes >= 8 GiB (0o377, negative, is corrupt)
        return int.from_bytes(field[1:], "big")
    digits = field.split(b"\0", 1)[0].strip()
    try:
        return int(digits, 8) if digits else 0
    except ValueError:
        raise ShardFormatError(f"{url}: corrupt tar header at byte {offset}") from None


# The pax keys that change how a member is read. webdataset's ShardWriter
# (Python's tarfile, PAX format) writes a pax record before every member that
# holds only its float mtime; one search of the record's few bytes skips
# parsing those, which took 40% of the time per sample of such shards.
_PAX_KEYS_WE_USE = re.compile(rb" (?:path|size|GNU\.sparse\.[a-z]+)=")


def _parse_pax(data: bytes, url: str, offset: int) -> dict[bytes, bytes]:
    """The records of a pax header: "<length> <key>=<value>\\n" each."""
    records: dict[bytes, bytes] = {}
    pos = 0
    while pos < len(data):
        space = data.find(b" ", pos)
        if space < 0:
            break
        try:
            length = int(data[pos:space])
        except ValueError:
            raise ShardFormatError(f"{url}: corrupt pax header at byte {offset}") from None
        if length <= 0:
            raise ShardFormatError(f"{url}: corrupt pax header at byte {offset}")
        key, equals, value = data[space + 1 : pos + length - 1].partition(b"=")
        if not equals:
            break  # tarfile stops at the first record it cannot read, too
        records[key] = value
        pos += length
    return records


def _apply_record(
    typeflag: int,
    data: bytes,
    long_name: bytes | None,
    long_size: int | None,
    global_pax: dict[bytes, bytes],
    url: str,
    offset: int,
) -> tuple[bytes | None, int | None]:
    """The next member's (long name, size) after a record describing it (GNU long name, pax).

    A pax global record updates global_pax instead (it holds for every later
    member). The outermost record wins, as in tarfile, where each record's
    handler patches the member read after it. Records are rare in shards (a
    pax header only for a long name or a huge size), so this is a call of
    its own, apart from _scan_shard's per-member loop.
    """
    if typeflag == _LONG_NAME:
        return (data.split(b"\0", 1)[0] if long_name is None else long_name), long_size
    if typeflag == _LONG_LINK or not (typeflag == _PAX_GLOBAL or _PAX_KEYS_WE_USE.search(data)):
        return long_name, long_size
    records = _parse_pax(data, url, offset)
    if typeflag == _PAX_GLOBAL:
        global_pax.update(records)
        return long_name, long_size
    if any(sparse in records for sparse in _PAX_SPARSE_KEYS):
        raise ShardFormatError(f"{url}: sparse member at byte {offset} is not supported")
    if long_name is None and b"path" in records:
        long_name = records[b"path"].rstrip(b"/")  # tarfile._apply_pax_info
    if long_size is None and b"size" in records:
        long_size = _parse_pax_size(records[b"size"], url, offset)
    return long_name, long_size


def _scan_shard(stream: BinaryIO, url: str, start: int, stop: int | None) -> Generator[Sample, None, int]:
    """Yield samples start..stop-1; return the number of samples scanned (all of them when stop is None).

    One loop serves reading (iter_shard_samples) and counting
    (count_shard_samples, which yields nothing): the bytes of samples before
    `start` are never copied.
    """
    buf = b""
    pos = 0
    consumed = 0  # stream offset of buf[0], for error messages
    read = stream.read

    def fill(need: int) -> bool:
        """Make buf[pos:] hold at least `need` bytes; False at end of stream."""
        nonlocal buf, pos, consumed
        have = len(buf) - pos
        parts = [buf[pos:]] if have else []
        while have < need:
            chunk = read(max(READ_CHUNK, need - have))
            if not chunk:
                break
            parts.append(chunk)
            have += len(chunk)
        consumed += pos
        buf = parts[0] if len(parts) == 1 else b"".join(parts)
        pos = 0
        return have >= need

    index = -1  # index of the sample being assembled
    key: str | None = None
    sample: Sample | None = None  # the sample being assembled, if it is in the window
    fields: Sample | set[str] = set()  # its field names, for the duplicate check
    # Set by the records before a member (_apply_record).
    long_name: bytes | None = None
    long_size: int | None = None
    global_pax: dict[bytes, bytes] = {}  # 'g' records hold for every later member
    verify = True

    while True:
        if len(buf) - pos < BLOCK and not fill(BLOCK):
            if len(buf) - pos:
                raise ShardFormatError(f"{url}: truncated tar header at byte {consumed + pos}")
            # tarfile tolerates a missing end-of-archive marker, but every tar
            # writer emits one: without it the shard was cut at a member
            # boundary, and the sample being assembled may be incomplete.
            raise ShardFormatError(f"{url}: truncated (no end-of-archive marker) at byte {consumed + pos}")
        # The header is read in place (startswith/find with offsets, single
        # bytes by index): slicing out the 512-byte block cost more than all
        # the checks that replace it.
        if buf[pos] == 0 and buf[pos : pos + BLOCK] == _ZERO_BLOCK:
            break
        if not buf.startswith(b"ustar", pos + 257):
            if not buf.startswith(b"\0\0\0\0\0", pos + 257):
                raise ShardFormatError(f"{url}: not a tar header at byte {consumed + pos}")
            verify = True  # v7 headers have no magic: only the checksum tells garbage
        if verify:
            # The checksum costs about half of the per-member parsing time, so
            # after the first header the ustar magic is what catches garbage:
            # a corrupted size misaligns the next header, whose magic then fails.
            checksum = _parse_number(buf[pos + 148 : pos + 156], url, consumed + pos)
            if checksum != sum(buf[pos : pos + 148]) + 256 + sum(buf[pos + 156 : pos + BLOCK]):
                raise ShardFormatError(f"{url}: tar header checksum mismatch at byte {consumed + pos}")
            verify = False
        # Writers put 11 octal digits and a NUL; anything else (spaces,
        # base-256, NUL padding) takes the general parser.
        try:
            if buf[pos + 135]:
                raise ValueError
            size = int(buf[pos + 124 : pos + 135], 8)
        except ValueError:
            size = _parse_number(buf[pos + 124 : pos + 136], url, consumed + pos)
        typeflag = buf[pos + 156]
        kind = _TYPE_KINDS[typeflag]
        member_offset = consumed + pos
        pos += BLOCK

        if kind == _RECORD:
            padded = (size + BLOCK - 1) & ~(BLOCK - 1)
            if len(buf) - pos < padded and not fill(padded):
                raise ShardFormatError(f"{url}: truncated tar member at byte {member_offset}")
            data = buf[pos : pos + size]
            pos += padded
            long_name, long_size = _apply_record(
                typeflag, data, long_name, long_size, global_pax, url, member_offset
            )
            continue
        if kind == _SPARSE:
            raise ShardFormatError(f"{url}: sparse member at byte {member_offset} is not supported")

        regular = kind == _REGULAR
        if long_name is not None:
            name = long_name
        else:
            end = buf.find(b"\0", pos - BLOCK, pos - 412)
            name = buf[pos - BLOCK : end if end >= 0 else pos - 412]
            if buf[pos - 167]:  # ustar prefix (bytes 345..500), read whatever the magic, as tarfile does
                end = buf.find(b"\0", pos - 167, pos - 12)
                name = buf[pos - 167 : end if end >= 0 else pos - 12] + b"/" + name
        if typeflag == 0:  # v7 regular: a name ending in "/" makes it a directory (tarfile.frombuf)
            end = buf.find(b"\0", pos - BLOCK, pos - 412)
            regular = not buf[pos - BLOCK : end if end >= 0 else pos - 412].endswith(b"/")
        if global_pax:
            if long_name is None and b"path" in global_pax:
                name = global_pax[b"path"].rstrip(b"/")
            if long_size is None and b"size" in global_pax:
                long_size = _parse_pax_size(global_pax[b"size"], url, member_offset)
        if long_size is not None:
            size = long_size
        long_name = long_size = None
        padded = 0 if kind == _NO_DATA else (size + BLOCK - 1) & ~(BLOCK - 1)

        want = False
        if regular:
            text = name.decode("utf-8", "surrogateescape")
            slash = text.rfind("/")
            dot = text.find(".", slash + 1)
            # split_member_name's answer without regexes (a call per member
            # costs ~5% of the loop): the base name has a dot after its first
            # character, the name is not meta (no leading "__") and has no
            # newline (base_plus_ext's "." matches none).
            if dot > slash + 1 and not text.startswith("__") and "\n" not in text:
                member_key = text[:dot]
                field = text[dot + 1 :].lower()
                want = True
            else:
                split = split_member_name(text)
                if split is not None:
                    member_key, field = split
                    want = True
        if want:
            if member_key != key:
                if sample is not None:
                    yield sample
                    sample = None
                index += 1
                key = member_key
                if stop is not None and index >= stop:
                    return index
                if index >= start:
                    sample = fields = {"__key__": member_key, "__url__": url, "__index__": index}
                else:
                    fields = set(_RESERVED_FIELDS)
            if field in fields:
                # WebDataset's group_by_keys raises here too (a ValueError).
                raise ShardFormatError(f"{url}: sample {key} has two {field} members (second: {text})")
            if sample is not None:
                if len(buf) - pos < size and not fill(size):
                    raise ShardFormatError(f"{url}: truncated tar member {text} at byte {member_offset}")
                sample[field] = buf[pos : pos + size]
            else:
                fields.add(field)  # type: ignore[union-attr]  # a set outside the window
        # Skip the member's data (or the rest of its padding). A member that
        # fits in a read goes through the buffer: discarding the buffer and
        # reading just the rest made counting 20% slower than reading.
        if len(buf) - pos < padded and (padded > READ_CHUNK or not fill(padded)):
            skip = padded - (len(buf) - pos)
            consumed += len(buf)
            buf, pos = b"", 0
            while skip:
                chunk = read(min(skip, READ_CHUNK))
                if not chunk:
                    raise ShardFormatError(f"{url}: truncated tar member at byte {member_offset}")
                skip -= len(chunk)
                consumed += len(chunk)
        else:
            pos += padded
    if sample is not None:
        yield sample
    return index + 1


def _parse_pax_size(value: bytes, url: str, offset: int) -> int:
    try:
        return int(value)
    except ValueError:
        raise ShardFormatError(f"{url}: corrupt pax size {value[:20]!r} at byte {offset}") from None


def iter_shard_samples(
    stream: BinaryIO, url: str, start: int = 0, stop: int | None = None
) -> Iterator[Sample]:
    """Yield samples start..stop-1 of a WebDataset tar stream, in order.

    Members are grouped into samples as WebDataset's tarfile_to_samples groups
    them (``split_member_name``): consecutive regular members with the same
    key form a sample; a key that comes back later starts a new one. Samples
    before `start` are parsed but their bytes are not copied. Raises
    ShardFormatError on a truncated or corrupt stream, or a sample with two
    members of the same field, after yielding every complete sample before
    the fault.
    """
    return _scan_shard(stream, url, start, stop)


def count_shard_samples(stream: BinaryIO, url: str) -> int:
    """The number of samples iter_shard_samples yields for the whole stream, copying no member bytes.

    Raises ShardFormatError where iter_shard_samples would.
    """
    scan = _scan_shard(stream, url, sys.maxsize, None)
    try:
        next(scan)
    except StopIteration as done:
        return done.value
    raise AssertionError("a scan with start=sys.maxsize yielded a sample")


def open_tar_stream(stream: BinaryIO, url: str) -> BinaryIO:
    """The tar bytes of a shard: `stream` gunzipped if the URL ends in .tar.gz, .tgz or .gz, else `stream`."""
    if url.lower().endswith(_GZIP_SUFFIXES):
        return GunzipStream(stream, url)  # type: ignore[return-value]
    return stream


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
