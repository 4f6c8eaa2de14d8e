"""How close to reality? The twin, the surrogates, the profiles' terms and the forecast against real runs,
real GPUs and traffic of a known shape, and the noise of the real measurements themselves (the floor under
any error)."""
