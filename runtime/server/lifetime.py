"""Serving until told to stop: uvicorn on a socket bound beforehand, and SIGTERM (or SIGINT) draining first.

On the first SIGTERM or SIGINT the server drains: ``/health`` and new requests answer 503, the requests queued
and running finish and their answers are sent, then the process leaves :func:`serve` (exit status 0 for the
command). A second signal stops at once: unfinished requests end as cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` (0: any free port), bound before anything slow happens so a
    port in use is refused at once, in one line (``ValueError``)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: not an address this machine knows ({e.strerror})") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({e.strerror}); pick another --port") from None
    return sock


def serve(app: Any, sock: socket.socket, *, ready: Callable[[int], None] | None = None) -> None:
    """Serve ``app`` (from :func:`rolecall.runtime.server.create_app`) on ``sock`` until a signal has drained it (see the
    module's docstring). ``ready(port)`` is called once the server accepts connections."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:  # ours drain first (_serve), then let uvicorn stop
            yield

    server = Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                   timeout_graceful_shutdown=None))
    asyncio.run(_serve(server, app.state.serving, sock, ready))


async def _serve(server: Any, serving: Any, sock: socket.socket, ready: Callable[[int], None] | None) -> None:
    loop = asyncio.get_running_loop()

    def drain_then_exit() -> None:
        serving.scheduler.drain()
        server.should_exit = True

    def stop(_: int) -> None:
        if serving.draining:  # a second signal: now (close() waits for the engine's step: not on this loop)
            threading.Thread(target=serving.scheduler.close, name="rolecall-close", daemon=True).start()
            server.should_exit = server.force_exit = True
            return
        serving.draining = True
        threading.Thread(target=drain_then_exit, name="rolecall-drain", daemon=True).start()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop, sig)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.02)
    if server.started and ready is not None:
        ready(sock.getsockname()[1])
    await task


__all__ = ["bind", "serve"]
