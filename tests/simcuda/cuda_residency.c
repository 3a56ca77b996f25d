/*
 * Residency of managed memory, shared by every process that simulates the same machine.
 *
 * Off unless SIMCUDA_RESIDENCY_DIR names a directory. That directory stands for the machine:
 * `<dir>/<device UUID>` is a file mapped by every process that uses the device, holding
 *
 *   - a table of SIMCUDA_MEMORY / 2 MiB slots, one per chunk the device can hold: which process's
 *     chunk (pid, address) sits in it and when it was last used (a clock, for LRU eviction).
 *     A managed chunk is on the device exactly when a slot names it; everything else is on the
 *     host (first touch included: populating a page costs about what faulting it in does);
 *   - the engine: a fair (ticket) lock that kernels and prefetches of every process hold while
 *     they run, in slices of SIMCUDA_TIMESLICE_US, the way a GPU time-slices between contexts.
 *
 * A kernel makes the memory it touches resident before each of its slices, paying
 * SIMCUDA_FAULT_US_PER_MIB for every MiB faulted in and for every MiB it evicts (least recently
 * used chunks of any process); a prefetch pays SIMCUDA_PREFETCH_US_PER_MIB the same way. The
 * cost is simulated time: the executor sleeps, holding the engine. Every migration is traced.
 *
 * Crash safety: the lock is a robust process-shared mutex (a process that dies holding it hands
 * it on with EOWNERDEAD; the table is consistent slot by slot, so it is simply made consistent
 * again). Slots and engine tickets of processes that no longer exist are reclaimed when seen.
 *
 * Each process keeps, per managed allocation, a hint per chunk: the slot it was last put in.
 * The hint is checked against the slot's (pid, address), so evictions by other processes need
 * not tell the owner anything.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "simcuda.h"

#define SHARED_MAGIC 0x5e51de4ce0000002ull /* bump the low digits when the layout changes */
/* Engine tickets remembered for crash recovery: more than the contexts a device ever has. */
#define ENGINE_RING 256
#define MIB (1024.0 * 1024.0)
/* How often a waiter for the engine checks whether the process it waits for still lives. */
#define ENGINE_POLL_NS 50000000L

/* Measured on an H200: a fault-driven page-in of 8 GiB takes 0.93 s; cuMemPrefetchAsync of the
 * same 8 GiB plus a kernel over it 0.185 s. */
#define DEFAULT_FAULT_US_PER_MIB (0.93e6 / 8192.0)
#define DEFAULT_PREFETCH_US_PER_MIB (0.185e6 / 8192.0)
#define DEFAULT_TIMESLICE_US 2000.0

struct slot {
    int32_t pid;            /* 0: free */
    uint32_t bytes;         /* of the chunk (the last chunk of an allocation may be short) */
    uint64_t address;       /* of the chunk in process `pid` */
    uint64_t last_use;      /* shared clock value */
};

struct shared_device {
    uint64_t magic;
    uint64_t slot_count;
    pthread_mutex_t lock;   /* robust, process-shared; guards everything below */
    pthread_cond_t engine_turn;
    uint64_t clock;
    uint64_t next_ticket, serving;
    int32_t ticket_pid[ENGINE_RING];
    struct slot slots[];
};

struct costs {
    double fault_s_per_byte, prefetch_s_per_byte, timeslice_s;
};

/* Written by cuInit (under its pthread_once), read-only afterwards. */
static struct shared_device *shared[SIM_MAX_DEVICES]; /* by device->index; NULL: not modelled */
static struct costs costs;

int sim_residency_models(const struct sim_device *device)
{
    return shared[device->index] != NULL;
}

double sim_residency_timeslice(void)
{
    return costs.timeslice_s;
}

/* ---- Opening the shared state ---- */

/* A number from the environment, at least `minimum` (and above it when `exclusive`). */
static int read_double(const char *name, double fallback, double minimum, int exclusive, double *out)
{
    const char *text = getenv(name);
    *out = fallback;
    if (!text)
        return 0;
    char *end;
    errno = 0;
    double value = strtod(text, &end);
    if (errno || end == text || *end || !isfinite(value) || value < minimum || (exclusive && value == minimum)) {
        fprintf(stderr, "simcuda: %s=%s is not a number %s %g\n", name, text, exclusive ? "above" : "of at least",
                minimum);
        return -1;
    }
    *out = value;
    return 0;
}

static void init_shared(struct shared_device *state, uint64_t slot_count)
{
    pthread_mutexattr_t mutex_attr;
    pthread_mutexattr_init(&mutex_attr);
    pthread_mutexattr_setpshared(&mutex_attr, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&mutex_attr, PTHREAD_MUTEX_ROBUST);
    pthread_mutex_init(&state->lock, &mutex_attr);
    pthread_mutexattr_destroy(&mutex_attr);
    pthread_condattr_t cond_attr;
    pthread_condattr_init(&cond_attr);
    pthread_condattr_setpshared(&cond_attr, PTHREAD_PROCESS_SHARED);
    pthread_condattr_setclock(&cond_attr, CLOCK_MONOTONIC);
    pthread_cond_init(&state->engine_turn, &cond_attr);
    pthread_condattr_destroy(&cond_attr);
    state->slot_count = slot_count;
    state->magic = SHARED_MAGIC;
}

/* Maps `<dir>/<uuid>`, creating it when it does not exist; the first process sizes it. */
static CUresult open_shared(const char *dir, const struct sim_device *device, struct shared_device **out)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, device->uuid_text);
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) {
        fprintf(stderr, "simcuda: cannot open %s (SIMCUDA_RESIDENCY_DIR): %s\n", path, strerror(errno));
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    CUresult result = CUDA_ERROR_OPERATING_SYSTEM;
    flock(fd, LOCK_EX); /* creators of the same file wait for each other */
    struct stat info;
    uint64_t slot_count = device->total / SIM_CHUNK_BYTES ? device->total / SIM_CHUNK_BYTES : 1;
    size_t size = sizeof(struct shared_device) + slot_count * sizeof(struct slot);
    int fresh = fstat(fd, &info) == 0 && info.st_size == 0;
    if (fresh && ftruncate(fd, (off_t)size) != 0)
        goto out;
    if (!fresh)
        size = (size_t)info.st_size; /* the first process's SIMCUDA_MEMORY counts */
    void *memory = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (memory == MAP_FAILED)
        goto out;
    struct shared_device *state = memory;
    if (fresh)
        init_shared(state, slot_count);
    if (state->magic != SHARED_MAGIC ||
        size < sizeof(struct shared_device) + state->slot_count * sizeof(struct slot)) {
        fprintf(stderr, "simcuda: %s is not a residency file of this simcuda\n", path);
        munmap(memory, size);
        result = CUDA_ERROR_INVALID_VALUE;
        goto out;
    }
    *out = state;
    result = CUDA_SUCCESS;
out:
    if (result == CUDA_ERROR_OPERATING_SYSTEM)
        fprintf(stderr, "simcuda: cannot map %s: %s\n", path, strerror(errno));
    flock(fd, LOCK_UN);
    close(fd);
    return result;
}

CUresult sim_residency_open(void)
{
    const char *dir = getenv("SIMCUDA_RESIDENCY_DIR");
    if (!dir || !*dir)
        return CUDA_SUCCESS;
    double fault_us, prefetch_us, slice_us;
    if (read_double("SIMCUDA_FAULT_US_PER_MIB", DEFAULT_FAULT_US_PER_MIB, 0, 0, &fault_us) != 0 ||
        read_double("SIMCUDA_PREFETCH_US_PER_MIB", DEFAULT_PREFETCH_US_PER_MIB, 0, 0, &prefetch_us) != 0 ||
        read_double("SIMCUDA_TIMESLICE_US", DEFAULT_TIMESLICE_US, 0, 1, &slice_us) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    costs.fault_s_per_byte = fault_us * 1e-6 / MIB;
    costs.prefetch_s_per_byte = prefetch_us * 1e-6 / MIB;
    costs.timeslice_s = slice_us * 1e-6;
    for (int i = 0; i < sim_device_count; i++) {
        CUresult result = open_shared(dir, &sim_devices[i], &shared[sim_devices[i].index]);
        if (result != CUDA_SUCCESS)
            return result;
    }
    return CUDA_SUCCESS;
}

/* ---- The lock and the engine ---- */

static void lock_shared(struct shared_device *state)
{
    if (pthread_mutex_lock(&state->lock) == EOWNERDEAD)
        pthread_mutex_consistent(&state->lock); /* every slot is valid on its own */
}

static int process_alive(pid_t pid)
{
    return kill(pid, 0) == 0 || errno != ESRCH;
}

void sim_engine_enter(const struct sim_device *device)
{
    struct shared_device *state = shared[device->index];
    if (!state)
        return;
    lock_shared(state);
    uint64_t ticket = state->next_ticket++;
    state->ticket_pid[ticket % ENGINE_RING] = (int32_t)getpid();
    while (state->serving != ticket) {
        /* The process whose turn it is may have died, holding or waiting: skip its ticket. */
        if (!process_alive(state->ticket_pid[state->serving % ENGINE_RING])) {
            state->serving++;
            pthread_cond_broadcast(&state->engine_turn);
            continue;
        }
        struct timespec until;
        clock_gettime(CLOCK_MONOTONIC, &until);
        until.tv_nsec += ENGINE_POLL_NS;
        if (until.tv_nsec >= 1000000000L) {
            until.tv_sec++;
            until.tv_nsec -= 1000000000L;
        }
        if (pthread_cond_timedwait(&state->engine_turn, &state->lock, &until) == EOWNERDEAD)
            pthread_mutex_consistent(&state->lock);
    }
    pthread_mutex_unlock(&state->lock);
}

void sim_engine_leave(const struct sim_device *device)
{
    struct shared_device *state = shared[device->index];
    if (!state)
        return;
    lock_shared(state);
    state->serving++;
    pthread_cond_broadcast(&state->engine_turn);
    pthread_mutex_unlock(&state->lock);
}

/* ---- Per-allocation hints ---- */

static size_t chunk_count(const struct sim_alloc *alloc)
{
    return (alloc->size + SIM_CHUNK_BYTES - 1) / SIM_CHUNK_BYTES;
}

int sim_residency_adopt(struct sim_alloc *alloc)
{
    if (alloc->family != SIM_MEM_MANAGED || !sim_residency_models(alloc->device))
        return 0;
    size_t count = chunk_count(alloc);
    alloc->chunk_slots = malloc(count * sizeof *alloc->chunk_slots);
    if (!alloc->chunk_slots)
        return -1;
    for (size_t i = 0; i < count; i++)
        alloc->chunk_slots[i] = -1;
    return 0;
}

static uint64_t chunk_address(const struct sim_alloc *alloc, size_t chunk)
{
    return (uint64_t)alloc->start + (uint64_t)chunk * SIM_CHUNK_BYTES;
}

static uint32_t chunk_bytes(const struct sim_alloc *alloc, size_t chunk)
{
    size_t offset = chunk * SIM_CHUNK_BYTES;
    return (uint32_t)(alloc->size - offset < SIM_CHUNK_BYTES ? alloc->size - offset : SIM_CHUNK_BYTES);
}

/* With the shared lock held: the slot holding the chunk, or NULL when it is on the host. */
static struct slot *resident_slot(struct shared_device *state, const struct sim_alloc *alloc, size_t chunk)
{
    int32_t index = alloc->chunk_slots[chunk];
    if (index < 0 || (uint64_t)index >= state->slot_count)
        return NULL;
    struct slot *slot = &state->slots[index];
    return slot->pid == (int32_t)getpid() && slot->address == chunk_address(alloc, chunk) ? slot : NULL;
}

void sim_residency_forget(struct sim_alloc *alloc)
{
    if (!alloc->chunk_slots)
        return;
    struct shared_device *state = shared[alloc->device->index];
    lock_shared(state);
    for (size_t chunk = 0; chunk < chunk_count(alloc); chunk++) {
        struct slot *slot = resident_slot(state, alloc, chunk);
        if (slot)
            memset(slot, 0, sizeof *slot);
    }
    pthread_mutex_unlock(&state->lock);
    free(alloc->chunk_slots);
    alloc->chunk_slots = NULL;
}

/* ---- Migrations ---- */

/* Bytes moved by one operation, for its cost and its trace lines. */
struct moves {
    size_t to_device;
    size_t to_host_own;           /* this process's chunks sent to the host (prefetch to the CPU) */
    struct {
        int32_t pid;
        size_t bytes;
    } evicted[16];                /* other owners' chunks evicted to make room, by owner */
    size_t evicted_owners;
    size_t evicted_other;         /* owners beyond the table above */
};

static void count_eviction(struct moves *moves, int32_t pid, size_t bytes)
{
    for (size_t i = 0; i < moves->evicted_owners; i++)
        if (moves->evicted[i].pid == pid) {
            moves->evicted[i].bytes += bytes;
            return;
        }
    if (moves->evicted_owners == sizeof moves->evicted / sizeof moves->evicted[0]) {
        moves->evicted_other += bytes;
        return;
    }
    moves->evicted[moves->evicted_owners].pid = pid;
    moves->evicted[moves->evicted_owners++].bytes = bytes;
}

/* Liveness of the owners seen during one operation (kill(pid, 0) once per pid). */
struct liveness {
    int32_t pid[32];
    int alive[32];
    size_t count;
};

static int owner_alive(struct liveness *seen, int32_t pid)
{
    for (size_t i = 0; i < seen->count; i++)
        if (seen->pid[i] == pid)
            return seen->alive[i];
    int alive = pid == (int32_t)getpid() || process_alive(pid);
    if (seen->count < sizeof seen->pid / sizeof seen->pid[0]) {
        seen->pid[seen->count] = pid;
        seen->alive[seen->count++] = alive;
    }
    return alive;
}

/* Eviction order: free slots, then those of dead processes, then least recently used. */
struct candidate {
    int rank;                     /* 0 free, 1 dead owner, 2 live owner */
    uint64_t last_use;
    uint32_t index;
};

static int candidate_order(const void *a, const void *b)
{
    const struct candidate *x = a, *y = b;
    if (x->rank != y->rank)
        return x->rank < y->rank ? -1 : 1;
    if (x->last_use != y->last_use)
        return x->last_use < y->last_use ? -1 : 1;
    return x->index < y->index ? -1 : x->index > y->index;
}

/* The ranges one operation touches: one allocation's chunks [first, last]. */
struct touched {
    struct sim_alloc *alloc;
    size_t first, last;
};

/* With the shared lock held: brings the chunks of `ranges` onto the device. */
static void bring_in(struct shared_device *state, struct touched *ranges, size_t range_count, struct moves *moves)
{
    uint64_t stamp = ++state->clock;
    size_t missing = 0;
    for (size_t r = 0; r < range_count; r++)
        for (size_t chunk = ranges[r].first; chunk <= ranges[r].last; chunk++) {
            struct slot *slot = resident_slot(state, ranges[r].alloc, chunk);
            if (slot)
                slot->last_use = stamp;
            else
                missing++;
        }
    if (missing == 0)
        return;
    struct candidate *order = sim_calloc(state->slot_count, sizeof *order);
    struct liveness seen = {0};
    for (uint64_t i = 0; i < state->slot_count; i++) {
        const struct slot *slot = &state->slots[i];
        order[i].index = (uint32_t)i;
        order[i].last_use = slot->last_use;
        order[i].rank = slot->pid == 0 ? 0 : owner_alive(&seen, slot->pid) ? 2 : 1;
    }
    qsort(order, state->slot_count, sizeof *order, candidate_order);
    /* Chunks touched by this operation carry `stamp` and sort last; an operation that needs more
     * than the device holds goes round again and evicts its own first chunks. */
    size_t next = 0;
    for (size_t r = 0; r < range_count; r++)
        for (size_t chunk = ranges[r].first; chunk <= ranges[r].last; chunk++) {
            struct sim_alloc *alloc = ranges[r].alloc;
            if (resident_slot(state, alloc, chunk))
                continue;
            struct candidate *victim = &order[next++ % state->slot_count];
            struct slot *slot = &state->slots[victim->index];
            if (slot->pid != 0 && owner_alive(&seen, slot->pid))
                count_eviction(moves, slot->pid, slot->bytes);
            slot->pid = (int32_t)getpid();
            slot->bytes = chunk_bytes(alloc, chunk);
            slot->address = chunk_address(alloc, chunk);
            slot->last_use = stamp;
            alloc->chunk_slots[chunk] = (int32_t)victim->index;
            moves->to_device += slot->bytes;
        }
    free(order);
}

/* With the shared lock held: sends the resident chunks of `ranges` to the host. */
static void send_out(struct shared_device *state, struct touched *ranges, size_t range_count, struct moves *moves)
{
    for (size_t r = 0; r < range_count; r++)
        for (size_t chunk = ranges[r].first; chunk <= ranges[r].last; chunk++) {
            struct slot *slot = resident_slot(state, ranges[r].alloc, chunk);
            if (!slot)
                continue;
            moves->to_host_own += slot->bytes;
            memset(slot, 0, sizeof *slot);
        }
}

static void trace_move(const struct sim_ctx *ctx, const char *cause, const char *direction, int32_t owner,
                       size_t bytes, double start, double end)
{
    if (bytes == 0)
        return;
    char fields[256];
    snprintf(fields, sizeof fields,
             "\"op\": \"migrate\", \"cause\": \"%s\", \"direction\": \"%s\", \"owner\": %d, \"bytes\": %zu", cause,
             direction, (int)owner, bytes);
    sim_trace_write(ctx, fields, start, end);
}

/* Sleeps for the cost of the moves, then traces them. */
static void pay(const struct sim_ctx *ctx, const struct moves *moves, int prefetch)
{
    size_t evicted = moves->evicted_other;
    for (size_t i = 0; i < moves->evicted_owners; i++)
        evicted += moves->evicted[i].bytes;
    size_t moved = moves->to_device + moves->to_host_own + evicted;
    if (moved == 0)
        return;
    double start = sim_now();
    sim_sleep_until(start + (double)moved * (prefetch ? costs.prefetch_s_per_byte : costs.fault_s_per_byte));
    double end = sim_now();
    const char *cause = prefetch ? "prefetch" : "fault";
    int32_t self = (int32_t)getpid();
    for (size_t i = 0; i < moves->evicted_owners; i++)
        trace_move(ctx, "evict", "to_host", moves->evicted[i].pid, moves->evicted[i].bytes, start, end);
    trace_move(ctx, "evict", "to_host", 0, moves->evicted_other, start, end);
    trace_move(ctx, cause, "to_host", self, moves->to_host_own, start, end);
    trace_move(ctx, cause, "to_device", self, moves->to_device, start, end);
}

/* With the registry read-locked: the chunk range of [ptr, ptr + bytes) when it is managed memory
 * of `device` with hints. */
static int managed_range(const struct sim_device *device, uintptr_t ptr, size_t bytes, struct touched *out)
{
    struct sim_alloc *alloc = sim_mem_find_range(ptr, bytes ? bytes : 1);
    if (!alloc || !alloc->chunk_slots || alloc->device != device || bytes == 0)
        return 0;
    out->alloc = alloc;
    out->first = (ptr - alloc->start) / SIM_CHUNK_BYTES;
    out->last = (ptr - alloc->start + bytes - 1) / SIM_CHUNK_BYTES;
    return 1;
}

struct collect {
    struct touched *ranges;
    size_t count, capacity;
};

static void collect_whole(struct sim_alloc *alloc, void *argument)
{
    struct collect *collect = argument;
    if (!alloc->chunk_slots)
        return;
    if (collect->count == collect->capacity) {
        collect->capacity = collect->capacity ? 2 * collect->capacity : 16;
        struct touched *grown = realloc(collect->ranges, collect->capacity * sizeof *grown);
        if (!grown) {
            fprintf(stderr, "simcuda: out of host memory\n");
            abort();
        }
        collect->ranges = grown;
    }
    collect->ranges[collect->count++] = (struct touched){alloc, 0, chunk_count(alloc) - 1};
}

void sim_residency_touch(struct sim_ctx *ctx, const struct sim_op *op)
{
    int prefetch = op->kind == SIM_OP_PREFETCH;
    /* A prefetch to the host moves chunks off the device that holds them: the context's. */
    struct sim_device *device = prefetch && op->u.prefetch.target ? op->u.prefetch.target : ctx->device;
    struct shared_device *state = shared[device->index];
    if (!state)
        return;
    struct moves moves = {0};
    struct touched one;
    struct collect all = {0};
    sim_mem_read_lock();
    lock_shared(state);
    if (prefetch) {
        if (managed_range(device, op->u.prefetch.ptr, op->u.prefetch.bytes, &one)) {
            if (!op->u.prefetch.target)
                send_out(state, &one, 1, &moves);
            else
                bring_in(state, &one, 1, &moves);
        }
    } else if (op->u.kernel.kind == SIM_KERNEL_FILL) {
        if (managed_range(device, op->u.kernel.dst, (size_t)op->u.kernel.count * 4, &one))
            bring_in(state, &one, 1, &moves);
    } else {
        /* nvshare_sleep stands for a kernel over the process's whole working set on the device. */
        sim_mem_for_each_managed(device, collect_whole, &all);
        bring_in(state, all.ranges, all.count, &moves);
    }
    pthread_mutex_unlock(&state->lock);
    sim_mem_unlock();
    free(all.ranges);
    pay(ctx, &moves, prefetch);
}
