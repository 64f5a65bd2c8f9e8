"""A minimal, deterministic tar writer that also produces the DALI index as it goes.

Writing the headers ourselves (ustar, mtime 0, fixed owner) makes shards byte-identical across
runs and avoids a second pass over the tar to index it: we know every member's data offset.
"""
from __future__ import annotations

import hashlib
import tarfile
from typing import BinaryIO

BLOCK = 512
RECORD = 20 * BLOCK


def _template() -> bytearray:
    info = tarfile.TarInfo("x")
    info.size, info.mtime, info.mode = 0, 0, 0o644
    info.uname = info.gname = ""
    h = bytearray(info.tobuf(format=tarfile.USTAR_FORMAT))
    h[0:100] = bytes(100)
    h[148:156] = b" " * 8
    return h


_TEMPLATE = _template()


def ustar_header(name: str, size: int) -> bytes:
    """The same 512 bytes ``tarfile`` writes for a regular file (mode 644, mtime 0, no owner),
    built from a template: ``TarInfo.tobuf`` costs ~40 µs a member, this ~3 µs."""
    raw = name.encode()
    if len(raw) > 100 or size >= 8 ** 11:
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = size, 0, 0o644
        info.uname = info.gname = ""
        return info.tobuf(format=tarfile.PAX_FORMAT)  # long names: a pax header carries them
    h = bytearray(_TEMPLATE)
    h[0:len(raw)] = raw
    h[124:136] = b"%011o\x00" % size
    h[148:155] = b"%06o\x00" % sum(h)
    return bytes(h)


class TarShardWriter:
    """Append samples (key, [(ext, bytes)]) to a tar stream; track sha256 and DALI index lines."""

    def __init__(self, f: BinaryIO):
        self.f = f
        self.offset = 0
        self.sha = hashlib.sha256()
        self.index_lines: list[str] = []

    def _write(self, data: bytes) -> None:
        self.f.write(data)
        self.sha.update(data)
        self.offset += len(data)

    def add_sample(self, key: str, members: list[tuple[str, bytes]]) -> None:
        parts = []
        for ext, data in members:
            name = f"{key}.{ext}"
            self._write(ustar_header(name, len(data)))
            parts.append(f"{ext} {self.offset} {len(data)} {name}")
            pad = (-len(data)) % BLOCK
            self._write(data + b"\0" * pad)
        self.index_lines.append(" ".join(parts))

    def close(self) -> None:
        """End-of-archive marker and record padding, as tarfile writes them."""
        end = self.offset + 2 * BLOCK
        self._write(b"\0" * (2 * BLOCK + (-end) % RECORD))

    def dali_index(self) -> bytes:
        """The index in the format of DALI's ``wds2idx`` (v1.2)."""
        return (f"v1.2 {len(self.index_lines)}\n" + "\n".join(self.index_lines) + "\n").encode()
