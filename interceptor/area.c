/*
 * The swap area: pinned host memory of the process that swapped-out device memory is copied
 * into (docs/interceptor.md, "Swapping"). Pinning takes time, so the area is pinned once, ahead
 * of handoffs, in chunks of AREA_CHUNK (the pinner thread, worker.c, pins one chunk at a time,
 * see swap.c), and reused: a swapped-out allocation holds a list of runs of AREA_PAGE pages and gives
 * them back when it is brought back or freed.
 *
 * How a chunk is pinned (measured on an H200, benchmarks/results/swap-paths-h200-2026-11-28.json
 * and swap-paths-h200-2026-11-28-pinning.json, "pinning"): cuMemHostAlloc costs 0.43 s per GiB
 * (threads do not help); registering anonymous memory with cuMemHostRegister 0.29 s, and 0.19 s
 * when the memory is advised to transparent huge pages first (the driver pins 2 MiB pages, not
 * 4 KiB ones). Of those 0.19 s, 0.18 are the kernel making the pages present (allocating and
 * zeroing them), which spreads over cores where the driver's pinning does not: made present
 * first (MADV_POPULATE_WRITE) from four threads, a GiB takes 0.05-0.08 s, and registering
 * present pages 0.02-0.04 s. So a chunk is an anonymous mapping aligned to 2 MiB, advised MADV_HUGEPAGE,
 * made present from several threads (populate.c), registered PORTABLE, and given back with
 * cuMemHostUnregister + munmap. Where registering fails (the driver refuses, no entry point, no
 * mapping) the area warns once and pins its chunks with cuMemHostAlloc from then on; each chunk
 * remembers how it was pinned and is freed that way.
 *
 * Fork: the mappings are advised MADV_DONTFORK, so a child does not get them (and the kernel
 * copies no pinned pages for it at fork); a child cannot use the driver, so it only forgets the
 * chunks (nvs_area_reset_after_fork).
 *
 * How much is pinned follows a target per device (the scheduler's PREPARE, summed over the
 * devices): chunks are added while the area is below it and whole free chunks are given back
 * while it is above it.
 *
 * The pool (pool.c): while the process is a member of its user's swap pool, the area pins
 * nothing of its own (PREPARE's targets wait; free chunks of its own are given back) and takes
 * its room from the pool instead: when its chunks lack room, nvs_area_take claims free pool
 * segments (registered already, so at once), and each becomes a chunk of the table like any
 * other, its pages handed out the same way; a segment that is wholly free again goes back to the
 * pool as soon as the pages are given back, for another process to evict into.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "area.h"
#include "gate.h"
#include "loader.h"
#include "log.h"
#include "pool.h"
#include "populate.h"

#define AREA_CHUNK ((size_t)64 << 20)
#define AREA_PAGE ((size_t)64 << 10)
#define PAGES_PER_CHUNK (AREA_CHUNK / AREA_PAGE)
#define MAX_CHUNKS 16384 /* 1 TiB of pinned memory */
#define HUGE_PAGE ((size_t)2 << 20) /* a transparent huge page (x86-64, aarch64 with 4 KiB pages) */

enum pinning {
    PINNED_REGISTERED, /* an anonymous mapping of ours, cuMemHostRegister'd */
    PINNED_ALLOCATED,  /* cuMemHostAlloc'd */
    PINNED_POOL,       /* a segment of the pool this process owns */
};

struct chunk {
    char *host;
    size_t pages; /* AREA_CHUNK / AREA_PAGE, or a pool segment's */
    enum pinning how;
    int segment;  /* PINNED_POOL: its index in the pool */
    size_t free_pages;
    uint64_t used[]; /* a bit per page: taken */
};

struct nvs_extent {
    size_t bytes;
    size_t n;
    struct nvs_area_run runs[];
};

/* Guards the chunk table, the page bits and the targets; any thread. A leaf lock: never held
 * across a CUDA call, I/O or another lock. */
static pthread_mutex_t area_mu = PTHREAD_MUTEX_INITIALIZER;
static struct chunk *chunks[MAX_CHUNKS]; /* NULL: an empty place */
static size_t n_chunks;                  /* places used, the highest + 1 */
static size_t pinned_chunks;             /* of them, pinned by the area itself (not the pool's) */
static uint64_t targets[NVS_MAX_DEVICES]; /* bytes each device may want swapped out at once */
/* Set once registering a chunk failed: the area pins with cuMemHostAlloc from then on (and the
 * warning is not repeated). Written by the thread that pins (the pinner: nvs_area_change_step,
 * which swap.c calls under nvs_ctx_mu) and reset after fork; atomic, read and written relaxed. */
static int registering_failed;

static int page_taken(const struct chunk *c, size_t page) { return (c->used[page / 64] >> (page % 64)) & 1; }

static void mark_pages(struct chunk *c, size_t first, size_t count, int taken) {
    for (size_t page = first; page < first + count; page++) {
        if (taken)
            c->used[page / 64] |= 1ULL << (page % 64);
        else
            c->used[page / 64] &= ~(1ULL << (page % 64));
    }
    c->free_pages = taken ? c->free_pages - count : c->free_pages + count;
}

static size_t pages_for(size_t bytes) { return (bytes + AREA_PAGE - 1) / AREA_PAGE; }

/* Under area_mu: the first free run of chunk c of at least `wanted` pages, or else its longest
 * one; its length (its start in *first). Whole taken words are skipped at once. */
static size_t find_run(const struct chunk *c, size_t wanted, size_t *first) {
    size_t best = 0, run = 0;
    for (size_t page = 0; page < c->pages;) {
        if (run == 0 && page % 64 == 0 && c->used[page / 64] == ~0ULL) {
            page += 64;
            continue;
        }
        run = page_taken(c, page) ? 0 : run + 1;
        page++;
        if (run > best) {
            best = run;
            *first = page - run;
            if (best >= wanted) break;
        }
    }
    return best;
}

static uint64_t free_bytes_locked(void) {
    uint64_t pages = 0;
    for (size_t i = 0; i < n_chunks; i++)
        if (chunks[i] != NULL) pages += chunks[i]->free_pages;
    return pages * AREA_PAGE;
}

/* Under area_mu: the chunk with the longest free run, at least `wanted` pages long if there is
 * one (the first such). */
static size_t pick_run(size_t wanted, size_t *chunk, size_t *first) {
    size_t best = 0;
    for (size_t i = 0; i < n_chunks && best < wanted; i++) {
        size_t start = 0, length;
        if (chunks[i] == NULL || chunks[i]->free_pages <= best) continue;
        length = find_run(chunks[i], wanted, &start);
        if (length > best) best = length, *chunk = i, *first = start;
    }
    return best;
}

/* Under area_mu: room for `bytes` from the chunks in the table (0, in *out), or -1 and nothing
 * taken when they have less free. */
static int take_locked(size_t bytes, struct nvs_extent **out) {
    size_t wanted = pages_for(bytes);
    if (free_bytes_locked() < wanted * AREA_PAGE) return -1;
    /* As few runs as possible: each run is one copy. */
    size_t cap = 8, n = 0;
    struct nvs_extent *e = malloc(sizeof *e + cap * sizeof e->runs[0]);
    while (e != NULL && wanted > 0) {
        size_t chunk = 0, first = 0;
        size_t take = pick_run(wanted, &chunk, &first);
        if (take > wanted) take = wanted;
        if (n == cap) {
            cap *= 2;
            struct nvs_extent *grown = realloc(e, sizeof *e + cap * sizeof e->runs[0]);
            if (grown == NULL) break;
            e = grown;
        }
        mark_pages(chunks[chunk], first, take, 1);
        e->runs[n++] = (struct nvs_area_run){.host = chunks[chunk]->host + first * AREA_PAGE, .bytes = take * AREA_PAGE,
                                             .chunk = (uint32_t)chunk, .page = (uint32_t)first};
        wanted -= take;
    }
    if (e != NULL && wanted == 0) {
        e->n = n;
        e->bytes = bytes;
        e->runs[n - 1].bytes -= pages_for(bytes) * AREA_PAGE - bytes; /* the last run ends with the data */
        *out = e;
        return 0;
    }
    for (size_t i = 0; e != NULL && i < n; i++)
        mark_pages(chunks[e->runs[i].chunk], e->runs[i].page, pages_for(e->runs[i].bytes), 0);
    free(e);
    return -1;
}

/* A claimed pool segment becomes a chunk of the table; -1 (and it goes back) when it cannot. */
static int add_segment(const struct nvs_pool_segment *segment) {
    size_t pages = segment->bytes / AREA_PAGE;
    struct chunk *c = calloc(1, sizeof *c + (pages + 63) / 64 * sizeof c->used[0]);
    pthread_mutex_lock(&area_mu);
    size_t place = 0;
    while (place < n_chunks && chunks[place] != NULL) place++;
    int added = c != NULL && place < MAX_CHUNKS;
    if (added) {
        *c = (struct chunk){.host = segment->host, .pages = pages, .how = PINNED_POOL, .segment = segment->index,
                            .free_pages = pages};
        chunks[place] = c;
        if (place == n_chunks) n_chunks++;
    }
    pthread_mutex_unlock(&area_mu);
    if (added) return 0;
    free(c);
    nvs_pool_release(segment->index);
    return -1;
}

/* Under area_mu: takes pool chunk `place` out of the table if it is wholly free; its segment's
 * index (for the pool, once area_mu is released), or -1. */
static int drop_free_segment_locked(size_t place) {
    struct chunk *c = chunks[place];
    if (c == NULL || c->how != PINNED_POOL || c->free_pages != c->pages) return -1;
    int segment = c->segment;
    chunks[place] = NULL;
    free(c);
    return segment;
}

int nvs_area_take(size_t bytes, struct nvs_extent **out) {
    *out = NULL;
    if (bytes == 0) return -1;
    /* The chunks in the table first; while they lack room, one more pool segment at a time (only
     * the worker takes: nobody else claims meanwhile). */
    for (;;) {
        pthread_mutex_lock(&area_mu);
        int taken = take_locked(bytes, out);
        pthread_mutex_unlock(&area_mu);
        if (taken == 0) return 0;
        struct nvs_pool_segment segment;
        if (nvs_pool_claim(&segment) != 0 || add_segment(&segment) != 0) break;
    }
    /* Not enough: what this take claimed goes back (no other pool chunk is wholly free: gives
     * return theirs at once). */
    pthread_mutex_lock(&area_mu);
    int *segments = n_chunks > 0 ? malloc(n_chunks * sizeof *segments) : NULL;
    size_t n = 0;
    for (size_t i = 0; segments != NULL && i < n_chunks; i++) {
        int segment = drop_free_segment_locked(i);
        if (segment >= 0) segments[n++] = segment;
    }
    pthread_mutex_unlock(&area_mu);
    for (size_t i = 0; i < n; i++) nvs_pool_release(segments[i]);
    free(segments);
    return -1;
}

void nvs_area_give(struct nvs_extent *e) {
    if (e == NULL) return;
    /* Pool segments this leaves wholly free go back to the pool now: another process may evict
     * into them. */
    int *segments = malloc(e->n * sizeof *segments);
    size_t n = 0;
    pthread_mutex_lock(&area_mu);
    for (size_t i = 0; i < e->n; i++)
        mark_pages(chunks[e->runs[i].chunk], e->runs[i].page, pages_for(e->runs[i].bytes), 0);
    for (size_t i = 0; segments != NULL && i < e->n; i++) {
        int segment = drop_free_segment_locked(e->runs[i].chunk);
        if (segment >= 0) segments[n++] = segment;
    }
    pthread_mutex_unlock(&area_mu);
    for (size_t i = 0; i < n; i++) nvs_pool_release(segments[i]);
    free(segments);
    free(e);
}

size_t nvs_area_runs(const struct nvs_extent *e, const struct nvs_area_run **runs) {
    *runs = e->runs;
    return e->n;
}

void nvs_area_want(int device, uint64_t bytes) {
    if (device < 0 || device >= NVS_MAX_DEVICES) return;
    pthread_mutex_lock(&area_mu);
    targets[device] = bytes;
    pthread_mutex_unlock(&area_mu);
}

static uint64_t target_locked(void) {
    uint64_t sum = 0;
    for (int i = 0; i < NVS_MAX_DEVICES; i++) sum += targets[i];
    return sum;
}

uint64_t nvs_area_ready(void) {
    uint64_t pages = 0;
    pthread_mutex_lock(&area_mu);
    for (size_t i = 0; i < n_chunks; i++)
        if (chunks[i] != NULL) pages += chunks[i]->pages;
    pthread_mutex_unlock(&area_mu);
    return pages * AREA_PAGE + nvs_pool_free_bytes();
}

/* Under area_mu: a chunk the area pinned itself, wholly free. */
static int own_free_chunk(const struct chunk *c) {
    return c != NULL && c->how != PINNED_POOL && c->free_pages == c->pages;
}

int nvs_area_change_due(void) {
    int pooled = nvs_pool_joined(); /* the pool holds this process's room: nothing of its own */
    pthread_mutex_lock(&area_mu);
    uint64_t target = pooled ? 0 : target_locked(), pinned = (uint64_t)pinned_chunks * AREA_CHUNK;
    int grow = pinned < target && n_chunks < MAX_CHUNKS;
    int shrink = 0;
    for (size_t i = 0; i < n_chunks && !grow && pinned >= target + AREA_CHUNK; i++) shrink = own_free_chunk(chunks[i]);
    pthread_mutex_unlock(&area_mu);
    return grow ? 1 : shrink ? -1 : 0;
}

/* AREA_CHUNK bytes of anonymous memory aligned to HUGE_PAGE (so that transparent huge pages can
 * back all of it), advised to them and kept from children; NULL when it cannot be mapped. */
static char *map_chunk(void) {
    size_t span = AREA_CHUNK + HUGE_PAGE;
    char *mapped = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mapped == MAP_FAILED) return NULL;
    char *host = (char *)(((uintptr_t)mapped + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1));
    if (host > mapped) munmap(mapped, (size_t)(host - mapped));
    if (mapped + span > host + AREA_CHUNK) munmap(host + AREA_CHUNK, (size_t)(mapped + span - (host + AREA_CHUNK)));
    /* Advice only: without transparent huge pages the chunk is pinned all the same, slower. */
    madvise(host, AREA_CHUNK, MADV_HUGEPAGE);
    if (madvise(host, AREA_CHUNK, MADV_DONTFORK) != 0) {
        munmap(host, AREA_CHUNK);
        return NULL;
    }
    return host;
}

/* Registers a chunk of our own mapping, or says which error refused it. */
static CUresult register_mapping(char *host) {
    if (nvs_real.cuMemHostRegister_v2 == NULL) return CUDA_ERROR_NOT_FOUND;
    return nvs_real.cuMemHostRegister_v2(host, AREA_CHUNK, CU_MEMHOSTREGISTER_PORTABLE);
}

/* Pins one chunk (a context current; PORTABLE: pinned for every context of the process, whichever
 * is current here): registered while registering works, else allocated by the driver. */
static CUresult pin_chunk(struct chunk *c) {
    if (!__atomic_load_n(&registering_failed, __ATOMIC_RELAXED)) {
        char *mapped = map_chunk();
        /* Advice only: where it fails (a kernel before 5.14, no memory) registering populates. */
        if (mapped != NULL) nvs_populate(mapped, AREA_CHUNK);
        CUresult r = mapped == NULL ? CUDA_ERROR_OUT_OF_MEMORY : register_mapping(mapped);
        if (r == CUDA_SUCCESS) {
            c->host = mapped;
            c->how = PINNED_REGISTERED;
            return CUDA_SUCCESS;
        }
        if (mapped != NULL) munmap(mapped, AREA_CHUNK);
        __atomic_store_n(&registering_failed, 1, __ATOMIC_RELAXED);
        char why[128];
        if (mapped == NULL)
            snprintf(why, sizeof why, "no host memory could be mapped");
        else
            snprintf(why, sizeof why, "%s, %d", nvs_real_error_name(r), r);
        nvs_warn("registering host memory for the swap area failed (%s): the area is pinned with cuMemHostAlloc "
                 "from now on, which is slower (on an H200: 0.43 s per GiB, not 0.19-0.29)",
                 why);
    }
    void *host = NULL;
    CUresult r = nvs_real.cuMemHostAlloc == NULL ? CUDA_ERROR_NOT_FOUND
                                                 : nvs_real.cuMemHostAlloc(&host, AREA_CHUNK, CU_MEMHOSTALLOC_PORTABLE);
    if (r == CUDA_SUCCESS) {
        c->host = host;
        c->how = PINNED_ALLOCATED;
    }
    return r;
}

/* Gives a chunk's pinned memory back the way it was pinned (a context current). */
static void unpin_chunk(const struct chunk *c) {
    if (c->how == PINNED_ALLOCATED) {
        if (nvs_real.cuMemFreeHost != NULL) nvs_real.cuMemFreeHost(c->host);
        return;
    }
    CUresult r = nvs_real.cuMemHostUnregister != NULL ? nvs_real.cuMemHostUnregister(c->host) : CUDA_ERROR_NOT_FOUND;
    if (r == CUDA_SUCCESS) {
        munmap(c->host, AREA_CHUNK);
        return;
    }
    /* Still registered as far as the driver knows: unmapping would let the kernel hand the
     * addresses to another mapping that the driver takes for pinned. Kept, and said. */
    nvs_warn("unregistering %zu bytes of the swap area at %p failed (%s, %d): they stay mapped and pinned", AREA_CHUNK,
             (void *)c->host, nvs_real_error_name(r), r);
}

int nvs_area_change_step(void) {
    int due = nvs_area_change_due();
    if (due > 0) {
        struct chunk *c = calloc(1, sizeof *c + PAGES_PER_CHUNK / 64 * sizeof c->used[0]);
        CUresult r = c == NULL ? CUDA_ERROR_OUT_OF_MEMORY : pin_chunk(c);
        if (r != CUDA_SUCCESS) {
            free(c);
            pthread_mutex_lock(&area_mu);
            unsigned long long pinned = (unsigned long long)pinned_chunks * AREA_CHUNK;
            pthread_mutex_unlock(&area_mu);
            nvs_warn("pinning %zu bytes of the swap area failed (%s, %d): it stays at %llu bytes, and what does not "
                     "fit in it is swapped the slow way (cuMemPrefetchAsync)",
                     AREA_CHUNK, nvs_real_error_name(r), r, pinned);
            return -1;
        }
        c->pages = c->free_pages = PAGES_PER_CHUNK;
        pthread_mutex_lock(&area_mu);
        size_t place = 0;
        while (place < n_chunks && chunks[place] != NULL) place++;
        chunks[place] = c;
        if (place == n_chunks) n_chunks++;
        pinned_chunks++;
        pthread_mutex_unlock(&area_mu);
        return 1;
    }
    if (due < 0) {
        struct chunk *c = NULL;
        pthread_mutex_lock(&area_mu);
        for (size_t i = 0; i < n_chunks && c == NULL; i++)
            if (own_free_chunk(chunks[i])) {
                c = chunks[i];
                chunks[i] = NULL;
                pinned_chunks--;
            }
        pthread_mutex_unlock(&area_mu);
        if (c != NULL) unpin_chunk(c);
        free(c);
        return c != NULL;
    }
    return 0;
}

void nvs_area_reset_after_fork(void) {
    /* The child has no device memory swapped out and cannot use the driver; the registered
     * chunks and the pool's segments are not even mapped in it (MADV_DONTFORK): only the
     * bookkeeping goes (the pool's own, pool.c). */
    pthread_mutex_init(&area_mu, NULL);
    for (size_t i = 0; i < n_chunks; i++) free(chunks[i]);
    memset(chunks, 0, sizeof chunks);
    memset(targets, 0, sizeof targets);
    n_chunks = pinned_chunks = 0;
    __atomic_store_n(&registering_failed, 0, __ATOMIC_RELAXED);
}
