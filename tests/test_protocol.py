"""The Python codec of the client protocol, checked message by message from the protocol table
(nvshare_py/protocol_table.py): what it writes it reads back, what it must refuse it refuses
with the documented error code, words it does not know it reads (docs/protocol.md), and every
part generated from the table is current."""

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nvshare_py import protocol, protocol_gen, vocabulary
from nvshare_py import protocol_table as table
from nvshare_py.scheduler import events as ev
from nvshare_py.scheduler.core import CoreConfig, SchedulerCore

devices = st.from_regex(r"\A[A-Za-z0-9-]{1,96}\Z")
uints = st.integers(min_value=0, max_value=protocol.MAX_INT)
texts = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\n\r\x7f"
                              + "".join(map(chr, range(32)))), max_size=40)
CHECKOUT = Path(__file__).resolve().parent.parent
ALL = {**protocol.CLIENT_MESSAGES, **protocol.SCHEDULER_MESSAGES, **protocol.QUERY_REPLIES}
WORD_FIELDS = [(m, f) for m in table.MESSAGES for f in m.fields if f.kind is table.Kind.WORD]


def catalogue_of(msg_type: str) -> dict:
    spec = table.BY_TYPE[msg_type]
    if spec.sender is table.Sender.CLIENT:
        return protocol.CLIENT_MESSAGES
    return protocol.QUERY_REPLIES if spec.reply_to else protocol.SCHEDULER_MESSAGES


def value_strategy(f: table.Field) -> st.SearchStrategy:
    strategy = {
        table.Kind.DEVICE: devices, table.Kind.UINT: uints, table.Kind.TEXT: texts,
        table.Kind.SESSION: st.from_regex(r"\A[0-9a-f]{16}\Z"),
        table.Kind.DEVICES: st.lists(devices, max_size=3).map(tuple), table.Kind.FLAG: st.booleans(),
        table.Kind.WORD: st.sampled_from(f.words.words) if f.words else st.nothing(),
        table.Kind.JSON: st.dictionaries(st.text(max_size=5), st.integers(), max_size=3).map(
            lambda d: protocol.Status.of(d).json),
    }[f.kind]
    return st.none() | strategy if f.nullable else strategy


def example(f: table.Field) -> object:
    """A valid value of a field (its vocabulary's first word for a word)."""
    return {
        table.Kind.DEVICE: "GPU-1", table.Kind.UINT: 7, table.Kind.TEXT: "text", table.Kind.SESSION: "0123456789abcdef",
        table.Kind.DEVICES: ("GPU-1",), table.Kind.FLAG: True, table.Kind.JSON: "{}",
        table.Kind.WORD: f.words.words[0] if f.words else "",
    }[f.kind]


def message_strategy(msg_type: str) -> st.SearchStrategy:
    spec = table.BY_TYPE[msg_type]
    return st.builds(ALL[msg_type], **{f.name: value_strategy(f) for f in spec.fields})


@given(st.sampled_from(sorted(ALL)).flatmap(message_strategy))
def test_every_message_round_trips(message):
    assert protocol.decode(message.encode(), catalogue_of(message.TYPE)) == message


def test_a_status_document_with_any_text_in_it_goes_over_the_wire():
    # A user, pod or program name may hold DEL, which JSON leaves unescaped and no field may carry.
    document = {"clients": [{"program": "a\x7fb\x01c", "\x7f": 1}]}
    status = protocol.Status.of(document)
    decoded = protocol.decode(status.encode(), protocol.QUERY_REPLIES)
    assert decoded.document()["clients"] == document["clients"]


@pytest.mark.parametrize("spec", table.MESSAGES, ids=lambda m: m.type)
def test_a_field_left_out_reads_as_its_default_and_a_default_is_left_out(spec):
    minimal = ALL[spec.type](**{f.name: example(f) for f in spec.fields if not f.optional})
    data = minimal.encode()
    assert all(f"\n{f.name}=".encode() not in data for f in spec.fields if f.optional)
    decoded = protocol.decode(data, catalogue_of(spec.type))
    for f in spec.fields:
        if f.optional:
            assert getattr(decoded, f.name) == f.default


@given(st.binary(max_size=600))
def test_junk_is_refused_with_an_error_code_never_an_exception_of_another_kind(data):
    try:
        protocol.decode(data)
    except protocol.ProtocolError as error:
        assert error.code in vocabulary.ERROR_CODE


@pytest.mark.parametrize("data, code", [
    (b"", "malformed"),
    (b"HELLO", "malformed"),
    (b"NVSHARE/2 ACQUIRE\ndevice=GPU-1", "unsupported-version"),
    (b"NVSHARE/1 GRANT\ndevice=GPU-1", "unknown-type"),  # a scheduler message on the client side
    (b"NVSHARE/1 TELEPORT\ndevice=GPU-1", "unknown-type"),
    (b"NVSHARE/1 ACQUIRE", "bad-field"),
    (b"NVSHARE/1 ACQUIRE\ndevice=GPU 1", "bad-field"),
    (b"NVSHARE/1 ACQUIRE\ndevice=GPU-1\ndevice=GPU-2", "malformed"),
    (b"NVSHARE/1 RELEASE\ndevice=GPU-1\ngrant=\xd9\xa3", "bad-field"),
    (b"NVSHARE/1 RELEASE\ndevice=GPU-1\ngrant=9223372036854775808", "bad-field"),
    (b"NVSHARE/1 RELEASE\ndevice=GPU-1\ngrant=1\nreason=Bored", "bad-field"),  # not a word
    (b"NVSHARE/1 RELEASE\ndevice=GPU-1\ngrant=1\nreason=" + b"b" * 33, "bad-field"),
    (b"NVSHARE/1 ACQUIRE\ndevice=GPU-1\n" + b"k=v\n" * 40, "malformed"),
    (b"NVSHARE/1 ACQUIRE\ndevice=GPU-1\nnote=" + b"x" * 1100, "bad-field"),
    (b"NVSHARE/1 ACQUIRE\ndevice=GPU-1\nnote=a\x01b", "bad-field"),
    (b"NVSHARE/1 ACQUIRE\ndevice=GPU-1\n" + b"#" * 5000, "too-large"),
    (b"NVSHARE/1 HELLO\npid=1\nsession=0123456789abcdef\nheld=" + b",".join(b"G%d" % i for i in range(65)),
     "bad-field"),
    (b"\xff\xfe", "malformed"),
])
def test_refusals_carry_the_documented_code(data, code):
    with pytest.raises(protocol.ProtocolError) as refused:
        protocol.decode(data)
    assert refused.value.code == code


@pytest.mark.parametrize("spec, field", WORD_FIELDS, ids=[f"{m.type}.{f.name}" for m, f in WORD_FIELDS])
def test_a_word_the_receiver_does_not_know_is_read_and_named(spec, field):
    """docs/protocol.md, "Unknown words": a newer peer's word is kept as text, and
    unknown_words names it, so that the receiver acts on the message and says what it could
    not read."""
    known = ALL[spec.type](**{f.name: example(f) for f in spec.fields if not f.optional})
    header, *lines = known.encode().decode().split("\n")
    lines = [line for line in lines if not line.startswith(f"{field.name}=")] + [f"{field.name}=preempted"]
    decoded = protocol.decode("\n".join([header, *lines]).encode(), catalogue_of(spec.type))
    assert getattr(decoded, field.name) == "preempted"
    assert protocol.unknown_words(decoded) == [(field.name, "preempted")]
    assert protocol.unknown_words(known) == []
    with pytest.raises(ValueError, match="preempted"):  # a sender writes only words it knows
        decoded.encode()


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


@pytest.mark.parametrize("message", [
    protocol.Hello(pid=1, session="0123456789abcdef", program="a\nb"),
    protocol.Hello(pid=1, session="0123456789abcdef", held=tuple(f"GPU-{i:060d}" for i in range(20))),
    protocol.Hello(pid=1, session="0123456789ABCDEF"),
    protocol.Hello(pid=-1, session="0123456789abcdef"),
    protocol.Acquire(device="GPU 1"),
    protocol.Memory(device="GPU-1", used=2**63),
    protocol.Release(device="GPU-1", grant=1, reason="bored"),
    protocol.Grant(device="GPU-1", grant=1, mode="fair", exclusive=True, quantum_ms=1),
])
def test_encoder_refuses_what_the_decoder_would_refuse_or_a_word_it_does_not_know(message):
    with pytest.raises(ValueError):
        message.encode()


def test_the_generated_parts_are_current():
    """The message classes, interceptor/protocol_table.h and docs/protocol.md's tables are what
    the table gives: a table changed without the generator fails here, naming the command."""
    stale = protocol_gen.stale(CHECKOUT)  # this checkout's files, whichever nvshare_py is imported
    assert not stale, f"{', '.join(map(str, stale))} out of date: run {protocol_gen.COMMAND}"


def test_every_client_message_reaches_a_handler_of_the_core_but_those_the_daemon_answers_itself():
    """A message with a FROM_CLIENT row becomes its own event; any other comes to the core as a
    ClientMessage, dispatched by the message's class: without a handler there the scheduler
    would ignore it."""
    handled = set(SchedulerCore(CoreConfig(), 0.0)._client_handlers)
    answered_by_the_daemon = {protocol.Hello, protocol.Query}
    for kind in set(protocol.CLIENT_MESSAGES.values()) - answered_by_the_daemon:
        assert kind in ev.FROM_CLIENT or kind in handled, f"{kind.TYPE} reaches no handler of the core"
    release = protocol.decode(b"NVSHARE/1 RELEASE\ndevice=GPU-1\ngrant=7\nreason=preempted\nresident=5")
    assert ev.from_client(1.5, "k", release) == ev.ReleaseReport(1.5, "k", "GPU-1", 7, "user", 5)
    assert ev.from_client(2.0, "k", protocol.Bye()) == ev.Unregister(2.0, "k", "bye")
    evicted = protocol.decode(b"NVSHARE/1 EVICTED\ndevice=GPU-1\nresident=5")
    assert ev.from_client(3.0, "k", evicted) == ev.ClientMessage(3.0, "k", protocol.Evicted(device="GPU-1", resident=5))
    assert ev.from_client(3.0, "k", evicted).device == "GPU-1"  # the daemon's quota check reads it
    assert ev.from_client(4.0, "k", protocol.Heartbeat()) == ev.Alive(4.0, "k")


def test_the_vocabularies_are_words_and_their_types_agree():
    for words in vocabulary.VOCABULARIES:
        assert all(vocabulary.WORD_FORM.match(word) for word in words.words)
    assert vocabulary.MODES == vocabulary.MODE.words == ("on", "off", "auto")
    assert vocabulary.gpu_uuid(bytes(range(16))) == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"
    assert vocabulary.GPU_UUID.match(vocabulary.gpu_uuid(bytes(range(16))))
