"""A TCP proxy in front of a test server that breaks connections on demand: real network
faults for the client's retry and reconnect rules (nothing of ours is faked).

- ``lose_answers = n``: the next ``n`` answers from the server are not passed on; the
  connection is cut instead (the server did the work, the client never hears of it).
- ``drop_all()``: cut every open connection (a worker's socket drops).
- ``go_dark()``: every connection open, and every one made until ``light()``, passes nothing
  either way from then on, and stays open: a server that hangs, or is gone while nothing
  tells its clients (the proxy's kernel still acknowledges what they send). After
  ``light()`` new connections pass again; those made dark never do.
- ``refuse = True``: accept and at once close new connections (the server is unreachable).
- ``cut_at_commit(marker, reaches_server=...)``: once, on the first connection that sends a
  ``COMMIT`` after sending ``marker`` (a PostgreSQL client: a statement's text), cut the
  connection there: either before the ``COMMIT`` reaches the server (the transaction is
  rolled back), or after, with the server's answer to it lost (it committed; the client
  never hears). ``holds_server``: cut before, the server's end kept open (a network that
  drops the rest: the server's session waits in its transaction, unaware). ``holds_client``:
  cut before, the client's end kept open (it waits for the ``COMMIT``'s answer) until
  ``release_held()`` cuts it, whatever the server does meanwhile (the test crashes it).
  ``then_refuse``: from the cut on, every other connection is cut too and new ones are
  refused (the database away just then).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class TcpProxy:
    def __init__(self, target_port: int, listener: socket.socket | None = None) -> None:
        self.target = ("127.0.0.1", target_port)
        self.listener = listener or socket.create_server(("127.0.0.1", 0))
        self.host, self.port = self.listener.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self.lose_answers = 0
        self.refuse = False
        self.dark = False
        self._links: list[_Link] = []
        self.accepted = 0
        self.accepted_at: list[float] = []  # time.monotonic() of each accept
        self.lost = 0
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._upstream: set[socket.socket] = set()  # the proxy's own ends towards the target
        self._closed = False
        self._commit_cut: tuple[bytes, bool, bool, bool, bool] | None = None
        self.commits_cut = 0
        self._held: list[socket.socket] = []  # clients' ends kept open (``holds_client``)
        threading.Thread(target=self._accept, daemon=True).start()

    def cut_at_commit(
        self,
        marker: bytes,
        *,
        reaches_server: bool,
        holds_server: bool = False,
        holds_client: bool = False,
        then_refuse: bool = False,
    ) -> None:
        """Arm the one cut described in the module's docstring."""
        with self._lock:
            self._commit_cut = (marker, reaches_server, holds_server, holds_client, then_refuse)

    def release_held(self) -> None:
        """Cut the clients' ends that ``holds_client`` kept open."""
        with self._lock:
            held, self._held = self._held, []
        self._cut(*held)

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
                # Refused meanwhile (a cut's ``then_refuse``, whose ``drop_all`` did not see
                # this connection yet): refused, or it would outlive the cut.
                refused = self.refuse
                if not refused:
                    self._open.update((client, upstream))
                    self._upstream.add(upstream)
            if refused:
                self._cut(client, upstream)
                continue
            link = _Link()
            with self._lock:
                link.dark = self.dark
                self._links.append(link)
            for args in ((client, upstream, False, link), (upstream, client, True, link)):
                threading.Thread(target=self._pump, args=args, daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, answers: bool, link: _Link) -> None:
        try:
            while data := source.recv(65536):
                if link.dark:
                    continue  # read (the sender's kernel hears it taken) and never passed on
                if answers:
                    with self._lock:
                        lose = self.lose_answers > 0 or link.lose_next
                        if lose and not link.lose_next:
                            self.lose_answers -= 1
                            self.lost += 1
                    if lose:
                        break
                elif self._commit_cut is not None and not self._at_commit(data, link):
                    if link.drop_all_after:
                        # The others first, this link after (below): cut first, it would
                        # have the client ask on a connection not cut yet.
                        self.drop_all(but=(source, sink))
                    if link.holds_server:
                        self._cut(source)  # the server's end stays open, unaware
                        return
                    if link.holds_client:
                        with self._lock:
                            self._held.append(source)  # the client waits for an answer
                        return
                    break  # cut before the COMMIT reaches the server
                if link.drop_all_after:
                    # The others first: the COMMIT's answer, lost, cuts this link at once, and
                    # the client may ask on another connection before this thread runs again.
                    self.drop_all(but=(source, sink))
                sink.sendall(data)
                if link.drop_all_after:
                    # Those opened since, too; but not this link, before the server has read
                    # the COMMIT (a reset would lose it): its answer, lost, cuts it.
                    link.drop_all_after = False
                    self.drop_all(but=(source, sink))
        except OSError:
            pass
        if answers and link.holds_client:
            self._cut(source)  # the server's end; the client's is held
            return
        self._cut(source, sink)

    def _at_commit(self, data: bytes, link: _Link) -> bool:
        """For a chunk a client sends while a cut is armed: whether to pass it on (and, if it
        carries the COMMIT to cut after, lose the server's answers from now on)."""
        with self._lock:
            if self._commit_cut is None:
                return True
            marker, reaches_server, holds_server, holds_client, then_refuse = self._commit_cut
            if b"BEGIN" in data:  # a transaction begins: marked only by what it sends
                link.marked = marker in data[data.rfind(b"BEGIN") :]
            link.marked = link.marked or marker in data
            after_marker = data[data.find(marker) :] if marker in data else data
            if not (link.marked and b"COMMIT" in after_marker):
                return True
            self._commit_cut = None
            self.commits_cut += 1
            link.lose_next = reaches_server
            link.holds_server = holds_server and not reaches_server
            link.holds_client = holds_client and not reaches_server
            self.refuse = self.refuse or then_refuse
            link.drop_all_after = then_refuse
            return reaches_server

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

    def go_dark(self) -> None:
        with self._lock:
            self.dark = True
            for link in self._links:
                link.dark = True

    def light(self) -> None:
        with self._lock:
            self.dark = False

    def drop_all(self, but: tuple[socket.socket, ...] = ()) -> None:
        with self._lock:
            socks = [sock for sock in self._open if sock not in but]
        self._cut(*socks)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.listener.close()
        self.drop_all()


class _Link:
    """One proxied connection's state for ``cut_at_commit``."""

    def __init__(self) -> None:
        self.marked = False  # sent the marker
        self.lose_next = False  # the server's answers from now on are lost, the link cut
        self.holds_server = False  # cut on the client's side only
        self.holds_client = False  # cut on the server's side only, the client's held
        self.drop_all_after = False  # once this chunk is passed on, cut every connection
        self.dark = False  # passes nothing either way (``go_dark``)
