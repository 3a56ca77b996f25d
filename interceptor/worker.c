/*
 * The worker thread: what the client core needs done on the GPU, off the client thread (which
 * keeps heart-beating while work drains) and outside nvs_mu (a drain can take seconds).
 *
 * - DRAIN: the gate is closed; wait until no submission is in flight, synchronise every
 *   context the process used on the device. Ends in a RELEASE (the core decides).
 * - PROBE: an idle check of a holder: release early only if nothing was submitted since the
 *   last look, everything submitted before had already finished (the device was idle, not
 *   just quiet on the host side), and nothing entered while the gate was being closed.
 * - SWAP_OUT / PREFETCH / PREFETCH_AHEAD: move swappable memory to the host, back for a grant, or back
 *   ahead of one (swap.c); the gate is closed meanwhile (the core opens it after a PREFETCH).
 * - deferred stream-ordered frees (memory.c), polled while any are pending.
 *
 * Beside it, the pinner thread grows (or shrinks) the swap area a chunk at a time towards what
 * the scheduler said to prepare, or keeps this process's side of its user's swap pool: joins it,
 * registers the segments others made, makes missing ones, lets go of retired ones (swap.c,
 * pool.c). It has a thread of its own because the worker's jobs
 * can block for seconds: an idle probe of a holder whose program waits in a synchronise waits
 * for the queued work too, so a holder's area pinned only between such probes could take the
 * whole first quantum (tests/test_simcuda_swapping.py shows it; on an H200 the first quanta,
 * priced at the slow path's cost while the area was pinned, went from 10-16 s to 3.6 s with this
 * thread and the area's pages made present by several, area.c). Both
 * hold nvs_ctx_mu for reading, so they run side by side, except that the pinner takes no step
 * while the worker moves memory (a swap job): on an H200 a registration in one thread held up
 * the process's other CUDA calls for its whole length, and the swap engine's moves ran at 7 GB/s
 * beside a thread that registered segments, 19 GB/s beside four that mapped their pages, against
 * 46 GB/s alone (registrations and mappings in five other processes cost it nothing;
 * benchmarks/results/swap-beside-pinners-h200-2026-11-29.json). Six tenants' pools growing
 * while they moved memory out made those moves run at 1.8-2.7 GB/s. A step that began before a
 * swap job ends before the job's first call (step_mu); drains and probes do not stop the pinner.
 * Nor does it take a step while the application asks for the GPU or has just been given it
 * (the pinning grace): the application's calls wait for a registration as the worker's do.
 *
 * Jobs come in struct nvs_device (job, under nvs_mu); results go back there (job_result) and
 * the client thread is woken to feed them to the core. Nothing here decides lock state.
 */
#include <sys/prctl.h>
#include <time.h>

#include "config.h"
#include "gate.h"
#include "log.h"
#include "memory.h"
#include "notify.h"
#include "swap.h"
#include "worker.h"

static pthread_cond_t worker_cv = PTHREAD_COND_INITIALIZER; /* with nvs_mu */
static int worker_kicked;                                    /* under nvs_mu */
static pthread_cond_t pinner_cv = PTHREAD_COND_INITIALIZER; /* with nvs_mu */
static int pinner_kicked;                                    /* under nvs_mu */
/* Held by the pinner for each step; the worker takes and drops it once a swap job is marked
 * running, so that the step it may be in the middle of ends before the job's calls begin. Nothing
 * else is taken under it but what a step takes (nvs_ctx_mu, nvs_mu). */
static pthread_mutex_t step_mu = PTHREAD_MUTEX_INITIALIZER;
static _Atomic int exiting;

void nvs_worker_assign_locked(struct nvs_device *d, enum nvs_job job, uint64_t bytes) {
    d->job = job;
    d->job_bytes = bytes;
    d->job_cut = 0;
    d->job_result = NVS_RESULT_NONE;
    worker_kicked = 1;
    pthread_cond_signal(&worker_cv);
}

void nvs_pinner_wake_locked(void) {
    pinner_kicked = 1;
    pthread_cond_signal(&pinner_cv);
}

void nvs_worker_signal(void) {
    pthread_mutex_lock(&nvs_mu);
    worker_kicked = 1;
    pthread_cond_signal(&worker_cv);
    pinner_kicked = 1; /* a capture ended: pinning may go on */
    pthread_cond_signal(&pinner_cv);
    pthread_mutex_unlock(&nvs_mu);
}

void nvs_worker_stop_for_exit(void) { atomic_store(&exiting, 1); }

static enum nvs_job_result run_drain(struct nvs_device *d) {
    nvs_gate_wait_quiet(d);
    return nvs_gate_sync_contexts(d) == 0 ? NVS_RESULT_DRAINED : NVS_RESULT_DEFERRED;
}

/* A synchronise with nothing in flight returns in microseconds; one that takes longer waited
 * for work that was still running (even on a busy machine, where the worker may lose the CPU
 * for a few milliseconds, far less than the queues of a training step). */
#define PROBE_BUSY_SECONDS 0.005

static enum nvs_job_result run_probe(struct nvs_device *d) {
    uint64_t x0 = atomic_load(&d->exited);
    uint64_t e0 = atomic_load(&d->entered);
    if (e0 != x0) return NVS_RESULT_ACTIVE;
    /* gate still open: the application may go on meanwhile; a capture means "not idle" */
    double started = nvs_now();
    if (nvs_gate_sync_contexts(d) != 0) return NVS_RESULT_ACTIVE;
    /* Work was running when the window ended: the application submitted nothing for a window
     * because it was waiting for that work (a synchronise at the end of a step with a deep
     * queue), and it goes on the moment the work ends. That is busy, not idle; the window
     * starts again now that the device is quiet. Releasing here would hand the GPU over at
     * every step, and over a memory budget swap at every step. */
    if (nvs_now() - started > PROBE_BUSY_SECONDS) return NVS_RESULT_ACTIVE;
    pthread_mutex_lock(&nvs_mu);
    nvs_gate_set_locked(d, 0);
    /* Seen with the gate closed: a thread that entered after this load backs out. If one
     * entered in between, the core reopens the gate (or drains, after a DROP). */
    int quiet = atomic_load(&d->entered) == e0;
    pthread_mutex_unlock(&nvs_mu);
    return quiet ? NVS_RESULT_DRAINED : NVS_RESULT_ACTIVE;
}

/* The jobs that move memory between the device and the host (swap.c). */
static int moves_memory(enum nvs_job job) {
    return job == NVS_JOB_SWAP_OUT || job == NVS_JOB_PREFETCH || job == NVS_JOB_PREFETCH_AHEAD;
}

static enum nvs_job_result run_job(struct nvs_device *d, enum nvs_job job, uint64_t bytes) {
    switch (job) {
    case NVS_JOB_PROBE:
        return run_probe(d);
    case NVS_JOB_SWAP_OUT:
        return nvs_swap_out(d, bytes) == 0 ? NVS_RESULT_MOVED : NVS_RESULT_DEFERRED;
    case NVS_JOB_PREFETCH:
    case NVS_JOB_PREFETCH_AHEAD:
        return nvs_swap_in(d, bytes, job == NVS_JOB_PREFETCH) == 0 ? NVS_RESULT_MOVED : NVS_RESULT_DEFERRED;
    default:
        return run_drain(d);
    }
}

/* How often pending frees are polled, pinning that is due but could not go on is tried again
 * (a capture runs, or the host had no memory to pin), and the pinner of a pool's member looks at
 * what the other members changed (a segment to register, one to let go of). */
#define FREES_POLL_NS (5 * 1000 * 1000)
#define PINNER_RETRY_NS (50 * 1000 * 1000)
#define PINNER_LOOK_NS (100 * 1000 * 1000)

/* Under nvs_mu: waits on `cv` until signalled or `ns` have passed. */
static void wait_at_most_locked(pthread_cond_t *cv, long ns) {
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_nsec += ns;
    if (until.tv_nsec >= 1000000000L) until.tv_sec++, until.tv_nsec -= 1000000000L;
    pthread_cond_timedwait(cv, &nvs_mu, &until);
}

static int any_capture_locked(void) {
    for (int i = 0; i < nvs_n_devices; i++)
        if (nvs_devices[i].captures > 0) return 1;
    return 0;
}

static void *worker_main(void *unused) {
    (void)unused;
    prctl(PR_SET_NAME, "nvs-worker", 0, 0, 0); /* named in /proc, where a stall is looked for */
    nvs_swap_resolve(); /* which swap engine the driver allows, once, before any job */
    pthread_mutex_lock(&nvs_mu);
    for (;;) {
        struct nvs_device *d = NULL;
        for (int i = 0; i < nvs_n_devices && d == NULL; i++)
            if (nvs_devices[i].job != NVS_JOB_NONE && !nvs_devices[i].job_running) d = &nvs_devices[i];
        if (d != NULL && !atomic_load(&exiting)) {
            enum nvs_job job = d->job;
            uint64_t bytes = d->job_bytes;
            int moves = moves_memory(job);
            d->job_running = 1;
            pthread_mutex_unlock(&nvs_mu);
            if (moves) { /* a pinner step under way ends first */
                pthread_mutex_lock(&step_mu);
                pthread_mutex_unlock(&step_mu);
            }
            enum nvs_job_result result = run_job(d, job, bytes);
            pthread_mutex_lock(&nvs_mu);
            if (moves) nvs_pinner_wake_locked(); /* its steps may go on */
            if (job == NVS_JOB_PREFETCH_AHEAD) d->ahead_at = nvs_now();
            d->job_running = 0;
            d->job = NVS_JOB_NONE;
            d->job_result = result;
            pthread_mutex_unlock(&nvs_mu);
            nvs_client_wake(); /* a pipe write: not under nvs_mu */
            pthread_mutex_lock(&nvs_mu);
            continue;
        }
        /* Event queries of deferred frees are unsafe API calls during a global-mode capture. */
        if (nvs_memory_frees_pending() && !atomic_load(&exiting) && !any_capture_locked()) {
            pthread_mutex_unlock(&nvs_mu);
            nvs_memory_poll_frees();
            pthread_mutex_lock(&nvs_mu);
            if (!worker_kicked) wait_at_most_locked(&worker_cv, FREES_POLL_NS);
        } else if (!worker_kicked) {
            pthread_cond_wait(&worker_cv, &nvs_mu);
        }
        worker_kicked = 0;
    }
    return NULL;
}

/* Under nvs_mu: whether the worker runs a swap job (a running job stays in d->job until it ends). */
static int moving_locked(void) {
    for (int i = 0; i < nvs_n_devices; i++)
        if (nvs_devices[i].job_running && moves_memory(nvs_devices[i].job)) return 1;
    return 0;
}

/* A pinner step holds up the application's calls as it holds up the worker's (a registration for
 * its whole length, above), so none is taken within the pinning grace (NVSHARE_PINNING_GRACE_MS,
 * 250 ms) of the application's asking for the GPU (a thread waits at a closed gate) or of its
 * getting it (the gate opened): on an H200 the first requests to six tenants that had just loaded
 * ended 0.35-0.52 s after their grant, their own pinner registering 512 MiB segments of the growing
 * pool in between (the request's own work took milliseconds). A waiter whose memory the worker has
 * just brought back ahead of its grant is about to get it: on an H200 a step begun as that swap-in
 * ended (its end wakes the pinner) made and registered a segment for 0.8 s, and the request's last
 * 128 MiB and first calls waited for it. A job that waits for its turn longer, or holds the GPU
 * longer (a training job in its quantum), lets steps go on beside it: a grace as long as a quantum
 * of 1 s kept two such jobs' areas from being pinned before their first handoffs
 * (tests/test_simcuda_pipelining.py). */
static int application_starting_work_locked(double now) { /* under nvs_mu */
    double grace = (double)nvs_config.pinning_grace_ms / 1000.0;
    for (int i = 0; i < nvs_n_devices; i++) {
        struct nvs_device *d = &nvs_devices[i];
        /* it has just asked, or its memory has just come back ahead of its grant (which is due) */
        if (d->waiters > 0 && (now - d->asked_at < grace || now - d->ahead_at < grace)) return 1;
        if (atomic_load(&d->gate_open) && now - d->gate_opened_at < grace) return 1;
    }
    return 0;
}

/* One step towards the swap area's (or pool's) target, unless the worker moves memory or the
 * application is starting work on the GPU: 1 when it changed something. */
static int step_unless_in_the_way(void) {
    pthread_mutex_lock(&step_mu);
    double now = nvs_now();
    pthread_mutex_lock(&nvs_mu);
    int wait = moving_locked() || application_starting_work_locked(now);
    pthread_mutex_unlock(&nvs_mu);
    int changed = !wait && nvs_swap_prepare_step();
    pthread_mutex_unlock(&step_mu);
    return changed;
}

/* Steps towards the swap area's target while there is one to take; waits to be told when there
 * is none, and retries now and then while one is due but cannot be taken (a swap job's end
 * tells it at once). */
static void *pinner_main(void *unused) {
    (void)unused;
    prctl(PR_SET_NAME, "nvs-pinner", 0, 0, 0);
    nvs_swap_resolve();
    pthread_mutex_lock(&nvs_mu);
    while (!atomic_load(&exiting)) {
        pinner_kicked = 0;
        pthread_mutex_unlock(&nvs_mu);
        while (!atomic_load(&exiting) && step_unless_in_the_way()) continue;
        int due = !atomic_load(&exiting) && nvs_swap_prepare_due();
        int watching = nvs_swap_prepare_watching();
        pthread_mutex_lock(&nvs_mu);
        if (pinner_kicked) continue;
        if (due) {
            wait_at_most_locked(&pinner_cv, PINNER_RETRY_NS);
        } else if (watching) {
            wait_at_most_locked(&pinner_cv, PINNER_LOOK_NS);
        } else {
            pthread_cond_wait(&pinner_cv, &nvs_mu);
        }
    }
    pthread_mutex_unlock(&nvs_mu);
    return NULL;
}

static int spawn(void *(*body)(void *)) {
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 256 * 1024);
    pthread_t thread;
    int r = pthread_create(&thread, &attr, body, NULL);
    pthread_attr_destroy(&attr);
    return r;
}

int nvs_worker_spawn(void) {
    int r = spawn(worker_main);
    return r == 0 ? spawn(pinner_main) : r;
}

void nvs_worker_reset_after_fork(void) {
    pthread_cond_init(&worker_cv, NULL);
    worker_kicked = 0;
    pthread_cond_init(&pinner_cv, NULL);
    pinner_kicked = 0;
    pthread_mutex_init(&step_mu, NULL);
}
