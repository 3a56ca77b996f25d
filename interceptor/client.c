/*
 * The client thread: the I/O shell around the client core (client_core.h). It owns the
 * connection to the scheduler, feeds the core what happened (scheduler messages, what the gate,
 * the allocator and the worker left in struct nvs_device, the time) and carries out the
 * actions the core returns: gates are opened and closed under nvs_mu, jobs handed to the
 * worker (worker.c) under nvs_mu, and messages and log lines are sent and written after
 * nvs_mu is released. It never calls CUDA and never blocks on the GPU, so it keeps
 * heart-beating while work drains.
 *
 * Only this thread feeds the core; the core itself and struct nvs_device's mailboxes are
 * under nvs_mu, which is never held across I/O (carry_out releases it for each send, connect
 * and log line).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#include "admission.h"
#include "area.h"
#include "client_core.h"
#include "collective.h"
#include "compiler.h"
#include "config.h"
#include "gang.h"
#include "gate.h"
#include "limits.h"
#include "log.h"
#include "memory.h"
#include "notify.h"
#include "pool.h"
#include "swap.h"
#include "transport.h"
#include "vmm.h"
#include "worker.h"

#define CONNECT_TIMEOUT_MS 1000
#define SEND_TIMEOUT_MS 2000
#define EXIT_BYE_WAIT_MS 200 /* at exit, how long the application waits for BYE to go out */

/* --- state shared with application threads ----------------------------------------------------*/

static _Atomic int started;        /* fast check for nvs_runtime_start */
static int starting;               /* under nvs_mu: threads created (or being created) */
static int wake_fds[2] = {-1, -1}; /* pipe: any thread writes a byte to wake the client thread;
                                    * created under nvs_mu before `started` is set */
static _Atomic int memory_dirty;   /* an allocation changed a byte count since the last look */
static _Atomic int exiting;        /* set by the atexit handler: the client thread says BYE */
static pthread_cond_t bye_cv = PTHREAD_COND_INITIALIZER; /* with nvs_mu: BYE went out */
static int bye_done;               /* under nvs_mu */

/* The lock state machine: under nvs_mu, fed only by the client thread. */
static struct nvs_core core;
static int synced_devices; /* under nvs_mu: devices of the table already added to the core */

/* The connection: client thread only (and the fork child, which has no client thread). */
static struct nvs_transport transport;

static void wake_client(void) {
    int fd = __atomic_load_n(&wake_fds[1], __ATOMIC_ACQUIRE);
    if (fd < 0) return;
    char byte = 1;
    ssize_t ignored = write(fd, &byte, 1); /* a full pipe already means "wake up" */
    (void)ignored;
}

static void memory_changed(void) {
    if (!atomic_exchange(&memory_dirty, 1)) wake_client();
}

/* --- identity --------------------------------------------------------------------------------*/

static void read_small_file(const char *path, char *out, size_t cap) {
    out[0] = '\0';
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    ssize_t n = read(fd, out, cap - 1);
    close(fd);
    out[n > 0 ? n : 0] = '\0';
}

static void make_session(char out[17]) {
    unsigned char bytes[8] = {0};
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    ssize_t n = fd >= 0 ? read(fd, bytes, sizeof bytes) : -1;
    if (fd >= 0) close(fd);
    if (n != (ssize_t)sizeof bytes) {
        /* No /dev/urandom (odd containers): time and pid still separate processes. */
        uint64_t mix = (uint64_t)(nvs_now() * 1e9) ^ ((uint64_t)getpid() << 32);
        memcpy(bytes, &mix, sizeof bytes);
    }
    for (int i = 0; i < 8; i++) snprintf(out + 2 * i, 3, "%02x", bytes[i]);
}

/* The container id: the last run of 64 hex digits in /proc/self/cgroup (docker, containerd,
 * CRI-O and podman all name the container's cgroup after it). Empty when not found. */
static void container_id(char *out, size_t cap) {
    char text[4096];
    read_small_file("/proc/self/cgroup", text, sizeof text);
    out[0] = '\0';
    size_t run = 0;
    for (size_t i = 0;; i++) {
        char c = text[i];
        int hex = (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
        if (hex) {
            run++;
            continue;
        }
        if (run == 64 && cap > 64) {
            memcpy(out, text + i - 64, 64);
            out[64] = '\0';
        }
        run = 0;
        if (c == '\0') break;
    }
}

/* Who this process is, for HELLO; read once per process (again in a fork child). */
static void identify(struct nvs_core_config *k) {
    memset(k, 0, sizeof *k);
    k->fail_open = nvs_config.fail_open;
    k->idle_release_ms = nvs_config.idle_release_ms;
    k->predrain = nvs_config.predrain;
    k->log_level = nvs_log_level;
    k->pid = (long)getpid();
    snprintf(k->socket_path, sizeof k->socket_path, "%s", nvs_config.socket_path);
    make_session(k->session);
    gethostname(k->host, sizeof k->host - 1);
    container_id(k->container, sizeof k->container);
    snprintf(k->pod, sizeof k->pod, "%s", nvs_config.pod);
    snprintf(k->pod_namespace, sizeof k->pod_namespace, "%s", nvs_config.pod_namespace);
    /* "python" says little when several notebooks share a GPU: launchers may name the program. */
    if (nvs_config.program[0] != '\0') {
        snprintf(k->program, sizeof k->program, "%s", nvs_config.program);
    } else {
        read_small_file("/proc/self/comm", k->program, sizeof k->program);
        k->program[strcspn(k->program, "\n")] = '\0';
    }
    /* Read at the first GPU call, not at load: torch.multiprocessing.spawn's children set
     * MASTER_ADDR and the like in Python before they initialise CUDA. */
    struct nvs_gang gang;
    nvs_gang_discover(environ, &gang);
    if (gang.malformed)
        nvs_warn("NVSHARE_GANG=%s is not name:size (size the ranks on this node) or none; %s", getenv("NVSHARE_GANG"),
                 gang.source);
    if (gang.name[0] != '\0')
        nvs_info("gang %s of %llu ranks on this node (from %s)", gang.name, (unsigned long long)gang.size, gang.source);
    else
        nvs_debug("%s", gang.source);
    snprintf(k->gang, sizeof k->gang, "%s", gang.name);
    k->gang_size = gang.size;
    k->counts_collectives = 1; /* collective.c counts them and holds them to a fence */
}

/* --- feeding the core (under nvs_mu) ---------------------------------------------------------*/

/* What the other threads left in the device table since the last look. */
static void observe_locked(double now) {
    for (int i = synced_devices; i < nvs_n_devices; i++) {
        struct nvs_device *d = &nvs_devices[i];
        if (d->known) nvs_core_add_device(&core, i, d->uuid, d->name, d->total);
    }
    synced_devices = nvs_n_devices;
    struct nvs_swap_figures figures; /* atomics and the area's leaf lock: no CUDA, no I/O */
    nvs_swap_figures(&figures);
    struct nvs_core_swap swap = {.engine = figures.engine == NVS_SWAP_COPY ? 1 : figures.engine == NVS_SWAP_MIGRATE ? 2 : 0,
                                 .area = figures.area, .out_bps = figures.out_bps, .in_bps = figures.in_bps,
                                 .pool = figures.pool};
    nvs_core_observe_swap(&core, &swap);
    for (int i = 0; i < nvs_n_devices; i++) {
        struct nvs_device *d = &nvs_devices[i];
        if (!d->known) continue;
        nvs_core_observe(&core, i, d->waiters, d->captures, atomic_load(&d->entered), atomic_load(&d->bytes));
        nvs_core_observe_admission(&core, i, d->admit_wanted);
        nvs_core_observe_residency(&core, i, atomic_load(&d->converted), atomic_load(&d->swapped));
        nvs_core_observe_collectives(&core, i, nvs_collectives_launched(d));
        if (d->job_result != NVS_RESULT_NONE) {
            enum nvs_job_result result = d->job_result;
            d->job_result = NVS_RESULT_NONE;
            nvs_core_job_done(&core, i, result, now);
        }
    }
}

#define LEASE_MARGIN_S 0.01 /* the coarse clock lags by up to a tick */

/* Hand the core's registration lease to the gate's fast path; waiters go on when it grows. */
static void publish_lease_locked(void) {
    double until = nvs_core_lease_until(&core);
    int64_t ms = until > 0 ? (int64_t)((until - LEASE_MARGIN_S) * 1000.0) : INT64_MAX;
    int64_t old = atomic_exchange(&nvs_lease_ms, ms);
    if (ms > old) pthread_cond_broadcast(&nvs_gate_cv);
}

/* Carry out the core's gate and job actions (under nvs_mu: an atomic store and a broadcast, a
 * mailbox) up to the first one that needs I/O, which is returned (0: none left). */
static int next_io_action_locked(struct nvs_action *a, char *buf, size_t cap) {
    while (nvs_core_pop(&core, a, buf, cap, nvs_now())) {
        if (a->kind == NVS_ACT_GATE)
            nvs_gate_set_locked(&nvs_devices[a->device], a->value);
        else if (a->kind == NVS_ACT_JOB)
            nvs_worker_assign_locked(&nvs_devices[a->device], (enum nvs_job)a->value, a->bytes);
        else if (a->kind == NVS_ACT_ADMISSION)
            nvs_admission_answer_locked(&nvs_devices[a->device], nvs_core_admitted(&core, a->device), a->value);
        else if (a->kind == NVS_ACT_SETTLED) /* after the device's LIMIT action, in order */
            nvs_admission_settled_locked(a->device >= 0 ? &nvs_devices[a->device] : NULL);
        else if (a->kind == NVS_ACT_SWAP_AREA) { /* the pinner pins (or gives back) the area */
            nvs_area_want(a->device, a->bytes);
            nvs_pinner_wake_locked();
        } else if (a->kind == NVS_ACT_POOL) { /* the pinner joins, grows or shrinks the pool */
            nvs_pool_want(a->bytes);
            nvs_pinner_wake_locked();
        } else if (a->kind == NVS_ACT_POOL_NEED) { /* the pinner registers others' segments up to it */
            nvs_pool_need_at_most(a->bytes);
            nvs_pinner_wake_locked();
        } else if (a->kind == NVS_ACT_SWAP_OUT_CUT) { /* the worker's swap-out stops (swap.c) */
            nvs_devices[a->device].job_cut = 1;
        } else if (a->kind == NVS_ACT_COLLECTIVES) { /* a gang's fence (collective.c) */
            uint64_t launched = nvs_collectives_limit_locked(&nvs_devices[a->device], a->bytes);
            nvs_core_collectives_limited(&core, a->device, launched, nvs_now());
        } else
            return 1;
    }
    publish_lease_locked();
    return 0;
}

/* Sending, connecting, logging: without nvs_mu. Returns what to tell the core: 0 nothing,
 * or the failed call's -errno (SEND, CONNECT); CONNECT's success is 1. */
static int perform_io(const struct nvs_action *a, const char *buf) {
    switch (a->kind) {
    case NVS_ACT_LOG:
        nvs_log(a->value, "%.*s", (int)a->len, buf);
        return 0;
    case NVS_ACT_SEND: {
        if (nvs_log_level >= NVS_LOG_DEBUG) {
            const char *eol = memchr(buf, '\n', a->len);
            nvs_debug("sent %.*s", (int)(eol ? eol - buf : (long)a->len), buf);
        }
        int r = nvs_transport_send(&transport, buf, a->len, SEND_TIMEOUT_MS);
        if (r < 0) nvs_debug("send failed: %s", strerror(-r)); /* carry_out reads what came, then closes */
        return r < 0 ? r : 0;
    }
    case NVS_ACT_CONNECT: {
        int r = nvs_transport_connect(&transport, nvs_config.socket_path, CONNECT_TIMEOUT_MS);
        return r < 0 ? r : 1;
    }
    case NVS_ACT_DISCONNECT:
        nvs_transport_close(&transport);
        return 0;
    case NVS_ACT_LIMIT:
        /* An atomic store and a log line: outside nvs_mu like the other I/O. */
        nvs_limit_from_scheduler(&nvs_devices[a->device], a->bytes);
        return 0;
    default:
        return 0;
    }
}

static void receive_all(void);

/* Carry out the core's actions in order; called without nvs_mu. */
static void carry_out(void) {
    char buf[NVS_TRANSPORT_MAX_MESSAGE];
    struct nvs_action a;
    for (;;) {
        pthread_mutex_lock(&nvs_mu);
        int more = next_io_action_locked(&a, buf, sizeof buf);
        pthread_mutex_unlock(&nvs_mu);
        if (!more) return;
        int outcome = perform_io(&a, buf);
        if (outcome == 0) continue;
        if (a.kind == NVS_ACT_SEND) {
            /* What the scheduler sent before the connection failed is read first: one without a
             * place for this process says why (ERROR too-many-connections), then closes. */
            receive_all();
            nvs_transport_close(&transport);
        }
        pthread_mutex_lock(&nvs_mu);
        if (a.kind == NVS_ACT_SEND)
            nvs_core_disconnected(&core, "send failed", nvs_now());
        else if (outcome > 0)
            nvs_core_connected(&core, nvs_now());
        else
            nvs_core_connect_failed(&core, -outcome, outcome == -ENAMETOOLONG, nvs_now());
        pthread_mutex_unlock(&nvs_mu);
    }
}

/* --- the client thread -----------------------------------------------------------------------*/

static void receive_all(void) {
    char buf[NVS_TRANSPORT_MAX_MESSAGE + 1];
    for (;;) {
        size_t len = 0;
        int r = nvs_transport_recv(&transport, buf, sizeof buf - 1, &len);
        if (r == 0) return;
        if (r < 0) nvs_transport_close(&transport);
        pthread_mutex_lock(&nvs_mu);
        double now = nvs_now();
        observe_locked(now);
        if (r < 0)
            nvs_core_disconnected(&core, r == -EPIPE ? "the scheduler closed the connection" : "receive failed", now);
        else
            nvs_core_receive(&core, buf, len, now);
        pthread_mutex_unlock(&nvs_mu);
        carry_out();
        if (r < 0) return;
    }
}

static void *client_main(void *unused) {
    (void)unused;
    prctl(PR_SET_NAME, "nvs-client", 0, 0, 0); /* named in /proc, where a stall is looked for */
    for (;;) {
        pthread_mutex_lock(&nvs_mu);
        double now = nvs_now();
        atomic_store(&memory_dirty, 0);
        observe_locked(now);
        int say_bye = atomic_load(&exiting) && !bye_done;
        /* The thread keeps serving after the exit: a holder's exit changes nothing until the
         * process is gone, and a late call of another's must find its gate open. */
        if (say_bye) nvs_core_exit(&core, now);
        nvs_core_tick(&core, now);
        pthread_mutex_unlock(&nvs_mu);
        carry_out();
        pthread_mutex_lock(&nvs_mu);
        if (say_bye) {
            bye_done = 1;
            pthread_cond_broadcast(&bye_cv);
        }
        double due = nvs_core_next_deadline(&core, nvs_now());
        pthread_mutex_unlock(&nvs_mu);

        int fd = nvs_transport_fd(&transport);
        struct pollfd fds[2] = {{wake_fds[0], POLLIN, 0}, {fd, POLLIN, 0}};
        double ms = (due - nvs_now()) * 1000.0;
        int n = poll(fds, fd >= 0 ? 2 : 1, ms <= 0 ? 0 : (int)ms + 1);
        if (n > 0 && (fds[0].revents & POLLIN)) {
            char sink[64];
            while (read(wake_fds[0], sink, sizeof sink) > 0) continue;
        }
        if (fd >= 0) receive_all();
    }
    return NULL;
}

/* --- start, exit, fork ---------------------------------------------------------------------*/

/* A clean exit says BYE, so the scheduler passes the locks on at once instead of noticing the
 * process's end. The client thread sends it; the application waits a moment for it. */
static void at_exit(void) {
    nvs_worker_stop_for_exit();
    nvs_pool_leave(); /* the last member of the swap pool removes it */
    if (!atomic_load(&started)) return;
    atomic_store(&exiting, 1);
    wake_client();
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_nsec += EXIT_BYE_WAIT_MS * 1000000L;
    if (until.tv_nsec >= 1000000000L) until.tv_sec++, until.tv_nsec -= 1000000000L;
    pthread_mutex_lock(&nvs_mu);
    while (!bye_done && pthread_cond_timedwait(&bye_cv, &nvs_mu, &until) == 0) continue;
    pthread_mutex_unlock(&nvs_mu);
}

static int spawn_client(void) {
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 256 * 1024);
    pthread_t thread;
    int r = pthread_create(&thread, &attr, client_main, NULL);
    pthread_attr_destroy(&attr);
    return r;
}

static void runtime_start(void) {
    if (NVS_LIKELY(atomic_load(&started))) return;
    struct nvs_core_config config;
    identify(&config); /* file reads: before nvs_mu */
    pthread_mutex_lock(&nvs_mu);
    if (starting) {
        pthread_mutex_unlock(&nvs_mu);
        return;
    }
    starting = 1;
    int fds[2];
    if (pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) {
        int err = errno;
        for (int i = 0; i < NVS_MAX_DEVICES; i++) nvs_gate_set_locked(&nvs_devices[i], 1);
        nvs_admission_settled_locked(NULL);
        pthread_mutex_unlock(&nvs_mu);
        nvs_error("cannot create a pipe (%s): nvshare cannot run; GPU work is not scheduled", strerror(err));
        return;
    }
    wake_fds[0] = fds[0];
    __atomic_store_n(&wake_fds[1], fds[1], __ATOMIC_RELEASE);
    nvs_core_init(&core, &config);
    synced_devices = 0;
    nvs_transport_init(&transport);
    pthread_mutex_unlock(&nvs_mu);

    static _Atomic int exit_hook;
    if (!atomic_exchange(&exit_hook, 1)) atexit(at_exit);

    /* nvshare's threads take no signals meant for the application. */
    sigset_t all, saved;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &saved);
    int r = nvs_worker_spawn();
    if (r == 0) r = spawn_client();
    pthread_sigmask(SIG_SETMASK, &saved, NULL);
    if (r != 0) {
        /* Without the threads no lock can ever be granted: never block the application. */
        nvs_error("cannot start nvshare's threads (%s): GPU work is not scheduled", strerror(r));
        pthread_mutex_lock(&nvs_mu);
        for (int i = 0; i < NVS_MAX_DEVICES; i++) nvs_gate_set_locked(&nvs_devices[i], 1);
        nvs_admission_settled_locked(NULL);
        pthread_mutex_unlock(&nvs_mu);
    }
    atomic_store(&started, 1);
}

static void fork_prepare(void) {
    pthread_mutex_lock(&nvs_mu);
    nvs_memory_fork_prepare();
}

static void fork_parent(void) {
    nvs_memory_fork_parent();
    pthread_mutex_unlock(&nvs_mu);
}

/* The child has none of the parent's threads, locks or GPU state: it starts from scratch and
 * registers anew if it ever uses CUDA. The inherited connection is closed without a word, so
 * the parent's registration stays the parent's (the scheduler watches the parent's pid). */
static void fork_child(void) {
    nvs_memory_reset_after_fork();
    nvs_vmm_reset_after_fork();
    nvs_area_reset_after_fork();
    nvs_pool_reset_after_fork();
    pthread_mutex_init(&nvs_mu, NULL);
    pthread_cond_init(&nvs_gate_cv, NULL);
    pthread_cond_init(&bye_cv, NULL);
    nvs_worker_reset_after_fork();
    nvs_gate_reset_after_fork();
    nvs_admission_reset_after_fork();
    nvs_transport_close(&transport);
    if (wake_fds[0] >= 0) close(wake_fds[0]);
    if (wake_fds[1] >= 0) close(wake_fds[1]);
    wake_fds[0] = wake_fds[1] = -1;
    starting = 0;
    bye_done = 0;
    atomic_store(&memory_dirty, 0);
    atomic_store(&exiting, 0);
    atomic_store(&started, 0);
    for (int i = 0; i < NVS_MAX_DEVICES; i++) {
        struct nvs_device *d = &nvs_devices[i];
        atomic_store(&d->gate_open, 0);
        atomic_store(&d->entered, 0);
        atomic_store(&d->exited, 0);
        atomic_store(&d->bytes, 0);
        atomic_store(&d->converted, 0);
        atomic_store(&d->swapped, 0);
        atomic_store(&d->swap_epoch, 0);
        d->waiters = 0;
        d->captures = 0;
        d->job = NVS_JOB_NONE;
        d->job_running = 0;
        d->job_result = NVS_RESULT_NONE;
        d->n_contexts = 0;
    }
    atomic_store(&nvs_lease_ms, INT64_MAX);
    nvs_tls.device = NULL;
}

static const struct nvs_runtime_ops runtime_ops = {
    .start = runtime_start,
    .wake_client = wake_client,
    .memory_changed = memory_changed,
    .kick_worker = nvs_worker_signal,
    .fork_prepare = fork_prepare,
    .fork_parent = fork_parent,
    .fork_child = fork_child,
};

__attribute__((constructor)) static void register_runtime(void) { nvs_notify_register(&runtime_ops); }
