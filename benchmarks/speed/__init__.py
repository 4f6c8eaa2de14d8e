"""How fast, and in how much memory? Wall time and peak memory of the twin, the surrogates, the packers,
the README's command and the load generator."""
