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


def _status_bytes(field: str) -> int | None:
    """A size from /proc/self/status (e.g. VmRSS, VmHWM), None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def rss_bytes() -> int | None:
    """This process's resident memory now (VmRSS), None where Linux does not tell it."""
    return _status_bytes("VmRSS")


def peak_rss_bytes() -> int:
    """This process's peak RSS: VmHWM of its own memory map where Linux tells it (ru_maxrss also counts the RSS of
    the process it was forked from)."""
    peak = _status_bytes("VmHWM")
    if peak is not None:
        return peak
    import resource
    import sys

    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r) * (1 if sys.platform == "darwin" else 1024)


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
