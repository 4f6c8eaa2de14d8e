"""The user-facing error hierarchy.

Every error a user can cause or act on derives from :class:`LoraPlannerError`; the CLI turns these
into one-line messages and exit codes instead of tracebacks.
"""


class LoraPlannerError(Exception):
    """Base class of errors reported to the user as a message (no traceback)."""

    exit_code = 1


class BadInputError(LoraPlannerError):
    """The user's input (workload, profile, flag) is wrong; the message says how to fix it."""

    exit_code = 2


class WorkloadError(BadInputError):
    """A workload file or workload description is invalid."""


class ProfileError(BadInputError):
    """A profile is missing, malformed, or cannot serve what was asked."""


class InfeasibleError(LoraPlannerError):
    """No configuration satisfies the constraints (e.g. not enough GPUs)."""

    exit_code = 3


class EngineStartError(LoraPlannerError):
    """A real vLLM engine did not start for another reason than memory: its log says why; what was measured
    before is kept, and the same command, rerun once that is fixed, resumes."""


class OutOfTimeError(LoraPlannerError):
    """A time budget (a GPU lease's ``--deadline``) would run out before the next step: the work done is
    saved and the same command, rerun, resumes it."""

    exit_code = 5


def printable(text: str) -> str:
    """``text`` with control characters escaped, so a message stays one line whatever a name holds."""
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)
