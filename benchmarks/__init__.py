"""Benchmarks: the figures the docs quote, measured, never asserted in tests (docs/benchmarks.md).

Grouped by the question they answer; each runs from the repository root as a module,
``python -m benchmarks.<group>.<name> [args]``, and writes ``artifacts/benchmarks/<name>.json`` through
:func:`benchmarks.record.write_result` (the command, commit, machine and date with the figures).

* :mod:`benchmarks.speed` — how fast, and in how much memory?
* :mod:`benchmarks.fidelity` — how close to real engines and real traffic, and how noisy is "real"?
* :mod:`benchmarks.placement` — what do plans cost in GPUs, and do they hold?
* :mod:`benchmarks.policies` — what does each serving policy change, in the twin and in GPUs?
* :mod:`benchmarks.studies` — one-off investigations behind a design choice.
"""
