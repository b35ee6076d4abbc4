"""The text of a profile (Plan.profile_report / Model.profile_report): where a step's time went, per backend, split
and op. Shared by `ggml-py generate --profile` and `ggml-py bench model --profile`."""

from __future__ import annotations

from typing import Any

TOP_OPS = 6  # ops listed per backend, the slowest first


def plan_profile_lines(prof: dict[str, Any], indent: str = "  ") -> list[str]:
    """One plan's profile: the time per compute and the host's share, then per backend its splits, nodes, time and
    slowest ops (ops only from backends that time their nodes)."""
    step = prof["seconds_per_compute"]
    host = prof["host_seconds_per_compute"]
    lines = [f"{indent}{prof['computes']} computes, {1e3 * step:.2f} ms each (host {1e3 * host:.2f} ms)"]
    by_backend: dict[str, dict[str, float]] = {}
    for sp in prof["splits"]:
        b = by_backend.setdefault(sp["backend"], {"splits": 0, "nodes": 0, "copies": 0, "seconds": 0.0})
        for k in ("nodes", "copies", "seconds"):
            b[k] += sp[k]
        b["splits"] += 1
    for name, b in by_backend.items():
        share = 100 * b["seconds"] / step if step else 0.0
        lines.append(f"{indent}  {name:<10} {int(b['splits'])} split(s), {int(b['nodes'])} nodes, "
                     f"{int(b['copies'])} copies in: {1e3 * b['seconds']:.2f} ms ({share:.0f}%)")
        ops = list(prof.get("by_backend_op", {}).get(name, {}).items())[:TOP_OPS]
        if ops:
            lines.append(f"{indent}    " + " | ".join(f"{op} {1e3 * sec:.2f} ms" for op, sec in ops))
    if "overlaps" in prof:  # asynchronous backends: what their queues did while the host computed
        ov = prof["overlaps"]
        lines.append(f"{indent}  copy/compute overlaps in the last compute: {len(ov)}" + (
            f", e.g. {ov[0]['copy']} ran {1e3 * ov[0]['seconds']:.3f} ms during {ov[0]['during']} on "
            f"{ov[0]['on']}" if ov else ""))
    lines += [f"{indent}warning: {w}" for w in prof["warnings"]]
    return lines


def model_profile_lines(plans: list[dict[str, Any]]) -> list[str]:
    """Model.profile_report(): every step plan that computed, by its tokens per step."""
    lines = []
    for p in plans:
        what = "1-token steps" if p["tokens"] == 1 else f"{p['tokens']}-token steps" + (
            " (last logits only)" if p["last_only"] else "")
        lines.append(f"profile of the {what}:")
        lines += plan_profile_lines(p)
    return lines
