import socket

import pytest

from sidecar._src.core import errors
from sidecar._src.wire import ipc

pytestmark = pytest.mark.unit


def test_frame_reader_reads_frames_that_arrive_together_or_in_pieces():
  a, b = socket.socketpair()
  with a, b:
    for payload in (b"one", b"", b"x" * 100_000):
      ipc.send_bytes(a, payload)
    frame = b"\x05\x00\x00\x00hello"
    a.sendall(frame[:2])  # a header split across sends
    reader = ipc.FrameReader(b)
    assert reader.read() == b"one" and reader.read() == b""
    assert reader.read() == b"x" * 100_000
    a.sendall(frame[2:])
    assert reader.read() == b"hello"
    ipc.send(a, {"op": "free"})
    assert reader.read() == b'{"op":"free"}'


def test_frame_reader_limits_and_eof():
  a, b = socket.socketpair()
  with b:
    ipc.send_bytes(a, b"y" * 50)
    reader = ipc.FrameReader(b, limit=10)
    with pytest.raises(errors.InvalidArgumentError, match="frame of 50 bytes exceeds the limit of 10"):
      reader.read()
    a.close()
    with pytest.raises(ConnectionError, match="closed"):
      ipc.FrameReader(b).read()
