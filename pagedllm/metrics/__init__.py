"""Engine metrics: the periodic log line (`loggers`) and Prometheus metrics (`prometheus`).

Nothing here is imported by `import pagedllm` or the offline `LLM`; `prometheus_client` is only imported
by `pagedllm.metrics.prometheus`, which the server loads.
"""
