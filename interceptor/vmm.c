/*
 * Virtual memory management (cuMemCreate / cuMemMap): physical device memory that the
 * application maps itself (PyTorch with expandable_segments:True, NCCL, JAX's default
 * allocator). nvshare cannot make it managed memory. It is counted in memory reports (and against
 * limits and admission), and with NVSHARE_VMM=swap (the default) swapped handle by handle
 * (docs/interceptor.md, "Swapping"): its bytes are copied to the pinned swap area, it is unmapped
 * and its physical handle released, so the device really has the room; before the process runs
 * again a new handle is created, mapped at the same address with the same access, and the bytes
 * are copied back. With NVSHARE_VMM=allow it never moves.
 *
 * Handles. The application never sees the driver's handle values: cuMemCreate answers a value of
 * nvshare's own (NVS_HANDLE_TAG, never reused in the process), and every hook that takes one
 * translates it to the driver handle that stands for it now (cuMemRelease, cuMemMap,
 * cuMemExportToShareableHandle, cuMemGetAllocationPropertiesFromHandle, cuMemMapArrayAsync,
 * cuMulticastBindMem); cuMemRetainAllocationHandle answers it, and cuMemGetAddressRange answers
 * for a swapped-out mapping (NCCL frees a buffer by retain, range, unmap, release). Why: a swapped-out handle's driver
 * handle is released, and the driver gives its value out again (on an H200 within a few
 * cuMemCreate calls: the value is the address of the driver's record), while the application
 * still holds it. Keeping the driver's values meant telling a new handle from an old one by value:
 * a new handle that came back with an old one's value was mapped as the old one (its tensors
 * written over the old ones') as soon as more than eight handles were out (issue 31). A value of
 * nvshare's kind that names no live handle is refused with CUDA_ERROR_INVALID_VALUE without
 * reaching the driver (which dereferences handle values: cuMemMap of a released one crashed).
 * Values that are not nvshare's (cuMemImportFromShareableHandle's, multicast objects') pass
 * through untouched: they name memory nvshare did not create and never moves.
 *
 * nvshare holds the one driver reference of a handle and counts the application's (cuMemCreate,
 * retains, releases) itself; the driver's goes with the application's last. What is swapped: a
 * handle mapped exactly once, whole, with its access recorded (per device, merged across
 * cuMemSetAccess calls: NCCL gives each device access in a call of its own). A handle exported
 * to another process, bound to a multicast object or mapped into a CUDA array never moves; nor
 * one mapped in several places or in part. Those count as memory that cannot move.
 *
 * Ranges. cuMemUnmap and cuMemSetAccess take a range that may hold several mappings (PyTorch sets
 * access over a run of handles at once): a swapped-out mapping in it has no driver mapping, so the
 * range is passed to the driver in the pieces between swapped-out mappings (the driver takes gaps,
 * measured), and a swapped-out mapping gets its access when it is brought back. While a hook works
 * on a handle with the driver, the worker does not move it, and the other way round (`moving`).
 *
 * Every hook call is logged at debug level (`vmm:` lines: handles, driver handles, ranges), and a
 * refusal by the driver as a warning naming the call.
 *
 * Over 600 lines: the hooks and the swap engine's side share the tables and their lock, and each
 * hook is a few lines of translation around one driver call.
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

/* Devices whose access a movable mapping may record (one per device of a node). */
#define NVS_VMM_ACCESS 8
/* nvshare's handle values: the tag in the top bits (above any address a driver record may have
 * in an x86-64 or aarch64 process), a counter below. */
#define NVS_HANDLE_TAG 0x4e56530000000000ULL /* "NVS" */
#define NVS_HANDLE_TAG_MASK 0xffffff0000000000ULL

#define vmm_debug(...) nvs_debug("vmm: " __VA_ARGS__)

struct handle {
    CUmemGenericAllocationHandle app;  /* nvshare's value, what the application holds */
    CUmemGenericAllocationHandle real; /* the driver's; 0 while swapped out, or once the
                                        * application released it (its mapping keeps the memory) */
    size_t size;
    struct nvs_device *device;
    CUmemAllocationProp prop;
    int references;      /* the application's: cuMemCreate and retains, less releases */
    int immovable;       /* exported, bound to a multicast object, mapped into an array, or a
                          * mapping could not be recorded: it never moves (nor counts as movable) */
    int swapped;         /* its bytes are in `area`, the device has no physical memory of it */
    struct nvs_extent *area;
    uint64_t last_used;  /* the device's swap epoch when created or last brought back */
    int moving;          /* the worker moves it or a hook works on it with the driver: others wait */
};

struct mapping {
    CUdeviceptr va;
    size_t size, offset;
    CUmemGenericAllocationHandle app; /* of the handle mapped there */
    CUmemAccessDesc access[NVS_VMM_ACCESS]; /* per location, the latest flags given */
    size_t n_access;
    int access_unknown;  /* more locations than recorded, or access given to part of it */
};

/* Guard everything below; any thread. Never held across a CUDA call or I/O
 * (tests/test_library_hygiene.py checks it); under it only the swap area's lock is taken, to give
 * a forgotten handle's place back. vmm_cv is broadcast when a move ends. */
static pthread_mutex_t vmm_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t vmm_cv = PTHREAD_COND_INITIALIZER;
static struct handle *handles;
static size_t n_handles, cap_handles;
static struct mapping *mappings;
static size_t n_mappings, cap_mappings;
static uint64_t handles_made; /* nvshare's values handed out so far */

static int grow(void **array, size_t *cap, size_t n, size_t size) {
    if (n < *cap) return 0;
    size_t wanted = *cap ? 2 * *cap : 16;
    void *grown = realloc(*array, wanted * size);
    if (grown == NULL) return -1;
    *array = grown;
    *cap = wanted;
    return 0;
}

static int is_ours(CUmemGenericAllocationHandle value) { return (value & NVS_HANDLE_TAG_MASK) == NVS_HANDLE_TAG; }

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

static int counts_as_movable(const struct handle *h) { return nvs_config.vmm_swap && !h->immovable; }

/* Under vmm_mu: the handle and its one whole mapping when it may be swapped, else NULL. */
static struct handle *movable(struct handle *h, struct mapping **where) {
    struct mapping *m = NULL;
    if (h == NULL || !counts_as_movable(h) || h->moving || mappings_of(h->app, &m) != 1) return NULL;
    if (m->offset != 0 || m->size != h->size || m->access_unknown) return NULL;
    *where = m;
    return h;
}

/* Under vmm_mu: it never moves from now on (counted as memory that cannot move). */
static void make_immovable(struct handle *h) {
    if (counts_as_movable(h) && h->device != NULL) atomic_fetch_sub(&h->device->converted, h->size);
    h->immovable = 1;
}

/* Under vmm_mu: wait until nothing works on the handle (it may be gone then). */
static struct handle *settled(CUmemGenericAllocationHandle app) {
    struct handle *h;
    while ((h = find_handle(app)) != NULL && h->moving) pthread_cond_wait(&vmm_cv, &vmm_mu);
    return h;
}

/* Under vmm_mu: a move or a hook's driver call on the handle is over. */
static void end_move(CUmemGenericAllocationHandle app) {
    struct handle *h = find_handle(app);
    if (h != NULL) h->moving = 0;
    pthread_cond_broadcast(&vmm_cv);
}

/* Under vmm_mu: the handle is gone for the application (released, unmapped everywhere): its
 * record, its charge and its counts go. Returns its place in the swap area (NULL: none), which
 * the caller gives back once it let vmm_mu go (giving a pool segment back may log). */
static struct nvs_extent *forget_handle(struct handle *h) {
    struct nvs_device *d = h->device;
    struct nvs_extent *area = h->area;
    if (d != NULL) {
        if (counts_as_movable(h)) atomic_fetch_sub(&d->converted, h->size);
        if (h->swapped) atomic_fetch_sub(&d->swapped, h->size);
    }
    nvs_memory_uncharge(d, h->size);
    *h = handles[--n_handles];
    return area;
}

/* Under vmm_mu: forget_handle when the application has no reference and no mapping left. */
static struct nvs_extent *forget_if_unused(CUmemGenericAllocationHandle app) {
    struct mapping *unused;
    struct handle *h = find_handle(app);
    return h != NULL && h->references <= 0 && mappings_of(app, &unused) == 0 ? forget_handle(h) : NULL;
}

/* The application's handle maps to swapped-out memory and it wants it now (to map, export or
 * bind it): it waits at the gate like a kernel would, and the grant brings the memory back first. */
static void wait_for_the_memory(struct nvs_device *d) {
    struct nvs_thread_state saved = nvs_tls;
    nvs_tls.device = d;
    nvs_gate_exit(nvs_gate_enter());
    nvs_tls = saved;
}

/* Under vmm_mu, which it may let go meanwhile: the live handle `app` names, settled and resident
 * (waiting for a grant when it is swapped out, if `resident`), claimed for the caller's driver
 * call (end_move ends it). NULL with *r set: CUDA_ERROR_INVALID_VALUE for a value of nvshare's that
 * names no live handle, CUDA_ERROR_NOT_READY when the grant could not bring it back (a capture
 * ran); NULL with *r = CUDA_SUCCESS: not nvshare's value, for the driver as it is. */
static struct handle *claim(CUmemGenericAllocationHandle app, int resident, CUresult *r) {
    *r = CUDA_SUCCESS;
    if (!is_ours(app)) return NULL;
    struct handle *h = settled(app);
    for (int waited = 0; h != NULL && h->references > 0 && resident && h->swapped; waited = 1) {
        if (waited) {
            *r = CUDA_ERROR_NOT_READY;
            return NULL;
        }
        struct nvs_device *d = h->device;
        pthread_mutex_unlock(&vmm_mu);
        wait_for_the_memory(d);
        pthread_mutex_lock(&vmm_mu);
        h = settled(app);
    }
    if (h == NULL || h->references <= 0) { /* released already, as the driver would say */
        *r = CUDA_ERROR_INVALID_VALUE;
        return NULL;
    }
    h->moving = 1;
    return h;
}

/* What the driver answered the application's call `call`: a refusal is logged (the application
 * sees it too, but often only as a message without the call's name). Running out of memory is
 * the application's to handle, and so are the refusals of a probe it expects to fail. */
static CUresult answered(const char *call, CUresult r, int expected_refusal) {
    if (r != CUDA_SUCCESS && r != CUDA_ERROR_OUT_OF_MEMORY && !expected_refusal)
        nvs_warn("%s failed with CUresult %d (the application's call, passed to the driver)", call, r);
    return r;
}

/* --- the hooks: handles --------------------------------------------------------------------------*/

NVS_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                                unsigned long long flags) {
    NVS_REAL_OR_FAIL(cuMemCreate);
    if (handle == NULL || prop == NULL) return CUDA_ERROR_INVALID_VALUE;
    nvs_runtime_start();
    nvs_memory_poll_frees();
    struct nvs_device *d = NULL;
    if (prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE) d = nvs_device_get(prop->location.id);
    CUresult r = nvs_memory_charge(d, size, "cuMemCreate");
    if (r != CUDA_SUCCESS) return r;
    CUmemGenericAllocationHandle real = 0;
    r = nvs_real.cuMemCreate(&real, size, prop, flags);
    if (r != CUDA_SUCCESS) {
        nvs_memory_uncharge(d, size);
        vmm_debug("cuMemCreate(%zu bytes) = %d", size, r);
        /* PyTorch tries fabric handles first and expects a refusal where there is no fabric. */
        return answered("cuMemCreate", r, (prop->requestedHandleTypes & CU_MEM_HANDLE_TYPE_FABRIC) != 0);
    }
    pthread_mutex_lock(&vmm_mu);
    CUmemGenericAllocationHandle app = NVS_HANDLE_TAG | ++handles_made;
    int failed = grow((void **)&handles, &cap_handles, n_handles, sizeof *handles);
    if (!failed)
        handles[n_handles++] = (struct handle){.app = app, .real = real, .size = size, .device = d, .prop = *prop,
                                               .references = 1,
                                               .last_used = d != NULL ? atomic_load(&d->swap_epoch) : 0};
    pthread_mutex_unlock(&vmm_mu);
    if (failed) {
        nvs_real.cuMemRelease(real);
        nvs_memory_uncharge(d, size);
        nvs_error("out of host memory recording a cuMemCreate handle of %zu bytes; returning CUDA_ERROR_OUT_OF_MEMORY",
                  size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (d != NULL) {
        if (nvs_config.vmm_swap) atomic_fetch_add(&d->converted, size); /* physical, but nvshare can move it */
        nvs_client_memory_changed();
    }
    *handle = app;
    vmm_debug("cuMemCreate(%zu bytes, device %d) -> handle %#llx (driver %#llx)", size, d != NULL ? d->ordinal : -1,
              app, real);
    static _Atomic int explained; /* any thread; the first to set it explains, once */
    static const char swaps[] = "nvshare swaps each one mapped once, whole, and not exported";
    if (!atomic_exchange(&explained, 1)) {
        const char *policy = nvs_config.vmm_hide ? "NVSHARE_VMM=hide: the device says it has no VMM, so NCCL falls "
                                                   "back to cuMemAlloc, which is converted"
                             : nvs_config.vmm_swap ? "NVSHARE_VMM=swap, the default; 'allow' keeps them where they are"
                                                   : "NVSHARE_VMM=allow; the default, 'swap', swaps them";
        nvs_info("cuMemCreate (virtual memory management) allocations stay physical device memory; %s (%s)",
                 nvs_config.vmm_swap ? swaps : "they never move", policy);
    }
    return CUDA_SUCCESS;
}

NVS_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    NVS_REAL_OR_FAIL(cuMemRelease);
    CUresult r;
    pthread_mutex_lock(&vmm_mu);
    struct handle *h = claim(handle, 0, &r);
    if (h == NULL) {
        pthread_mutex_unlock(&vmm_mu);
        if (r == CUDA_SUCCESS) r = answered("cuMemRelease", nvs_real.cuMemRelease(handle), 0);
        vmm_debug("cuMemRelease(handle %#llx) = %d", handle, r);
        return r;
    }
    /* The driver's reference goes with the application's last one (its mappings keep the memory). */
    CUmemGenericAllocationHandle real = h->references == 1 ? h->real : 0;
    pthread_mutex_unlock(&vmm_mu);
    r = real != 0 ? nvs_real.cuMemRelease(real) : CUDA_SUCCESS;
    pthread_mutex_lock(&vmm_mu);
    h = find_handle(handle);
    if (r == CUDA_SUCCESS) {
        h->references--;
        if (real != 0) h->real = 0;
    }
    end_move(handle);
    struct nvs_extent *gone = forget_if_unused(handle);
    pthread_mutex_unlock(&vmm_mu);
    nvs_area_give(gone);
    nvs_client_memory_changed();
    vmm_debug("cuMemRelease(handle %#llx, driver %#llx) = %d", handle, real, r);
    return answered("cuMemRelease", r, 0);
}

NVS_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                             unsigned long long flags) {
    NVS_REAL_OR_FAIL(cuMemMap);
    CUresult r;
    pthread_mutex_lock(&vmm_mu);
    struct handle *h = claim(handle, 1, &r);
    CUmemGenericAllocationHandle real = h != NULL ? h->real : handle;
    pthread_mutex_unlock(&vmm_mu);
    if (h == NULL && r != CUDA_SUCCESS) {
        vmm_debug("cuMemMap(%#llx, %zu bytes, handle %#llx) = %d", (unsigned long long)ptr, size, handle, r);
        return r;
    }
    r = answered("cuMemMap", nvs_real.cuMemMap(ptr, size, offset, real, flags), 0);
    vmm_debug("cuMemMap(%#llx, %zu bytes, offset %zu, handle %#llx, driver %#llx) = %d", (unsigned long long)ptr,
              size, offset, handle, real, r);
    if (h == NULL) return r;
    pthread_mutex_lock(&vmm_mu);
    if (r == CUDA_SUCCESS && grow((void **)&mappings, &cap_mappings, n_mappings, sizeof *mappings) == 0)
        mappings[n_mappings++] = (struct mapping){.va = ptr, .size = size, .offset = offset, .app = handle};
    else if (r == CUDA_SUCCESS)
        make_immovable(find_handle(handle)); /* an untracked mapping: it must never move */
    end_move(handle);
    pthread_mutex_unlock(&vmm_mu);
    return r;
}

NVS_EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr) {
    NVS_REAL_OR_FAIL(cuMemRetainAllocationHandle);
    if (handle == NULL) return CUDA_ERROR_INVALID_VALUE;
    CUdeviceptr at = (CUdeviceptr)(uintptr_t)addr;
    pthread_mutex_lock(&vmm_mu);
    struct handle *h = NULL;
    for (size_t i = 0; i < n_mappings && h == NULL; i++)
        if (at >= mappings[i].va && at - mappings[i].va < mappings[i].size) h = find_handle(mappings[i].app);
    CUmemGenericAllocationHandle app = h != NULL ? h->app : 0;
    if (h != NULL) h = settled(app);
    /* Released by the application and mapped: nvshare holds no driver reference any more. */
    int retain_real = h != NULL && h->real == 0 && !h->swapped;
    if (retain_real) h->moving = 1;
    pthread_mutex_unlock(&vmm_mu);
    if (h == NULL) {
        CUresult r = nvs_real.cuMemRetainAllocationHandle(handle, addr);
        vmm_debug("cuMemRetainAllocationHandle(%p) = %d, not nvshare's: driver %#llx", addr, r, r == 0 ? *handle : 0);
        return r;
    }
    CUmemGenericAllocationHandle real = 0;
    CUresult r = retain_real ? nvs_real.cuMemRetainAllocationHandle(&real, addr) : CUDA_SUCCESS;
    pthread_mutex_lock(&vmm_mu);
    h = find_handle(app);
    if (r == CUDA_SUCCESS) {
        h->references++; /* nvshare's driver reference stands for it */
        if (retain_real) h->real = real;
        *handle = app;
    }
    if (retain_real) end_move(app);
    pthread_mutex_unlock(&vmm_mu);
    vmm_debug("cuMemRetainAllocationHandle(%p) = %d: handle %#llx", addr, r, app);
    return answered("cuMemRetainAllocationHandle", r, 0);
}

NVS_EXPORT CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                                 CUmemAllocationHandleType handleType, unsigned long long flags) {
    NVS_REAL_OR_FAIL(cuMemExportToShareableHandle);
    CUresult r;
    pthread_mutex_lock(&vmm_mu);
    struct handle *h = claim(handle, 1, &r);
    CUmemGenericAllocationHandle real = h != NULL ? h->real : handle;
    if (h != NULL) make_immovable(h); /* another process may map it from now on */
    pthread_mutex_unlock(&vmm_mu);
    if (h == NULL && r != CUDA_SUCCESS) return r;
    nvs_client_memory_changed();
    r = answered("cuMemExportToShareableHandle", nvs_real.cuMemExportToShareableHandle(shareableHandle, real,
                                                                                       handleType, flags), 0);
    vmm_debug("cuMemExportToShareableHandle(handle %#llx, driver %#llx, type %d) = %d", handle, real, handleType, r);
    if (h != NULL) {
        pthread_mutex_lock(&vmm_mu);
        end_move(handle);
        pthread_mutex_unlock(&vmm_mu);
    }
    return r;
}

NVS_EXPORT CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop,
                                                           CUmemGenericAllocationHandle handle) {
    NVS_REAL_OR_FAIL(cuMemGetAllocationPropertiesFromHandle);
    if (prop == NULL) return CUDA_ERROR_INVALID_VALUE;
    CUresult r;
    pthread_mutex_lock(&vmm_mu);
    struct handle *h = claim(handle, 0, &r);
    CUmemGenericAllocationHandle real = h != NULL ? h->real : handle;
    if (h != NULL && real == 0) *prop = h->prop; /* swapped out: as it was created */
    pthread_mutex_unlock(&vmm_mu);
    if (h == NULL && r != CUDA_SUCCESS) return r;
    if (real != 0) r = answered("cuMemGetAllocationPropertiesFromHandle",
                                nvs_real.cuMemGetAllocationPropertiesFromHandle(prop, real), 0);
    vmm_debug("cuMemGetAllocationPropertiesFromHandle(handle %#llx, driver %#llx) = %d", handle, real, r);
    if (h != NULL) {
        pthread_mutex_lock(&vmm_mu);
        end_move(handle);
        pthread_mutex_unlock(&vmm_mu);
    }
    return r;
}

/* A call that binds or maps a handle somewhere else (a sparse array, a multicast object): the
 * handle's driver value, the handle made immovable and resident first (CUDA_SUCCESS with
 * *real = value for a value that is not nvshare's). When it succeeds the caller ends the claim
 * with bind_done. */
static CUresult bind_handle(CUmemGenericAllocationHandle value, CUmemGenericAllocationHandle *real) {
    CUresult r;
    pthread_mutex_lock(&vmm_mu);
    struct handle *h = claim(value, 1, &r);
    *real = h != NULL ? h->real : value;
    if (h != NULL) make_immovable(h);
    pthread_mutex_unlock(&vmm_mu);
    if (h != NULL) nvs_client_memory_changed();
    return r;
}

static void bind_done(CUmemGenericAllocationHandle value) {
    if (!is_ours(value)) return;
    pthread_mutex_lock(&vmm_mu);
    end_move(value);
    pthread_mutex_unlock(&vmm_mu);
}

#define MAP_ARRAY_MAX 256 /* entries of one cuMemMapArrayAsync call nvshare translates */

static int maps_a_handle(const CUarrayMapInfo *entry) {
    return entry->memOperationType == CU_MEM_OPERATION_TYPE_MAP && entry->memHandleType == CU_MEM_HANDLE_TYPE_GENERIC;
}

static CUresult map_array(CUresult (*real_fn)(CUarrayMapInfo *, unsigned int, CUstream), const char *call,
                          CUarrayMapInfo *list, unsigned int count, CUstream stream) {
    if (list == NULL || count == 0 || count > MAP_ARRAY_MAX) return real_fn(list, count, stream);
    CUarrayMapInfo *copy = malloc(count * sizeof *copy);
    if (copy == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    memcpy(copy, list, count * sizeof *copy);
    CUresult r = CUDA_SUCCESS;
    unsigned int bound = 0; /* entries [0, bound) translated (and their handles claimed) */
    for (; bound < count; bound++) {
        CUarrayMapInfo *entry = &copy[bound];
        if (maps_a_handle(entry) && (r = bind_handle(entry->memHandle.memHandle, &entry->memHandle.memHandle)) != 0)
            break;
    }
    if (r == CUDA_SUCCESS) r = answered(call, real_fn(copy, count, stream), 0);
    for (unsigned int i = 0; i < bound; i++)
        if (maps_a_handle(&list[i])) bind_done(list[i].memHandle.memHandle);
    vmm_debug("%s(%u mappings, first handle %#llx, driver %#llx) = %d", call, count, list[0].memHandle.memHandle,
              copy[0].memHandle.memHandle, r);
    free(copy);
    return r;
}

NVS_EXPORT CUresult cuMemMapArrayAsync(CUarrayMapInfo *mapInfoList, unsigned int count, CUstream hStream) {
    NVS_REAL_OR_FAIL(cuMemMapArrayAsync);
    return map_array(nvs_real.cuMemMapArrayAsync, "cuMemMapArrayAsync", mapInfoList, count, hStream);
}

NVS_EXPORT CUresult cuMemMapArrayAsync_ptsz(CUarrayMapInfo *mapInfoList, unsigned int count, CUstream hStream) {
    NVS_REAL_OR_FAIL(cuMemMapArrayAsync_ptsz);
    return map_array(nvs_real.cuMemMapArrayAsync_ptsz, "cuMemMapArrayAsync_ptsz", mapInfoList, count, hStream);
}

NVS_EXPORT CUresult cuMulticastBindMem(CUmemGenericAllocationHandle mcHandle, size_t mcOffset,
                                       CUmemGenericAllocationHandle memHandle, size_t memOffset, size_t size,
                                       unsigned long long flags) {
    NVS_REAL_OR_FAIL(cuMulticastBindMem);
    CUmemGenericAllocationHandle real;
    CUresult r = bind_handle(memHandle, &real);
    if (r != CUDA_SUCCESS) return r;
    r = answered("cuMulticastBindMem", nvs_real.cuMulticastBindMem(mcHandle, mcOffset, real, memOffset, size, flags),
                 0);
    bind_done(memHandle);
    vmm_debug("cuMulticastBindMem(handle %#llx, driver %#llx) = %d", memHandle, real, r);
    return r;
}

NVS_EXPORT CUresult cuMulticastBindMem_v2(CUmemGenericAllocationHandle mcHandle, CUdevice dev, size_t mcOffset,
                                          CUmemGenericAllocationHandle memHandle, size_t memOffset, size_t size,
                                          unsigned long long flags) {
    NVS_REAL_OR_FAIL(cuMulticastBindMem_v2);
    CUmemGenericAllocationHandle real;
    CUresult r = bind_handle(memHandle, &real);
    if (r != CUDA_SUCCESS) return r;
    r = answered("cuMulticastBindMem_v2",
                 nvs_real.cuMulticastBindMem_v2(mcHandle, dev, mcOffset, real, memOffset, size, flags), 0);
    bind_done(memHandle);
    vmm_debug("cuMulticastBindMem_v2(handle %#llx, driver %#llx) = %d", memHandle, real, r);
    return r;
}

/* --- the hooks: ranges ---------------------------------------------------------------------------*/

static int overlaps(const struct mapping *m, CUdeviceptr ptr, size_t size) {
    return m->va < ptr + size && ptr < m->va + m->size;
}

static int inside(const struct mapping *m, CUdeviceptr ptr, size_t size) {
    return m->va >= ptr && m->va - ptr < size && m->size <= size - (m->va - ptr);
}

/* An application's call on an address range, and the recorded mappings it touches. */
struct range {
    CUdeviceptr ptr;
    size_t size;
    struct mapping *found; /* copies */
    size_t n;
    int any_swapped;
};

/* Under vmm_mu, which it lets go while it waits: the mappings overlapping the range, once none of
 * their handles is moving, their handles claimed (end_range ends it). */
static void claim_range(struct range *range) {
    for (int again = 1; again;) {
        again = 0;
        for (size_t i = 0; i < n_mappings && !again; i++) {
            struct handle *h = overlaps(&mappings[i], range->ptr, range->size) ? find_handle(mappings[i].app) : NULL;
            if (h != NULL && h->moving) {
                pthread_cond_wait(&vmm_cv, &vmm_mu);
                again = 1;
            }
        }
    }
    range->n = 0;
    range->any_swapped = 0;
    for (size_t i = 0; i < n_mappings; i++) {
        if (!overlaps(&mappings[i], range->ptr, range->size)) continue;
        struct mapping *grown = range->found;
        if (range->n % 16 == 0) grown = realloc(range->found, (range->n + 16) * sizeof *grown);
        if (grown == NULL) break; /* unrecorded: the driver's answer for it is the range's */
        range->found = grown;
        range->found[range->n++] = mappings[i];
        struct handle *h = find_handle(mappings[i].app);
        if (h != NULL) {
            h->moving = 1;
            range->any_swapped |= h->swapped;
        }
    }
}

static void end_range(struct range *range) {
    for (size_t i = 0; i < range->n; i++) end_move(range->found[i].app);
    free(range->found);
}

static int swapped_out(CUmemGenericAllocationHandle app) {
    struct handle *h = find_handle(app);
    return h != NULL && h->swapped;
}

static int by_address(const void *x, const void *y) {
    const struct mapping *a = x, *b = y;
    return a->va < b->va ? -1 : a->va > b->va;
}

static CUdeviceptr clamp(CUdeviceptr x, CUdeviceptr low, CUdeviceptr high) {
    return x < low ? low : x > high ? high : x;
}

/* `call` on each piece of the range between its swapped-out mappings (they have no driver mapping;
 * found[] sorted by address, swapped[i] saying which), under no lock: the first failure's
 * CUresult, and in *done how far (an address) the range is done: up to the piece that failed. */
static CUresult in_pieces(const struct range *range, const int *swapped,
                          CUresult (*call)(CUdeviceptr, size_t, void *), void *argument, CUdeviceptr *done) {
    CUdeviceptr at = range->ptr, end = range->ptr + range->size;
    for (size_t i = 0; i <= range->n; i++) {
        if (i < range->n && !swapped[i]) continue;
        CUdeviceptr until = i < range->n ? clamp(range->found[i].va, at, end) : end;
        CUresult r = until > at ? call(at, until - at, argument) : CUDA_SUCCESS;
        if (r != CUDA_SUCCESS) {
            *done = at;
            return r;
        }
        if (i < range->n) at = clamp(range->found[i].va + range->found[i].size, at, end);
    }
    *done = end;
    return CUDA_SUCCESS;
}

static CUresult unmap_piece(CUdeviceptr ptr, size_t size, void *unused) {
    (void)unused;
    return nvs_real.cuMemUnmap(ptr, size);
}

struct access_call {
    const CUmemAccessDesc *desc;
    size_t count;
};

static CUresult access_piece(CUdeviceptr ptr, size_t size, void *argument) {
    const struct access_call *a = argument;
    return nvs_real.cuMemSetAccess(ptr, size, a->desc, a->count);
}

/* Under vmm_mu, the range claimed: its mappings sorted by address, and which of them are swapped
 * out (the caller frees it; NULL: no memory). */
static int *prepare_pieces(struct range *range) {
    int *swapped = calloc(range->n + 1, sizeof *swapped);
    if (swapped == NULL) return NULL;
    qsort(range->found, range->n, sizeof *range->found, by_address);
    for (size_t i = 0; i < range->n; i++) swapped[i] = swapped_out(range->found[i].app);
    return swapped;
}

/* Under vmm_mu: forget the recorded mapping at m's place. */
static void remove_mapping(const struct mapping *m) {
    for (size_t i = 0; i < n_mappings; i++)
        if (mappings[i].va == m->va && mappings[i].app == m->app) {
            mappings[i] = mappings[--n_mappings];
            return;
        }
}

NVS_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    NVS_REAL_OR_FAIL(cuMemUnmap);
    if (size == 0) return nvs_real.cuMemUnmap(ptr, size); /* the driver's refusal */
    struct range range = {.ptr = ptr, .size = size};
    pthread_mutex_lock(&vmm_mu);
    claim_range(&range);
    int *swapped = prepare_pieces(&range);
    pthread_mutex_unlock(&vmm_mu);
    CUresult r = CUDA_ERROR_OUT_OF_MEMORY;
    CUdeviceptr done = ptr;
    if (swapped != NULL) r = in_pieces(&range, swapped, unmap_piece, NULL, &done);
    pthread_mutex_lock(&vmm_mu);
    /* What the driver unmapped (and swapped-out mappings, which it had no mapping of, up to there). */
    for (size_t i = 0; i < range.n; i++)
        if (inside(&range.found[i], ptr, done - ptr)) remove_mapping(&range.found[i]);
    end_range(&range);
    pthread_mutex_unlock(&vmm_mu);
    for (size_t i = 0; i < range.n; i++) { /* each handle left unused goes, its area given back unlocked */
        pthread_mutex_lock(&vmm_mu);
        struct nvs_extent *gone = forget_if_unused(range.found[i].app);
        pthread_mutex_unlock(&vmm_mu);
        nvs_area_give(gone);
    }
    free(swapped);
    nvs_client_memory_changed();
    vmm_debug("cuMemUnmap(%#llx, %zu bytes: %zu mappings, %s) = %d", (unsigned long long)ptr, size, range.n,
              range.any_swapped ? "some swapped out" : "none swapped out", r);
    return answered("cuMemUnmap", r, 0);
}

/* Under vmm_mu: the access `desc` gives, recorded in m (per location, the latest flags). */
static void record_access(struct mapping *m, const CUmemAccessDesc *desc, size_t count) {
    for (size_t k = 0; k < count; k++) {
        size_t at = 0;
        while (at < m->n_access && (m->access[at].location.type != desc[k].location.type ||
                                    m->access[at].location.id != desc[k].location.id))
            at++;
        if (at == NVS_VMM_ACCESS) {
            m->access_unknown = 1;
            return;
        }
        m->access[at] = desc[k];
        if (at == m->n_access) m->n_access++;
    }
}

NVS_EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
    NVS_REAL_OR_FAIL(cuMemSetAccess);
    if (desc == NULL || count == 0 || size == 0) return nvs_real.cuMemSetAccess(ptr, size, desc, count);
    struct range range = {.ptr = ptr, .size = size};
    pthread_mutex_lock(&vmm_mu);
    claim_range(&range);
    int *swapped = prepare_pieces(&range);
    pthread_mutex_unlock(&vmm_mu);
    CUresult r = CUDA_ERROR_OUT_OF_MEMORY;
    CUdeviceptr done = ptr;
    struct access_call a = {desc, count};
    if (swapped != NULL) r = in_pieces(&range, swapped, access_piece, &a, &done);
    pthread_mutex_lock(&vmm_mu);
    for (size_t i = 0; i < range.n; i++) {
        struct mapping *m = NULL;
        for (size_t k = 0; k < n_mappings && m == NULL; k++)
            if (mappings[k].va == range.found[i].va && mappings[k].app == range.found[i].app) m = &mappings[k];
        if (m == NULL) continue;
        if (inside(m, ptr, done - ptr))
            record_access(m, desc, count); /* a swapped-out one gets it when it comes back */
        else if (r == CUDA_SUCCESS)
            m->access_unknown = 1; /* access to part of it: not recorded, so it never moves */
    }
    end_range(&range);
    pthread_mutex_unlock(&vmm_mu);
    free(swapped);
    vmm_debug("cuMemSetAccess(%#llx, %zu bytes, %zu descriptors, first device %d flags %d: %zu mappings, %s) = %d",
              (unsigned long long)ptr, size, count, desc[0].location.id, desc[0].flags, range.n,
              range.any_swapped ? "some swapped out" : "none swapped out", r);
    return answered("cuMemSetAccess", r, 0);
}

/* NCCL frees a buffer by asking its range first (then unmaps it): a swapped-out mapping has no
 * driver mapping, so its recorded range answers. */
NVS_EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr) {
    NVS_REAL_OR_FAIL(cuMemGetAddressRange_v2);
    int answered_here = 0;
    pthread_mutex_lock(&vmm_mu);
    for (size_t i = 0; i < n_mappings && !answered_here; i++) {
        struct mapping *m = &mappings[i];
        if (dptr < m->va || dptr - m->va >= m->size || !swapped_out(m->app)) continue;
        if (pbase != NULL) *pbase = m->va;
        if (psize != NULL) *psize = m->size;
        answered_here = 1;
    }
    pthread_mutex_unlock(&vmm_mu);
    if (answered_here) {
        vmm_debug("cuMemGetAddressRange(%#llx): a swapped-out mapping's", (unsigned long long)dptr);
        return CUDA_SUCCESS;
    }
    return nvs_real.cuMemGetAddressRange_v2(pbase, psize, dptr);
}

/* Binding an address range to a multicast object: the memory mapped there never moves, and must
 * be resident for the driver to bind it. */
static CUresult bind_range(CUdeviceptr ptr, size_t size) {
    for (;;) {
        struct range range = {.ptr = ptr, .size = size};
        pthread_mutex_lock(&vmm_mu);
        claim_range(&range);
        struct nvs_device *wait_on = NULL;
        for (size_t i = 0; i < range.n; i++)
            if (swapped_out(range.found[i].app)) wait_on = find_handle(range.found[i].app)->device;
        for (size_t i = 0; i < range.n && wait_on == NULL; i++) {
            struct handle *h = find_handle(range.found[i].app);
            if (h != NULL) make_immovable(h);
        }
        end_range(&range);
        pthread_mutex_unlock(&vmm_mu);
        if (wait_on == NULL) {
            nvs_client_memory_changed();
            return CUDA_SUCCESS;
        }
        wait_for_the_memory(wait_on); /* the grant brings it back; then it is made immovable */
        pthread_mutex_lock(&vmm_mu);
        int back = 1;
        for (size_t i = 0; i < n_mappings; i++)
            if (overlaps(&mappings[i], ptr, size)) back &= !swapped_out(mappings[i].app);
        pthread_mutex_unlock(&vmm_mu);
        if (!back) return CUDA_ERROR_NOT_READY; /* a capture kept it out */
    }
}

NVS_EXPORT CUresult cuMulticastBindAddr(CUmemGenericAllocationHandle mcHandle, size_t mcOffset, CUdeviceptr memptr,
                                        size_t size, unsigned long long flags) {
    NVS_REAL_OR_FAIL(cuMulticastBindAddr);
    CUresult r = bind_range(memptr, size);
    if (r == CUDA_SUCCESS)
        r = answered("cuMulticastBindAddr", nvs_real.cuMulticastBindAddr(mcHandle, mcOffset, memptr, size, flags), 0);
    vmm_debug("cuMulticastBindAddr(%#llx, %zu bytes) = %d", (unsigned long long)memptr, size, r);
    return r;
}

NVS_EXPORT CUresult cuMulticastBindAddr_v2(CUmemGenericAllocationHandle mcHandle, CUdevice dev, size_t mcOffset,
                                           CUdeviceptr memptr, size_t size, unsigned long long flags) {
    NVS_REAL_OR_FAIL(cuMulticastBindAddr_v2);
    CUresult r = bind_range(memptr, size);
    if (r == CUDA_SUCCESS)
        r = answered("cuMulticastBindAddr_v2",
                     nvs_real.cuMulticastBindAddr_v2(mcHandle, dev, mcOffset, memptr, size, flags), 0);
    vmm_debug("cuMulticastBindAddr_v2(%#llx, %zu bytes) = %d", (unsigned long long)memptr, size, r);
    return r;
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
        if (h->device != d || h->swapped != swapped) continue;
        /* Out: what may move now. Back: everything out (made immovable it could not be). */
        if (swapped ? h->moving || mappings_of(h->app, &m) != 1 : movable(h, &m) == NULL) continue;
        items[n++] = (struct nvs_swappable){.vmm = 1, .key = h->app, .ptr = m->va, .size = h->size,
                                            .last_used = h->last_used, .area = h->area};
    }
    pthread_mutex_unlock(&vmm_mu);
    *out = items;
    return n;
}

int nvs_vmm_claim(const struct nvs_swappable *item) {
    pthread_mutex_lock(&vmm_mu);
    struct mapping *m = NULL;
    struct handle *h = movable(find_handle(item->key), &m);
    int ok = h != NULL && !h->swapped && m->va == item->ptr;
    if (ok) h->moving = 1;
    pthread_mutex_unlock(&vmm_mu);
    return ok ? 0 : -1;
}

int nvs_vmm_release_physical(const struct nvs_swappable *item, int copied) {
    pthread_mutex_lock(&vmm_mu);
    CUmemGenericAllocationHandle real = find_handle(item->key)->real; /* claimed: it stays */
    pthread_mutex_unlock(&vmm_mu);
    CUresult r = copied ? nvs_real.cuMemUnmap(item->ptr, item->size) : CUDA_ERROR_NOT_READY;
    if (r == CUDA_SUCCESS && real != 0) {
        CUresult released = nvs_real.cuMemRelease(real);
        if (released != CUDA_SUCCESS) nvs_warn("releasing a swapped-out VMM handle failed (%d)", released);
    }
    pthread_mutex_lock(&vmm_mu);
    struct handle *h = find_handle(item->key);
    if (r == CUDA_SUCCESS) {
        h->swapped = 1;
        h->real = 0;
        h->area = item->area;
    }
    end_move(item->key);
    pthread_mutex_unlock(&vmm_mu);
    if (copied && r != CUDA_SUCCESS) nvs_warn("unmapping a VMM mapping to swap it out failed (%d): it stays", r);
    if (r == CUDA_SUCCESS)
        vmm_debug("swapped out handle %#llx (driver %#llx released) at %#llx, %zu bytes",
                  (unsigned long long)item->key, real,
                  (unsigned long long)item->ptr, item->size);
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
        end_move(item->key);
    }
    pthread_mutex_unlock(&vmm_mu);
    if (r != CUDA_SUCCESS) nvs_warn("bringing back a swapped-out VMM mapping failed (%d): it stays on the host", r);
    else
        vmm_debug("bringing back handle %#llx (driver %#llx) at %#llx, %zu bytes, access for %zu devices",
                  (unsigned long long)item->key,
                  real, (unsigned long long)where.va, where.size, where.n_access);
    return r == CUDA_SUCCESS ? 0 : -1;
}

void nvs_vmm_restored(const struct nvs_swappable *item, uint64_t last_used) {
    pthread_mutex_lock(&vmm_mu);
    struct handle *h = find_handle(item->key);
    if (h != NULL) {
        h->swapped = 0;
        h->last_used = last_used;
    }
    end_move(item->key);
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
