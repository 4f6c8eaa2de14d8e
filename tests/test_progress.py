"""Progress of long work written to a log (not a terminal): a line every ``every_s`` seconds, and the end once."""

from __future__ import annotations

import io
import time
from types import SimpleNamespace

from twin.progress import Progress, counter


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


def test_a_counter_leaves_what_was_done_before_it_started_out_of_the_rate(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("twin.progress.time", SimpleNamespace(monotonic=lambda: now[0]))
    log = io.StringIO()
    report = counter("twin", unit="GPU", stream=log, every_s=0.0)
    report(6, 10)  # six answers kept from before: done at once
    now[0] += 2.0
    report(8, 10)  # two simulated in 2 s
    now[0] += 2.0
    report(10, 10)  # two more in 2 s
    lines = log.getvalue().splitlines()
    assert [line.split("%")[0].split()[-1] for line in lines] == ["60", "80", "100"]
    assert "1.00GPU/s" in lines[-1]  # 4 GPUs in 4 s, not 10 in 4 s
