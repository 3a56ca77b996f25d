/*
 * The pinned swap area (area.c).
 */
#ifndef NVSHARE_AREA_H
#define NVSHARE_AREA_H

#include <stddef.h>
#include <stdint.h>

/* The pinned swap area (area.c), any thread. A run of it: `bytes` at `host`. */
struct nvs_area_run {
    char *host;
    size_t bytes;
    uint32_t chunk, page;
};
struct nvs_extent;
/* Room for `bytes` (0, in *out), or -1 when the area has less free (claiming pool segments while
 * its own chunks lack room). */
int nvs_area_take(size_t bytes, struct nvs_extent **out);
void nvs_area_give(struct nvs_extent *e); /* NULL: nothing */
size_t nvs_area_runs(const struct nvs_extent *e, const struct nvs_area_run **runs);
/* What device `index` may want out at once (the scheduler's PREPARE); the area follows the sum. */
void nvs_area_want(int index, uint64_t bytes);
/* The pinned bytes the area has ready (MEMORY area=): its chunks, taken or free (the segments it
 * holds of the pool included), and the pool's free segments registered here. What a move out can
 * take now is that less what is out through the area. */
uint64_t nvs_area_ready(void);
/* 1: the area should grow, -1: shrink (a whole chunk is free above the target), 0: neither. */
int nvs_area_change_due(void);
/* Pin or give back one chunk (a context current); 1 when it changed, -1 on failure. */
int nvs_area_change_step(void);
void nvs_area_reset_after_fork(void);

#endif
