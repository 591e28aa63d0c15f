"""Uploads over a bare socket: a chunked body (no Content-Length) or a declared one, sent until the
server answers. An HTTP client library sends the whole body before it reads the answer, and a
server that answers early and closes makes it fail with a broken pipe, hiding the status."""

from __future__ import annotations

import select
import socket
import time
from dataclasses import dataclass

CHUNK = 1 << 20


@dataclass
class Answer:
    status: int | None  # None: the server closed or never answered
    body: bytes
    sent: int  # body bytes sent before the answer came (or the server stopped reading)
    seconds: float


def upload(port: int, path: str, headers: dict[str, str], total: int, *, chunked: bool, filler: bytes = b"a",
           prefix: bytes = b"", seconds: float = 60.0) -> Answer:
    """POST `prefix` + `filler` bytes up to `total` bytes; stop sending as soon as an answer arrives."""
    start = time.monotonic()
    lines = [f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    lines.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {total}")
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    sock.setblocking(False)
    block = (prefix + filler * CHUNK)[:CHUNK]
    rest = filler * CHUNK
    pending, sent, first = memoryview(b""), 0, True
    try:
        while time.monotonic() - start < seconds:
            want_write = bool(pending) or sent < total or chunked
            readable, writable, _ = select.select([sock], [sock] if want_write else [], [], 0.2)
            if readable:
                break
            if not writable:
                continue
            if not pending:
                if sent >= total:
                    if not chunked:
                        continue  # all sent: wait for the answer
                    pending, chunked = memoryview(b"0\r\n\r\n"), False
                else:
                    data = (block if first else rest)[:total - sent]
                    first, sent = False, sent + len(data)
                    pending = memoryview((f"{len(data):x}\r\n".encode() + data + b"\r\n") if chunked else data)
            try:
                pending = pending[sock.send(pending):]
            except BlockingIOError:
                pass
            except (BrokenPipeError, ConnectionResetError):
                break
        status, body = _read_answer(sock)
    finally:
        sock.close()
    return Answer(status, body, sent, time.monotonic() - start)


def _read_answer(sock: socket.socket, limit: int = 1 << 20) -> tuple[int | None, bytes]:
    """Status and body of the answer (at most `limit` bytes read, 10 s)."""
    sock.setblocking(True)
    sock.settimeout(10)
    data = b""
    try:
        while len(data) < limit:
            piece = sock.recv(65536)
            if not piece:
                break
            data += piece
            head, sep, body = data.partition(b"\r\n\r\n")
            if sep and b"content-length:" in head.lower():
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                if len(body) >= length:
                    break
    except (ConnectionResetError, socket.timeout):
        pass
    head, _, body = data.partition(b"\r\n\r\n")
    try:
        return int(head.split(b" ")[1]), body
    except (IndexError, ValueError):
        return None, body
