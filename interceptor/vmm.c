/*
 * Virtual memory management (cuMemCreate / cuMemMap): physical device memory that the
 * application maps itself (PyTorch with expandable_segments:True, NCCL, JAX's default
 * allocator). nvshare cannot make it managed memory, so with NVSHARE_VMM=allow it is passed
 * through and counted in memory reports (and against limits and admission) as memory that cannot
 * move; with NVSHARE_VMM=swap it is also swapped handle by handle (docs/interceptor.md,
 * "Swapping"; opt-in: on its first real-GPU run PyTorch's expandable segments met
 * CUDA_ERROR_NOT_SUPPORTED from a driver call after a swap-in, not explained yet, so every failing
 * VMM call is logged as a warning): its bytes are copied to the pinned swap area, it is
 * unmapped and its physical handle released, so the device really has the room; before the
 * process runs again a new handle is created, mapped at the same address with the same access,
 * and the bytes are copied back.
 *
 * The application keeps the handle cuMemCreate gave it, so a handle that was swapped and
 * brought back is the application's handle standing for another driver handle: the hooks that
 * take a handle (cuMemMap, cuMemRelease, cuMemExportToShareableHandle) translate it, and
 * cuMemRetainAllocationHandle answers with it. nvshare holds the one driver reference of a
 * handle and counts the application's (cuMemCreate, retains, releases) itself; the driver's goes
 * with the application's last. What is swapped: a handle mapped exactly once, whole; one
 * exported to another process (cuMemExportToShareableHandle) never, nor one mapped in several
 * places or in part, or given more than NVS_VMM_ACCESS access descriptions. Those stay where
 * they are and count as memory that cannot move. Not translated: other calls that take a handle
 * (cuMemGetAllocationPropertiesFromHandle, cuMemMapArrayAsync) see the driver's view of a
 * handle that was brought back (a handle it no longer knows).
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include "area.h"
#include "compiler.h"
#include "config.h"
#include "gate.h"
#include "hook_table.h"
#include "loader.h"
#include "log.h"
#include "memory.h"
#include "notify.h"
#include "vmm.h"

#define NVS_VMM_ACCESS 4

struct handle {
    CUmemGenericAllocationHandle app;  /* what the application holds */
    CUmemGenericAllocationHandle real; /* the driver's handle, 0 while swapped out */
    size_t size;
    struct nvs_device *device;
    CUmemAllocationProp prop;
    int references;      /* the application's: cuMemCreate and retains, less releases */
    int exported;        /* shared with another process: it never moves */
    int swapped;         /* its bytes are in `area`, the device has no physical memory of it */
    struct nvs_extent *area;
    uint64_t last_used;  /* the device's swap epoch when created or last brought back */
    int moving;          /* the worker moves it: the application's calls on it wait */
};

struct mapping {
    CUdeviceptr va;
    size_t size, offset;
    CUmemGenericAllocationHandle app; /* of the handle mapped there */
    CUmemAccessDesc access[NVS_VMM_ACCESS];
    size_t n_access;     /* > NVS_VMM_ACCESS: more than can be recorded (never moves) */
};

/* Guard everything below; any thread. A leaf lock: never held across a CUDA call, I/O or
 * another lock. vmm_cv is broadcast when a move ends. */
static pthread_mutex_t vmm_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t vmm_cv = PTHREAD_COND_INITIALIZER;
static struct handle *handles;
static size_t n_handles, cap_handles;
static struct mapping *mappings;
static size_t n_mappings, cap_mappings;

static int grow(void **array, size_t *cap, size_t n, size_t size) {
    if (n < *cap) return 0;
    size_t wanted = *cap ? 2 * *cap : 16;
    void *grown = realloc(*array, wanted * size);
    if (grown == NULL) return -1;
    *array = grown;
    *cap = wanted;
    return 0;
}

/* Under vmm_mu. */
static struct handle *find_handle(CUmemGenericAllocationHandle app) {
    for (size_t i = 0; i < n_handles; i++)
        if (handles[i].app == app) return &handles[i];
    return NULL;
}

static size_t mappings_of(CUmemGenericAllocationHandle app, struct mapping **only) {
    size_t n = 0;
    for (size_t i = 0; i < n_mappings; i++)
        if (mappings[i].app == app) {
            n++;
            *only = &mappings[i];
        }
    return n;
}

/* Under vmm_mu: the handle and its one whole mapping when it may be swapped, else NULL. */
static struct handle *movable(struct handle *h, struct mapping **where) {
    struct mapping *m = NULL;
    if (!nvs_config.vmm_swap || h == NULL || h->exported || h->moving || mappings_of(h->app, &m) != 1) return NULL;
    if (m->offset != 0 || m->size != h->size || m->n_access > NVS_VMM_ACCESS) return NULL;
    *where = m;
    return h;
}

/* Under vmm_mu: wait until the worker no longer moves the handle (it may be gone then). */
static struct handle *settled(CUmemGenericAllocationHandle app) {
    struct handle *h;
    while ((h = find_handle(app)) != NULL && h->moving) pthread_cond_wait(&vmm_cv, &vmm_mu);
    return h;
}

/* Under vmm_mu: the handle is gone for the application (released, unmapped everywhere): its
 * record, its charge and its counts go. Returns what to uncharge. */
static void forget_handle(struct handle *h) {
    struct nvs_device *d = h->device;
    if (d != NULL) {
        if (!h->exported && nvs_config.vmm_swap) atomic_fetch_sub(&d->converted, h->size);
        if (h->swapped) atomic_fetch_sub(&d->swapped, h->size);
    }
    nvs_area_give(h->area);
    nvs_memory_uncharge(d, h->size);
    *h = handles[--n_handles];
}

static void forget_if_unused(CUmemGenericAllocationHandle app) {
    struct mapping *unused;
    struct handle *h = find_handle(app);
    if (h != NULL && h->references <= 0 && mappings_of(app, &unused) == 0) forget_handle(h);
}

/* The application's handle maps to swapped-out memory and it wants it now (to map or export):
 * it waits at the gate like a kernel would, and the grant brings the memory back first. */
static void wait_for_the_memory(struct nvs_device *d) {
    struct nvs_thread_state saved = nvs_tls;
    nvs_tls.device = d;
    nvs_gate_exit(nvs_gate_enter());
    nvs_tls = saved;
}

/* What the driver answered the application's call `call`: a refusal is logged (the application
 * sees it too, but often only as a message without the call's name). Running out of memory is
 * the application's to handle, and so are the refusals of a probe it expects to fail. */
static CUresult answered(const char *call, CUresult r, int expected_refusal) {
    if (r != CUDA_SUCCESS && r != CUDA_ERROR_OUT_OF_MEMORY && !expected_refusal)
        nvs_warn("%s failed with CUresult %d (the application's call, passed to the driver)", call, r);
    return r;
}

/* --- the hooks -------------------------------------------------------------------------------*/

NVS_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                                unsigned long long flags) {
    NVS_REAL_OR_FAIL(cuMemCreate);
    nvs_runtime_start();
    nvs_memory_poll_frees();
    struct nvs_device *d = NULL;
    if (prop != NULL && prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE) d = nvs_device_get(prop->location.id);
    CUresult r = nvs_memory_charge(d, size, "cuMemCreate");
    if (r != CUDA_SUCCESS) return r;
    /* The driver may give out again the value of a handle released by a swap-out, which the
     * application still holds: such a value is kept aside until another one comes. */
    CUmemGenericAllocationHandle aside[8];
    int n_aside = 0;
    for (;;) {
        r = nvs_real.cuMemCreate(handle, size, prop, flags);
        if (r != CUDA_SUCCESS || n_aside == 8) break;
        pthread_mutex_lock(&vmm_mu);
        int taken = find_handle(*handle) != NULL;
        pthread_mutex_unlock(&vmm_mu);
        if (!taken) break;
        aside[n_aside++] = *handle;
    }
    for (int i = 0; i < n_aside; i++) nvs_real.cuMemRelease(aside[i]);
    if (r != CUDA_SUCCESS) {
        nvs_memory_uncharge(d, size);
        /* PyTorch tries fabric handles first and expects a refusal where there is no fabric. */
        return answered("cuMemCreate", r, prop != NULL && (prop->requestedHandleTypes & CU_MEM_HANDLE_TYPE_FABRIC));
    }
    pthread_mutex_lock(&vmm_mu);
    int failed = grow((void **)&handles, &cap_handles, n_handles, sizeof *handles);
    if (!failed)
        handles[n_handles++] = (struct handle){.app = *handle, .real = *handle, .size = size, .device = d, .prop = *prop,
                                               .references = 1,
                                               .last_used = d != NULL ? atomic_load(&d->swap_epoch) : 0};
    pthread_mutex_unlock(&vmm_mu);
    if (failed) { /* not recorded: it stays the driver's handle, passed through, never counted */
        nvs_memory_uncharge(d, size);
        nvs_error("out of memory recording a cuMemCreate handle of %zu bytes; it is not counted", size);
        return CUDA_SUCCESS;
    }
    if (d != NULL) {
        if (nvs_config.vmm_swap) atomic_fetch_add(&d->converted, size); /* physical, but nvshare can move it */
        nvs_client_memory_changed();
    }
    static _Atomic int explained; /* any thread; the first to set it explains, once */
    if (!atomic_exchange(&explained, 1))
        nvs_info("cuMemCreate (virtual memory management) allocations stay physical device memory; %s "
                 "(NVSHARE_VMM=%s; 'hide' makes NCCL fall back to cuMemAlloc, which is converted)",
                 nvs_config.vmm_swap ? "nvshare swaps each one mapped once, whole, and not exported"
                                     : "they never move ('swap' lets nvshare swap them)",
                 nvs_config.vmm_hide ? "hide" : nvs_config.vmm_swap ? "swap" : "allow");
    return CUDA_SUCCESS;
}

NVS_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    NVS_REAL_OR_FAIL(cuMemRelease);
    pthread_mutex_lock(&vmm_mu);
    struct handle *h = settled(handle);
    if (h == NULL) {
        pthread_mutex_unlock(&vmm_mu);
        return answered("cuMemRelease", nvs_real.cuMemRelease(handle), 0);
    }
    if (h->references <= 0) {
        pthread_mutex_unlock(&vmm_mu);
        return CUDA_ERROR_INVALID_VALUE; /* released already, as the driver would say */
    }
    /* The driver's reference goes with the application's last one (its mappings keep the memory). */
    CUmemGenericAllocationHandle real = h->references == 1 && !h->swapped ? h->real : 0;
    h->moving = real != 0;
    pthread_mutex_unlock(&vmm_mu);
    CUresult r = real != 0 ? nvs_real.cuMemRelease(real) : CUDA_SUCCESS;
    pthread_mutex_lock(&vmm_mu);
    h = find_handle(handle);
    h->moving = 0;
    if (r == CUDA_SUCCESS) {
        h->references--;
        if (real != 0) h->real = 0;
        forget_if_unused(handle);
    }
    pthread_cond_broadcast(&vmm_cv);
    pthread_mutex_unlock(&vmm_mu);
    nvs_client_memory_changed();
    return answered("cuMemRelease", r, 0);
}

NVS_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                             unsigned long long flags) {
    NVS_REAL_OR_FAIL(cuMemMap);
    pthread_mutex_lock(&vmm_mu);
    struct handle *h = settled(handle);
    while (h != NULL && h->swapped) {
        struct nvs_device *d = h->device;
        pthread_mutex_unlock(&vmm_mu);
        wait_for_the_memory(d);
        pthread_mutex_lock(&vmm_mu);
        h = settled(handle);
        if (h != NULL && h->swapped) { /* the grant could not bring it back (a capture ran) */
            pthread_mutex_unlock(&vmm_mu);
            return CUDA_ERROR_NOT_READY;
        }
    }
    CUmemGenericAllocationHandle real = h != NULL ? h->real : handle;
    if (h != NULL) h->moving = 1; /* no move and no release while the driver maps it */
    pthread_mutex_unlock(&vmm_mu);
    CUresult r = answered("cuMemMap", nvs_real.cuMemMap(ptr, size, offset, real, flags), 0);
    if (h == NULL) return r;
    pthread_mutex_lock(&vmm_mu);
    h = find_handle(handle);
    h->moving = 0;
    if (r == CUDA_SUCCESS && grow((void **)&mappings, &cap_mappings, n_mappings, sizeof *mappings) == 0)
        mappings[n_mappings++] = (struct mapping){.va = ptr, .size = size, .offset = offset, .app = handle};
    else if (r == CUDA_SUCCESS)
        h->exported = 1; /* untracked mapping: it must never move */
    pthread_cond_broadcast(&vmm_cv);
    pthread_mutex_unlock(&vmm_mu);
    return r;
}

static int inside(const struct mapping *m, CUdeviceptr ptr, size_t size) {
    return m->va >= ptr && m->va - ptr < size && m->size <= size - (m->va - ptr);
}

/* Under vmm_mu: wait until no handle mapped in [ptr, ptr + size) is moving. */
static void settle_range(CUdeviceptr ptr, size_t size) {
    for (int again = 1; again;) {
        again = 0;
        for (size_t i = 0; i < n_mappings && !again; i++) {
            struct handle *h = inside(&mappings[i], ptr, size) ? find_handle(mappings[i].app) : NULL;
            if (h != NULL && h->moving) {
                pthread_cond_wait(&vmm_cv, &vmm_mu);
                again = 1;
            }
        }
    }
}

/* Under vmm_mu: copies of the mappings in [ptr, ptr + size) (at most `cap`), and whether any
 * of their handles is swapped out. */
static size_t mappings_in(CUdeviceptr ptr, size_t size, struct mapping *out, size_t cap, int *any_swapped) {
    size_t n = 0;
    *any_swapped = 0;
    for (size_t i = 0; i < n_mappings && n < cap; i++) {
        if (!inside(&mappings[i], ptr, size)) continue;
        struct handle *h = find_handle(mappings[i].app);
        *any_swapped |= h != NULL && h->swapped;
        out[n++] = mappings[i];
    }
    return n;
}

static int is_swapped(CUmemGenericAllocationHandle app) {
    struct handle *h = find_handle(app);
    return h != NULL && h->swapped;
}

#define RANGE_MAPPINGS 256 /* mappings one unmap or access call handles one by one */

NVS_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    NVS_REAL_OR_FAIL(cuMemUnmap);
    struct mapping *found = malloc(RANGE_MAPPINGS * sizeof *found);
    if (found == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    int any_swapped;
    pthread_mutex_lock(&vmm_mu);
    settle_range(ptr, size);
    size_t n = mappings_in(ptr, size, found, RANGE_MAPPINGS, &any_swapped);
    pthread_mutex_unlock(&vmm_mu);
    /* A swapped-out mapping is unmapped already: then the others are unmapped one by one. */
    CUresult r = CUDA_SUCCESS;
    size_t done = n;
    if (!any_swapped) {
        r = nvs_real.cuMemUnmap(ptr, size);
        if (r != CUDA_SUCCESS) done = 0;
    } else {
        for (done = 0; done < n; done++) {
            pthread_mutex_lock(&vmm_mu);
            int swapped = is_swapped(found[done].app);
            pthread_mutex_unlock(&vmm_mu);
            if (!swapped && (r = nvs_real.cuMemUnmap(found[done].va, found[done].size)) != CUDA_SUCCESS) break;
        }
    }
    pthread_mutex_lock(&vmm_mu);
    for (size_t k = 0; k < done; k++) {
        for (size_t i = 0; i < n_mappings; i++)
            if (mappings[i].va == found[k].va && mappings[i].app == found[k].app) {
                mappings[i] = mappings[--n_mappings];
                break;
            }
        forget_if_unused(found[k].app);
    }
    pthread_mutex_unlock(&vmm_mu);
    free(found);
    nvs_client_memory_changed();
    return answered("cuMemUnmap", r, 0);
}

NVS_EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
    NVS_REAL_OR_FAIL(cuMemSetAccess);
    struct mapping *found = malloc(RANGE_MAPPINGS * sizeof *found);
    if (found == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    int any_swapped;
    pthread_mutex_lock(&vmm_mu);
    settle_range(ptr, size);
    size_t n = mappings_in(ptr, size, found, RANGE_MAPPINGS, &any_swapped);
    pthread_mutex_unlock(&vmm_mu);
    CUresult r = CUDA_SUCCESS;
    if (!any_swapped) {
        r = nvs_real.cuMemSetAccess(ptr, size, desc, count);
    } else { /* a swapped-out mapping gets it when it is brought back */
        for (size_t k = 0; k < n && r == CUDA_SUCCESS; k++) {
            pthread_mutex_lock(&vmm_mu);
            int swapped = is_swapped(found[k].app);
            pthread_mutex_unlock(&vmm_mu);
            if (!swapped) r = nvs_real.cuMemSetAccess(found[k].va, found[k].size, desc, count);
        }
    }
    pthread_mutex_lock(&vmm_mu);
    for (size_t i = 0; i < n_mappings && r == CUDA_SUCCESS; i++) {
        struct mapping *m = &mappings[i];
        if (!inside(m, ptr, size)) continue;
        m->n_access = count;
        if (desc != NULL && count <= NVS_VMM_ACCESS) memcpy(m->access, desc, count * sizeof *desc);
    }
    pthread_mutex_unlock(&vmm_mu);
    free(found);
    return answered("cuMemSetAccess", r, 0);
}

NVS_EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr) {
    NVS_REAL_OR_FAIL(cuMemRetainAllocationHandle);
    if (handle == NULL) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&vmm_mu);
    for (size_t i = 0; i < n_mappings; i++) {
        struct mapping *m = &mappings[i];
        if ((CUdeviceptr)(uintptr_t)addr < m->va || (CUdeviceptr)(uintptr_t)addr - m->va >= m->size) continue;
        struct handle *h = find_handle(m->app);
        if (h == NULL) break;
        h->references++; /* nvshare's driver reference stands for it */
        *handle = h->app;
        pthread_mutex_unlock(&vmm_mu);
        return CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&vmm_mu);
    return nvs_real.cuMemRetainAllocationHandle(handle, addr);
}

NVS_EXPORT CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                                 CUmemAllocationHandleType handleType, unsigned long long flags) {
    NVS_REAL_OR_FAIL(cuMemExportToShareableHandle);
    pthread_mutex_lock(&vmm_mu);
    struct handle *h = settled(handle);
    if (h != NULL && h->swapped) {
        struct nvs_device *d = h->device;
        pthread_mutex_unlock(&vmm_mu);
        wait_for_the_memory(d);
        pthread_mutex_lock(&vmm_mu);
        h = settled(handle);
        if (h != NULL && h->swapped) {
            pthread_mutex_unlock(&vmm_mu);
            return CUDA_ERROR_NOT_READY;
        }
    }
    CUmemGenericAllocationHandle real = handle;
    if (h != NULL) {
        real = h->real;
        /* Another process may map it from now on: it never moves again. */
        if (!h->exported && h->device != NULL && nvs_config.vmm_swap) atomic_fetch_sub(&h->device->converted, h->size);
        h->exported = 1;
    }
    pthread_mutex_unlock(&vmm_mu);
    nvs_client_memory_changed();
    return answered("cuMemExportToShareableHandle",
                    nvs_real.cuMemExportToShareableHandle(shareableHandle, real, handleType, flags), 0);
}

/* --- swapping (swap.c) ------------------------------------------------------------------------*/

size_t nvs_vmm_swappable(struct nvs_device *d, int swapped, struct nvs_swappable **out) {
    size_t n = 0;
    *out = NULL;
    pthread_mutex_lock(&vmm_mu);
    struct nvs_swappable *items = n_handles > 0 ? malloc(n_handles * sizeof *items) : NULL;
    for (size_t i = 0; items != NULL && i < n_handles; i++) {
        struct handle *h = &handles[i];
        struct mapping *m = NULL;
        if (h->device != d || h->swapped != swapped || movable(h, &m) == NULL) continue;
        items[n++] = (struct nvs_swappable){.vmm = 1, .key = h->app, .ptr = m->va, .size = h->size,
                                            .last_used = h->last_used, .area = h->area};
    }
    pthread_mutex_unlock(&vmm_mu);
    *out = items;
    return n;
}

int nvs_vmm_release_physical(const struct nvs_swappable *item) {
    pthread_mutex_lock(&vmm_mu);
    struct mapping *m = NULL;
    struct handle *h = movable(find_handle(item->key), &m);
    if (h == NULL || h->swapped || m->va != item->ptr) {
        pthread_mutex_unlock(&vmm_mu);
        return -1;
    }
    h->moving = 1;
    CUmemGenericAllocationHandle real = h->real;
    pthread_mutex_unlock(&vmm_mu);
    CUresult r = nvs_real.cuMemUnmap(item->ptr, item->size);
    if (r == CUDA_SUCCESS && real != 0) {
        CUresult released = nvs_real.cuMemRelease(real);
        if (released != CUDA_SUCCESS) nvs_warn("releasing a swapped-out VMM handle failed (%d)", released);
    }
    pthread_mutex_lock(&vmm_mu);
    h = find_handle(item->key);
    h->moving = 0;
    if (r == CUDA_SUCCESS) {
        h->swapped = 1;
        h->real = 0;
        h->area = item->area;
    }
    pthread_cond_broadcast(&vmm_cv);
    pthread_mutex_unlock(&vmm_mu);
    if (r != CUDA_SUCCESS) nvs_warn("unmapping a VMM mapping to swap it out failed (%d): it stays", r);
    return r == CUDA_SUCCESS ? 0 : -1;
}

int nvs_vmm_restore_physical(const struct nvs_swappable *item, struct nvs_extent **area) {
    *area = NULL;
    pthread_mutex_lock(&vmm_mu);
    struct handle *h = settled(item->key);
    struct mapping *m = NULL;
    if (h == NULL || !h->swapped || mappings_of(h->app, &m) != 1) {
        pthread_mutex_unlock(&vmm_mu);
        return -1;
    }
    h->moving = 1; /* until nvs_vmm_restored: the bytes are not back yet */
    CUmemAllocationProp prop = h->prop;
    struct mapping where = *m;
    int release = h->references <= 0;
    pthread_mutex_unlock(&vmm_mu);
    CUmemGenericAllocationHandle real = 0;
    CUresult r = nvs_real.cuMemCreate(&real, item->size, &prop, 0);
    if (r == CUDA_SUCCESS) {
        r = nvs_real.cuMemMap(where.va, where.size, 0, real, 0);
        if (r == CUDA_SUCCESS && where.n_access > 0) r = nvs_real.cuMemSetAccess(where.va, where.size, where.access,
                                                                                 where.n_access);
        if (r != CUDA_SUCCESS) nvs_real.cuMemUnmap(where.va, where.size);
        if (r != CUDA_SUCCESS || release) { /* released by the application: its mapping keeps it */
            nvs_real.cuMemRelease(real);
            if (r == CUDA_SUCCESS) real = 0;
        }
    }
    pthread_mutex_lock(&vmm_mu);
    h = find_handle(item->key);
    if (r == CUDA_SUCCESS) {
        h->real = real;
        *area = h->area;
        h->area = NULL;
    } else {
        h->moving = 0;
        pthread_cond_broadcast(&vmm_cv);
    }
    pthread_mutex_unlock(&vmm_mu);
    if (r != CUDA_SUCCESS) nvs_warn("bringing back a swapped-out VMM mapping failed (%d): it stays on the host", r);
    return r == CUDA_SUCCESS ? 0 : -1;
}

void nvs_vmm_restored(const struct nvs_swappable *item, uint64_t last_used) {
    pthread_mutex_lock(&vmm_mu);
    struct handle *h = find_handle(item->key);
    if (h != NULL) {
        h->swapped = 0;
        h->moving = 0;
        h->last_used = last_used;
    }
    pthread_cond_broadcast(&vmm_cv);
    pthread_mutex_unlock(&vmm_mu);
}

void nvs_vmm_reset_after_fork(void) {
    /* The child has no handles of its own (physical memory is not inherited). */
    pthread_mutex_init(&vmm_mu, NULL);
    pthread_cond_init(&vmm_cv, NULL);
    free(handles);
    free(mappings);
    handles = NULL;
    mappings = NULL;
    n_handles = cap_handles = n_mappings = cap_mappings = 0;
}
