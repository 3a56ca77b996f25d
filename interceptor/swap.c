/*
 * The swap engine: moving a process's device memory out and back at link speed (issue 18;
 * docs/interceptor.md, "Swapping"). The worker runs it (worker.c's SWAP_OUT, PREFETCH and
 * RESTORE jobs); the scheduler says how much and when (docs/protocol.md, "Residency").
 *
 * Out: the bytes are copied from the device into the pinned swap area (area.c) on the copy
 * engines (cuMemcpyDtoHAsync: the link's bandwidth, 52.6 GB/s on an H200, where a managed
 * prefetch to the host runs at 3-15 GB/s, bounded by the host's page population), then the
 * device's pages are released without being migrated: cuMemDiscardBatchAsync for converted
 * (managed) allocations, unmap and release of the physical handle for VMM memory (vmm.c). In:
 * cuMemDiscardAndPrefetchBatchAsync makes the managed pages resident again without copying (a
 * new VMM handle is created and mapped at the same address), then the bytes are copied back
 * (cuMemcpyHtoDAsync), all of it before the gate opens. Both directions work in pieces of
 * PIECE bytes and say after each what moved (the device's swapped count, which the client
 * thread reports as MEMORY resident=), so that the scheduler can let the next holder bring its
 * memory in while this one's goes out (the two share the link: on an H200 two processes' copies
 * of managed memory the opposite ways ran at 24 GB/s each, where cuMemAlloc memory's overlapped).
 *
 * Fallback (engine "migrate"): a driver without the discard entry points (resolved through
 * cuGetProcAddress at cudaVersion 13000: CUDA 13 drivers have them), and whatever does not fit
 * the area, move as before issue 18: cuMemPrefetchAsync to the host and back. VMM memory moves
 * only through the area (a prefetch cannot move it).
 *
 * Which allocations (the policy of issue 8): the device's swap epoch advances at each grant that
 * brings memory back; an allocation remembers the epoch in which it was made or last brought
 * back. A swap-out takes the least recently used first, the largest first among equals; a
 * swap-in the most recently used first. Whole allocations are chosen: a swap-out moves at least
 * what was asked, at most one allocation more.
 *
 * Locks: nvs_ctx_mu (read) for a whole job (as a drain holds it: no context is destroyed under the
 * internal stream, no capture begins); mem_mu, vmm_mu, the area's lock and the pool's only inside
 * the calls to memory.c, vmm.c, area.c and pool.c. The figures (engine, bandwidths) are atomics
 * any thread reads.
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include "area.h"
#include "gate.h"
#include "loader.h"
#include "log.h"
#include "memory.h"
#include "notify.h"
#include "pool.h"
#include "swap.h"
#include "vmm.h"

/* What one step of a job moves at most before it says so: 512 MiB is 10 ms of an H200's link,
 * so the next holder's swap-in trails this one's swap-out by about that. */
#define PIECE ((size_t)512 << 20)
/* Moves shorter than this tell little about the bandwidth (they are mostly latency). */
#define MEASURED_SECONDS 0.01

typedef CUresult (*discard_fn)(CUdeviceptr *, size_t *, size_t, unsigned long long, CUstream);
typedef CUresult (*discard_prefetch_fn)(CUdeviceptr *, size_t *, size_t, CUmemLocation *, size_t *, size_t,
                                        unsigned long long, CUstream);

/* Resolved once by the worker (nvs_swap_resolve); engine is published last (release). */
static discard_fn discard;
static discard_prefetch_fn discard_prefetch;
static _Atomic int engine = NVS_SWAP_UNRESOLVED;
/* The bandwidths of the last pinned moves, bytes per second as doubles' bits (0: none yet). */
static _Atomic uint64_t out_bps_bits, in_bps_bits;

static void *driver_function(const char *name) {
    void *pfn = NULL;
    CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    if (nvs_real.cuGetProcAddress_v2 == NULL ||
        nvs_real.cuGetProcAddress_v2(name, &pfn, 13000, CU_GET_PROC_ADDRESS_DEFAULT, &status) != CUDA_SUCCESS ||
        status != CU_GET_PROC_ADDRESS_SUCCESS)
        return NULL;
    return pfn;
}

static pthread_once_t resolve_once = PTHREAD_ONCE_INIT;

static void resolve(void) {
    discard = (discard_fn)driver_function("cuMemDiscardBatchAsync");
    discard_prefetch = (discard_prefetch_fn)driver_function("cuMemDiscardAndPrefetchBatchAsync");
    int pinned = discard != NULL && discard_prefetch != NULL && nvs_real.cuMemHostAlloc != NULL &&
                 nvs_real.cuMemcpyDtoHAsync_v2 != NULL && nvs_real.cuMemcpyHtoDAsync_v2 != NULL;
    if (!pinned)
        nvs_warn("the CUDA driver has no cuMemDiscardBatchAsync/cuMemDiscardAndPrefetchBatchAsync (CUDA 13): "
                 "swapping moves memory with cuMemPrefetchAsync, about 4-15 times slower to the host");
    atomic_store_explicit(&engine, pinned ? NVS_SWAP_COPY : NVS_SWAP_MIGRATE, memory_order_release);
}

void nvs_swap_resolve(void) {
    if (nvs_real_load() == 0) pthread_once(&resolve_once, resolve);
}

static double load_rate(_Atomic uint64_t *bits) {
    uint64_t raw = atomic_load(bits);
    double rate;
    memcpy(&rate, &raw, sizeof rate);
    return rate;
}

static void note_rate(_Atomic uint64_t *bits, uint64_t bytes, double seconds) {
    if (bytes == 0 || seconds < MEASURED_SECONDS) return;
    double rate = (double)bytes / seconds, old = load_rate(bits);
    if (old > 0) rate = (old + rate) / 2; /* the recent moves, the last one weighing half */
    uint64_t raw;
    memcpy(&raw, &rate, sizeof raw);
    atomic_store(bits, raw);
}

void nvs_swap_figures(struct nvs_swap_figures *out) {
    out->engine = atomic_load_explicit(&engine, memory_order_acquire);
    out->area = nvs_area_ready();
    out->out_bps = (uint64_t)(load_rate(&out_bps_bits) + 0.5);
    out->in_bps = (uint64_t)(load_rate(&in_bps_bits) + 0.5);
    out->pool = nvs_pool_joined();
}

/* --- choosing ----------------------------------------------------------------------------------*/

static int least_recent_first(const void *x, const void *y) {
    const struct nvs_swappable *a = x, *b = y;
    if (a->last_used != b->last_used) return a->last_used < b->last_used ? -1 : 1;
    return a->size > b->size ? -1 : a->size < b->size;
}

static int most_recent_first(const void *x, const void *y) {
    const struct nvs_swappable *a = x, *b = y;
    if (a->last_used != b->last_used) return a->last_used > b->last_used ? -1 : 1;
    return a->size > b->size ? -1 : a->size < b->size;
}

/* d's converted allocations and movable VMM handles that are (1) or are not (0) swapped out,
 * in the given order; NULL with *n = 0 when there are none. */
static struct nvs_swappable *gather(struct nvs_device *d, int swapped, int (*order)(const void *, const void *),
                                    size_t *n) {
    struct nvs_swappable *converted, *vmm;
    size_t n_converted = nvs_memory_swappable(d, swapped, &converted);
    size_t n_vmm = nvs_vmm_swappable(d, swapped, &vmm);
    *n = 0;
    struct nvs_swappable *all = n_converted + n_vmm > 0 ? malloc((n_converted + n_vmm) * sizeof *all) : NULL;
    if (all != NULL) {
        if (n_converted) memcpy(all, converted, n_converted * sizeof *all);
        if (n_vmm) memcpy(all + n_converted, vmm, n_vmm * sizeof *all);
        *n = n_converted + n_vmm;
        qsort(all, *n, sizeof *all, order);
    }
    free(converted);
    free(vmm);
    return all;
}

/* --- moving ------------------------------------------------------------------------------------*/

/* A job's moves go in batches of about a piece each, two batches in flight, so that while the
 * host settles one (and reports its progress) the link moves the next. Each batch's discard (or
 * discard-and-prefetch) is one call for all its converted blocks, not one a 64 MiB block. Out,
 * the batches go on two streams in turn. In, on one stream, each batch's pages made anew just
 * before its copies: measured on an H200 with 16 GiB (4 rounds each), that ran steadily at
 * 0.43-0.45 s (39-40 GB/s end to end) where a block at a time took 0.46-0.48 s; making every
 * page of the job first in one call, or the batches on two streams, was faster when it worked
 * (0.39-0.40 s) but now and then left pages to the driver's faults: 1.2-17.6 s. */
#define BATCH_ITEMS 64

struct batch {
    struct nvs_swappable *items[BATCH_ITEMS];
    int failed[BATCH_ITEMS]; /* its move could not be queued: it stays where it was */
    size_t n;
    uint64_t bytes;
    CUstream stream;
};

struct job {
    struct nvs_device *d;
    CUstream streams[2];
    int n_streams;         /* made by begin: two out, one in */
    int capturing;         /* a stream capture runs on the device */
    int out;               /* moving to the host, else back */
    uint64_t epoch;        /* in: the swap epoch what comes back belongs to */
    uint64_t piece;        /* a batch is launched once it holds this many bytes */
    uint64_t pinned_bytes; /* moved through the area, for the bandwidth */
    /* Where a job's time goes (the debug log says it at the end): in the driver's calls that
     * queue the moves, in waiting for them, and in how many batches. */
    double queueing, waiting;
    int launched;
    struct batch batches[2];
    int filling;           /* the batch items are added to; the other may be in flight */
    int in_flight;         /* the other one was launched and is not settled yet */
};

/* The progress of a move: `bytes` more (or fewer) of d's swappable memory are on the host.
 * The client thread reports it (MEMORY resident=) at once. */
static void progress(struct nvs_device *d, int64_t bytes) {
    if (bytes > 0)
        atomic_fetch_add(&d->swapped, (uint64_t)bytes);
    else
        atomic_fetch_sub(&d->swapped, (uint64_t)-bytes);
    nvs_client_memory_changed();
}

/* Queue the copies of an item between its memory and its runs in the area, out (to the host)
 * or in. */
static CUresult copy_item(CUstream stream, const struct nvs_swappable *item, int out) {
    const struct nvs_area_run *runs;
    size_t n = nvs_area_runs(item->area, &runs), offset = 0;
    for (size_t i = 0; i < n; offset += runs[i++].bytes) {
        CUdeviceptr device = item->ptr + offset;
        CUresult r = out ? nvs_real.cuMemcpyDtoHAsync_v2(runs[i].host, device, runs[i].bytes, stream)
                         : nvs_real.cuMemcpyHtoDAsync_v2(device, runs[i].host, runs[i].bytes, stream);
        if (r != CUDA_SUCCESS) return r;
    }
    return CUDA_SUCCESS;
}

static CUresult prefetch_item(CUstream stream, int ordinal, const struct nvs_swappable *item, int to_host) {
    if (nvs_real.cuMemPrefetchAsync_v2 != NULL) {
        CUmemLocation where = {.type = to_host ? CU_MEM_LOCATION_TYPE_HOST : CU_MEM_LOCATION_TYPE_DEVICE,
                               .id = to_host ? 0 : ordinal};
        return nvs_real.cuMemPrefetchAsync_v2(item->ptr, item->size, where, 0, stream);
    }
    return nvs_real.cuMemPrefetchAsync(item->ptr, item->size, to_host ? CU_DEVICE_CPU : ordinal, stream);
}

/* A batch's size: PIECE, or an eighth of a smaller job (progress is told at least eight times a
 * job). */
static uint64_t piece_of(const struct nvs_swappable *items, size_t n) {
    uint64_t total = 0;
    for (size_t i = 0; i < n; i++) total += items[i].size;
    return total / 8 < PIECE ? total / 8 : PIECE;
}

/* Whether the batch's item i is a converted block moving through the area (one whose pages a
 * discard gives up or makes anew). */
static int area_block(const struct batch *batch, size_t i) {
    const struct nvs_swappable *item = batch->items[i];
    return !batch->failed[i] && !item->vmm && item->area != NULL;
}

/* The batch's converted blocks in the area: their addresses and sizes; how many. */
static size_t area_blocks(const struct batch *batch, CUdeviceptr *ptrs, size_t *sizes) {
    size_t n = 0;
    for (size_t i = 0; i < batch->n; i++) {
        if (!area_block(batch, i)) continue;
        ptrs[n] = batch->items[i]->ptr;
        sizes[n++] = batch->items[i]->size;
    }
    return n;
}

/* An item's move out could not be queued: it stays where it is. */
static void fail_out(struct batch *batch, size_t i, CUresult r) {
    struct nvs_swappable *item = batch->items[i];
    nvs_debug("moving %#llx (%zu bytes) to the host failed (%d)", (unsigned long long)item->ptr, item->size, r);
    batch->failed[i] = 1;
}

/* Queues the batch's moves on its stream. Out: each item's copies into the area (or its
 * prefetch), then one discard of the converted blocks' pages (they go without being moved; a
 * refused discard leaves them all resident). In: one discard-and-prefetch making the converted
 * blocks' pages anew, then the copies back (or prefetches). */
static void launch(struct job *job, struct batch *batch) {
    double since = nvs_now();
    CUdeviceptr ptrs[BATCH_ITEMS];
    size_t sizes[BATCH_ITEMS];
    if (!job->out) {
        size_t n = area_blocks(batch, ptrs, sizes), first = 0;
        CUmemLocation here = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = job->d->ordinal};
        CUresult r = n > 0 ? discard_prefetch(ptrs, sizes, n, &here, &first, 1, 0, batch->stream) : CUDA_SUCCESS;
        if (r != CUDA_SUCCESS)
            nvs_warn("making %zu blocks of device %d resident again failed (%d): their bytes are copied back all the "
                     "same (the driver makes the pages as they are written)", n, job->d->ordinal, r);
    }
    for (size_t i = 0; i < batch->n; i++) {
        struct nvs_swappable *item = batch->items[i];
        CUresult r = item->area != NULL ? copy_item(batch->stream, item, job->out)
                                        : prefetch_item(batch->stream, job->d->ordinal, item, job->out);
        if (r == CUDA_SUCCESS) continue;
        if (job->out)
            fail_out(batch, i, r);
        else /* settled as resident all the same: a failed copy leaves indeterminate bytes, as a
              * failed copy of the application's would; the error is the context's */
            nvs_warn("bringing %zu bytes at %#llx back to device %d failed (%d)", item->size,
                     (unsigned long long)item->ptr, job->d->ordinal, r);
    }
    if (job->out) {
        size_t n = area_blocks(batch, ptrs, sizes);
        CUresult r = n > 0 ? discard(ptrs, sizes, n, 0, batch->stream) : CUDA_SUCCESS;
        for (size_t i = 0; r != CUDA_SUCCESS && i < batch->n; i++)
            if (area_block(batch, i)) fail_out(batch, i, r);
    }
    job->queueing += nvs_now() - since;
    job->launched++;
}

/* Waits for the batch's moves, then settles each item: out, its mark set (VMM: unmapped and
 * released); in, resident again with the job's epoch. What settled is reported at once as
 * progress. A failed move leaves its item as it was (its place in the area given back). */
static void settle(struct job *job, struct batch *batch) {
    if (batch->n == 0) return;
    double since = nvs_now();
    CUresult synced = nvs_real.cuStreamSynchronize(batch->stream);
    job->waiting += nvs_now() - since;
    if (synced != CUDA_SUCCESS) nvs_warn("waiting for a swap of device %d returned %d", job->d->ordinal, synced);
    int64_t moved = 0;
    for (size_t i = 0; i < batch->n; i++) {
        struct nvs_swappable *item = batch->items[i];
        int settled;
        if (job->out) {
            int copied = synced == CUDA_SUCCESS && !batch->failed[i];
            settled = item->vmm ? nvs_vmm_release_physical(item, copied) == 0
                                : copied && nvs_memory_mark(job->d, item, 1, item->last_used) == 0;
            if (!settled) { /* failed, freed or unmapped meanwhile, or the driver refused: it stays */
                nvs_area_give(item->area);
                item->area = NULL;
            }
        } else {
            struct nvs_swappable back = *item;
            back.area = NULL;
            if (item->vmm) {
                nvs_vmm_restored(item, job->epoch);
                settled = 1;
            } else {
                settled = nvs_memory_mark(job->d, &back, 0, job->epoch) == 0; /* else freed: the free counted it */
            }
        }
        if (settled) moved += (int64_t)item->size;
        if (settled && item->area != NULL) job->pinned_bytes += item->size;
        if (!job->out) nvs_area_give(item->area); /* its bytes are back: the place is free again */
    }
    if (moved) progress(job->d, job->out ? moved : -moved);
    batch->n = 0;
    batch->bytes = 0;
}

/* Launches the filling batch, settles the one before it (still in flight), and fills the other
 * stream's batch next. */
static void launch_filling(struct job *job) {
    struct batch *filling = &job->batches[job->filling], *other = &job->batches[!job->filling];
    if (filling->n == 0) return;
    launch(job, filling);
    if (job->in_flight) settle(job, other);
    job->in_flight = 1;
    job->filling = !job->filling;
}

/* Adds an item whose move is prepared; launches its batch once the batch holds a piece. */
static void add(struct job *job, struct nvs_swappable *item) {
    struct batch *batch = &job->batches[job->filling];
    batch->failed[batch->n] = 0;
    batch->items[batch->n++] = item;
    batch->bytes += item->size;
    if (batch->bytes >= job->piece || batch->n == BATCH_ITEMS) launch_filling(job);
}

/* Launches what is left and settles everything. */
static void finish(struct job *job, double since) {
    launch_filling(job);
    if (job->in_flight) settle(job, &job->batches[!job->filling]);
    job->in_flight = 0;
    if (job->launched > 0)
        nvs_debug("swap %s of device %d: %llu bytes through the area in %d batches, %.3f s (queueing %.3f s, waiting %.3f s)",
                  job->out ? "out" : "in", job->d->ordinal, (unsigned long long)job->pinned_bytes, job->launched,
                  nvs_now() - since, job->queueing, job->waiting);
}

/* Prepares an item's move in: its place in the area is taken over first (a free meanwhile must
 * not give it back under the copy); VMM memory gets a new physical handle mapped at its
 * address. 0 when its move can be launched. */
static int prepare_in(struct job *job, struct nvs_swappable *item) {
    if (item->area == NULL) return 0; /* moved by the driver's prefetch: prefetched back */
    if (item->vmm) {
        struct nvs_extent *area;
        if (nvs_vmm_restore_physical(item, &area) != 0) return -1;
        item->area = area;
        return 0;
    }
    struct nvs_swappable claimed = *item;
    claimed.area = NULL;
    return nvs_memory_mark(job->d, &claimed, 1, item->last_used) == 0 ? 0 : -1; /* else freed: the free gave it */
}

/* The caller holds nvs_ctx_mu. A job moving d's memory `out` (to the host) or back: its streams
 * (two out, one in: see BATCH_ITEMS) made in one of d's contexts, that context pushed; -1 while
 * a capture runs on d (unless `during_capture`), 1 when there is no context to use (nothing
 * can have been allocated). */
static int begin(struct job *job, struct nvs_device *d, int out, int during_capture) {
    *job = (struct job){.d = d, .out = out, .n_streams = out ? 2 : 1};
    pthread_mutex_lock(&nvs_mu);
    job->capturing = d->captures > 0;
    CUcontext ctx = d->n_contexts > 0 ? d->contexts[0] : NULL;
    pthread_mutex_unlock(&nvs_mu);
    if (job->capturing && !during_capture) return -1;
    /* Managed memory is one address space for every context of the device: one will do. */
    if (ctx == NULL || nvs_real.cuStreamCreate == NULL || nvs_real.cuCtxPushCurrent_v2(ctx) != CUDA_SUCCESS) return 1;
    /* Non-blocking: never ordered with the application's legacy default stream (the gate is
     * closed meanwhile; the synchronise of each batch is the only ordering needed). */
    for (int i = 0; i < job->n_streams; i++) {
        if (nvs_real.cuStreamCreate(&job->streams[i], CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS) continue;
        if (i == 1) nvs_real.cuStreamDestroy_v2(job->streams[0]);
        CUcontext popped;
        nvs_real.cuCtxPopCurrent_v2(&popped);
        nvs_warn("no stream to swap memory of device %d: nothing moved", d->ordinal);
        return 1;
    }
    job->batches[0].stream = job->streams[0];
    job->batches[1].stream = job->streams[job->n_streams - 1];
    return 0;
}

static void end(struct job *job) {
    for (int i = 0; i < job->n_streams; i++) nvs_real.cuStreamDestroy_v2(job->streams[i]);
    CUcontext popped;
    nvs_real.cuCtxPopCurrent_v2(&popped);
}

int nvs_swap_out(struct nvs_device *d, uint64_t at_least) {
    nvs_swap_resolve();
    int pinned_engine = atomic_load_explicit(&engine, memory_order_acquire) == NVS_SWAP_COPY;
    size_t n;
    struct nvs_swappable *items = gather(d, 0, least_recent_first, &n);
    size_t chosen = 0;
    for (uint64_t total = 0; chosen < n && total < at_least; chosen++) total += items[chosen].size;
    struct job job;
    pthread_rwlock_rdlock(&nvs_ctx_mu);
    int started = begin(&job, d, 1, 0);
    if (started == 0) {
        double since = nvs_now();
        job.piece = piece_of(items, chosen);
        for (size_t i = 0; i < chosen; i++) {
            /* The scheduler took the EVICT back (the application asked for the device while its
             * memory moved out): what is queued ends, the rest stays. */
            if (atomic_load(&d->job_cut)) {
                nvs_debug("swap out of device %d cut short: %zu of %zu allocations queued", d->ordinal, i, chosen);
                break;
            }
            int pinned = pinned_engine && nvs_area_take(items[i].size, &items[i].area) == 0;
            /* Only the area can hold VMM memory; and a handle is claimed before its copy, so that
             * the application's unmap or release waits until it is out. */
            if (items[i].vmm && (!pinned || nvs_vmm_claim(&items[i]) != 0)) {
                nvs_area_give(items[i].area);
                items[i].area = NULL;
                continue;
            }
            add(&job, &items[i]);
        }
        finish(&job, since);
        note_rate(&out_bps_bits, job.pinned_bytes, nvs_now() - since);
        end(&job);
    }
    pthread_rwlock_unlock(&nvs_ctx_mu);
    free(items);
    return started < 0 ? -1 : 0;
}

int nvs_swap_in(struct nvs_device *d, uint64_t up_to, int for_grant) {
    nvs_swap_resolve();
    size_t n;
    struct nvs_swappable *items = gather(d, 1, most_recent_first, &n);
    /* Within `up_to`, most recent first, skipping what no longer fits. For a grant, memory in the
     * area comes back whatever `up_to` says: it is nowhere else. */
    uint64_t total = 0;
    unsigned char *chosen = n > 0 ? calloc(n, 1) : NULL;
    for (size_t i = 0; chosen != NULL && i < n; i++) {
        if ((for_grant && items[i].area != NULL) || items[i].size <= up_to - total) {
            chosen[i] = 1;
            total += items[i].size < up_to - total ? items[i].size : up_to - total;
        }
    }
    struct job job = {.capturing = 0};
    int left_out = 0; /* area memory that did not come back */
    pthread_rwlock_rdlock(&nvs_ctx_mu);
    /* During a stream capture a grant still brings converted memory back from the area (copies
     * and a synchronise on a stream of nvshare's own are no calls a capture forbids), but not VMM
     * memory (creating and mapping physical memory is) nor anything ahead of a grant. */
    int started = n > 0 && chosen != NULL ? begin(&job, d, 0, for_grant) : 1;
    /* What comes back for the grant belongs to the epoch the grant begins, so does what comes
     * back ahead of it. */
    uint64_t epoch = for_grant ? atomic_fetch_add(&d->swap_epoch, 1) + 1 : atomic_load(&d->swap_epoch) + 1;
    if (started == 0) {
        double since = nvs_now();
        job.epoch = epoch;
        job.piece = piece_of(items, n);
        for (size_t i = 0; i < n; i++) {
            if (!chosen[i]) continue;
            if (job.capturing && (items[i].vmm || items[i].area == NULL)) {
                chosen[i] = 0; /* VMM memory waits for the capture's end; the rest faults in */
                left_out |= items[i].area != NULL;
                continue;
            }
            if (prepare_in(&job, &items[i]) == 0) add(&job, &items[i]);
        }
        finish(&job, since);
        note_rate(&in_bps_bits, job.pinned_bytes, nvs_now() - since);
        end(&job);
    }
    pthread_rwlock_unlock(&nvs_ctx_mu);
    if (for_grant && started >= 0) {
        /* The rest moved by prefetch (beyond what fits) counts as resident too, keeping its last
         * use: the holder may touch any of it (it faults in), and the next swap-out takes it
         * first. */
        for (size_t i = 0; i < n; i++) {
            if ((chosen != NULL && chosen[i] && started == 0) || items[i].area != NULL) continue;
            if (nvs_memory_mark(d, &items[i], 0, items[i].last_used) == 0) progress(d, -(int64_t)items[i].size);
        }
    }
    free(chosen);
    free(items);
    return started < 0 || left_out ? -1 : 0;
}

int nvs_swap_prepare_due(void) {
    return atomic_load_explicit(&engine, memory_order_acquire) == NVS_SWAP_COPY &&
           (nvs_pool_due() || nvs_area_change_due() != 0);
}

int nvs_swap_prepare_watching(void) { return nvs_pool_joined(); }

int nvs_swap_prepare_step(void) {
    if (!nvs_swap_prepare_due()) return 0;
    /* Pinned memory is allocated (and registered) in a context: any one of the process's will do
     * (PORTABLE). No pinning while a capture runs (it is not a call a capture allows). The pool
     * first: a process that joins it pins nothing of its own. */
    CUcontext ctx = NULL;
    pthread_rwlock_rdlock(&nvs_ctx_mu);
    pthread_mutex_lock(&nvs_mu);
    int capturing = 0;
    uint64_t movable = 0; /* what an EVICT could ask this process to move out */
    for (int i = 0; i < nvs_n_devices; i++) {
        struct nvs_device *d = &nvs_devices[i];
        capturing |= d->captures > 0;
        if (ctx == NULL && d->n_contexts > 0) ctx = d->contexts[0];
        uint64_t converted = atomic_load(&d->converted), swapped = atomic_load(&d->swapped);
        movable += converted > swapped ? converted - swapped : 0;
    }
    pthread_mutex_unlock(&nvs_mu);
    nvs_pool_need(movable);
    int changed = 0;
    if (!capturing && ctx != NULL && nvs_real.cuCtxPushCurrent_v2(ctx) == CUDA_SUCCESS) {
        changed = nvs_pool_step() > 0 || nvs_area_change_step() > 0;
        CUcontext popped;
        nvs_real.cuCtxPopCurrent_v2(&popped);
    }
    pthread_rwlock_unlock(&nvs_ctx_mu);
    if (changed) nvs_client_memory_changed(); /* the area's size is reported */
    return changed;
}
