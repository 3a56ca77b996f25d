/*
 * Device allocations (memory.c): deferred frees, charging, and the converted allocations the
 * swap engine may move (struct nvs_swappable, also vmm.c's).
 */
#ifndef NVSHARE_MEMORY_H
#define NVSHARE_MEMORY_H

#include <stddef.h>
#include <stdint.h>

#include "cuda_types.h"

struct nvs_device;
struct nvs_extent;

/* Complete stream-ordered frees whose event has completed. Cheap when none is pending. */
void nvs_memory_poll_frees(void);
int nvs_memory_frees_pending(void);
/* The caller holds nvs_ctx_mu, before a context may be destroyed: complete the pending frees made in
 * `ctx` (NULL: every one on `device`), waiting for the work queued before them. */
void nvs_memory_settle_frees(CUcontext ctx, struct nvs_device *device);
/* Charge `call`'s allocation of `size` bytes on d before it is made (limits, admission), or
 * refuse it with CUDA_ERROR_OUT_OF_MEMORY; give a charge back. No lock held (both may wait). */
CUresult nvs_memory_charge(struct nvs_device *d, size_t size, const char *call);
void nvs_memory_uncharge(struct nvs_device *d, size_t size);
/* Fork child: forget every allocation (the child has no device memory of its own). */
void nvs_memory_reset_after_fork(void);
void nvs_memory_fork_prepare(void);
void nvs_memory_fork_parent(void);

/* Converted allocations move in blocks of this size: a swap-out moves at least what it was asked,
 * at most a block more, and a block brought back ahead of a grant is as much as there is room. */
#define NVS_SWAP_BLOCK ((size_t)64 << 20)
/* What a swap may move: a block of a converted allocation (memory.c) or a VMM handle's one
 * mapping (vmm.c). */
struct nvs_swappable {
    int vmm;                 /* a VMM handle (key: the application's handle), else a block of a
                              * converted allocation (key: the allocation's device pointer) */
    uint64_t key;
    CUdeviceptr ptr;         /* where its bytes are */
    size_t size;
    uint64_t last_used;      /* the device's swap epoch when it was made or last brought back */
    struct nvs_extent *area; /* swapped out: its bytes in the area (NULL: moved by the driver's
                              * prefetch, the bytes are in its managed memory on the host) */
};
/* d's swappable memory that is (1) or is not (0) swapped out, copied (NULL with 0 when none);
 * the caller frees *out. Any thread, no lock held. */
size_t nvs_memory_swappable(struct nvs_device *d, int swapped, struct nvs_swappable **out);
/* A converted allocation is now swapped out (1) or resident (0), its bytes in item->area: 0, or
 * -1 when it is gone (freed meanwhile). The swapped count is the caller's (swap.c). */
int nvs_memory_mark(struct nvs_device *d, const struct nvs_swappable *item, int swapped, uint64_t last_used);

#endif
