"""Scalar events in TensorBoard's file format, written without TensorFlow or TensorBoard.

An event file (`events.out.tfevents.<time>.<host>`) is a TFRecord stream: each record is
u64 length | u32 masked CRC-32C of the length | data | u32 masked CRC-32C of the data, and the
data is a serialized `tensorflow.Event` protocol buffer: wall_time (field 1, double), step (2,
int64), file_version (3, string: the first record) or summary (5: repeated Value {tag (1),
simple_value (2, float)}). Only the fields scalars need are written.
"""
import os
import socket
import struct
import time


def _crc32c_table():
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative int64 as protobuf writes it
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _event(step, wall_time, file_version=None, scalars=None) -> bytes:
    data = b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(int(step))
    if file_version is not None:
        data += _field(3, file_version.encode())
    if scalars:
        values = b"".join(_field(1, _field(1, tag.encode()) + b"\x15" + struct.pack("<f", float(value)))
                          for tag, value in scalars.items())
        data += _field(5, values)
    return data


class ScalarWriter:
    """Appends scalars to one event file in `logdir` (made 0700 if missing; the file is 0600)."""

    def __init__(self, logdir):
        os.makedirs(logdir, mode=0o700, exist_ok=True)
        self.path = os.path.join(logdir, f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}")
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self.file = os.fdopen(fd, "ab")
        self._write(_event(0, time.time(), file_version="brain.Event:2"))

    def _write(self, data):
        length = struct.pack("<Q", len(data))
        self.file.write(length + struct.pack("<I", _masked(length)) + data + struct.pack("<I", _masked(data)))

    def add(self, step, scalars, wall_time=None):
        """One event at `step` with {tag: value}; values that are None are left out."""
        present = {k: v for k, v in scalars.items() if v is not None}
        if present:
            self._write(_event(step, time.time() if wall_time is None else wall_time, scalars=present))

    def flush(self):
        self.file.flush()

    def close(self):
        self.file.close()
