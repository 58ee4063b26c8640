"""Writing to benchmarks/RESULTS.md: where a section was measured (the commit, the CPU, the JAX backend), and the
append."""

from __future__ import annotations

import os
import platform
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "RESULTS.md")


def commit() -> str:
    return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()


def cpu_name() -> str:
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), name)
    except OSError:
        return name


def describe() -> str:
    """``commit abc1234; machine: 2 cores, <cpu>, jax 0.10.2 on cpu``."""
    import jax

    return f"commit {commit()}; machine: {os.cpu_count()} cores, {cpu_name()}, jax {jax.__version__} on " \
           f"{jax.default_backend()}"


def append(text: str) -> None:
    """Add a section at the end of RESULTS.md."""
    with open(RESULTS, "a", encoding="utf-8") as f:
        f.write("\n" + text)
