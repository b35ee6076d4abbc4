"""`ggml-py bench chat`: time to first token, turn by turn, of a multi-turn chat against two real servers, one with
the prefix cache (the default) and one without (`--no-prefix-cache`), in one run.

Each turn sends the whole conversation so far (a system prompt, the questions, the answers so far) as a streamed
/v1/chat/completions request, greedy, and times the first content chunk from the moment the request is sent. The
two servers get the same conversation turn by turn (which one goes first alternates), so both see the same machine
load; with the cache, a turn computes only the tokens after the last whole block the previous turns left behind,
without it the whole conversation again. The answers must be the same on both (determinism): the run says whether
they are.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
from typing import Any
from urllib.parse import urlsplit

from ggml_py.errors import GgmlPyError

SYSTEM = ("You are a patient teacher who answers questions about geography, history and science. Answer in two or "
          "three sentences, plainly, without lists. ") * 3
QUESTIONS = ["What is the capital of France?", "What river runs through it?", "How long is that river?",
             "Which other big cities does it pass?", "What is the capital of Italy?", "Which of the two is older?",
             "Who founded it, according to legend?", "What is the tallest mountain in Europe?",
             "Is it in France or in Italy?", "Thank you. Summarize what we discussed."]


class _Server:
    """`ggml-py serve` in a subprocess on a free port."""

    def __init__(self, model: str, threads: int, *extra: str) -> None:
        cmd = [sys.executable, "-m", "ggml_py", "serve", "-m", model, "--port", "0", "-t", str(threads),
               "--parallel", "1", "--ctx", "4096", *extra]
        self.p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        assert self.p.stderr is not None
        deadline = time.time() + 120
        lines = []
        while time.time() < deadline:
            line = self.p.stderr.readline()
            if not line:
                raise GgmlPyError("the server did not start: " + "".join(lines[-5:]))
            lines.append(line)
            if "listening on http://" in line:
                u = urlsplit(line.split("listening on ")[1].strip())
                self.host, self.port = u.hostname or "127.0.0.1", u.port or 0
                return
        raise GgmlPyError("the server did not start within 120 s")

    def turn(self, messages: list[dict[str, str]], n_gen: int) -> tuple[float, str, dict[str, Any]]:
        """Stream one chat completion: seconds to the first content chunk, the answer, the usage."""
        body = json.dumps({"messages": messages, "max_tokens": n_gen, "temperature": 0, "stream": True,
                           "stream_options": {"include_usage": True}})
        conn = http.client.HTTPConnection(self.host, self.port, timeout=600)
        t0 = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise GgmlPyError(f"the server answered {resp.status}: {resp.read()[:300]!r}")
        ttft, text, usage = None, [], {}
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for ch in chunk.get("choices", []):
                piece = ch.get("delta", {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(piece)
        conn.close()
        return ttft if ttft is not None else time.perf_counter() - t0, "".join(text), usage

    def close(self) -> None:
        self.p.terminate()
        try:
            self.p.wait(30)
        except subprocess.TimeoutExpired:
            self.p.kill()


def run(model: str | None = None, threads: int = 2, n_gen: int | None = None, rounds: int | None = None,
        json: bool = False, quick: bool = False, **_: Any) -> dict[str, Any]:
    from ggml_py.models import default_model_path

    path = model or default_model_path()
    if not os.path.exists(path):
        raise GgmlPyError(f"no model at {path}")
    n_gen = n_gen or (8 if quick else 48)
    turns = min(rounds or len(QUESTIONS), len(QUESTIONS))
    on, off = _Server(path, threads), None
    try:
        off = _Server(path, threads, "--no-prefix-cache")
        convo: dict[str, list[dict[str, str]]] = {k: [{"role": "system", "content": SYSTEM}] for k in ("on", "off")}
        rows = []
        for k in range(turns):
            got = {}
            for name in (("on", "off") if k % 2 == 0 else ("off", "on")):
                convo[name].append({"role": "user", "content": QUESTIONS[k]})
                got[name] = (on if name == "on" else off).turn(convo[name], n_gen)
                convo[name].append({"role": "assistant", "content": got[name][1]})
            u_on, u_off = got["on"][2], got["off"][2]
            rows.append({"turn": k + 1, "prompt_tokens": u_on.get("prompt_tokens"),
                         "cached_tokens": (u_on.get("prompt_tokens_details") or {}).get("cached_tokens"),
                         "ttft_s_cache": got["on"][0], "ttft_s_no_cache": got["off"][0],
                         "same_answer": got["on"][1] == got["off"][1] and u_off.get("prompt_tokens") ==
                         u_on.get("prompt_tokens")})
    finally:
        on.close()
        if off is not None:
            off.close()
    return {"model": path, "threads": threads, "n_gen": n_gen, "turns": rows,
            "answers_identical": all(r["same_answer"] for r in rows)}


def report(r: dict[str, Any]) -> str:
    lines = [f"bench chat: {os.path.basename(r['model'])}, {r['threads']} threads, greedy answers of at most "
             f"{r['n_gen']} tokens, time to first token per turn (the whole conversation sent each turn)",
             f"{'turn':>4} {'prompt':>7} {'cached':>7} {'cache on':>10} {'cache off':>10} {'off/on':>7}"]
    for t in r["turns"]:
        lines.append(f"{t['turn']:>4} {t['prompt_tokens']:>7} {t['cached_tokens']:>7} "
                     f"{t['ttft_s_cache'] * 1e3:>8.1f}ms {t['ttft_s_no_cache'] * 1e3:>8.1f}ms "
                     f"{t['ttft_s_no_cache'] / t['ttft_s_cache']:>6.2f}x")
    lines.append("answers identical with and without the cache: " + ("yes" if r["answers_identical"] else "NO"))
    return "\n".join(lines)
