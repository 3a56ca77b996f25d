/*
 * Residency of device memory, shared by every process that simulates the same machine.
 *
 * Off unless SIMCUDA_RESIDENCY_DIR names a directory. That directory stands for the machine:
 * `<dir>/<device UUID>` is a file mapped by every process that uses the device, holding
 *
 *   - a table of SIMCUDA_MEMORY / 2 MiB slots, one per chunk the device can hold: which process's
 *     chunk (pid, address) sits in it and when it was last used (a clock, for LRU eviction).
 *     A managed chunk is on the device exactly when a slot names it; everything else is on the
 *     host (first touch included: populating a page costs about what faulting it in does).
 *     Physical device memory (cuMemAlloc, pools, cuMemCreate handles) takes `fixed` slots for
 *     as long as it exists: it is never evicted, and it evicts managed chunks to get room;
 *   - the engines: fair (ticket) queues that the work of every process takes turns on. The
 *     compute engine is held by kernels and prefetches, in slices of SIMCUDA_TIMESLICE_US, the
 *     way a GPU time-slices between contexts; the link has one copy engine per direction
 *     (device to host, host to device), held by copies between device-side memory and host
 *     memory in slices of LINK_SLICE_S. So one process's copies overlap another's kernels and
 *     its copies the other way, and two copies the same way share the bandwidth. Copies of
 *     managed memory also take turns with each other whichever way they go (simcuda.h, enum
 *     sim_engine: measured so on an H200).
 *
 * A kernel makes the memory it touches resident before each of its slices, paying
 * SIMCUDA_FAULT_US_PER_MIB for every MiB faulted in and for every MiB it evicts (least recently
 * used chunks of any process). A prefetch to the device pays SIMCUDA_PREFETCH_US_PER_MIB per MiB
 * brought in; moving a chunk to the host (a prefetch to the host, or an eviction that makes room
 * for a prefetch or a physical allocation) pays SIMCUDA_PREFETCH_TO_HOST_US_PER_MIB, or
 * SIMCUDA_FIRST_EVICTION_US_PER_MIB when the chunk has never been on the host since the device
 * created it (the host pages are populated then: a process's first eviction is the slow one).
 * cuMemDiscardBatchAsync gives a process's chunks up without moving them (their contents become
 * indeterminate: the pages are zeroed), and cuMemDiscardAndPrefetchBatchAsync makes them resident
 * at SIMCUDA_DISCARD_PREFETCH_US_PER_MIB, since nothing is copied. Copies cost
 * SIMCUDA_PINNED_US_PER_MIB when their host side is pinned (or registered) memory and
 * SIMCUDA_PAGEABLE_US_PER_MIB when it is pageable; pinning host memory costs
 * SIMCUDA_PIN_US_PER_MIB when the driver allocates it and SIMCUDA_REGISTER_US_PER_MIB (or
 * SIMCUDA_REGISTER_HUGE_US_PER_MIB, when the memory is advised to transparent huge pages) when
 * it registers the application's. Costs are simulated time: the executor (or, for pinning and physical
 * allocations, the calling thread) sleeps. Every migration is traced.
 *
 * Crash safety: the lock is a robust process-shared mutex (a process that dies holding it hands
 * it on with EOWNERDEAD; the table is consistent slot by slot, so it is simply made consistent
 * again). Slots and engine tickets of processes that no longer exist are reclaimed when seen.
 *
 * Each process keeps, per allocation, a hint per chunk: the slot it was last put in, and what it
 * knows of the chunk's host pages. The hint is checked against the slot's (pid, address), so
 * evictions by other processes need not tell the owner anything.
 *
 * (Some 900 lines: the cost model above and the shared device file, from opening it through the
 * engines, the per-allocation hints and the migrations to physical memory's fixed slots. One
 * file, because every part reads or writes that file's private layout under its robust lock and
 * must leave it consistent for the crash rules above.)
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

#define SHARED_MAGIC 0x5e51de4ce0000004ull /* bump the low digits when the layout changes */
/* Engine tickets remembered for crash recovery: more than the contexts a device ever has. */
#define ENGINE_RING 256
#define MIB (1024.0 * 1024.0)
/* How often a waiter for an engine checks whether the process it waits for still lives. */
#define ENGINE_POLL_NS 50000000L
/* A copy holds its copy engine for at most this long at a time, so that copies of several
 * processes in one direction share the link as a real one does. */
#define LINK_SLICE_S 0.001

/* Measured on an H200 (driver 580, CUDA 13): a fault-driven page-in of 8 GiB takes 0.93 s;
 * cuMemPrefetchAsync of managed memory to the GPU 49-51 GB/s, to the CPU 11-15 GB/s, 2.5-6.6 GB/s
 * the first time a process's memory goes out; pinned cudaMemcpy 55 GB/s each way (managed
 * memory resident on the device to pinned memory 52.6 GB/s, back 51.3 GB/s); a copy into
 * freshly allocated pageable memory 1.4 GB/s; cudaMemDiscardAndPrefetchBatchAsync of 16 GiB
 * 0.05 s; allocating 16 GiB of pinned memory 7.5 s; registering anonymous memory with
 * cuMemHostRegister 0.288 s per GiB, 0.186 s when it was advised MADV_HUGEPAGE first (6 GiB in
 * 64 MiB chunks, benchmarks/results/swap-paths-h200-2026-11-28.json). */
#define US_PER_MIB_AT(gb_per_s) (MIB / ((gb_per_s) * 1e3))
#define DEFAULT_FAULT_US_PER_MIB (0.93e6 / 8192.0)
#define DEFAULT_PREFETCH_US_PER_MIB US_PER_MIB_AT(50.0)
#define DEFAULT_PREFETCH_TO_HOST_US_PER_MIB US_PER_MIB_AT(13.0)
#define DEFAULT_FIRST_EVICTION_US_PER_MIB US_PER_MIB_AT(4.5)
#define DEFAULT_PINNED_US_PER_MIB US_PER_MIB_AT(55.0)
#define DEFAULT_PAGEABLE_US_PER_MIB US_PER_MIB_AT(1.4)
#define DEFAULT_DISCARD_PREFETCH_US_PER_MIB (0.05e6 / 16384.0)
#define DEFAULT_PIN_US_PER_MIB (7.5e6 / 16384.0)
#define DEFAULT_REGISTER_US_PER_MIB (0.2877e6 / 1024.0)
#define DEFAULT_REGISTER_HUGE_US_PER_MIB (0.1857e6 / 1024.0)
/* Registering pages that are present already (MADV_POPULATE_WRITE first): 0.021-0.026 s per GiB,
 * the population itself 0.18 s per GiB on one thread, 0.05 on four
 * (benchmarks/results/swap-paths-h200-2026-11-28-pinning.json). */
#define DEFAULT_REGISTER_PRESENT_US_PER_MIB (0.0246e6 / 1024.0)
#define DEFAULT_TIMESLICE_US 2000.0

struct slot {
    int32_t pid;            /* 0: free */
    uint32_t bytes;         /* of the chunk (the last chunk of an allocation may be short) */
    uint64_t address;       /* of the chunk in process `pid` (physical memory: its key) */
    uint64_t last_use;      /* shared clock value */
    uint8_t fixed;          /* physical device memory: never evicted */
    uint8_t host_backed;    /* the chunk's host pages exist: moving it out costs the later rate */
    uint8_t padding[6];
};

/* A fair queue of turns on one engine. */
struct engine {
    uint64_t next_ticket, serving;
    int32_t ticket_pid[ENGINE_RING];
};

struct shared_device {
    uint64_t magic;
    uint64_t slot_count;
    pthread_mutex_t lock;   /* robust, process-shared; guards everything below */
    pthread_cond_t engine_turn; /* broadcast whenever any engine's turn passes */
    uint64_t clock;
    struct engine engines[SIM_ENGINE_COUNT];
    struct slot slots[];
};

struct costs {
    double fault, prefetch_in, prefetch_out, first_out, discard_prefetch, pinned, pageable; /* s/byte */
    double pin, register_pages, register_huge, register_present;                            /* s/byte */
    double timeslice_s;
};

/* Written by cuInit (under its pthread_once), read-only afterwards. */
static struct shared_device *shared[SIM_MAX_DEVICES]; /* by device->index; NULL: not modelled */
static struct costs costs;
static int modelled;       /* some device is modelled */
static int prefetch_in_call; /* SIMCUDA_PREFETCH_IN_CALL: a prefetch to a device migrates inside the call */

/* What a process knows of one chunk of its allocation (alloc->chunk_state). */
enum chunk_state {
    CHUNK_FRESH = 0,        /* never resident: the first touch creates it */
    CHUNK_DEVICE_BORN,      /* created on the device; no host pages yet */
    CHUNK_HOST_BACKED,      /* has been on the host: its host pages exist */
};

int sim_residency_models(const struct sim_device *device)
{
    return shared[device->index] != NULL;
}

int sim_residency_prefetch_in_call(void)
{
    return prefetch_in_call;
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
    static const struct {
        const char *name;
        double fallback;
        size_t offset;
    } rates[] = {
        {"SIMCUDA_FAULT_US_PER_MIB", DEFAULT_FAULT_US_PER_MIB, offsetof(struct costs, fault)},
        {"SIMCUDA_PREFETCH_US_PER_MIB", DEFAULT_PREFETCH_US_PER_MIB, offsetof(struct costs, prefetch_in)},
        {"SIMCUDA_PREFETCH_TO_HOST_US_PER_MIB", DEFAULT_PREFETCH_TO_HOST_US_PER_MIB, offsetof(struct costs, prefetch_out)},
        {"SIMCUDA_FIRST_EVICTION_US_PER_MIB", DEFAULT_FIRST_EVICTION_US_PER_MIB, offsetof(struct costs, first_out)},
        {"SIMCUDA_DISCARD_PREFETCH_US_PER_MIB", DEFAULT_DISCARD_PREFETCH_US_PER_MIB,
         offsetof(struct costs, discard_prefetch)},
        {"SIMCUDA_PINNED_US_PER_MIB", DEFAULT_PINNED_US_PER_MIB, offsetof(struct costs, pinned)},
        {"SIMCUDA_PAGEABLE_US_PER_MIB", DEFAULT_PAGEABLE_US_PER_MIB, offsetof(struct costs, pageable)},
        {"SIMCUDA_PIN_US_PER_MIB", DEFAULT_PIN_US_PER_MIB, offsetof(struct costs, pin)},
        {"SIMCUDA_REGISTER_US_PER_MIB", DEFAULT_REGISTER_US_PER_MIB, offsetof(struct costs, register_pages)},
        {"SIMCUDA_REGISTER_HUGE_US_PER_MIB", DEFAULT_REGISTER_HUGE_US_PER_MIB, offsetof(struct costs, register_huge)},
        {"SIMCUDA_REGISTER_PRESENT_US_PER_MIB", DEFAULT_REGISTER_PRESENT_US_PER_MIB,
         offsetof(struct costs, register_present)},
    };
    /* Every rate at once: a slower machine in the same proportions, so that what is modelled
     * outweighs the real copying of the bytes on the host that runs the simulation. */
    double scale;
    if (read_double("SIMCUDA_COST_SCALE", 1, 0, 1, &scale) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof rates / sizeof rates[0]; i++) {
        double us_per_mib;
        if (read_double(rates[i].name, rates[i].fallback, 0, 0, &us_per_mib) != 0)
            return CUDA_ERROR_INVALID_VALUE;
        *(double *)((char *)&costs + rates[i].offset) = us_per_mib * scale * 1e-6 / MIB;
    }
    double slice_us;
    if (read_double("SIMCUDA_TIMESLICE_US", DEFAULT_TIMESLICE_US, 0, 1, &slice_us) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    costs.timeslice_s = slice_us * 1e-6;
    double in_call;
    if (read_double("SIMCUDA_PREFETCH_IN_CALL", 0, 0, 0, &in_call) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    prefetch_in_call = in_call != 0;
    for (int i = 0; i < sim_device_count; i++) {
        CUresult result = open_shared(dir, &sim_devices[i], &shared[sim_devices[i].index]);
        if (result != CUDA_SUCCESS)
            return result;
    }
    modelled = 1;
    return CUDA_SUCCESS;
}

/* ---- The lock and the engines ---- */

static void lock_shared(struct shared_device *state)
{
    if (pthread_mutex_lock(&state->lock) == EOWNERDEAD)
        pthread_mutex_consistent(&state->lock); /* every slot is valid on its own */
}

static int process_alive(pid_t pid)
{
    return kill(pid, 0) == 0 || errno != ESRCH;
}

/* Waits for a turn on the engine; returns the seconds spent waiting. */
static double engine_enter(struct shared_device *state, enum sim_engine which)
{
    double asked = sim_now();
    struct engine *engine = &state->engines[which];
    lock_shared(state);
    uint64_t ticket = engine->next_ticket++;
    engine->ticket_pid[ticket % ENGINE_RING] = (int32_t)getpid();
    while (engine->serving != ticket) {
        /* The process whose turn it is may have died, holding or waiting: skip its ticket. */
        if (!process_alive(engine->ticket_pid[engine->serving % ENGINE_RING])) {
            engine->serving++;
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
    return sim_now() - asked;
}

static void engine_leave(struct shared_device *state, enum sim_engine which)
{
    lock_shared(state);
    state->engines[which].serving++;
    pthread_cond_broadcast(&state->engine_turn);
    pthread_mutex_unlock(&state->lock);
}

void sim_engine_enter(const struct sim_device *device)
{
    if (shared[device->index])
        engine_enter(shared[device->index], SIM_ENGINE_COMPUTE);
}

void sim_engine_leave(const struct sim_device *device)
{
    if (shared[device->index])
        engine_leave(shared[device->index], SIM_ENGINE_COMPUTE);
}

double sim_link_transfer(const struct sim_device *device, enum sim_engine direction, size_t bytes, int pageable,
                         int managed)
{
    struct shared_device *state = shared[device->index];
    if (!state || bytes == 0)
        return 0;
    double per_byte = pageable ? costs.pageable : costs.pinned, waited = 0;
    size_t slice = per_byte > 0 ? (size_t)(LINK_SLICE_S / per_byte) : bytes;
    if (slice == 0)
        slice = 1;
    for (size_t done = 0; done < bytes;) {
        size_t part = bytes - done < slice ? bytes - done : slice;
        /* Always the direction's engine first: two copies never wait for each other's second. */
        waited += engine_enter(state, direction);
        if (managed)
            waited += engine_enter(state, SIM_ENGINE_MANAGED_LINK);
        sim_sleep_until(sim_now() + (double)part * per_byte);
        if (managed)
            engine_leave(state, SIM_ENGINE_MANAGED_LINK);
        engine_leave(state, direction);
        done += part;
    }
    return waited;
}

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif

/* Gives [ptr, ptr + bytes) its host pages now, contents unchanged (where the kernel can: else
 * they come at first touch, as before), so that what a later copy pays is what is modelled, not
 * the simulating host's page faults. */
static void host_populate(uintptr_t ptr, size_t bytes)
{
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t first = ptr / page * page, last = (ptr + bytes + page - 1) / page * page;
    if (last > first)
        madvise((void *)first, last - first, MADV_POPULATE_WRITE);
}

/* Whether the VmFlags line of /proc/self/smaps has flag `flag` (two letters). */
static int has_vm_flag(const char *line, const char *flag)
{
    for (const char *at = strstr(line, flag); at; at = strstr(at + 1, flag))
        if (at[-1] == ' ' && (at[2] == ' ' || at[2] == '\n' || at[2] == '\0'))
            return 1;
    return 0;
}

/* Whether every page of [start, start + bytes) is mapped and advised MADV_HUGEPAGE ("hg" among
 * the mapping's VmFlags in /proc/self/smaps). The file is read up to the range's last mapping
 * only: the kernel computes each mapping's figures as it is read. */
static int advised_huge(uintptr_t start, size_t bytes)
{
    FILE *smaps = fopen("/proc/self/smaps", "re");
    if (!smaps)
        return 0;
    char line[1024];
    uintptr_t covered = start, end = start + bytes, low = 0, high = 0;
    int huge = 1;
    while (huge && covered < end && fgets(line, sizeof line, smaps)) {
        unsigned long first, last;
        if (sscanf(line, "%lx-%lx ", &first, &last) == 2) {
            low = first, high = last;
        } else if (strncmp(line, "VmFlags:", 8) == 0 && high > covered) {
            huge = low <= covered && has_vm_flag(line + 8, "hg"); /* no gap, advised */
            covered = high;
        }
    }
    fclose(smaps);
    return huge && covered >= end;
}

/* The bytes of [start, start + bytes) whose pages are present in this process's page tables
 * (/proc/self/pagemap, bit 63): what registering finds mapped, and so need not make or map
 * itself. Pages of a shared file that another process made are not mapped here until this one
 * touches them, as on a real host. Where pagemap cannot be read, the pages in memory (mincore);
 * 0 where neither can tell. */
static size_t present_bytes(uintptr_t start, size_t bytes)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    uintptr_t first = start & ~(uintptr_t)(page - 1);
    size_t pages = (start + bytes - first + page - 1) / page, present = 0;
    uint64_t *entries = malloc(pages * sizeof *entries);
    int fd = entries ? open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC) : -1;
    ssize_t wanted = (ssize_t)(pages * sizeof *entries);
    if (fd >= 0 && pread(fd, entries, (size_t)wanted, (off_t)(first / page * sizeof *entries)) == wanted) {
        for (size_t i = 0; i < pages; i++)
            present += entries[i] >> 63;
    } else {
        unsigned char *map = malloc(pages);
        if (map && mincore((void *)first, start + bytes - first, map) == 0)
            for (size_t i = 0; i < pages; i++)
                present += map[i] & 1;
        free(map);
    }
    if (fd >= 0)
        close(fd);
    free(entries);
    present *= page;
    return present < bytes ? present : bytes;
}

/* Held for writing while a registration runs (sim_pin_cost), for a moment for reading by every
 * entry point (sim_driver_wait). The real driver's registration holds up the process's other
 * calls for its whole length: on an H200 the swap engine's copies and discards in another thread
 * ran at 7 GB/s beside a thread registering 512 MiB segments, 46 GB/s alone, while registrations
 * in five other processes cost them nothing
 * (benchmarks/results/swap-beside-pinners-h200-2026-11-29.json). A forked child never takes it
 * (its calls fail before: sim_check_init). */
static pthread_rwlock_t registering = PTHREAD_RWLOCK_INITIALIZER;

void sim_driver_wait(void)
{
    pthread_rwlock_rdlock(&registering);
    pthread_rwlock_unlock(&registering);
}

/* Pinning: the real driver locks the pages in (populating them), which costs per byte: what it
 * allocates itself at one rate, what it registers at another, faster when transparent huge pages
 * back it (fewer, larger pages to lock), and fastest for pages already present (populating them
 * is most of the price). A registration holds the process's other calls meanwhile. */
void sim_pin_cost(const struct sim_ctx *ctx, void *ptr, size_t bytes, enum sim_pinning how)
{
    if (!modelled)
        return;
    int held = how == SIM_PIN_REGISTERED && pthread_rwlock_wrlock(&registering) == 0;
    double start = sim_now();
    int huge = how == SIM_PIN_REGISTERED && advised_huge((uintptr_t)ptr, bytes);
    size_t present = how == SIM_PIN_REGISTERED ? present_bytes((uintptr_t)ptr, bytes) : 0;
    double per_byte = how == SIM_PIN_ALLOCATED ? costs.pin : huge ? costs.register_huge : costs.register_pages;
    host_populate((uintptr_t)ptr, bytes);
    sim_sleep_until(start + (double)(bytes - present) * per_byte + (double)present * costs.register_present);
    if (held)
        pthread_rwlock_unlock(&registering);
    char fields[200];
    snprintf(fields, sizeof fields,
             "\"op\": \"pin\", \"how\": \"%s\", \"huge\": %s, \"ptr\": %llu, \"bytes\": %zu, \"present\": %zu",
             how == SIM_PIN_ALLOCATED ? "allocated" : "registered", huge ? "true" : "false",
             (unsigned long long)(uintptr_t)ptr, bytes, present);
    sim_trace_write(ctx, fields, start, sim_now());
}

void sim_unpin_trace(const struct sim_ctx *ctx, uintptr_t ptr, size_t bytes, enum sim_pinning how)
{
    if (!modelled)
        return;
    char fields[160];
    snprintf(fields, sizeof fields, "\"op\": \"unpin\", \"how\": \"%s\", \"ptr\": %llu, \"bytes\": %zu",
             how == SIM_PIN_ALLOCATED ? "allocated" : "registered", (unsigned long long)ptr, bytes);
    double at = sim_now();
    sim_trace_write(ctx, fields, at, at);
}

/* ---- Per-allocation hints ---- */

static size_t chunk_count_of(size_t size)
{
    return (size + SIM_CHUNK_BYTES - 1) / SIM_CHUNK_BYTES;
}

static int new_hints(size_t size, struct sim_chunks *chunks)
{
    size_t count = chunk_count_of(size);
    chunks->slots = malloc(count * sizeof *chunks->slots);
    chunks->state = calloc(count, 1);
    if (!chunks->slots || !chunks->state) {
        free(chunks->slots);
        free(chunks->state);
        chunks->slots = NULL;
        chunks->state = NULL;
        return -1;
    }
    for (size_t i = 0; i < count; i++)
        chunks->slots[i] = -1;
    return 0;
}

int sim_residency_adopt(struct sim_alloc *alloc)
{
    if (alloc->family != SIM_MEM_MANAGED || !sim_residency_models(alloc->device))
        return 0;
    return new_hints(alloc->size, &alloc->chunks);
}

static uint32_t chunk_bytes_of(size_t size, size_t chunk)
{
    size_t offset = chunk * SIM_CHUNK_BYTES;
    return (uint32_t)(size - offset < SIM_CHUNK_BYTES ? size - offset : SIM_CHUNK_BYTES);
}

/* With the shared lock held: the slot holding chunk `chunk` of the range keyed `key`, or NULL
 * when it is not on the device. */
static struct slot *held_slot(struct shared_device *state, const struct sim_chunks *chunks, uint64_t key, size_t chunk)
{
    int32_t index = chunks->slots[chunk];
    if (index < 0 || (uint64_t)index >= state->slot_count)
        return NULL;
    struct slot *slot = &state->slots[index];
    return slot->pid == (int32_t)getpid() && slot->address == key + (uint64_t)chunk * SIM_CHUNK_BYTES ? slot : NULL;
}

static void release_chunks(struct shared_device *state, struct sim_chunks *chunks, uint64_t key, size_t size)
{
    lock_shared(state);
    for (size_t chunk = 0; chunk < chunk_count_of(size); chunk++) {
        struct slot *slot = held_slot(state, chunks, key, chunk);
        if (slot)
            memset(slot, 0, sizeof *slot);
    }
    pthread_mutex_unlock(&state->lock);
    free(chunks->slots);
    free(chunks->state);
    chunks->slots = NULL;
    chunks->state = NULL;
}

void sim_residency_forget(struct sim_alloc *alloc)
{
    if (alloc->chunks.slots)
        release_chunks(shared[alloc->device->index], &alloc->chunks, (uint64_t)alloc->start, alloc->size);
}

/* ---- Migrations ---- */

/* Bytes moved by one operation, for its cost and its trace lines. */
struct moves {
    size_t to_device;             /* this process's chunks made resident */
    size_t to_host_backed;        /* this process's chunks sent to the host (prefetch to the CPU) */
    size_t to_host_fresh;         /* of which none had host pages yet: the first-eviction rate */
    size_t evicted_backed, evicted_fresh; /* chunks of others (or its own) evicted for room */
    struct {
        int32_t pid;
        size_t bytes;
    } evicted[16];                /* the evicted bytes by owner */
    size_t evicted_owners;
    size_t evicted_other;         /* owners beyond the table above */
};

static void count_eviction(struct moves *moves, const struct slot *slot)
{
    if (slot->host_backed)
        moves->evicted_backed += slot->bytes;
    else
        moves->evicted_fresh += slot->bytes;
    for (size_t i = 0; i < moves->evicted_owners; i++)
        if (moves->evicted[i].pid == slot->pid) {
            moves->evicted[i].bytes += slot->bytes;
            return;
        }
    if (moves->evicted_owners == sizeof moves->evicted / sizeof moves->evicted[0]) {
        moves->evicted_other += slot->bytes;
        return;
    }
    moves->evicted[moves->evicted_owners].pid = slot->pid;
    moves->evicted[moves->evicted_owners++].bytes = slot->bytes;
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

/* Eviction order: free slots, then those of dead processes, then least recently used; fixed
 * slots (physical memory of live processes) never. */
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

/* The chunks one operation touches: chunks [first, last] of one range. */
struct touched {
    struct sim_chunks *chunks;
    uint64_t key;                 /* the range's start (its first chunk's address or key) */
    size_t size;
    size_t first, last;
};

/* With the shared lock held: the slots that may be taken for room, best first; returns how many. */
static size_t eviction_order(struct shared_device *state, struct candidate *order)
{
    struct liveness seen = {0};
    size_t count = 0;
    for (uint64_t i = 0; i < state->slot_count; i++) {
        const struct slot *slot = &state->slots[i];
        int rank = slot->pid == 0 ? 0 : owner_alive(&seen, slot->pid) ? 2 : 1;
        if (slot->fixed && rank == 2)
            continue;
        order[count++] = (struct candidate){rank, slot->last_use, (uint32_t)i};
    }
    qsort(order, count, sizeof *order, candidate_order);
    return count;
}

/* With the shared lock held: brings the chunks of `ranges` onto the device (`fixed`: as physical
 * memory). Returns -1 when some did not fit because everything else is fixed. */
static int bring_in(struct shared_device *state, struct touched *ranges, size_t range_count, int fixed,
                    struct moves *moves)
{
    uint64_t stamp = ++state->clock;
    size_t missing = 0;
    for (size_t r = 0; r < range_count; r++)
        for (size_t chunk = ranges[r].first; chunk <= ranges[r].last; chunk++) {
            struct slot *slot = held_slot(state, ranges[r].chunks, ranges[r].key, chunk);
            if (slot)
                slot->last_use = stamp;
            else
                missing++;
        }
    if (missing == 0)
        return 0;
    struct candidate *order = sim_calloc(state->slot_count, sizeof *order);
    size_t candidates = eviction_order(state, order);
    struct liveness seen = {0};
    int complete = 0;
    /* Chunks touched by this operation carry `stamp` and sort last; an operation that needs more
     * than the device holds goes round again and evicts its own first chunks. */
    size_t next = 0;
    for (size_t r = 0; r < range_count; r++)
        for (size_t chunk = ranges[r].first; chunk <= ranges[r].last; chunk++) {
            struct sim_chunks *chunks = ranges[r].chunks;
            if (held_slot(state, chunks, ranges[r].key, chunk))
                continue;
            if (candidates == 0) {
                complete = -1; /* the rest stays on the host */
                continue;
            }
            struct slot *slot = &state->slots[order[next++ % candidates].index];
            if (slot->pid != 0 && owner_alive(&seen, slot->pid))
                count_eviction(moves, slot);
            /* A chunk the device has held before and that is not resident now was moved out
             * since: its host pages exist. */
            if (chunks->state[chunk] == CHUNK_DEVICE_BORN)
                chunks->state[chunk] = CHUNK_HOST_BACKED;
            else if (chunks->state[chunk] == CHUNK_FRESH)
                chunks->state[chunk] = CHUNK_DEVICE_BORN;
            slot->pid = (int32_t)getpid();
            slot->bytes = chunk_bytes_of(ranges[r].size, chunk);
            slot->address = ranges[r].key + (uint64_t)chunk * SIM_CHUNK_BYTES;
            slot->last_use = stamp;
            slot->fixed = (uint8_t)fixed;
            slot->host_backed = chunks->state[chunk] == CHUNK_HOST_BACKED;
            chunks->slots[chunk] = (int32_t)(slot - state->slots);
            moves->to_device += slot->bytes;
        }
    free(order);
    return complete;
}

/* With the shared lock held: sends the resident chunks of `ranges` to the host (`discard`: gives
 * them up without moving anything). */
static void send_out(struct shared_device *state, struct touched *ranges, size_t range_count, int discard,
                     struct moves *moves)
{
    for (size_t r = 0; r < range_count; r++)
        for (size_t chunk = ranges[r].first; chunk <= ranges[r].last; chunk++) {
            struct slot *slot = held_slot(state, ranges[r].chunks, ranges[r].key, chunk);
            if (!slot)
                continue;
            if (slot->host_backed)
                moves->to_host_backed += slot->bytes;
            else
                moves->to_host_fresh += slot->bytes;
            /* A discarded chunk is made anew wherever it goes next, like a fresh one. */
            ranges[r].chunks->state[chunk] = discard ? CHUNK_FRESH : CHUNK_HOST_BACKED;
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

enum move_kind { MOVE_FAULT, MOVE_PREFETCH, MOVE_DISCARD_PREFETCH, MOVE_PHYSICAL };

/* Sleeps for the cost of the moves, then traces them. */
static void pay(const struct sim_ctx *ctx, const struct moves *moves, enum move_kind kind)
{
    size_t evicted = moves->evicted_backed + moves->evicted_fresh;
    size_t to_host = moves->to_host_backed + moves->to_host_fresh;
    double seconds;
    if (kind == MOVE_FAULT) {
        seconds = (double)(moves->to_device + evicted) * costs.fault;
    } else {
        double in_rate = kind == MOVE_PREFETCH ? costs.prefetch_in : kind == MOVE_DISCARD_PREFETCH ? costs.discard_prefetch : 0;
        seconds = (double)moves->to_device * in_rate +
                  (double)(moves->evicted_backed + moves->to_host_backed) * costs.prefetch_out +
                  (double)(moves->evicted_fresh + moves->to_host_fresh) * costs.first_out;
    }
    if (moves->to_device + evicted + to_host == 0)
        return;
    double start = sim_now();
    sim_sleep_until(start + seconds);
    double end = sim_now();
    const char *cause = kind == MOVE_FAULT ? "fault" : kind == MOVE_PREFETCH ? "prefetch" : "populate";
    int32_t self = (int32_t)getpid();
    for (size_t i = 0; i < moves->evicted_owners; i++)
        trace_move(ctx, "evict", "to_host", moves->evicted[i].pid, moves->evicted[i].bytes, start, end);
    trace_move(ctx, "evict", "to_host", 0, moves->evicted_other, start, end);
    trace_move(ctx, cause, "to_host", self, to_host, start, end);
    if (kind != MOVE_PHYSICAL)
        trace_move(ctx, cause, "to_device", self, moves->to_device, start, end);
}

/* With the registry read-locked: the chunk range of [ptr, ptr + bytes) when it is managed memory
 * of `device` with hints. */
static int managed_range(const struct sim_device *device, uintptr_t ptr, size_t bytes, struct touched *out)
{
    struct sim_alloc *alloc = sim_mem_find_range(ptr, bytes ? bytes : 1);
    if (!alloc || !alloc->chunks.slots || alloc->family != SIM_MEM_MANAGED || alloc->device != device || bytes == 0)
        return 0;
    *out = (struct touched){&alloc->chunks, (uint64_t)alloc->start, alloc->size, (ptr - alloc->start) / SIM_CHUNK_BYTES,
                            (ptr - alloc->start + bytes - 1) / SIM_CHUNK_BYTES};
    return 1;
}

struct collect {
    struct touched *ranges;
    size_t count, capacity;
};

static void collect_whole(struct sim_alloc *alloc, void *argument)
{
    struct collect *collect = argument;
    if (!alloc->chunks.slots)
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
    collect->ranges[collect->count++] =
        (struct touched){&alloc->chunks, (uint64_t)alloc->start, alloc->size, 0, chunk_count_of(alloc->size) - 1};
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
                send_out(state, &one, 1, 0, &moves);
            else
                bring_in(state, &one, 1, 0, &moves);
        }
    } else if (op->u.kernel.kind != SIM_KERNEL_SLEEP) { /* a fill, or an all-reduce's write */
        if (managed_range(device, op->u.kernel.dst, (size_t)op->u.kernel.count * 4, &one))
            bring_in(state, &one, 1, 0, &moves);
    } else {
        /* nvshare_sleep stands for a kernel over the process's whole working set on the device. */
        sim_mem_for_each_managed(device, collect_whole, &all);
        bring_in(state, all.ranges, all.count, 0, &moves);
    }
    pthread_mutex_unlock(&state->lock);
    sim_mem_unlock();
    free(all.ranges);
    pay(ctx, &moves, !prefetch ? MOVE_FAULT : op->u.prefetch.discard ? MOVE_DISCARD_PREFETCH : MOVE_PREFETCH);
}

/* Zeroes the whole pages of [ptr, ptr + bytes): a discarded range's contents are indeterminate.
 * Written over rather than given back to the kernel: the simulating host then pays a write of the
 * range here, not page faults at whatever touches it next (a copy back that the model prices). */
static void forget_contents(uintptr_t ptr, size_t bytes)
{
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t first = (ptr + page - 1) / page * page, last = (ptr + bytes) / page * page;
    if (last > first)
        memset((void *)first, 0, last - first);
}

size_t sim_residency_discard(struct sim_ctx *ctx, uintptr_t ptr, size_t bytes)
{
    struct shared_device *state = shared[ctx->device->index];
    struct moves moves = {0};
    struct touched one;
    sim_mem_read_lock();
    if (state && managed_range(ctx->device, ptr, bytes, &one)) {
        lock_shared(state);
        send_out(state, &one, 1, 1, &moves);
        pthread_mutex_unlock(&state->lock);
    }
    forget_contents(ptr, bytes);
    sim_mem_unlock();
    return moves.to_host_backed + moves.to_host_fresh;
}

/* ---- Physical device memory ---- */

CUresult sim_residency_fix(struct sim_device *device, uint64_t key, size_t size, struct sim_chunks *chunks)
{
    struct shared_device *state = shared[device->index];
    if (!state || size == 0)
        return CUDA_SUCCESS;
    if (new_hints(size, chunks) != 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    struct touched range = {chunks, key, size, 0, chunk_count_of(size) - 1};
    struct moves moves = {0};
    lock_shared(state);
    /* Room is what is not physical memory already: refused before anything moves. */
    struct candidate *order = sim_calloc(state->slot_count, sizeof *order);
    int fits = eviction_order(state, order) >= chunk_count_of(size);
    free(order);
    if (fits)
        bring_in(state, &range, 1, 1, &moves);
    pthread_mutex_unlock(&state->lock);
    if (!fits) {
        free(chunks->slots);
        free(chunks->state);
        chunks->slots = NULL;
        chunks->state = NULL;
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    struct sim_ctx *ctx = NULL;
    if (sim_ctx_require(&ctx) != CUDA_SUCCESS || ctx->device != device)
        ctx = device->primary;
    pay(ctx, &moves, MOVE_PHYSICAL);
    char fields[128];
    snprintf(fields, sizeof fields, "\"op\": \"physical\", \"event\": \"reserve\", \"bytes\": %zu", size);
    double at = sim_now();
    sim_trace_write(ctx, fields, at, at);
    return CUDA_SUCCESS;
}

void sim_residency_unfix(struct sim_device *device, uint64_t key, size_t size, struct sim_chunks *chunks)
{
    if (!chunks->slots)
        return;
    release_chunks(shared[device->index], chunks, key, size);
    char fields[128];
    snprintf(fields, sizeof fields, "\"op\": \"physical\", \"event\": \"release\", \"bytes\": %zu", size);
    double at = sim_now();
    sim_trace_write(device->primary, fields, at, at);
}
