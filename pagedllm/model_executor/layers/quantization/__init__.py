"""Quantized linear methods (`quantization=...`, vLLM's method names): `gguf` keeps GGUF block weights
packed (CPU); `fp8` (online or vLLM's checkpoints), `compressed-tensors` (FP8 / INT8 W8A8), `awq` and
`gptq` (int4) read their checkpoints' tensors. `base.py` holds the registry and the hook the layers use."""
