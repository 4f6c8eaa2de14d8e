"""ML surrogates of the twin (features, training, distillation, compiled trees)."""

#: SVM and KNN are tuned on a seeded sample of at most this many training rows: an SVM's fit grows with
#: the square of the rows (431 s of search on 10,790 Llama rows), and neither model ships. (Here, not in
#: models.train, so the CLI can show the default without importing the training stack at start-up.)
DEFAULT_KERNEL_ROWS = 10_000
