"""A `deepinfer serve` subprocess on a free loopback port, as a user starts it; stopped by SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx2


def free_port() -> int:
    from deepinfer.distributed.group import free_port as pick

    return pick("127.0.0.1")


class ServerProcess:
    def __init__(self, *flags: str, cache, api_key: str | None = None, timeout_s: float = 120, env: dict | None = None):
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
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}: {self.proc.stderr.read()}")
            try:
                if httpx2.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx2.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("the server did not answer /health in time")

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def metrics(self) -> dict[str, float]:
        """The metrics' samples by their text name (labels included)."""
        text = httpx2.get(f"{self.url}/metrics", headers=self.headers(), timeout=10).text
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                samples[name] = float(value)
        return samples

    def stop(self, timeout: float = 60) -> tuple[int, str]:
        """SIGTERM, then (exit code, stderr)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            _, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return self.proc.returncode, err
