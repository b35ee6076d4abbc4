"""`python -m ggml_py` is the `ggml-py` command."""

from ggml_py.commands.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
