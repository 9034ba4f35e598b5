"""FP8 numerics: element formats, scale rules (as Transformer Engine computes them) and the fused,
mergeable statistics of one tensor. Pure maths on tensors; imports nothing else of fp8track."""
