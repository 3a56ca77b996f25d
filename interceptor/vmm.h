/*
 * Virtual memory management (vmm.c): the VMM memory the swap engine may move.
 */
#ifndef NVSHARE_VMM_H
#define NVSHARE_VMM_H

#include <stddef.h>
#include <stdint.h>

#include "memory.h"

struct nvs_device;
struct nvs_extent;

/* d's swappable memory that is (1) or is not (0) swapped out, copied (NULL with 0 when none);
 * the caller frees *out. Any thread, no lock held. */
size_t nvs_vmm_swappable(struct nvs_device *d, int swapped, struct nvs_swappable **out);
/* VMM memory whose bytes were copied to item->area: unmapped and its physical handle released,
 * marked swapped (0), or -1 when it can no longer move (unmapped, exported meanwhile). */
int nvs_vmm_release_physical(const struct nvs_swappable *item);
/* Swapped-out VMM memory: a new physical handle mapped at the same address with the same access
 * (0, its bytes' place handed over in *area; the bytes are copied back next, and
 * nvs_vmm_restored ends the move), or -1. */
int nvs_vmm_restore_physical(const struct nvs_swappable *item, struct nvs_extent **area);
void nvs_vmm_restored(const struct nvs_swappable *item, uint64_t last_used);
void nvs_vmm_reset_after_fork(void);

#endif
