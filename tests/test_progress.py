"""Progress of long work written to a log (not a terminal): a line every ``every_s`` seconds, and the end once."""

from __future__ import annotations

import io
import time

from twin.progress import Progress


def _shares(log: io.StringIO) -> list[str]:
    return [line.split("%")[0].split()[-1] for line in log.getvalue().splitlines()]


def test_a_log_gets_each_line_once_and_short_work_prints_nothing():
    log = io.StringIO()
    bar = Progress(3, "work", every_s=0.0, stream=log)
    for _ in range(3):
        bar.advance()
    bar.close()
    assert _shares(log) == ["33", "67", "100"]  # the last line is not repeated by close()
    log = io.StringIO()
    bar = Progress(4, "work", every_s=0.05, stream=log)
    time.sleep(0.06)
    bar.advance()  # printed: every_s has passed
    bar.advance()  # not printed: too soon
    bar.close()  # so close() prints where the work stopped
    assert _shares(log) == ["25", "50"]
    quiet = io.StringIO()
    bar = Progress(3, "short", every_s=60.0, stream=quiet)
    bar.advance(3)
    bar.close()
    assert quiet.getvalue() == ""
