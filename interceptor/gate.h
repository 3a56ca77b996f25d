/*
 * The device table and each device's gate (gate.c): the fast path every submission takes
 * (nvs_gate_enter/exit, inline), the locks, and who writes each global under which lock.
 */
#ifndef NVSHARE_GATE_H
#define NVSHARE_GATE_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "client_core.h"
#include "compiler.h"
#include "cuda_types.h"

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
    /* The collectives launched on the device and the limit a gang's fence holds them to, in one
     * word (collective.c says how): counted by the launching threads, limited by the client
     * thread under nvs_mu. */
    _Atomic uint64_t collectives;

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
     *   job_cut:   the running SWAP_OUT is to stop after the pieces in flight (the client thread
     *              sets it, NVS_ACT_SWAP_OUT_CUT; a new job clears it; the worker reads it
     *              without nvs_mu, between the pieces it queues);
     *   job_result: what the worker found, for the client thread to feed to the core;
     *   asked_at, gate_opened_at: when the first of the waiters began to wait, when the gate
     *              last opened (nvs_now(); nvs_gate_add_waiter_locked and nvs_gate_set_locked
     *              write them), for the pinner, which keeps out of the application's way when it
     *              asks for the device and when it gets it (worker.c);
     *   ahead_at:  when the worker last brought memory back ahead of a grant (a PREFETCH_AHEAD
     *              job ended; the worker writes it): the grant follows within milliseconds, and
     *              the pinner keeps out of its way too. */
    int waiters;
    int captures;
    double asked_at, gate_opened_at, ahead_at;
    /* Admission (admission.c): the largest total an allocating thread waits for (0: none; the
     * client thread passes it to the core) and the number of refusals so far. */
    uint64_t admit_wanted;
    unsigned admit_refusals;
    enum nvs_job job;
    uint64_t job_bytes; /* of a swap job (client_core.h, struct nvs_action) */
    int job_running;
    _Atomic int job_cut;
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
/* Read-held by whoever pushes or synchronises a recorded context or queries an event in one:
 * drains and idle probes (gate.c), swap jobs and the pinning of the swap area and the pool's
 * segments (swap.c), deferred frees (memory.c, polled with a try). Write-held by what destroys a
 * context (context.c, which settles its deferred frees first) and by a capture's beginning
 * (gate.c): so nothing touches a context while the application destroys it, and no capture begins
 * while one of those calls runs. Readers run side by side: the swap area is pinned (its own
 * thread) while an idle probe waits for a holder's queued work, which can take seconds. Writers
 * are preferred, so a steady stream of readers cannot hold a capture off. Taken before nvs_mu and
 * mem_mu, never the other way; never recursively. */
extern pthread_rwlock_t nvs_ctx_mu;

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

/* Work the interceptor submits on the holder's behalf in an application thread (the pages of a
 * new allocation): counted in flight like a submission, so that a release waits for it and an
 * idle probe sees it (a prefetch may do its migration inside the call, leaving no GPU work for
 * a synchronise to find), but never waited for: 0, nothing counted, when the gate is closed.
 * 1: passed; end with nvs_gate_leave. */
static inline int nvs_gate_try_pass(struct nvs_device *d) {
    atomic_fetch_add(&d->entered, 1);
    if (nvs_gate_passable(d)) return 1;
    atomic_fetch_add(&d->exited, 1);
    return 0;
}

static inline void nvs_gate_leave(struct nvs_device *d) { atomic_fetch_add(&d->exited, 1); }

/* Under nvs_mu: forget a context in every device's list (drains no longer synchronise it). */
void nvs_gate_forget_context_locked(CUcontext ctx);
/* Under nvs_mu: open or close a device's gate. */
void nvs_gate_set_locked(struct nvs_device *d, int open);
/* Under nvs_mu: one more application thread waits on the device; 1 when it is the first (then
 * the caller wakes the client thread, outside nvs_mu). */
int nvs_gate_add_waiter_locked(struct nvs_device *d);
/* Worker side: wait until no submission is in flight on the (closed) gate. */
void nvs_gate_wait_quiet(struct nvs_device *d);
/* Synchronise every recorded context of the device (gate left as it is). -1, synchronising
 * nothing, while a stream capture is in progress on the device: a synchronise from another
 * thread would invalidate it. Capture begin waits while this runs (nvs_ctx_mu, read-held). */
int nvs_gate_sync_contexts(struct nvs_device *d);
/* Fork child: no capture is in progress. */
void nvs_gate_reset_after_fork(void);

#endif
