"""Log files as the readers see them: plain or gzip (told by the first bytes, whatever the name), read in chunks
of whole lines, with a progress bar on a terminal."""

from __future__ import annotations

import gzip
import io
import itertools
import os
import sys
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from planner.workload_csv import printable
from twin.errors import BadInputError

CHUNK = 16 << 20  # bytes read at once
MAX_LINE = CHUNK  # a longer line is refused: no request record is that long, and memory stays bounded
GZIP_MAGIC = b"\x1f\x8b"
BOM = b"\xef\xbb\xbf"
READ_ERRORS = (OSError, EOFError, zlib.error)  # gzip.BadGzipFile is an OSError


def where(path: str | os.PathLike) -> str:
    """A path as messages name it (one line, whatever it holds)."""
    return printable(str(path))


class Progress:
    """A byte count of the logs read, drawn by tqdm on stderr when it is a terminal and the read takes over a
    second; nothing otherwise (a CI log stays clean)."""

    def __init__(self, paths: list[Path]) -> None:
        from tqdm import tqdm

        total = sum(_size(p) for p in paths)
        self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="reading logs",
                        file=sys.stderr, disable=not sys.stderr.isatty(), delay=1.0, leave=False, mininterval=0.5)
        self.done = 0  # bytes of the files read before the current one

    def at(self, position: int) -> None:
        """The current file has been read up to ``position`` (its bytes on disk)."""
        self.bar.update(max(0, self.done + position - self.bar.n))

    def file_done(self, path: Path) -> None:
        self.done += _size(path)
        self.at(0)

    def close(self) -> None:
        self.bar.close()


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


@contextmanager
def open_log(path: Path) -> Iterator[tuple[io.BufferedIOBase, io.BufferedReader]]:
    """The log's bytes (decompressed if it is gzip) and the file on disk (whose position is the progress)."""
    try:
        raw = open(path, "rb")  # noqa: SIM115 -- closed below
    except OSError as exc:
        raise BadInputError(f"{where(path)}: cannot read the log ({exc.strerror or exc})") from None
    try:
        gz = raw.peek(2)[:2] == GZIP_MAGIC
        yield (gzip.GzipFile(fileobj=raw, mode="rb") if gz else raw), raw
    finally:
        raw.close()


def read(stream, path: Path, size: int) -> bytes:
    """Up to ``size`` bytes, a damaged gzip stream being bad input."""
    try:
        return stream.read(size)
    except READ_ERRORS as exc:
        raise BadInputError(f"{where(path)}: cannot read the log ({exc})") from None


def first_byte(path: Path) -> bytes:
    """The log's first byte that is not whitespace (after a UTF-8 byte order mark), b'' if none in 1 MiB."""
    with open_log(path) as (stream, _raw):
        head = read(stream, path, 1 << 20)
    return head.removeprefix(BOM).lstrip()[:1]


def line_chunks(path: Path, progress: Progress | None) -> Iterator[tuple[bytes, int]]:
    """The log in chunks of whole lines (each ends at a newline, or the end of the file; no byte order mark),
    each with the number of lines before it."""
    lines = 0
    tail = b""
    with open_log(path) as (stream, raw):
        data = read(stream, path, CHUNK).removeprefix(BOM)
        while data or tail:
            buf = tail + data if tail else data
            first_end = data.find(b"\n")
            if tail and len(tail) + (first_end if first_end >= 0 else len(data)) > MAX_LINE:
                raise _long_line(path, lines + 1)
            cut = buf.rfind(b"\n") + 1 if data else len(buf)
            chunk, tail = buf[:cut], buf[cut:]
            if chunk:
                yield chunk, lines
                lines += chunk.count(b"\n")
            if progress is not None:
                progress.at(raw.tell())
            data = read(stream, path, CHUNK) if data else b""


def text_lines(text: io.TextIOBase, path: Path) -> Iterator[str]:
    """The lines of a log opened as text, each refused past MAX_LINE characters (as :func:`line_chunks` does)."""
    for number in itertools.count(1):
        line = text.readline(MAX_LINE + 1)
        if not line:
            return
        if len(line) > MAX_LINE:
            raise _long_line(path, number)
        yield line


def _long_line(path: Path, number: int) -> BadInputError:
    return BadInputError(f"{where(path)}:{number}: a line longer than {MAX_LINE:,} bytes; a request log has one "
                         "request a line")
