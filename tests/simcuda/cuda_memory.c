/*
 * Memory: every allocation family is host memory mapped with mmap, recorded in one address
 * registry (sorted by start address) so that pointer attributes, copies and kernels can tell
 * device, managed and pinned host memory apart and catch use after free.
 *
 * Accounting: device->used counts the non-managed device bytes this process holds (cuMemAlloc_v2,
 * cuMemAllocPitch_v2, pool allocations, cuMemCreate); allocations that would take it past
 * SIMCUDA_MEMORY fail with CUDA_ERROR_OUT_OF_MEMORY. Managed memory is never counted and never
 * fails for size: that is what nvshare relies on. cuMemGetInfo_v2 reports total - used.
 *
 * IPC: cuIpcGetMemHandle works on cuMemAlloc_v2/cuMemAllocPitch_v2 memory only. It moves the
 * allocation onto a memfd (same address, same contents) and the handle names that descriptor
 * as /proc/<pid>/fd/<fd>, which a process of the same user opens in cuIpcOpenMemHandle. Like
 * the real driver it refuses managed memory (and pool, VMM and host memory) with
 * CUDA_ERROR_INVALID_VALUE, and refuses (the same way) to open a handle in the process that
 * exported it.
 *
 * (Some 1,100 lines: the registry and the two dozen entry points that add to it, free from it or
 * read it: the allocation families, stream-ordered pools, IPC, managed-memory hints and pointer
 * attributes. The first three share the registry's private release path, which also settles the
 * device's count and each pool's; the last two read what those allocations recorded. cuda_vmm.c
 * reaches the registry through simcuda.h.)
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "simcuda.h"

/* cuMemAllocPitch_v2 rounds rows up to this many bytes. */
#define PITCH_ALIGNMENT 512

struct sim_pool {
    enum sim_magic magic;
    struct sim_device *device;
    int is_default;
    /* Guarded by the registry lock. */
    int destroyed;                /* cuMemPoolDestroy came while allocations were outstanding */
    size_t outstanding;           /* live allocations */
    size_t used, used_high;       /* bytes */
    int reuse[3];                 /* CU_MEMPOOL_ATTR_REUSE_* */
    cuuint64_t release_threshold;
};

/* The registry, guarded by registry_lock. Writers are preferred so that a stream of kernel
 * executions (readers) cannot starve an allocation. */
static pthread_rwlock_t registry_lock = PTHREAD_RWLOCK_WRITER_NONRECURSIVE_INITIALIZER_NP;
static struct sim_alloc **registry;
static size_t registry_count, registry_capacity;

void sim_mem_read_lock(void)
{
    pthread_rwlock_rdlock(&registry_lock);
}

void sim_mem_write_lock(void)
{
    pthread_rwlock_wrlock(&registry_lock);
}

void sim_mem_unlock(void)
{
    pthread_rwlock_unlock(&registry_lock);
}

/* Index of the last allocation starting at or below `ptr`, or -1. */
static ptrdiff_t registry_floor(uintptr_t ptr)
{
    ptrdiff_t low = 0, high = (ptrdiff_t)registry_count - 1, found = -1;
    while (low <= high) {
        ptrdiff_t middle = low + (high - low) / 2;
        if (registry[middle]->start <= ptr) {
            found = middle;
            low = middle + 1;
        } else {
            high = middle - 1;
        }
    }
    return found;
}

struct sim_alloc *sim_mem_find_range(uintptr_t ptr, size_t bytes)
{
    ptrdiff_t index = registry_floor(ptr);
    if (index < 0)
        return NULL;
    struct sim_alloc *alloc = registry[index];
    size_t offset = ptr - alloc->start;
    if (offset >= alloc->size || bytes > alloc->size - offset)
        return NULL;
    return alloc;
}

/* With the lock held: the allocation starting at `ptr`, or NULL. */
static struct sim_alloc *sim_mem_find_start(uintptr_t ptr)
{
    ptrdiff_t index = registry_floor(ptr);
    return index >= 0 && registry[index]->start == ptr ? registry[index] : NULL;
}

/* With the lock held: the allocation holding [ptr, ptr + bytes), or, for VMM memory, the first of
 * the mappings that lie next to each other over the whole range (a GPU sees one address range
 * where the application mapped several handles side by side, as PyTorch's expandable segments
 * do); NULL when the range is not covered. `*access`: the devices that may access all of it. */
static struct sim_alloc *find_span(uintptr_t ptr, size_t bytes, uint64_t *access)
{
    struct sim_alloc *first = sim_mem_find_range(ptr, bytes ? bytes : 1);
    if (first) {
        *access = first->access;
        return first;
    }
    first = sim_mem_find_range(ptr, 1);
    if (!first || first->family != SIM_MEM_VMM)
        return NULL;
    *access = SIM_ACCESS_ALL;
    for (struct sim_alloc *alloc = first;;) {
        *access &= alloc->access;
        uintptr_t end = alloc->start + alloc->size;
        if (end - ptr >= bytes)
            return first;
        alloc = sim_mem_find_range(end, 1);
        if (!alloc || alloc->family != SIM_MEM_VMM)
            return NULL;
    }
}

static int may_access(uint64_t access, const struct sim_device *device)
{
    return device ? (access >> device->ordinal) & 1 : access != 0;
}

int sim_mem_range_ok(uintptr_t ptr, size_t bytes, const struct sim_device *device)
{
    uint64_t access;
    return find_span(ptr, bytes, &access) != NULL && may_access(access, device);
}

int sim_mem_overlaps(uintptr_t ptr, size_t bytes)
{
    ptrdiff_t index = registry_floor(ptr + bytes - 1);
    return index >= 0 && registry[index]->start + registry[index]->size > ptr;
}

int sim_mem_range_known(uintptr_t ptr, size_t bytes, enum sim_family *family)
{
    sim_mem_read_lock();
    uint64_t access;
    struct sim_alloc *alloc = find_span(ptr, bytes, &access);
    if (alloc && family)
        *family = alloc->family;
    sim_mem_unlock();
    return alloc != NULL;
}

int sim_mem_vmm_refused(uintptr_t ptr, size_t bytes, const struct sim_device *device)
{
    sim_mem_read_lock();
    uint64_t access;
    struct sim_alloc *alloc = find_span(ptr, bytes, &access);
    int refused = alloc && alloc->family == SIM_MEM_VMM && !may_access(access, device);
    sim_mem_unlock();
    return refused;
}

struct sim_alloc *sim_mem_add(const struct sim_alloc *prototype)
{
    if (registry_count == registry_capacity) {
        size_t capacity = registry_capacity ? 2 * registry_capacity : 64;
        struct sim_alloc **grown = realloc(registry, capacity * sizeof *grown);
        if (!grown)
            return NULL;
        registry = grown;
        registry_capacity = capacity;
    }
    struct sim_alloc *alloc = malloc(sizeof *alloc);
    if (!alloc)
        return NULL;
    *alloc = *prototype;
    size_t index = (size_t)(registry_floor(alloc->start) + 1);
    memmove(&registry[index + 1], &registry[index], (registry_count - index) * sizeof *registry);
    registry[index] = alloc;
    registry_count++;
    return alloc;
}

void sim_mem_remove(struct sim_alloc *alloc)
{
    ptrdiff_t index = registry_floor(alloc->start);
    memmove(&registry[index], &registry[index + 1], (registry_count - (size_t)index - 1) * sizeof *registry);
    registry_count--;
    free(alloc);
}

int sim_mem_charge(struct sim_device *device, size_t bytes)
{
    if (bytes > device->total - device->used)
        return -1;
    device->used += bytes;
    return 0;
}

void sim_mem_uncharge(struct sim_device *device, size_t bytes)
{
    device->used -= bytes;
}

/* Read-write anonymous memory that costs nothing until touched, or NULL. */
static void *sim_mem_map(size_t bytes)
{
    void *memory = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return memory == MAP_FAILED ? NULL : memory;
}

static void pool_release(struct sim_pool *pool, size_t bytes)
{
    pool->used -= bytes;
    if (--pool->outstanding == 0 && pool->destroyed) {
        pool->magic = SIM_MAGIC_DEAD;
        free(pool);
    }
}

/* Unmaps and forgets an allocation of any family but VMM (registry write-locked). Registered
 * host memory is the application's: it stays mapped. */
static void release(struct sim_alloc *alloc)
{
    if (alloc->family == SIM_MEM_HOST)
        sim_unpin_trace(alloc->ctx, alloc->start, alloc->size, alloc->registered ? SIM_PIN_REGISTERED : SIM_PIN_ALLOCATED);
    if (alloc->family == SIM_MEM_MANAGED)
        sim_residency_forget(alloc);
    else
        sim_residency_unfix(alloc->device, (uint64_t)alloc->start, alloc->size, &alloc->chunks);
    if (!alloc->registered)
        munmap((void *)alloc->start, alloc->size);
    if (alloc->shared_fd >= 0)
        close(alloc->shared_fd);
    if (alloc->charged)
        sim_mem_uncharge(alloc->device, alloc->charged);
    if (alloc->pool)
        pool_release(alloc->pool, alloc->size);
    sim_mem_remove(alloc);
}

/* Writes *out only on success. */
static CUresult allocate(struct sim_ctx *ctx, size_t bytes, enum sim_family family, struct sim_pool *pool,
                         CUdeviceptr *out)
{
    if (bytes == 0)
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_device *device = pool ? pool->device : ctx->device;
    int charged = family == SIM_MEM_DEVICE || family == SIM_MEM_POOL;
    CUresult result = CUDA_ERROR_OUT_OF_MEMORY;
    sim_mem_write_lock();
    if (charged && sim_mem_charge(device, bytes) != 0)
        goto out;
    void *memory = sim_mem_map(bytes);
    if (!memory)
        goto uncharge;
    struct sim_alloc prototype = {
        .start = (uintptr_t)memory, .size = bytes, .family = family, .device = device, .ctx = ctx,
        .pool = pool, .charged = charged ? bytes : 0, .access = SIM_ACCESS_ALL, .shared_fd = -1,
    };
    struct sim_alloc *alloc = sim_mem_add(&prototype);
    if (!alloc) {
        munmap(memory, bytes);
        goto uncharge;
    }
    if (sim_residency_adopt(alloc) != 0) {
        release(alloc);
        goto out;
    }
    if (pool) {
        pool->outstanding++;
        pool->used += bytes;
        if (pool->used > pool->used_high)
            pool->used_high = pool->used;
    }
    sim_mem_unlock();
    /* Physical device memory takes its place on the modelled device (evicting managed chunks,
     * which this thread pays for); a device full of physical memory refuses it. */
    result = charged ? sim_residency_fix(device, (uint64_t)alloc->start, bytes, &alloc->chunks) : CUDA_SUCCESS;
    if (result != CUDA_SUCCESS) {
        sim_mem_write_lock();
        release(alloc);
        sim_mem_unlock();
        return result;
    }
    if (family == SIM_MEM_HOST)
        sim_pin_cost(ctx, memory, bytes, SIM_PIN_ALLOCATED);
    *out = (CUdeviceptr)(uintptr_t)memory;
    return CUDA_SUCCESS;
uncharge:
    if (charged)
        sim_mem_uncharge(device, bytes);
out:
    sim_mem_unlock();
    return result;
}

/* An allocation of the calling thread's current context. */
static CUresult allocate_in_current(size_t bytes, enum sim_family family, CUdeviceptr *out)
{
    struct sim_ctx *ctx;
    CUresult result = sim_ctx_require(&ctx);
    return result != CUDA_SUCCESS ? result : allocate(ctx, bytes, family, NULL, out);
}

SIM_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    SIM_ENTER();
    return dptr ? allocate_in_current(bytesize, SIM_MEM_DEVICE, dptr) : CUDA_ERROR_INVALID_VALUE;
}

SIM_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                                       unsigned int ElementSizeBytes)
{
    SIM_ENTER();
    if (!dptr || !pPitch || WidthInBytes == 0 || Height == 0 ||
        (ElementSizeBytes != 4 && ElementSizeBytes != 8 && ElementSizeBytes != 16))
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_ctx *ctx;
    CUresult result = sim_ctx_require(&ctx);
    if (result != CUDA_SUCCESS)
        return result;
    if (WidthInBytes > SIZE_MAX - PITCH_ALIGNMENT)
        return CUDA_ERROR_OUT_OF_MEMORY;
    size_t pitch = (WidthInBytes + PITCH_ALIGNMENT - 1) / PITCH_ALIGNMENT * PITCH_ALIGNMENT;
    if (Height > SIZE_MAX / pitch)
        return CUDA_ERROR_OUT_OF_MEMORY;
    result = allocate(ctx, pitch * Height, SIM_MEM_DEVICE, NULL, dptr);
    if (result == CUDA_SUCCESS)
        *pPitch = pitch;
    return result;
}

SIM_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    SIM_ENTER();
    if (!dptr || (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST))
        return CUDA_ERROR_INVALID_VALUE;
    return allocate_in_current(bytesize, SIM_MEM_MANAGED, dptr);
}

SIM_EXPORT CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags)
{
    SIM_ENTER();
    if (!pp ||
        (Flags & ~(unsigned int)(CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_WRITECOMBINED)))
        return CUDA_ERROR_INVALID_VALUE;
    CUdeviceptr address;
    CUresult result = allocate_in_current(bytesize, SIM_MEM_HOST, &address);
    if (result == CUDA_SUCCESS)
        *pp = (void *)(uintptr_t)address;
    return result;
}

SIM_EXPORT CUresult cuMemAllocHost_v2(void **pp, size_t bytesize)
{
    return cuMemHostAlloc(pp, bytesize, 0);
}

/* SIMCUDA_HOST_REGISTER_ERROR: the error every cuMemHostRegister answers, as a driver that
 * refuses to register memory would (0: none). Written by cuInit (under its pthread_once). */
static CUresult host_register_error;

CUresult sim_mem_open(void)
{
    const char *text = getenv("SIMCUDA_HOST_REGISTER_ERROR");
    if (!text)
        return CUDA_SUCCESS;
    char *end;
    long value = strtol(text, &end, 10);
    if (end == text || *end || value < 1 || value > 999) {
        fprintf(stderr, "simcuda: SIMCUDA_HOST_REGISTER_ERROR=%s is not a CUDA error number from 1 to 999\n", text);
        return CUDA_ERROR_INVALID_VALUE;
    }
    host_register_error = (CUresult)value;
    return CUDA_SUCCESS;
}

/* Pins the application's own memory: it becomes pinned host memory to copies (and pays for the
 * pinning, at the registering rate), and stays the application's to unmap after
 * cuMemHostUnregister. */
SIM_EXPORT CUresult cuMemHostRegister_v2(void *p, size_t bytesize, unsigned int Flags)
{
    SIM_ENTER();
    if (!p || bytesize == 0 ||
        (Flags & ~(unsigned int)(CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP)))
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_ctx *ctx;
    CUresult result = sim_ctx_require(&ctx);
    if (result != CUDA_SUCCESS)
        return result;
    if (host_register_error != CUDA_SUCCESS)
        return host_register_error;
    struct sim_alloc prototype = {
        .start = (uintptr_t)p, .size = bytesize, .family = SIM_MEM_HOST, .device = ctx->device, .ctx = ctx,
        .access = SIM_ACCESS_ALL, .shared_fd = -1, .registered = 1,
    };
    sim_mem_write_lock();
    /* Overlapping what the driver already knows (registered or allocated) is refused. */
    if (sim_mem_overlaps((uintptr_t)p, bytesize))
        result = CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
    else if (!sim_mem_add(&prototype))
        result = CUDA_ERROR_OUT_OF_MEMORY;
    sim_mem_unlock();
    if (result == CUDA_SUCCESS)
        sim_pin_cost(ctx, p, bytesize, SIM_PIN_REGISTERED);
    return result;
}

SIM_EXPORT CUresult cuMemHostUnregister(void *p)
{
    SIM_ENTER();
    sim_mem_write_lock();
    struct sim_alloc *alloc = sim_mem_find_start((uintptr_t)p);
    CUresult result = alloc && alloc->registered ? CUDA_SUCCESS : CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
    if (result == CUDA_SUCCESS)
        release(alloc);
    sim_mem_unlock();
    return result;
}

#define FAMILY(family) (1u << (family))

/* With the lock held: the allocation starting at `ptr` if it is one of `families` and no
 * stream-ordered free of it is queued, else NULL. */
static struct sim_alloc *find_freeable(uintptr_t ptr, unsigned int families)
{
    struct sim_alloc *alloc = sim_mem_find_start(ptr);
    return alloc && !alloc->free_queued && (families & FAMILY(alloc->family)) ? alloc : NULL;
}

/* Frees the allocation starting at `ptr` if its family is in `families`. Like cuMemFree and
 * cuMemFreeHost, it first waits for the owning context's queued work, so that no queued
 * operation can touch the memory afterwards. */
static CUresult free_now(uintptr_t ptr, unsigned int families)
{
    struct sim_ctx *current;
    CUresult result = sim_ctx_require(&current);
    if (result != CUDA_SUCCESS)
        return result;
    sim_mem_read_lock();
    struct sim_alloc *alloc = find_freeable(ptr, families);
    struct sim_ctx *owner = alloc ? alloc->ctx : NULL;
    sim_mem_unlock();
    if (!alloc)
        return CUDA_ERROR_INVALID_VALUE;
    sim_drain(owner);
    sim_mem_write_lock();
    /* Another thread may have freed it meanwhile, or queued a stream-ordered free of it, which
     * is then the free that counts: releasing it here too would free it twice. */
    alloc = find_freeable(ptr, families);
    if (alloc && alloc->ctx == owner)
        release(alloc);
    else
        result = CUDA_ERROR_INVALID_VALUE;
    sim_mem_unlock();
    return result;
}

/* Freeing NULL succeeds, as measured for both. */
SIM_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    SIM_ENTER();
    return dptr ? free_now((uintptr_t)dptr, FAMILY(SIM_MEM_DEVICE) | FAMILY(SIM_MEM_POOL) | FAMILY(SIM_MEM_MANAGED))
                : CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemFreeHost(void *p)
{
    SIM_ENTER();
    return p ? free_now((uintptr_t)p, FAMILY(SIM_MEM_HOST)) : CUDA_SUCCESS;
}

void sim_mem_release_ctx(struct sim_ctx *ctx)
{
    sim_mem_write_lock();
    for (size_t i = registry_count; i-- > 0;)
        if (registry[i]->ctx == ctx)
            release(registry[i]);
    sim_mem_unlock();
}

void sim_mem_for_each_managed(const struct sim_device *device, void (*fn)(struct sim_alloc *, void *), void *argument)
{
    for (size_t i = 0; i < registry_count; i++)
        if (registry[i]->family == SIM_MEM_MANAGED && registry[i]->device == device)
            fn(registry[i], argument);
}

SIM_EXPORT CUresult cuMemGetInfo_v2(size_t *free, size_t *total)
{
    SIM_ENTER();
    if (!free || !total)
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_ctx *ctx;
    CUresult result = sim_ctx_require(&ctx);
    if (result != CUDA_SUCCESS)
        return result;
    sim_mem_read_lock();
    *total = ctx->device->total;
    *free = ctx->device->total - ctx->device->used;
    sim_mem_unlock();
    return CUDA_SUCCESS;
}

/* ---- Stream-ordered allocation ---- */

struct sim_pool *sim_pool_new(struct sim_device *device, int is_default)
{
    struct sim_pool *pool = sim_calloc(1, sizeof *pool);
    pool->magic = SIM_MAGIC_POOL;
    pool->device = device;
    pool->is_default = is_default;
    pool->reuse[0] = pool->reuse[1] = pool->reuse[2] = 1;
    return pool;
}

static CUresult check_pool(CUmemoryPool handle, struct sim_pool **out)
{
    struct sim_pool *pool = (struct sim_pool *)handle;
    if (!pool || pool->magic != SIM_MAGIC_POOL || pool->destroyed)
        return CUDA_ERROR_INVALID_VALUE;
    *out = pool;
    return CUDA_SUCCESS;
}

static CUresult allocate_async(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool handle, CUstream hStream)
{
    SIM_ENTER();
    if (!dptr)
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_ctx *ctx;
    struct sim_stream *stream;
    CUresult result = sim_stream_resolve(hStream, &ctx, &stream);
    if (result != CUDA_SUCCESS)
        return result;
    struct sim_pool *pool = ctx->device->default_pool;
    if (handle && check_pool(handle, &pool) != CUDA_SUCCESS)
        return CUDA_ERROR_INVALID_VALUE;
    if (sim_stream_capturing(stream)) /* graph memory nodes are not simulated */
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    return allocate(ctx, bytesize, SIM_MEM_POOL, pool, dptr);
}

SIM_WITH_TWIN(cuMemAllocAsync, cuMemAllocAsync_ptsz, (CUdeviceptr *dptr, size_t bytesize, CUstream hStream),
              return allocate_async(dptr, bytesize, NULL, hStream);)
SIM_WITH_TWIN(cuMemAllocFromPoolAsync, cuMemAllocFromPoolAsync_ptsz,
              (CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream),
              return pool ? allocate_async(dptr, bytesize, pool, hStream) : CUDA_ERROR_INVALID_VALUE;)

/* Frees device or pool memory once the stream reaches this point. Managed memory cannot be freed
 * in stream order: CUDA_ERROR_NOT_SUPPORTED, as measured. */
static CUresult free_async(CUdeviceptr dptr, CUstream hStream, const char *api)
{
    SIM_ENTER();
    struct sim_ctx *ctx;
    struct sim_stream *stream;
    CUresult result = sim_stream_resolve(hStream, &ctx, &stream);
    if (result != CUDA_SUCCESS)
        return result;
    if (sim_stream_capturing(stream))
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    sim_mem_write_lock();
    struct sim_alloc *alloc = sim_mem_find_start((uintptr_t)dptr);
    if (alloc && alloc->family == SIM_MEM_MANAGED)
        result = CUDA_ERROR_NOT_SUPPORTED;
    else if (!alloc || alloc->free_queued || (alloc->family != SIM_MEM_DEVICE && alloc->family != SIM_MEM_POOL))
        result = CUDA_ERROR_INVALID_VALUE;
    else
        alloc->free_queued = 1; /* a second free of the same pointer is an error from now on */
    sim_mem_unlock();
    if (result != CUDA_SUCCESS)
        return result;
    struct sim_op *op = sim_op_new(SIM_OP_FREE, api);
    op->u.free_ptr = (uintptr_t)dptr;
    return sim_submit(ctx, stream, op, 0);
}

SIM_WITH_TWIN(cuMemFreeAsync, cuMemFreeAsync_ptsz, (CUdeviceptr dptr, CUstream hStream),
              return free_async(dptr, hStream, __func__);)

void sim_mem_free_now(uintptr_t ptr)
{
    sim_mem_write_lock();
    struct sim_alloc *alloc = sim_mem_find_start(ptr);
    if (alloc)
        release(alloc);
    sim_mem_unlock();
}

SIM_EXPORT CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool_out, CUdevice dev)
{
    SIM_ENTER();
    if (!pool_out)
        return CUDA_ERROR_INVALID_VALUE;
    SIM_REQUIRE_DEVICE(dev, device);
    *pool_out = (CUmemoryPool)device->default_pool;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool_out, const CUmemPoolProps *poolProps)
{
    SIM_ENTER();
    if (!pool_out || !poolProps || poolProps->allocType != CU_MEM_ALLOCATION_TYPE_PINNED ||
        poolProps->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    SIM_REQUIRE_DEVICE(poolProps->location.id, device);
    *pool_out = (CUmemoryPool)sim_pool_new(device, 0);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemPoolDestroy(CUmemoryPool handle)
{
    SIM_ENTER();
    struct sim_pool *pool;
    if (check_pool(handle, &pool) != CUDA_SUCCESS || pool->is_default)
        return CUDA_ERROR_INVALID_VALUE;
    sim_mem_write_lock();
    /* Outstanding allocations stay valid; the pool goes with the last of them. */
    pool->destroyed = 1;
    if (pool->outstanding == 0) {
        pool->magic = SIM_MAGIC_DEAD;
        free(pool);
    }
    sim_mem_unlock();
    return CUDA_SUCCESS;
}

/* Freed pool memory goes straight back to the device here, so there is never anything to trim. */
SIM_EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool handle, size_t minBytesToKeep)
{
    (void)minBytesToKeep;
    SIM_ENTER();
    struct sim_pool *pool;
    return check_pool(handle, &pool);
}

SIM_EXPORT CUresult cuMemPoolSetAttribute(CUmemoryPool handle, CUmemPool_attribute attr, void *value)
{
    SIM_ENTER();
    struct sim_pool *pool;
    if (check_pool(handle, &pool) != CUDA_SUCCESS || !value)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult result = CUDA_SUCCESS;
    sim_mem_write_lock();
    switch (attr) {
    case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES:
        pool->reuse[attr - CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES] = *(int *)value != 0;
        break;
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD:
        pool->release_threshold = *(cuuint64_t *)value;
        break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH: /* only a reset to 0 is allowed */
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH:
        if (*(cuuint64_t *)value != 0)
            result = CUDA_ERROR_INVALID_VALUE;
        else
            pool->used_high = pool->used;
        break;
    default:
        result = CUDA_ERROR_INVALID_VALUE;
        break;
    }
    sim_mem_unlock();
    return result;
}

SIM_EXPORT CUresult cuMemPoolGetAttribute(CUmemoryPool handle, CUmemPool_attribute attr, void *value)
{
    SIM_ENTER();
    struct sim_pool *pool;
    if (check_pool(handle, &pool) != CUDA_SUCCESS || !value)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult result = CUDA_SUCCESS;
    sim_mem_read_lock();
    switch (attr) {
    case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES:
        *(int *)value = pool->reuse[attr - CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES];
        break;
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD:
        *(cuuint64_t *)value = pool->release_threshold;
        break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: /* nothing is kept in reserve */
    case CU_MEMPOOL_ATTR_USED_MEM_CURRENT:
        *(cuuint64_t *)value = pool->used;
        break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH:
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH:
        *(cuuint64_t *)value = pool->used_high;
        break;
    default:
        result = CUDA_ERROR_INVALID_VALUE;
        break;
    }
    sim_mem_unlock();
    return result;
}

/* ---- Managed memory hints ---- */

/* Whether [ptr, ptr + count) is managed memory. */
static int is_managed_range(CUdeviceptr ptr, size_t count)
{
    enum sim_family family;
    return sim_mem_range_known((uintptr_t)ptr, count ? count : 1, &family) && family == SIM_MEM_MANAGED;
}

static int valid_location(CUmemLocation location)
{
    switch (location.type) {
    case CU_MEM_LOCATION_TYPE_DEVICE:
        return sim_device_get(location.id) != NULL;
    case CU_MEM_LOCATION_TYPE_HOST:
    case CU_MEM_LOCATION_TYPE_HOST_NUMA:
    case CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT:
        return 1;
    default:
        return 0;
    }
}

static CUmemLocation device_location(CUdevice device)
{
    CUmemLocation location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = device};
    if (device == CU_DEVICE_CPU)
        location.type = CU_MEM_LOCATION_TYPE_HOST;
    return location;
}

/* A traced operation on the stream; it moves chunks when residency is modelled. `discard`: the
 * range's contents are discarded first and nothing is copied. */
static CUresult prefetch(CUdeviceptr devPtr, size_t count, CUmemLocation location, int discard, size_t range,
                         CUstream hStream, const char *api)
{
    SIM_ENTER();
    if (!valid_location(location))
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_ctx *ctx;
    struct sim_stream *stream;
    CUresult result = sim_stream_resolve(hStream, &ctx, &stream);
    if (result != CUDA_SUCCESS)
        return result;
    if (!is_managed_range(devPtr, count))
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_op *op = sim_op_new(SIM_OP_PREFETCH, api);
    op->u.prefetch.ptr = (uintptr_t)devPtr;
    op->u.prefetch.bytes = count;
    op->u.prefetch.target = location.type == CU_MEM_LOCATION_TYPE_DEVICE ? sim_device_get(location.id) : NULL;
    op->u.prefetch.discard = discard;
    op->u.prefetch.range = range;
    struct sim_device *target = op->u.prefetch.target;
    if (target && !discard && sim_residency_prefetch_in_call() && sim_residency_models(target)) {
        /* The migration made by the calling thread, as a driver may do it inside the call: the
         * stream gets nothing, so a synchronise finds no work while the call still runs. */
        sim_engine_enter(target);
        sim_residency_touch(ctx, op);
        sim_engine_leave(target);
        sim_op_free(op);
        return CUDA_SUCCESS;
    }
    return sim_submit(ctx, stream, op, 0);
}

SIM_WITH_TWIN(cuMemPrefetchAsync, cuMemPrefetchAsync_ptsz,
              (CUdeviceptr devPtr, size_t count, CUdevice dstDevice, CUstream hStream),
              return prefetch(devPtr, count, device_location(dstDevice), 0, 0, hStream, __func__);)
SIM_WITH_TWIN(cuMemPrefetchAsync_v2, cuMemPrefetchAsync_v2_ptsz,
              (CUdeviceptr devPtr, size_t count, CUmemLocation location, unsigned int flags, CUstream hStream),
              return flags != 0 ? CUDA_ERROR_INVALID_VALUE : prefetch(devPtr, count, location, 0, 0, hStream, __func__);)

/* Range i goes to prefetchLocs[j], j the last index with prefetchLocIdxs[j] <= i (the first is 0),
 * as batch copies pick their attributes. With `discard`, the ranges' contents are discarded first
 * and nothing is copied (cuMemDiscardAndPrefetchBatchAsync): the pages are made where they go. */
static CUresult prefetch_batch(CUdeviceptr *dptrs, size_t *sizes, size_t count, CUmemLocation *locations,
                               size_t *location_indices, size_t n_locations, unsigned long long flags, CUstream hStream,
                               int discard, const char *api)
{
    SIM_ENTER();
    if (!dptrs || !sizes || count == 0 || !locations || !location_indices || n_locations == 0 || n_locations > count ||
        location_indices[0] != 0 || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult result = CUDA_SUCCESS;
    for (size_t i = 0, j = 0; i < count && result == CUDA_SUCCESS; i++) {
        while (j + 1 < n_locations && location_indices[j + 1] <= i)
            j++;
        result = prefetch(dptrs[i], sizes[i], locations[j], discard, i, hStream, api);
    }
    return result;
}

/* Checks a batch of ranges to discard: every one managed memory. */
static CUresult check_discard(CUdeviceptr *dptrs, size_t *sizes, size_t count, unsigned long long flags,
                              CUstream hStream, struct sim_ctx **ctx, struct sim_stream **stream)
{
    SIM_ENTER();
    if (!dptrs || !sizes || count == 0 || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult result = sim_stream_resolve(hStream, ctx, stream);
    for (size_t i = 0; i < count && result == CUDA_SUCCESS; i++)
        if (!is_managed_range(dptrs[i], sizes[i]))
            result = CUDA_ERROR_INVALID_VALUE;
    return result;
}

/* One traced discard per range, in stream order: the process's chunks there leave the device
 * without being moved, and the contents become indeterminate (cuda_residency.c). */
static CUresult discard_batch(CUdeviceptr *dptrs, size_t *sizes, size_t count, unsigned long long flags,
                              CUstream hStream, const char *api)
{
    struct sim_ctx *ctx;
    struct sim_stream *stream;
    CUresult result = check_discard(dptrs, sizes, count, flags, hStream, &ctx, &stream);
    for (size_t i = 0; i < count && result == CUDA_SUCCESS; i++) {
        struct sim_op *op = sim_op_new(SIM_OP_DISCARD, api);
        op->u.prefetch.ptr = (uintptr_t)dptrs[i];
        op->u.prefetch.bytes = sizes[i];
        op->u.prefetch.range = i;
        result = sim_submit(ctx, stream, op, 0);
    }
    return result;
}

#define SIM_PREFETCH_BATCH_PARAMS                                                                 \
    (CUdeviceptr *dptrs, size_t *sizes, size_t count, CUmemLocation *prefetchLocs, size_t *prefetchLocIdxs, \
     size_t numPrefetchLocs, unsigned long long flags, CUstream hStream)
SIM_WITH_TWIN(cuMemPrefetchBatchAsync, cuMemPrefetchBatchAsync_ptsz, SIM_PREFETCH_BATCH_PARAMS,
              return prefetch_batch(dptrs, sizes, count, prefetchLocs, prefetchLocIdxs, numPrefetchLocs, flags, hStream,
                                    0, __func__);)
SIM_WITH_TWIN(cuMemDiscardAndPrefetchBatchAsync, cuMemDiscardAndPrefetchBatchAsync_ptsz, SIM_PREFETCH_BATCH_PARAMS,
              struct sim_ctx *ctx; struct sim_stream *stream;
              CUresult result = check_discard(dptrs, sizes, count, flags, hStream, &ctx, &stream);
              if (result != CUDA_SUCCESS) return result;
              return prefetch_batch(dptrs, sizes, count, prefetchLocs, prefetchLocIdxs, numPrefetchLocs, flags, hStream,
                                    1, __func__);)
#undef SIM_PREFETCH_BATCH_PARAMS
SIM_WITH_TWIN(cuMemDiscardBatchAsync, cuMemDiscardBatchAsync_ptsz,
              (CUdeviceptr *dptrs, size_t *sizes, size_t count, unsigned long long flags, CUstream hStream),
              return discard_batch(dptrs, sizes, count, flags, hStream, __func__);)

static const char *const advice_names[] = {
    [CU_MEM_ADVISE_SET_READ_MOSTLY] = "set_read_mostly",
    [CU_MEM_ADVISE_UNSET_READ_MOSTLY] = "unset_read_mostly",
    [CU_MEM_ADVISE_SET_PREFERRED_LOCATION] = "set_preferred_location",
    [CU_MEM_ADVISE_UNSET_PREFERRED_LOCATION] = "unset_preferred_location",
    [CU_MEM_ADVISE_SET_ACCESSED_BY] = "set_accessed_by",
    [CU_MEM_ADVISE_UNSET_ACCESSED_BY] = "unset_accessed_by",
};

/* Advice is a hint: it is checked and traced (so tests see who advised what), and changes
 * nothing in the simulation, residency included. */
static CUresult advise(CUdeviceptr devPtr, size_t count, CUmem_advise advice, CUmemLocation location)
{
    SIM_ENTER();
    if (advice < CU_MEM_ADVISE_SET_READ_MOSTLY || advice > CU_MEM_ADVISE_UNSET_ACCESSED_BY ||
        !valid_location(location) || !is_managed_range(devPtr, count))
        return CUDA_ERROR_INVALID_VALUE;
    sim_mem_read_lock();
    struct sim_alloc *alloc = sim_mem_find_range((uintptr_t)devPtr, count ? count : 1);
    char fields[256];
    snprintf(fields, sizeof fields,
             "\"op\": \"advise\", \"advice\": \"%s\", \"location\": \"%s\", \"location_id\": %d, "
             "\"ptr\": %llu, \"bytes\": %zu",
             advice_names[advice], location.type == CU_MEM_LOCATION_TYPE_DEVICE ? "device" : "host", location.id,
             (unsigned long long)devPtr, count);
    double now = sim_now();
    if (alloc)
        sim_trace_write(alloc->ctx, fields, now, now);
    sim_mem_unlock();
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemAdvise(CUdeviceptr devPtr, size_t count, CUmem_advise advice, CUdevice device)
{
    return advise(devPtr, count, advice, device_location(device));
}

SIM_EXPORT CUresult cuMemAdvise_v2(CUdeviceptr devPtr, size_t count, CUmem_advise advice, CUmemLocation location)
{
    return advise(devPtr, count, advice, location);
}

/* ---- Pointer attributes ---- */

/* Writes one attribute of `ptr` (in `alloc`, or in no allocation when NULL). Boolean attributes
 * are written as 32-bit unsigned integers. */
static CUresult pointer_attribute(const struct sim_alloc *alloc, CUpointer_attribute attribute, uintptr_t ptr,
                                  void *data)
{
    int host = alloc && alloc->family == SIM_MEM_HOST;
    switch (attribute) {
    case CU_POINTER_ATTRIBUTE_CONTEXT:
        /* Pool and VMM memory belongs to no context (measured). */
        *(CUcontext *)data = alloc && alloc->family != SIM_MEM_POOL && alloc->family != SIM_MEM_VMM
                                 ? (CUcontext)alloc->ctx
                                 : NULL;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
        /* Managed memory reports DEVICE, as with the real driver; IS_MANAGED tells it apart. */
        *(unsigned int *)data = !alloc ? 0 : host ? CU_MEMORYTYPE_HOST : CU_MEMORYTYPE_DEVICE;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER:
        *(CUdeviceptr *)data = alloc ? (CUdeviceptr)ptr : 0;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_HOST_POINTER: {
        int mapped = alloc && (host || alloc->family == SIM_MEM_MANAGED);
        *(void **)data = mapped ? (void *)ptr : NULL;
        /* Device memory has no host address: NULL, and an error from cuPointerGetAttribute. */
        return mapped || !alloc ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    }
    case CU_POINTER_ATTRIBUTE_IS_MANAGED:
        *(unsigned int *)data = alloc && alloc->family == SIM_MEM_MANAGED;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
        *(int *)data = alloc ? alloc->device->ordinal : -2;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE:
        *(unsigned int *)data = alloc && alloc->family == SIM_MEM_DEVICE;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
        *(CUdeviceptr *)data = alloc ? (CUdeviceptr)alloc->start : 0;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
        *(size_t *)data = alloc ? alloc->size : 0;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_MAPPED:
        *(unsigned int *)data = alloc != NULL;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE:
        *(CUmemoryPool *)data = alloc ? (CUmemoryPool)alloc->pool : NULL;
        return CUDA_SUCCESS;
    default:
        return CUDA_ERROR_INVALID_VALUE;
    }
}

SIM_EXPORT CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr)
{
    SIM_ENTER();
    if (!data)
        return CUDA_ERROR_INVALID_VALUE;
    sim_mem_read_lock();
    const struct sim_alloc *alloc = sim_mem_find_range((uintptr_t)ptr, 1);
    /* Memory the driver does not know is an error here (cuPointerGetAttributes reports it). */
    CUresult result = alloc ? pointer_attribute(alloc, attribute, (uintptr_t)ptr, data) : CUDA_ERROR_INVALID_VALUE;
    sim_mem_unlock();
    return result;
}

/* The allocation holding dptr (for VMM memory: the mapping). */
SIM_EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr)
{
    SIM_ENTER();
    sim_mem_read_lock();
    const struct sim_alloc *alloc = sim_mem_find_range((uintptr_t)dptr, 1);
    if (alloc && pbase)
        *pbase = (CUdeviceptr)alloc->start;
    if (alloc && psize)
        *psize = alloc->size;
    sim_mem_unlock();
    return alloc ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

SIM_EXPORT CUresult cuPointerGetAttributes(unsigned int numAttributes, CUpointer_attribute *attributes, void **data,
                                           CUdeviceptr ptr)
{
    SIM_ENTER();
    if (numAttributes == 0 || !attributes || !data)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult result = CUDA_SUCCESS;
    sim_mem_read_lock();
    const struct sim_alloc *alloc = sim_mem_find_range((uintptr_t)ptr, 1);
    for (unsigned int i = 0; i < numAttributes && result == CUDA_SUCCESS; i++) {
        if (!data[i])
            continue;
        result = pointer_attribute(alloc, attributes[i], (uintptr_t)ptr, data[i]);
        if (attributes[i] == CU_POINTER_ATTRIBUTE_HOST_POINTER)
            result = CUDA_SUCCESS; /* NULL for device memory, not an error here */
    }
    sim_mem_unlock();
    return result;
}

/* ---- IPC ---- */

struct ipc_handle {
    char magic[8];
    int32_t pid;
    int32_t fd;
    uint64_t size;
};
_Static_assert(sizeof(struct ipc_handle) <= CU_IPC_HANDLE_SIZE, "IPC handle too large");
static const char ipc_magic[8] = "simcuda";

/* Moves an allocation onto a memfd at the same address (registry write-locked). */
static CUresult share(struct sim_alloc *alloc)
{
    int fd = memfd_create("simcuda-ipc", MFD_CLOEXEC);
    if (fd < 0)
        return CUDA_ERROR_OPERATING_SYSTEM;
    void *staging = NULL;
    if (ftruncate(fd, (off_t)alloc->size) != 0 ||
        (staging = mmap(NULL, alloc->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) == MAP_FAILED) {
        close(fd);
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    memcpy(staging, (void *)alloc->start, alloc->size);
    munmap(staging, alloc->size);
    if (mmap((void *)alloc->start, alloc->size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED) {
        close(fd);
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    alloc->shared_fd = fd;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr)
{
    SIM_ENTER();
    if (!pHandle)
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_ctx *ctx;
    CUresult result = sim_ctx_require(&ctx);
    if (result != CUDA_SUCCESS)
        return result;
    sim_mem_write_lock();
    struct sim_alloc *alloc = sim_mem_find_range((uintptr_t)dptr, 1);
    if (!alloc || alloc->family != SIM_MEM_DEVICE)
        result = CUDA_ERROR_INVALID_VALUE;
    else if (alloc->shared_fd < 0)
        result = share(alloc);
    if (result == CUDA_SUCCESS) {
        struct ipc_handle handle = {.pid = (int32_t)getpid(), .fd = alloc->shared_fd, .size = alloc->size};
        memcpy(handle.magic, ipc_magic, sizeof handle.magic);
        memset(pHandle, 0, sizeof *pHandle);
        memcpy(pHandle->reserved, &handle, sizeof handle);
    }
    sim_mem_unlock();
    return result;
}

SIM_EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags)
{
    SIM_ENTER();
    if (!pdptr || (Flags & ~(unsigned int)CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS))
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_ctx *ctx;
    CUresult result = sim_ctx_require(&ctx);
    if (result != CUDA_SUCCESS)
        return result;
    struct ipc_handle exported;
    memcpy(&exported, handle.reserved, sizeof exported);
    if (memcmp(exported.magic, ipc_magic, sizeof exported.magic) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (exported.pid == (int32_t)getpid())
        return CUDA_ERROR_INVALID_VALUE;
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)exported.pid, (int)exported.fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return CUDA_ERROR_INVALID_VALUE;
    void *memory = mmap(NULL, (size_t)exported.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (memory == MAP_FAILED)
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_alloc prototype = {
        .start = (uintptr_t)memory, .size = (size_t)exported.size, .family = SIM_MEM_IPC,
        .device = ctx->device, .ctx = ctx, .access = SIM_ACCESS_ALL, .shared_fd = -1,
    };
    sim_mem_write_lock();
    if (!sim_mem_add(&prototype))
        result = CUDA_ERROR_OUT_OF_MEMORY;
    sim_mem_unlock();
    if (result != CUDA_SUCCESS) {
        munmap(memory, (size_t)exported.size);
        return result;
    }
    *pdptr = (CUdeviceptr)(uintptr_t)memory;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuIpcOpenMemHandle(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags)
{
    return cuIpcOpenMemHandle_v2(pdptr, handle, Flags);
}

SIM_EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr dptr)
{
    SIM_ENTER();
    return free_now((uintptr_t)dptr, FAMILY(SIM_MEM_IPC));
}

/* ---- The 32-bit ABI of CUDA 2.x ---- */

SIM_32BIT_ABI_ENTRY(cuMemAlloc, (unsigned int *dptr, unsigned int bytesize))
SIM_32BIT_ABI_ENTRY(cuMemAllocPitch, (unsigned int *dptr, unsigned int *pPitch, unsigned int WidthInBytes,
                                      unsigned int Height, unsigned int ElementSizeBytes))
SIM_32BIT_ABI_ENTRY(cuMemAllocHost, (void **pp, unsigned int bytesize))
SIM_32BIT_ABI_ENTRY(cuMemFree, (unsigned int dptr))
SIM_32BIT_ABI_ENTRY(cuMemGetInfo, (unsigned int *free, unsigned int *total))
