"""A client process for tests: uses nvshare_py.client and obeys one command per line of stdin,
answering on stdout (started by nvshare_py.testing.scheduler's SchedulerProcess.agent()).

    python -m nvshare_py.testing.agent     # prints "ready <client-id>" once registered

    announce GPU-x 1000 name   DEVICE; prints "announced GPU-x"
    memory GPU-x 400           MEMORY; prints "reported GPU-x"
    acquire GPU-x [timeout]    in a thread; prints "granted GPU-x <grant> <mode> <exclusive 0|1>"
                               when granted, or "timeout GPU-x"
    release GPU-x              prints "released GPU-x" (or "not-held GPU-x")
    grant GPU-x                prints "grant GPU-x <grant id|none>"
    on-drop ignore             ignore DROP (default "release": give the lock back)
    fork                       forks a child that keeps the connection open; prints
                               "forked <pid>"; the child reports "child refused ..."
    close                      BYE; prints "closed"
    exit                       ends the program

Unprompted lines: "drop <dev> <grant>" (then "released <dev>" unless ignored),
"revoked <dev> <grant> <reason>", "mode <dev> <mode> <quantum>", "error <text>".
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

from nvshare_py.client import Client


def main() -> None:
    output = threading.Lock()

    def say(*words: Any) -> None:
        with output:
            sys.stdout.write(" ".join(str(w) for w in words) + "\n")
            sys.stdout.flush()

    drop_policy = ["release"]
    client: Client

    def on_drop(device, grant) -> None:
        say("drop", device, grant.id)
        if drop_policy[0] == "release":
            client.release(device, reason="drop")
            say("released", device)

    def on_revoke(device, grant, reason) -> None:
        say("revoked", device, grant.id, reason)

    def on_mode(device, mode, quantum) -> None:
        say("mode", device, mode, quantum)

    client = Client(on_drop=on_drop, on_revoke=on_revoke, on_mode=on_mode)
    client.connect()
    say("ready", client.client_id)

    def acquire(device: str, timeout: float | None) -> None:
        try:
            grant = client.acquire(device, timeout)
        except TimeoutError:
            say("timeout", device)
        except Exception as exc:
            say("error", repr(exc))
        else:
            say("granted", device, grant.id, grant.mode, int(grant.exclusive))

    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        command, args = words[0], words[1:]
        try:
            if command == "acquire":
                timeout = float(args[1]) if len(args) > 1 else None
                threading.Thread(target=acquire, args=(args[0], timeout), daemon=True).start()
            elif command == "release":
                say("released" if client.release(args[0]) else "not-held", args[0])
            elif command == "announce":
                client.announce(args[0], int(args[1]), " ".join(args[2:]))
                say("announced", args[0])
            elif command == "memory":
                client.report_memory(args[0], int(args[1]))
                say("reported", args[0])
            elif command == "on-drop":
                drop_policy[0] = args[0]
                say("on-drop", args[0])
            elif command == "grant":
                grant = client.grant(args[0])
                say("grant", args[0], grant.id if grant else "none")
            elif command == "fork":
                pid = os.fork()
                if pid == 0:
                    # Only this thread lives on in the child: a lock another thread held at the
                    # fork (say()'s included) stays held for ever, so the child writes its one
                    # line straight to the descriptor and never returns to the command loop.
                    try:
                        client.acquire("GPU-fork-child", timeout=1)
                    except RuntimeError as exc:
                        report = f"child refused {type(exc).__name__}"
                    except BaseException as exc:
                        report = f"child failed {exc!r}"
                    else:
                        report = "child used the parent's client"
                    os.write(sys.stdout.fileno(), (report + "\n").encode())
                    time.sleep(3600)
                    os._exit(0)
                say("forked", pid)
            elif command == "close":
                client.close()
                say("closed")
            elif command == "exit":
                break
            else:
                say("error unknown command", command)
        except Exception as exc:
            say("error", repr(exc))


if __name__ == "__main__":
    main()
