"""Bytes on disk: GGUF files, block quantization formats, the file quantizer."""
