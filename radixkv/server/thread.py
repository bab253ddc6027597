"""ServerThread: an app under uvicorn in a background thread, on a loopback socket bound before
it starts (so there is no port race), with the connection guards of the app's ServerLimits
(radixkv.server.guards.connections); used by the tests, the load test and anyone embedding.
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from radixkv.server.guards.connections import uvicorn_options
from radixkv.server.limits import ServerLimits


class ServerThread:
    """uvicorn.Server in a background thread, on a socket bound before it starts (no port race)."""

    def __init__(self, app, host: str = "127.0.0.1", limits: ServerLimits | None = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.port = self.sock.getsockname()[1]
        self.base_url = f"http://{host}:{self.port}"
        if limits is None:  # a radixkv app's own limits (create_app), else the defaults
            state = getattr(getattr(app, "state", None), "radixkv", None)
            limits = getattr(state, "limits", None) or ServerLimits()
        config = uvicorn.Config(
            app, log_level="warning", lifespan="off", timeout_graceful_shutdown=5, **uvicorn_options(limits)
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()
