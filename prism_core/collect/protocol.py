"""Frames between rank processes and the collection coordinator over a Unix socket.

A frame is a 4-byte length, a JSON header, then the raw bytes of the tensors the header lists
(dtype and shape each); no pickle. bfloat16 and every other dtype travel as their raw bytes.
"""

from __future__ import annotations

import json
import socket
import struct

import torch

_LEN = struct.Struct("!I")


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k
    return bytes(buf)


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def tensor_from(raw: bytes, dtype: str, shape: list[int]) -> torch.Tensor:
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return t.view(getattr(torch, dtype)).reshape(shape)


def send(sock: socket.socket, header: dict, tensors: list[torch.Tensor] = ()) -> None:
    header = dict(header, tensors=[{"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                                   for t in tensors])
    payloads = [tensor_bytes(t) for t in tensors]
    head = json.dumps(header).encode()
    sock.sendall(b"".join([_LEN.pack(len(head)), head, *payloads]))


def recv(sock: socket.socket) -> tuple[dict, list[torch.Tensor]]:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    header = json.loads(_recv_exact(sock, n))
    tensors = []
    for spec in header.pop("tensors"):
        size = torch.empty(0, dtype=getattr(torch, spec["dtype"])).element_size()
        count = 1
        for d in spec["shape"]:
            count *= d
        tensors.append(tensor_from(_recv_exact(sock, size * count), spec["dtype"], spec["shape"]))
    return header, tensors
