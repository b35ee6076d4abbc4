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
