"""The measurement window of real runs: arrivals over [0, duration), what finishes after the warm-up counts.

Runs stored by `planner validate` and `planner profile` record the window they were measured with; scoring
them again (`planner rescore`, `planner calibrate`) takes it from them, since another window scores other
requests (runs of 10 s scored as 30 s count every request as unfinished past 10 s)."""

from __future__ import annotations

from twin.errors import BadInputError

#: The window of runs that record none (`planner validate`'s defaults when they were made).
UNRECORDED = (30.0, 5.0)


def check_window(duration_s: float, warmup_s: float) -> None:
    """Before any run: the warm-up leaves a window to measure (BadInputError)."""
    if duration_s <= warmup_s:
        raise BadInputError(f"--duration {duration_s:g} s must be longer than --warmup {warmup_s:g} s: what follows "
                            "the warm-up is measured")


def run_window(rows: list[dict], duration_s: float | None, warmup_s: float | None, where: str,
               unrecorded: tuple[float, float] = UNRECORDED) -> tuple[float, float]:
    """(duration, warm-up) of the stored runs ``rows`` (saved cases of ``where``): as they record it, where a value
    given must agree; for runs that record none, as given, else ``unrecorded``."""
    recorded = {(r["duration_s"], r["warmup_s"]) for r in rows if "duration_s" in r}
    if len(recorded) > 1:
        raise BadInputError(f"{where}: runs measured with different windows ("
                            + ", ".join(f"{d:g} s after {w:g} s" for d, w in sorted(recorded))
                            + "); score each set apart")
    if recorded:
        duration, warmup = recorded.pop()
        for flag, given, made in (("--duration", duration_s, duration), ("--warmup", warmup_s, warmup)):
            if given is not None and given != made:
                raise BadInputError(f"{flag} {given:g}: the runs of {where} were made with {flag} {made:g}; leave "
                                    f"{flag} out")
        return duration, warmup
    duration = unrecorded[0] if duration_s is None else duration_s
    warmup = unrecorded[1] if warmup_s is None else warmup_s
    check_window(duration, warmup)
    return duration, warmup
