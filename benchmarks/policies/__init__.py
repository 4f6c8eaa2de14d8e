"""What does a serving policy change? Chameleon, Toppings and ELORA against their baselines in the twin,
beside the papers' figures, and the GPUs each policy needs for the same workloads (docs/policies.md)."""
