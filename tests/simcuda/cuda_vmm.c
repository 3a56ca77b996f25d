/*
 * Virtual memory management: cuMemAddressReserve reserves inaccessible address space,
 * cuMemCreate makes a "physical" allocation (a memfd, counted against the device budget and,
 * with residency modelled, holding fixed slots of the device), cuMemMap maps it into a
 * reservation, cuMemSetAccess makes the mapping usable. Two mappings of one allocation share
 * their bytes, as on a GPU. A handle counts references (cuMemCreate and each
 * cuMemRetainAllocationHandle one, each cuMemRelease gives one back); the memory goes when the
 * last reference and the last mapping are gone. cuMemExportToShareableHandle hands out a file
 * descriptor of the memory for handle types it was created with, which
 * cuMemImportFromShareableHandle turns into a handle again (in any process).
 *
 * As measured on an H200 (driver 580.159.04; benchmarks/gpu/probe_vmm_handles.py):
 * - a handle's value is the address of the driver's record of it, and the value of a handle that
 *   is gone comes back for a later cuMemCreate (there within the next ten creations): here the
 *   most recently freed one comes back first. A handle that is gone is refused with
 *   CUDA_ERROR_INVALID_VALUE while its value is not given out again (and said on stderr: the
 *   real driver dereferences it, and crashed in cuMemMap);
 * - cuMemSetAccess and cuMemUnmap take a range in which mappings lie side by side or with
 *   unmapped gaps between them (every mapping it touches must lie inside it);
 * - a copy or memset of mapped memory without access is refused when it is made
 *   (CUDA_ERROR_INVALID_VALUE, cuda_memory.c); a kernel touching it faults;
 * - a handle that asks for fabric export (CU_MEM_HANDLE_TYPE_FABRIC) is refused with
 *   CUDA_ERROR_NOT_PERMITTED: the machine has no fabric.
 * Modelled, not measured: access is kept per device (cuMemSetAccess sets the devices its
 * descriptors name and leaves the others as they were, which NCCL relies on).
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "simcuda.h"

struct sim_phys {
    enum sim_magic magic;
    int fd;
    size_t size;
    struct sim_device *device;
    CUmemAllocationProp prop;     /* as created (cuMemGetAllocationPropertiesFromHandle) */
    struct sim_chunks chunks;     /* residency: the fixed slots it holds */
    /* Guarded by the registry lock. */
    int references;              /* cuMemCreate and retains, less releases */
    int mappings;                 /* live cuMemMap ranges */
    struct sim_phys *next_free;   /* gone: the next value to give out again after this one */
    struct sim_phys *next_record; /* every record ever made, live or gone (never freed) */
    int imported;                 /* cuMemImportFromShareableHandle: another's memory, not counted */
};

/* Guarded by the registry lock: every record ever made, so that a value is looked up before it
 * is dereferenced; and those of handles that are gone, most recently freed first, whose values
 * are given out again. */
static struct sim_phys *all_records, *free_records;

/* Reserved address ranges, guarded by the registry lock. */
struct reservation {
    uintptr_t start;
    size_t size;
    struct reservation *next;
};
static struct reservation *reservations;

static struct reservation *find_reservation(uintptr_t ptr, size_t size)
{
    for (struct reservation *r = reservations; r; r = r->next)
        if (ptr >= r->start && ptr - r->start <= r->size && size <= r->size - (ptr - r->start))
            return r;
    return NULL;
}

/* A record for a new handle: the value of the handle that went last, if one did (registry
 * write-locked). */
static struct sim_phys *new_record(void)
{
    struct sim_phys *phys = free_records;
    if (!phys) {
        phys = calloc(1, sizeof *phys);
        if (phys) {
            phys->next_record = all_records;
            all_records = phys;
        }
        return phys;
    }
    free_records = phys->next_free;
    struct sim_phys *next_record = phys->next_record;
    memset(phys, 0, sizeof *phys);
    phys->next_record = next_record;
    return phys;
}

static void drop_record(struct sim_phys *phys)
{
    phys->magic = SIM_MAGIC_DEAD;
    phys->next_free = free_records;
    free_records = phys;
}

/* Frees the memory of a released, unmapped allocation (registry write-locked). */
static void phys_destroy_if_unused(struct sim_phys *phys)
{
    if (phys->references > 0 || phys->mappings > 0)
        return;
    if (!phys->imported) {
        sim_residency_unfix(phys->device, (uint64_t)(uintptr_t)phys, phys->size, &phys->chunks);
        sim_mem_uncharge(phys->device, phys->size);
    }
    close(phys->fd);
    drop_record(phys);
}

static int multiple_of_granularity(size_t value)
{
    return value % SIM_VMM_GRANULARITY == 0;
}

static CUresult check_prop(const CUmemAllocationProp *prop, struct sim_device **device)
{
    if (!prop || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    *device = sim_device_get(prop->location.id);
    return *device ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

SIM_EXPORT CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                                  CUmemAllocationGranularity_flags option)
{
    SIM_ENTER();
    struct sim_device *device;
    if (!granularity || (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM && option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
        return CUDA_ERROR_INVALID_VALUE;
    CUresult result = check_prop(prop, &device);
    if (result == CUDA_SUCCESS)
        *granularity = SIM_VMM_GRANULARITY;
    return result;
}

/* Makes the record of a new handle of `size` bytes on `device` backed by `fd` (which it owns from
 * then on), counted against the device and, with residency modelled, holding its slots. An
 * imported handle (of memory another process made, and counts) is neither. */
static CUresult make_handle(CUmemGenericAllocationHandle *handle, struct sim_device *device, size_t size,
                            const CUmemAllocationProp *prop, int fd, int imported)
{
    sim_mem_write_lock();
    struct sim_phys *phys = new_record();
    int charged = phys && (imported || sim_mem_charge(device, size) == 0);
    if (phys && !charged)
        drop_record(phys);
    sim_mem_unlock();
    if (!charged) {
        close(fd);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    phys->size = size;
    phys->device = device;
    phys->prop = *prop;
    phys->references = 1;
    phys->fd = fd;
    phys->imported = imported;
    /* On the modelled device it takes its room now (not when mapped), as physical memory does. */
    CUresult result = imported ? CUDA_SUCCESS
                               : sim_residency_fix(device, (uint64_t)(uintptr_t)phys, size, &phys->chunks);
    sim_mem_write_lock();
    if (result == CUDA_SUCCESS) {
        phys->magic = SIM_MAGIC_PHYS;
    } else {
        sim_mem_uncharge(device, size);
        drop_record(phys);
    }
    sim_mem_unlock();
    if (result != CUDA_SUCCESS) {
        close(fd);
        return result;
    }
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)phys;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                                unsigned long long flags)
{
    SIM_ENTER();
    struct sim_device *device;
    if (!handle || flags != 0 || size == 0 || !multiple_of_granularity(size))
        return CUDA_ERROR_INVALID_VALUE;
    CUresult result = check_prop(prop, &device);
    if (result != CUDA_SUCCESS)
        return result;
    /* No fabric (IMEX) here, as on the H200 it was measured on (PyTorch asks and expects this). */
    if (prop->requestedHandleTypes & CU_MEM_HANDLE_TYPE_FABRIC)
        return CUDA_ERROR_NOT_PERMITTED;
    char name[32]; /* the device, for cuMemImportFromShareableHandle */
    snprintf(name, sizeof name, "simcuda-vmm-%d", device->ordinal);
    int fd = memfd_create(name, MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
        if (fd >= 0)
            close(fd);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return make_handle(handle, device, size, prop, fd, 0);
}

/* With the registry locked: the live handle `handle` names. `call` names the entry point in the
 * line said on stderr for a handle that is gone (the real driver dereferences its value). */
static CUresult check_phys(CUmemGenericAllocationHandle handle, struct sim_phys **out, const char *call)
{
    struct sim_phys *phys = all_records;
    while (phys && (uintptr_t)phys != handle)
        phys = phys->next_record;
    if (!phys) /* never a handle's value */
        return CUDA_ERROR_INVALID_VALUE;
    if (phys->magic != SIM_MAGIC_PHYS || phys->references == 0) {
        fprintf(stderr, "simcuda: %s of handle %#llx, which was released (the real driver may crash)\n", call,
                (unsigned long long)handle);
        return CUDA_ERROR_INVALID_VALUE;
    }
    *out = phys;
    return CUDA_SUCCESS;
}

/* The memory stays until its last mapping goes, as with the real driver. */
SIM_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    SIM_ENTER();
    sim_mem_write_lock();
    struct sim_phys *phys;
    CUresult result = check_phys(handle, &phys, "cuMemRelease");
    if (result == CUDA_SUCCESS) {
        phys->references--;
        phys_destroy_if_unused(phys);
    }
    sim_mem_unlock();
    return result;
}

/* The handle of the allocation mapped at `addr`, with one more reference to give back. */
SIM_EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr)
{
    SIM_ENTER();
    if (!handle)
        return CUDA_ERROR_INVALID_VALUE;
    sim_mem_write_lock();
    struct sim_alloc *alloc = sim_mem_find_range((uintptr_t)addr, 1);
    CUresult result = alloc && alloc->family == SIM_MEM_VMM ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    if (result == CUDA_SUCCESS) {
        alloc->phys->references++;
        *handle = (CUmemGenericAllocationHandle)(uintptr_t)alloc->phys;
    }
    sim_mem_unlock();
    return result;
}

/* A POSIX file descriptor of the memory (the only type simulated), for a handle created with it. */
SIM_EXPORT CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                                 CUmemAllocationHandleType handleType, unsigned long long flags)
{
    SIM_ENTER();
    if (!shareableHandle || flags != 0 || handleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return CUDA_ERROR_INVALID_VALUE;
    sim_mem_read_lock();
    struct sim_phys *phys;
    CUresult result = check_phys(handle, &phys, "cuMemExportToShareableHandle");
    if (result == CUDA_SUCCESS && !(phys->prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
        result = CUDA_ERROR_INVALID_VALUE;
    int fd = result == CUDA_SUCCESS ? fcntl(phys->fd, F_DUPFD_CLOEXEC, 0) : -1;
    sim_mem_unlock();
    if (result == CUDA_SUCCESS && fd < 0)
        return CUDA_ERROR_OPERATING_SYSTEM;
    if (result == CUDA_SUCCESS)
        *(int *)shareableHandle = fd;
    return result;
}

SIM_EXPORT CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                        unsigned long long flags)
{
    (void)addr; /* a hint; the real driver may ignore it too */
    SIM_ENTER();
    if (alignment == 0)
        alignment = SIM_VMM_GRANULARITY;
    if (!ptr || flags != 0 || size == 0 || !multiple_of_granularity(size) || (alignment & (alignment - 1)) ||
        size > SIZE_MAX - alignment)
        return CUDA_ERROR_INVALID_VALUE;
    struct reservation *reservation = malloc(sizeof *reservation);
    if (!reservation)
        return CUDA_ERROR_OUT_OF_MEMORY;
    size_t span = size + alignment;
    char *base = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED) {
        free(reservation);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    uintptr_t start = ((uintptr_t)base + alignment - 1) & ~(uintptr_t)(alignment - 1);
    if (start > (uintptr_t)base)
        munmap(base, start - (uintptr_t)base);
    if ((uintptr_t)base + span > start + size)
        munmap((void *)(start + size), (uintptr_t)base + span - (start + size));
    reservation->start = start;
    reservation->size = size;
    sim_mem_write_lock();
    reservation->next = reservations;
    reservations = reservation;
    sim_mem_unlock();
    *ptr = (CUdeviceptr)start;
    return CUDA_SUCCESS;
}

/* Whether any mapping lies in [ptr, ptr + size) (registry locked). */
static int has_mappings(uintptr_t ptr, size_t size)
{
    for (size_t offset = 0; offset < size; offset += SIM_VMM_GRANULARITY)
        if (sim_mem_find_range(ptr + offset, 1))
            return 1;
    return 0;
}

SIM_EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    SIM_ENTER();
    CUresult result = CUDA_ERROR_INVALID_VALUE;
    sim_mem_write_lock();
    for (struct reservation **link = &reservations; *link; link = &(*link)->next) {
        struct reservation *r = *link;
        if (r->start != (uintptr_t)ptr || r->size != size)
            continue;
        if (!has_mappings(r->start, r->size)) {
            munmap((void *)r->start, r->size);
            *link = r->next;
            free(r);
            result = CUDA_SUCCESS;
        }
        break;
    }
    sim_mem_unlock();
    return result;
}

SIM_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                             unsigned long long flags)
{
    SIM_ENTER();
    if (flags != 0 || size == 0 || !multiple_of_granularity(size) || !multiple_of_granularity(offset) ||
        !multiple_of_granularity((uintptr_t)ptr))
        return CUDA_ERROR_INVALID_VALUE;
    sim_mem_write_lock();
    struct sim_phys *phys;
    CUresult result = check_phys(handle, &phys, "cuMemMap");
    if (result == CUDA_SUCCESS &&
        (offset > phys->size || size > phys->size - offset || !find_reservation((uintptr_t)ptr, size) ||
         has_mappings((uintptr_t)ptr, size)))
        result = CUDA_ERROR_INVALID_VALUE;
    if (result == CUDA_SUCCESS &&
        mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, phys->fd, (off_t)offset) == MAP_FAILED)
        result = CUDA_ERROR_OUT_OF_MEMORY;
    if (result == CUDA_SUCCESS) {
        struct sim_alloc prototype = {
            .start = (uintptr_t)ptr, .size = size, .family = SIM_MEM_VMM, .device = phys->device,
            .phys = phys, .shared_fd = -1,
        };
        if (sim_mem_add(&prototype))
            phys->mappings++;
        else
            result = CUDA_ERROR_OUT_OF_MEMORY;
    }
    sim_mem_unlock();
    return result;
}

/* Puts inaccessible reserved address space back over [ptr, ptr + size). */
static void unmap_range(uintptr_t ptr, size_t size)
{
    mmap((void *)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
}

/* The mappings [ptr, ptr + size) touches: at least one, each inside it (gaps between them are
 * fine, measured on an H200 for cuMemUnmap and cuMemSetAccess). Registry locked. */
static int mappings_inside(uintptr_t ptr, size_t size)
{
    int found = 0;
    for (size_t offset = 0; offset < size;) {
        struct sim_alloc *alloc = sim_mem_find_range(ptr + offset, 1);
        if (!alloc) {
            offset = (offset / SIM_VMM_GRANULARITY + 1) * SIM_VMM_GRANULARITY;
            continue;
        }
        if (alloc->family != SIM_MEM_VMM || alloc->start < ptr || alloc->size > size - (alloc->start - ptr))
            return 0;
        found = 1;
        offset = alloc->start - ptr + alloc->size;
    }
    return found;
}

/* Calls `each` for every mapping in [ptr, ptr + size) (registry write-locked; `each` may remove
 * it). */
static void for_each_mapping(uintptr_t ptr, size_t size, void (*each)(struct sim_alloc *, void *), void *argument)
{
    for (size_t offset = 0; offset < size;) {
        struct sim_alloc *alloc = sim_mem_find_range(ptr + offset, 1);
        if (!alloc) {
            offset = (offset / SIM_VMM_GRANULARITY + 1) * SIM_VMM_GRANULARITY;
            continue;
        }
        offset = alloc->start - ptr + alloc->size;
        each(alloc, argument);
    }
}

static void unmap_one(struct sim_alloc *alloc, void *unused)
{
    (void)unused;
    struct sim_phys *phys = alloc->phys;
    unmap_range(alloc->start, alloc->size);
    sim_mem_remove(alloc);
    phys->mappings--;
    phys_destroy_if_unused(phys);
}

SIM_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    SIM_ENTER();
    if (size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    sim_mem_write_lock();
    int inside = mappings_inside((uintptr_t)ptr, size);
    if (inside)
        for_each_mapping((uintptr_t)ptr, size, unmap_one, NULL);
    sim_mem_unlock();
    return inside ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

struct access_change {
    uint64_t granted, revoked; /* devices given read-write access, and devices given less */
};

/* A mapping's access: per device, as the descriptors say; other devices keep theirs. The host
 * side (the executor writes the bytes) is read-write while any device may write. */
static void change_access(struct sim_alloc *alloc, void *argument)
{
    const struct access_change *change = argument;
    alloc->access = (alloc->access & ~change->revoked) | change->granted;
    mprotect((void *)alloc->start, alloc->size, alloc->access ? PROT_READ | PROT_WRITE : PROT_NONE);
}

SIM_EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count)
{
    SIM_ENTER();
    if (!desc || count == 0 || size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    struct access_change change = {0, 0};
    for (size_t i = 0; i < count; i++) {
        struct sim_device *device = desc[i].location.type == CU_MEM_LOCATION_TYPE_DEVICE
                                        ? sim_device_get(desc[i].location.id) : NULL;
        if (!device)
            return CUDA_ERROR_INVALID_DEVICE;
        uint64_t bit = UINT64_C(1) << device->ordinal;
        /* Device work here writes (fills, copies): read-only access counts as none. */
        if (desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            change.granted |= bit, change.revoked &= ~bit;
        else if (desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_READ || desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_NONE)
            change.revoked |= bit, change.granted &= ~bit;
        else
            return CUDA_ERROR_INVALID_VALUE;
    }
    sim_mem_write_lock();
    int inside = mappings_inside((uintptr_t)ptr, size);
    if (inside)
        for_each_mapping((uintptr_t)ptr, size, change_access, &change);
    sim_mem_unlock();
    return inside ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

SIM_EXPORT CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop,
                                                           CUmemGenericAllocationHandle handle)
{
    SIM_ENTER();
    if (!prop)
        return CUDA_ERROR_INVALID_VALUE;
    sim_mem_read_lock();
    struct sim_phys *phys;
    CUresult result = check_phys(handle, &phys, "cuMemGetAllocationPropertiesFromHandle");
    if (result == CUDA_SUCCESS)
        *prop = phys->prop;
    sim_mem_unlock();
    return result;
}

/* A file descriptor cuMemExportToShareableHandle gave (in any process): a handle of the same
 * memory, on the device the memory was made on (its memfd's name says which). */
SIM_EXPORT CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
                                                   CUmemAllocationHandleType shHandleType)
{
    SIM_ENTER();
    if (!handle || shHandleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return CUDA_ERROR_INVALID_VALUE;
    int fd = (int)(intptr_t)osHandle;
    char link[64], target[128];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, target, sizeof target - 1);
    target[n > 0 ? n : 0] = '\0';
    int ordinal;
    struct stat st;
    if (sscanf(target, "/memfd:simcuda-vmm-%d", &ordinal) != 1 || fstat(fd, &st) != 0 || st.st_size <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_device *device = sim_device_get(ordinal);
    int copy = device ? fcntl(fd, F_DUPFD_CLOEXEC, 0) : -1;
    if (copy < 0)
        return device ? CUDA_ERROR_OPERATING_SYSTEM : CUDA_ERROR_INVALID_DEVICE;
    CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
                                .requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                                .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = ordinal}};
    return make_handle(handle, device, (size_t)st.st_size, &prop, copy, 1);
}

/* CUDA arrays are not simulated: the memory handles of the mappings are checked (a value that is
 * no live handle is CUDA_ERROR_INVALID_VALUE), then the call is CUDA_ERROR_NOT_SUPPORTED. */
static CUresult map_array(CUarrayMapInfo *list, unsigned int count)
{
    SIM_ENTER();
    if (!list || count == 0)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult result = CUDA_SUCCESS;
    sim_mem_read_lock();
    for (unsigned int i = 0; i < count && result == CUDA_SUCCESS; i++) {
        struct sim_phys *phys;
        if (list[i].memOperationType == CU_MEM_OPERATION_TYPE_MAP &&
            list[i].memHandleType == CU_MEM_HANDLE_TYPE_GENERIC)
            result = check_phys(list[i].memHandle.memHandle, &phys, "cuMemMapArrayAsync");
    }
    sim_mem_unlock();
    return result == CUDA_SUCCESS ? CUDA_ERROR_NOT_SUPPORTED : result;
}

SIM_IGNORING_PARAMETERS(
SIM_WITH_TWIN(cuMemMapArrayAsync, cuMemMapArrayAsync_ptsz,
              (CUarrayMapInfo *mapInfoList, unsigned int count, CUstream hStream),
              return map_array(mapInfoList, count);))

/* Multicast objects are not simulated: the memory to bind is checked (a handle, or mapped VMM
 * memory), then the call is CUDA_ERROR_NOT_SUPPORTED. */
static CUresult bind_memory(CUmemGenericAllocationHandle memHandle, const char *call)
{
    sim_mem_read_lock();
    struct sim_phys *phys;
    CUresult result = check_phys(memHandle, &phys, call);
    sim_mem_unlock();
    return result == CUDA_SUCCESS ? CUDA_ERROR_NOT_SUPPORTED : result;
}

static CUresult bind_address(CUdeviceptr memptr, size_t size)
{
    sim_mem_read_lock();
    struct sim_alloc *alloc = sim_mem_find_range((uintptr_t)memptr, size ? size : 1);
    CUresult result = alloc && alloc->family == SIM_MEM_VMM ? CUDA_ERROR_NOT_SUPPORTED : CUDA_ERROR_INVALID_VALUE;
    sim_mem_unlock();
    return result;
}

SIM_IGNORING_PARAMETERS(
SIM_EXPORT CUresult cuMulticastBindMem(CUmemGenericAllocationHandle mcHandle, size_t mcOffset,
                                       CUmemGenericAllocationHandle memHandle, size_t memOffset, size_t size,
                                       unsigned long long flags)
{
    SIM_ENTER();
    return bind_memory(memHandle, "cuMulticastBindMem");
}

SIM_EXPORT CUresult cuMulticastBindMem_v2(CUmemGenericAllocationHandle mcHandle, CUdevice dev, size_t mcOffset,
                                          CUmemGenericAllocationHandle memHandle, size_t memOffset, size_t size,
                                          unsigned long long flags)
{
    SIM_ENTER();
    return bind_memory(memHandle, "cuMulticastBindMem_v2");
}

SIM_EXPORT CUresult cuMulticastBindAddr(CUmemGenericAllocationHandle mcHandle, size_t mcOffset, CUdeviceptr memptr,
                                        size_t size, unsigned long long flags)
{
    SIM_ENTER();
    return bind_address(memptr, size);
}

SIM_EXPORT CUresult cuMulticastBindAddr_v2(CUmemGenericAllocationHandle mcHandle, CUdevice dev, size_t mcOffset,
                                           CUdeviceptr memptr, size_t size, unsigned long long flags)
{
    SIM_ENTER();
    return bind_address(memptr, size);
})
