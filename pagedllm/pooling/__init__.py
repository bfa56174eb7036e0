"""Pooling models: embeddings, classification, scoring and reranking (vLLM's `runner="pooling"`).

`config.py` resolves the runner, the tasks and the pooler config (sentence-transformers files),
`pooler.py` turns a step's hidden states into per-request results, `runner.py` is the model runner for
pooling models (prefill-only requests through the same scheduler), `inputs.py` builds pooling requests,
`llm_api.py` the `LLM.embed/classify/score/reward/encode` methods, `adapters.py` the `convert="classify"`
head for decoder-only models."""
