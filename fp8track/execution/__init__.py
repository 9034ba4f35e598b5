"""Running a model in FP8: recipes, which layers stay in BF16, ``apply_fp8`` and the backends
(CPU emulation, torchao, Transformer Engine). Reads numerics; knows nothing of monitoring."""
