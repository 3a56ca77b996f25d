"""Ask the CUDA driver whether device pointers are managed (CU_POINTER_ATTRIBUTE_IS_MANAGED)."""

import ctypes

_IS_MANAGED = 8
_driver = ctypes.CDLL("libcuda.so.1")
_get_attribute = _driver.cuPointerGetAttribute
_get_attribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
_get_attribute.restype = ctypes.c_int


def is_managed(pointer: int) -> bool:
    flag = ctypes.c_uint(0)
    status = _get_attribute(ctypes.byref(flag), _IS_MANAGED, pointer)
    if status != 0:
        raise RuntimeError(f"cuPointerGetAttribute({pointer:#x}) failed with CUDA error {status}")
    return bool(flag.value)


def summarise(pointers) -> dict:
    """{"checked": n, "unmanaged": [hex addresses...]} for the given device pointers."""
    pointers = sorted(set(int(p) for p in pointers if p))
    return {"checked": len(pointers), "unmanaged": [hex(p) for p in pointers if not is_managed(p)]}
