"""Run a store node as a subprocess and wait for it to be ready (benches and tests).

``r3rdma-store`` prints one JSON line ``{"event": "ready", ...}`` once it listens; this waits
for that line (no polling), so callers get the ports the OS picked.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from r3rdma.transport.auth import derive_admin_token, derive_read_token
from r3rdma.transport.ucx_env import without_our_choices

from .address import NodeAddress

__all__ = ["NodeProcess", "spawn_node", "new_token"]


@dataclass
class NodeProcess:
    """A running ``r3rdma-store`` subprocess (stderr goes to ``log``)."""

    proc: subprocess.Popen
    root: Path
    address: NodeAddress
    token: str  # the push secret (UCX); HTTP takes read_token / admin_token, never this
    log: Path
    read_token_file: Path | None = None  # where the node wrote its read token (ready line)
    http_workers: int = 0  # processes serving its HTTP port (ready line; 0: the node itself)

    @property
    def read_token(self) -> str:
        """The HTTP read token (GET/HEAD): ``derive_read_token(token)``."""
        return derive_read_token(self.token)

    @property
    def admin_token(self) -> str:
        """The HTTP admin token (DELETE): ``derive_admin_token(token)``."""
        return derive_admin_token(self.token)

    host = property(lambda self: self.address.host)
    ucx_port = property(lambda self: self.address.ucx_port)
    http_port = property(lambda self: self.address.http_port)
    push_url = property(lambda self: self.address.push_url)
    http_url = property(lambda self: self.address.http_url)

    @property
    def alive(self) -> bool:
        """True while the node process has not exited."""
        return self.proc.poll() is None

    def _status(self, key: str) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        raise KeyError(key)

    def rss(self) -> int:
        """Resident memory now, bytes."""
        return self._status("VmRSS")

    def peak_rss(self) -> int:
        """Peak resident memory since start (VmHWM), bytes."""
        return self._status("VmHWM")

    def kill(self) -> None:
        """SIGKILL the node (no drain) if it is still running, and reap it (waits up to 30 s)."""
        if self.alive:
            self.proc.kill()
        self.proc.wait(30)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        """Send ``sig`` (SIGTERM: the node drains, then exits 0) and return the exit status."""
        if self.alive:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


def new_token() -> str:
    """A fresh push secret: 32 random bytes as 64 hex characters."""
    return secrets.token_hex(32)


def spawn_node(
    root: str | os.PathLike[str],
    token: str,
    *extra: str,
    fsize_limit: int | None = None,
    timeout: float = 60.0,
) -> NodeProcess:
    """Start a store node on ``root`` (ports picked by the OS); return once it printed ready.

    ``fsize_limit``: run it under ``RLIMIT_FSIZE`` with SIGXFSZ ignored, so writing past the
    limit fails with EFBIG (a stand-in for a full disk that needs no mount).
    """
    root = Path(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    token_file = root.parent / f".{root.name}.token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    log = root.parent / f"{root.name}.log"
    args = ["--root", str(root), "--token-file", str(token_file), *extra]
    if fsize_limit is None:
        cmd = [sys.executable, "-m", "r3rdma.store.cli", *args]
    else:
        # Set the limit in the child itself (preexec_fn is unsafe with the UCX threads here).
        boot = (
            "import resource, signal, sys, runpy; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({int(fsize_limit)}, {int(fsize_limit)})); "
            "sys.argv = ['r3rdma-store'] + sys.argv[1:]; runpy.run_module('r3rdma.store.cli', run_name='__main__')"
        )
        cmd = [sys.executable, "-c", boot, *args]
    # The node makes its own UCX choices (STORE_NODE_UCX_ENV: blocking progress), as one started
    # from a shell does, not the defaults this process applied for its own clients.
    env = dict(without_our_choices(os.environ), PYTHONUNBUFFERED="1")
    env.pop("R3_STORE_TOKEN", None)
    if fsize_limit is not None:
        # UCX's posix shared-memory transport backs its pools with files, which the limit
        # would break; this node speaks TCP only (peers negotiate it).
        env["UCX_TLS"] = "tcp,self"
    with open(log, "ab") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while True:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            proc.kill()
            raise TimeoutError(f"store node on {root} not ready in {timeout} s; log: {log}")
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"store node on {root} exited with {proc.wait()}: {log.read_text()[-2000:]}")
        try:
            info = json.loads(line)
        except ValueError:
            print(f"store node stdout: {line!r}", file=sys.stderr)
            continue
        if isinstance(info, dict) and info.get("event") == "ready":
            read_file = info.get("read_token_file")
            return NodeProcess(
                proc,
                root,
                NodeAddress(info["host"], info["ucx_port"], info["http_port"]),
                token,
                log,
                Path(read_file) if read_file else None,
                info.get("http_workers", 0),
            )
