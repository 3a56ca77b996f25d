/*
 * Every cuMemcpy* and cuMemset* entry point. Copies and sets really move bytes, at execution
 * time, on the stream's queue.
 *
 * When the calling thread gets control back follows the driver documentation ("API
 * synchronization behavior"):
 * - synchronous copies return after the copy, except device-to-device copies, which are
 *   asynchronous with respect to the host;
 * - synchronous memsets return after the memset only when the target is pinned host or managed
 *   memory;
 * - asynchronous copies from pageable host memory (memory the driver did not allocate) stage
 *   the source bytes and return at once; asynchronous copies to pageable memory return after
 *   the copy. Pageable memory cannot be part of a stream capture.
 * All of this was checked on an H200 with driver 580. Device-side arguments must lie in driver
 * memory (CUDA_ERROR_INVALID_VALUE otherwise); memory freed before the copy executes makes the
 * context fail with CUDA_ERROR_ILLEGAL_ADDRESS. CUDA arrays, cuMemcpy3DBatchAsync and cuMemcpy3DWithAttributesAsync are not
 * simulated (CUDA_ERROR_NOT_SUPPORTED); the 32-bit entry points of CUDA 2.x answer
 * CUDA_ERROR_INVALID_CONTEXT, as the real driver does.
 */
#include <stdlib.h>
#include <string.h>

#include "simcuda.h"

/* What an argument claims to be. Unified pointers may name driver or pageable host memory. */
enum side { SIDE_HOST, SIDE_DEVICE, SIDE_UNIFIED };

struct endpoint_use {
    int known;                    /* driver memory; otherwise pageable host memory */
    int host;                     /* pinned host, managed or pageable memory */
    int device_side;              /* memory on the device's side of the link (managed included) */
    int managed;                  /* managed memory */
};

static CUresult classify(const struct sim_ctx *ctx, uintptr_t ptr, size_t bytes, enum side side,
                         struct endpoint_use *use)
{
    enum sim_family family = SIM_MEM_HOST;
    use->known = sim_mem_range_known(ptr, bytes, &family);
    if ((side == SIDE_DEVICE && !use->known) || (ctx && sim_mem_vmm_refused(ptr, bytes, ctx->device)))
        return CUDA_ERROR_INVALID_VALUE;
    use->host = !use->known || family == SIM_MEM_HOST || family == SIM_MEM_MANAGED;
    use->device_side = use->known && family != SIM_MEM_HOST;
    use->managed = use->known && family == SIM_MEM_MANAGED;
    return CUDA_SUCCESS;
}

/* The link a copy crosses, for the residency model's copy engines: device-side memory to host
 * memory is device-to-host, and the other way round; anything else crosses none. */
static void set_link(struct sim_copy *copy, const struct endpoint_use *dst, const struct endpoint_use *src)
{
    copy->link = SIM_ENGINE_COMPUTE;
    copy->managed = 0;
    if (src->device_side && !dst->device_side) {
        copy->link = SIM_ENGINE_D2H;
        copy->pageable = !dst->known;
        copy->managed = src->managed;
    } else if (dst->device_side && !src->device_side) {
        copy->link = SIM_ENGINE_H2D;
        copy->pageable = !src->known;
        copy->managed = dst->managed;
    }
}

static CUresult submit_copy(struct sim_copy copy, enum side dst_side, enum side src_side, CUstream hStream,
                            int synchronous, const char *api)
{
    SIM_ENTER();
    struct sim_ctx *ctx;
    struct sim_stream *stream;
    CUresult result = sim_stream_resolve(hStream, &ctx, &stream);
    if (result != CUDA_SUCCESS || copy.width == 0 || copy.height == 0 || copy.depth == 0)
        return result;
    size_t src_extent = sim_extent(copy.width, copy.height, copy.depth, copy.src_pitch, copy.src_slice);
    struct endpoint_use dst, src;
    result = classify(ctx, copy.dst, sim_extent(copy.width, copy.height, copy.depth, copy.dst_pitch, copy.dst_slice),
                      dst_side, &dst);
    if (result == CUDA_SUCCESS)
        result = classify(ctx, copy.src, src_extent, src_side, &src);
    if (result != CUDA_SUCCESS)
        return result;
    if ((!dst.known || !src.known) && sim_stream_capturing(stream))
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    copy.check_dst = dst.known;
    copy.check_src = src.known;
    set_link(&copy, &dst, &src);
    struct sim_op *op = sim_op_new(SIM_OP_MEMCPY, api);
    int wait = synchronous ? dst.host || src.host : !dst.known;
    if (!synchronous && !src.known) {
        op->staging = malloc(src_extent);
        if (!op->staging) {
            sim_op_free(op);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        memcpy(op->staging, (const void *)copy.src, src_extent);
        copy.src = (uintptr_t)op->staging;
    }
    op->u.copy = copy;
    return sim_submit(ctx, stream, op, wait);
}

static CUresult copy_linear(uintptr_t dst, enum side dst_side, uintptr_t src, enum side src_side, size_t bytes,
                            CUstream hStream, int synchronous, const char *api)
{
    struct sim_copy copy = {.dst = dst, .src = src, .width = bytes, .height = 1, .depth = 1};
    return submit_copy(copy, dst_side, src_side, hStream, synchronous, api);
}

#define SYNC 1
#define ASYNC 0
#define HOST(pointer) (uintptr_t)(pointer), SIDE_HOST
#define DEVICE(pointer) (uintptr_t)(pointer), SIDE_DEVICE
#define UNIFIED(pointer) (uintptr_t)(pointer), SIDE_UNIFIED

SIM_WITH_TWIN(cuMemcpy, cuMemcpy_ptds, (CUdeviceptr dst, CUdeviceptr src, size_t ByteCount),
              return copy_linear(UNIFIED(dst), UNIFIED(src), ByteCount, NULL, SYNC, __func__);)
SIM_WITH_TWIN(cuMemcpyAsync, cuMemcpyAsync_ptsz, (CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream),
              return copy_linear(UNIFIED(dst), UNIFIED(src), ByteCount, hStream, ASYNC, __func__);)
SIM_WITH_TWIN(cuMemcpyHtoD_v2, cuMemcpyHtoD_v2_ptds, (CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount),
              return copy_linear(DEVICE(dstDevice), HOST(srcHost), ByteCount, NULL, SYNC, __func__);)
SIM_WITH_TWIN(cuMemcpyDtoH_v2, cuMemcpyDtoH_v2_ptds, (void *dstHost, CUdeviceptr srcDevice, size_t ByteCount),
              return copy_linear(HOST(dstHost), DEVICE(srcDevice), ByteCount, NULL, SYNC, __func__);)
SIM_WITH_TWIN(cuMemcpyDtoD_v2, cuMemcpyDtoD_v2_ptds, (CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount),
              return copy_linear(DEVICE(dstDevice), DEVICE(srcDevice), ByteCount, NULL, SYNC, __func__);)
SIM_WITH_TWIN(cuMemcpyHtoDAsync_v2, cuMemcpyHtoDAsync_v2_ptsz,
              (CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount, CUstream hStream),
              return copy_linear(DEVICE(dstDevice), HOST(srcHost), ByteCount, hStream, ASYNC, __func__);)
SIM_WITH_TWIN(cuMemcpyDtoHAsync_v2, cuMemcpyDtoHAsync_v2_ptsz,
              (void *dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream),
              return copy_linear(HOST(dstHost), DEVICE(srcDevice), ByteCount, hStream, ASYNC, __func__);)
SIM_WITH_TWIN(cuMemcpyDtoDAsync_v2, cuMemcpyDtoDAsync_v2_ptsz,
              (CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream),
              return copy_linear(DEVICE(dstDevice), DEVICE(srcDevice), ByteCount, hStream, ASYNC, __func__);)

/* ---- Peer copies: the contexts must be valid; the copy runs on the current context. ---- */

static CUresult check_peer_contexts(CUcontext dst_context, CUcontext src_context)
{
    struct sim_ctx *ignored;
    CUresult result = sim_ctx_check(dst_context, &ignored);
    return result != CUDA_SUCCESS ? result : sim_ctx_check(src_context, &ignored);
}

static CUresult copy_peer(CUdeviceptr dst, CUcontext dst_context, CUdeviceptr src, CUcontext src_context,
                          size_t bytes, CUstream hStream, int synchronous, const char *api)
{
    SIM_ENTER();
    CUresult result = check_peer_contexts(dst_context, src_context);
    return result != CUDA_SUCCESS ? result : copy_linear(DEVICE(dst), DEVICE(src), bytes, hStream, synchronous, api);
}

SIM_WITH_TWIN(cuMemcpyPeer, cuMemcpyPeer_ptds,
              (CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice, CUcontext srcContext, size_t ByteCount),
              return copy_peer(dstDevice, dstContext, srcDevice, srcContext, ByteCount, NULL, SYNC, __func__);)
SIM_WITH_TWIN(cuMemcpyPeerAsync, cuMemcpyPeerAsync_ptsz,
              (CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice, CUcontext srcContext, size_t ByteCount,
               CUstream hStream),
              return copy_peer(dstDevice, dstContext, srcDevice, srcContext, ByteCount, hStream, ASYNC, __func__);)

/* ---- 2D and 3D copies ---- */

/* One side of a CUDA_MEMCPY2D/3D/3D_PEER descriptor. */
struct endpoint {
    CUmemorytype type;
    const void *host;
    CUdeviceptr device;
    size_t x, y, z, lod, pitch, height;
};

static CUresult resolve_endpoint(const struct endpoint *end, size_t height, size_t depth, size_t width, uintptr_t *address,
                                 size_t *slice, enum side *side)
{
    uintptr_t base;
    switch (end->type) {
    case CU_MEMORYTYPE_HOST:
        base = (uintptr_t)end->host;
        *side = SIDE_HOST;
        break;
    case CU_MEMORYTYPE_DEVICE:
        base = (uintptr_t)end->device;
        *side = SIDE_DEVICE;
        break;
    case CU_MEMORYTYPE_UNIFIED:
        base = (uintptr_t)end->device;
        *side = SIDE_UNIFIED;
        break;
    case CU_MEMORYTYPE_ARRAY:
        return CUDA_ERROR_NOT_SUPPORTED;
    default:
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (end->lod != 0 || (height > 1 && end->pitch < width) || (depth > 1 && end->height < height))
        return CUDA_ERROR_INVALID_VALUE;
    *slice = end->pitch * end->height;
    *address = base + (end->z * end->height + end->y) * end->pitch + end->x;
    return CUDA_SUCCESS;
}

static CUresult copy_3d(const struct endpoint *dst, const struct endpoint *src, size_t width, size_t height, size_t depth,
                        CUstream hStream, int synchronous, const char *api)
{
    struct sim_copy copy = {.width = width, .height = height, .depth = depth, .dst_pitch = dst->pitch,
                            .src_pitch = src->pitch};
    enum side dst_side, src_side;
    CUresult result = resolve_endpoint(dst, height, depth, width, &copy.dst, &copy.dst_slice, &dst_side);
    if (result == CUDA_SUCCESS)
        result = resolve_endpoint(src, height, depth, width, &copy.src, &copy.src_slice, &src_side);
    if (result != CUDA_SUCCESS)
        return result;
    return submit_copy(copy, dst_side, src_side, hStream, synchronous, api);
}

static CUresult copy_2d(const CUDA_MEMCPY2D *p, CUstream hStream, int synchronous, const char *api)
{
    SIM_ENTER();
    if (!p)
        return CUDA_ERROR_INVALID_VALUE;
    struct endpoint src = {p->srcMemoryType, p->srcHost, p->srcDevice, p->srcXInBytes, p->srcY, 0, 0, p->srcPitch, p->Height};
    struct endpoint dst = {p->dstMemoryType, p->dstHost, p->dstDevice, p->dstXInBytes, p->dstY, 0, 0, p->dstPitch, p->Height};
    return copy_3d(&dst, &src, p->WidthInBytes, p->Height, 1, hStream, synchronous, api);
}

/* One side (src or dst) of a CUDA_MEMCPY3D or CUDA_MEMCPY3D_PEER, which name their fields alike. */
#define ENDPOINT_3D(p, side)                                                                                \
    {(p)->side##MemoryType, (p)->side##Host, (p)->side##Device, (p)->side##XInBytes, (p)->side##Y, (p)->side##Z, \
     (p)->side##LOD, (p)->side##Pitch, (p)->side##Height}

static CUresult copy_3d_descriptor(const CUDA_MEMCPY3D *p, CUstream hStream, int synchronous, const char *api)
{
    SIM_ENTER();
    if (!p)
        return CUDA_ERROR_INVALID_VALUE;
    struct endpoint src = ENDPOINT_3D(p, src), dst = ENDPOINT_3D(p, dst);
    return copy_3d(&dst, &src, p->WidthInBytes, p->Height, p->Depth, hStream, synchronous, api);
}

static CUresult copy_3d_peer(const CUDA_MEMCPY3D_PEER *p, CUstream hStream, int synchronous, const char *api)
{
    SIM_ENTER();
    if (!p)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult result = check_peer_contexts(p->dstContext, p->srcContext);
    if (result != CUDA_SUCCESS)
        return result;
    struct endpoint src = ENDPOINT_3D(p, src), dst = ENDPOINT_3D(p, dst);
    return copy_3d(&dst, &src, p->WidthInBytes, p->Height, p->Depth, hStream, synchronous, api);
}

SIM_WITH_TWIN(cuMemcpy2D_v2, cuMemcpy2D_v2_ptds, (const CUDA_MEMCPY2D *pCopy),
              return copy_2d(pCopy, NULL, SYNC, __func__);)
SIM_WITH_TWIN(cuMemcpy2DUnaligned_v2, cuMemcpy2DUnaligned_v2_ptds, (const CUDA_MEMCPY2D *pCopy),
              return copy_2d(pCopy, NULL, SYNC, __func__);)
SIM_WITH_TWIN(cuMemcpy2DAsync_v2, cuMemcpy2DAsync_v2_ptsz, (const CUDA_MEMCPY2D *pCopy, CUstream hStream),
              return copy_2d(pCopy, hStream, ASYNC, __func__);)
SIM_WITH_TWIN(cuMemcpy3D_v2, cuMemcpy3D_v2_ptds, (const CUDA_MEMCPY3D *pCopy),
              return copy_3d_descriptor(pCopy, NULL, SYNC, __func__);)
SIM_WITH_TWIN(cuMemcpy3DAsync_v2, cuMemcpy3DAsync_v2_ptsz, (const CUDA_MEMCPY3D *pCopy, CUstream hStream),
              return copy_3d_descriptor(pCopy, hStream, ASYNC, __func__);)
SIM_WITH_TWIN(cuMemcpy3DPeer, cuMemcpy3DPeer_ptds, (const CUDA_MEMCPY3D_PEER *pCopy),
              return copy_3d_peer(pCopy, NULL, SYNC, __func__);)
SIM_WITH_TWIN(cuMemcpy3DPeerAsync, cuMemcpy3DPeerAsync_ptsz, (const CUDA_MEMCPY3D_PEER *pCopy, CUstream hStream),
              return copy_3d_peer(pCopy, hStream, ASYNC, __func__);)

/* ---- Batches ----
 * As measured: every batch needs at least one attribute (the first applying from copy 0), and
 * the legacy default stream is refused. The attributes (access order, location hints) change
 * nothing here; pageable memory in a batch makes the call return after the copies. */

static CUresult copy_batch(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count, CUmemcpyAttributes *attrs,
                           size_t *attrsIdxs, size_t numAttrs, size_t *failIdx, CUstream hStream, int per_thread,
                           const char *api)
{
    SIM_ENTER();
    if (failIdx)
        *failIdx = SIZE_MAX;
    if (!dsts || !srcs || !sizes || count == 0 || !attrs || !attrsIdxs || numAttrs == 0 || numAttrs > count ||
        attrsIdxs[0] != 0 || hStream == CU_STREAM_LEGACY || (!hStream && !per_thread))
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_ctx *ctx;
    struct sim_stream *stream;
    CUresult result = sim_stream_resolve(hStream, &ctx, &stream);
    if (result != CUDA_SUCCESS)
        return result;
    struct sim_op *op = sim_op_new(SIM_OP_BATCH, api);
    op->u.batch.count = count;
    op->u.batch.copies = calloc(count, sizeof(struct sim_copy));
    if (!op->u.batch.copies) {
        sim_op_free(op);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    int pageable = 0;
    for (size_t i = 0; i < count; i++) {
        if (sizes[i] == 0) {
            if (failIdx)
                *failIdx = i;
            sim_op_free(op);
            return CUDA_ERROR_INVALID_VALUE;
        }
        struct sim_copy *copy = &op->u.batch.copies[i];
        *copy = (struct sim_copy){.dst = (uintptr_t)dsts[i], .src = (uintptr_t)srcs[i], .width = sizes[i],
                                  .height = 1, .depth = 1};
        struct endpoint_use dst, src;
        classify(NULL, copy->dst, copy->width, SIDE_UNIFIED, &dst);
        classify(NULL, copy->src, copy->width, SIDE_UNIFIED, &src);
        copy->check_dst = dst.known;
        copy->check_src = src.known;
        set_link(copy, &dst, &src);
        pageable |= !copy->check_dst || !copy->check_src;
    }
    if (pageable && sim_stream_capturing(stream)) {
        sim_op_free(op);
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    }
    return sim_submit(ctx, stream, op, pageable);
}

SIM_EXPORT CUresult cuMemcpyBatchAsync(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
                                       CUmemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs, size_t *failIdx,
                                       CUstream hStream)
{
    return copy_batch(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, failIdx, hStream, 0, __func__);
}

SIM_EXPORT CUresult cuMemcpyBatchAsync_ptsz(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
                                            CUmemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs,
                                            size_t *failIdx, CUstream hStream)
{
    return copy_batch(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, failIdx, hStream, 1, __func__);
}

SIM_EXPORT CUresult cuMemcpyBatchAsync_v2(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
                                          CUmemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs, CUstream hStream)
{
    return copy_batch(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, NULL, hStream, 0, __func__);
}

SIM_EXPORT CUresult cuMemcpyBatchAsync_v2_ptsz(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
                                               CUmemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs,
                                               CUstream hStream)
{
    return copy_batch(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, NULL, hStream, 1, __func__);
}

/* CUDA 13.2: one copy with attributes, simulated as a batch of that one copy. */
SIM_EXPORT CUresult cuMemcpyWithAttributesAsync(CUdeviceptr dst, CUdeviceptr src, size_t size, CUmemcpyAttributes *attr,
                                                CUstream hStream)
{
    size_t first = 0;
    return copy_batch(&dst, &src, &size, 1, attr, &first, 1, NULL, hStream, 0, __func__);
}

/* ---- Memsets ---- */

static CUresult submit_set(CUdeviceptr dst, size_t pitch, size_t width, size_t height, unsigned int element_size,
                           uint32_t value, CUstream hStream, int synchronous, const char *api)
{
    SIM_ENTER();
    struct sim_ctx *ctx;
    struct sim_stream *stream;
    CUresult result = sim_stream_resolve(hStream, &ctx, &stream);
    if (result != CUDA_SUCCESS || width == 0 || height == 0)
        return result;
    size_t row_bytes = width * element_size;
    if (dst % element_size || (height > 1 && (pitch < row_bytes || pitch % element_size)))
        return CUDA_ERROR_INVALID_VALUE;
    enum sim_family family;
    size_t extent = sim_extent(row_bytes, height, 1, pitch, 0);
    if (!sim_mem_range_known((uintptr_t)dst, extent, &family) || sim_mem_vmm_refused((uintptr_t)dst, extent, ctx->device))
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_op *op = sim_op_new(SIM_OP_MEMSET, api);
    op->u.set = (struct sim_set){.dst = (uintptr_t)dst, .pitch = pitch, .width = width, .height = height,
                                 .element_size = element_size, .value = value};
    int wait = synchronous && (family == SIM_MEM_HOST || family == SIM_MEM_MANAGED);
    return sim_submit(ctx, stream, op, wait);
}

SIM_WITH_TWIN(cuMemsetD8_v2, cuMemsetD8_v2_ptds, (CUdeviceptr dstDevice, unsigned char uc, size_t N),
              return submit_set(dstDevice, N, N, 1, 1, uc, NULL, SYNC, __func__);)
SIM_WITH_TWIN(cuMemsetD16_v2, cuMemsetD16_v2_ptds, (CUdeviceptr dstDevice, unsigned short us, size_t N),
              return submit_set(dstDevice, 2 * N, N, 1, 2, us, NULL, SYNC, __func__);)
SIM_WITH_TWIN(cuMemsetD32_v2, cuMemsetD32_v2_ptds, (CUdeviceptr dstDevice, unsigned int ui, size_t N),
              return submit_set(dstDevice, 4 * N, N, 1, 4, ui, NULL, SYNC, __func__);)
SIM_WITH_TWIN(cuMemsetD2D8_v2, cuMemsetD2D8_v2_ptds,
              (CUdeviceptr dstDevice, size_t dstPitch, unsigned char uc, size_t Width, size_t Height),
              return submit_set(dstDevice, dstPitch, Width, Height, 1, uc, NULL, SYNC, __func__);)
SIM_WITH_TWIN(cuMemsetD2D16_v2, cuMemsetD2D16_v2_ptds,
              (CUdeviceptr dstDevice, size_t dstPitch, unsigned short us, size_t Width, size_t Height),
              return submit_set(dstDevice, dstPitch, Width, Height, 2, us, NULL, SYNC, __func__);)
SIM_WITH_TWIN(cuMemsetD2D32_v2, cuMemsetD2D32_v2_ptds,
              (CUdeviceptr dstDevice, size_t dstPitch, unsigned int ui, size_t Width, size_t Height),
              return submit_set(dstDevice, dstPitch, Width, Height, 4, ui, NULL, SYNC, __func__);)
SIM_WITH_TWIN(cuMemsetD8Async, cuMemsetD8Async_ptsz, (CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream),
              return submit_set(dstDevice, N, N, 1, 1, uc, hStream, ASYNC, __func__);)
SIM_WITH_TWIN(cuMemsetD16Async, cuMemsetD16Async_ptsz,
              (CUdeviceptr dstDevice, unsigned short us, size_t N, CUstream hStream),
              return submit_set(dstDevice, 2 * N, N, 1, 2, us, hStream, ASYNC, __func__);)
SIM_WITH_TWIN(cuMemsetD32Async, cuMemsetD32Async_ptsz, (CUdeviceptr dstDevice, unsigned int ui, size_t N, CUstream hStream),
              return submit_set(dstDevice, 4 * N, N, 1, 4, ui, hStream, ASYNC, __func__);)
SIM_WITH_TWIN(cuMemsetD2D8Async, cuMemsetD2D8Async_ptsz,
              (CUdeviceptr dstDevice, size_t dstPitch, unsigned char uc, size_t Width, size_t Height, CUstream hStream),
              return submit_set(dstDevice, dstPitch, Width, Height, 1, uc, hStream, ASYNC, __func__);)
SIM_WITH_TWIN(cuMemsetD2D16Async, cuMemsetD2D16Async_ptsz,
              (CUdeviceptr dstDevice, size_t dstPitch, unsigned short us, size_t Width, size_t Height, CUstream hStream),
              return submit_set(dstDevice, dstPitch, Width, Height, 2, us, hStream, ASYNC, __func__);)
SIM_WITH_TWIN(cuMemsetD2D32Async, cuMemsetD2D32Async_ptsz,
              (CUdeviceptr dstDevice, size_t dstPitch, unsigned int ui, size_t Width, size_t Height, CUstream hStream),
              return submit_set(dstDevice, dstPitch, Width, Height, 4, ui, hStream, ASYNC, __func__);)

/* ---- Not simulated: CUDA arrays, 3D batches; unusable: the 32-bit ABI ---- */

SIM_NOT_SUPPORTED_WITH_TWIN(cuMemcpyDtoA_v2, cuMemcpyDtoA_v2_ptds,
                            (CUarray dstArray, size_t dstOffset, CUdeviceptr srcDevice, size_t ByteCount))
SIM_NOT_SUPPORTED_WITH_TWIN(cuMemcpyAtoD_v2, cuMemcpyAtoD_v2_ptds,
                            (CUdeviceptr dstDevice, CUarray srcArray, size_t srcOffset, size_t ByteCount))
SIM_NOT_SUPPORTED_WITH_TWIN(cuMemcpyHtoA_v2, cuMemcpyHtoA_v2_ptds,
                            (CUarray dstArray, size_t dstOffset, const void *srcHost, size_t ByteCount))
SIM_NOT_SUPPORTED_WITH_TWIN(cuMemcpyAtoH_v2, cuMemcpyAtoH_v2_ptds,
                            (void *dstHost, CUarray srcArray, size_t srcOffset, size_t ByteCount))
SIM_NOT_SUPPORTED_WITH_TWIN(cuMemcpyAtoA_v2, cuMemcpyAtoA_v2_ptds,
                            (CUarray dstArray, size_t dstOffset, CUarray srcArray, size_t srcOffset, size_t ByteCount))
SIM_NOT_SUPPORTED_WITH_TWIN(cuMemcpyHtoAAsync_v2, cuMemcpyHtoAAsync_v2_ptsz,
                            (CUarray dstArray, size_t dstOffset, const void *srcHost, size_t ByteCount, CUstream hStream))
SIM_NOT_SUPPORTED_WITH_TWIN(cuMemcpyAtoHAsync_v2, cuMemcpyAtoHAsync_v2_ptsz,
                            (void *dstHost, CUarray srcArray, size_t srcOffset, size_t ByteCount, CUstream hStream))
SIM_NOT_SUPPORTED_WITH_TWIN(cuMemcpy3DBatchAsync, cuMemcpy3DBatchAsync_ptsz,
                            (size_t numOps, CUDA_MEMCPY3D_BATCH_OP *opList, size_t *failIdx, unsigned long long flags,
                             CUstream hStream))
SIM_NOT_SUPPORTED_WITH_TWIN(cuMemcpy3DBatchAsync_v2, cuMemcpy3DBatchAsync_v2_ptsz,
                            (size_t numOps, CUDA_MEMCPY3D_BATCH_OP *opList, unsigned long long flags, CUstream hStream))

SIM_IGNORING_PARAMETERS(SIM_EXPORT CUresult cuMemcpy3DWithAttributesAsync(CUDA_MEMCPY3D_BATCH_OP *op,
                                                                          unsigned long long flags, CUstream hStream)
                        { SIM_ENTER(); return CUDA_ERROR_NOT_SUPPORTED; })

SIM_32BIT_ABI_ENTRY(cuMemcpyHtoD, (unsigned int dstDevice, const void *srcHost, unsigned int ByteCount))
SIM_32BIT_ABI_ENTRY(cuMemcpyDtoH, (void *dstHost, unsigned int srcDevice, unsigned int ByteCount))
SIM_32BIT_ABI_ENTRY(cuMemcpyDtoD, (unsigned int dstDevice, unsigned int srcDevice, unsigned int ByteCount))
SIM_32BIT_ABI_ENTRY(cuMemcpyDtoA, (CUarray dstArray, unsigned int dstOffset, unsigned int srcDevice, unsigned int ByteCount))
SIM_32BIT_ABI_ENTRY(cuMemcpyAtoD, (unsigned int dstDevice, CUarray srcArray, unsigned int srcOffset, unsigned int ByteCount))
SIM_32BIT_ABI_ENTRY(cuMemcpyHtoA, (CUarray dstArray, unsigned int dstOffset, const void *srcHost, unsigned int ByteCount))
SIM_32BIT_ABI_ENTRY(cuMemcpyAtoH, (void *dstHost, CUarray srcArray, unsigned int srcOffset, unsigned int ByteCount))
SIM_32BIT_ABI_ENTRY(cuMemcpyAtoA,
                    (CUarray dstArray, unsigned int dstOffset, CUarray srcArray, unsigned int srcOffset, unsigned int ByteCount))
SIM_32BIT_ABI_ENTRY(cuMemcpyHtoDAsync, (unsigned int dstDevice, const void *srcHost, unsigned int ByteCount, CUstream hStream))
SIM_32BIT_ABI_ENTRY(cuMemcpyDtoHAsync, (void *dstHost, unsigned int srcDevice, unsigned int ByteCount, CUstream hStream))
SIM_32BIT_ABI_ENTRY(cuMemcpyDtoDAsync, (unsigned int dstDevice, unsigned int srcDevice, unsigned int ByteCount, CUstream hStream))
SIM_32BIT_ABI_ENTRY(cuMemcpyHtoAAsync,
                    (CUarray dstArray, unsigned int dstOffset, const void *srcHost, unsigned int ByteCount, CUstream hStream))
SIM_32BIT_ABI_ENTRY(cuMemcpyAtoHAsync,
                    (void *dstHost, CUarray srcArray, unsigned int srcOffset, unsigned int ByteCount, CUstream hStream))
SIM_32BIT_ABI_ENTRY(cuMemcpy2D, (const void *pCopy))
SIM_32BIT_ABI_ENTRY(cuMemcpy2DUnaligned, (const void *pCopy))
SIM_32BIT_ABI_ENTRY(cuMemcpy2DAsync, (const void *pCopy, CUstream hStream))
SIM_32BIT_ABI_ENTRY(cuMemcpy3D, (const void *pCopy))
SIM_32BIT_ABI_ENTRY(cuMemcpy3DAsync, (const void *pCopy, CUstream hStream))
SIM_32BIT_ABI_ENTRY(cuMemsetD8, (unsigned int dstDevice, unsigned char uc, unsigned int N))
SIM_32BIT_ABI_ENTRY(cuMemsetD16, (unsigned int dstDevice, unsigned short us, unsigned int N))
SIM_32BIT_ABI_ENTRY(cuMemsetD32, (unsigned int dstDevice, unsigned int ui, unsigned int N))
SIM_32BIT_ABI_ENTRY(cuMemsetD2D8,
                    (unsigned int dstDevice, unsigned int dstPitch, unsigned char uc, unsigned int Width, unsigned int Height))
SIM_32BIT_ABI_ENTRY(cuMemsetD2D16,
                    (unsigned int dstDevice, unsigned int dstPitch, unsigned short us, unsigned int Width, unsigned int Height))
SIM_32BIT_ABI_ENTRY(cuMemsetD2D32,
                    (unsigned int dstDevice, unsigned int dstPitch, unsigned int ui, unsigned int Width, unsigned int Height))
