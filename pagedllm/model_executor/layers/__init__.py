"""Tensor-parallel-aware building blocks shared by the model definitions."""
