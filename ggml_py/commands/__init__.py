"""Subcommands of `ggml-py`: each module has add_arguments(parser) and run(args) -> result or (result, exit code)."""
