/*
 * Every driver entry point libnvshare.so intercepts, declared once (an X-macro list).
 *
 *   X(kind, name, (parameters), (arguments))
 *
 * kind GATED:  the wrapper is generated in hooks.c: wait for the device's lock, call the real
 *              function, leave the gate. For everything that submits GPU work or touches
 *              device memory.
 * kind LAUNCH: GATED, for a launch of a function `f` (a parameter of that name): a launch of
 *              a collective is also counted, and held to a gang's fence (collective.c).
 * kind CONTEXT: the wrapper is generated in hooks.c: call the real function, then forget the
 *              calling thread's cached device (the call may change its current context).
 * kind CUSTOM: the wrapper is hand-written (memory.c, context.c, hooks.c, collective.c).
 *
 * `name` is the exported ABI symbol of libcuda.so.1 (with its _v2/_ptds/_ptsz suffix), which
 * is also the symbol libnvshare.so exports. Adding a hook is one line here (plus its
 * hand-written wrapper if it is CUSTOM). Every hook returns CUresult. Parameters are written in
 * the driver's own types (structs nvshare never reads are opaque in cuda_types.h); `make
 * signatures` checks every prototype against the CUDA toolkit's cuda.h where one is installed.
 *
 * NVS_FOR_EACH_REAL lists functions nvshare only calls (never exported, never wrapped).
 */
#ifndef NVSHARE_HOOK_TABLE_H
#define NVSHARE_HOOK_TABLE_H

#include <stddef.h>

#include "cuda_types.h"

#define NVS_LAUNCH_PARAMS                                                                       \
    CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,          \
        unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,                 \
        unsigned int sharedMemBytes, CUstream hStream, void **kernelParams
#define NVS_LAUNCH_ARGS                                                                         \
    f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream,  \
        kernelParams

#define NVS_FOR_EACH_HOOK(X)                                                                    \
    /* --- kernel launches and graphs --- */                                                    \
    X(LAUNCH, cuLaunchKernel, (NVS_LAUNCH_PARAMS, void **extra), (NVS_LAUNCH_ARGS, extra))      \
    X(LAUNCH, cuLaunchKernel_ptsz, (NVS_LAUNCH_PARAMS, void **extra), (NVS_LAUNCH_ARGS, extra)) \
    X(LAUNCH, cuLaunchKernelEx,                                                                 \
      (const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra),          \
      (config, f, kernelParams, extra))                                                         \
    X(LAUNCH, cuLaunchKernelEx_ptsz,                                                            \
      (const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra),          \
      (config, f, kernelParams, extra))                                                         \
    X(LAUNCH, cuLaunchCooperativeKernel, (NVS_LAUNCH_PARAMS), (NVS_LAUNCH_ARGS))                \
    X(LAUNCH, cuLaunchCooperativeKernel_ptsz, (NVS_LAUNCH_PARAMS), (NVS_LAUNCH_ARGS))           \
    X(GATED, cuLaunchCooperativeKernelMultiDevice,                                              \
      (CUDA_LAUNCH_PARAMS *launchParamsList, unsigned int numDevices, unsigned int flags),      \
      (launchParamsList, numDevices, flags))                                                    \
    X(LAUNCH, cuLaunch, (CUfunction f), (f))                                                    \
    X(LAUNCH, cuLaunchGrid, (CUfunction f, int grid_width, int grid_height),                    \
      (f, grid_width, grid_height))                                                             \
    X(LAUNCH, cuLaunchGridAsync, (CUfunction f, int grid_width, int grid_height, CUstream s),   \
      (f, grid_width, grid_height, s))                                                          \
    X(GATED, cuGraphLaunch, (CUgraphExec hGraphExec, CUstream hStream), (hGraphExec, hStream))  \
    /* a host function runs in stream order and may read (converted, managed) memory */         \
    X(GATED, cuLaunchHostFunc, (CUstream hStream, CUhostFn fn, void *userData),                 \
      (hStream, fn, userData))                                                                  \
    X(GATED, cuLaunchHostFunc_ptsz, (CUstream hStream, CUhostFn fn, void *userData),            \
      (hStream, fn, userData))                                                                  \
    X(GATED, cuGraphLaunch_ptsz, (CUgraphExec hGraphExec, CUstream hStream),                    \
      (hGraphExec, hStream))                                                                    \
    /* --- copies --- */                                                                       \
    X(GATED, cuMemcpy, (CUdeviceptr dst, CUdeviceptr src, size_t n), (dst, src, n))             \
    X(GATED, cuMemcpy_ptds, (CUdeviceptr dst, CUdeviceptr src, size_t n), (dst, src, n))        \
    X(GATED, cuMemcpyAsync, (CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s),           \
      (dst, src, n, s))                                                                         \
    X(GATED, cuMemcpyAsync_ptsz, (CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s),      \
      (dst, src, n, s))                                                                         \
    X(GATED, cuMemcpyPeer,                                                                      \
      (CUdeviceptr dst, CUcontext dstCtx, CUdeviceptr src, CUcontext srcCtx, size_t n),         \
      (dst, dstCtx, src, srcCtx, n))                                                            \
    X(GATED, cuMemcpyPeer_ptds,                                                                 \
      (CUdeviceptr dst, CUcontext dstCtx, CUdeviceptr src, CUcontext srcCtx, size_t n),         \
      (dst, dstCtx, src, srcCtx, n))                                                            \
    X(GATED, cuMemcpyPeerAsync,                                                                 \
      (CUdeviceptr dst, CUcontext dstCtx, CUdeviceptr src, CUcontext srcCtx, size_t n,          \
       CUstream s),                                                                             \
      (dst, dstCtx, src, srcCtx, n, s))                                                         \
    X(GATED, cuMemcpyPeerAsync_ptsz,                                                            \
      (CUdeviceptr dst, CUcontext dstCtx, CUdeviceptr src, CUcontext srcCtx, size_t n,          \
       CUstream s),                                                                             \
      (dst, dstCtx, src, srcCtx, n, s))                                                         \
    X(GATED, cuMemcpyHtoD_v2, (CUdeviceptr dst, const void *src, size_t n), (dst, src, n))      \
    X(GATED, cuMemcpyHtoD_v2_ptds, (CUdeviceptr dst, const void *src, size_t n), (dst, src, n)) \
    X(GATED, cuMemcpyDtoH_v2, (void *dst, CUdeviceptr src, size_t n), (dst, src, n))            \
    X(GATED, cuMemcpyDtoH_v2_ptds, (void *dst, CUdeviceptr src, size_t n), (dst, src, n))       \
    X(GATED, cuMemcpyDtoD_v2, (CUdeviceptr dst, CUdeviceptr src, size_t n), (dst, src, n))      \
    X(GATED, cuMemcpyDtoD_v2_ptds, (CUdeviceptr dst, CUdeviceptr src, size_t n), (dst, src, n)) \
    X(GATED, cuMemcpyDtoA_v2, (CUarray dst, size_t dstOff, CUdeviceptr src, size_t n),          \
      (dst, dstOff, src, n))                                                                    \
    X(GATED, cuMemcpyDtoA_v2_ptds, (CUarray dst, size_t dstOff, CUdeviceptr src, size_t n),     \
      (dst, dstOff, src, n))                                                                    \
    X(GATED, cuMemcpyAtoD_v2, (CUdeviceptr dst, CUarray src, size_t srcOff, size_t n),          \
      (dst, src, srcOff, n))                                                                    \
    X(GATED, cuMemcpyAtoD_v2_ptds, (CUdeviceptr dst, CUarray src, size_t srcOff, size_t n),     \
      (dst, src, srcOff, n))                                                                    \
    X(GATED, cuMemcpyHtoA_v2, (CUarray dst, size_t dstOff, const void *src, size_t n),          \
      (dst, dstOff, src, n))                                                                    \
    X(GATED, cuMemcpyHtoA_v2_ptds, (CUarray dst, size_t dstOff, const void *src, size_t n),     \
      (dst, dstOff, src, n))                                                                    \
    X(GATED, cuMemcpyAtoH_v2, (void *dst, CUarray src, size_t srcOff, size_t n),                \
      (dst, src, srcOff, n))                                                                    \
    X(GATED, cuMemcpyAtoH_v2_ptds, (void *dst, CUarray src, size_t srcOff, size_t n),           \
      (dst, src, srcOff, n))                                                                    \
    X(GATED, cuMemcpyAtoA_v2, (CUarray dst, size_t dstOff, CUarray src, size_t srcOff, size_t n), \
      (dst, dstOff, src, srcOff, n))                                                            \
    X(GATED, cuMemcpyAtoA_v2_ptds,                                                              \
      (CUarray dst, size_t dstOff, CUarray src, size_t srcOff, size_t n),                       \
      (dst, dstOff, src, srcOff, n))                                                            \
    X(GATED, cuMemcpyHtoAAsync_v2,                                                              \
      (CUarray dst, size_t dstOff, const void *src, size_t n, CUstream s),                      \
      (dst, dstOff, src, n, s))                                                                 \
    X(GATED, cuMemcpyHtoAAsync_v2_ptsz,                                                         \
      (CUarray dst, size_t dstOff, const void *src, size_t n, CUstream s),                      \
      (dst, dstOff, src, n, s))                                                                 \
    X(GATED, cuMemcpyAtoHAsync_v2, (void *dst, CUarray src, size_t srcOff, size_t n, CUstream s), \
      (dst, src, srcOff, n, s))                                                                 \
    X(GATED, cuMemcpyAtoHAsync_v2_ptsz,                                                         \
      (void *dst, CUarray src, size_t srcOff, size_t n, CUstream s), (dst, src, srcOff, n, s))  \
    X(GATED, cuMemcpyHtoDAsync_v2, (CUdeviceptr dst, const void *src, size_t n, CUstream s),    \
      (dst, src, n, s))                                                                         \
    X(GATED, cuMemcpyHtoDAsync_v2_ptsz,                                                         \
      (CUdeviceptr dst, const void *src, size_t n, CUstream s), (dst, src, n, s))               \
    X(GATED, cuMemcpyDtoHAsync_v2, (void *dst, CUdeviceptr src, size_t n, CUstream s),          \
      (dst, src, n, s))                                                                         \
    X(GATED, cuMemcpyDtoHAsync_v2_ptsz, (void *dst, CUdeviceptr src, size_t n, CUstream s),     \
      (dst, src, n, s))                                                                         \
    X(GATED, cuMemcpyDtoDAsync_v2, (CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s),    \
      (dst, src, n, s))                                                                         \
    X(GATED, cuMemcpyDtoDAsync_v2_ptsz,                                                         \
      (CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s), (dst, src, n, s))               \
    X(GATED, cuMemcpy2D_v2, (const CUDA_MEMCPY2D *p), (p))                                      \
    X(GATED, cuMemcpy2D_v2_ptds, (const CUDA_MEMCPY2D *p), (p))                                 \
    X(GATED, cuMemcpy2DUnaligned_v2, (const CUDA_MEMCPY2D *p), (p))                             \
    X(GATED, cuMemcpy2DUnaligned_v2_ptds, (const CUDA_MEMCPY2D *p), (p))                        \
    X(GATED, cuMemcpy2DAsync_v2, (const CUDA_MEMCPY2D *p, CUstream s), (p, s))                  \
    X(GATED, cuMemcpy2DAsync_v2_ptsz, (const CUDA_MEMCPY2D *p, CUstream s), (p, s))             \
    X(GATED, cuMemcpy3D_v2, (const CUDA_MEMCPY3D *p), (p))                                      \
    X(GATED, cuMemcpy3D_v2_ptds, (const CUDA_MEMCPY3D *p), (p))                                 \
    X(GATED, cuMemcpy3DAsync_v2, (const CUDA_MEMCPY3D *p, CUstream s), (p, s))                  \
    X(GATED, cuMemcpy3DAsync_v2_ptsz, (const CUDA_MEMCPY3D *p, CUstream s), (p, s))             \
    X(GATED, cuMemcpy3DPeer, (const CUDA_MEMCPY3D_PEER *p), (p))                                \
    X(GATED, cuMemcpy3DPeer_ptds, (const CUDA_MEMCPY3D_PEER *p), (p))                           \
    X(GATED, cuMemcpy3DPeerAsync, (const CUDA_MEMCPY3D_PEER *p, CUstream s), (p, s))            \
    X(GATED, cuMemcpy3DPeerAsync_ptsz, (const CUDA_MEMCPY3D_PEER *p, CUstream s), (p, s))       \
    /* batch copies: CUDA 12.8 (with failIdx) and 13.0 (_v2, without) */                       \
    X(GATED, cuMemcpyBatchAsync,                                                                \
      (CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,                       \
       CUmemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs, size_t *failIdx,          \
       CUstream s),                                                                             \
      (dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, failIdx, s))                       \
    X(GATED, cuMemcpyBatchAsync_ptsz,                                                           \
      (CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,                       \
       CUmemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs, size_t *failIdx,          \
       CUstream s),                                                                             \
      (dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, failIdx, s))                       \
    X(GATED, cuMemcpyBatchAsync_v2,                                                             \
      (CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,                       \
       CUmemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs, CUstream s),              \
      (dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, s))                                \
    X(GATED, cuMemcpyBatchAsync_v2_ptsz,                                                        \
      (CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,                       \
       CUmemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs, CUstream s),              \
      (dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, s))                                \
    X(GATED, cuMemcpy3DBatchAsync,                                                              \
      (size_t numOps, CUDA_MEMCPY3D_BATCH_OP *ops, size_t *failIdx, unsigned long long flags,   \
       CUstream s),                                                                             \
      (numOps, ops, failIdx, flags, s))                                                         \
    X(GATED, cuMemcpy3DBatchAsync_ptsz,                                                         \
      (size_t numOps, CUDA_MEMCPY3D_BATCH_OP *ops, size_t *failIdx, unsigned long long flags,   \
       CUstream s),                                                                             \
      (numOps, ops, failIdx, flags, s))                                                         \
    X(GATED, cuMemcpy3DBatchAsync_v2,                                                           \
      (size_t numOps, CUDA_MEMCPY3D_BATCH_OP *ops, unsigned long long flags, CUstream s),       \
      (numOps, ops, flags, s))                                                                  \
    X(GATED, cuMemcpy3DBatchAsync_v2_ptsz,                                                      \
      (size_t numOps, CUDA_MEMCPY3D_BATCH_OP *ops, unsigned long long flags, CUstream s),       \
      (numOps, ops, flags, s))                                                                  \
    X(GATED, cuMemcpyWithAttributesAsync,                                                       \
      (CUdeviceptr dst, CUdeviceptr src, size_t n, CUmemcpyAttributes *attr, CUstream s),       \
      (dst, src, n, attr, s))                                                                   \
    X(GATED, cuMemcpy3DWithAttributesAsync,                                                     \
      (CUDA_MEMCPY3D_BATCH_OP *op, unsigned long long flags, CUstream s), (op, flags, s))       \
    /* --- memset --- */                                                                       \
    X(GATED, cuMemsetD8_v2, (CUdeviceptr d, unsigned char v, size_t n), (d, v, n))              \
    X(GATED, cuMemsetD8_v2_ptds, (CUdeviceptr d, unsigned char v, size_t n), (d, v, n))         \
    X(GATED, cuMemsetD16_v2, (CUdeviceptr d, unsigned short v, size_t n), (d, v, n))            \
    X(GATED, cuMemsetD16_v2_ptds, (CUdeviceptr d, unsigned short v, size_t n), (d, v, n))       \
    X(GATED, cuMemsetD32_v2, (CUdeviceptr d, unsigned int v, size_t n), (d, v, n))              \
    X(GATED, cuMemsetD32_v2_ptds, (CUdeviceptr d, unsigned int v, size_t n), (d, v, n))         \
    X(GATED, cuMemsetD2D8_v2, (CUdeviceptr d, size_t pitch, unsigned char v, size_t w, size_t h), \
      (d, pitch, v, w, h))                                                                      \
    X(GATED, cuMemsetD2D8_v2_ptds,                                                              \
      (CUdeviceptr d, size_t pitch, unsigned char v, size_t w, size_t h), (d, pitch, v, w, h))  \
    X(GATED, cuMemsetD2D16_v2,                                                                  \
      (CUdeviceptr d, size_t pitch, unsigned short v, size_t w, size_t h), (d, pitch, v, w, h)) \
    X(GATED, cuMemsetD2D16_v2_ptds,                                                             \
      (CUdeviceptr d, size_t pitch, unsigned short v, size_t w, size_t h), (d, pitch, v, w, h)) \
    X(GATED, cuMemsetD2D32_v2,                                                                  \
      (CUdeviceptr d, size_t pitch, unsigned int v, size_t w, size_t h), (d, pitch, v, w, h))   \
    X(GATED, cuMemsetD2D32_v2_ptds,                                                             \
      (CUdeviceptr d, size_t pitch, unsigned int v, size_t w, size_t h), (d, pitch, v, w, h))   \
    X(GATED, cuMemsetD8Async, (CUdeviceptr d, unsigned char v, size_t n, CUstream s),           \
      (d, v, n, s))                                                                             \
    X(GATED, cuMemsetD8Async_ptsz, (CUdeviceptr d, unsigned char v, size_t n, CUstream s),      \
      (d, v, n, s))                                                                             \
    X(GATED, cuMemsetD16Async, (CUdeviceptr d, unsigned short v, size_t n, CUstream s),         \
      (d, v, n, s))                                                                             \
    X(GATED, cuMemsetD16Async_ptsz, (CUdeviceptr d, unsigned short v, size_t n, CUstream s),    \
      (d, v, n, s))                                                                             \
    X(GATED, cuMemsetD32Async, (CUdeviceptr d, unsigned int v, size_t n, CUstream s),           \
      (d, v, n, s))                                                                             \
    X(GATED, cuMemsetD32Async_ptsz, (CUdeviceptr d, unsigned int v, size_t n, CUstream s),      \
      (d, v, n, s))                                                                             \
    X(GATED, cuMemsetD2D8Async,                                                                 \
      (CUdeviceptr d, size_t pitch, unsigned char v, size_t w, size_t h, CUstream s),           \
      (d, pitch, v, w, h, s))                                                                   \
    X(GATED, cuMemsetD2D8Async_ptsz,                                                            \
      (CUdeviceptr d, size_t pitch, unsigned char v, size_t w, size_t h, CUstream s),           \
      (d, pitch, v, w, h, s))                                                                   \
    X(GATED, cuMemsetD2D16Async,                                                                \
      (CUdeviceptr d, size_t pitch, unsigned short v, size_t w, size_t h, CUstream s),          \
      (d, pitch, v, w, h, s))                                                                   \
    X(GATED, cuMemsetD2D16Async_ptsz,                                                           \
      (CUdeviceptr d, size_t pitch, unsigned short v, size_t w, size_t h, CUstream s),          \
      (d, pitch, v, w, h, s))                                                                   \
    X(GATED, cuMemsetD2D32Async,                                                                \
      (CUdeviceptr d, size_t pitch, unsigned int v, size_t w, size_t h, CUstream s),            \
      (d, pitch, v, w, h, s))                                                                   \
    X(GATED, cuMemsetD2D32Async_ptsz,                                                           \
      (CUdeviceptr d, size_t pitch, unsigned int v, size_t w, size_t h, CUstream s),            \
      (d, pitch, v, w, h, s))                                                                   \
    /* --- managed-memory migration --- */                                                     \
    X(GATED, cuMemPrefetchAsync, (CUdeviceptr p, size_t n, CUdevice dst, CUstream s),           \
      (p, n, dst, s))                                                                           \
    X(GATED, cuMemPrefetchAsync_ptsz, (CUdeviceptr p, size_t n, CUdevice dst, CUstream s),      \
      (p, n, dst, s))                                                                           \
    X(GATED, cuMemPrefetchAsync_v2,                                                             \
      (CUdeviceptr p, size_t n, CUmemLocation loc, unsigned int flags, CUstream s),             \
      (p, n, loc, flags, s))                                                                    \
    X(GATED, cuMemPrefetchAsync_v2_ptsz,                                                        \
      (CUdeviceptr p, size_t n, CUmemLocation loc, unsigned int flags, CUstream s),             \
      (p, n, loc, flags, s))                                                                    \
    X(GATED, cuMemPrefetchBatchAsync,                                                           \
      (CUdeviceptr *ptrs, size_t *sizes, size_t count, CUmemLocation *locs, size_t *locIdxs,    \
       size_t numLocs, unsigned long long flags, CUstream s),                                   \
      (ptrs, sizes, count, locs, locIdxs, numLocs, flags, s))                                   \
    X(GATED, cuMemPrefetchBatchAsync_ptsz,                                                      \
      (CUdeviceptr *ptrs, size_t *sizes, size_t count, CUmemLocation *locs, size_t *locIdxs,    \
       size_t numLocs, unsigned long long flags, CUstream s),                                   \
      (ptrs, sizes, count, locs, locIdxs, numLocs, flags, s))                                   \
    X(GATED, cuMemDiscardAndPrefetchBatchAsync,                                                 \
      (CUdeviceptr *ptrs, size_t *sizes, size_t count, CUmemLocation *locs, size_t *locIdxs,    \
       size_t numLocs, unsigned long long flags, CUstream s),                                   \
      (ptrs, sizes, count, locs, locIdxs, numLocs, flags, s))                                   \
    X(GATED, cuMemDiscardAndPrefetchBatchAsync_ptsz,                                            \
      (CUdeviceptr *ptrs, size_t *sizes, size_t count, CUmemLocation *locs, size_t *locIdxs,    \
       size_t numLocs, unsigned long long flags, CUstream s),                                   \
      (ptrs, sizes, count, locs, locIdxs, numLocs, flags, s))                                   \
    /* a discard is stream-ordered work on device memory too */                                \
    X(GATED, cuMemDiscardBatchAsync,                                                            \
      (CUdeviceptr *ptrs, size_t *sizes, size_t count, unsigned long long flags, CUstream s),   \
      (ptrs, sizes, count, flags, s))                                                           \
    X(GATED, cuMemDiscardBatchAsync_ptsz,                                                       \
      (CUdeviceptr *ptrs, size_t *sizes, size_t count, unsigned long long flags, CUstream s),   \
      (ptrs, sizes, count, flags, s))                                                           \
    /* --- allocations (memory.c) --- */                                                       \
    X(CUSTOM, cuMemAlloc_v2, (CUdeviceptr *dptr, size_t size), (dptr, size))                    \
    X(CUSTOM, cuMemAllocPitch_v2,                                                               \
      (CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height, unsigned int elemSize),   \
      (dptr, pitch, width, height, elemSize))                                                   \
    X(CUSTOM, cuMemAllocAsync, (CUdeviceptr *dptr, size_t size, CUstream s), (dptr, size, s))   \
    X(CUSTOM, cuMemAllocAsync_ptsz, (CUdeviceptr *dptr, size_t size, CUstream s),               \
      (dptr, size, s))                                                                          \
    X(CUSTOM, cuMemAllocFromPoolAsync,                                                          \
      (CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream s), (dptr, size, pool, s))   \
    X(CUSTOM, cuMemAllocFromPoolAsync_ptsz,                                                     \
      (CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream s), (dptr, size, pool, s))   \
    X(CUSTOM, cuMemAllocManaged, (CUdeviceptr *dptr, size_t size, unsigned int flags),          \
      (dptr, size, flags))                                                                      \
    X(CUSTOM, cuMemFree_v2, (CUdeviceptr dptr), (dptr))                                         \
    X(CUSTOM, cuMemFreeAsync, (CUdeviceptr dptr, CUstream s), (dptr, s))                        \
    X(CUSTOM, cuMemFreeAsync_ptsz, (CUdeviceptr dptr, CUstream s), (dptr, s))                   \
    X(CUSTOM, cuMemGetInfo_v2, (size_t *free_bytes, size_t *total_bytes),                       \
      (free_bytes, total_bytes))                                                                \
    X(CUSTOM, cuDeviceTotalMem_v2, (size_t *bytes, CUdevice dev), (bytes, dev))                  \
    /* --- virtual memory management (vmm.c) --- */                                            \
    X(CUSTOM, cuMemCreate,                                                                      \
      (CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,      \
       unsigned long long flags),                                                               \
      (handle, size, prop, flags))                                                              \
    X(CUSTOM, cuMemRelease, (CUmemGenericAllocationHandle handle), (handle))                    \
    X(CUSTOM, cuMemMap,                                                                         \
      (CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,        \
       unsigned long long flags),                                                               \
      (ptr, size, offset, handle, flags))                                                       \
    X(CUSTOM, cuMemUnmap, (CUdeviceptr ptr, size_t size), (ptr, size))                          \
    X(CUSTOM, cuMemSetAccess, (CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count), \
      (ptr, size, desc, count))                                                                 \
    X(CUSTOM, cuMemRetainAllocationHandle, (CUmemGenericAllocationHandle *handle, void *addr),  \
      (handle, addr))                                                                           \
    X(CUSTOM, cuMemExportToShareableHandle,                                                     \
      (void *shareableHandle, CUmemGenericAllocationHandle handle,                              \
       CUmemAllocationHandleType handleType, unsigned long long flags),                         \
      (shareableHandle, handle, handleType, flags))                                             \
    X(CUSTOM, cuMemGetAddressRange_v2, (CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr),     \
      (pbase, psize, dptr))                                                                     \
    X(CUSTOM, cuMemGetAllocationPropertiesFromHandle,                                           \
      (CUmemAllocationProp *prop, CUmemGenericAllocationHandle handle), (prop, handle))         \
    X(CUSTOM, cuMemMapArrayAsync, (CUarrayMapInfo *mapInfoList, unsigned int count, CUstream hStream), \
      (mapInfoList, count, hStream))                                                            \
    X(CUSTOM, cuMemMapArrayAsync_ptsz,                                                          \
      (CUarrayMapInfo *mapInfoList, unsigned int count, CUstream hStream), (mapInfoList, count, hStream)) \
    X(CUSTOM, cuMulticastBindMem,                                                               \
      (CUmemGenericAllocationHandle mcHandle, size_t mcOffset, CUmemGenericAllocationHandle memHandle, \
       size_t memOffset, size_t size, unsigned long long flags),                                \
      (mcHandle, mcOffset, memHandle, memOffset, size, flags))                                  \
    X(CUSTOM, cuMulticastBindMem_v2,                                                            \
      (CUmemGenericAllocationHandle mcHandle, CUdevice dev, size_t mcOffset,                    \
       CUmemGenericAllocationHandle memHandle, size_t memOffset, size_t size, unsigned long long flags), \
      (mcHandle, dev, mcOffset, memHandle, memOffset, size, flags))                             \
    X(CUSTOM, cuMulticastBindAddr,                                                              \
      (CUmemGenericAllocationHandle mcHandle, size_t mcOffset, CUdeviceptr memptr, size_t size, \
       unsigned long long flags),                                                               \
      (mcHandle, mcOffset, memptr, size, flags))                                                \
    X(CUSTOM, cuMulticastBindAddr_v2,                                                           \
      (CUmemGenericAllocationHandle mcHandle, CUdevice dev, size_t mcOffset, CUdeviceptr memptr, \
       size_t size, unsigned long long flags),                                                  \
      (mcHandle, dev, mcOffset, memptr, size, flags))                                           \
    X(CUSTOM, cuIpcGetMemHandle, (CUipcMemHandle *handle, CUdeviceptr dptr), (handle, dptr))    \
    X(CUSTOM, cuDeviceGetAttribute, (int *value, CUdevice_attribute attrib, CUdevice dev),      \
      (value, attrib, dev))                                                                     \
    /* --- contexts (hooks.c, context.c): they change the thread's device --- */                \
    X(CONTEXT, cuCtxSetCurrent, (CUcontext ctx), (ctx))                                          \
    X(CONTEXT, cuCtxPushCurrent_v2, (CUcontext ctx), (ctx))                                      \
    X(CONTEXT, cuCtxPopCurrent_v2, (CUcontext *pctx), (pctx))                                    \
    X(CONTEXT, cuCtxCreate_v2, (CUcontext *pctx, unsigned int flags, CUdevice dev),              \
      (pctx, flags, dev))                                                                       \
    X(CONTEXT, cuCtxCreate_v3,                                                                   \
      (CUcontext *pctx, CUexecAffinityParam *affinityParams, int numParams, unsigned int flags,    \
       CUdevice dev),                                                                           \
      (pctx, affinityParams, numParams, flags, dev))                                            \
    X(CONTEXT, cuCtxCreate_v4,                                                                   \
      (CUcontext *pctx, CUctxCreateParams *createParams, unsigned int flags, CUdevice dev),     \
      (pctx, createParams, flags, dev))                                                         \
    /* --- stream capture (gate.c): a drain must not synchronise during a capture --- */       \
    X(CUSTOM, cuStreamBeginCapture, (CUstream hStream), (hStream))                              \
    X(CUSTOM, cuStreamBeginCapture_ptsz, (CUstream hStream), (hStream))                         \
    X(CUSTOM, cuStreamBeginCapture_v2, (CUstream hStream, CUstreamCaptureMode mode), (hStream, mode)) \
    X(CUSTOM, cuStreamBeginCapture_v2_ptsz, (CUstream hStream, CUstreamCaptureMode mode),       \
      (hStream, mode))                                                                          \
    X(CUSTOM, cuStreamBeginCaptureToGraph,                                                      \
      (CUstream hStream, CUgraph hGraph, const CUgraphNode *dependencies, const CUgraphEdgeData *dependencyData,   \
       size_t numDependencies, CUstreamCaptureMode mode),                                       \
      (hStream, hGraph, dependencies, dependencyData, numDependencies, mode))                   \
    X(CUSTOM, cuStreamBeginCaptureToGraph_ptsz,                                                 \
      (CUstream hStream, CUgraph hGraph, const CUgraphNode *dependencies, const CUgraphEdgeData *dependencyData,   \
       size_t numDependencies, CUstreamCaptureMode mode),                                       \
      (hStream, hGraph, dependencies, dependencyData, numDependencies, mode))                   \
    X(CUSTOM, cuStreamEndCapture, (CUstream hStream, CUgraph *phGraph), (hStream, phGraph))     \
    X(CUSTOM, cuStreamEndCapture_ptsz, (CUstream hStream, CUgraph *phGraph), (hStream, phGraph)) \
    X(CUSTOM, cuCtxDestroy_v2, (CUcontext ctx), (ctx))                                          \
    X(CUSTOM, cuDevicePrimaryCtxRelease_v2, (CUdevice dev), (dev))                              \
    X(CUSTOM, cuDevicePrimaryCtxReset_v2, (CUdevice dev), (dev))                                \
    /* --- kernels looked up by name: which are collectives (collective.c) --- */               \
    X(CUSTOM, cuModuleGetFunction, (CUfunction *hfunc, CUmodule hmod, const char *name),        \
      (hfunc, hmod, name))                                                                      \
    X(CUSTOM, cuLibraryGetKernel, (CUkernel *pKernel, CUlibrary library, const char *name),     \
      (pKernel, library, name))                                                                 \
    X(CUSTOM, cuKernelGetFunction, (CUfunction *pFunc, CUkernel kernel), (pFunc, kernel))       \
    /* --- lookup (hooks.c) --- */                                                             \
    X(CUSTOM, cuGetProcAddress,                                                                 \
      (const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags),                      \
      (symbol, pfn, cudaVersion, flags))                                                        \
    X(CUSTOM, cuGetProcAddress_v2,                                                              \
      (const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,                       \
       CUdriverProcAddressQueryResult *symbolStatus),                                           \
      (symbol, pfn, cudaVersion, flags, symbolStatus))

#define NVS_FOR_EACH_REAL(X)                                                                    \
    X(cuCtxGetCurrent, (CUcontext * pctx))                                                      \
    X(cuCtxGetDevice, (CUdevice * dev))                                                         \
    X(cuCtxSynchronize, (void))                                                                 \
    X(cuCtxGetApiVersion, (CUcontext ctx, unsigned int *version))                               \
    X(cuDeviceGetUuid_v2, (CUuuid * uuid, CUdevice dev))                                        \
    X(cuDeviceGetUuid, (CUuuid * uuid, CUdevice dev))                                           \
    X(cuDeviceGetName, (char *name, int len, CUdevice dev))                                     \
    X(cuEventCreate, (CUevent * event, unsigned int flags))                                     \
    X(cuEventRecord, (CUevent event, CUstream stream))                                          \
    X(cuEventQuery, (CUevent event))                                                            \
    X(cuEventSynchronize, (CUevent event))                                                      \
    X(cuEventDestroy_v2, (CUevent event))                                                       \
    X(cuStreamIsCapturing, (CUstream stream, CUstreamCaptureStatus *status))                    \
    X(cuPointerGetAttribute, (void *data, CUpointer_attribute attribute, CUdeviceptr ptr))      \
    X(cuMemAdvise_v2, (CUdeviceptr ptr, size_t count, CUmem_advise advice, CUmemLocation location)) \
    X(cuStreamCreate, (CUstream * phStream, unsigned int flags))                                 \
    X(cuStreamSynchronize, (CUstream hStream))                                                  \
    X(cuStreamDestroy_v2, (CUstream hStream))                                                   \
    /* the swap area (area.c) */                                                                \
    X(cuMemHostRegister_v2, (void *p, size_t bytesize, unsigned int flags))                     \
    X(cuMemHostUnregister, (void *p))                                                           \
    X(cuMemHostAlloc, (void **pp, size_t bytesize, unsigned int flags))                          \
    X(cuMemFreeHost, (void *p))                                                                 \
    X(cuGetErrorName, (CUresult error, const char **pStr))

/* `make` lists the exported names for the version script with this. */
#ifdef NVS_LIST_HOOK_NAMES
#define NVS_HOOK_NAME(kind, name, params, args) @name@
NVS_FOR_EACH_HOOK(NVS_HOOK_NAME)
#undef NVS_HOOK_NAME
#endif

/* Prototypes of every exported hook, so hand-written wrappers are checked against the list. */
#define NVS_DECLARE_HOOK(kind, name, params, args) CUresult name params;
NVS_FOR_EACH_HOOK(NVS_DECLARE_HOOK)
#undef NVS_DECLARE_HOOK

#endif
