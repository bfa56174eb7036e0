"""OpenAI-compatible HTTP server (`pagedllm serve`). Needs the `serve` extras (fastapi, uvicorn, pyzmq,
prometheus_client); nothing here is imported by `import pagedllm`."""
