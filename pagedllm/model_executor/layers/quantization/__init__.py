"""Quantized linear methods (`quantization=...`, as vLLM names them): `gguf` keeps GGUF block weights packed."""
