"""Serving test helpers: the reference a served request must equal (``qjax.generate`` on it alone), and a live
``qjax serve`` started as its own process on 127.0.0.1 (a free port), stopped with SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import requests

import qjax
from qjax.serving import SamplingParams


class Server:
    """``qjax serve ARGS --port 0``; ``url`` is its root once it answers /health."""

    def __init__(self, args: list[str], *, env: dict | None = None, timeout: float = 600):
        cmd = [sys.executable, "-m", "qjax.cli", "serve", *args, "--port", "0"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, **(env or {})})
        self.stderr: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()
        self.url = None
        deadline = time.monotonic() + timeout
        for line in self.proc.stdout:  # the address is printed once the socket is bound
            if "listening on " in line:
                self.url = line.split("listening on ", 1)[1].strip()
                break
        if self.url is None:
            self.proc.wait(30)
            raise RuntimeError(f"qjax serve exited {self.proc.returncode}: {''.join(self.stderr)[-4000:]}")
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()
        self.health: list[tuple[int, str]] = []  # what /health answered while the server warmed up
        while time.monotonic() < deadline:
            try:
                r = requests.get(self.url + "/health", timeout=5)
                self.health.append((r.status_code, r.text))
                if r.status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise RuntimeError("qjax serve did not answer /health")

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.stderr.append(line)

    def metrics(self) -> dict[str, float]:
        """The unlabelled value of every ``qjax:`` series without a histogram suffix."""
        out = {}
        for line in requests.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("qjax:") and "_bucket" not in line:
                name, value = line.rsplit(" ", 1)
                out[name.split("{", 1)[0]] = float(value)
        return out

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def alone(model, prompt, sp: SamplingParams, width: int = 128) -> list[int]:
    """qjax.generate on this one prompt, cut after its first stop token (generate pads after it). The prompt is
    left-padded to ``width`` (masked: generate gives a padded row exactly its unpadded tokens, tests/test_generate.py)
    so that references of different lengths share compiled programs."""
    eos = list(model.generation_config.eos_token_id)
    ids = np.zeros((1, width), np.int32)
    mask = np.zeros((1, width), np.int32)
    ids[0, width - len(prompt):], mask[0, width - len(prompt):] = prompt, 1
    out = qjax.generate(model, ids, attention_mask=mask, max_new_tokens=sp.max_tokens, do_sample=not sp.greedy,
                        temperature=1.0 if sp.greedy else sp.temperature, top_k=sp.top_k, top_p=sp.top_p,
                        seed=sp.seed or 0, eos_token_id=eos)[0, width:].tolist()
    for i, t in enumerate(out):
        if t in eos:
            return out[:i + 1]
    return out
