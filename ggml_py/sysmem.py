"""What the kernel says about memory: used to refuse, with a clear error, sizes no allocation could satisfy."""

from __future__ import annotations


def available_memory() -> int | None:
    """Bytes the kernel says can be allocated without swapping (MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(text: str) -> int:
    """Bytes from '600M', '1.5G', '2GiB' or '1048576' (binary units); ValueError naming the text otherwise."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1] if t and t[-1] in "KMGT" else ""
    try:
        n = float(t[: len(t) - len(unit)])
    except ValueError:
        raise ValueError(f"not a size: {text!r} (e.g. 600M, 1.5G or a number of bytes)") from None
    if not n > 0 or n != n or n == float("inf"):
        raise ValueError(f"not a positive size: {text!r}")
    return int(n * _UNITS[unit])
