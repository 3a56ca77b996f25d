"""How the real CUDA driver treats VMM handles and ranges (issue 31), for the simulated driver's
model (tests/simcuda/README.md) and nvshare's handle translation (interceptor/vmm.c).

    python benchmarks/gpu/probe_vmm_handles.py       # on a machine with a GPU; no nvshare

Prints, with plain ctypes on libcuda.so.1 (no nvshare, no framework): the values cuMemCreate
hands out and whether released ones come back; what cuMemSetAccess and cuMemUnmap answer for a
range of two mappings side by side and for a range with an unmapped gap; mapping over a mapping;
cuMemRetainAllocationHandle of an unmapped address; a handle asking for fabric export; and what
a memset of mapped memory without access, and of unmapped reserved memory, answers. Never passes
a released handle's value to the driver: on driver 580 cuMemMap of one crashed the process
(the value is the address of the driver's record).
"""

from __future__ import annotations

import ctypes as C

U = C.c_uint64


class Prop(C.Structure):  # CUmemAllocationProp
    _fields_ = [("type", C.c_int), ("handle_types", C.c_int), ("location_type", C.c_int), ("id", C.c_int),
                ("win32", C.c_void_p), ("compression", C.c_ubyte), ("rdma", C.c_ubyte), ("usage", C.c_ushort),
                ("reserved", C.c_ubyte * 4)]


class Access(C.Structure):  # CUmemAccessDesc
    _fields_ = [("location_type", C.c_int), ("id", C.c_int), ("flags", C.c_int)]


def main() -> None:
    cuda = C.CDLL("libcuda.so.1")
    cuda.cuInit(0)
    ctx = C.c_void_p()
    cuda.cuDevicePrimaryCtxRetain(C.byref(ctx), 0)
    cuda.cuCtxSetCurrent(ctx)
    prop = Prop(type=1, handle_types=1, location_type=1, id=0)  # pinned, POSIX fd, device 0
    granularity = C.c_size_t()
    cuda.cuMemGetAllocationGranularity(C.byref(granularity), C.byref(prop), 0)
    g = granularity.value

    def create(p: Prop = prop) -> tuple[int, int]:
        handle = U()
        return cuda.cuMemCreate(C.byref(handle), C.c_size_t(g), C.byref(p), U(0)), handle.value

    handles = [create()[1] for _ in range(6)]
    print("G", g, "created", [hex(h) for h in handles])
    print("rel", cuda.cuMemRelease(U(handles[2])), cuda.cuMemRelease(U(handles[4])))
    print("after releasing 2,4 new", [hex(create()[1]) for _ in range(3)])
    print("rel twice", cuda.cuMemRelease(U(handles[2])))
    va = U()
    print("reserve", cuda.cuMemAddressReserve(C.byref(va), C.c_size_t(8 * g), C.c_size_t(0), U(0), U(0)))
    v = va.value

    def map_at(slot: int, handle: int) -> int:
        return cuda.cuMemMap(U(v + slot * g), C.c_size_t(g), C.c_size_t(0), U(handle), U(0))

    print("map", map_at(0, handles[0]), map_at(1, handles[1]), map_at(3, handles[3]), "map over",
          map_at(0, handles[5]))
    access = Access(1, 0, 3)  # device 0, read-write

    def set_access(slot: int, count: int) -> int:
        return cuda.cuMemSetAccess(U(v + slot * g), C.c_size_t(count * g), C.byref(access), C.c_size_t(1))

    print("setaccess 2 maps", set_access(0, 2), "with hole", set_access(0, 4), "part", set_access(1, 1))
    retained = U()
    print("retain unmapped", cuda.cuMemRetainAllocationHandle(C.byref(retained), C.c_void_p(v + 2 * g)),
          "retain mapped", cuda.cuMemRetainAllocationHandle(C.byref(retained), C.c_void_p(v + g + 5)),
          hex(retained.value))
    print("unmap hole", cuda.cuMemUnmap(U(v + 2 * g), C.c_size_t(2 * g)),
          "unmap 2", cuda.cuMemUnmap(U(v), C.c_size_t(2 * g)))
    print("fabric", create(Prop(type=1, handle_types=8, location_type=1, id=0))[0])
    pool = [create()[1] for _ in range(20)]
    released = pool[5:15]
    for handle in released:
        cuda.cuMemRelease(U(handle))
    again = [create()[1] for _ in range(10)]
    print("released order", [hex(h) for h in released])
    print("new order", [hex(h) for h in again])
    print("noaccess child")
    map_at(6, again[0])
    print("memset noaccess", cuda.cuMemsetD32_v2(U(v + 6 * g), C.c_uint(7), C.c_size_t(16)),
          "sync", cuda.cuCtxSynchronize())
    print("memset unmapped", cuda.cuMemsetD32_v2(U(v + 7 * g), C.c_uint(7), C.c_size_t(16)),
          "sync", cuda.cuCtxSynchronize())


if __name__ == "__main__":
    main()
