"""A JSON file holding one array of objects (Alpaca's alpaca_data.json, ShareGPT dumps, most
`data.json` files): its elements read one at a time from a bounded buffer, never the whole file
(json.load holds ~2.5 times the file: +170 MB for 67 MB, measured), each from the byte after the
one before, so the scan can mark where rows start and a job read from there, as for JSON lines
(jsonl.py)."""
from __future__ import annotations

import codecs
import json
from typing import IO, Any, Callable, Iterator

CHUNK = 1 << 20  # bytes read at a time
MAX_ELEMENT_CHARS = 1 << 28  # an element longer than this is named rather than buffered on
WHITESPACE = " \t\n\r"
BOM = "\ufeff"


class ArrayError(ValueError):
    """The file is not one JSON array of values; the message says where."""


def starts_array(head: bytes) -> bool:
    """Whether a file starting with `head` holds a JSON array (its first character, after a byte
    order mark and whitespace, is `[`; JSON lines start with `{`)."""
    return head.removeprefix(codecs.BOM_UTF8).lstrip(WHITESPACE.encode())[:1] == b"["


def elements(fh: IO[bytes], position: int = 0, number: int = 0
             ) -> Iterator[tuple[int, Any, str, Callable[[], int]]]:
    """(number, value, its JSON text, byte position just after it) of each element of the array in
    `fh` (an open binary file), from its start, or (`number` > 0) from just after element `number`,
    which ends at byte `position`. ArrayError naming the element and byte where the file is not
    a JSON array, ends inside it, or goes on after it."""
    reader = _Reader(fh, position if number else 0)
    if not number:
        if reader.next_char() == BOM:  # a byte order mark, as Windows saves UTF-8
            reader.i += 1
        if reader.next_char() != "[":
            raise ArrayError("a JSON array starts with [")
        reader.i += 1
        if reader.next_char() == "]":  # an empty array
            reader.i += 1
            return reader.end()
    elif not reader.comma_or_end(number):
        return reader.end()
    while True:
        value, start, end = reader.value(number + 1)
        number += 1
        yield number, value, reader.text[start:end], reader.position_at(end)
        reader.i = end
        if not reader.comma_or_end(number):
            return reader.end()


class _Reader:
    """Decoded text of a binary file from byte `base` on, a chunk at a time; `i` indexes `text`."""

    def __init__(self, fh: IO[bytes], base: int):
        fh.seek(base)
        self.fh, self.base, self.text, self.i = fh, base, "", 0
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.eof = False

    def more(self, chars: int = 1) -> bool:
        """Read on, a chunk at a time, until `chars` more characters are read (a chunk at least) or
        the file ends, joined on at once (dropping text already passed); False at the end of the file."""
        if self.eof:
            return False
        if self.i > CHUNK:
            self.base += len(self.text[:self.i].encode("utf-8"))
            self.text, self.i = self.text[self.i:], 0
        read: list[str] = []
        while not read or chars > 0 and not self.eof:
            data = self.fh.read(CHUNK)
            self.eof = not data
            read.append(self.decoder.decode(data, final=self.eof))
            chars -= len(read[-1])
        self.text = "".join([self.text, *read])  # one copy: += on an attribute copies the text each time
        return True

    def next_char(self) -> str:
        """The next character that is not whitespace ("" at the end of the file), not consumed."""
        while True:
            while self.i < len(self.text) and self.text[self.i] in WHITESPACE:
                self.i += 1
            if self.i < len(self.text) or not self.more():
                return self.text[self.i:self.i + 1]

    def comma_or_end(self, number: int) -> bool:
        """After element `number`: True past a comma (another element follows), False at the `]`."""
        char = self.next_char()
        if char in (",", "]"):
            self.i += 1
            return char == ","
        found = f"found {char!r}" if char else "the file ends (cut short?)"
        raise ArrayError(f"after element {number} (byte {self.position_at(self.i)()}): expected , or ], {found}")

    def value(self, number: int) -> tuple[Any, int, int]:
        """(value, start, end) of the JSON value starting at the next character. A value that ends
        where the text read so far does is parsed again with more (a number may go on); the text
        read for it doubles each time (up to MAX_ELEMENT_CHARS and a chunk), so a 200 MB element is
        parsed 8 times, not once a chunk, 200 times (quadratic: 3 s for 64 MiB)."""
        decoder = json.JSONDecoder()
        self.next_char()
        while True:
            try:
                value, end = decoder.raw_decode(self.text, self.i)
                if end < len(self.text) or self.eof:
                    return value, self.i, end
            except json.JSONDecodeError as exc:
                if self.eof or len(self.text) - self.i > MAX_ELEMENT_CHARS:
                    where = f"element {number} (byte {self.position_at(self.i)()})"
                    reason = "the file ends inside it (cut short?)" if self.eof and exc.pos >= len(self.text) - 1 \
                        else exc.msg if self.eof else f"longer than {MAX_ELEMENT_CHARS} characters or not JSON"
                    raise ArrayError(f"{where}: not valid JSON ({reason})") from None
            except ValueError as exc:  # a whole number of over 4300 digits: Python refuses it
                raise ArrayError(f"element {number} (byte {self.position_at(self.i)()}): cannot be read ({exc})") \
                    from None
            pending = len(self.text) - self.i
            self.more(min(pending, MAX_ELEMENT_CHARS + 1 - pending))

    def end(self) -> None:
        """After the closing `]`: only whitespace may follow."""
        char = self.next_char()
        if char:
            raise ArrayError(f"byte {self.position_at(self.i)()}: {char!r} after the array's closing ]")

    def position_at(self, index: int) -> Callable[[], int]:
        """The byte offset of text index `index`, computed when asked (the scan asks at its marks)."""
        base, text = self.base, self.text
        return lambda: base + len(text[:index].encode("utf-8"))
