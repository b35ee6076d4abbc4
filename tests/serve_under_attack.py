"""Issue 24's "must show", as a command: `ggml-py serve` on SmolLM2, and at once one client sending a 1 MB stop
string, one a 4 MB prompt (each over and over), and 1,000 slow-header connections; meanwhile a 2-token chat request is
timed, several times.

    .venv/bin/python tests/serve_under_attack.py [--tries 9] [--slow 1000] [--stop-mb 1] [--prompt-mb 4] [-t 2]

Prints one JSON object: the latencies (min / median / max), what the hostile clients got, the server's settings.
tests/test_serve_limits.py runs it (smaller) in the suite."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # serve_helpers, also under PYTHONSAFEPATH=1
from serve_helpers import ServerProc, timed_chat, under_attack  # noqa: E402


def measure(tries: int = 9, n_slow: int = 1000, stop_mb: float = 1, prompt_mb: float = 4, threads: int = 2,
            server_args: tuple[str, ...] = ()) -> dict:
    from ggml_py.models import default_model_path

    s = ServerProc(default_model_path(), "--parallel", "4", "-t", str(threads), *server_args)
    try:
        timed_chat(s.url)  # warm: the batched plan is prepared on the first request
        quiet = [timed_chat(s.url)[0] for _ in range(3)]
        r = under_attack(s.url, n_slow=n_slow, tries=tries, stop_chars=int(stop_mb * 2**20),
                         prompt_chars=int(prompt_mb * 2**20))
        health = s.metrics()
    finally:
        code, _ = s.stop()
    lat = r["latencies_s"]
    return {**r, "latency_min_s": min(lat), "latency_median_s": statistics.median(lat), "latency_max_s": max(lat),
            "quiet_latency_median_s": statistics.median(quiet), "server_exit": code,
            "server_log_tracebacks": s.log_text.count("Traceback"),
            "requests_finished": health["requests_finished"], "server_args": list(server_args)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tries", type=int, default=9)
    ap.add_argument("--slow", type=int, default=1000, help="slow-header connections")
    ap.add_argument("--stop-mb", type=float, default=1)
    ap.add_argument("--prompt-mb", type=float, default=4)
    ap.add_argument("-t", "--threads", type=int, default=2)
    a = ap.parse_args(argv)
    r = measure(a.tries, a.slow, a.stop_mb, a.prompt_mb, a.threads)
    print(json.dumps(r, indent=1))
    return 0 if r["latency_max_s"] < 1.0 and r["server_exit"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
