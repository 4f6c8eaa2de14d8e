"""The process heap kept for the twin's runs.

Each twin run allocates its requests and engine state afresh, megabytes apiece for an hour of a busy GPU, and frees
them at its end. glibc's malloc serves blocks that large from fresh ``mmap`` pages and gives a heap's freed top back
to the system, so every run faulted in and zeroed its memory again: a fifth of a twin-packed plan's time was the
kernel's. :func:`keep_freed_memory` has malloc keep what runs free for the next ones.
"""

from __future__ import annotations

import ctypes
import ctypes.util

#: glibc's ``mallopt`` parameters (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
#: Blocks up to this size come from the heap (glibc's own ceiling for its adaptive threshold on 64-bit systems).
MMAP_THRESHOLD = 32 << 20
#: Free memory at the heap's top is given back to the system only above this.
TRIM_THRESHOLD = 64 << 20


def keep_freed_memory() -> bool:
    """Have this process's malloc (and its forked workers') reuse freed blocks of up to :data:`MMAP_THRESHOLD` and
    keep up to :data:`TRIM_THRESHOLD` free, for a peak a few percent higher; False where the C library is not glibc
    or refused a setting."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
