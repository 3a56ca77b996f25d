#!/bin/bash
# One-shot environment probe on the GPU machine: what the interceptor design relies on.
set -u
nvidia-smi --query-gpu=name,memory.total,memory.free,driver_version,uuid --format=csv
python3 -c 'import sys,torch,jax,cupy;print(sys.version);print("torch",torch.__version__,torch.version.cuda);print("jax",jax.__version__);print("cupy",cupy.__version__)' 2>&1 | grep -v Warning
ldconfig -p | grep -E "libcuda.so|libnvidia-ml" 
ldd --version | head -1
NAMES=cuGetProcAddress,cuMemAlloc,cuMemAllocPitch,cuMemAllocAsync,cuMemAllocFromPoolAsync,cuMemFree,cuMemFreeAsync,cuMemGetInfo,cuLaunchKernel,cuLaunchKernelEx,cuLaunchCooperativeKernel,cuGraphLaunch,cuMemcpy,cuMemcpyAsync,cuMemcpyHtoD,cuMemcpyHtoDAsync,cuMemcpyDtoH,cuMemcpyDtoHAsync,cuMemcpyDtoD,cuMemcpyDtoDAsync,cuMemcpy2D,cuMemcpy2DAsync,cuMemcpy3D,cuMemcpy3DAsync,cuMemcpyPeer,cuMemcpyPeerAsync,cuMemcpy3DPeer,cuMemsetD8,cuMemsetD32,cuMemsetD8Async,cuMemsetD2D8,cuMemcpyBatchAsync,cuMemcpy3DBatchAsync,cuCtxCreate,cuCtxDestroy,cuCtxSetCurrent,cuCtxPushCurrent,cuCtxPopCurrent,cuDevicePrimaryCtxRelease,cuDevicePrimaryCtxReset,cuMemPrefetchAsync,cuPointerGetAttribute,cuIpcGetMemHandle,cuDeviceTotalMem,cuMemCreate,cuMemMap,cuStreamBeginCapture,cuLaunchHostFunc,cuMemcpyAtoH,cuMemcpyHtoA
python3 tests/gpu/probe_driver.py $NAMES > $OUT/probe.json; echo probe rc=$?
python3 - <<'PY'
import json,os
d=json.load(open(os.environ["OUT"]+"/probe.json"))
print("driver", d["driver_version"])
for n,row in d["lookups"].items():
    vals={k:v for k,v in row.items() if k!="exported"}
    print(n, row["exported"], {k:v for k,v in vals.items() if k.endswith("/0") or k.endswith("/2")})
PY
for f in $(python3 -c 'import torch,os;d=os.path.dirname(torch.__file__)+"/lib";print(" ".join(d+"/"+x for x in os.listdir(d) if x.endswith(".so")))') $(python3 -c 'import nvidia.cuda_runtime as m,os,glob;print(" ".join(glob.glob(os.path.dirname(m.__path__[0]+"/")+"/**/libcudart*.so*",recursive=True)))' 2>/dev/null) $(python3 -c 'import jaxlib,glob,os;print(" ".join(glob.glob(os.path.dirname(jaxlib.__file__)+"/**/*.so",recursive=True)[:40]))') ; do
  s=$(readelf --dyn-syms -W $f 2>/dev/null | grep -E " (dlsym|dlvsym)@" | awk '{print $8}' | sort -u | tr '\n' ' ')
  [ -n "$s" ] && echo "$(basename $f): $s"
done
python3 -c 'import jax_plugins,glob,os;print(glob.glob(os.path.dirname(jax_plugins.__path__[0]+"/")+"/**/*.so",recursive=True))' 2>&1 | head -3
nproc; free -g | head -2
