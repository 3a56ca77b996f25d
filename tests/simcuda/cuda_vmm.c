/*
 * Virtual memory management: cuMemAddressReserve reserves inaccessible address space,
 * cuMemCreate makes a "physical" allocation (a memfd, counted against the device budget and,
 * with residency modelled, holding fixed slots of the device), cuMemMap maps it into a
 * reservation, cuMemSetAccess makes the mapping usable. Two mappings of one allocation share
 * their bytes, as on a GPU. A handle counts references (cuMemCreate and each
 * cuMemRetainAllocationHandle one, each cuMemRelease gives one back); the memory goes when the
 * last reference and the last mapping are gone. cuMemExportToShareableHandle hands out a file
 * descriptor of the memory for handle types it was created with.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include "simcuda.h"

struct sim_phys {
    enum sim_magic magic;
    int fd;
    size_t size;
    struct sim_device *device;
    int handle_types;             /* CUmemAllocationHandleType bits it may be exported as */
    struct sim_chunks chunks;     /* residency: the fixed slots it holds */
    /* Guarded by the registry lock. */
    int references;              /* cuMemCreate and retains, less releases */
    int mappings;                 /* live cuMemMap ranges */
};

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

/* Frees the memory of a released, unmapped allocation (registry write-locked). */
static void phys_destroy_if_unused(struct sim_phys *phys)
{
    if (phys->references > 0 || phys->mappings > 0)
        return;
    sim_residency_unfix(phys->device, (uint64_t)(uintptr_t)phys, phys->size, &phys->chunks);
    close(phys->fd);
    sim_mem_uncharge(phys->device, phys->size);
    phys->magic = SIM_MAGIC_DEAD;
    free(phys);
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
    struct sim_phys *phys = calloc(1, sizeof *phys);
    if (!phys)
        return CUDA_ERROR_OUT_OF_MEMORY;
    phys->magic = SIM_MAGIC_PHYS;
    phys->size = size;
    phys->device = device;
    phys->handle_types = prop->requestedHandleTypes;
    phys->references = 1;
    phys->fd = memfd_create("simcuda-vmm", MFD_CLOEXEC);
    if (phys->fd < 0 || ftruncate(phys->fd, (off_t)size) != 0) {
        if (phys->fd >= 0)
            close(phys->fd);
        free(phys);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    sim_mem_write_lock();
    int charged = sim_mem_charge(device, size) == 0;
    sim_mem_unlock();
    /* On the modelled device it takes its room now (not when mapped), as physical memory does. */
    result = charged ? sim_residency_fix(device, (uint64_t)(uintptr_t)phys, size, &phys->chunks)
                     : CUDA_ERROR_OUT_OF_MEMORY;
    if (result != CUDA_SUCCESS) {
        if (charged) {
            sim_mem_write_lock();
            sim_mem_uncharge(device, size);
            sim_mem_unlock();
        }
        close(phys->fd);
        free(phys);
        return result;
    }
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)phys;
    return CUDA_SUCCESS;
}

static CUresult check_phys(CUmemGenericAllocationHandle handle, struct sim_phys **out)
{
    struct sim_phys *phys = (struct sim_phys *)(uintptr_t)handle;
    if (!phys || phys->magic != SIM_MAGIC_PHYS || phys->references == 0)
        return CUDA_ERROR_INVALID_VALUE;
    *out = phys;
    return CUDA_SUCCESS;
}

/* The memory stays until its last mapping goes, as with the real driver. */
SIM_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    SIM_ENTER();
    sim_mem_write_lock();
    struct sim_phys *phys;
    CUresult result = check_phys(handle, &phys);
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
    CUresult result = check_phys(handle, &phys);
    if (result == CUDA_SUCCESS && !(phys->handle_types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
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
    CUresult result = check_phys(handle, &phys);
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

/* Every byte of [ptr, ptr + size) must be covered by mappings that lie inside it. */
static int covered_by_mappings(uintptr_t ptr, size_t size)
{
    for (size_t offset = 0; offset < size;) {
        struct sim_alloc *alloc = sim_mem_find_range(ptr + offset, 1);
        if (!alloc || alloc->family != SIM_MEM_VMM || alloc->start < ptr || alloc->size > size - (alloc->start - ptr))
            return 0;
        offset = alloc->start - ptr + alloc->size;
    }
    return 1;
}

SIM_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    SIM_ENTER();
    if (size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    sim_mem_write_lock();
    int covered = covered_by_mappings((uintptr_t)ptr, size);
    for (size_t offset = 0; covered && offset < size;) {
        struct sim_alloc *alloc = sim_mem_find_range((uintptr_t)ptr + offset, 1);
        struct sim_phys *phys = alloc->phys;
        offset = alloc->start - (uintptr_t)ptr + alloc->size;
        unmap_range(alloc->start, alloc->size);
        sim_mem_remove(alloc);
        phys->mappings--;
        phys_destroy_if_unused(phys);
    }
    sim_mem_unlock();
    return covered ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

SIM_EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count)
{
    SIM_ENTER();
    if (!desc || count == 0 || size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    int prot = PROT_NONE;
    for (size_t i = 0; i < count; i++) {
        if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE || !sim_device_get(desc[i].location.id))
            return CUDA_ERROR_INVALID_DEVICE;
        if (desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            prot = PROT_READ | PROT_WRITE;
        else if (desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_READ && prot == PROT_NONE)
            prot = PROT_READ;
        else if (desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READ && desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE)
            return CUDA_ERROR_INVALID_VALUE;
    }
    CUresult result = CUDA_SUCCESS;
    sim_mem_write_lock();
    if (!covered_by_mappings((uintptr_t)ptr, size) || mprotect((void *)(uintptr_t)ptr, size, prot) != 0) {
        result = CUDA_ERROR_INVALID_VALUE;
    } else {
        /* Device work may read and write only read-write mappings. */
        for (size_t offset = 0; offset < size;) {
            struct sim_alloc *alloc = sim_mem_find_range((uintptr_t)ptr + offset, 1);
            alloc->accessible = prot == (PROT_READ | PROT_WRITE);
            offset = alloc->start - (uintptr_t)ptr + alloc->size;
        }
    }
    sim_mem_unlock();
    return result;
}
