/*
 * Not part of libnvshare.so: `make signatures` compiles this file against the CUDA toolkit's
 * cuda.h, when one is installed, to check every hook's prototype (hook_table.h) against NVIDIA's.
 *
 * __CUDA_API_VERSION_INTERNAL makes cuda.h declare every ABI version of every entry point under
 * its exported name (cuMemAlloc_v2, cuLaunchKernel_ptsz, the legacy cuLaunchKernel, ...), as the
 * driver itself is built. With nvshare's own types switched off, hook_table.h then declares each hook
 * again, in the toolkit's types: a hook whose parameters differ from NVIDIA's is a conflicting
 * declaration, an error. Hooks the toolkit does not declare (entry points newer than it) are not
 * checked; the Makefile lists them. Headers older than CUDA 13.0 lack types the hooks name
 * (CUmemcpyAttributes, ...): the Makefile skips the check for them, saying so.
 */
#define __CUDA_API_VERSION_INTERNAL 1
#include <cuda.h>

#define NVSHARE_CUDA_TYPES_H /* the toolkit's types stand in for cuda_types.h */
#include "hook_table.h"

#define NVS_DECLARE_REAL(name, params) CUresult name params;
NVS_FOR_EACH_REAL(NVS_DECLARE_REAL)
#undef NVS_DECLARE_REAL
