"""The interceptor's wire layer: interceptor/transport.c (a ZMTP 3.1 client) and
interceptor/message.c (the protocol codec), driven through tests/c/wire_harness.c.

The C side is checked against real libzmq (pyzmq ROUTER sockets), against a hand-driven ZMTP
peer where byte-level control matters (fragmentation, PING contexts, protocol violations), and
against nvshare_py.protocol, whose encoder and decoder it must agree with byte for byte.

(Some 1,250 lines: the codec's tests (builders and parser, most of them against the Python
codec, many with Hypothesis) and the transport's (against libzmq, a hand-driven peer, and
connect errors). Both drive the one harness, compiled once a session with sanitizers where they
work, and together they are the wire layer's tests.)
"""

from __future__ import annotations

import codecs
import concurrent.futures
import errno
import json
import os
import queue
import random
import re
import shutil
import socket
import struct
import subprocess
import tempfile
import threading
import time
import warnings
from pathlib import Path

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from zmq.utils.monitor import recv_monitor_message

from nvshare_py import protocol
from nvshare_py import protocol_table as table

REPO = Path(__file__).resolve().parent.parent
SOURCES = [REPO / "interceptor" / "transport.c", REPO / "interceptor" / "message.c"]
HARNESS_SOURCE = REPO / "tests" / "c" / "wire_harness.c"
STRICT_FLAGS = ["-std=gnu11", "-Wall", "-Wextra", "-Werror", "-fPIC", "-fvisibility=hidden"]
SANITIZERS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"]
ANSWER_TIMEOUT = 30.0  # seconds to wait for one harness answer on a loaded 2-core machine
DEVICE = "GPU-5151ad00-0000-4000-8000-000000000000"

HYPOTHESIS = settings(
    deadline=None, max_examples=150, suppress_health_check=[HealthCheck.too_slow]
)


# --- building and driving the harness ----------------------------------------------------------


def _compiler() -> str:
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler: the C wire layer cannot be built here")
    return compiler


def _compile(compiler: str, output: Path, extra: list[str]) -> None:
    command = [compiler, *STRICT_FLAGS, "-O2", "-g", *extra, "-iquote", str(REPO / 'interceptor'),
               *map(str, SOURCES), str(HARNESS_SOURCE), "-o", str(output)]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stderr}"


def _sanitizers_work(compiler: str, build: Path) -> bool:
    probe = build / "probe.c"
    probe.write_text("int main(void) { return 0; }\n")
    result = subprocess.run([compiler, *SANITIZERS, str(probe), "-o", str(build / "probe")],
                            capture_output=True)
    return result.returncode == 0 and subprocess.run([str(build / "probe")],
                                                     capture_output=True).returncode == 0


@pytest.fixture(scope="session")
def wire_build():
    """The harness, twice: with AddressSanitizer + UBSan where the compiler has them (every
    functional test), and plain -O2 (latency measurement)."""
    compiler = _compiler()
    build = Path(tempfile.mkdtemp(prefix="nvs-wire-"))
    checked = build / "wire_harness_checked"
    plain = build / "wire_harness"
    sanitized = _sanitizers_work(compiler, build)
    if not sanitized:
        warnings.warn("the C compiler has no working AddressSanitizer/UBSan: the wire harness "
                      "runs without them, so memory errors are only caught when they crash")
    _compile(compiler, checked, SANITIZERS if sanitized else [])
    _compile(compiler, plain, [])
    yield {"checked": checked, "plain": plain, "dir": build, "compiler": compiler}
    shutil.rmtree(build, ignore_errors=True)


class Harness:
    """One `wire_harness script` process: a command line in, one answer line out."""

    def __init__(self, executable: Path, workdir: Path):
        self.stderr_path = workdir / f"harness-{time.monotonic_ns()}.err"
        self._stderr = open(self.stderr_path, "w")
        env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0:abort_on_error=1",
                   UBSAN_OPTIONS="print_stacktrace=1")
        self.proc = subprocess.Popen([str(executable), "script"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._stderr, text=True,
                                     bufsize=1, env=env)
        self.pid = self.proc.pid
        self._answers: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read_answers, daemon=True).start()

    def _read_answers(self) -> None:
        for line in self.proc.stdout:
            self._answers.put(line.rstrip("\n"))
        self._answers.put(None)

    def cmd(self, line: str, timeout: float = ANSWER_TIMEOUT) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        try:
            answer = self._answers.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"harness gave no answer to {line[:80]!r}") from None
        if answer is None:
            code = self.proc.wait(timeout=10)
            raise AssertionError(f"harness died (exit {code}) on {line[:80]!r}:\n"
                                 f"{self.stderr_path.read_text()[-4000:]}")
        return answer

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        try:
            code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError("harness did not exit when its input closed")
        finally:
            self._stderr.close()
        assert code == 0, f"harness exit {code}:\n{self.stderr_path.read_text()[-4000:]}"

    # typed commands ------------------------------------------------------------------------

    @staticmethod
    def _rc(answer: str) -> int:
        kind, _, value = answer.partition(" ")
        assert kind == "rc", answer
        return int(value)

    def connect(self, path: str, timeout_ms: int = 20_000) -> int:
        return self._rc(self.cmd(f"connect {path} {timeout_ms}"))

    def send(self, data: bytes) -> int:
        return self._rc(self.cmd(f"send {data.hex()}"))

    def recv(self, timeout_ms: int = 20_000, cap: int | None = None) -> bytes | None | int:
        """The message, None when nothing came in time, or the negative errno."""
        answer = self.cmd(f"recv {timeout_ms}" + (f" {cap}" if cap is not None else ""))
        kind, _, value = answer.partition(" ")
        if kind == "msg":
            return bytes.fromhex(value)
        if kind == "none":
            return None
        return self._rc(answer)

    def parse(self, data: bytes) -> dict | None:
        answer = self.cmd(f"parse {data.hex()}")
        if answer == "rejected":
            return None
        kind, _, document = answer.partition(" ")
        assert kind == "parsed", answer
        return json.loads(document)

    def build(self, msg_type: str, cap: int | None = None, **fields) -> bytes | None:
        """Build with the C builder. Field values are bytes, str or int; lists repeat the key."""
        args = [f"cap={cap}"] if cap is not None else []
        for key, value in fields.items():
            for item in value if isinstance(value, list) else [value]:
                raw = item if isinstance(item, bytes) else str(item).encode()
                args.append(f"{key}={raw.hex()}")
        answer = self.cmd(" ".join(["build", msg_type, *args]))
        if answer == "invalid":
            return None
        kind, _, value = answer.partition(" ")
        assert kind == "built", answer
        return bytes.fromhex(value)


@pytest.fixture
def sockdir():
    path = tempfile.mkdtemp(prefix="nvs-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def harness(wire_build):
    h = Harness(wire_build["checked"], wire_build["dir"])
    yield h
    h.close()


@pytest.fixture(scope="module")
def codec(wire_build):
    """One long-lived harness for the codec tests (no sockets): hypothesis runs many examples."""
    h = Harness(wire_build["checked"], wire_build["dir"])
    yield h
    h.close()


@pytest.fixture
def zctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def bind_router(ctx: zmq.Context, path: str, **options) -> zmq.Socket:
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    for name, value in options.items():
        router.setsockopt(getattr(zmq, name), value)
    router.bind(f"ipc://{path}")
    return router


def router_recv(router: zmq.Socket, timeout_ms: int = 10_000) -> list[zmq.Frame]:
    assert router.poll(timeout_ms), "the ROUTER received nothing"
    return router.recv_multipart(copy=False)


# --- a hand-driven ZMTP peer ---------------------------------------------------------------

CLIENT_GREETING = (b"\xff" + bytes(8) + b"\x7f" + b"\x03\x01" + b"NULL".ljust(20, b"\x00")
                   + b"\x00" + bytes(31))
CLIENT_READY = b"\x04\x1c\x05READY\x0bSocket-Type\x00\x00\x00\x06DEALER"


def server_greeting(major: int = 3, minor: int = 1, mechanism: bytes = b"NULL") -> bytes:
    return (b"\xff" + bytes(8) + b"\x7f" + bytes([major, minor]) + mechanism.ljust(20, b"\x00")
            + b"\x00" + bytes(31))


def frame(body: bytes, more: bool = False, command: bool = False, long: bool = False) -> bytes:
    flags = (0x01 if more else 0) | (0x04 if command else 0)
    if long or len(body) > 255:
        return bytes([flags | 0x02]) + struct.pack(">Q", len(body)) + body
    return bytes([flags, len(body)]) + body


def command(name: bytes, data: bytes = b"", long: bool = False) -> bytes:
    return frame(bytes([len(name)]) + name + data, command=True, long=long)


def ready(socket_type: bytes = b"ROUTER", extra: bytes = b"") -> bytes:
    prop = b"\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type
    return command(b"READY", extra + prop)


def ping(context: bytes = b"", ttl: int = 0) -> bytes:
    return command(b"PING", struct.pack(">H", ttl) + context)


def pong(context: bytes) -> bytes:
    return command(b"PONG", context)


def read_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        assert chunk, f"peer closed after {len(data)} of {n} bytes"
        data += chunk
    return data


class RawPeer:
    """A listening AF_UNIX socket that plays the scheduler's side of ZMTP by hand."""

    def __init__(self, path: str):
        self.path = path
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(4)
        self.listener.settimeout(ANSWER_TIMEOUT)
        self.pool = concurrent.futures.ThreadPoolExecutor(1)
        self.conns: list[socket.socket] = []

    def accept(self) -> socket.socket:
        conn, _ = self.listener.accept()
        conn.settimeout(ANSWER_TIMEOUT)
        self.conns.append(conn)
        return conn

    def handshake(self, greeting: bytes | None = None, reply: bytes | None = None,
                  chunk: int = 0) -> socket.socket:
        """Accept, check the client's greeting and READY byte for byte, answer (in pieces of
        `chunk` bytes with pauses when chunk > 0)."""
        conn = self.accept()
        outgoing = (server_greeting() if greeting is None else greeting) + (
            ready() if reply is None else reply)
        if chunk:
            for i in range(0, len(outgoing), chunk):
                conn.sendall(outgoing[i:i + chunk])
                time.sleep(0.002)
        else:
            conn.sendall(outgoing)
        assert read_exactly(conn, len(CLIENT_GREETING)) == CLIENT_GREETING
        assert read_exactly(conn, len(CLIENT_READY)) == CLIENT_READY
        return conn

    def in_background(self, fn, *args, **kwargs) -> concurrent.futures.Future:
        return self.pool.submit(fn, *args, **kwargs)

    def close(self) -> None:
        for conn in self.conns:
            conn.close()
        self.listener.close()
        self.pool.shutdown(wait=True)


@pytest.fixture
def raw_peer(sockdir):
    peer = RawPeer(os.path.join(sockdir, "raw.sock"))
    yield peer
    peer.close()


def connect_raw(harness: Harness, peer: RawPeer, **handshake) -> socket.socket:
    future = peer.in_background(peer.handshake, **handshake)
    assert harness.connect(peer.path) == 0
    return future.result(timeout=ANSWER_TIMEOUT)


# --- the Python codec as the oracle ----------------------------------------------------------
# Everything here derives from the protocol table, so that a message or a field added there is
# checked between the two codecs without a new test.

READS = [m for m in table.MESSAGES if m.sender is table.Sender.SCHEDULER and not m.reply_to]
WRITES = [m for m in table.MESSAGES if m.sender is table.Sender.CLIENT]
WORD_FIELDS = [(m.type, f) for m in READS for f in m.fields if f.kind is table.Kind.WORD]
UNKNOWN_WORD = "not-yet-invented"
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
codecs.register_error("wire-test-qmark", lambda e: ("?" * (e.end - e.start), e.end))


def cut(text: str, limit: int) -> str:
    """`text` cut to `limit` UTF-8 bytes at a character boundary."""
    return text.encode()[:limit].decode(errors="ignore")


def sanitized(raw: bytes) -> str:
    """What the C builders make of a free text: ill-formed UTF-8 bytes and control characters
    become '?', cut to 1024 bytes."""
    return cut(CONTROL.sub("?", raw.decode("utf-8", errors="wire-test-qmark")), protocol.MAX_VALUE)


def python_decode(data: bytes) -> protocol.Message | None:
    try:
        return protocol.decode(data, protocol.SCHEDULER_MESSAGES)
    except protocol.ProtocolError:
        return None


def python_refusal(data: bytes) -> str | None:
    """The error code the Python codec refuses `data` with, None when it reads it."""
    try:
        protocol.decode(data, protocol.SCHEDULER_MESSAGES)
    except protocol.ProtocolError as error:
        return error.code
    return None


def c_view(msg: protocol.Message) -> dict:
    """The members of struct nvs_msg the C parser must fill for a message Python decoded."""
    view: dict = {"type": msg.TYPE}
    for f in table.BY_TYPE[msg.TYPE].fields:
        value = getattr(msg, f.name)
        if f.kind is table.Kind.JSON:
            continue  # not kept
        if f.kind is table.Kind.WORD:
            view[f.c_member + "_text"] = value
            view[f.words.name] = f.words.words.index(value) + 1 if value in f.words else 0
        elif f.kind is table.Kind.TEXT:
            view[f.c_member] = cut(value, f.c_size - 1)
        elif f.kind is table.Kind.FLAG:
            view[f.c_member] = int(value)
        elif f.nullable:
            view[f.c_member], view["has_" + f.c_member] = value or 0, int(value is not None)
        else:
            view[f.c_member] = value
    view["unknown"] = [[msg.TYPE, name, word] for name, word in protocol.unknown_words(msg)]
    return view


def assert_parsed_like(parsed: dict | None, msg: protocol.Message) -> None:
    assert parsed is not None, f"C parser rejected {msg}"
    expected = c_view(msg)
    assert {key: parsed[key] for key in expected} == expected


def assert_agree(parsed: dict | None, data: bytes) -> None:
    """The C parser reads `data` as the Python codec does: the same message, the same refusal,
    and a type a client does not read as UNKNOWN (Python: unknown-type)."""
    if data.startswith(b"NVSHARE/1 STATUS\n"):
        return  # the client reads STATUS only for its arrival (test_parser_reports_status_...)
    msg = python_decode(data)
    if msg is not None:
        assert_parsed_like(parsed, msg)
    elif python_refusal(data) == "unknown-type":
        assert parsed is not None and parsed["type"] == "UNKNOWN", f"{data!r}: {parsed}"
    else:
        assert parsed is None, f"C accepted what Python refuses: {data!r}"


# hypothesis strategies ----------------------------------------------------------------------

devices = st.from_regex(r"[A-Za-z0-9-]{1,96}", fullmatch=True)
uints = st.integers(0, protocol.MAX_INT)
# Valid values: no control characters, at most 1024 bytes (256 characters of up to 4 bytes).
characters = st.characters(exclude_categories=("Cs",), exclude_characters="\x7f",
                           min_codepoint=0x20)
texts = st.text(characters, max_size=256)
short_texts = st.text(characters, max_size=24)
device_lists = st.lists(devices, max_size=12)


def value_strategy(f: table.Field) -> st.SearchStrategy:
    """Valid values of a field, as its Python class holds them (known words only)."""
    kinds = {
        table.Kind.DEVICE: devices, table.Kind.UINT: uints, table.Kind.TEXT: texts,
        table.Kind.SESSION: st.from_regex(r"[0-9a-f]{16}", fullmatch=True),
        table.Kind.DEVICES: device_lists.map(tuple), table.Kind.FLAG: st.booleans(),
        table.Kind.WORD: st.sampled_from(f.words.words) if f.words else st.nothing(),
        table.Kind.JSON: st.just("{}"),
    }
    strategy = kinds[f.kind]
    return st.none() | strategy if f.nullable else strategy


def message_strategy(spec: table.Message) -> st.SearchStrategy:
    cls = protocol.CLIENT_MESSAGES.get(spec.type) or protocol.SCHEDULER_MESSAGES[spec.type]
    return st.builds(cls, **{f.name: value_strategy(f) for f in spec.fields})


scheduler_messages = st.one_of([message_strategy(m) for m in READS])
known_keys = {f.name for m in table.MESSAGES for f in m.fields}
unknown_keys = st.from_regex(r"[a-z][a-z0-9_]{0,31}", fullmatch=True).filter(lambda key: key not in known_keys)


def with_field(msg: protocol.Message, key: str, value: str) -> bytes:
    """`msg` encoded with `key`'s value replaced by `value` (any text: an encoder would refuse
    a word outside its vocabulary)."""
    header, *fields = msg.encode().decode().split("\n")
    fields = [line for line in fields if not line.startswith(f"{key}=")] + [f"{key}={value}"]
    return "\n".join([header, *fields]).encode()


# --- the codec: builders ----------------------------------------------------------------------


def build_args(msg: protocol.Message) -> dict:
    """The harness's build arguments that should produce `msg`: a field holding its default is
    left out, as a C caller would leave it out."""
    args = {}
    for f in table.BY_TYPE[msg.TYPE].fields:
        value = getattr(msg, f.name)
        if f.optional and value == f.default:
            continue
        args[f.name] = list(value) if isinstance(value, tuple) else int(value) if isinstance(value, bool) else value
    return args


@pytest.mark.parametrize("spec", WRITES, ids=lambda m: m.type)
def test_every_client_message_is_built_as_python_encodes_it(codec, spec):
    """One example per client message, every field given (defaults changed where a field has
    one): the C builder writes what the Python encoder writes."""
    example = {}
    for f in spec.fields:
        example[f.name] = {
            table.Kind.DEVICE: DEVICE, table.Kind.UINT: 12345, table.Kind.TEXT: "some text",
            table.Kind.SESSION: "0123456789abcdef", table.Kind.DEVICES: (DEVICE, "MIG-1"),
            table.Kind.FLAG: True, table.Kind.WORD: f.words.words[0] if f.words else "",
        }[f.kind]
    msg = protocol.CLIENT_MESSAGES[spec.type](**example)
    built = codec.build(spec.type.lower(), **build_args(msg))
    assert built == msg.encode()
    assert protocol.decode(built) == msg


@pytest.mark.parametrize("msg_type, fields", [
    ("acquire", {}),  # no device at all
    ("acquire", {"device": ""}),
    ("acquire", {"device": "GPU 0"}),
    ("acquire", {"device": "GPU-0,GPU-1"}),
    ("acquire", {"device": "GPU-é"}),
    ("acquire", {"device": "G" * 97}),
    ("device", {"device": DEVICE, "total": 2**63}),
    ("memory", {"device": DEVICE, "used": 2**64 - 1}),
    ("release", {"device": DEVICE, "grant": 1, "reason": "later"}),  # a sender speaks only known words
    ("release", {"device": DEVICE, "grant": 1, "reason": "Idle"}),
    ("hello", {"pid": 2**64 - 1, "session": "0123456789abcdef"}),  # what the C core sends for a negative pid
    ("hello", {"pid": 1, "session": "0123456789ABCDEF"}),
    ("hello", {"pid": 1, "session": "0123456789abcde"}),
    ("hello", {"pid": 1, "session": "0123456789abcdef0"}),
    ("hello", {"pid": 1}),
    ("hello", {"pid": 1, "session": "0123456789abcdef", "held": ["GPU-1", "bad id"]}),
    # 11 ids of 96 characters: 1066 bytes once joined, over the 1024-byte value limit
    ("hello", {"pid": 1, "session": "0123456789abcdef", "wanted": ["W" * 96] * 11}),
    # 65 ids: more than one registration may name
    ("hello", {"pid": 1, "session": "0123456789abcdef", "held": [f"G{i}" for i in range(65)]}),
    # five 1024-byte texts: over the 4096-byte message limit
    ("hello", {"pid": 1, "session": "0123456789abcdef", "host": "h" * 1024,
               "container": "c" * 1024, "pod": "p" * 1024, "namespace": "n" * 1024,
               "program": "x" * 1024}),
])
def test_builders_refuse_invalid_arguments(codec, msg_type, fields):
    assert codec.build(msg_type, **fields) is None


def test_builders_accept_the_limits(codec):
    assert protocol.decode(codec.build("acquire", device="G" * 96)) == protocol.Acquire("G" * 96)
    ids = ["W" * 96] * 10  # 969 bytes joined
    built = codec.build("hello", pid=1, session="0123456789abcdef", wanted=ids)
    assert protocol.decode(built).wanted == tuple(ids)
    ids = [f"G{i}" for i in range(64)]
    assert protocol.decode(codec.build("hello", pid=1, session="0123456789abcdef", held=ids)).held == tuple(ids)


def test_a_default_goes_without_saying(codec):
    """RELEASE reason=user is the default: left out by both codecs, read back as user."""
    for args in ({}, {"reason": "user"}):
        built = codec.build("release", device=DEVICE, grant=3, **args)
        assert built == f"NVSHARE/1 RELEASE\ndevice={DEVICE}\ngrant=3".encode()
        assert built == protocol.Release(device=DEVICE, grant=3).encode()
        assert protocol.decode(built).reason == "user"


def test_builders_never_write_past_the_capacity(codec):
    full = codec.build("release", device=DEVICE, grant=12345, reason="idle")
    # the harness hands the builder a heap block of exactly `cap` bytes (AddressSanitizer)
    assert codec.build("release", cap=len(full), device=DEVICE, grant=12345, reason="idle") == full
    for cap in (0, 1, 9, 10, len(full) - 1):
        assert codec.build("release", cap=cap, device=DEVICE, grant=12345, reason="idle") is None
    assert codec.build("heartbeat", cap=len(b"NVSHARE/1 HEARTBEAT")) == b"NVSHARE/1 HEARTBEAT"
    assert codec.build("heartbeat", cap=len(b"NVSHARE/1 HEARTBEAT") - 1) is None


@pytest.mark.parametrize("raw, expected", [
    (b"tab\there", "tab?here"),
    (b"line\nbreak\r", "line?break?"),
    (b"del\x7f", "del?"),
    (b"caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x9a\x80", "café € 🚀"),
    (b"\xff\xfe", "??"),
    (b"\xe2\x82", "??"),  # a truncated three-byte character
    (b"\xed\xa0\x80", "???"),  # an encoded surrogate
    (b"\xc0\xaf", "??"),  # an overlong '/'
    (b"\xf4\x90\x80\x80", "????"),  # above U+10FFFF
    (b"\xc2\x85", "\x85"),  # U+0085 is no control character for the protocol
    (b"a" + "é".encode() * 600, "a" + "é" * 511),  # cut at a character boundary to 1024 bytes
])
def test_builders_make_free_texts_acceptable(codec, raw, expected):
    built = codec.build("device", device=DEVICE, total=1, name=raw)
    assert protocol.decode(built) == protocol.DeviceAnnouncement(device=DEVICE, total=1, name=expected)
    assert sanitized(raw) == expected  # the oracle of the property test below agrees


free_texts = st.binary(max_size=1500).map(lambda b: b.replace(b"\x00", b"\x01"))


@st.composite
def client_messages(draw):
    """(message type, C builder arguments, the Python message expected, or None where the
    builder must refuse): any client message of the table, with values the C side may be given
    (free texts of any bytes, numbers up to 2^64-1, omitted optional fields)."""
    spec = draw(st.sampled_from(WRITES))
    args, values, valid = {}, {}, True
    for f in spec.fields:
        if f.optional and draw(st.booleans()):
            continue  # left out: the default
        if f.kind is table.Kind.TEXT:
            raw = draw(free_texts)
            args[f.name], values[f.name] = raw, sanitized(raw)
        elif f.kind is table.Kind.UINT:
            number = draw(st.integers(0, 2**64 - 1))
            args[f.name], values[f.name] = number, number
            valid = valid and number <= protocol.MAX_INT
        elif f.kind is table.Kind.DEVICES:
            ids = draw(device_lists)
            args[f.name], values[f.name] = ids, tuple(ids)
            valid = valid and len(",".join(ids)) <= protocol.MAX_VALUE
        else:
            value = draw(value_strategy(f))
            args[f.name], values[f.name] = (int(value) if isinstance(value, bool) else value), value
    expected = protocol.CLIENT_MESSAGES[spec.type](**values)
    if valid:
        try:
            expected.encode()
        except ValueError:  # over 4096 bytes
            valid = False
    return spec.type, args, expected if valid else None


@HYPOTHESIS
@given(client_messages())
def test_builders_agree_with_python_encoder(codec, case):
    kind, args, expected = case
    built = codec.build(kind.lower(), **args)
    if expected is None:
        assert built is None
    else:
        assert built == expected.encode()
        assert protocol.decode(built) == expected


# --- the codec: parser ------------------------------------------------------------------------


@pytest.mark.parametrize("spec", READS, ids=lambda m: m.type)
def test_parser_reads_every_scheduler_message(codec, spec):
    for msg in (protocol.SCHEDULER_MESSAGES[spec.type](**{f.name: v for f, v in zip(spec.fields, example)})
                for example in ([_example(f, 0) for f in spec.fields], [_example(f, 1) for f in spec.fields])):
        assert_parsed_like(codec.parse(msg.encode()), msg)


def _example(f: table.Field, which: int):
    """Two different valid values of a field (the second a default's alternative)."""
    return {
        table.Kind.DEVICE: (DEVICE, "G"), table.Kind.UINT: (17, protocol.MAX_INT),
        table.Kind.TEXT: ("c12", "é" * 20), table.Kind.FLAG: (True, False),
        table.Kind.WORD: (f.words.words[0], f.words.words[-1]) if f.words else ("", ""),
    }[f.kind][which]


@pytest.mark.parametrize("msg_type, field", WORD_FIELDS, ids=[f"{t}.{f.name}" for t, f in WORD_FIELDS])
def test_a_word_neither_side_knows_is_read_and_named(codec, msg_type, field):
    """docs/protocol.md, "Unknown words": a word a newer scheduler may send is read by both
    codecs, kept as text (C: number 0, its vocabulary's UNKNOWN) and named, so that the
    receiver acts on the message all the same."""
    spec = table.BY_TYPE[msg_type]
    known = protocol.SCHEDULER_MESSAGES[msg_type](**{f.name: _example(f, 0) for f in spec.fields})
    data = with_field(known, field.name, UNKNOWN_WORD)
    msg = protocol.decode(data, protocol.SCHEDULER_MESSAGES)
    assert getattr(msg, field.name) == UNKNOWN_WORD
    assert protocol.unknown_words(msg) == [(field.name, UNKNOWN_WORD)]
    parsed = codec.parse(data)
    assert_parsed_like(parsed, msg)
    assert parsed[field.words.name] == 0 and parsed["unknown"] == [[msg_type, field.name, UNKNOWN_WORD]]
    # Not a word at all is still malformed, for both.
    for bad in ("Preempted", "pre empted", "x" * 33, ""):
        bad_data = with_field(known, field.name, bad)
        assert python_refusal(bad_data) == "bad-field" and codec.parse(bad_data) is None


@pytest.mark.parametrize("text, python_says", [
    ("NVSHARE/1 GRANT\ndevice=G\ngrant=7\nmode=on\nexclusive=1\nquantum_ms=5", None),
    ("NVSHARE/1 GRANT\ndevice=G\ngrant=7\nmode=on\nexclusive=1\nquantum_ms=5\n", None),
    ("NVSHARE/1 GRANT\ndevice=G\ngrant=7\nmode=on\nexclusive=1\nquantum_ms=5\n\n", "malformed"),
    ("NVSHARE/1 GRANT\r\ndevice=G\r\ngrant=7\nmode=on\nexclusive=1\nquantum_ms=5", "malformed"),
    ("NVSHARE/0001 GRANT\ndevice=G\ngrant=0007\nmode=on\nexclusive=1\nquantum_ms=5", None),
    ("NVSHARE/2 GRANT\ndevice=G\ngrant=7\nmode=on\nexclusive=1\nquantum_ms=5", "unsupported-version"),
    ("NVSHARE/00001 GRANT\ndevice=G\ngrant=7\nmode=on\nexclusive=1\nquantum_ms=5", "malformed"),
    ("NVSHARE/1 GRANT\ndevice=G\ngrant=9223372036854775807\nmode=on\nexclusive=1\nquantum_ms=5", None),
    ("NVSHARE/1 GRANT\ndevice=G\ngrant=9223372036854775808\nmode=on\nexclusive=1\nquantum_ms=5", "bad-field"),
    ("NVSHARE/1 GRANT\ndevice=G\ngrant=00000000000000000001\nmode=on\nexclusive=1\nquantum_ms=5",
     "bad-field"),  # 20 digits
    ("NVSHARE/1 GRANT\ndevice=G\ngrant=٣\nmode=on\nexclusive=1\nquantum_ms=5", "bad-field"),
    ("NVSHARE/1 GRANT\ndevice=G\ngrant=+7\nmode=on\nexclusive=1\nquantum_ms=5", "bad-field"),
    ("NVSHARE/1 GRANT\ndevice=G\ngrant=\nmode=on\nexclusive=1\nquantum_ms=5", "bad-field"),
    ("NVSHARE/1 GRANT\ndevice=G\ngrant=7\nmode=ON\nexclusive=1\nquantum_ms=5", "bad-field"),
    ("NVSHARE/1 GRANT\ndevice=G\ngrant=7\nmode=fair\nexclusive=0\nquantum_ms=5", None),  # a newer mode
    ("NVSHARE/1 GRANT\ndevice=G\ngrant=7\nmode=on\nexclusive=yes\nquantum_ms=5", "bad-field"),
    ("NVSHARE/1 GRANT\ndevice=G\ngrant=7\nmode=on\nexclusive=1", "bad-field"),  # missing quantum_ms
    ("NVSHARE/1 GRANT\ndevice=G\ngrant=7\nmode=on\nexclusive=1\nquantum_ms=5\nfuture=x=y", None),
    ("NVSHARE/1 GRANT\ndevice=G\ngrant=7\nmode=on\nexclusive=1\nquantum_ms=5\nx=1\nx=1", "malformed"),
    ("NVSHARE/1 GRANT\ndevice=G\ngrant=7\nmode=on\nexclusive=1\nquantum_ms=5\nX=1", "malformed"),
    ("NVSHARE/1 GRANT\ndevice=G\ngrant=7\nmode=on\nexclusive=1\nquantum_ms=5\n=1", "malformed"),
    ("NVSHARE/1 GRANT\ndevice=G\ngrant=7\nmode=on\nexclusive=1\nquantum_ms=5\nnoequals", "malformed"),
    ("NVSHARE/1 GRANT\ndevice=G\ngrant=7\nmode=on\nexclusive=1\nquantum_ms=5\nk=a\tb", "bad-field"),
    ("NVSHARE/1 GRANT\ndevice=G\ngrant=7\nmode=on\nexclusive=1\nquantum_ms=5\n" + "k" * 32 + "=1", None),
    ("NVSHARE/1 GRANT\ndevice=G\ngrant=7\nmode=on\nexclusive=1\nquantum_ms=5\n" + "k" * 33 + "=1",
     "malformed"),
    ("NVSHARE/1 GRANT\ndevice=G\ngrant=7\nmode=on\nexclusive=1\nquantum_ms=5\nk=" + "v" * 1024, None),
    ("NVSHARE/1 GRANT\ndevice=G\ngrant=7\nmode=on\nexclusive=1\nquantum_ms=5\nk=" + "v" * 1025,
     "bad-field"),
    ("NVSHARE/1 GRANT\ndevice=G\ngrant=7\nmode=on\nexclusive=1\nquantum_ms=5\n"
     + "".join(f"k{i}=1\n" for i in range(27)), None),  # 32 fields
    ("NVSHARE/1 GRANT\ndevice=G\ngrant=7\nmode=on\nexclusive=1\nquantum_ms=5\n"
     + "".join(f"k{i}=1\n" for i in range(28)), "malformed"),  # 33 fields
    ("NVSHARE/1 GRANT\ndevice=G-" + "x" * 95 + "\ngrant=7\nmode=on\nexclusive=1\nquantum_ms=5",
     "bad-field"),  # a 97-character device id
    ("NVSHARE/1 WELCOME\nclient=c1\nheartbeat_ms=1000\nidle_release_ms=250\nversion=1", None),
    ("NVSHARE/1 WELCOME\nclient=\nheartbeat_ms=1000\nidle_release_ms=250\nversion=7", None),
    ("NVSHARE/1 WELCOME\nclient=c1\nheartbeat_ms=1000\nidle_release_ms=250", "bad-field"),
    ("NVSHARE/1 ERROR\ncode=too-large", None),
    ("NVSHARE/1 ERROR\ncode=oops", None),  # a newer error code: read, kept as text
    ("NVSHARE/1 ERROR\ncode=Oops", "bad-field"),
    ("NVSHARE/1 DROP\ndevice=G\ngrant=1\ngrace_ms=1\nreason=grace-expired", None),  # unknown to DROP
    ("NVSHARE/1 REVOKE\ndevice=G\ngrant=1\nreason=grace-expired", None),
    ("NVSHARE/1 REVOKE\ndevice=G\ngrant=1\nreason=preempted", None),
    ("NVSHARE/1 CONTENDED\ndevice=G\ngrant=1\nquantum_left_ms=29000", None),
    ("NVSHARE/1 CONTENDED\nquantum_left_ms=0\ngrant=1\ndevice=G\nfuture=1", None),
    ("NVSHARE/1 CONTENDED\ndevice=G\ngrant=1", "bad-field"),  # missing quantum_left_ms
    ("NVSHARE/1 CONTENDED\ndevice=G\nquantum_left_ms=5", "bad-field"),  # missing grant
    ("NVSHARE/1 CONTENDED\ndevice=G\ngrant=1\nquantum_left_ms=-5", "bad-field"),
    ("NVSHARE/1 CONTENDED\ndevice=G\ngrant=1\nquantum_left_ms=9223372036854775808", "bad-field"),
    ("NVSHARE/1 CONTENDED\ndevice=G,H\ngrant=1\nquantum_left_ms=5", "bad-field"),
    ("NVSHARE/1 CONTENDED\ndevice=G\ngrant=1\nquantum_left_ms=5\nquantum_left_ms=5", "malformed"),
    ("NVSHARE/1 ACQUIRE\ndevice=G", "unknown-type"),  # a client message
    ("NVSHARE/1 UNKNOWN", "unknown-type"),
    ("NVSHARE/1 SWAPPED\ndevice=G\nbytes=oops", "unknown-type"),  # a newer type's fields are not read
    ("NVSHARE/1 welcome\nclient=c\nheartbeat_ms=1\nidle_release_ms=1\nversion=1", "malformed"),
    ("NVSHARE/1  GRANT", "malformed"),
    ("NVSHARE/1", "malformed"),
    ("", "malformed"),
    ("\n", "malformed"),
    ("NVSHARE/1 ERROR\ncode=malformed\ndetail=" + "é" * 512, None),
    ("NVSHARE/1 ERROR\ncode=malformed\ndetail=" + "x" * 1023 + "é", "bad-field"),  # 1025 bytes
])
def test_parser_accepts_what_python_accepts(codec, text, python_says):
    data = text.encode()
    assert python_refusal(data) == python_says, "the Python codec changed: update this table"
    parsed = codec.parse(data)
    assert_agree(parsed, data)
    if python_says == "unknown-type":
        assert parsed["unknown_type"] == text.split("\n")[0].split(" ")[1]


def test_parser_reports_status_without_reading_its_document(codec):
    """STATUS answers the interceptor's own QUERY (its registration check after a silence,
    docs/interceptor.md): only its arrival matters, so even a document longer than other values
    may fill it (not checked as JSON); a registered client's decoder (Python's) does not take it."""
    document = '{"devices":[' + ",".join(['{"device":"G"}'] * 200) + "]}"
    for data in (b"NVSHARE/1 STATUS\njson={}", ("NVSHARE/1 STATUS\njson=" + document).encode()):
        assert python_decode(data) is None
        parsed = codec.parse(data)
        assert parsed["type"] == "STATUS"
        assert not any(value for key, value in parsed.items() if key != "type"), parsed
    assert codec.parse(b"NVSHARE/1 STATUS") is None  # json is required
    assert codec.parse(("NVSHARE/1 STATUS\njson=" + "x" * (table.STATUS_DOCUMENT_MAX + 1)).encode()) is None


def test_codec_speaks_the_residency_fields(codec):
    """docs/protocol.md "Residency": GRANT prefetch=, DROP evict= and EVICT bytes= are read (absent:
    0); MEMORY and RELEASE carry resident= only when given, EVICTED always."""
    grant = codec.parse(f"NVSHARE/1 GRANT\ndevice={DEVICE}\ngrant=3\nmode=on\nexclusive=1\nquantum_ms=9\n"
                        f"prefetch={protocol.MAX_INT}".encode())
    assert (grant["type"], grant["prefetch"], grant["evict"]) == ("GRANT", protocol.MAX_INT, 0)
    drop = codec.parse(f"NVSHARE/1 DROP\ndevice={DEVICE}\ngrant=3\ngrace_ms=5\nreason=quantum\nevict=77".encode())
    assert (drop["type"], drop["evict"], drop["prefetch"]) == ("DROP", 77, 0)
    evict = codec.parse(f"NVSHARE/1 EVICT\ndevice={DEVICE}\nbytes=12".encode())
    assert (evict["type"], evict["device"], evict["bytes"]) == ("EVICT", DEVICE, 12)
    for damaged in (f"NVSHARE/1 EVICT\ndevice={DEVICE}", f"NVSHARE/1 EVICT\ndevice={DEVICE}\nbytes=-1",
                    f"NVSHARE/1 DROP\ndevice={DEVICE}\ngrant=3\ngrace_ms=5\nreason=quantum\nevict=x"):
        assert codec.parse(damaged.encode()) is None
    assert codec.build("memory", device=DEVICE, used=10, resident=4) == \
        f"NVSHARE/1 MEMORY\ndevice={DEVICE}\nused=10\nresident=4".encode()
    assert codec.build("memory", device=DEVICE, used=10) == f"NVSHARE/1 MEMORY\ndevice={DEVICE}\nused=10".encode()
    assert codec.build("release", device=DEVICE, grant=3, reason="drop", resident=0) == \
        f"NVSHARE/1 RELEASE\ndevice={DEVICE}\ngrant=3\nreason=drop\nresident=0".encode()
    assert codec.build("evicted", device=DEVICE, resident=5) == f"NVSHARE/1 EVICTED\ndevice={DEVICE}\nresident=5".encode()
    assert codec.build("evicted", device="bad id", resident=5) is None
    assert codec.build("evicted", device=DEVICE, resident=protocol.MAX_INT + 1) is None


@pytest.mark.parametrize("data", [
    b"NVSHARE/1 ERROR\ncode=malformed\ndetail=\xff",
    b"NVSHARE/1 ERROR\ncode=malformed\ndetail=\xed\xa0\x80",  # surrogate
    b"NVSHARE/1 ERROR\ncode=malformed\ndetail=\xc0\xaf",  # overlong
    b"NVSHARE/1 ERROR\ncode=malformed\ndetail=\xe2\x82",  # truncated
    b"NVSHARE/1 ERROR\ncode=malformed\ndetail=a\x00b",
    b"NVSHARE/1 ERROR\ncode=malformed\ndetail=" + b"x" * 4096,  # over 4096 bytes in all
])
def test_parser_rejects_bytes_python_rejects(codec, data):
    assert python_decode(data) is None
    assert codec.parse(data) is None


def test_parser_cuts_long_texts_at_character_boundaries(codec):
    msg = protocol.Error(code="malformed", detail="é" * 300, type="T" * 30 + "€")
    parsed = codec.parse(msg.encode())
    assert parsed["detail"] == "é" * 127  # 254 of the 255 bytes the C struct has room for
    assert parsed["error_type"] == "T" * 30  # the euro sign does not fit whole
    welcome = protocol.Welcome(client="c" * 100, heartbeat_ms=1, idle_release_ms=2)
    assert codec.parse(welcome.encode())["client"] == "c" * 63


@st.composite
def reworded(draw, messages=scheduler_messages):
    """A valid scheduler message as another sender could write it: fields in any order, unknown
    keys between them, words it may not know, maybe a trailing newline."""
    msg = draw(messages)
    header, *fields = msg.encode().decode().split("\n")
    for index, line in enumerate(fields):
        key = line.partition("=")[0]
        if key in {f.name for _, f in WORD_FIELDS} and draw(st.integers(0, 4)) == 0:
            fields[index] = f"{key}={UNKNOWN_WORD}"
    extra_keys = draw(st.lists(unknown_keys, unique=True, max_size=protocol.MAX_FIELDS - len(fields)))
    fields += [f"{key}={draw(short_texts)}" for key in extra_keys]
    fields = draw(st.permutations(fields))
    data = "\n".join([header, *fields]).encode() + draw(st.sampled_from([b"", b"\n"]))
    return data


@HYPOTHESIS
@given(reworded())
def test_parser_reads_python_encoded_messages(codec, data):
    if len(data) <= protocol.MAX_MESSAGE:  # else the unknown keys made it too long for anyone
        assert python_decode(data) is not None
    assert_agree(codec.parse(data), data)


MUTATION_BYTES = b"\n=,-019azAZ_ \x00\x1f\x7f\x80\xbf\xc3\xa9\xe2\xed\xa0\xf0\xf4\xff"


@st.composite
def mutated(draw):
    data = bytearray(draw(reworded()))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["replace", "insert", "delete", "duplicate-line"]))
        pos = draw(st.integers(0, max(len(data) - 1, 0)))
        byte = draw(st.sampled_from(MUTATION_BYTES))
        if op == "replace" and data:
            data[pos] = byte
        elif op == "insert":
            data.insert(pos, byte)
        elif op == "delete" and data:
            del data[pos]
        elif op == "duplicate-line":
            lines = bytes(data).split(b"\n")
            line = lines[draw(st.integers(0, len(lines) - 1))]
            data += b"\n" + line
    return bytes(data)


@HYPOTHESIS
@given(mutated())
def test_parser_agrees_with_python_on_damaged_messages(codec, data):
    assert_agree(codec.parse(data), data)


@HYPOTHESIS
@given(st.binary(max_size=5000) | st.binary(max_size=600).map(lambda b: b"NVSHARE/1 GRANT\n" + b))
def test_parser_rejects_junk(codec, data):
    # Under AddressSanitizer/UBSan: any read out of bounds kills the harness and fails here.
    assert_agree(codec.parse(data), data)


# --- the transport against libzmq -----------------------------------------------------------


def test_handshake_with_pyzmq_router(harness, sockdir, zctx):
    path = os.path.join(sockdir, "scheduler.sock")
    router = bind_router(zctx, path)
    assert harness.connect(path) == 0
    assert harness.cmd("fdflags") == "fdflags 1 1"  # non-blocking, close-on-exec

    hello = harness.build("hello", pid=harness.pid, session="0123456789abcdef", program="wire")
    assert harness.send(hello) == 0
    routing_id, body = router_recv(router)
    # libzmq reports the kernel-verified peer (SO_PEERCRED): ...:<uid>:<gid>:<pid>
    assert body.get("Peer-Address").split(":")[-3:] == [str(os.getuid()), str(os.getgid()),
                                                         str(harness.pid)]
    assert protocol.decode(body.bytes) == protocol.Hello(pid=harness.pid,
                                                         session="0123456789abcdef",
                                                         program="wire")
    welcome = protocol.Welcome(client="c1", heartbeat_ms=1000, idle_release_ms=250)
    router.send_multipart([routing_id, welcome.encode()])
    received = harness.recv()
    assert received == welcome.encode()
    assert_parsed_like(harness.parse(received), welcome)


def test_every_client_message_reaches_the_scheduler(harness, sockdir, zctx):
    path = os.path.join(sockdir, "scheduler.sock")
    router = bind_router(zctx, path)
    assert harness.connect(path) == 0
    expected = [
        ("hello", dict(pid=7, session="00000000deadbeef", host="node", container="ctr", pod="p",
                       namespace="ns", program="train.py", held=["GPU-1"], wanted=["GPU-2"]),
         protocol.Hello(pid=7, session="00000000deadbeef", host="node", container="ctr", pod="p",
                        namespace="ns", program="train.py", held=("GPU-1",), wanted=("GPU-2",))),
        ("device", dict(device=DEVICE, total=17179869184, name="nvshare simulated GPU"),
         protocol.DeviceAnnouncement(device=DEVICE, total=17179869184, name="nvshare simulated GPU")),
        ("memory", dict(device=DEVICE, used=123), protocol.Memory(device=DEVICE, used=123)),
        ("acquire", dict(device=DEVICE), protocol.Acquire(device=DEVICE)),
        ("release", dict(device=DEVICE, grant=3, reason="idle"),
         protocol.Release(device=DEVICE, grant=3, reason="idle")),
        ("heartbeat", {}, protocol.Heartbeat()),
        ("bye", {}, protocol.Bye()),
        # a long frame (over 255 bytes) on the wire
        ("hello", dict(pid=8, session="00000000deadbeef", program="p" * 1000),
         protocol.Hello(pid=8, session="00000000deadbeef", program="p" * 1000)),
    ]
    for kind, args, _ in expected:
        assert harness.send(harness.build(kind, **args)) == 0
    routing_ids = set()
    for _, _, message in expected:
        routing_id, body = router_recv(router)
        routing_ids.add(routing_id.bytes)
        assert protocol.decode(body.bytes) == message
    assert len(routing_ids) == 1


def test_every_scheduler_message_reaches_the_client(harness, sockdir, zctx):
    path = os.path.join(sockdir, "scheduler.sock")
    router = bind_router(zctx, path)
    assert harness.connect(path) == 0
    assert harness.send(harness.build("heartbeat")) == 0
    routing_id, _ = router_recv(router)
    messages = [
        protocol.Welcome(client="c3", heartbeat_ms=500, idle_release_ms=1000),
        protocol.Grant(device=DEVICE, grant=1, mode="on", exclusive=True, quantum_ms=30000),
        protocol.Drop(device=DEVICE, grant=1, grace_ms=5000, reason="memory"),
        protocol.Revoke(device=DEVICE, grant=1, reason="grace-expired"),
        protocol.Contended(device=DEVICE, grant=1, quantum_left_ms=12345),
        protocol.ModeNotice(device=DEVICE, mode="auto", quantum_ms=10000),
        protocol.Error(code="too-large", detail="4097 bytes, limit 4096", type=""),
        protocol.Error(code="bad-field", detail="x" * 1024, type="MEMORY"),  # long frame
    ]
    for msg in messages:
        router.send_multipart([routing_id, msg.encode()])
    for msg in messages:
        received = harness.recv()
        assert received == msg.encode()
        assert_parsed_like(harness.parse(received), msg)


def test_send_limits(harness, sockdir, zctx):
    path = os.path.join(sockdir, "scheduler.sock")
    router = bind_router(zctx, path)
    assert harness.send(b"early") == -errno.ENOTCONN
    assert harness.recv(10) == -errno.ENOTCONN
    assert harness.connect(path) == 0
    assert harness.connect(path) == -errno.EISCONN
    assert harness.send(b"x" * 4097) == -errno.EMSGSIZE
    assert harness.send(b"") == 0
    assert harness.send(bytes(range(256)) * 16) == 0  # 4096 bytes, NULs included
    assert router_recv(router)[1].bytes == b""
    assert router_recv(router)[1].bytes == bytes(range(256)) * 16


def test_skips_multiframe_and_oversized_messages(harness, sockdir, zctx):
    path = os.path.join(sockdir, "scheduler.sock")
    router = bind_router(zctx, path)
    assert harness.connect(path) == 0
    assert harness.send(b"hi") == 0
    rid = router_recv(router)[0].bytes
    router.send_multipart([rid, b"part-1", b"part-2", b"part-3"])
    router.send_multipart([rid, b"first"])
    router.send_multipart([rid, b"o" * 4097])
    router.send_multipart([rid, b"second"])
    router.send_multipart([rid, b"big" * 40_000])  # far larger than the receive buffer
    router.send_multipart([rid, b"m" * 3000, b"n" * 3000, b"p" * 5000, b"tail"])
    router.send_multipart([rid, b"x" * 4096])  # exactly the limit: delivered
    router.send_multipart([rid, b""])
    router.send_multipart([rid, b"t" * 17])  # over the caller's capacity below
    router.send_multipart([rid, b"last"])
    assert harness.recv() == b"first"
    assert harness.recv() == b"second"
    assert harness.recv() == b"x" * 4096
    assert harness.recv() == b""
    assert harness.recv(cap=16) == b"last"
    assert harness.recv(200) is None


def test_eof_when_the_router_closes(harness, sockdir, zctx):
    path = os.path.join(sockdir, "scheduler.sock")
    router = bind_router(zctx, path)
    monitor = router.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    assert harness.connect(path) == 0
    assert monitor.poll(10_000)  # libzmq has read everything we sent
    recv_monitor_message(monitor)
    router.disable_monitor()
    monitor.close()
    router.close(linger=0)
    assert harness.recv(10_000) == -errno.EPIPE
    # no SIGPIPE: the harness lives on and reports the broken pipe
    assert harness.send(b"anyone?") == -errno.EPIPE
    harness.cmd("close")
    gone = -errno.ECONNREFUSED if os.path.exists(path) else -errno.ENOENT
    assert harness.connect(path) == gone


def test_reconnects_after_close(harness, sockdir, zctx):
    path = os.path.join(sockdir, "scheduler.sock")
    router = bind_router(zctx, path)
    ids = []
    for attempt in range(3):
        assert harness.connect(path) == 0
        assert harness.send(f"attempt {attempt}".encode()) == 0
        rid, body = router_recv(router)
        assert body.bytes == f"attempt {attempt}".encode()
        ids.append(rid.bytes)
        assert harness.cmd("close") == "closed"
    assert len(set(ids)) == 3  # a new connection each time, each with its own routing id


def _wait_for_event(monitor: zmq.Socket, event: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if monitor.poll(int(left * 1000) + 1) and recv_monitor_message(monitor)["event"] == event:
            return True
    return False


def test_heartbeats_keep_an_idle_client_connected(harness, wire_build, sockdir, zctx):
    path = os.path.join(sockdir, "scheduler.sock")
    # A PING every 100 ms, and 2 s to answer it: far more than a busy machine takes to schedule
    # the harness between two of its commands, so only a client that never answers is dropped.
    router = bind_router(zctx, path, HEARTBEAT_IVL=100, HEARTBEAT_TIMEOUT=2000)
    monitor = router.get_monitor_socket(zmq.EVENT_DISCONNECTED)

    # A client that reads nothing (so answers no PING) is dropped by the ROUTER. (The harness
    # only reads inside its recv/serve commands: the library has no switch for this.)
    sleeper = Harness(wire_build["checked"], wire_build["dir"])
    try:
        assert sleeper.connect(path) == 0
        assert sleeper.cmd("sleep 1000") == "slept"
        assert _wait_for_event(monitor, zmq.EVENT_DISCONNECTED, ANSWER_TIMEOUT)
        assert sleeper.recv(5000) in (-errno.EPIPE, -errno.ECONNRESET)
    finally:
        sleeper.close()

    # A client that keeps receiving answers every PING and stays connected: serve would report
    # the end of the stream, and the next message still comes with the same routing id.
    assert harness.connect(path) == 0
    assert harness.send(b"before") == 0
    rid_before = router_recv(router)[0].bytes
    assert harness.cmd("serve 4000") == "served 0"  # 40 PINGs, twice the timeout, no message
    assert harness.send(b"after") == 0
    rid_after, body = router_recv(router)
    assert (rid_after.bytes, body.bytes) == (rid_before, b"after")


# --- the transport against a hand-driven ZMTP peer ------------------------------------------


def test_handshake_in_fragments_byte_by_byte(harness, raw_peer):
    conn = connect_raw(harness, raw_peer, chunk=1,
                       reply=ready(extra=b"\x08Identity\x00\x00\x00\x00"))
    conn.sendall(frame(b"ok"))
    assert harness.recv() == b"ok"


def test_handshake_accepts_long_ready_and_a_dealer_peer(harness, raw_peer):
    socket_type = b"\x0bSocket-Type\x00\x00\x00\x06DEALER"
    conn = connect_raw(harness, raw_peer, reply=command(b"READY", socket_type, long=True))
    conn.sendall(frame(b"ok"))
    assert harness.recv() == b"ok"


def test_ping_is_answered_with_its_context(harness, raw_peer):
    conn = connect_raw(harness, raw_peer)
    conn.sendall(ping(b"ctx-0123456789ab", ttl=30) + ping() + frame(b"after the pings"))
    assert harness.recv() == b"after the pings"
    expected = pong(b"ctx-0123456789ab") + pong(b"")
    assert read_exactly(conn, len(expected)) == expected
    # a long-form PING, and a context longer than the 16 bytes allowed (cut, as libzmq does)
    conn.sendall(command(b"PING", b"\x00\x00" + b"L" * 20, long=True) + frame(b"next"))
    assert harness.recv() == b"next"
    assert read_exactly(conn, len(pong(b"L" * 16))) == pong(b"L" * 16)


def test_unknown_commands_are_ignored(harness, raw_peer):
    conn = connect_raw(harness, raw_peer)
    conn.sendall(command(b"SUBSCRIBE", b"topic") + command(b"X" * 200, b"y" * 5000)
                 + frame(b"message"))
    assert harness.recv() == b"message"


def test_many_messages_in_one_write(harness, raw_peer):
    conn = connect_raw(harness, raw_peer)
    rng = random.Random(7)
    messages = [bytes([i % 256]) * rng.choice([0, 1, 100, 255, 256, 1000, 4096])
                for i in range(120)]
    stream = b"".join(frame(m, long=(i % 3 == 0)) for i, m in enumerate(messages))
    # about 150 KiB in one write: many messages per read, many reads
    sender = raw_peer.in_background(conn.sendall, stream)
    for m in messages:
        assert harness.recv() == m
    assert harness.recv(100) is None
    sender.result(timeout=ANSWER_TIMEOUT)


def test_message_split_across_reads(harness, raw_peer):
    conn = connect_raw(harness, raw_peer)
    message = bytes(range(256)) * 12
    stream = frame(message) + frame(b"short")

    def trickle():
        for piece in (stream[:1], stream[1:5], stream[5:9], stream[9:1000], stream[1000:3080],
                      stream[3080:-3], stream[-3:]):
            conn.sendall(piece)
            time.sleep(0.05)

    sender = raw_peer.in_background(trickle)
    assert harness.recv(10_000) == message
    assert harness.recv(10_000) == b"short"
    sender.result(timeout=ANSWER_TIMEOUT)


def test_discarded_message_with_commands_between_its_frames(harness, raw_peer):
    conn = connect_raw(harness, raw_peer)
    conn.sendall(frame(b"a" * 100, more=True) + ping(b"p1") + frame(b"b" * 9000, more=True)
                 + frame(b"c", more=False) + frame(b"wanted"))
    assert harness.recv() == b"wanted"
    assert read_exactly(conn, len(pong(b"p1"))) == pong(b"p1")


@pytest.mark.parametrize("violation", [
    bytes([0x08, 1]) + b"x",  # a reserved flag bit
    bytes([0x05, 5]) + b"\x04PING",  # a command with MORE
    bytes([0x02]) + struct.pack(">Q", 2**63) + b"x",  # a size of 2^63
    command(b"PING", b"\x00"),  # a PING without its TTL
    frame(b"\x09PING", command=True),  # a command name longer than its frame
], ids=["reserved-flag", "command-more", "size-2^63", "ping-no-ttl", "name-overrun"])
def test_protocol_violations_break_the_connection(harness, raw_peer, violation):
    conn = connect_raw(harness, raw_peer)
    conn.sendall(frame(b"fine") + violation + frame(b"never seen"))
    assert harness.recv() == b"fine"
    assert harness.recv() == -errno.EPROTO


# --- connect errors ------------------------------------------------------------------------


def test_connect_error_no_socket(harness, sockdir):
    assert harness.connect(os.path.join(sockdir, "missing.sock")) == -errno.ENOENT


def test_connect_error_no_listener(harness, sockdir):
    path = os.path.join(sockdir, "stale.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()  # the file stays, nobody listens
    assert harness.connect(path) == -errno.ECONNREFUSED


def test_connect_error_path_too_long(harness, sockdir):
    path = os.path.join(sockdir, "x" * 120)
    assert harness.connect(path) == -errno.ENAMETOOLONG


@pytest.mark.skipif(os.geteuid() == 0, reason="root connects whatever the socket's mode")
def test_connect_error_no_permission(harness, sockdir):
    path = os.path.join(sockdir, "private.sock")
    private = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    private.bind(path)
    private.listen(1)
    os.chmod(path, 0o000)
    try:
        assert harness.connect(path) == -errno.EACCES
    finally:
        private.close()


def test_connect_error_peer_never_greets(harness, sockdir):
    path = os.path.join(sockdir, "mute.sock")
    mute = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    mute.bind(path)
    mute.listen(1)
    try:
        start = time.monotonic()
        assert harness.connect(path, timeout_ms=300) == -errno.ETIMEDOUT
        assert time.monotonic() - start < ANSWER_TIMEOUT
    finally:
        mute.close()


@pytest.mark.parametrize("greeting, reply, expected", [
    (b"HTTP/1.1 400 Bad Request\r\n\r\n", b"", -errno.EPROTO),
    (b"\xff" + bytes(8) + b"\x7e", b"", -errno.EPROTO),  # ZMTP 1.0 signature
    (server_greeting(major=2, minor=0), b"", -errno.EPROTO),
    (server_greeting(mechanism=b"CURVE"), b"", -errno.EPROTO),
    (server_greeting(), ready(b"PUB"), -errno.EPROTO),
    (server_greeting(), command(b"READY", b""), -errno.EPROTO),  # no Socket-Type
    (server_greeting(), command(b"READY", b"\x0bSocket-Type\x00\x00\x01\x00"), -errno.EPROTO),
    (server_greeting(), frame(b"data before READY"), -errno.EPROTO),
    (server_greeting(), command(b"HELLO", b""), -errno.EPROTO),
    (server_greeting(), command(b"ERROR", b"\x06denied"), -errno.EACCES),
    (server_greeting()[:20], None, -errno.ECONNRESET),  # closes mid-greeting
], ids=["http", "zmtp1", "zmtp2", "curve", "pub", "no-socket-type", "short-property",
        "data-first", "unknown-command", "error-command", "closed"])
def test_connect_error_peer_that_is_no_zmtp3_router(harness, raw_peer, greeting, reply, expected):
    def serve():
        conn = raw_peer.accept()
        conn.sendall(greeting + (reply or b""))
        if reply is None:
            conn.close()
            return
        try:  # keep the connection open until the client gives up on it
            while conn.recv(4096):
                pass
        except ConnectionResetError:  # it closed with our bytes unread
            pass

    done = raw_peer.in_background(serve)
    assert harness.connect(raw_peer.path, timeout_ms=10_000) == expected
    done.result(timeout=ANSWER_TIMEOUT)


def test_socket_type_is_case_insensitive_in_property_name(harness, raw_peer):
    conn = connect_raw(harness, raw_peer,
                       reply=command(b"READY", b"\x0bsocket-type\x00\x00\x00\x06ROUTER"))
    conn.sendall(frame(b"ok"))
    assert harness.recv() == b"ok"


# --- the library's own constraints ------------------------------------------------------------


def test_wire_layer_uses_only_old_libc_symbols(wire_build):
    """The objects compile with the interceptor's flags and need nothing newer than glibc 2.17
    (and nothing besides libc)."""
    compiler, build = wire_build["compiler"], wire_build["dir"]
    library = build / "libwire.so"
    # _FILE_OFFSET_BITS=64 is a common build flag that binds some calls to newer symbols.
    result = subprocess.run([compiler, *STRICT_FLAGS, "-O2", "-D_FILE_OFFSET_BITS=64", "-shared",
                             "-o", str(library), *map(str, SOURCES)], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("no objdump to read symbol versions")
    table = subprocess.run([objdump, "-T", str(library)], capture_output=True, text=True,
                           check=True).stdout
    versions = set(re.findall(r"\*UND\*\s+\S+\s+\(([^)]+)\)", table))
    assert versions, table
    for version in versions:
        assert version.startswith("GLIBC_"), f"dependency outside glibc: {version}"
        major, minor = (int(part) for part in version[len("GLIBC_"):].split(".")[:2])
        assert (major, minor) <= (2, 17), f"needs {version}:\n{table}"
    dynamic = subprocess.run([objdump, "-p", str(library)], capture_output=True, text=True,
                             check=True).stdout
    assert set(re.findall(r"NEEDED\s+(\S+)", dynamic)) <= {"libc.so.6"}
    exported = {line.split()[-1] for line in table.splitlines()
                if " g " in line and ".text" in line}
    assert not exported, f"-fvisibility=hidden must keep the wire layer private: {exported}"


# --- measurement ------------------------------------------------------------------------------


def test_round_trip_latency(wire_build, sockdir, zctx):
    """Round trips C harness -> pyzmq ROUTER echo -> C harness; printed as JSON, not asserted."""
    path = os.path.join(sockdir, "echo.sock")
    router = bind_router(zctx, path)
    stop = threading.Event()

    def echo():
        while not stop.is_set():
            if router.poll(50):
                router.send_multipart(router.recv_multipart())

    echoer = threading.Thread(target=echo)
    echoer.start()
    try:
        result = subprocess.run([str(wire_build["plain"]), "bench", path, "1000"],
                                capture_output=True, text=True, timeout=120)
    finally:
        stop.set()
        echoer.join()
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["messages"] == 1000
    print(json.dumps({"benchmark": "wire_round_trip_c_to_pyzmq_router", **report}))
