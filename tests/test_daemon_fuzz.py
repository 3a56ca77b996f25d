"""Hostile input on the client socket: whatever peers send, the daemon stays up, answers only
with well-formed messages, and a well-behaved client keeps getting its lock throughout."""

from __future__ import annotations

import shutil

import pytest
import zmq
import zmq.utils.monitor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nvshare_py import protocol, vocabulary
from nvshare_py.client import Client
from nvshare_py.testing.scheduler import DEFAULT_OPTIONS, PATIENCE, SchedulerProcess, short_socket_dir

GOOD_GPU = "GPU-5151ad00-0000-4000-8000-0000000000aa"
FUZZ_DEVICES = st.sampled_from(["GPU-fuzz-0", "GPU-fuzz-1", "MIG-fuzz-2"])

TYPES = st.sampled_from(["HELLO", "DEVICE", "MEMORY", "ACQUIRE", "RELEASE", "HEARTBEAT", "BYE", "GRANT", "WELCOME", "NOPE"])
KEYS = st.sampled_from(["pid", "session", "device", "total", "used", "grant", "reason", "held", "wanted", "name", "x"])
VALUES = st.one_of(
    st.integers(min_value=-5, max_value=2**64).map(str),
    FUZZ_DEVICES,
    st.sampled_from(["", "0123456789abcdef", "user", "idle", "GPU-fuzz-0,GPU-fuzz-1", "=", "a" * 1100]),
    st.text(max_size=40),
)


@st.composite
def near_valid(draw) -> bytes:
    """Messages that look like the protocol but break it in one or more ways."""
    version = draw(st.sampled_from(["1", "1", "1", "2", "01", "x"]))
    lines = [f"NVSHARE/{version} {draw(TYPES)}"]
    for key, value in draw(st.lists(st.tuples(KEYS, VALUES), max_size=6)):
        lines.append(f"{key}={value}")
    separator = draw(st.sampled_from(["\n", "\n", "\r\n", "\n\n"]))
    data = separator.join(lines).encode("utf-8", "surrogatepass")
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]  # truncated
    return data


def valid(message: protocol.Message) -> bytes:
    return message.encode()


SESSIONS = st.sampled_from(["00000000000000f1", "00000000000000f2"])
VALID_MESSAGES = st.one_of(
    st.builds(lambda s, p: valid(protocol.Hello(pid=p, session=s)), SESSIONS, st.integers(1, 10**6)),
    st.builds(lambda s, d: valid(protocol.Hello(pid=1, session=s, held=(d,), wanted=(d,))), SESSIONS, FUZZ_DEVICES),
    st.builds(lambda d, t: valid(protocol.DeviceAnnouncement(device=d, total=t)), FUZZ_DEVICES, st.integers(0, 2**62)),
    st.builds(lambda d, u: valid(protocol.Memory(device=d, used=u)), FUZZ_DEVICES, st.integers(0, 2**62)),
    st.builds(lambda d: valid(protocol.Acquire(device=d)), FUZZ_DEVICES),
    st.builds(
        lambda d, g, r: valid(protocol.Release(device=d, grant=g, reason=r)),
        FUZZ_DEVICES,
        st.integers(0, 50),
        st.sampled_from(vocabulary.RELEASE_REASON.words),
    ),
    st.just(valid(protocol.Heartbeat())),
    st.just(valid(protocol.Bye())),
)

ONE_FRAME = st.one_of(
    st.binary(max_size=300),
    near_valid(),
    VALID_MESSAGES,  # valid messages in any order: before HELLO, twice HELLO, after BYE, ...
    st.integers(protocol.MAX_MESSAGE + 1, 60_000).map(lambda n: b"NVSHARE/1 HEARTBEAT\n" + b"x" * n),
)
MESSAGE = st.one_of(
    ONE_FRAME.map(lambda frame: [frame]),
    st.lists(ONE_FRAME, min_size=2, max_size=3),  # multi-frame
)


@pytest.fixture(scope="module")
def fuzz_target():
    """One daemon and one well-behaved client shared by every example of this module."""
    directory = short_socket_dir()
    scheduler = SchedulerProcess(directory, {**DEFAULT_OPTIONS, "log_level": "info"}).start()
    client = Client(directory)
    client.connect()
    context = zmq.Context()
    yield scheduler, client, context
    context.destroy(linger=0)
    client.close()
    scheduler.cleanup()
    shutil.rmtree(directory, ignore_errors=True)


def assert_good_client_works(scheduler, client) -> None:
    assert scheduler.running, scheduler.log_text()[-3000:]
    assert "Traceback" not in scheduler.log_text()  # nothing went wrong inside the daemon either
    with client.hold(GOOD_GPU, timeout=PATIENCE) as grant:
        assert grant.device == GOOD_GPU


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(conversation=st.lists(MESSAGE, min_size=1, max_size=12))
def test_hostile_peers_do_not_disturb_the_daemon(fuzz_target, conversation):
    scheduler, client, context = fuzz_target
    peer = context.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(scheduler.paths.client_endpoint)
    try:
        for frames in conversation:
            peer.send_multipart(frames)
        # Everything the daemon answers is a well-formed scheduler message of one frame.
        while peer.poll(200):
            reply = peer.recv_multipart()
            assert len(reply) == 1
            protocol.decode(reply[0], protocol.SCHEDULER_MESSAGES)
    finally:
        peer.close(linger=0)
    assert_good_client_works(scheduler, client)


def test_answers_name_the_problem(fuzz_target):
    scheduler, client, context = fuzz_target
    peer = context.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.setsockopt(zmq.RCVTIMEO, 10_000)
    peer.connect(scheduler.paths.client_endpoint)

    def answer(*frames: bytes) -> protocol.Error:
        peer.send_multipart(list(frames))
        message = protocol.decode(peer.recv(), protocol.SCHEDULER_MESSAGES)
        assert isinstance(message, protocol.Error)
        return message

    try:
        assert answer(valid(protocol.Acquire(device="GPU-fuzz-0"))).code == "not-registered"
        assert answer(b"NVSHARE/1 HEARTBEAT\n" + b"x" * 5000).code == "too-large"
        assert answer(b"NVSHARE/1 HEARTBEAT", b"NVSHARE/1 HEARTBEAT").code == "malformed"
        assert answer(b"NVSHARE/2 HELLO").code == "unsupported-version"
        assert answer(b"NVSHARE/1 FROBNICATE").code == "unknown-type"
        assert answer(b"\xff\xfe").code == "malformed"
        assert answer(b'{"v": 1, "op": "set-mode", "mode": "off"}').code == "malformed"
        peer.send(valid(protocol.Hello(pid=1, session="00000000000000f3")))
        assert isinstance(protocol.decode(peer.recv(), protocol.SCHEDULER_MESSAGES), protocol.Welcome)
        assert answer(valid(protocol.Hello(pid=1, session="00000000000000f3"))).code == "already-registered"
        assert answer(b"NVSHARE/1 ACQUIRE\ndevice=GPU fuzz").code == "bad-field"
        peer.send(valid(protocol.Bye()))
    finally:
        peer.close(linger=0)
    # A client-socket peer cannot reach the control operations: the mode is unchanged.
    assert scheduler.status()["scheduler"]["defaults"]["mode"] == "on"
    assert_good_client_works(scheduler, client)


def test_a_flood_neither_stops_service_nor_floods_the_log(fuzz_target):
    scheduler, client, context = fuzz_target
    log_before = len(scheduler.log_text().splitlines())
    peer = context.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.setsockopt(zmq.SNDHWM, 0)
    peer.connect(scheduler.paths.client_endpoint)
    try:
        for _ in range(5000):
            peer.send(b"garbage")
        assert_good_client_works(scheduler, client)
    finally:
        peer.close(linger=0)
    # Rejections are logged through a rate limit, not once per message.
    assert len(scheduler.log_text().splitlines()) - log_before < 200


def test_a_peer_over_the_wire_limit_is_cut_off_and_others_carry_on(fuzz_target):
    scheduler, client, context = fuzz_target
    peer = context.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    monitor = peer.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    peer.connect(scheduler.paths.client_endpoint)
    try:
        peer.send(b"x" * (2 << 20))  # libzmq drops the connection (MAXMSGSIZE) without reading it
        assert monitor.poll(15_000), "the daemon did not cut the peer off"
        assert zmq.utils.monitor.recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
        assert_good_client_works(scheduler, client)
    finally:
        peer.disable_monitor()
        monitor.close(linger=0)
        peer.close(linger=0)
