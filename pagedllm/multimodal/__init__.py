"""Multimodal (image) input: loading (`media`), HF-processor preprocessing and placeholder expansion
(`processing`), the plain-data features that travel with a request (`inputs`), the scheduler's encoder
cache bookkeeping (`encoder_cache`) and the model runner's encoder step (`runner`)."""
