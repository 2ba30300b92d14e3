"""The self-checking byte format of one stored block, shared by the disk and redis tiers.

    offset  size  field
    0       4     magic b"DIKV"
    4       2     format version (little-endian u16), currently 1
    6       2     key length K (u16)
    8       8     payload length P (u64)
    16      8     expiry time, seconds since the epoch (f64; inf = never)
    24      16    blake2b-128 over bytes [0, 24) + key + payload
    40      K     key
    40+K    P     payload

The checksum covers the expiry time and the key as well as the payload, so a
flipped bit anywhere is caught; the stored key guards against a file or value
that landed under the wrong name.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

MAGIC = b"DIKV"
VERSION = 1
_PREFIX = struct.Struct("<4sHHQd")
CHECKSUM_SIZE = 16
HEADER_SIZE = _PREFIX.size + CHECKSUM_SIZE


class CorruptRecord(ValueError):
    """The bytes are not a valid record of the expected key."""


@dataclass(frozen=True)
class Header:
    expires_at: float
    payload_len: int
    checksum: bytes
    key_len: int

    @property
    def record_len(self) -> int:
        return HEADER_SIZE + self.key_len + self.payload_len


def _checksum(prefix: bytes | memoryview, key: bytes | memoryview, payload: bytes | memoryview) -> bytes:
    digest = hashlib.blake2b(prefix, digest_size=CHECKSUM_SIZE)
    digest.update(key)
    digest.update(payload)
    return digest.digest()


def encode_header(key: bytes, payload: bytes, expires_at: float) -> bytes:
    """Everything before the payload; the record is `encode_header(...) + payload`."""
    if len(key) > 0xFFFF:
        raise ValueError(f"key must be at most 65535 bytes, got {len(key)}")
    prefix = _PREFIX.pack(MAGIC, VERSION, len(key), len(payload), expires_at)
    return prefix + _checksum(prefix, key, payload) + key


def encode(key: bytes, payload: bytes, expires_at: float) -> bytes:
    return encode_header(key, payload, expires_at) + payload


def decode_header(data: bytes | memoryview, key: bytes) -> Header:
    """Parses and checks the fixed header and key; `data` needs only the first HEADER_SIZE + len(key) bytes."""
    if len(data) < HEADER_SIZE + len(key):
        raise CorruptRecord(f"record too short for a header: {len(data)} bytes")
    magic, version, key_len, payload_len, expires_at = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise CorruptRecord(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise CorruptRecord(f"unsupported record version {version}, expected {VERSION}")
    if key_len != len(key) or bytes(data[HEADER_SIZE : HEADER_SIZE + key_len]) != key:
        raise CorruptRecord("record holds a different key")
    checksum = bytes(data[_PREFIX.size : HEADER_SIZE])
    return Header(expires_at=expires_at, payload_len=payload_len, checksum=checksum, key_len=key_len)


def decode(data: bytes, key: bytes) -> tuple[bytes, float]:
    """The payload and expiry time of a whole record; raises CorruptRecord on any mismatch."""
    header = decode_header(data, key)
    if len(data) != header.record_len:
        raise CorruptRecord(f"record is {len(data)} bytes, header says {header.record_len}")
    view = memoryview(data)
    start = HEADER_SIZE + header.key_len
    if _checksum(view[: _PREFIX.size], key, view[start:]) != header.checksum:
        raise CorruptRecord("checksum mismatch")
    return bytes(view[start:]), header.expires_at
