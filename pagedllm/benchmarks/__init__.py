"""Benchmarks run by `pagedllm bench ...`. Each module has `add_cli_args(parser)` and `main(args) -> int`."""
