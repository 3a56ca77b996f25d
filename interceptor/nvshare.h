/*
 * Internal interfaces of libnvshare.so shared by its source files. Nothing here is exported:
 * the library is built with -fvisibility=hidden and only the hooks (NVS_EXPORT) and dlsym
 * leave it.
 */
#ifndef NVSHARE_INTERNAL_H
#define NVSHARE_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "cuda_types.h"
#include "client_core.h"
#include "hooks.h"
#include "message.h"

#define NVS_EXPORT __attribute__((visibility("default")))
#define NVS_LIKELY(x) __builtin_expect(!!(x), 1)
#define NVS_UNLIKELY(x) __builtin_expect(!!(x), 0)

/* ---------------------------------------------------------------- config.c */

enum nvs_log_level { NVS_LOG_ERROR = 0, NVS_LOG_WARN = 1, NVS_LOG_INFO = 2, NVS_LOG_DEBUG = 3 };

/* One entry of NVSHARE_MEMORY_LIMIT (limits.c applies them). */
#define NVS_MAX_LIMIT_RULES 64
struct nvs_memory_limit_rule {
    int ordinal;                         /* CUDA device ordinal, -1: by uuid or every device */
    char uuid[NVS_DEVICE_ID_MAX + 1];    /* "GPU-…"/"MIG-…", "": by ordinal or every device */
    uint64_t bytes;
};

/* Read once from the environment by nvs_config_load() (first use, in an application thread,
 * before any nvshare thread exists) and never written afterwards. */
struct nvs_config {
    char socket_path[256];     /* <socket-dir>/client/scheduler.sock */
    int fail_open;             /* NVSHARE_FAIL_MODE=open */
    long idle_release_ms;      /* NVSHARE_IDLE_RELEASE_MS, -1: take the scheduler's */
    int managed;               /* NVSHARE_MANAGED (default 1): convert allocations */
    int vmm_hide;              /* NVSHARE_VMM=hide */
    int vmm_swap;              /* NVSHARE_VMM=swap: VMM memory is swapped too (vmm.c) */
    int predrain;              /* NVSHARE_PREDRAIN (default 1): drain ahead of a contended quantum's end */
    int advise;                /* NVSHARE_ADVISE (default 0): advise converted memory onto its device */
    char pod[256];             /* NVSHARE_POD_NAME */
    char pod_namespace[256];   /* NVSHARE_POD_NAMESPACE */
    char program[128];         /* NVSHARE_PROGRAM, "" = /proc/self/comm */
    /* NVSHARE_MEMORY_LIMIT: the limits the process starts with; memory_limit_invalid: the
     * setting did not parse (every device is limited to 0 bytes, limits.c says why). */
    struct nvs_memory_limit_rule memory_limits[NVS_MAX_LIMIT_RULES];
    int n_memory_limits;
    int memory_limit_invalid;
};

extern struct nvs_config nvs_config;
/* Load the configuration once (pthread_once; any thread, cheap afterwards). The driver loader
 * calls it first; NVML lookups (nvml.c) call it in processes that never load the CUDA driver. */
void nvs_config_load(void);

/* ---------------------------------------------------------------- log.c */

/* Written by nvs_config_load only; read everywhere. */
extern int nvs_log_level;
void nvs_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
#define nvs_error(...) nvs_log(NVS_LOG_ERROR, __VA_ARGS__)
#define nvs_warn(...) nvs_log(NVS_LOG_WARN, __VA_ARGS__)
#define nvs_info(...) nvs_log(NVS_LOG_INFO, __VA_ARGS__)
#define nvs_debug(...)                                                                          \
    do {                                                                                        \
        if (NVS_UNLIKELY(nvs_log_level >= NVS_LOG_DEBUG)) nvs_log(NVS_LOG_DEBUG, __VA_ARGS__);  \
    } while (0)

/* Monotonic seconds. */
double nvs_now(void);

/* ---------------------------------------------------------------- gate.c */

#define NVS_MAX_DEVICES NVS_CORE_MAX_DEVICES

struct nvs_device {
    /* The gate (fast path). Every application thread that submits work on this device
     * touches this cache line: entered/exited with seq_cst read-modify-writes, gate_open with
     * a seq_cst load. gate_open is written only under nvs_mu. */
    _Atomic uint64_t entered __attribute__((aligned(64)));
    _Atomic uint64_t exited;
    _Atomic int gate_open;

    /* Bytes this process has allocated on the device (memory.c), any thread. */
    _Atomic uint64_t bytes __attribute__((aligned(64)));
    /* The admitted total + 1 (admission.c; 0: no admission in force, nothing waits). Written by
     * the client thread under nvs_mu, read by allocating threads without a lock. */
    _Atomic uint64_t admission;
    /* 1 once memory calls on the device may go on: the scheduler's limits for it are applied,
     * or no scheduler answers for now (admission.c). Written like `admission`. */
    _Atomic int memory_ready;
    /* Of them, what nvshare can move (memory.c: converted allocations, made managed by nvshare;
     * vmm.c: VMM memory not exported), and of that, what the worker's swap jobs moved to the host
     * and did not bring back (swap.c, as each piece moves; memory.c and vmm.c when such memory is
     * freed). Any thread; the client thread reads them for the core: resident = converted -
     * swapped. */
    _Atomic uint64_t converted;
    _Atomic uint64_t swapped;
    /* The device's swap epoch (swap.c): advances at each grant that brings memory back; an
     * allocation remembers the one it was made or last brought back in. Any thread. */
    _Atomic uint64_t swap_epoch;

    /* Identity: written once under nvs_mu before `known` is set, constant afterwards. */
    int ordinal;
    int known;
    char uuid[NVS_DEVICE_ID_MAX + 1];
    char name[128];
    uint64_t total;

    /* Mailboxes between the threads, all under nvs_mu. The lock state itself lives in the
     * client core (client_core.h), which only the client thread feeds.
     *   waiters:   application threads blocked at the closed gate (they write it);
     *   captures:  stream captures in progress on the device (gate.c capture hooks);
     *   job:       work the client thread handed to the worker; job_running while it runs;
     *   job_result: what the worker found, for the client thread to feed to the core. */
    int waiters;
    int captures;
    /* Admission (admission.c): the largest total an allocating thread waits for (0: none; the
     * client thread passes it to the core) and the number of refusals so far. */
    uint64_t admit_wanted;
    unsigned admit_refusals;
    enum nvs_job job;
    uint64_t job_bytes; /* of a swap job (client_core.h, struct nvs_action) */
    int job_running;
    enum nvs_job_result job_result;

    /* Contexts this process used on the device (drains synchronise each), under nvs_mu. */
    CUcontext *contexts;
    int n_contexts, cap_contexts;
};

/* The registration lease (client_core.h, nvs_core_lease_until) in CLOCK_MONOTONIC_COARSE
 * milliseconds: an open gate may be passed only before it; INT64_MAX: no limit. Written by the
 * client thread under nvs_mu (which broadcasts nvs_gate_cv when it grows), read by the gate's
 * fast path without a lock (a stale value only sends a thread to the slow path, or lets it
 * pass a lease the client thread has just renewed). */
extern _Atomic int64_t nvs_lease_ms;

static inline int64_t nvs_coarse_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts); /* vDSO: no system call */
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* An open gate whose lease holds. */
static inline int nvs_gate_passable(struct nvs_device *d) {
    return atomic_load(&d->gate_open) &&
           nvs_coarse_ms() < atomic_load_explicit(&nvs_lease_ms, memory_order_relaxed);
}

/* Guards all lock state above and the device table; never held across a CUDA call or I/O
 * (tests/test_library_hygiene.py checks the code for it). */
extern pthread_mutex_t nvs_mu;
/* Signalled (broadcast) whenever a gate opens. */
extern pthread_cond_t nvs_gate_cv;
/* Held by whoever pushes, synchronises or destroys a recorded context or queries an event in
 * one: drains (gate.c), deferred frees (memory.c: polled with a trylock, settled before their
 * context is destroyed) and the context-destroying hooks (context.c). So nothing touches a context
 * while the application destroys it. Taken before nvs_mu and mem_mu, never the other way. */
extern pthread_mutex_t nvs_ctx_mu;

extern struct nvs_device nvs_devices[NVS_MAX_DEVICES];
extern int nvs_n_devices; /* highest ordinal seen + 1, under nvs_mu */

struct nvs_thread_state {
    struct nvs_device *device; /* device of the current context, NULL: look it up */
    unsigned int depth;        /* > 0 while inside a gated call (nested calls pass through) */
    unsigned int capturing;    /* stream captures this thread began and has not ended */
};
extern __thread struct nvs_thread_state nvs_tls __attribute__((tls_model("initial-exec")));

struct nvs_device *nvs_gate_resolve(void);
void nvs_gate_wait(struct nvs_device *dev);
/* The device of the calling thread's current context (NULL when there is none). */
struct nvs_device *nvs_current_device(void);
/* The device with this ordinal, its identity filled in (NULL if out of range). */
struct nvs_device *nvs_device_get(CUdevice ordinal);
struct nvs_device *nvs_device_by_uuid(const char *uuid); /* under nvs_mu */

/* Enter the gate of the calling thread's device; returns the device to pass to
 * nvs_gate_exit (NULL: nested call or no current context, nothing counted). */
static inline struct nvs_device *nvs_gate_enter(void) {
    struct nvs_thread_state *t = &nvs_tls;
    if (t->depth++ != 0) return NULL;
    struct nvs_device *d = t->device;
    if (NVS_UNLIKELY(d == NULL)) {
        d = nvs_gate_resolve();
        if (d == NULL) return NULL;
    }
    for (;;) {
        atomic_fetch_add(&d->entered, 1);
        if (NVS_LIKELY(nvs_gate_passable(d))) return d;
        /* A thread capturing a CUDA graph passes: its launches go into the graph and submit
         * nothing, and its capture must end before the drain may synchronise (gate.c). */
        if (t->capturing > 0) return d;
        atomic_fetch_add(&d->exited, 1);
        nvs_gate_wait(d);
    }
}

static inline void nvs_gate_exit(struct nvs_device *d) {
    if (d != NULL) atomic_fetch_add(&d->exited, 1);
    nvs_tls.depth--;
}

/* Under nvs_mu: forget a context in every device's list (drains no longer synchronise it). */
void nvs_gate_forget_context_locked(CUcontext ctx);
/* Under nvs_mu: open or close a device's gate. */
void nvs_gate_set_locked(struct nvs_device *d, int open);
/* Worker side: wait until no submission is in flight on the (closed) gate. */
void nvs_gate_wait_quiet(struct nvs_device *d);
/* Synchronise every recorded context of the device (gate left as it is). -1, synchronising
 * nothing, while a stream capture is in progress on the device: a synchronise from another
 * thread would invalidate it. Capture begin waits while this runs (nvs_ctx_mu). */
int nvs_gate_sync_contexts(struct nvs_device *d);
/* Fork child: no capture is in progress. */
void nvs_gate_reset_after_fork(void);

/* ---------------------------------------------------------------- memory.c */

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

/* ---------------------------------------------------------------- swapping: area.c, vmm.c, swap.c */

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
size_t nvs_vmm_swappable(struct nvs_device *d, int swapped, struct nvs_swappable **out);
/* A converted allocation is now swapped out (1) or resident (0), its bytes in item->area: 0, or
 * -1 when it is gone (freed meanwhile). The swapped count is the caller's (swap.c). */
int nvs_memory_mark(struct nvs_device *d, const struct nvs_swappable *item, int swapped, uint64_t last_used);
/* VMM memory whose bytes were copied to item->area: unmapped and its physical handle released,
 * marked swapped (0), or -1 when it can no longer move (unmapped, exported meanwhile). */
int nvs_vmm_release_physical(const struct nvs_swappable *item);
/* Swapped-out VMM memory: a new physical handle mapped at the same address with the same access
 * (0, its bytes' place handed over in *area; the bytes are copied back next, and
 * nvs_vmm_restored ends the move), or -1. */
int nvs_vmm_restore_physical(const struct nvs_swappable *item, struct nvs_extent **area);
void nvs_vmm_restored(const struct nvs_swappable *item, uint64_t last_used);
void nvs_vmm_reset_after_fork(void);

/* The pinned swap area (area.c), any thread. A run of it: `bytes` at `host`. */
struct nvs_area_run {
    char *host;
    size_t bytes;
    uint32_t chunk, page;
};
struct nvs_extent;
/* Room for `bytes` (0, in *out), or -1 when the area has less free. */
int nvs_area_take(size_t bytes, struct nvs_extent **out);
void nvs_area_give(struct nvs_extent *e); /* NULL: nothing */
size_t nvs_area_runs(const struct nvs_extent *e, const struct nvs_area_run **runs);
/* What device `index` may want out at once (the scheduler's PREPARE); the area follows the sum. */
void nvs_area_want(int index, uint64_t bytes);
uint64_t nvs_area_pinned(void);
/* 1: the area should grow, -1: shrink (a whole chunk is free above the target), 0: neither. */
int nvs_area_change_due(void);
/* Pin or give back one chunk (a context current); 1 when it changed, -1 on failure. */
int nvs_area_change_step(void);
void nvs_area_reset_after_fork(void);

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
/* Between jobs: grow or shrink the area by a chunk; 1 when it did. */
int nvs_swap_prepare_step(void);
struct nvs_swap_figures {
    int engine;       /* enum nvs_swap_engine */
    uint64_t area;    /* bytes pinned */
    uint64_t out_bps, in_bps; /* the last moves through the area, bytes per second (0: none yet) */
};
void nvs_swap_figures(struct nvs_swap_figures *out);

/* ---------------------------------------------------------------- admission.c */

/* What the scheduler admitted for d (NVS_NO_LIMIT: no admission in force). Any thread, no lock. */
uint64_t nvs_admitted(const struct nvs_device *d);
/* Block until d's admitted total reaches `total` (0), or the scheduler refuses (-1, logged
 * naming `call` and `size`). Takes nvs_mu; call it holding no lock. */
int nvs_admission_wait(struct nvs_device *d, uint64_t total, const char *call, size_t size);
/* Under nvs_mu (client thread): the core's admitted total for d, and whether the last answer
 * granted (1) or refused (0) what the waiters asked. Wakes the waiters. */
void nvs_admission_answer_locked(struct nvs_device *d, uint64_t admitted, int granted);
/* A process's first memory call on a device (an allocation, cuMemGetInfo, cuDeviceTotalMem, an
 * NVML memory query) waits here until the scheduler's memory limits for it are known: those it
 * sends with the registration, or none when no scheduler answers (bounded by the client's
 * connection and WELCOME timeouts). Starts the client thread. Call it holding no lock; d may be
 * NULL (nothing to wait for). Afterwards one atomic load. */
void nvs_admission_await_registration(struct nvs_device *d);
/* Under nvs_mu (client thread): memory calls on d may go on (d NULL: on every device, now and
 * later, when nvshare cannot or no longer asks a scheduler). Wakes the waiters. */
void nvs_admission_settled_locked(struct nvs_device *d);
/* Fork child: no admission until the child registers. */
void nvs_admission_reset_after_fork(void);

/* ---------------------------------------------------------------- limits.c */

#define NVS_NO_LIMIT UINT64_MAX

/* The memory limit of device `d` in bytes (NVS_NO_LIMIT: none). Any thread, no lock: one atomic
 * load once decided (from NVSHARE_MEMORY_LIMIT, on first use). */
uint64_t nvs_limit_of(const struct nvs_device *d);
/* Change d's limit at run time (NVS_NO_LIMIT lifts it); any thread, takes no lock, makes no
 * CUDA call. Allocations from then on are charged against the new limit; memory already
 * allocated stays (a limit below the current use refuses every allocation until frees bring the
 * use under it). */
void nvs_limit_set(struct nvs_device *d, uint64_t bytes);
/* The scheduler's limit of d changed to `bytes` (0: none; LIMIT in docs/protocol.md): the
 * limit becomes the smaller of it and the configured one (NVSHARE_MEMORY_LIMIT), so the
 * scheduler can lower what the environment allows, never raise it. Any thread, no lock. */
void nvs_limit_from_scheduler(struct nvs_device *d, uint64_t bytes);
/* The configured limit of a device this process has not used through CUDA, by UUID (NVML). */
uint64_t nvs_limit_of_unopened(const char *uuid);
/* What a limited process is told: total = min(limit, real_total); free = total - used, but no
 * more than `available` (what it would be told without a limit). */
void nvs_limit_figures(uint64_t limit, uint64_t real_total, uint64_t used, uint64_t available,
                       uint64_t *total_out, uint64_t *free_out);
/* Log (at most once a second) that `call` of `size` bytes was refused by d's limit. Call it
 * with no lock held (it writes to stderr). */
void nvs_limit_refused(const struct nvs_device *d, const char *call, size_t size, uint64_t used, uint64_t limit);

/* ---------------------------------------------------------------- nvml.c */

/* dlsym's answer for an NVML symbol: the wrapper standing for `address` if it is the address of
 * a hooked NVML function of libnvidia-ml.so.1, else `address`. */
void *nvs_nvml_substitute(void *address);

/* ---------------------------------------------------------------- notify.c */

/* What the lower units may ask of the runtime (client.c and worker.c), through pointers that
 * client.c registers: no link dependency upward. */
struct nvs_runtime_ops {
    void (*start)(void);
    void (*wake_client)(void);
    void (*memory_changed)(void);
    void (*kick_worker)(void);
    void (*fork_prepare)(void);
    void (*fork_parent)(void);
    void (*fork_child)(void);
};
void nvs_notify_register(const struct nvs_runtime_ops *ops);

/* Start the client and worker threads once per process (again in a forked child). */
void nvs_runtime_start(void);
/* Wake the client thread (never from a signal handler). */
void nvs_client_wake(void);
/* A device's allocated bytes changed: the client thread sends a (coalesced) MEMORY report. */
void nvs_client_memory_changed(void);
/* Tell the worker thread that stream-ordered frees are pending. */
void nvs_worker_kick(void);
/* Fork handlers (hooks.c registers them with pthread_atfork). */
void nvs_fork_prepare(void);
void nvs_fork_parent(void);
void nvs_fork_child(void);

/* ---------------------------------------------------------------- worker.c */

/* The worker thread does what needs the GPU for the client core: drains and idle probes
 * (jobs, handed over in struct nvs_device under nvs_mu), and deferred stream-ordered frees. */
int nvs_worker_spawn(void);
/* Under nvs_mu: hand the worker a job for the device. */
void nvs_worker_assign_locked(struct nvs_device *d, enum nvs_job job, uint64_t bytes);
void nvs_worker_signal(void);
/* Under nvs_mu: the worker looks for work again (the swap area's target changed). */
void nvs_worker_wake_locked(void);
/* Set at process exit: the worker stops calling CUDA (the driver may be torn down). */
void nvs_worker_stop_for_exit(void);
/* Fork child: no worker thread, no job. */
void nvs_worker_reset_after_fork(void);

#endif
