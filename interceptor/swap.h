/*
 * The swap engine (swap.c), for the worker.
 */
#ifndef NVSHARE_SWAP_H
#define NVSHARE_SWAP_H

#include <stdint.h>

struct nvs_device;

/* The swap engine (swap.c), for the worker; no lock held. */
enum nvs_swap_engine { NVS_SWAP_UNRESOLVED = 0, NVS_SWAP_COPY, NVS_SWAP_MIGRATE };
void nvs_swap_resolve(void);
/* Move at least `at_least` bytes of d's swappable memory to the host, least recently used first
 * (-1 and nothing moved while a stream capture runs on d). */
int nvs_swap_out(struct nvs_device *d, uint64_t at_least);
/* Bring back what was moved out, most recently used first: up to `up_to` bytes ahead of a grant
 * (`for_grant` 0); for a grant everything in the area and of the rest up to `up_to`, and all of
 * it counts as resident again (-1: some VMM memory waits for a capture's end). */
int nvs_swap_in(struct nvs_device *d, uint64_t up_to, int for_grant);
/* The pinner thread (worker.c): a step of the swap pool (pool.c) or of the area (a chunk more or
 * less); 1 when it changed something. Whether a change is due (it may not be possible now: a
 * capture runs). Whether to look again now and then although nothing is due: other processes
 * change the pool this process is a member of. */
int nvs_swap_prepare_step(void);
int nvs_swap_prepare_due(void);
int nvs_swap_prepare_watching(void);
struct nvs_swap_figures {
    int engine;       /* enum nvs_swap_engine */
    uint64_t area;    /* pinned bytes ready (nvs_area_ready) */
    uint64_t out_bps, in_bps; /* the last moves through the area, bytes per second (0: none yet) */
    int pool;                 /* the area's room is its user's swap pool */
};
void nvs_swap_figures(struct nvs_swap_figures *out);

#endif
