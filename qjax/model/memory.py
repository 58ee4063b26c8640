"""How much memory a device can still take — one answer for the loader's check before it reads a checkpoint, the
server's plan and the speed runs.

A GPU's allocator reports its pool (``memory_stats()["bytes_limit"]``) and what is allocated from it
(``bytes_in_use``); CPU devices report nothing, and their arrays live in host memory, shared by every CPU device of
the process: ``MemAvailable`` of ``/proc/meminfo`` (what the kernel can hand out without swapping, page cache
included), else the free pages ``sysconf`` counts.
"""

from __future__ import annotations

import os

import jax

__all__ = ["host_available", "device_limit", "available"]


def host_available() -> int | None:
    """Bytes of host memory available to a new allocation (None: this system says nothing)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (OSError, ValueError, AttributeError):
        return None


def _stats(device) -> dict:
    try:
        return device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - CPU devices (and some plugins) have no allocator statistics
        return {}


def device_limit(device=None) -> int | None:
    """The size of ``device``'s memory pool (``bytes_limit``; None on CPU, whose arrays are host memory)."""
    stats = _stats(device if device is not None else jax.local_devices()[0])
    return int(stats["bytes_limit"]) if stats.get("bytes_limit") else None


def available(device=None) -> tuple[int | None, str]:
    """(bytes ``device`` — default: the first local one — can still allocate, what they are, for a message): its
    pool less what is in use, or on CPU the host's available memory; (None, …) when neither is known."""
    device = device if device is not None else jax.local_devices()[0]
    stats = _stats(device)
    if stats.get("bytes_limit"):
        free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        return free, f"free memory of {device.device_kind} {device.id}"
    return host_available(), "available host memory (MemAvailable)"
