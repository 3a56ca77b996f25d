"""The daemon's ZMTP server parser (nvshare_py/scheduler/zmtp.py), without sockets."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from nvshare_py.scheduler import zmtp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import floodkit  # noqa: E402


def handshake(identity: bytes | None = None) -> bytes:
    return floodkit.GREETING + floodkit.ready(identity)


def test_a_peer_announcing_an_identity_is_served_and_the_identity_ignored():
    parser = zmtp.Parser(max_message=1024)
    items = parser.feed(handshake(identity=b"\x00\x6b\x8b\x45\x67") + floodkit.frame(b"hi"))
    assert items == [zmtp.Ready(b"DEALER"), zmtp.Message((b"hi",))]


def test_byte_by_byte_input_gives_the_same_result():
    data = handshake() + floodkit.frame(b"a", more=True) + floodkit.frame(b"b" * 300) \
        + floodkit.frame(b"\x04PING\x00\x00ctx", command=True)
    parser = zmtp.Parser(max_message=1024)
    items = [item for byte in data for item in parser.feed(bytes([byte]))]
    assert items == [zmtp.Ready(b"DEALER"), zmtp.Message((b"a", b"b" * 300)), zmtp.Ping(b"ctx")]


@pytest.mark.parametrize("data", [
    b"GET / HTTP/1.1\r\n",                                              # not ZMTP
    floodkit.GREETING[:10] + bytes([2]) + floodkit.GREETING[11:],       # ZMTP 2
    floodkit.GREETING.replace(b"NULL", b"CURV") + floodkit.ready(),     # another mechanism
    floodkit.GREETING + floodkit.frame(b"before READY"),
    floodkit.GREETING + floodkit.frame(b"\x05READY" + b"\x0bSocket-Type\x00\x00\x00\x03PUB", command=True),
    handshake() + b"\x08\x01x",                                         # reserved flag
])
def test_what_a_server_must_not_accept_is_a_violation(data):
    with pytest.raises(zmtp.Violation):
        zmtp.Parser(max_message=1024).feed(data)


def test_an_oversized_message_is_refused_on_its_header_before_its_body_arrives():
    parser = zmtp.Parser(max_message=1024)
    parser.feed(handshake())
    parser.feed(floodkit.frame(b"x" * 600, more=True))
    with pytest.raises(zmtp.Violation):
        parser.feed(floodkit.frame(b"y" * 600)[:9])  # only the header of the second frame


def test_a_reply_to_a_req_peer_keeps_its_empty_delimiter_frame():
    # The control socket answers REQ peers (nvsharectl) behind the delimiter they sent.
    parser = zmtp.Parser(max_message=1024)
    parser.feed(handshake())
    assert parser.feed(zmtp.message([b"", b"x" * 300])) == [zmtp.Message((b"", b"x" * 300))]
    assert zmtp.frame(b"y") == zmtp.message([b"y"]) == floodkit.frame(b"y")
