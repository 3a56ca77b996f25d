/*
 * Device allocations become managed allocations, so every process may use the whole GPU and
 * the driver pages to host memory when the sum exceeds it. A table remembers what each
 * pointer is, for frees, for the per-device byte counts that feed MEMORY reports and
 * cuMemGetInfo, and for the IPC explanation. Allocations are not the hot path: one mutex.
 *
 * Every allocation is charged to its device's byte count before it is made, against the
 * device's memory limit (limits.c): one that would pass it is refused with
 * CUDA_ERROR_OUT_OF_MEMORY without reaching the driver. A failed allocation gives its charge
 * back; a free (a deferred one when it completes) uncharges it.
 *
 * (Some 750 lines, most of them the allocation and free hooks, the stream-ordered frees of
 * converted memory and swap.c's view of what may move: one file, because all of these read or
 * change the pointer table and the pending-free list under mem_mu, which no other unit sees. The
 * rest answers the memory queries from the charged byte counts and explains the IPC refusal.)
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include "admission.h"
#include "area.h"
#include "compiler.h"
#include "config.h"
#include "gate.h"
#include "hook_table.h"
#include "limits.h"
#include "loader.h"
#include "log.h"
#include "memory.h"
#include "notify.h"

enum alloc_kind {
    ALLOC_CONVERTED = 1, /* a device allocation nvshare turned into a managed one */
    ALLOC_MANAGED,       /* the application's own cuMemAllocManaged */
    ALLOC_DEVICE,        /* passed through (NVSHARE_MANAGED=0): physical device memory */
};

/* Swapping moves converted allocations in blocks of NVS_SWAP_BLOCK bytes (swap.c): each block is
 * moved to the host by a swap-out and not brought back (its bytes in the pinned area, or area
 * NULL when the driver's prefetch moved them), or not, and remembers the device's swap epoch of
 * when it was allocated or last brought back. */
struct block {
    int swapped;
    struct nvs_extent *area;
    uint64_t last_used;
};

struct alloc {
    uint64_t key; /* device pointer */
    size_t size;
    struct nvs_device *device;
    enum alloc_kind kind;
    struct block *blocks; /* converted: one per NVS_SWAP_BLOCK bytes (NULL: it never moves) */
};

static size_t blocks_of(size_t size) { return (size + NVS_SWAP_BLOCK - 1) / NVS_SWAP_BLOCK; }

/* Open-addressing hash table of live allocations; under mem_mu. Keys are never 0. (VMM handles
 * are vmm.c's.) */
struct alloc_table {
    struct alloc *slots;
    size_t cap, used, tombstones;
};
#define TOMBSTONE UINT64_MAX

/* Guards the table and the pending-free list; any thread. A leaf lock: taken after nvs_ctx_mu
 * and nvs_mu (fork prepare), never held across a CUDA call, I/O or another lock. */
static pthread_mutex_t mem_mu = PTHREAD_MUTEX_INITIALIZER;
static struct alloc_table pointers;

static size_t slot_of(uint64_t key, size_t cap) {
    key ^= key >> 33;
    key *= 0xff51afd7ed558ccdULL;
    key ^= key >> 33;
    return (size_t)key & (cap - 1);
}

static int table_grow(struct alloc_table *t) {
    size_t cap = t->cap ? 2 * t->cap : 1024;
    if (t->used * 4 < t->cap) cap = t->cap; /* mostly tombstones: rehash in place */
    struct alloc *slots = calloc(cap, sizeof *slots);
    if (slots == NULL) return -1;
    for (size_t i = 0; i < t->cap; i++) {
        struct alloc *a = &t->slots[i];
        if (a->key == 0 || a->key == TOMBSTONE) continue;
        size_t j = slot_of(a->key, cap);
        while (slots[j].key != 0) j = (j + 1) & (cap - 1);
        slots[j] = *a;
    }
    free(t->slots);
    t->slots = slots;
    t->cap = cap;
    t->tombstones = 0;
    return 0;
}

static int table_put(struct alloc_table *t, const struct alloc *a) {
    if ((t->used + t->tombstones + 1) * 2 > t->cap && table_grow(t) != 0) return -1;
    size_t j = slot_of(a->key, t->cap);
    while (t->slots[j].key != 0 && t->slots[j].key != TOMBSTONE && t->slots[j].key != a->key)
        j = (j + 1) & (t->cap - 1);
    if (t->slots[j].key == TOMBSTONE) t->tombstones--;
    if (t->slots[j].key != a->key) t->used++;
    t->slots[j] = *a;
    return 0;
}

static struct alloc *table_find(struct alloc_table *t, uint64_t key) {
    if (t->cap == 0 || key == 0 || key == TOMBSTONE) return NULL;
    size_t j = slot_of(key, t->cap);
    while (t->slots[j].key != 0) {
        if (t->slots[j].key == key) return &t->slots[j];
        j = (j + 1) & (t->cap - 1);
    }
    return NULL;
}

static void table_remove(struct alloc_table *t, struct alloc *a) {
    a->key = TOMBSTONE;
    t->used--;
    t->tombstones++;
}

/* --- charging allocations to their device ----------------------------------------------------*/

enum charge_outcome { CHARGED = 0, OVER_LIMIT, NOT_ADMITTED };

/* Add `size` bytes to d's use if that keeps it within d's limit and what the scheduler admitted
 * (always, without either): CHARGED, or what stopped it, with nothing charged and the use and
 * limit it saw. Lock-free; concurrent allocations on a device cannot pass a bound together:
 * each compare-and-swap sees the others' charges. */
static enum charge_outcome charge(struct nvs_device *d, size_t size, uint64_t *used_seen, uint64_t *limit_seen) {
    if (d == NULL) return CHARGED; /* no device (no current context): the driver will refuse it */
    uint64_t limit = nvs_limit_of(d), admitted = nvs_admitted(d);
    if (NVS_LIKELY(limit == NVS_NO_LIMIT && admitted == NVS_NO_LIMIT)) {
        atomic_fetch_add(&d->bytes, size);
        return CHARGED;
    }
    uint64_t bound = limit < admitted ? limit : admitted;
    uint64_t used = atomic_load(&d->bytes);
    do {
        if (size > bound || used > bound - size) {
            *used_seen = used;
            *limit_seen = limit;
            return size > limit || used > limit - size ? OVER_LIMIT : NOT_ADMITTED;
        }
    } while (!atomic_compare_exchange_weak(&d->bytes, &used, used + size));
    return CHARGED;
}

/* A converted allocation is freed: it leaves its device's converted (and swapped) counts, at
 * the moment its bytes are uncharged, so that resident = converted - swapped never moves
 * without `bytes` moving with it (the scheduler tells a free from a swap-out by that); its
 * bytes in the swap area are given back. */
static void converted_gone(struct nvs_device *d, size_t size, struct block *blocks) {
    if (blocks == NULL) return; /* never counted */
    uint64_t swapped = 0;
    for (size_t i = 0; i < blocks_of(size); i++) {
        nvs_area_give(blocks[i].area);
        if (blocks[i].swapped) swapped += i + 1 < blocks_of(size) ? NVS_SWAP_BLOCK : size - i * NVS_SWAP_BLOCK;
    }
    free(blocks);
    if (d == NULL) return;
    atomic_fetch_sub(&d->converted, size);
    atomic_fetch_sub(&d->swapped, swapped);
}

void nvs_memory_uncharge(struct nvs_device *d, size_t size) {
    if (d == NULL) return;
    atomic_fetch_sub(&d->bytes, size);
    nvs_client_memory_changed();
}

static void settle_device_frees(struct nvs_device *d);

/* Charge `call`'s allocation of `size` bytes on d before it is made, or refuse it. Before a
 * refusal or a wait the device's pending stream-ordered frees are completed (waiting for the
 * work queued before them): their memory is the program's to reuse, as with the driver's own
 * stream-ordered allocator. Past the admitted total the thread waits for the scheduler
 * (admission.c) and tries again; a refusal is CUDA_ERROR_OUT_OF_MEMORY. No lock is held here
 * (the waits and the log lines need none). */
CUresult nvs_memory_charge(struct nvs_device *d, size_t size, const char *call) {
    uint64_t used = 0, limit = 0;
    int settled = 0;
    nvs_admission_await_registration(d); /* the first one: its limits from the scheduler first */
    for (;;) {
        enum charge_outcome outcome = charge(d, size, &used, &limit);
        if (NVS_LIKELY(outcome == CHARGED)) return CUDA_SUCCESS;
        if (!settled && nvs_memory_frees_pending()) {
            settled = 1;
            settle_device_frees(d);
            continue;
        }
        if (outcome == OVER_LIMIT) {
            nvs_limit_refused(d, call, size, used, limit);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        /* NOT_ADMITTED: used + size <= limit, so the sum cannot overflow. */
        if (nvs_admission_wait(d, used + size, call, size) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
    }
}

/* A charged allocation succeeded: record it (the MEMORY report follows). */
static void remember(struct alloc_table *t, uint64_t key, size_t size, struct nvs_device *d, enum alloc_kind kind) {
    struct alloc a = {.key = key, .size = size, .device = d, .kind = kind};
    if (kind == ALLOC_CONVERTED && d != NULL && size > 0) {
        a.blocks = calloc(blocks_of(size), sizeof *a.blocks);
        uint64_t epoch = atomic_load(&d->swap_epoch);
        for (size_t i = 0; a.blocks != NULL && i < blocks_of(size); i++) a.blocks[i].last_used = epoch;
        if (a.blocks == NULL) nvs_warn("out of memory recording an allocation of %zu bytes; it will not be swapped", size);
    }
    pthread_mutex_lock(&mem_mu);
    int failed = table_put(t, &a);
    pthread_mutex_unlock(&mem_mu);
    if (!failed && a.blocks != NULL) atomic_fetch_add(&d->converted, size);
    if (failed) {
        free(a.blocks);
        nvs_error("out of memory recording an allocation of %zu bytes; it is not counted", size);
        nvs_memory_uncharge(d, size); /* a free of it will find nothing to uncharge */
        return;
    }
    if (d != NULL) nvs_client_memory_changed();
}

/* The end of a charged allocation: record it if the driver made it, else give the charge back. */
static CUresult settle_charge(CUresult result, struct alloc_table *t, uint64_t key, size_t size, struct nvs_device *d,
                              enum alloc_kind kind) {
    if (result == CUDA_SUCCESS)
        remember(t, key, size, d, kind);
    else
        nvs_memory_uncharge(d, size);
    return result;
}

/* Remove `key` from `t`; returns 1 and fills `out` if it was there. */
static int forget(struct alloc_table *t, uint64_t key, struct alloc *out) {
    pthread_mutex_lock(&mem_mu);
    struct alloc *a = table_find(t, key);
    if (a != NULL) {
        *out = *a;
        table_remove(t, a);
    }
    pthread_mutex_unlock(&mem_mu);
    return a != NULL;
}

static int lookup_kind(uint64_t key) {
    pthread_mutex_lock(&mem_mu);
    struct alloc *a = table_find(&pointers, key);
    int kind = a != NULL ? (int)a->kind : 0;
    pthread_mutex_unlock(&mem_mu);
    return kind;
}

/* Common start of every allocation: threads running (memory reports), old frees done. */
static void allocation_prologue(void) {
    nvs_runtime_start();
    nvs_memory_poll_frees();
}


/*
 * NVSHARE_ADVISE=1 (off by default: on an H100 it bought nothing over plain conversion, whose GPU
 * time per GPT-2 step was already within 0.2 % of native; docs/interceptor.md, "What it costs"): a
 * converted allocation is advised onto the device that allocated it, SetPreferredLocation and
 * SetAccessedBy, as a device allocation would be. Both are hints and stay correct when memory is
 * swapped: a prefetch to the host (evict on release) moves the pages out regardless of the
 * preferred location, and the device keeps a mapping to them, so after an eviction the GPU may
 * read them over the bus instead of faulting them back: the grantee must prefetch them in.
 * Advice that fails is reported and leaves the allocation as it is.
 */
static void advise_onto_device(CUdeviceptr ptr, size_t size, struct nvs_device *d) {
    if (!nvs_config.advise || d == NULL || nvs_real.cuMemAdvise_v2 == NULL) return;
    CUmemLocation location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = d->ordinal};
    CUresult r = nvs_real.cuMemAdvise_v2(ptr, size, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, location);
    if (r == CUDA_SUCCESS) r = nvs_real.cuMemAdvise_v2(ptr, size, CU_MEM_ADVISE_SET_ACCESSED_BY, location);
    if (r != CUDA_SUCCESS) nvs_warn("cuMemAdvise on %#llx failed (%d); the allocation keeps no advice",
                                    (unsigned long long)ptr, r);
}

/*
 * A fresh converted allocation of a process that holds its device: its pages made on the device
 * at once (a prefetch of memory nobody touched moves nothing; it only makes the pages), as
 * cuMemAlloc would have them. Otherwise the program's first writes populate managed pages fault
 * by fault: on an H200 a model's load (30 GiB copied in from pinned memory) took 2.27 s under
 * nvshare against 1.04 s without (issue 29). Only for a holder, whose GPU the prefetch may use,
 * and never during a stream capture; the caller gets the pointer after the pages are made, so
 * nothing it queues can meet them half made. A refusal leaves the pages to the faults, as before.
 */
static void make_pages(CUdeviceptr ptr, size_t size, struct nvs_device *d) {
    if (d == NULL || nvs_real.cuMemPrefetchAsync_v2 == NULL || nvs_real.cuStreamCreate == NULL) return;
    pthread_mutex_lock(&nvs_mu);
    int capturing = d->captures > 0;
    pthread_mutex_unlock(&nvs_mu);
    /* Passed like a submission: the making is the holder's work. With the GPU full it evicts
     * other processes' pages on the driver's path, which on an H200 took the prefetch call itself
     * most of a second per GiB; an idle probe that found nothing in flight meanwhile released a
     * loading tenant between two pieces of its load (issue 29). */
    if (capturing || !nvs_gate_try_pass(d)) return;
    CUstream stream;
    CUresult r = nvs_real.cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING);
    if (r == CUDA_SUCCESS) {
        CUmemLocation here = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = d->ordinal};
        r = nvs_real.cuMemPrefetchAsync_v2(ptr, size, here, 0, stream);
        if (r == CUDA_SUCCESS) r = nvs_real.cuStreamSynchronize(stream);
        nvs_real.cuStreamDestroy_v2(stream);
    }
    nvs_gate_leave(d);
    if (r != CUDA_SUCCESS)
        nvs_debug("making the pages of %#llx (%zu bytes) on device %d failed (%d): they come as touched",
                  (unsigned long long)ptr, size, d->ordinal, r);
}

/* The managed replacement of `call`'s device allocation of `size` bytes. */
static CUresult allocate_converted(CUdeviceptr *dptr, size_t size, const char *call) {
    if (nvs_real.cuMemAllocManaged == NULL) return CUDA_ERROR_NOT_FOUND;
    struct nvs_device *d = nvs_current_device();
    CUresult r = nvs_memory_charge(d, size, call);
    if (r != CUDA_SUCCESS) return r;
    r = nvs_real.cuMemAllocManaged(dptr, size, CU_MEM_ATTACH_GLOBAL);
    if (settle_charge(r, &pointers, r == CUDA_SUCCESS ? *dptr : 0, size, d, ALLOC_CONVERTED) == CUDA_SUCCESS) {
        advise_onto_device(*dptr, size, d);
        make_pages(*dptr, size, d);
    }
    return r;
}

NVS_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t size) {
    NVS_REAL_OR_FAIL(cuMemAlloc_v2);
    allocation_prologue();
    if (nvs_config.managed) return allocate_converted(dptr, size, "cuMemAlloc_v2");
    struct nvs_device *d = nvs_current_device();
    CUresult r = nvs_memory_charge(d, size, "cuMemAlloc_v2");
    if (r != CUDA_SUCCESS) return r;
    r = nvs_real.cuMemAlloc_v2(dptr, size);
    return settle_charge(r, &pointers, r == CUDA_SUCCESS ? *dptr : 0, size, d, ALLOC_DEVICE);
}

NVS_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height,
                                       unsigned int elemSize) {
    NVS_REAL_OR_FAIL(cuMemAllocPitch_v2);
    allocation_prologue();
    if (!nvs_config.managed) {
        /* The driver picks the pitch, so the size is known only afterwards: charge it then, and
         * free what the limit does not allow. */
        CUresult r = nvs_real.cuMemAllocPitch_v2(dptr, pitch, width, height, elemSize);
        if (r != CUDA_SUCCESS) return r;
        struct nvs_device *d = nvs_current_device();
        r = nvs_memory_charge(d, *pitch * height, "cuMemAllocPitch_v2");
        if (r == CUDA_SUCCESS) {
            remember(&pointers, *dptr, *pitch * height, d, ALLOC_DEVICE);
        } else {
            CUresult freed = nvs_real.cuMemFree_v2(*dptr);
            if (freed != CUDA_SUCCESS)
                nvs_warn("freeing a pitched allocation over the memory limit failed (%d)", freed);
        }
        return r;
    }
    if (dptr == NULL || pitch == NULL || width == 0 || height == 0 ||
        (elemSize != 4 && elemSize != 8 && elemSize != 16))
        return CUDA_ERROR_INVALID_VALUE;
    /* Rows start at multiples of the texture pitch alignment, and never closer than 512 bytes
     * apart: current drivers hand out pitches in multiples of 512, and code written against
     * them may assume it. */
    size_t alignment = 512;
    struct nvs_device *d = nvs_current_device();
    int texture_alignment = 0;
    if (d != NULL && nvs_real.cuDeviceGetAttribute != NULL &&
        nvs_real.cuDeviceGetAttribute(&texture_alignment, CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT,
                                      d->ordinal) == CUDA_SUCCESS &&
        (size_t)texture_alignment > alignment)
        alignment = (size_t)texture_alignment;
    if (width > SIZE_MAX - alignment) return CUDA_ERROR_INVALID_VALUE;
    size_t row = (width + alignment - 1) / alignment * alignment;
    if (height > SIZE_MAX / row) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = allocate_converted(dptr, row * height, "cuMemAllocPitch_v2");
    if (r == CUDA_SUCCESS) *pitch = row;
    return r;
}

static CUresult alloc_async(CUdeviceptr *dptr, size_t size, CUstream s, int per_thread) {
    const char *call = per_thread ? "cuMemAllocAsync_ptsz" : "cuMemAllocAsync";
    allocation_prologue();
    if (nvs_config.managed) return allocate_converted(dptr, size, call);
    struct nvs_device *d = nvs_current_device();
    CUresult r = nvs_memory_charge(d, size, call);
    if (r != CUDA_SUCCESS) return r;
    r = per_thread ? nvs_real.cuMemAllocAsync_ptsz(dptr, size, s) : nvs_real.cuMemAllocAsync(dptr, size, s);
    return settle_charge(r, &pointers, r == CUDA_SUCCESS ? *dptr : 0, size, d, ALLOC_DEVICE);
}

NVS_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t size, CUstream s) {
    NVS_REAL_OR_FAIL(cuMemAllocAsync);
    return alloc_async(dptr, size, s, 0);
}

NVS_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t size, CUstream s) {
    NVS_REAL_OR_FAIL(cuMemAllocAsync_ptsz);
    return alloc_async(dptr, size, s, 1);
}

static CUresult alloc_from_pool(CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream s, int per_thread) {
    const char *call = per_thread ? "cuMemAllocFromPoolAsync_ptsz" : "cuMemAllocFromPoolAsync";
    allocation_prologue();
    if (nvs_config.managed) return allocate_converted(dptr, size, call);
    /* Charged to the current device, not the pool's: nvshare does not ask the pool where it lives. */
    struct nvs_device *d = nvs_current_device();
    CUresult r = nvs_memory_charge(d, size, call);
    if (r != CUDA_SUCCESS) return r;
    r = per_thread ? nvs_real.cuMemAllocFromPoolAsync_ptsz(dptr, size, pool, s)
                   : nvs_real.cuMemAllocFromPoolAsync(dptr, size, pool, s);
    return settle_charge(r, &pointers, r == CUDA_SUCCESS ? *dptr : 0, size, d, ALLOC_DEVICE);
}

NVS_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream s) {
    NVS_REAL_OR_FAIL(cuMemAllocFromPoolAsync);
    return alloc_from_pool(dptr, size, pool, s, 0);
}

NVS_EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream s) {
    NVS_REAL_OR_FAIL(cuMemAllocFromPoolAsync_ptsz);
    return alloc_from_pool(dptr, size, pool, s, 1);
}

NVS_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t size, unsigned int flags) {
    NVS_REAL_OR_FAIL(cuMemAllocManaged);
    allocation_prologue();
    struct nvs_device *d = nvs_current_device();
    CUresult r = nvs_memory_charge(d, size, "cuMemAllocManaged");
    if (r != CUDA_SUCCESS) return r;
    r = nvs_real.cuMemAllocManaged(dptr, size, flags);
    return settle_charge(r, &pointers, r == CUDA_SUCCESS ? *dptr : 0, size, d, ALLOC_MANAGED);
}

NVS_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr) {
    NVS_REAL_OR_FAIL(cuMemFree_v2);
    nvs_memory_poll_frees();
    struct alloc a;
    int known = forget(&pointers, dptr, &a);
    CUresult r = nvs_real.cuMemFree_v2(dptr);
    if (known && r == CUDA_SUCCESS) converted_gone(a.device, a.size, a.blocks);
    if (known && r == CUDA_SUCCESS) nvs_memory_uncharge(a.device, a.size);
    if (known && r != CUDA_SUCCESS) { /* still allocated: keep it */
        pthread_mutex_lock(&mem_mu);
        table_put(&pointers, &a);
        pthread_mutex_unlock(&mem_mu);
    }
    return r;
}

/* --- stream-ordered frees of converted memory -------------------------------------------------
 * cuMemFreeAsync must not free before the work queued on its stream is done, and managed
 * memory has no stream-ordered free: record an event on the stream and free once it has
 * completed. Pending frees are completed on later allocations and frees, and by the worker
 * thread; never from a host callback (those may not call CUDA). */

struct pending_free {
    struct pending_free *next;
    CUdeviceptr ptr;
    size_t size;
    struct nvs_device *device;
    struct block *blocks; /* its swap state (counted until the free completes) */
    CUcontext ctx;  /* the allocating context (current at cuMemFreeAsync), NULL: none */
    CUevent event;  /* recorded on the freeing stream, in `ctx` */
};

/* Pending frees: the list under mem_mu; n_pending counts them (any thread, atomically) so that
 * polling costs one load when there are none. Their contexts are pushed and their events
 * queried only under nvs_ctx_mu (gate.h): cuCtxDestroy_v2 and the primary-context hooks hold
 * it while they settle a context's frees and destroy it, so no free outlives its context. */
static struct pending_free *pending;
static _Atomic int n_pending;
/* Polls (nvs_memory_poll_frees) that have taken pending frees off the list to query their
 * events; under mem_mu, by the polling threads. A settle (nvs_memory_settle_frees) waits on
 * polls_back until none has: it would find the list without the frees it must wait for, and an
 * allocation that needed one of them was refused (CI under two CPU hogs). */
static int polls_out;
static pthread_cond_t polls_back = PTHREAD_COND_INITIALIZER;

int nvs_memory_frees_pending(void) { return atomic_load(&n_pending) > 0; }

/* Detach the pending frees `take` selects; the rest stay. A poll says so (`poll`: it gives them
 * back with give_back_pending); anyone else first waits until no poll has any out. */
static struct pending_free *detach_pending(int (*take)(const struct pending_free *, const void *), const void *arg,
                                           int poll) {
    struct pending_free *taken = NULL;
    pthread_mutex_lock(&mem_mu);
    if (poll)
        polls_out++;
    else
        while (polls_out > 0) pthread_cond_wait(&polls_back, &mem_mu);
    for (struct pending_free **link = &pending; *link != NULL;) {
        struct pending_free *p = *link;
        if (take(p, arg)) {
            *link = p->next;
            p->next = taken;
            taken = p;
        } else {
            link = &p->next;
        }
    }
    pthread_mutex_unlock(&mem_mu);
    return taken;
}

/* Put `list` back on the pending list; `poll`: a poll's frees (detach_pending), the poll ends. */
static void give_back_pending(struct pending_free *list, int poll) {
    struct pending_free *tail = list;
    while (tail != NULL && tail->next != NULL) tail = tail->next;
    pthread_mutex_lock(&mem_mu);
    if (tail != NULL) {
        tail->next = pending;
        pending = list;
    }
    if (poll && --polls_out == 0) pthread_cond_broadcast(&polls_back);
    pthread_mutex_unlock(&mem_mu);
}

/* The caller holds nvs_ctx_mu and p's event has completed: free the memory in its own context
 * and uncount it. */
static void complete_free(struct pending_free *p) {
    /* Free in the allocating context (the calling thread may have none, or another). */
    int pushed = p->ctx != NULL && nvs_real.cuCtxPushCurrent_v2(p->ctx) == CUDA_SUCCESS;
    CUresult r = nvs_real.cuMemFree_v2(p->ptr);
    nvs_real.cuEventDestroy_v2(p->event);
    if (pushed) {
        CUcontext popped;
        nvs_real.cuCtxPopCurrent_v2(&popped);
    }
    if (r != CUDA_SUCCESS) nvs_warn("deferred free of %#llx failed (%d)", (unsigned long long)p->ptr, r);
    converted_gone(p->device, p->size, p->blocks);
    nvs_memory_uncharge(p->device, p->size);
    atomic_fetch_sub(&n_pending, 1);
    free(p);
}

static int any_free(const struct pending_free *p, const void *unused) { return 1; }

void nvs_memory_poll_frees(void) {
    if (NVS_LIKELY(atomic_load(&n_pending) == 0)) return;
    /* A context's destruction or a capture's beginning holds nvs_ctx_mu (or waits for it): leave
     * the frees to a later poll (the worker polls every few milliseconds while frees are
     * pending) rather than wait for it. */
    if (pthread_rwlock_tryrdlock(&nvs_ctx_mu) != 0) return;
    struct pending_free *list = detach_pending(any_free, NULL, 1), *keep = NULL;
    while (list != NULL) {
        struct pending_free *p = list;
        list = p->next;
        if (nvs_real.cuEventQuery(p->event) == CUDA_ERROR_NOT_READY) {
            p->next = keep;
            keep = p;
        } else {
            complete_free(p);
        }
    }
    /* Back on the list before nvs_ctx_mu goes: a context destroyed next must find them. */
    give_back_pending(keep, 1);
    pthread_rwlock_unlock(&nvs_ctx_mu);
}

struct context_selector {
    CUcontext ctx;
    struct nvs_device *device;
};

static int made_in(const struct pending_free *p, const void *arg) {
    const struct context_selector *which = arg;
    return which->ctx != NULL ? p->ctx == which->ctx : p->device == which->device;
}

void nvs_memory_settle_frees(CUcontext ctx, struct nvs_device *device) {
    if (atomic_load(&n_pending) == 0) return;
    struct context_selector which = {ctx, device};
    struct pending_free *list = detach_pending(made_in, &which, 0);
    while (list != NULL) {
        struct pending_free *p = list;
        list = p->next;
        /* The work queued before the free still uses the memory: wait for it, as destroying
         * the context would. */
        CUresult r = nvs_real.cuEventSynchronize != NULL ? nvs_real.cuEventSynchronize(p->event) : CUDA_SUCCESS;
        if (r != CUDA_SUCCESS)
            nvs_debug("waiting for a deferred free before its context goes returned %d", r);
        complete_free(p);
    }
}

/* A refusal's last chance (charge_or_refuse): complete d's pending frees, waiting for them. */
static void settle_device_frees(struct nvs_device *d) {
    pthread_rwlock_rdlock(&nvs_ctx_mu);
    nvs_memory_settle_frees(NULL, d);
    pthread_rwlock_unlock(&nvs_ctx_mu);
}

static CUresult free_async(CUdeviceptr dptr, CUstream s, int per_thread) {
    nvs_memory_poll_frees();
    int kind = lookup_kind(dptr);
    if (kind != ALLOC_CONVERTED) {
        CUresult r = per_thread ? nvs_real.cuMemFreeAsync_ptsz(dptr, s) : nvs_real.cuMemFreeAsync(dptr, s);
        struct alloc a;
        if (r == CUDA_SUCCESS && kind != 0 && forget(&pointers, dptr, &a)) nvs_memory_uncharge(a.device, a.size);
        return r;
    }
    /* The per-thread variant's stream 0 is the per-thread default stream. */
    CUstream stream = per_thread && s == NULL ? CU_STREAM_PER_THREAD : s;
    CUstreamCaptureStatus capture = CU_STREAM_CAPTURE_STATUS_NONE;
    if (nvs_real.cuStreamIsCapturing != NULL && nvs_real.cuStreamIsCapturing(stream, &capture) == CUDA_SUCCESS &&
        capture != CU_STREAM_CAPTURE_STATUS_NONE) {
        nvs_warn("cuMemFreeAsync of converted (managed) memory inside stream capture is not supported; "
                 "set NVSHARE_MANAGED=0 for this program");
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    }
    struct pending_free *p = calloc(1, sizeof *p);
    if (p == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = nvs_real.cuEventCreate(&p->event, CU_EVENT_DISABLE_TIMING);
    if (r == CUDA_SUCCESS) {
        r = nvs_real.cuEventRecord(p->event, stream);
        if (r != CUDA_SUCCESS) nvs_real.cuEventDestroy_v2(p->event);
    }
    if (r != CUDA_SUCCESS) {
        free(p);
        return r;
    }
    struct alloc a;
    forget(&pointers, dptr, &a);
    p->ptr = dptr;
    p->size = a.size;
    p->device = a.device;
    p->blocks = a.blocks;
    if (nvs_real.cuCtxGetCurrent(&p->ctx) != CUDA_SUCCESS) p->ctx = NULL;
    atomic_fetch_add(&n_pending, 1);
    give_back_pending(p, 0);
    nvs_worker_kick(); /* the worker polls while frees are pending */
    return CUDA_SUCCESS;
}

NVS_EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream s) {
    NVS_REAL_OR_FAIL(cuMemFreeAsync);
    return free_async(dptr, s, 0);
}

NVS_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream s) {
    NVS_REAL_OR_FAIL(cuMemFreeAsync_ptsz);
    return free_async(dptr, s, 1);
}

/* --- what the application is told ---------------------------------------------------------*/

NVS_EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes) {
    NVS_REAL_OR_FAIL(cuMemGetInfo_v2);
    if (free_bytes == NULL || total_bytes == NULL) return CUDA_ERROR_INVALID_VALUE;
    size_t real_free, real_total;
    CUresult r = nvs_real.cuMemGetInfo_v2(&real_free, &real_total);
    if (r != CUDA_SUCCESS) return r;
    *free_bytes = real_free;
    *total_bytes = real_total;
    struct nvs_device *d = nvs_current_device();
    if (d == NULL) return CUDA_SUCCESS;
    /* Frameworks size themselves from the first answer (JAX takes 75 % of it): a limit the
     * scheduler holds for this process must be in it. */
    nvs_admission_await_registration(d);
    uint64_t used = atomic_load(&d->bytes);
    /* Each process sees the GPU as if it were alone: managed memory may be oversubscribed,
     * so other processes' memory does not reduce what this one may use. */
    if (nvs_config.managed) *free_bytes = used >= real_total ? 0 : real_total - used;
    uint64_t limit = nvs_limit_of(d);
    if (limit != NVS_NO_LIMIT) {
        /* A limited process sees a GPU of its limit's size, so frameworks size themselves to it. */
        uint64_t total, free;
        nvs_limit_figures(limit, real_total, used, *free_bytes, &total, &free);
        *total_bytes = total;
        *free_bytes = free;
    }
    return CUDA_SUCCESS;
}

NVS_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    NVS_REAL_OR_FAIL(cuDeviceTotalMem_v2);
    CUresult r = nvs_real.cuDeviceTotalMem_v2(bytes, dev);
    if (r != CUDA_SUCCESS) return r;
    struct nvs_device *d = nvs_device_get(dev);
    nvs_admission_await_registration(d); /* a limit from the scheduler shows here too */
    uint64_t limit = d != NULL ? nvs_limit_of(d) : NVS_NO_LIMIT;
    if (limit < *bytes) *bytes = limit;
    return r;
}

NVS_EXPORT CUresult cuDeviceGetAttribute(int *value, CUdevice_attribute attrib, CUdevice dev) {
    NVS_REAL_OR_FAIL(cuDeviceGetAttribute);
    CUresult r = nvs_real.cuDeviceGetAttribute(value, attrib, dev);
    if (r == CUDA_SUCCESS && nvs_config.vmm_hide && attrib == CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)
        *value = 0;
    return r;
}

/* --- CUDA IPC: the driver refuses managed memory; say why ---------------------------------*/

NVS_EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle *handle, CUdeviceptr dptr) {
    NVS_REAL_OR_FAIL(cuIpcGetMemHandle);
    CUresult r = nvs_real.cuIpcGetMemHandle(handle, dptr);
    if (r == CUDA_SUCCESS) return r;
    unsigned int is_managed = 0;
    if (nvs_real.cuPointerGetAttribute != NULL &&
        nvs_real.cuPointerGetAttribute(&is_managed, CU_POINTER_ATTRIBUTE_IS_MANAGED, dptr) == CUDA_SUCCESS &&
        is_managed) {
        static _Atomic int explained; /* any thread; the first to set it explains, once */
        if (!atomic_exchange(&explained, 1))
            nvs_warn("cuIpcGetMemHandle failed (%d) on %#llx: nvshare turned this device allocation into "
                     "managed memory, which CUDA IPC cannot share. Run this program with NVSHARE_MANAGED=0 "
                     "(its allocations are then physical and not oversubscribable; the lock still applies)",
                     r, (unsigned long long)dptr);
    }
    return r;
}

/* --- swapping: what swap.c may move (docs/interceptor.md, "Swapping") -------------------------*/

size_t nvs_memory_swappable(struct nvs_device *d, int swapped, struct nvs_swappable **out) {
    size_t n = 0, cap = 0;
    struct nvs_swappable *items = NULL;
    pthread_mutex_lock(&mem_mu);
    for (size_t i = 0; i < pointers.cap; i++) {
        const struct alloc *a = &pointers.slots[i];
        if (a->key == 0 || a->key == TOMBSTONE || a->device != d || a->blocks == NULL) continue;
        for (size_t k = 0; k < blocks_of(a->size); k++) {
            if (a->blocks[k].swapped != swapped) continue;
            if (n == cap) {
                cap = cap ? 2 * cap : 64;
                struct nvs_swappable *grown = realloc(items, cap * sizeof *items);
                if (grown == NULL) break;
                items = grown;
            }
            size_t offset = k * NVS_SWAP_BLOCK;
            items[n++] = (struct nvs_swappable){.key = a->key, .ptr = a->key + offset,
                                                .size = a->size - offset < NVS_SWAP_BLOCK ? a->size - offset : NVS_SWAP_BLOCK,
                                                .last_used = a->blocks[k].last_used, .area = a->blocks[k].area};
        }
    }
    pthread_mutex_unlock(&mem_mu);
    *out = items;
    return n;
}

int nvs_memory_mark(struct nvs_device *d, const struct nvs_swappable *item, int swapped, uint64_t last_used) {
    pthread_mutex_lock(&mem_mu);
    struct alloc *a = table_find(&pointers, item->key);
    size_t k = (item->ptr - item->key) / NVS_SWAP_BLOCK;
    int present = a != NULL && a->device == d && a->blocks != NULL && item->ptr >= a->key && k < blocks_of(a->size) &&
                  item->size == (a->size - k * NVS_SWAP_BLOCK < NVS_SWAP_BLOCK ? a->size - k * NVS_SWAP_BLOCK : NVS_SWAP_BLOCK);
    if (present) {
        a->blocks[k].swapped = swapped;
        a->blocks[k].area = item->area;
        a->blocks[k].last_used = last_used;
    }
    pthread_mutex_unlock(&mem_mu);
    return present ? 0 : -1;
}

/* --- fork ----------------------------------------------------------------------------------*/

void nvs_memory_reset_after_fork(void) {
    pthread_mutex_init(&mem_mu, NULL);
    for (size_t i = 0; i < pointers.cap; i++)
        if (pointers.slots[i].key != 0 && pointers.slots[i].key != TOMBSTONE) free(pointers.slots[i].blocks);
    free(pointers.slots);
    memset(&pointers, 0, sizeof pointers);
    while (pending != NULL) {
        struct pending_free *p = pending;
        pending = p->next;
        free(p);
    }
    atomic_store(&n_pending, 0);
    polls_out = 0; /* a poll of the parent's is no thread of the child's: nothing comes back */
    pthread_cond_init(&polls_back, NULL);
}

void nvs_memory_fork_prepare(void) { pthread_mutex_lock(&mem_mu); }
void nvs_memory_fork_parent(void) { pthread_mutex_unlock(&mem_mu); }
