"""Keep the harness's load generator ahead of the engine it measures when they share CPUs.

On a small CPU machine the engine, its API server and the harness (load generator and /metrics
scraper) run on the same cores. At equal priority the harness, which needs about a tenth of a core,
waits up to half a second for a CPU while the engine's processes run: requests go out late (the
engine then sees a gap in the arrivals, and its dominant adapter's running set can empty) and
token times are stamped late. A client on its own machine does neither. So an engine started by
the harness runs at a lower priority: a higher nice value, and, where the kernel shares CPU time
between sessions first (autogroup, ``/proc/PID/autogroup``), a higher nice value for its session
too. The engine still gets every cycle the harness does not use.
"""

from __future__ import annotations

import shutil
from pathlib import Path

#: Nice units the engine runs below the harness.
ENGINE_NICENESS = 5


def niced(argv: list[str], niceness: int) -> list[str]:
    """``argv`` run ``niceness`` nice units lower (every process it starts inherits that); unchanged when
    ``niceness`` is 0 or the ``nice`` program is missing."""
    if niceness <= 0 or shutil.which("nice") is None:
        return argv
    return ["nice", "-n", str(niceness), *argv]


def lower_session_priority(pid: int, niceness: int) -> bool:
    """Raise the autogroup nice value of session leader ``pid`` by ``niceness``; False where the kernel has no
    autogroups (then the processes' own nice values already order them) or refuses."""
    path = Path(f"/proc/{pid}/autogroup")
    if niceness <= 0:
        return False
    try:
        current = int(path.read_text(encoding="ascii").split()[-1])  # "/autogroup-13 nice 0"
        path.write_text(str(min(19, current + niceness)), encoding="ascii")
    except (OSError, ValueError, IndexError):
        return False
    return True
