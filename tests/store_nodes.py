"""Start store nodes as subprocesses (as scripts/start_store_nodes.sh does) for tests."""

from __future__ import annotations

import json
import os
import select
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class RunningNode:
    proc: subprocess.Popen
    root: Path
    host: str
    ucx_port: int
    http_port: int
    token: str

    @property
    def push_url(self) -> str:
        return f"{self.host}:{self.ucx_port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    def stop(self, sig=signal.SIGTERM, timeout=60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


def start_node(root: Path, token: str, *extra: str, ucx_port: int = 0, timeout: float = 60) -> RunningNode:
    token_file = root.parent / f".{root.name}.token"
    token_file.write_text(token)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "r3rdma.store.cli", "--root", str(root), "--token-file", str(token_file),
         "--ucx-port", str(ucx_port), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, remaining))
        if not ready:
            proc.kill()
            raise TimeoutError(f"store node did not report ready in {timeout} s: {proc.stderr.read()}")
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"store node exited with {proc.wait()}: {proc.stderr.read()}")
        info = json.loads(line)
        if info.get("event") == "ready":
            return RunningNode(proc, root, info["host"], info["ucx_port"], info["http_port"], token)


def new_token() -> str:
    return secrets.token_hex(32)
