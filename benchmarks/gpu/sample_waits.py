"""Where each tenant of bench_tenants.py waits (issue 29), sampled from /proc every 5 ms.

    python3 benchmarks/gpu/sample_waits.py OUTFILE SECONDS &

Run beside bench_tenants.py (benchmarks/gpu/run_issue29.sh does with WAITS=1). For every tenant
process (`bench_tenants.py --tenant ...`) it writes one line per change of its main thread's
state and wait channel, with the wall clock (the clock of the benchmark's `sent` and of the
interceptor's debug lines): `<time> <pid> <state> <wchan>`. When the main thread sleeps or is
blocked anywhere but in its idle read of the next command, the line also holds its kernel stack
(readable as root) and the threads of the process that are running or blocked (`OTHERS
tid:state:wchan:name`, with the top of their kernel stacks while the main thread is blocked).
A request that waits before its first GPU call then shows on what: the
process's memory map lock (`__do_sys_brk`, `vm_mmap_pgoff` beside the pool's page making in
`faultin_page_range`), or the driver's locks (`os_acquire_rwlock_*` under `rmapiLockAcquire`).
No CUDA, no nvshare: /proc only."""
import os
import sys
import time

IDLE_WAITS = ("pipe_read", "anon_pipe_read", "do_select", "do_sys_poll", "ep_poll")


def read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def state_of(stat: str) -> str:
    return stat[stat.rfind(")") + 2:].split(" ", 1)[0]


def tenants() -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and "--tenant" in read(f"/proc/{name}/cmdline").split("\0"):
            found.append(int(name))
    return found


def others(pid: int, stacks: bool) -> str:
    """The process's other threads that run or are blocked: tid:state:wchan:name, and with
    `stacks` (the main thread is blocked) the top of each one's kernel stack in brackets, which
    says what holds the lock the main thread waits for."""
    busy = []
    for tid in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else ():
        stat = read(f"/proc/{pid}/task/{tid}/stat") if tid != str(pid) else ""
        if stat and state_of(stat) in ("R", "D"):
            name = stat[stat.find("(") + 1:stat.rfind(")")].replace(" ", "_")
            entry = f"{tid}:{state_of(stat)}:{read(f'/proc/{pid}/task/{tid}/wchan')}:{name}"
            if stacks:
                frames = read(f"/proc/{pid}/task/{tid}/stack").split("\n")[:4]
                entry += "[" + ",".join(frame.split()[-1] for frame in frames if frame.strip()) + "]"
            busy.append(entry)
    return " ".join(busy)


def main() -> None:
    end = time.time() + float(sys.argv[2])
    last: dict[int, tuple[str, str]] = {}
    pids: list[int] = []
    looked = 0.0
    with open(sys.argv[1], "w", buffering=1) as out:
        while time.time() < end:
            now = time.time()
            if now - looked > 0.5:  # tenants come and go with the benchmark's sessions
                looked, pids = now, tenants()
            for pid in pids:
                stat = read(f"/proc/{pid}/task/{pid}/stat")
                if not stat:
                    continue
                state, wchan = state_of(stat), read(f"/proc/{pid}/task/{pid}/wchan")
                if last.get(pid) == (state, wchan):
                    continue
                last[pid] = (state, wchan)
                line = f"{now:.4f} {pid} {state} {wchan}"
                if state == "D" or (state == "S" and wchan not in IDLE_WAITS):
                    stack = read(f"/proc/{pid}/task/{pid}/stack").strip().replace("\n", " | ")
                    line += (f" STACK {stack[:600]}" if stack else "") + f" OTHERS {others(pid, state == 'D')}"
                out.write(line + "\n")
            time.sleep(0.005)


if __name__ == "__main__":
    main()
