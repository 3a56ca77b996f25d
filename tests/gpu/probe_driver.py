"""Probe how the installed CUDA driver resolves entry points (no allocation, no kernels).

Prints, for each name, whether cuGetProcAddress returns the address of an exported
versioned symbol (so an interceptor can map it back to the right wrapper).
"""
import ctypes
import json
import sys

cuda = ctypes.CDLL("libcuda.so.1")
res = {}
cuda.cuInit(0)
v = ctypes.c_int()
cuda.cuDriverGetVersion(ctypes.byref(v))
res["driver_version"] = v.value
gpa = cuda.cuGetProcAddress_v2
gpa.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64, ctypes.POINTER(ctypes.c_int)]
names = sys.argv[1].split(",") if len(sys.argv) > 1 else []
suffixes = ["", "_v2", "_v3", "_v4", "_ptsz", "_ptds", "_v2_ptsz", "_v2_ptds", "_v3_ptsz", "_v3_ptds"]
out = {}
for base in names:
    exported = {}
    for s in suffixes:
        try:
            a = ctypes.cast(getattr(cuda, base + s), ctypes.c_void_p).value
            exported[base + s] = a
        except AttributeError:
            pass
    rev = {a: n for n, a in exported.items()}
    row = {"exported": sorted(exported)}
    for ver in (11030, 12000, 12080, 13000):
        for flags in (0, 1, 2):
            p = ctypes.c_void_p()
            st = ctypes.c_int(-1)
            r = gpa(base.encode(), ctypes.byref(p), ver, flags, ctypes.byref(st))
            key = f"{ver}/{flags}"
            row[key] = (r, st.value, rev.get(p.value, None if not p.value else "UNEXPORTED"))
    out[base] = row
res["lookups"] = out
print(json.dumps(res, indent=1))
