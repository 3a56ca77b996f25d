"""PyTorch's expandable segments without PyTorch (issue 31), on :mod:`nvshare_py.driver`: a
program that allocates device memory the way PyTorch's caching allocator does with
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (c10/cuda/CUDACachingAllocator.cpp,
``ExpandableSegment``), for tests on the simulated driver and for benchmarks on a real GPU.

One large address range is reserved once. A tensor's memory is a run of physical handles of one
size (PyTorch: 20 MiB for large blocks; the granularity, 2 MiB, here by default) created one by
one and mapped side by side, made accessible with one ``cuMemSetAccess`` over the whole run; a
kernel or copy of a tensor spans several handles. Freeing unmaps and releases each handle of a
run, leaving a hole that a later run fills again. Every handle holds its own value, so a handle
mapped in the wrong place, swapped in with another's bytes or not at all shows in the check.

    python -m nvshare_py.testing.segments --handles 20 --rounds 6 [--step] [--tag 1]

prints ``ready handles=<n> t=<monotonic>``, then per round ``round <r> intact=<0|1> handles=<n>
bad=<indices> t=...`` and finally ``done``. Each round: wait for a line on stdin (``--step``) or
sleep ``--pause`` seconds between ``pause`` and ``resume`` lines (the program is idle meanwhile:
under nvshare another program takes the GPU and this one's memory is swapped out); grow by a run of 2-4 handles (created, mapped and
given access while the program does not hold the GPU: the calls are not gated) and fill it (a
kernel per handle: this waits for the GPU); check every handle, reading each run of handles with
one copy; every other round free the oldest run grown.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from nvshare_py.driver import Driver


class Segment:
    """One reserved address range of `slots` handles of `handle_bytes` each."""

    def __init__(self, cuda: Driver, slots: int, handle_bytes: int):
        self.cuda, self.handle_bytes = cuda, handle_bytes
        self.ptr = cuda.vmm_reserve(slots * handle_bytes)
        self.handles: list[int | None] = [None] * slots
        self.values: list[int] = [0] * slots

    def address(self, slot: int) -> int:
        return self.ptr + slot * self.handle_bytes

    def free_run(self, count: int) -> int:
        """The first slot of the first `count` free slots side by side."""
        run = 0
        for slot, handle in enumerate(self.handles):
            run = run + 1 if handle is None else 0
            if run == count:
                return slot - count + 1
        raise MemoryError(f"no {count} free slots side by side in the segment")

    def map(self, first: int, count: int) -> None:
        """Creates `count` handles, maps them side by side from `first`, and gives the device
        access to all of them in one call (PyTorch's ExpandableSegment::map)."""
        for slot in range(first, first + count):
            handle = self.handles[slot] = self.cuda.vmm_create(self.handle_bytes, shareable=True)
            self.cuda.vmm_map(self.address(slot), self.handle_bytes, handle)
        self.cuda.vmm_set_access(self.address(first), count * self.handle_bytes)

    def fill(self, first: int, count: int, values: list[int]) -> None:
        for slot, value in zip(range(first, first + count), values):
            self.cuda.fill(self.address(slot), value, self.handle_bytes // 4)
            self.values[slot] = value

    def unmap(self, first: int, count: int) -> None:
        """Unmaps and releases each handle of the run (PyTorch's ExpandableSegment::unmapHandles)."""
        self.cuda.synchronize()
        for slot in range(first, first + count):
            handle, self.handles[slot] = self.handles[slot], None
            assert handle is not None, f"slot {slot} is not mapped"
            self.cuda.vmm_unmap(self.address(slot), self.handle_bytes)
            self.cuda.vmm_release(handle)

    def runs(self) -> list[tuple[int, int]]:
        """The runs of mapped slots side by side: (first, count)."""
        found: list[tuple[int, int]] = []
        for slot, handle in enumerate(self.handles):
            if handle is None:
                continue
            if found and found[-1][0] + found[-1][1] == slot:
                found[-1] = (found[-1][0], found[-1][1] + 1)
            else:
                found.append((slot, 1))
        return found

    def bad_slots(self) -> list[int]:
        """The mapped slots whose bytes are not their value, each run read with one copy."""
        bad = []
        for first, count in self.runs():
            data = self.cuda.memcpy_dtoh(self.address(first), count * self.handle_bytes)
            for k in range(count):
                word = (self.values[first + k] & 0xFFFFFFFF).to_bytes(4, "little")
                if data[k * self.handle_bytes:(k + 1) * self.handle_bytes] != word * (self.handle_bytes // 4):
                    bad.append(first + k)
        return bad

    def mapped(self) -> int:
        return sum(handle is not None for handle in self.handles)

    def close(self) -> None:
        for first, count in self.runs():
            self.unmap(first, count)
        self.cuda.vmm_address_free(self.ptr, len(self.handles) * self.handle_bytes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--handles", type=int, default=20, help="handles mapped before the first round (3 runs)")
    parser.add_argument("--handle-bytes", type=int, default=0, help="bytes per handle (default: the granularity)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--step", action="store_true", help="wait for a line on stdin before each round")
    parser.add_argument("--pause", type=float, default=1.0, help="seconds idle before each round (without --step)")
    parser.add_argument("--tag", type=int, default=os.getpid() & 0xFF, help="distinguishes this program's values")
    parser.add_argument("--device", type=int, default=0)
    args = parser.parse_args(argv)

    def say(text: str) -> None:
        print(f"{text} t={time.monotonic():.6f}", flush=True)

    cuda = Driver()
    cuda.context(args.device)
    handle_bytes = args.handle_bytes or cuda.vmm_granularity()
    segment = Segment(cuda, args.handles + 4 * args.rounds + 8, handle_bytes)
    serial = 0

    def new_values(count: int) -> list[int]:
        nonlocal serial
        serial += count
        return [(0x5E000000 | args.tag << 16 | (serial - count + k)) for k in range(count)]

    third = args.handles // 3
    for first, count in ((0, third), (third, third), (2 * third, args.handles - 2 * third)):
        segment.map(first, count)
        segment.fill(first, count, new_values(count))
    cuda.synchronize()
    say(f"ready handles={segment.mapped()}")
    grown: list[tuple[int, int]] = []
    intact = True
    for round_ in range(args.rounds):
        if args.step:
            sys.stdin.readline()
        else:
            say("pause")
            time.sleep(args.pause)
            say("resume")
        count = 2 + round_ % 3
        first = segment.free_run(count)
        segment.map(first, count)
        grown.append((first, count))
        segment.fill(first, count, new_values(count))
        bad = segment.bad_slots()
        intact &= not bad
        if round_ % 2 == 1:
            segment.unmap(*grown.pop(0))
        say(f"round {round_} intact={int(not bad)} handles={segment.mapped()} bad={','.join(map(str, bad[:8])) or '-'}")
    segment.close()
    cuda.close()
    say("done")
    return 0 if intact else 1


if __name__ == "__main__":
    sys.exit(main())
