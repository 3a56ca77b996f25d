"""nvshare_py.client and a newer scheduler (docs/protocol.md, "Unknown words, unknown types"):
a word it does not know does not stop it from acting on the message (a REVOKE voids the grant,
a DROP is answered by a release, a GRANT is a grant), and it says once what it could not read;
a message type it does not know is ignored. A ROUTER socket plays the scheduler."""

from __future__ import annotations

import logging
import threading

from nvshare_py import protocol
from nvshare_py.testing.scheduler import PATIENCE
from test_client_residency import GPU, FakeScheduler, connected  # noqa: F401  (the fixture)


def send_raw(scheduler: FakeScheduler, text: str) -> None:
    scheduler.router.send_multipart([scheduler.peer, text.encode()])


def granted(scheduler: FakeScheduler, client, mode: str = "on", exclusive: int = 1):
    result = {}
    acquiring = threading.Thread(target=lambda: result.update(grant=client.acquire(GPU)))
    acquiring.start()
    scheduler.expect(protocol.Acquire)
    send_raw(scheduler, f"NVSHARE/1 GRANT\ndevice={GPU}\ngrant=7\nmode={mode}\nexclusive={exclusive}\nquantum_ms=1000")
    acquiring.join(PATIENCE)
    assert not acquiring.is_alive(), f"acquire() still waits after GRANT mode={mode}"
    return result["grant"]


def test_a_grant_is_a_grant_whatever_its_mode(connected, caplog):  # noqa: F811
    scheduler, client = connected
    with caplog.at_level(logging.WARNING, logger="nvshare"):
        grant = granted(scheduler, client, mode="fair", exclusive=0)
    assert (grant.id, grant.mode, grant.exclusive) == (7, "fair", True)  # an unknown mode counts as mode on
    assert [r for r in caplog.records if "GRANT mode=fair" in r.getMessage()]


def test_a_revoke_voids_the_grant_whatever_its_reason(connected):  # noqa: F811
    scheduler, client = connected
    granted(scheduler, client)
    send_raw(scheduler, f"NVSHARE/1 REVOKE\ndevice={GPU}\ngrant=7\nreason=preempted")
    release = scheduler.expect(protocol.Release)
    assert (release.grant, release.reason) == (7, "revoke")


def test_a_drop_is_answered_whatever_its_reason(connected):  # noqa: F811
    scheduler, client = connected
    granted(scheduler, client)
    send_raw(scheduler, f"NVSHARE/1 DROP\ndevice={GPU}\ngrant=7\ngrace_ms=5000\nreason=rebalance")
    release = scheduler.expect(protocol.Release)
    assert (release.grant, release.reason) == (7, "drop")


def test_what_it_cannot_read_is_said_once_and_an_unknown_type_is_ignored(connected, caplog):  # noqa: F811
    scheduler, client = connected
    with caplog.at_level(logging.WARNING, logger="nvshare"):
        for _ in range(3):
            send_raw(scheduler, f"NVSHARE/1 TELEPORT\ndevice={GPU}")
            send_raw(scheduler, f"NVSHARE/1 MODE\ndevice={GPU}\nmode=fair\nquantum_ms=5")
        granted(scheduler, client)  # the client read on past all of them
    said = [r.getMessage() for r in caplog.records]
    assert len([m for m in said if "TELEPORT" in m]) == 1
    assert len([m for m in said if "MODE mode=fair" in m]) == 1
