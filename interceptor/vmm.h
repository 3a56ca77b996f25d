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
/* Before its bytes are copied out: the item (of nvs_vmm_swappable) is claimed for the move, so
 * that the application's calls on it (unmap, release, access) wait until it is out (0), or -1
 * when it can no longer move (unmapped, exported meanwhile). Any thread, no lock held. */
int nvs_vmm_claim(const struct nvs_swappable *item);
/* The claimed item's bytes were `copied` to item->area (1): unmapped and its physical handle
 * released, marked swapped (0); or the copy failed (0): it stays where it is (-1). Either way the
 * claim ends. */
int nvs_vmm_release_physical(const struct nvs_swappable *item, int copied);
/* Swapped-out VMM memory: a new physical handle mapped at the same address with the same access
 * (0, its bytes' place handed over in *area; the bytes are copied back next, and
 * nvs_vmm_restored ends the move), or -1. */
int nvs_vmm_restore_physical(const struct nvs_swappable *item, struct nvs_extent **area);
void nvs_vmm_restored(const struct nvs_swappable *item, uint64_t last_used);
void nvs_vmm_reset_after_fork(void);

#endif
