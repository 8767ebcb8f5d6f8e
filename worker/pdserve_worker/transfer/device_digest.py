"""The pushed-KV digest of device memory (NPU, GPU): Fletcher's two sums, computed by torch
where the pool lies.

XXH3 (digest.py) reads host addresses; an NPU or GPU pool can only be read on its device, and a
copy to the host would cost more than the push. So HIXL declares FLETCHER64: over the bytes
x_0..x_{N-1}, A = sum x_i and B = sum (N - i) x_i, both mod 2^31 - 1 (Adler-32's construction,
wider; SGLang's opt-in transfer check is Adler-32). Appending m bytes y folds in as A += sum y,
B += m * A + sum (m - j) y_j, so ranges hash in any split. Each range is one strided view of its
pool's tensor and two reductions on its device; the sums stay there until `intdigest` (one sync
per chunk). One changed byte always changes A (|d| < 256). `KVPool` registers its tensor here
(`register`/`unregister`), so pusher and check keep digest.py's `update(addr, copies, step, length)`.
"""

from __future__ import annotations

import bisect
import threading
from typing import Any

import torch

from pdserve_worker.transfer.base import FLETCHER64

__all__ = ["FLETCHER64", "TensorDigest", "register", "unregister"]

MODULUS = (1 << 31) - 1
PIECE = 1 << 20  # bytes per reduction: (m - j) * y < 2^28, a piece's sum < 2^48 (int64 holds it)

_lock = threading.Lock()
_pools: list[tuple[int, int, Any]] = []  # (base address, bytes, the pool's bytes as a flat uint8 tensor)
_weights: dict[torch.device, torch.Tensor] = {}


def register(tensor: torch.Tensor) -> None:
    """Make the (contiguous) pool `tensor` findable by the addresses of its bytes."""
    flat = tensor.reshape(-1).view(torch.uint8)
    entry = (int(flat.data_ptr()), flat.numel(), flat)
    with _lock:
        bisect.insort(_pools, entry, key=lambda e: e[0])


def unregister(tensor: torch.Tensor) -> None:
    base = int(tensor.data_ptr())
    with _lock:
        _pools[:] = [e for e in _pools if e[0] != base]


def _bytes_at(addr: int, span: int) -> tuple[torch.Tensor, int]:
    """The registered pool holding [addr, addr + span), and the offset of addr in it."""
    with _lock:
        i = bisect.bisect_right(_pools, addr, key=lambda e: e[0]) - 1
        if i >= 0:
            base, size, flat = _pools[i]
            if addr + span <= base + size:
                return flat, addr - base
    raise ValueError(f"no KV pool registered for the digest holds {span} bytes at {addr:#x}")


def _descending(m: int, device: torch.device) -> torch.Tensor:
    """m, m - 1, ..., 1 as int64 on `device` (a slice of one cached PIECE-long ramp)."""
    ramp = _weights.get(device)
    if ramp is None:
        ramp = _weights[device] = torch.arange(PIECE, 0, -1, dtype=torch.int64, device=device)
    return ramp[PIECE - m :]


class TensorDigest:
    """A running FLETCHER64 over registered pool memory, fed by address like `HostDigest`."""

    def __init__(self) -> None:
        self.bytes = 0
        self._a: torch.Tensor | None = None  # int64 scalars on the pool's device
        self._b: torch.Tensor | None = None

    def update(self, addr: int, copies: int, step: int, length: int) -> None:
        """Feed `copies` ranges of `length` bytes, the i-th at `addr + i * step`."""
        if copies <= 0 or length <= 0:
            return
        flat, offset = _bytes_at(addr, (copies - 1) * step + length)
        rows = flat.as_strided((copies, length), (step, 1), flat.storage_offset() + offset)
        stream = rows.reshape(-1)  # (a copy only for a head slice's gathered rows)
        self.bytes += stream.numel()
        for piece in stream.split(PIECE):
            self._fold(piece)

    def _fold(self, piece: torch.Tensor) -> None:
        m = piece.numel()
        y = piece.to(torch.int64)
        a_piece = y.sum()
        b_piece = (y * _descending(m, y.device)).sum()
        if self._a is None or self._b is None:
            self._a = torch.zeros((), dtype=torch.int64, device=y.device)
            self._b = torch.zeros((), dtype=torch.int64, device=y.device)
        self._b = (self._b + (m % MODULUS) * self._a + b_piece) % MODULUS
        self._a = (self._a + a_piece) % MODULUS

    def intdigest(self) -> int:
        if self._a is None or self._b is None:
            return 0
        return (int(self._a.item()) << 32) | int(self._b.item())
