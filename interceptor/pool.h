/*
 * The swap pool (pool.c): pinned host memory that the processes of one user (one pod) share
 * for swapping, handed out in whole segments.
 */
#ifndef NVSHARE_POOL_H
#define NVSHARE_POOL_H

#include <stddef.h>
#include <stdint.h>

/* A segment of the pool that this process owns: `bytes` at `host`, registered here. */
struct nvs_pool_segment {
    char *host;
    size_t bytes;
    int index;
};

/* The scheduler's POOL: the pool should hold `bytes` (any thread; under nvs_mu too: an atomic
 * store). */
void nvs_pool_want(uint64_t bytes);
/* What this process could be asked to move out at once (its movable memory on its devices): the
 * pinner registers free segments others made until those free here would take it (any thread). */
void nvs_pool_need(uint64_t bytes);
/* The scheduler's POOL need=: of that, register others' segments for at most `bytes` (what this
 * process may be asked to move out soon; UINT64_MAX: no cap). Any thread (an atomic store). */
void nvs_pool_need_at_most(uint64_t bytes);
/* 1 while this process is a member of its user's pool: its swap area takes its room from the
 * pool's segments then, and pins no chunks of its own. Any thread. */
int nvs_pool_joined(void);
/* The pinner thread (worker.c, through swap.c), no lock held: whether a step is due (the
 * scheduler's size changed, another member changed the pool, or the members' liveness is due
 * for a look), and one step (a context current, nvs_ctx_mu read-held): join, unregister,
 * remove, retire, register or make one segment. 1 when the pool, or what this process can use
 * of it, changed. */
int nvs_pool_due(void);
int nvs_pool_step(void);
/* For the swap area (area.c): claim a free segment registered here (instant: nothing is pinned
 * on the way), 0 and *out; where there is none, the swap-out joins the pool (told POOL since) or
 * registers a free segment another member made, on its path (the worker, a context current; the
 * pinner takes no step meanwhile); -1 when none can be had. And (any thread, no lock held) give a wholly free segment
 * back to the pool. */
int nvs_pool_claim(struct nvs_pool_segment *out);
void nvs_pool_release(int index);
/* Bytes in the pool's free segments registered here, as last seen (any thread, no lock). */
uint64_t nvs_pool_free_bytes(void);
/* Process exit (client.c's atexit handler): leave the pool; the last member removes its files. */
void nvs_pool_leave(void);
/* Fork child: no member (a child that uses CUDA joins by itself). */
void nvs_pool_reset_after_fork(void);

#endif
