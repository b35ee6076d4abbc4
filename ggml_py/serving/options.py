"""The HTTP server's limits and access policy (no dependencies: the CLI reads its defaults without importing the
server's)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServeOptions:
    """The server's limits and access policy (flags of `ggml-py serve`; docs/serving.md, "Limits and security").

    max_body_bytes: a larger request body is refused with 413 before it is read (Content-Length) or as soon as the
    bytes streamed pass it. max_prompt_chars: a longer prompt (the characters of a completion's prompt, of a chat's
    message contents together) is refused with 400 before it is tokenized; None: the tokens of a sequence's context
    times the bytes of the longest token, which no fitting prompt exceeds. header_timeout: seconds for a request head
    to arrive (from the connection, or from the previous response); body_timeout: seconds for a request body to
    arrive once its head has (408). keep_alive_timeout: seconds an idle keep-alive connection stays open.
    max_connections: open connections beyond which the one that has waited longest for its request head is closed
    (or, when every connection is busy, the new one). drain_timeout: seconds the open requests may take to finish on
    shutdown before they are cancelled. api_key: if set, /v1/* and /metrics need `Authorization: Bearer <key>`.
    allowed_hosts: Host headers accepted besides the bound address and localhost ("*" any, "*.example.com" a
    domain). cors_origins: origins a browser may call from (CORS; "*" any); none by default.
    max_embedding_inputs: inputs one /v1/embeddings request may have (OpenAI's own limit, 2048, by default: a
    client that batches as many as OpenAI accepts works here too); each is also held to max_prompt_chars and to a
    sequence's context in tokens."""

    max_body_bytes: int = 8 * 2**20
    max_prompt_chars: int | None = None
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    keep_alive_timeout: int = 5
    max_connections: int = 1024
    drain_timeout: float = 30.0
    api_key: str | None = None
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()
    max_embedding_inputs: int = 2048
