"""ML surrogates of the twin (features, training, distillation, compiled trees)."""
