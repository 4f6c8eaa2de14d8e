"""One-off investigations behind a design choice: the simulated duration of training scenarios, forest
size, the saturation feature, and what one LoRA slot costs in KV cache."""
