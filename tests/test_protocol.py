"""The Python codec of the client protocol: what it writes it reads back, what it must refuse it
refuses with the documented error code (docs/protocol.md)."""

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nvshare_py import protocol

devices = st.from_regex(r"\A[A-Za-z0-9-]{1,96}\Z")
uints = st.integers(min_value=0, max_value=protocol.MAX_INT)
texts = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\n\r\x7f"
                              + "".join(map(chr, range(32)))), max_size=40)

FIELD_STRATEGIES = {
    "device": devices, "total": uints, "used": uints, "grant": uints, "pid": uints,
    "quantum_ms": uints, "quantum_left_ms": uints, "grace_ms": uints, "heartbeat_ms": uints, "idle_release_ms": uints,
    "version": st.just(protocol.VERSION), "session": st.from_regex(r"\A[0-9a-f]{16}\Z"),
    "held": st.lists(devices, max_size=3).map(tuple), "wanted": st.lists(devices, max_size=3).map(tuple),
    "exclusive": st.booleans(), "mode": st.sampled_from(protocol.MODES),
    "code": st.sampled_from(protocol.ERROR_CODES),
    # Residency: `resident` is absent (None) from clients that do not report it, except in EVICTED
    # (and in PREFETCH, the scheduler's).
    "resident": st.none() | uints, "evict": uints, "prefetch": uints, "bytes": uints,
    "request": uints, "admission": st.booleans(),
    # The swap engine's figures (MEMORY) and the pipelining fields (CONTENDED).
    "area": st.none() | uints, "out_bps": uints, "in_bps": uints, "idle_ms": uints,
}
REASONS = {"Release": protocol.RELEASE_REASONS, "Drop": protocol.DROP_REASONS,
           "Revoke": protocol.REVOKE_REASONS, "Refused": protocol.REFUSE_REASONS}


def message_strategy(cls):
    fields = {}
    for f in dataclasses.fields(cls):
        if f.name == "reason":
            fields[f.name] = st.sampled_from(REASONS[cls.__name__])
        elif cls in (protocol.Evicted, protocol.Prefetch) and f.name == "resident":
            fields[f.name] = uints
        else:
            fields[f.name] = FIELD_STRATEGIES.get(f.name, texts)
    return st.builds(cls, **fields)


ALL = {**protocol.CLIENT_MESSAGES, **protocol.SCHEDULER_MESSAGES}


@given(st.sampled_from(sorted(ALL)).flatmap(lambda name: message_strategy(ALL[name])))
def test_every_message_round_trips(message):
    catalogue = protocol.CLIENT_MESSAGES if message.TYPE in protocol.CLIENT_MESSAGES else protocol.SCHEDULER_MESSAGES
    assert protocol.decode(message.encode(), catalogue) == message


@given(st.binary(max_size=600))
def test_junk_is_refused_with_an_error_code_never_an_exception_of_another_kind(data):
    try:
        protocol.decode(data)
    except protocol.ProtocolError as error:
        assert error.code in protocol.ERROR_CODES


@pytest.mark.parametrize("data, code", [
    (b"", "malformed"),
    (b"HELLO", "malformed"),
    (b"NVSHARE/2 ACQUIRE\ndevice=GPU-1", "unsupported-version"),
    (b"NVSHARE/1 GRANT\ndevice=GPU-1", "unknown-type"),  # a scheduler message on the client side
    (b"NVSHARE/1 ACQUIRE", "bad-field"),
    (b"NVSHARE/1 ACQUIRE\ndevice=GPU 1", "bad-field"),
    (b"NVSHARE/1 ACQUIRE\ndevice=GPU-1\ndevice=GPU-2", "malformed"),
    (b"NVSHARE/1 RELEASE\ndevice=GPU-1\ngrant=\xd9\xa3", "bad-field"),
    (b"NVSHARE/1 RELEASE\ndevice=GPU-1\ngrant=9223372036854775808", "bad-field"),
    (b"NVSHARE/1 RELEASE\ndevice=GPU-1\ngrant=1\nreason=bored", "bad-field"),
    (b"NVSHARE/1 ACQUIRE\ndevice=GPU-1\n" + b"k=v\n" * 40, "malformed"),
    (b"NVSHARE/1 ACQUIRE\ndevice=GPU-1\nnote=" + b"x" * 1100, "bad-field"),
    (b"NVSHARE/1 ACQUIRE\ndevice=GPU-1\n" + b"#" * 5000, "too-large"),
    (b"\xff\xfe", "malformed"),
])
def test_refusals_carry_the_documented_code(data, code):
    with pytest.raises(protocol.ProtocolError) as refused:
        protocol.decode(data)
    assert refused.value.code == code


def test_contention_notice_and_the_quantum_release_reason_on_the_wire():
    notice = protocol.Contended(device="GPU-1", grant=7, quantum_left_ms=1500)
    assert notice.encode() == b"NVSHARE/1 CONTENDED\ndevice=GPU-1\ngrant=7\nquantum_left_ms=1500"
    assert protocol.decode(notice.encode(), protocol.SCHEDULER_MESSAGES) == notice
    with pytest.raises(protocol.ProtocolError) as refused:  # a scheduler message, not a client's
        protocol.decode(notice.encode())
    assert refused.value.code == "unknown-type"
    release = protocol.decode(b"NVSHARE/1 RELEASE\ndevice=GPU-1\ngrant=7\nreason=quantum")
    assert release == protocol.Release(device="GPU-1", grant=7, reason="quantum")


def test_unknown_fields_are_ignored_for_forward_compatibility():
    assert protocol.decode(b"NVSHARE/1 ACQUIRE\ndevice=GPU-1\npriority=7\n") == protocol.Acquire(device="GPU-1")


def test_encoder_refuses_what_the_decoder_would_refuse():
    with pytest.raises(ValueError):
        protocol.Hello(pid=1, session="0123456789abcdef", program="a\nb").encode()
    with pytest.raises(ValueError):
        protocol.Hello(pid=1, session="0123456789abcdef", held=tuple(f"GPU-{i:060d}" for i in range(20))).encode()
