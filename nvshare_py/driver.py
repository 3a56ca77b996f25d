"""A small ctypes binding of the CUDA driver API, resolved the way the CUDA runtime resolves it.

By default (``via="gpa"``) only ``cuGetProcAddress_v2`` is looked up with ``dlsym``. It is then
asked for ``cuGetProcAddress`` itself (CUDA 12.0 ABI), and every other function is resolved by
base name through the pointer that came back, with the CUDA version of the ABI this module calls
(the ``PFN_<name>_v<version>`` numbers of cudaTypedefs.h). Under the nvshare interceptor every
call therefore takes the interceptor's main path, as PyTorch, JAX and CuPy calls do. The other
entry paths into a driver (see :data:`VIAS`) can be chosen instead, so that tests reach the
interceptor through each of them.

It works on the real driver and on the simulated one (``tests/simcuda``): the two kernels it
launches, ``nvshare_sleep`` and ``nvshare_fill``, come from a small PTX module embedded here
(:data:`KERNELS_PTX`). The real driver JIT-compiles it; the simulated driver accepts any image
and knows both kernels by name.

Example::

    with Driver() as cuda:
        cuda.context(0)                      # on every thread that calls the driver
        ptr = cuda.alloc(1 << 20)
        cuda.fill(ptr, 7, (1 << 20) // 4)
        cuda.synchronize()
        assert cuda.memcpy_dtoh(ptr, 4) == (7).to_bytes(4, "little")
        cuda.free(ptr)

(Some 670 lines: the PTX of its kernels, the table of C signatures, and `Driver`'s methods, each
a few lines around one driver call. One binding: every method goes through the same resolver
and error translation.)
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from ctypes import POINTER, byref, c_char, c_char_p, c_int, c_size_t, c_uint, c_uint64, c_void_p
from dataclasses import dataclass
from typing import Callable

from .vocabulary import gpu_uuid

__all__ = ["COPY_PTX", "Device", "Driver", "DriverError", "DriverNotFound", "FAMILIES", "KERNELS_PTX", "VIAS"]

_PTX_HEADER = """\
.version 6.0
.target sm_60
.address_size 64
"""


def _grid_stride(count: str, body: str) -> str:
    """A grid-stride loop over a 1-D grid, for the kernels below: %index runs from the thread's
    global index to the register `count` by the grid's size, `body` done for each (the kernel
    declares the registers: %past, %block, %threads, %thread, %blocks, %index, %stride, %lane)."""
    return f"""\
    mov.u32 %block, %ctaid.x;
    mov.u32 %threads, %ntid.x;
    mov.u32 %thread, %tid.x;
    mov.u32 %blocks, %nctaid.x;
    mul.wide.u32 %index, %block, %threads;
    cvt.u64.u32 %lane, %thread;
    add.u64 %index, %index, %lane;
    mul.wide.u32 %stride, %blocks, %threads;
LOOP:
    setp.ge.u64 %past, %index, {count};
    @%past bra DONE;
{body}\
    add.u64 %index, %index, %stride;
    bra LOOP;
DONE:
    ret;
}}
"""


# nvshare_sleep(uint64 duration_us): spins on %globaltimer (nanoseconds) for the duration.
# nvshare_fill(uint64 dst, uint32 value, uint64 count): a grid-stride loop writing `count` words.
KERNELS_PTX = _PTX_HEADER + """
.visible .entry nvshare_sleep(.param .u64 duration_us)
{
    .reg .pred %done;
    .reg .b64 %duration, %now, %deadline;

    ld.param.u64 %duration, [duration_us];
    mul.lo.u64 %duration, %duration, 1000;
    mov.u64 %now, %globaltimer;
    add.u64 %deadline, %now, %duration;
WAIT:
    mov.u64 %now, %globaltimer;
    setp.lt.u64 %done, %now, %deadline;
    @%done bra WAIT;
    ret;
}

.visible .entry nvshare_fill(.param .u64 dst, .param .u32 value, .param .u64 count)
{
    .reg .pred %past;
    .reg .b32 %word, %block, %threads, %thread, %blocks;
    .reg .b64 %base, %words, %index, %stride, %lane, %offset, %address;

    ld.param.u64 %base, [dst];
    ld.param.u32 %word, [value];
    ld.param.u64 %words, [count];
    cvta.to.global.u64 %base, %base;
""" + _grid_stride("%words", """\
    shl.b64 %offset, %index, 2;
    add.u64 %address, %base, %offset;
    st.global.u32 [%address], %word;
""")

# nvshare_copy(uint64 dst, uint64 src, uint64 count): a grid-stride loop copying `count` units of
# 16 bytes (pinned host memory is in the device's address space). Not one of Driver's kernels
# (the simulated driver runs only those above): benchmarks/gpu/bench_swap_paths.py loads it on a
# real GPU to copy on the SMs instead of the copy engines.
COPY_PTX = _PTX_HEADER + """
.visible .entry nvshare_copy(.param .u64 dst, .param .u64 src, .param .u64 count)
{
    .reg .pred %past;
    .reg .b32 %block, %threads, %thread, %blocks;
    .reg .b64 %d, %s, %n, %index, %stride, %lane, %offset, %from, %to, %x, %y;

    ld.param.u64 %d, [dst];
    ld.param.u64 %s, [src];
    ld.param.u64 %n, [count];
    cvta.to.global.u64 %d, %d;
    cvta.to.global.u64 %s, %s;
""" + _grid_stride("%n", """\
    shl.b64 %offset, %index, 4;
    add.u64 %from, %s, %offset;
    add.u64 %to, %d, %offset;
    ld.global.v2.u64 {%x, %y}, [%from];
    st.global.v2.u64 [%to], {%x, %y};
""")

FAMILIES = ("plain", "pitch", "async", "pool", "managed", "host", "vmm")
"""Allocation families of :meth:`Driver.alloc`."""

VIAS = ("gpa", "gpa-ptds", "dlsym", "export")
"""Entry paths :class:`Driver` can resolve the driver's functions through: ``gpa``
(cuGetProcAddress, as the CUDA runtime uses it), ``gpa-ptds`` (the same with
CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, as code built with ``--default-stream
per-thread``), ``dlsym`` (the ABI symbol looked up in the library's handle, as PyTorch does for
some functions) and ``export`` (the symbol the process's global scope binds, as in a program
linked against libcuda)."""

_CUdeviceptr = c_uint64
_CU_POINTER_ATTRIBUTE_IS_MANAGED = 8
_CU_MEM_ATTACH_GLOBAL = 1
_CU_GET_PROC_ADDRESS_DEFAULT = 0
_CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM = 2
_IPC_HANDLE_BYTES = 64  # CU_IPC_HANDLE_SIZE
_CU_MEM_ALLOCATION_TYPE_PINNED = 1
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
_CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1
_FILL_THREADS = 256
_FILL_MAX_BLOCKS = 4096
_KERNEL_NAMES = ("nvshare_sleep", "nvshare_fill")  # the entries of KERNELS_PTX


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", c_int), ("id", c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _MemAllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", c_int),
        ("requestedHandleTypes", c_int),
        ("location", _MemLocation),
        ("win32HandleMetaData", c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _MemAccessDesc(ctypes.Structure):
    _fields_ = [("location", _MemLocation), ("flags", c_int)]


# name -> (base name, CUDA version of this ABI, version of its per-thread twin or None, argtypes)
_FUNCTIONS: dict[str, tuple[str, int, int | None, list]] = {
    "cuInit": ("cuInit", 2000, None, [c_uint]),
    "cuDriverGetVersion": ("cuDriverGetVersion", 2020, None, [POINTER(c_int)]),
    "cuGetErrorName": ("cuGetErrorName", 6000, None, [c_int, POINTER(c_char_p)]),
    "cuGetErrorString": ("cuGetErrorString", 6000, None, [c_int, POINTER(c_char_p)]),
    "cuDeviceGetCount": ("cuDeviceGetCount", 2000, None, [POINTER(c_int)]),
    "cuDeviceGetAttribute": ("cuDeviceGetAttribute", 2000, None, [POINTER(c_int), c_int, c_int]),
    "cuDeviceGet": ("cuDeviceGet", 2000, None, [POINTER(c_int), c_int]),
    "cuDeviceGetName": ("cuDeviceGetName", 2000, None, [c_char_p, c_int, c_int]),
    "cuDeviceGetUuid_v2": ("cuDeviceGetUuid", 11040, None, [POINTER(c_char * 16), c_int]),
    "cuDeviceTotalMem_v2": ("cuDeviceTotalMem", 3020, None, [POINTER(c_size_t), c_int]),
    "cuDevicePrimaryCtxRetain": ("cuDevicePrimaryCtxRetain", 7000, None, [POINTER(c_void_p), c_int]),
    "cuDevicePrimaryCtxRelease_v2": ("cuDevicePrimaryCtxRelease", 11000, None, [c_int]),
    "cuCtxSetCurrent": ("cuCtxSetCurrent", 4000, None, [c_void_p]),
    "cuCtxGetCurrent": ("cuCtxGetCurrent", 4000, None, [POINTER(c_void_p)]),
    "cuCtxGetDevice": ("cuCtxGetDevice", 2000, None, [POINTER(c_int)]),
    "cuCtxSynchronize": ("cuCtxSynchronize", 2000, None, []),
    "cuModuleLoadData": ("cuModuleLoadData", 2000, None, [POINTER(c_void_p), c_char_p]),
    "cuModuleGetFunction": ("cuModuleGetFunction", 2000, None, [POINTER(c_void_p), c_void_p, c_char_p]),
    "cuLaunchKernel": (
        "cuLaunchKernel", 4000, 7000,
        [c_void_p, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_void_p, POINTER(c_void_p), POINTER(c_void_p)],
    ),
    "cuStreamCreate": ("cuStreamCreate", 2000, None, [POINTER(c_void_p), c_uint]),
    "cuStreamDestroy_v2": ("cuStreamDestroy", 4000, None, [c_void_p]),
    "cuStreamSynchronize": ("cuStreamSynchronize", 2000, 7000, [c_void_p]),
    "cuMemGetInfo_v2": ("cuMemGetInfo", 3020, None, [POINTER(c_size_t), POINTER(c_size_t)]),
    "cuMemAlloc_v2": ("cuMemAlloc", 3020, None, [POINTER(_CUdeviceptr), c_size_t]),
    "cuMemAllocPitch_v2": (
        "cuMemAllocPitch", 3020, None, [POINTER(_CUdeviceptr), POINTER(c_size_t), c_size_t, c_size_t, c_uint],
    ),
    "cuMemAllocManaged": ("cuMemAllocManaged", 6000, None, [POINTER(_CUdeviceptr), c_size_t, c_uint]),
    "cuMemAllocHost_v2": ("cuMemAllocHost", 3020, None, [POINTER(c_void_p), c_size_t]),
    "cuMemAllocAsync": ("cuMemAllocAsync", 11020, 11020, [POINTER(_CUdeviceptr), c_size_t, c_void_p]),
    "cuMemAllocFromPoolAsync": (
        "cuMemAllocFromPoolAsync", 11020, 11020, [POINTER(_CUdeviceptr), c_size_t, c_void_p, c_void_p],
    ),
    "cuDeviceGetDefaultMemPool": ("cuDeviceGetDefaultMemPool", 11020, None, [POINTER(c_void_p), c_int]),
    "cuMemFree_v2": ("cuMemFree", 3020, None, [_CUdeviceptr]),
    "cuMemFreeAsync": ("cuMemFreeAsync", 11020, 11020, [_CUdeviceptr, c_void_p]),
    "cuMemFreeHost": ("cuMemFreeHost", 2000, None, [c_void_p]),
    "cuMemGetAllocationGranularity": (
        "cuMemGetAllocationGranularity", 10020, None, [POINTER(c_size_t), POINTER(_MemAllocationProp), c_int],
    ),
    "cuMemCreate": ("cuMemCreate", 10020, None, [POINTER(c_uint64), c_size_t, POINTER(_MemAllocationProp), c_uint64]),
    "cuMemRelease": ("cuMemRelease", 10020, None, [c_uint64]),
    "cuMemAddressReserve": (
        "cuMemAddressReserve", 10020, None, [POINTER(_CUdeviceptr), c_size_t, c_size_t, _CUdeviceptr, c_uint64],
    ),
    "cuMemAddressFree": ("cuMemAddressFree", 10020, None, [_CUdeviceptr, c_size_t]),
    "cuMemMap": ("cuMemMap", 10020, None, [_CUdeviceptr, c_size_t, c_size_t, c_uint64, c_uint64]),
    "cuMemUnmap": ("cuMemUnmap", 10020, None, [_CUdeviceptr, c_size_t]),
    "cuMemSetAccess": ("cuMemSetAccess", 10020, None, [_CUdeviceptr, c_size_t, POINTER(_MemAccessDesc), c_size_t]),
    "cuMemcpyHtoD_v2": ("cuMemcpyHtoD", 3020, 7000, [_CUdeviceptr, c_void_p, c_size_t]),
    "cuMemcpyDtoH_v2": ("cuMemcpyDtoH", 3020, 7000, [c_void_p, _CUdeviceptr, c_size_t]),
    "cuPointerGetAttribute": ("cuPointerGetAttribute", 4000, None, [c_void_p, c_int, _CUdeviceptr]),
    "cuIpcGetMemHandle": ("cuIpcGetMemHandle", 4010, None, [POINTER(c_char * _IPC_HANDLE_BYTES), _CUdeviceptr]),
}

_GetProcAddress = ctypes.CFUNCTYPE(c_int, c_char_p, POINTER(c_void_p), c_int, c_uint64, POINTER(c_int))


def _address(handle: c_void_p) -> int:
    """The address or handle a driver call wrote (ctypes reads NULL as None)."""
    return handle.value or 0


class DriverNotFound(OSError):
    """The CUDA driver library could not be loaded."""


class DriverError(RuntimeError):
    """A driver call failed: ``code`` is the CUresult, ``name`` its name (CUDA_ERROR_...)."""

    def __init__(self, function: str, code: int, name: str, description: str):
        super().__init__(f"{function} failed: {name} ({code}): {description}")
        self.function = function
        self.code = code
        self.name = name


@dataclass(frozen=True)
class Device:
    """One device as the driver enumerates it."""

    index: int
    uuid: str
    name: str
    total_memory: int


@dataclass(frozen=True)
class _Allocation:
    family: str
    size: int
    handle: int = 0  # vmm: the cuMemCreate handle


class Driver:
    """The CUDA driver of this process, loaded from ``library`` and initialised (``cuInit``).

    ``via`` picks the entry path every function is resolved through (one of :data:`VIAS`); with
    ``gpa-ptds`` the stream-ordered functions are their ``_ptsz``/``_ptds`` variants.

    Each thread that calls the driver first makes a context current with :meth:`context`.
    Methods raise :class:`DriverError` when a call fails.
    """

    def __init__(self, library: str = "libcuda.so.1", *, via: str = "gpa"):
        if via not in VIAS:
            raise ValueError(f"unknown entry path {via!r}; one of {', '.join(VIAS)}")
        try:
            # A program linked against libcuda has it in the global scope, where `export` looks.
            self._library = ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL if via == "export" else ctypes.DEFAULT_MODE)
            bootstrap = _GetProcAddress(("cuGetProcAddress_v2", self._library)) if via.startswith("gpa") else None
        except (OSError, AttributeError) as error:
            raise DriverNotFound(
                f"cannot load the CUDA driver {library!r}: {error}. Install the NVIDIA driver, or put the "
                "simulated driver (built by `make -C tests/simcuda`, shipped in nvshare_py/_lib/simcuda) "
                "on LD_LIBRARY_PATH."
            ) from error
        self.library = library
        self.via = via
        self._lock = threading.Lock()
        self._allocations: dict[int, _Allocation] = {}  # guarded by _lock
        self._contexts: dict[int, int] = {}  # device index -> retained primary context; _lock
        self._kernels: dict[int, dict[str, int]] = {}  # context -> kernel name -> function; _lock
        self._pools: dict[int, int] = {}  # device index -> default memory pool; _lock
        self.resolved: dict[str, int] = {}
        """Address each function resolved to, by the name of the ABI this module calls."""

        # Exactly one of the two is set: where each function's address is found.
        self._lookup: Callable[..., int] | None = None
        self._scope: ctypes.CDLL | None = None
        if bootstrap is not None:
            self._lookup = self._get_proc_address(bootstrap)
        else:  # dlsym looks in the library's own handle, export in the process's global scope
            self._scope = self._library if via == "dlsym" else ctypes.CDLL(None)
        self._functions = {}
        for name, (base, version, per_thread_version, argtypes) in _FUNCTIONS.items():
            self.resolved[name] = self._resolve(name, base, version, per_thread_version)
            self._functions[name] = ctypes.CFUNCTYPE(c_int, *argtypes)(self.resolved[name])
        self._call("cuInit", 0)

    def _get_proc_address(self, bootstrap):
        """cuGetProcAddress as the CUDA runtime uses it: looked up through itself."""
        address = c_void_p()
        status = c_int()
        result = bootstrap(b"cuGetProcAddress", byref(address), 12000, _CU_GET_PROC_ADDRESS_DEFAULT, byref(status))
        if result != 0 or not address.value:
            raise DriverNotFound(f"{self.library}: cuGetProcAddress cannot resolve itself (CUresult {result})")
        return _GetProcAddress(address.value)

    def _resolve(self, name: str, base: str, version: int, per_thread_version: int | None) -> int:
        if self._scope is not None:
            try:
                return _address(ctypes.cast(getattr(self._scope, name), c_void_p))
            except AttributeError as error:
                raise DriverNotFound(f"{self.library}: {name} not found through {self.via}: {error}") from error
        flags, wanted = _CU_GET_PROC_ADDRESS_DEFAULT, version
        if self.via == "gpa-ptds" and per_thread_version is not None:
            flags, wanted = _CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, per_thread_version
        assert self._lookup is not None  # no scope: a lookup
        address, status = c_void_p(), c_int()
        result = self._lookup(base.encode(), byref(address), wanted, flags, byref(status))
        if result != 0 or not address.value:
            raise DriverNotFound(
                f"{self.library}: cuGetProcAddress({base!r}, {wanted}) failed (CUresult {result}, status {status.value})"
            )
        return _address(address)

    # ---- plumbing ----

    def _call(self, name: str, *args) -> None:
        result = self._functions[name](*args)
        if result != 0:
            raise self._error(name, result)

    def _error(self, function: str, code: int) -> DriverError:
        text = c_char_p()
        name = f"CUresult {code}"
        if self._functions["cuGetErrorName"](code, byref(text)) == 0 and text.value:
            name = text.value.decode()
        description = ""
        if self._functions["cuGetErrorString"](code, byref(text)) == 0 and text.value:
            description = text.value.decode()
        return DriverError(function, code, name, description)

    def close(self) -> None:
        """Releases the primary contexts this object retained."""
        with self._lock:
            contexts, self._contexts = self._contexts, {}
            self._kernels.clear()
            self._pools.clear()
        for index in contexts:
            self._call("cuDevicePrimaryCtxRelease_v2", index)

    def __enter__(self) -> Driver:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # ---- devices and contexts ----

    @property
    def version(self) -> int:
        """The driver's CUDA version, e.g. 13000 for CUDA 13.0."""
        version = c_int()
        self._call("cuDriverGetVersion", byref(version))
        return version.value

    def devices(self) -> list[Device]:
        count = c_int()
        self._call("cuDeviceGetCount", byref(count))
        found = []
        for index in range(count.value):
            handle = c_int()
            self._call("cuDeviceGet", byref(handle), index)
            name = ctypes.create_string_buffer(256)
            self._call("cuDeviceGetName", name, len(name), handle)
            uuid = (c_char * 16)()
            self._call("cuDeviceGetUuid_v2", byref(uuid), handle)
            total = c_size_t()
            self._call("cuDeviceTotalMem_v2", byref(total), handle)
            found.append(Device(index, gpu_uuid(bytes(uuid)), name.value.decode(), total.value))
        return found

    def device_attribute(self, attribute: int, device: int = 0) -> int:
        """A CUdevice_attribute of the device (cuDeviceGetAttribute)."""
        value = c_int()
        self._call("cuDeviceGetAttribute", byref(value), attribute, device)
        return value.value

    def context(self, device: int = 0) -> int:
        """Makes the device's primary context current on the calling thread; returns its handle.

        The context is retained once per :class:`Driver` (released by :meth:`close`).
        """
        with self._lock:
            ctx = self._contexts.get(device)
            if ctx is None:
                handle = c_void_p()
                self._call("cuDevicePrimaryCtxRetain", byref(handle), device)
                ctx = self._contexts[device] = _address(handle)
        self._call("cuCtxSetCurrent", c_void_p(ctx))
        return ctx

    def _current_context(self) -> int:
        ctx = c_void_p()
        self._call("cuCtxGetCurrent", byref(ctx))
        if not ctx.value:
            raise DriverError("cuCtxGetCurrent", 201, "CUDA_ERROR_INVALID_CONTEXT",
                              "no current context on this thread: call Driver.context() first")
        return ctx.value

    def _current_device(self) -> int:
        device = c_int()
        self._call("cuCtxGetDevice", byref(device))
        return device.value

    # ---- memory ----

    def alloc(self, nbytes: int, family: str = "plain") -> int:
        """Allocates ``nbytes`` on the current device; returns the device address.

        ``family``: plain (cuMemAlloc_v2), pitch (cuMemAllocPitch_v2, one row), async
        (cuMemAllocAsync on the default stream), pool (cuMemAllocFromPoolAsync from the device's
        default pool), managed (cuMemAllocManaged), host (cuMemAllocHost_v2, pinned host memory),
        vmm (cuMemCreate + cuMemAddressReserve + cuMemMap + cuMemSetAccess, rounded up to the
        allocation granularity).
        """
        if family not in FAMILIES:
            raise ValueError(f"unknown allocation family {family!r}; one of {', '.join(FAMILIES)}")
        if nbytes <= 0:
            raise ValueError("nbytes must be positive")
        if family == "pitch":
            return self.alloc_pitch(nbytes, 1)[0]
        handle = 0
        size = nbytes
        if family == "host":
            host = c_void_p()
            self._call("cuMemAllocHost_v2", byref(host), nbytes)
            ptr = _address(host)
        elif family == "vmm":
            ptr, size, handle = self._alloc_vmm(nbytes)
        else:
            dptr = _CUdeviceptr()
            if family == "plain":
                self._call("cuMemAlloc_v2", byref(dptr), nbytes)
            elif family == "async":
                self._call("cuMemAllocAsync", byref(dptr), nbytes, None)
            elif family == "pool":
                self._call("cuMemAllocFromPoolAsync", byref(dptr), nbytes, c_void_p(self._default_pool()), None)
            else:
                self._call("cuMemAllocManaged", byref(dptr), nbytes, _CU_MEM_ATTACH_GLOBAL)
            ptr = dptr.value
        with self._lock:
            self._allocations[ptr] = _Allocation(family, size, handle)
        return ptr

    def alloc_pitch(self, width: int, height: int, element_bytes: int = 4) -> tuple[int, int]:
        """Allocates ``height`` rows of ``width`` bytes on the current device (cuMemAllocPitch_v2,
        ``element_bytes`` 4, 8 or 16); returns the device address and the row pitch the driver
        chose. Freed by :meth:`free`."""
        dptr, pitch = _CUdeviceptr(), c_size_t()
        self._call("cuMemAllocPitch_v2", byref(dptr), byref(pitch), width, height, element_bytes)
        with self._lock:
            self._allocations[dptr.value] = _Allocation("pitch", pitch.value * height)
        return dptr.value, pitch.value

    def _default_pool(self) -> int:
        device = self._current_device()
        with self._lock:
            pool = self._pools.get(device)
        if pool is None:
            handle = c_void_p()
            self._call("cuDeviceGetDefaultMemPool", byref(handle), device)
            pool = _address(handle)
            with self._lock:
                self._pools[device] = pool
        return pool

    def _alloc_vmm(self, nbytes: int) -> tuple[int, int, int]:
        prop = self._vmm_prop()
        granularity = self.vmm_granularity()
        size = -(-nbytes // granularity) * granularity
        handle, ptr = c_uint64(), _CUdeviceptr()
        # A failed step undoes exactly the steps that succeeded before it, newest first.
        with contextlib.ExitStack() as undo:
            self._call("cuMemCreate", byref(handle), size, byref(prop), 0)
            undo.callback(self._functions["cuMemRelease"], handle)
            self._call("cuMemAddressReserve", byref(ptr), size, 0, 0, 0)
            undo.callback(self._functions["cuMemAddressFree"], ptr, size)
            self._call("cuMemMap", ptr, size, 0, handle, 0)
            undo.callback(self._functions["cuMemUnmap"], ptr, size)
            access = _MemAccessDesc(prop.location, _CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            self._call("cuMemSetAccess", ptr, size, byref(access), 1)
            undo.pop_all()
        return ptr.value, size, handle.value

    # ---- virtual memory management, one call at a time (as PyTorch's expandable segments use it) ----

    def _vmm_prop(self, device: int | None = None, shareable: bool = False) -> _MemAllocationProp:
        location = _MemLocation(_CU_MEM_LOCATION_TYPE_DEVICE, self._current_device() if device is None else device)
        return _MemAllocationProp(type=_CU_MEM_ALLOCATION_TYPE_PINNED, location=location,
                                  requestedHandleTypes=_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR if shareable else 0)

    def vmm_granularity(self) -> int:
        """The recommended granularity of cuMemCreate/cuMemMap on the current device."""
        granularity = c_size_t()
        self._call("cuMemGetAllocationGranularity", byref(granularity), byref(self._vmm_prop()),
                   _CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
        return granularity.value

    def vmm_reserve(self, nbytes: int) -> int:
        """Reserves ``nbytes`` of address space (cuMemAddressReserve); returns its start."""
        ptr = _CUdeviceptr()
        self._call("cuMemAddressReserve", byref(ptr), nbytes, 0, 0, 0)
        return ptr.value

    def vmm_address_free(self, ptr: int, nbytes: int) -> None:
        self._call("cuMemAddressFree", ptr, nbytes)

    def vmm_create(self, nbytes: int, shareable: bool = False) -> int:
        """A physical allocation of ``nbytes`` on the current device (cuMemCreate; ``shareable``:
        exportable as a file descriptor, as PyTorch asks); returns its handle."""
        handle = c_uint64()
        self._call("cuMemCreate", byref(handle), nbytes, byref(self._vmm_prop(shareable=shareable)), 0)
        return handle.value

    def vmm_release(self, handle: int) -> None:
        self._call("cuMemRelease", handle)

    def vmm_map(self, ptr: int, nbytes: int, handle: int, offset: int = 0) -> None:
        self._call("cuMemMap", ptr, nbytes, offset, handle, 0)

    def vmm_unmap(self, ptr: int, nbytes: int) -> None:
        self._call("cuMemUnmap", ptr, nbytes)

    def vmm_set_access(self, ptr: int, nbytes: int, devices: list[int] | None = None) -> None:
        """Read-write access to [ptr, ptr + nbytes) for each device (the current one by default),
        in one cuMemSetAccess call with a descriptor per device."""
        devices = [self._current_device()] if devices is None else devices
        access = (_MemAccessDesc * len(devices))(
            *(_MemAccessDesc(_MemLocation(_CU_MEM_LOCATION_TYPE_DEVICE, d), _CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
              for d in devices))
        self._call("cuMemSetAccess", ptr, nbytes, access, len(devices))

    def free(self, ptr: int) -> None:
        """Frees memory from :meth:`alloc` the way its family is freed (async and pool memory
        with cuMemFreeAsync on the default stream)."""
        with self._lock:
            allocation = self._allocations.pop(ptr, None)
        if allocation is None:
            raise ValueError(f"{ptr:#x} was not allocated by this Driver (or was freed already)")
        if allocation.family == "host":
            self._call("cuMemFreeHost", c_void_p(ptr))
        elif allocation.family == "vmm":
            self._call("cuMemUnmap", ptr, allocation.size)
            self._call("cuMemAddressFree", ptr, allocation.size)
            self._call("cuMemRelease", allocation.handle)
        elif allocation.family in ("async", "pool"):
            self._call("cuMemFreeAsync", ptr, None)
        else:
            self._call("cuMemFree_v2", ptr)

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of the current device, as cuMemGetInfo_v2 reports them."""
        free, total = c_size_t(), c_size_t()
        self._call("cuMemGetInfo_v2", byref(free), byref(total))
        return free.value, total.value

    def is_managed(self, ptr: int) -> bool:
        """Whether ``ptr`` points into managed memory (CU_POINTER_ATTRIBUTE_IS_MANAGED)."""
        managed = c_uint(0)  # zeroed: a driver that writes a one-byte bool reads the same
        self._call("cuPointerGetAttribute", byref(managed), _CU_POINTER_ATTRIBUTE_IS_MANAGED, ptr)
        return bool(managed.value)

    def ipc_mem_handle(self, ptr: int) -> bytes:
        """The CUDA IPC handle of device memory (cuIpcGetMemHandle), for another process to open."""
        handle = (c_char * _IPC_HANDLE_BYTES)()
        self._call("cuIpcGetMemHandle", byref(handle), ptr)
        return handle.raw

    def memcpy_htod(self, dst: int, data: bytes | bytearray | memoryview) -> None:
        """Copies ``data`` to device address ``dst`` (cuMemcpyHtoD_v2)."""
        source = bytes(data)
        self._call("cuMemcpyHtoD_v2", dst, source, len(source))

    def memcpy_dtoh(self, src: int, nbytes: int) -> bytes:
        """Copies ``nbytes`` from device address ``src`` (cuMemcpyDtoH_v2)."""
        target = ctypes.create_string_buffer(nbytes)
        self._call("cuMemcpyDtoH_v2", target, src, nbytes)
        return target.raw

    # ---- work ----

    def create_stream(self, non_blocking: bool = True) -> int:
        stream = c_void_p()
        self._call("cuStreamCreate", byref(stream), 1 if non_blocking else 0)
        return _address(stream)

    def destroy_stream(self, stream: int) -> None:
        self._call("cuStreamDestroy_v2", c_void_p(stream))

    def stream_synchronize(self, stream: int | None = None) -> None:
        self._call("cuStreamSynchronize", c_void_p(stream))

    def synchronize(self) -> None:
        """Waits for all work of the current context (cuCtxSynchronize)."""
        self._call("cuCtxSynchronize")

    def _kernel(self, name: str) -> int:
        """The function `name` of KERNELS_PTX in the current context (loaded on first use)."""
        ctx = self._current_context()
        with self._lock:
            kernels = self._kernels.get(ctx)
        if kernels is None:
            module = c_void_p()
            self._call("cuModuleLoadData", byref(module), KERNELS_PTX.encode())
            kernels = {}
            for kernel_name in _KERNEL_NAMES:
                function = c_void_p()
                self._call("cuModuleGetFunction", byref(function), module, kernel_name.encode())
                kernels[kernel_name] = _address(function)
            with self._lock:
                self._kernels[ctx] = kernels
        return kernels[name]

    def _launch(self, function: int, blocks: int, threads: int, stream: int | None, *arguments) -> None:
        # The driver copies the arguments during the launch; they only need to live until then.
        pointers = (c_void_p * len(arguments))(*(ctypes.addressof(argument) for argument in arguments))
        self._call("cuLaunchKernel", c_void_p(function), blocks, 1, 1, threads, 1, 1, 0, c_void_p(stream),
                   pointers, None)

    def launch_sleep(self, us: int, stream: int | None = None) -> None:
        """Queues ``nvshare_sleep``: the kernel occupies the device for ``us`` microseconds."""
        self._launch(self._kernel("nvshare_sleep"), 1, 1, stream, c_uint64(us))

    def fill(self, ptr: int, value: int, count: int, stream: int | None = None) -> None:
        """Queues ``nvshare_fill``: writes ``count`` 32-bit words of ``value`` from ``ptr``."""
        blocks = max(1, min(_FILL_MAX_BLOCKS, -(-count // _FILL_THREADS)))
        self._launch(self._kernel("nvshare_fill"), blocks, _FILL_THREADS, stream,
                     _CUdeviceptr(ptr), c_uint(value & 0xFFFFFFFF), c_uint64(count))
