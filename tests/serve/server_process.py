"""A `deepinfer serve` subprocess on a free loopback port, as a user starts it; ready once /health
answers (however long loading takes: tests/waits.py); stopped by SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx2

from waits import HANG_S, finish, wait_until


def free_port() -> int:
    from deepinfer.distributed.group import free_port as pick

    return pick("127.0.0.1")


class ServerProcess:
    def __init__(self, *flags: str, cache, api_key: str | None = None, env: dict | None = None):
        """env: more environment variables for the server."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        extra = env or {}
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(DEEPINFER_CACHE=str(cache), OMP_NUM_THREADS="1", **extra)
        key = ["--api-key", api_key] if api_key else []
        argv = [sys.executable, "-m", "deepinfer", "serve", "--port", str(self.port), *key, *flags]
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            wait_until(self.healthy, "the server answering /health", self.proc, every_s=0.2)
        except BaseException:
            self.stop()
            raise

    def healthy(self) -> bool:
        try:
            return httpx2.get(f"{self.url}/health", timeout=HANG_S).status_code == 200
        except httpx2.TransportError:  # not listening yet
            return False

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def metrics(self) -> dict[str, float]:
        """The metrics' samples by their text name (labels included)."""
        text = httpx2.get(f"{self.url}/metrics", headers=self.headers(), timeout=HANG_S).text
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                samples[name] = float(value)
        return samples

    def stop(self) -> tuple[int, str]:
        """SIGTERM, then (exit code, stderr) once it has exited."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code, _, err = finish(self.proc, "the server after SIGTERM")
        return code, err
