"""Input files: only regular ones are read, and those read whole (workloads, ranks, placements, load generator
records) with a bound on the bytes read.

A device (``/dev/zero``, ``/dev/urandom``) or a FIFO never ends, and a directory is no file; a file over the
reader's cap is refused before it is read, so no input can exhaust memory. (Logs are streamed, in bounded
memory whatever their size: ``planner.log_files``.)
"""

from __future__ import annotations

import os
import stat

from twin.atomic import file_kind
from twin.errors import BadInputError, printable


def read_capped(path: str | os.PathLike, limit: int, what: str) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them; ``what`` names the file in messages
    ("the workload"). Anything else is a BadInputError naming the path."""
    where = printable(str(path))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)  # a FIFO opens without a writer
    except OSError as exc:
        raise BadInputError(f"{where}: cannot read {what} ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadInputError(f"{where}: cannot read {what}: it is {file_kind(st.st_mode)}, not a regular file")
        try:
            data = f.read(limit + 1) if st.st_size <= limit else b""
        except OSError as exc:
            raise BadInputError(f"{where}: cannot read {what} ({exc.strerror})") from None
    if st.st_size > limit or len(data) > limit:  # the latter: it grew while read
        raise BadInputError(f"{where}: too large for {what} (over {limit:,} bytes)")
    return data


def check_regular(path: str | os.PathLike, what: str) -> None:
    """Refuse ``path`` unless it is a readable regular file (before a reader that streams it opens it)."""
    where = printable(str(path))
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise BadInputError(f"{where}: cannot read {what} ({exc.strerror})") from None
    if not stat.S_ISREG(mode):
        raise BadInputError(f"{where}: cannot read {what}: it is {file_kind(mode)}, not a regular file")
    if not os.access(path, os.R_OK):
        raise BadInputError(f"{where}: cannot read {what} (permission denied)")
