"""nvshare_py.client when the scheduler forgets it while the connection stays up (it answers
`not-registered`, docs/protocol.md): the grant is void, the program is told (on_revoke, reason
`lost`), nothing is released, and the client registers again. A ROUTER socket plays the
scheduler."""

from __future__ import annotations

import threading

from nvshare_py.testing.scheduler import PATIENCE
from nvshare_py import protocol
from test_client_residency import GPU, connected  # noqa: F401  (the fixture)


def test_a_lost_registration_voids_the_grant_and_registers_again(connected):  # noqa: F811
    scheduler, client = connected
    revoked = threading.Event()
    told = []
    client.on_revoke = lambda device, grant, reason: (told.append((device, grant.id, reason)), revoked.set())
    acquiring = threading.Thread(target=client.acquire, args=(GPU,))
    acquiring.start()
    scheduler.expect(protocol.Acquire)
    scheduler.send(protocol.Grant(device=GPU, grant=7, mode="on", exclusive=True, quantum_ms=1000))
    acquiring.join(PATIENCE)
    scheduler.send(protocol.Error(code="not-registered", detail="", type="HEARTBEAT"))
    hello = scheduler.expect(protocol.Hello)
    assert hello.held == ()  # the grant may be someone else's by now: not claimed
    assert revoked.wait(PATIENCE), "on_revoke was not called"
    assert told == [(GPU, 7, "lost")]
    assert client.grant(GPU) is None
    assert client.release(GPU) is False
