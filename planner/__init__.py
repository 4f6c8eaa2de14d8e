"""Placement: workload CSV I/O, packers, baselines, placement schema, the planner CLI."""
