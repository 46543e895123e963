"""A TCP proxy in front of a test server that breaks connections on demand: real network
faults for the client's retry and reconnect rules (nothing of ours is faked).

- ``lose_answers = n``: the next ``n`` answers from the server are not passed on; the
  connection is cut instead (the server did the work, the client never hears of it).
- ``drop_all()``: cut every open connection (a worker's socket drops).
- ``refuse = True``: accept and at once close new connections (the server is unreachable).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class TcpProxy:
    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.lose_answers = 0
        self.refuse = False
        self.accepted = 0
        self.accepted_at: list[float] = []  # time.monotonic() of each accept
        self.lost = 0
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._upstream: set[socket.socket] = set()  # the proxy's own ends towards the target
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            with self._lock:
                self.accepted += 1
                self.accepted_at.append(time.monotonic())
            if self.refuse:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            for sock in (client, upstream):  # a small write is passed on at once (no Nagle)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._open.update((client, upstream))
                self._upstream.add(upstream)
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, answers: bool) -> None:
        try:
            while data := source.recv(65536):
                if answers:
                    with self._lock:
                        lose = self.lose_answers > 0
                        if lose:
                            self.lose_answers -= 1
                            self.lost += 1
                    if lose:
                        break
                sink.sendall(data)
        except OSError:
            pass
        finally:
            self._cut(source, sink)

    def _cut(self, *socks: socket.socket) -> None:
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()
            with self._lock:
                self._open.discard(sock)
                self._upstream.discard(sock)

    def upstream_ports(self) -> list[int]:
        """The local ports of the connections open to the target (as the target sees them)."""
        with self._lock:
            socks = list(self._upstream)
        ports = []
        for sock in socks:
            with contextlib.suppress(OSError):
                ports.append(sock.getsockname()[1])
        return ports

    def drop_all(self) -> None:
        with self._lock:
            socks = list(self._open)
        self._cut(*socks)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.listener.close()
        self.drop_all()
