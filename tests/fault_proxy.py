"""A loopback HTTP/1.1 proxy that injects GCS-like faults, for the fault tests.

Between the storage client and fake-gcs-server it relays requests one by one
(keep-alive included) and, per request, with configured probabilities answers
503 without forwarding, or forwards it and cuts the connection halfway through
the response body (a connection dropped mid-transfer). Mode "down" refuses
everything, as a vanished endpoint does. With ``hold`` set, a request whose
request line contains it (after the first ``hold_skip`` of them) waits, with
``held`` set, until ``release`` is set: an upload kept in flight for as long
as a test needs. With ``drop_held``, the request then dies unanswered, as one
whose client was killed meanwhile would (never reaching the server).
"""

from __future__ import annotations

import random
import socket
import threading
from dataclasses import dataclass, field


@dataclass
class FaultStats:
    requests: int = 0
    unavailable: int = 0  # answered 503
    dropped: int = 0  # cut mid-response
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, name: str) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + 1)


class _Stream:
    """Buffered reads from a socket: lines and exact byte counts."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buffer = b""

    def _fill(self) -> bool:
        chunk = self.sock.recv(65536)
        if not chunk:
            return False
        self.buffer += chunk
        return True

    def read_until(self, marker: bytes) -> bytes | None:
        while marker not in self.buffer:
            if not self._fill():
                return None
        head, _, self.buffer = self.buffer.partition(marker)
        return head + marker

    def read_exact(self, size: int) -> bytes | None:
        while len(self.buffer) < size:
            if not self._fill():
                return None
        data, self.buffer = self.buffer[:size], self.buffer[size:]
        return data


def _header(head: bytes, name: bytes) -> bytes | None:
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value.strip()
    return None


def _read_body(stream: _Stream, head: bytes, is_response: bool, request_method: bytes = b"") -> bytes | None:
    """The message body in its wire form (chunked kept chunked)."""
    if is_response:
        status = int(head.split(b" ", 2)[1])
        if request_method == b"HEAD" or status in (204, 304) or 100 <= status < 200:
            return b""
    if (_header(head, b"transfer-encoding") or b"").lower() == b"chunked":
        parts = []
        while True:
            size_line = stream.read_until(b"\r\n")
            if size_line is None:
                return None
            parts.append(size_line)
            size = int(size_line.split(b";")[0].strip(), 16)
            data = stream.read_exact(size + 2)
            if data is None:
                return None
            parts.append(data)
            if size == 0:
                return b"".join(parts)
    length = _header(head, b"content-length")
    if length is not None:
        return stream.read_exact(int(length))
    if not is_response:
        return b""
    chunks = [stream.buffer]  # response delimited by connection close
    stream.buffer = b""
    while chunk := stream.sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


class FaultProxy:
    def __init__(self, upstream_port: int, fault_rate: float = 0.0, seed: int = 0):
        self.upstream_port = upstream_port
        self.fault_rate = fault_rate
        self.mode = "faults"  # or "down"
        self.hold: bytes | None = None
        self.hold_skip = 0
        self.drop_held = False
        self.held = threading.Event()
        self.release = threading.Event()
        self.stats = FaultStats()
        self._random = random.Random(seed)
        self._random_lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._closed.set()
        self._server.close()

    def _holds(self) -> bool:
        with self._random_lock:
            self.hold_skip -= 1
            return self.hold_skip < 0

    def _roll(self) -> float:
        with self._random_lock:
            return self._random.random()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream = None
        try:
            incoming = _Stream(client)
            while True:
                head = incoming.read_until(b"\r\n\r\n")
                if head is None:
                    return
                body = _read_body(incoming, head, is_response=False)
                if body is None:
                    return
                self.stats.count("requests")
                if self.hold is not None and self.hold in head.split(b"\r\n", 1)[0] and self._holds():
                    self.held.set()
                    if not self.release.wait(120) or self.drop_held:
                        return
                if self.mode == "down":
                    return  # close without an answer
                roll = self._roll()
                if roll < self.fault_rate / 2:
                    self.stats.count("unavailable")
                    client.sendall(
                        b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                    )
                    return
                if upstream is None:
                    upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
                    outgoing = _Stream(upstream)
                upstream.sendall(head + body)
                response_head = outgoing.read_until(b"\r\n\r\n")
                if response_head is None:
                    return
                method = head.split(b" ", 1)[0]
                response_body = _read_body(outgoing, response_head, is_response=True, request_method=method)
                if response_body is None:
                    return
                if roll < self.fault_rate and len(response_body) > 1:
                    self.stats.count("dropped")
                    client.sendall(response_head + response_body[: len(response_body) // 2])
                    return
                client.sendall(response_head + response_body)
                if (
                    b"close" in (_header(head, b"connection") or b"").lower()
                    or b"close" in (_header(response_head, b"connection") or b"").lower()
                ):
                    return
        except OSError:
            return
        finally:
            client.close()
            if upstream is not None:
                upstream.close()
