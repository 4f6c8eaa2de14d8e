"""Request states of the engine loops (``state`` arrays of :mod:`twin.core` and :mod:`twin.policies.engine`)."""

PENDING, WAITING, RUNNING, FINISHED, REJECTED = 0, 1, 2, 3, 4
