"""Tar headers, read one at a time and the data between them skipped: what the WebDataset scan walks
(a shard of 10,000 samples holds 30,000 headers). tarfile builds a TarInfo per header in Python,
parsing every field (16k samples/s measured); this takes from each 512-byte block only what a
sample needs, the name, type and size, with tarfile's checks (the header checksum, a truncated
header, data past the end of the file) and one it lacks (a file ending at a header, without the
end-of-archive blocks: cut short, the members after lost), and its extensions: a pax (`x`) or GNU
long-name (`L`) header naming the member after it (GNU long-link (`K`) and pax `linkpath` naming a
link's target), ustar's name prefix, base-256 sizes. A hard or symbolic link is read as the member
before it that it names, as tarfile's extractfile reads it (GNU tar stores a file hard-linked on
disk, or archived twice, as a link to its first copy): a sample's `cls` or image member that is a
link was dropped, its label read as missing. A name is only looked up among the archive's members,
never on disk."""
from __future__ import annotations

import posixpath
import re
from typing import IO, Iterator, NamedTuple

BLOCK = 512
ZERO_BLOCK = bytes(BLOCK)
HIGH_BYTES = bytes(range(128, 256))
POSIX_MAGIC = b"ustar\x00"  # a GNU header's magic is b"ustar  ": its bytes 345-500 hold times, not a prefix
REGULAR = (b"0", b"\x00", b"7")  # a file; 7: contiguous file, read as one (tarfile too)
NO_DATA = (b"1", b"2", b"3", b"4", b"5", b"6")  # links, devices, folders, fifos: no data (tarfile's rule)
HARD_LINK, SYMBOLIC_LINK = b"1", b"2"
LINKS = (HARD_LINK, SYMBOLIC_LINK)  # read as the member they name
# Headers for the member after them: pax (x, X: this member; g: every member), GNU long name (L) and
# long link target (K), each with its text as data.
EXTENSIONS = (b"x", b"X", b"g", b"L", b"K")
PAX_RECORD = re.compile(rb"(\d+) ([^=]+)=")
MAX_EXTENSION_BYTES = 16 << 20  # an extended header's text, read whole: names, a link's target, pax records


class TarError(Exception):
    """A tar file that cannot be read as one; the message names the byte offset."""


class Member(NamedTuple):
    name: str
    offset: int  # byte offset of its first header (its pax or long-name header's, when it has one)
    offset_data: int
    size: int


def check_tar(fh: IO[bytes]) -> None:
    """TarError unless the file starts with a tar header (or the end-of-archive blocks): a
    compressed or other file is named before any member is looked for."""
    fh.seek(0)
    block = fh.read(BLOCK)
    if not block:
        raise TarError("empty file")
    if block != ZERO_BLOCK:
        _header(block, 0)


def members(fh: IO[bytes], position: int, file_size: int, end: float = float("inf")) -> Iterator[Member]:
    """The regular-file members whose headers start at `position` and after (before `end`), in
    order, a link as the member it names (its data's offset and size); TarError naming the byte
    where a header is damaged, a link names no member before it, a member ends past `file_size` or
    the file ends before the end-of-archive blocks (a zero block: every tar writer ends the archive
    with two)."""
    extended: dict[str, str | int] = {}  # path, size and link target for the next member (pax, GNU)
    first = position
    named: dict[str, Member] | None = None  # by normalized name, from the first link on (most tars have none)
    while position < end:
        fh.seek(position)
        block = fh.read(BLOCK)
        if block == ZERO_BLOCK:  # the end-of-archive blocks
            return
        if not block:  # tarfile and tar stop here too, without a word: the members after are lost
            raise TarError(f"ends at byte {position}, a member's header, without the end-of-archive blocks: "
                           f"the shard is cut short (or its writer was never closed)")
        if len(block) < BLOCK:
            raise TarError(f"damaged tar header at byte {position} (truncated header)")
        kind, name, size = _header(block, position)
        if kind in EXTENSIONS:
            if size > MAX_EXTENSION_BYTES:  # read whole: a damaged header's size of gigabytes ran out of memory
                raise TarError(f"the extended header at byte {position} holds {size} bytes, more than a name and pax "
                               f"records take (at most {MAX_EXTENSION_BYTES}): damaged")
            payload = _payload(fh, position, size, file_size, name)
            if kind in (b"L", b"K"):
                text = payload.split(b"\x00", 1)[0].decode("utf-8", "surrogateescape")
                extended["path" if kind == b"L" else "linkpath"] = text
            else:
                extended.update(_pax(payload, position, global_=kind == b"g"))
            position += BLOCK + _padded(size)
            continue
        if kind == b"S":
            raise TarError(f"member {name!r} at byte {position} is a sparse file, which a sample cannot hold")
        name, size = str(extended.get("path", name)), int(extended.get("size", size))
        data = position + BLOCK
        if data + size > file_size:
            raise TarError(f"member {name!r} ends after the end of the file (byte {data + size} of {file_size}): "
                           f"the shard is cut short")
        regular = kind in REGULAR and not (kind == b"\x00" and name.endswith("/"))  # V7 marks a folder so
        if kind in LINKS and named is None:  # the first link: the members before it, their headers walked again
            named = _named(fh, first, file_size)
        if regular or kind in LINKS:
            where = (_linked(named, kind, name, str(extended.get("linkpath", _text(block[157:257]))), first)
                     if kind in LINKS else (data, size))
            member = Member(name, first, *where)
            if named is not None:
                named[posixpath.normpath(name)] = member
            yield member
        position = data if kind in NO_DATA or (kind == b"\x00" and not regular) else data + _padded(size)
        extended, first = {}, position


def _named(fh: IO[bytes], position: int, file_size: int) -> dict[str, Member]:
    """The members whose headers start before `position`, by normalized name (the last of a name)."""
    return {posixpath.normpath(member.name): member for member in members(fh, 0, file_size, end=position)}


def _linked(named: dict[str, Member], kind: bytes, name: str, target: str, position: int) -> tuple[int, int]:
    """(data offset, size) of the member a link names, found as tarfile finds it: a hard link's target is the archive's
    name, a symbolic link's is relative to the link's folder. Only members before the link are
    looked in (tarfile looks after a symbolic link too, which a walk of the headers has not read)."""
    path = "/".join(filter(None, (posixpath.dirname(name), target))) if kind == SYMBOLIC_LINK else target
    if posixpath.normpath(path) not in named:
        raise TarError(f"member {name!r} at byte {position} is a link to {target!r}, which no member before it is")
    return named[posixpath.normpath(path)][2:]


def _header(block: bytes, position: int) -> tuple[bytes, str, int]:
    """(type, name, size) of a header block; TarError if its checksum or a number is not a tar's."""
    try:
        stored = _number(block[148:156])
        unsigned = 256 + sum(block) - sum(block[148:156])  # the checksum field counts as 8 spaces
        if stored != unsigned:
            high = BLOCK - 8 - len((block[:148] + block[156:]).translate(None, HIGH_BYTES))
            if stored != unsigned - 256 * high:  # old tars summed signed bytes (tarfile accepts both)
                raise TarError(f"damaged tar header at byte {position} (bad checksum)")
        size = _number(block[124:136])
    except ValueError:
        raise TarError(f"damaged tar header at byte {position} (invalid header)") from None
    if size < 0:  # base 256 holds negative numbers: the next header would be this one or one before it
        raise TarError(f"damaged tar header at byte {position} (negative size {size})")
    name = _text(block[0:100])
    if block[257:263] == POSIX_MAGIC and block[345] != 0:
        name = f"{_text(block[345:500])}/{name}"
    return block[156:157], name, size


def _number(field: bytes) -> int:
    """A numeric field: octal digits (NUL or space ended), or base-256 when its first byte's top bit is set."""
    if field[0] in (0o200, 0o377):  # tarfile's rule: 0o200 positive, 0o377 negative
        value = int.from_bytes(field[1:], "big")
        return value if field[0] == 0o200 else value - (1 << (8 * (len(field) - 1)))
    digits = field.split(b"\x00", 1)[0].strip()
    return int(digits, 8) if digits else 0


def _text(field: bytes) -> str:
    return field.split(b"\x00", 1)[0].decode("utf-8", "surrogateescape")


def _padded(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


def _payload(fh: IO[bytes], position: int, size: int, file_size: int, name: str) -> bytes:
    if position + BLOCK + size > file_size:
        raise TarError(f"member {name!r} ends after the end of the file (byte {position + BLOCK + size} "
                       f"of {file_size}): the shard is cut short")
    fh.seek(position + BLOCK)
    return fh.read(size)


def _pax(payload: bytes, position: int, global_: bool) -> dict[str, str | int]:
    """A pax header's path, size and link target, for the member after it. A global header (`g`) is
    for every member after it, which a part's job starting mid-shard would not see: one naming a
    path, size or link target is refused, its other records (comments, times) are not needed."""
    records: dict[str, str | int] = {}
    start = 0
    while match := PAX_RECORD.match(payload, start):
        length = int(match.group(1))
        if length <= len(match.group(0)):
            raise TarError(f"damaged pax header at byte {position} (invalid record length {length})")
        keyword = match.group(2).decode("utf-8", "surrogateescape")
        value = payload[match.end():start + length - 1]
        if keyword == "path":
            records["path"] = value.decode("utf-8", "surrogateescape")
        elif keyword == "linkpath":
            records["linkpath"] = value.decode("utf-8", "surrogateescape")
        elif keyword == "size":
            try:
                records["size"] = int(value)
            except ValueError:
                raise TarError(f"damaged pax header at byte {position} (size {value[:20]!r})") from None
            if records["size"] < 0:  # would read the member's data to the end of the file, and step back
                raise TarError(f"damaged pax header at byte {position} (negative size {records['size']})")
        start += length
    if global_ and records:
        raise TarError(f"the global pax header at byte {position} sets {', '.join(records)} for every member after "
                       f"it, which a shard read from a mark cannot honour")
    return records
