/*
 * The two threads nvshare adds to a CUDA process, started on its first gated call or
 * allocation:
 *
 * - the client thread owns the connection to the scheduler: registration, the protocol state
 *   machine of every device (docs/protocol.md), heartbeats, memory reports, idle detection,
 *   reconnection. It never calls CUDA and never blocks on the GPU, so it keeps heart-beating
 *   while work drains.
 * - the worker thread does what needs the GPU: drains before a RELEASE (after DROP or REVOKE,
 *   or ahead of a contended quantum's end: the pre-drain), idle probes, deferred stream-ordered
 *   frees.
 *
 * They share state with application threads through nvs_mu (nvshare.h); I/O and CUDA calls
 * happen outside it.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "nvshare.h"
#include "transport.h"

#define CONNECT_TIMEOUT_MS 1000
#define SEND_TIMEOUT_MS 2000
#define WELCOME_TIMEOUT_S 5.0
#define FAST_RETRY_PERIOD_S 3.0 /* reconnect every 100 ms for this long, then back off to 1 s */
#define WAIT_WARNING_PERIOD_S 10.0
#define MEMORY_REPORT_PERIOD_S 0.1
#define DEFAULT_HEARTBEAT_MS 1000
#define DEFAULT_IDLE_RELEASE_MS 1000
/* Pre-drain lead: the longest recent drain of the device times PREDRAIN_LEAD_FACTOR (a margin
 * for drains that grow), at least PREDRAIN_LEAD_MIN_S, at most half the quantum. */
#define PREDRAIN_LEAD_FACTOR 1.5
#define PREDRAIN_LEAD_MIN_S 0.02

/* --- state shared with application threads ----------------------------------------------------*/

static _Atomic int started;       /* fast check for nvs_runtime_start */
static int starting;              /* under nvs_mu: threads created (or being created) */
static int wake_fds[2] = {-1, -1}; /* pipe: any thread writes a byte to wake the client thread;
                                     * created under nvs_mu before `started` is set */
static pthread_cond_t worker_cv = PTHREAD_COND_INITIALIZER; /* with nvs_mu */
static int worker_kicked;                                    /* under nvs_mu */
static _Atomic int memory_dirty;  /* an allocation changed a byte count since the last look */
static _Atomic int exiting;       /* set by an atexit handler: the worker stops calling CUDA */

/* --- client-thread state (only the client thread touches it, and the fork child) ------------*/

static struct {
    struct nvs_transport transport;
    int connected;     /* ZMTP session up, HELLO sent */
    int registered;    /* WELCOME received */
    int was_registered; /* registered at least once (this HELLO is a re-registration) */
    double connected_at;
    double next_attempt;
    double outage_since;  /* 0 while connected or before the first attempt */
    double backoff_s;
    double last_wait_warning;
    int fail_open_warned;
    int lost_warned;
    double last_sent;
    long heartbeat_ms;
    long scheduler_idle_ms;
    double last_memory_report;
    char session[17];
    char client_id[64];
} C;

static long idle_window_ms(void) {
    if (nvs_config.idle_release_ms >= 0) return nvs_config.idle_release_ms;
    return C.scheduler_idle_ms;
}

void nvs_client_wake(void) {
    int fd = __atomic_load_n(&wake_fds[1], __ATOMIC_ACQUIRE);
    if (fd < 0) return;
    char byte = 1;
    ssize_t ignored = write(fd, &byte, 1); /* a full pipe already means "wake up" */
    (void)ignored;
}

void nvs_client_memory_changed(void) {
    if (!atomic_exchange(&memory_dirty, 1)) nvs_client_wake();
}

void nvs_worker_kick(void) {
    pthread_mutex_lock(&nvs_mu);
    worker_kicked = 1;
    pthread_cond_signal(&worker_cv);
    pthread_mutex_unlock(&nvs_mu);
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

/* --- sending ---------------------------------------------------------------------------------*/

static void disconnect(const char *why, int err);

static int send_message(const char *buf, size_t len, double now) {
    if (len == 0) {
        nvs_error("could not encode a protocol message (a bug); dropping the connection");
        disconnect("encoding failed", EINVAL);
        return -1;
    }
    int r = nvs_transport_send(&C.transport, buf, len, SEND_TIMEOUT_MS);
    if (r < 0) {
        disconnect("send failed", -r);
        return -1;
    }
    C.last_sent = now;
    nvs_debug("sent %.*s", (int)(memchr(buf, '\n', len) ? (const char *)memchr(buf, '\n', len) - buf : (long)len), buf);
    return 0;
}

static void send_hello(double now) {
    const char *held[NVS_MAX_DEVICES], *wanted[NVS_MAX_DEVICES];
    size_t n_held = 0, n_wanted = 0;
    pthread_mutex_lock(&nvs_mu);
    for (int i = 0; i < nvs_n_devices; i++) {
        struct nvs_device *d = &nvs_devices[i];
        if (!d->known) continue;
        if (d->state == NVS_HOLDING || d->state == NVS_UNSCHEDULED)
            held[n_held++] = d->uuid;
        else if (C.was_registered && (d->state == NVS_WAITING || (d->state == NVS_IDLE && d->waiters > 0)))
            wanted[n_wanted++] = d->uuid; /* keeps its place in the queue of the same daemon; a
                                             * first registration asks with DEVICE, MEMORY, ACQUIRE.
                                             * Not while draining: a GRANT must not come before
                                             * the drain ends (it asks again then). */
    }
    pthread_mutex_unlock(&nvs_mu);

    char host[256] = "", container[80], program[sizeof nvs_config.program];
    gethostname(host, sizeof host - 1);
    container_id(container, sizeof container);
    /* "python" says little when several notebooks share a GPU: launchers may name the program. */
    if (nvs_config.program[0] != '\0') {
        memcpy(program, nvs_config.program, sizeof program);
    } else {
        read_small_file("/proc/self/comm", program, sizeof program);
        program[strcspn(program, "\n")] = '\0';
    }
    struct nvs_hello hello = {
        .pid = (long)getpid(),
        .host = host,
        .container = container,
        .pod = nvs_config.pod,
        .namespace_ = nvs_config.pod_namespace,
        .program = program,
        .held = held,
        .n_held = n_held,
        .wanted = wanted,
        .n_wanted = n_wanted,
    };
    memcpy(hello.session, C.session, sizeof hello.session);
    char buf[NVS_TRANSPORT_MAX_MESSAGE];
    send_message(buf, nvs_msg_hello(buf, sizeof buf, &hello), now);
}

/* --- connection ------------------------------------------------------------------------------*/

static int any_waiters(void) {
    int waiting = 0;
    pthread_mutex_lock(&nvs_mu);
    for (int i = 0; i < nvs_n_devices; i++) waiting |= nvs_devices[i].waiters > 0;
    pthread_mutex_unlock(&nvs_mu);
    return waiting;
}

static void schedule_reconnect(double now) {
    if (C.outage_since == 0) C.outage_since = now;
    if (now - C.outage_since < FAST_RETRY_PERIOD_S)
        C.backoff_s = 0.1;
    else
        C.backoff_s = C.backoff_s * 2 > 1.0 ? 1.0 : C.backoff_s * 2;
    C.next_attempt = now + C.backoff_s;
}

static void disconnect(const char *why, int err) {
    double now = nvs_now();
    int was_registered = C.registered;
    nvs_transport_close(&C.transport);
    C.connected = 0;
    C.registered = 0;
    schedule_reconnect(now);
    if (was_registered)
        nvs_warn("lost the scheduler at %s (%s: %s); reconnecting. Processes holding a GPU lock keep "
                 "running, the others wait (NVSHARE_FAIL_MODE=%s)",
                 nvs_config.socket_path, why, strerror(err), nvs_config.fail_open ? "open" : "closed");
    pthread_mutex_lock(&nvs_mu);
    for (int i = 0; i < nvs_n_devices; i++) {
        struct nvs_device *d = &nvs_devices[i];
        d->announced = 0;
        d->grant_known = 0; /* grant ids are per connection: a new one names them again */
        d->predrain_at = 0; /* so is contention: the scheduler tells a re-registered holder again */
        if (d->state == NVS_WAITING) d->state = NVS_IDLE; /* asked again after re-registration */
    }
    pthread_mutex_unlock(&nvs_mu);
}

static void try_connect(double now) {
    int r = nvs_transport_connect(&C.transport, nvs_config.socket_path, CONNECT_TIMEOUT_MS);
    if (r < 0) {
        nvs_debug("cannot connect to %s: %s", nvs_config.socket_path, strerror(-r));
        if (r == -ENAMETOOLONG && C.outage_since == 0)
            nvs_error("the scheduler socket path %s is too long for a Unix socket", nvs_config.socket_path);
        schedule_reconnect(now);
        return;
    }
    C.connected = 1;
    C.registered = 0;
    C.connected_at = now;
    send_hello(now);
}

/* --- scheduler messages ----------------------------------------------------------------------*/

static void start_job_locked(struct nvs_device *d, enum nvs_job job) {
    d->job = job;
    d->job_result = NVS_RESULT_NONE;
    worker_kicked = 1;
    pthread_cond_signal(&worker_cv);
}

/* DROP, REVOKE or a due pre-drain of the device's current grant: stop submitting, drain, then
 * RELEASE. A second cause joins the running drain (a REVOKE changes the reason it gives). */
static void begin_release_locked(struct nvs_device *d, const char *reason, double now) {
    nvs_gate_set_locked(d, 0);
    if (!d->drop_pending) d->drain_started = now;
    d->drop_pending = 1;
    d->release_reason = reason;
    d->predrain_at = 0;
    if (d->state == NVS_HOLDING) d->state = NVS_DRAINING;
    if (d->job_result == NVS_RESULT_DRAINED || d->job_running) return; /* the worker's result will do */
    start_job_locked(d, NVS_JOB_DRAIN);
}

static int grant_matches(const struct nvs_device *d, uint64_t grant) {
    /* After a reconnection the client does not know the new daemon's grant id of a lock it
     * claimed: the first message naming one tells it. */
    return !d->grant_known || d->grant == grant;
}

static void reset_idle_tracking_locked(struct nvs_device *d, double now) {
    d->idle_entered = atomic_load(&d->entered);
    d->idle_since = now;
    long window = idle_window_ms();
    d->idle_next_check = now + (window > 0 ? window / 4000.0 : 1.0);
}

/* The scheduler answered `not-registered` although it had welcomed us: it dropped this client
 * while the connection stayed up (silent past its heartbeat timeout: the process was stopped,
 * or starved). Every grant is void and its lock may be someone else's by now: close the gates,
 * drain what already passed them (nothing to release: the scheduler forgot those grants), and
 * register again, asking for the devices waited for. */
static void lose_registration(double now) {
    nvs_warn("the scheduler dropped this process's registration (silent past its heartbeat timeout); "
             "registering again, GPU work waits for the lock");
    C.registered = 0;
    C.connected_at = now; /* the WELCOME timeout counts from the new HELLO */
    pthread_mutex_lock(&nvs_mu);
    for (int i = 0; i < nvs_n_devices; i++) {
        struct nvs_device *d = &nvs_devices[i];
        d->announced = 0; /* the scheduler forgot its DEVICE and MEMORY reports too */
        if (d->state == NVS_HOLDING || d->state == NVS_DRAINING) {
            d->grant_known = 0;
            begin_release_locked(d, "revoke", now);
        }
    }
    pthread_mutex_unlock(&nvs_mu);
    send_hello(now);
}

/* How long before the quantum's end a contended device's drain should start (see
 * PREDRAIN_LEAD_FACTOR); with no drain seen yet, the minimum. Under nvs_mu. */
static double predrain_lead_locked(const struct nvs_device *d) {
    double longest = 0;
    for (int i = 0; i < d->drains_known; i++)
        if (d->drain_seconds[i] > longest) longest = d->drain_seconds[i];
    double lead = longest * PREDRAIN_LEAD_FACTOR;
    if (lead < PREDRAIN_LEAD_MIN_S) lead = PREDRAIN_LEAD_MIN_S;
    double half_quantum = d->quantum_ms / 2000.0; /* a process never gives more of it to its queue */
    return lead < half_quantum ? lead : half_quantum;
}

/* The drain that began at drain_started ends with this RELEASE: remember how long it took. */
static void note_drain_locked(struct nvs_device *d, double now) {
    if (d->drain_started <= 0) return;
    d->drain_seconds[d->drain_next] = now - d->drain_started;
    d->drain_next = (d->drain_next + 1) % NVS_DRAIN_HISTORY;
    if (d->drains_known < NVS_DRAIN_HISTORY) d->drains_known++;
    d->drain_started = 0;
}

static void handle_message(const struct nvs_msg *m, double now) {
    if (m->type == NVS_MSG_WELCOME) {
        C.registered = 1;
        C.was_registered = 1;
        C.heartbeat_ms = m->heartbeat_ms > 0 ? (long)m->heartbeat_ms : DEFAULT_HEARTBEAT_MS;
        C.scheduler_idle_ms = (long)m->idle_release_ms;
        snprintf(C.client_id, sizeof C.client_id, "%s", m->client);
        if (C.lost_warned || C.fail_open_warned) nvs_warn("connected to the scheduler at %s again", nvs_config.socket_path);
        nvs_info("registered with the scheduler as %s", C.client_id);
        C.outage_since = 0;
        C.lost_warned = 0;
        C.fail_open_warned = 0;
        pthread_mutex_lock(&nvs_mu);
        for (int i = 0; i < nvs_n_devices; i++) {
            struct nvs_device *d = &nvs_devices[i];
            if (d->state == NVS_UNSCHEDULED || d->state == NVS_HOLDING) {
                /* claimed in HELLO (held=): keep the gate open until the scheduler decides */
                d->state = NVS_HOLDING;
                d->grant_known = 0;
                reset_idle_tracking_locked(d, now);
            }
        }
        pthread_mutex_unlock(&nvs_mu);
        return;
    }
    if (m->type == NVS_MSG_ERROR) {
        if (strcmp(m->code, "not-registered") != 0)
            nvs_warn("the scheduler rejected a message: %s (%s)", m->code, m->detail);
        else if (C.registered)
            lose_registration(now);
        else /* an answer to what was sent before our HELLO; WELCOME follows */
            nvs_debug("not-registered answer to %s ignored: registering", m->error_type);
        return;
    }
    pthread_mutex_lock(&nvs_mu);
    struct nvs_device *d = nvs_device_by_uuid(m->device);
    if (d == NULL) {
        pthread_mutex_unlock(&nvs_mu);
        nvs_debug("scheduler message for unknown device %s ignored", m->device);
        return;
    }
    switch (m->type) {
    case NVS_MSG_GRANT:
        if (d->state == NVS_DRAINING) break; /* cannot happen: no ACQUIRE before our RELEASE */
        d->state = NVS_HOLDING;
        d->grant = m->grant;
        d->grant_known = 1;
        d->drop_pending = 0;
        d->quantum_ms = m->quantum_ms;
        d->predrain_at = 0; /* a CONTENDED follows when others wait */
        reset_idle_tracking_locked(d, now);
        nvs_gate_set_locked(d, 1);
        nvs_debug("granted %s (grant %llu)", d->uuid, (unsigned long long)m->grant);
        break;
    case NVS_MSG_CONTENDED:
        if (d->state != NVS_HOLDING || !grant_matches(d, m->grant)) {
            nvs_debug("stale CONTENDED for grant %llu ignored", (unsigned long long)m->grant);
        } else if (!nvs_config.predrain) {
            nvs_debug("others wait for %s; no pre-drain (NVSHARE_PREDRAIN=0)", d->uuid);
        } else {
            d->grant = m->grant;
            d->grant_known = 1;
            double left = m->quantum_left_ms / 1000.0, lead = predrain_lead_locked(d);
            d->predrain_at = now + (left > lead ? left - lead : 0); /* due now at the latest */
            nvs_debug("others wait for %s: draining in %.3f s, %.3f s before the quantum ends", d->uuid,
                      d->predrain_at - now, lead);
        }
        break;
    case NVS_MSG_DROP:
    case NVS_MSG_REVOKE:
        if ((d->state == NVS_HOLDING || d->state == NVS_DRAINING) && grant_matches(d, m->grant)) {
            d->grant = m->grant;
            d->grant_known = 1;
            if (m->type == NVS_MSG_REVOKE) {
                nvs_warn("the scheduler revoked the lock of %s (%s): its work did not drain in time", d->uuid,
                         m->reason);
                begin_release_locked(d, "revoke", now);
            } else if (!d->drop_pending) {
                begin_release_locked(d, "drop", now);
            }
        } else {
            nvs_debug("stale %s for grant %llu ignored", m->type == NVS_MSG_DROP ? "DROP" : "REVOKE",
                      (unsigned long long)m->grant);
        }
        break;
    case NVS_MSG_MODE:
        d->quantum_ms = m->quantum_ms;
        nvs_debug("%s: mode %d, quantum %llu ms", d->uuid, (int)m->mode, (unsigned long long)m->quantum_ms);
        break;
    default:
        break;
    }
    pthread_mutex_unlock(&nvs_mu);
}

static void receive_all(double now) {
    char buf[NVS_TRANSPORT_MAX_MESSAGE + 1];
    while (C.connected) {
        size_t len = 0;
        int r = nvs_transport_recv(&C.transport, buf, sizeof buf - 1, &len);
        if (r == 0) return;
        if (r < 0) {
            disconnect(r == -EPIPE ? "the scheduler closed the connection" : "receive failed", -r);
            return;
        }
        struct nvs_msg m;
        if (nvs_msg_parse(buf, len, &m) != 0) {
            nvs_debug("unparseable scheduler message ignored");
            continue;
        }
        handle_message(&m, now);
    }
}

/* --- the per-device state machine ------------------------------------------------------------
 * next_message() picks the next message to send (updating state as if it were sent), under
 * nvs_mu; the caller sends it outside the lock and calls again until there is nothing left. */

static size_t next_message(double now, char *buf, size_t cap) {
    long window = idle_window_ms();
    for (int i = 0; i < nvs_n_devices; i++) {
        struct nvs_device *d = &nvs_devices[i];
        if (!d->known) continue;

        /* the worker finished a drain or an idle probe */
        if (d->job_result == NVS_RESULT_ACTIVE) {
            d->job_result = NVS_RESULT_NONE;
            reset_idle_tracking_locked(d, now);
        } else if (d->job_result == NVS_RESULT_DRAINED) {
            d->job_result = NVS_RESULT_NONE;
            const char *reason = d->drop_pending ? d->release_reason : "idle";
            int known_grant = d->grant_known;
            if (d->drop_pending) note_drain_locked(d, now);
            d->state = NVS_IDLE;
            d->drop_pending = 0;
            if (C.registered && known_grant) {
                nvs_debug("releasing %s (grant %llu, %s)", d->uuid, (unsigned long long)d->grant, reason);
                return nvs_msg_release(buf, cap, d->uuid, d->grant, reason);
            }
        }

        /* others wait and the quantum is nearly over: drain now, so the handoff is on time */
        if (d->predrain_at > 0 && now >= d->predrain_at) {
            d->predrain_at = 0;
            if (d->state == NVS_HOLDING && d->grant_known && C.registered) {
                nvs_debug("draining %s ahead of its quantum's end (grant %llu)", d->uuid, (unsigned long long)d->grant);
                begin_release_locked(d, "quantum", now);
            }
        }

        if (!C.registered) {
            /* fail-open: with no scheduler, nothing is scheduled */
            if (nvs_config.fail_open && C.outage_since != 0 && d->state == NVS_IDLE) {
                d->state = NVS_UNSCHEDULED;
                nvs_gate_set_locked(d, 1);
            }
            continue;
        }

        uint64_t bytes = atomic_load(&d->bytes);
        int wants = d->state == NVS_IDLE && d->waiters > 0;
        if (!d->announced && (wants || d->state != NVS_IDLE || bytes > 0)) {
            d->announced = 1;
            d->reported_bytes = UINT64_MAX;
            return nvs_msg_device(buf, cap, d->uuid, d->total, d->name);
        }
        if (d->announced && bytes != d->reported_bytes &&
            (wants || now - C.last_memory_report >= MEMORY_REPORT_PERIOD_S)) {
            d->reported_bytes = bytes;
            C.last_memory_report = now;
            return nvs_msg_memory(buf, cap, d->uuid, bytes);
        }
        if (wants) {
            d->state = NVS_WAITING;
            return nvs_msg_acquire(buf, cap, d->uuid);
        }

        /* early release of an idle holder; the worker does the GPU part */
        if (d->state == NVS_HOLDING && d->grant_known && d->job == NVS_JOB_NONE && !d->job_running &&
            d->job_result == NVS_RESULT_NONE && window > 0 && now >= d->idle_next_check) {
            uint64_t entered = atomic_load(&d->entered);
            if (entered != d->idle_entered) {
                d->idle_entered = entered;
                d->idle_since = now;
            } else if (now - d->idle_since >= window / 1000.0) {
                start_job_locked(d, NVS_JOB_PROBE);
            }
            d->idle_next_check = now + window / 4000.0;
        }
    }
    if (C.registered && now - C.last_sent >= C.heartbeat_ms / 1000.0) return nvs_msg_heartbeat(buf, cap);
    return 0;
}

static void warn_about_outage(double now) {
    if (C.registered || C.outage_since == 0) return;
    if (nvs_config.fail_open) {
        if (!C.fail_open_warned)
            nvs_warn("no scheduler at %s: running unscheduled (NVSHARE_FAIL_MODE=open) until it is reachable",
                     nvs_config.socket_path);
        C.fail_open_warned = 1;
        return;
    }
    if (any_waiters() && now - C.last_wait_warning >= WAIT_WARNING_PERIOD_S) {
        nvs_warn("waiting for the scheduler at %s: GPU work is held until it is reachable "
                 "(NVSHARE_FAIL_MODE=closed; set NVSHARE_FAIL_MODE=open to run unscheduled meanwhile)",
                 nvs_config.socket_path);
        C.last_wait_warning = now;
        C.lost_warned = 1;
    }
}

/* Milliseconds until something is due (at most 1 s). */
static int poll_timeout(double now) {
    double due = now + 1.0;
    if (!C.connected && C.next_attempt < due) due = C.next_attempt;
    if (C.connected && !C.registered && C.connected_at + WELCOME_TIMEOUT_S < due) due = C.connected_at + WELCOME_TIMEOUT_S;
    if (C.registered) {
        double heartbeat = C.last_sent + C.heartbeat_ms / 1000.0;
        if (heartbeat < due) due = heartbeat;
        double memory = C.last_memory_report + MEMORY_REPORT_PERIOD_S;
        pthread_mutex_lock(&nvs_mu);
        for (int i = 0; i < nvs_n_devices; i++) {
            struct nvs_device *d = &nvs_devices[i];
            if (!d->known) continue;
            if (d->announced && atomic_load(&d->bytes) != d->reported_bytes && memory < due) due = memory;
            if (d->state == NVS_HOLDING && d->grant_known && idle_window_ms() > 0 && d->idle_next_check < due)
                due = d->idle_next_check;
            if (d->predrain_at > 0 && d->predrain_at < due) due = d->predrain_at;
        }
        pthread_mutex_unlock(&nvs_mu);
    }
    double ms = (due - now) * 1000.0;
    return ms <= 0 ? 0 : (int)ms + 1;
}

static void *client_main(void *unused) {
    (void)unused;
    for (;;) {
        double now = nvs_now();
        if (!C.connected && now >= C.next_attempt) try_connect(now);
        if (C.connected && !C.registered && now - C.connected_at > WELCOME_TIMEOUT_S)
            disconnect("no WELCOME from the scheduler", ETIMEDOUT);
        if (C.connected) receive_all(now);
        atomic_store(&memory_dirty, 0);
        for (;;) {
            char buf[NVS_TRANSPORT_MAX_MESSAGE];
            now = nvs_now();
            pthread_mutex_lock(&nvs_mu);
            size_t len = next_message(now, buf, sizeof buf);
            pthread_mutex_unlock(&nvs_mu);
            if (len == 0 || !C.connected) break;
            if (send_message(buf, len, now) != 0) break;
        }
        warn_about_outage(now);

        struct pollfd fds[2] = {{wake_fds[0], POLLIN, 0}, {nvs_transport_fd(&C.transport), POLLIN, 0}};
        int n = poll(fds, C.connected ? 2 : 1, poll_timeout(nvs_now()));
        if (n > 0 && (fds[0].revents & POLLIN)) {
            char sink[64];
            while (read(wake_fds[0], sink, sizeof sink) > 0) continue;
        }
    }
    return NULL;
}

/* --- the worker ------------------------------------------------------------------------------*/

/* An idle probe: release only if nothing was submitted since the last look, everything
 * submitted before has finished, and nothing entered while the gate was being closed. */
static enum nvs_job_result run_probe(struct nvs_device *d) {
    uint64_t x0 = atomic_load(&d->exited);
    uint64_t e0 = atomic_load(&d->entered);
    if (e0 == x0) {
        nvs_gate_sync_contexts(d); /* gate still open: the application may go on meanwhile */
        pthread_mutex_lock(&nvs_mu);
        nvs_gate_set_locked(d, 0);
        pthread_mutex_unlock(&nvs_mu);
        if (atomic_load(&d->entered) == e0) return NVS_RESULT_DRAINED;
    }
    pthread_mutex_lock(&nvs_mu);
    int must_release = d->drop_pending;
    if (!must_release) nvs_gate_set_locked(d, 1); /* the application is active: carry on */
    pthread_mutex_unlock(&nvs_mu);
    if (!must_release) return NVS_RESULT_ACTIVE;
    nvs_gate_drain(d);
    return NVS_RESULT_DRAINED;
}

static void *worker_main(void *unused) {
    (void)unused;
    pthread_mutex_lock(&nvs_mu);
    for (;;) {
        struct nvs_device *d = NULL;
        for (int i = 0; i < nvs_n_devices && d == NULL; i++)
            if (nvs_devices[i].job != NVS_JOB_NONE && !nvs_devices[i].job_running) d = &nvs_devices[i];
        if (d != NULL && !atomic_load(&exiting)) {
            enum nvs_job job = d->job;
            d->job_running = 1;
            pthread_mutex_unlock(&nvs_mu);
            enum nvs_job_result result;
            if (job == NVS_JOB_PROBE) {
                result = run_probe(d);
            } else {
                nvs_gate_drain(d);
                result = NVS_RESULT_DRAINED;
            }
            pthread_mutex_lock(&nvs_mu);
            d->job_running = 0;
            d->job = NVS_JOB_NONE;
            /* A DROP that arrived while an idle probe found the device active: drain now. */
            if (result == NVS_RESULT_ACTIVE && d->drop_pending) {
                start_job_locked(d, NVS_JOB_DRAIN);
                continue;
            }
            d->job_result = result;
            nvs_client_wake();
            continue;
        }
        if (nvs_memory_frees_pending() && !atomic_load(&exiting)) {
            pthread_mutex_unlock(&nvs_mu);
            nvs_memory_poll_frees();
            pthread_mutex_lock(&nvs_mu);
            struct timespec until;
            clock_gettime(CLOCK_REALTIME, &until);
            until.tv_nsec += 5 * 1000 * 1000;
            if (until.tv_nsec >= 1000000000L) until.tv_sec++, until.tv_nsec -= 1000000000L;
            if (!worker_kicked) pthread_cond_timedwait(&worker_cv, &nvs_mu, &until);
        } else if (!worker_kicked) {
            pthread_cond_wait(&worker_cv, &nvs_mu);
        }
        worker_kicked = 0;
    }
    return NULL;
}

/* --- start, exit, fork ---------------------------------------------------------------------*/

static void at_exit(void) { atomic_store(&exiting, 1); }

static void reset_client_state(void) {
    memset(&C, 0, sizeof C);
    nvs_transport_init(&C.transport);
    C.heartbeat_ms = DEFAULT_HEARTBEAT_MS;
    C.scheduler_idle_ms = DEFAULT_IDLE_RELEASE_MS;
    make_session(C.session);
}

static int spawn(void *(*main_fn)(void *)) {
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 256 * 1024);
    pthread_t thread;
    int r = pthread_create(&thread, &attr, main_fn, NULL);
    pthread_attr_destroy(&attr);
    return r;
}

void nvs_runtime_start(void) {
    if (NVS_LIKELY(atomic_load(&started))) return;
    pthread_mutex_lock(&nvs_mu);
    if (starting) {
        pthread_mutex_unlock(&nvs_mu);
        return;
    }
    starting = 1;
    int fds[2];
    if (pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) {
        nvs_error("cannot create a pipe (%s): nvshare cannot run; GPU work is not scheduled", strerror(errno));
        for (int i = 0; i < NVS_MAX_DEVICES; i++) nvs_gate_set_locked(&nvs_devices[i], 1);
        pthread_mutex_unlock(&nvs_mu);
        return;
    }
    wake_fds[0] = fds[0];
    __atomic_store_n(&wake_fds[1], fds[1], __ATOMIC_RELEASE);
    pthread_mutex_unlock(&nvs_mu);

    reset_client_state();
    static _Atomic int exit_hook;
    if (!atomic_exchange(&exit_hook, 1)) atexit(at_exit);

    /* nvshare's threads take no signals meant for the application. */
    sigset_t all, saved;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &saved);
    int r = spawn(worker_main);
    if (r == 0) r = spawn(client_main);
    pthread_sigmask(SIG_SETMASK, &saved, NULL);
    if (r != 0) {
        /* Without the threads no lock can ever be granted: never block the application. */
        nvs_error("cannot start nvshare's threads (%s): GPU work is not scheduled", strerror(r));
        pthread_mutex_lock(&nvs_mu);
        for (int i = 0; i < NVS_MAX_DEVICES; i++) nvs_gate_set_locked(&nvs_devices[i], 1);
        pthread_mutex_unlock(&nvs_mu);
    }
    atomic_store(&started, 1);
}

void nvs_fork_prepare(void) {
    pthread_mutex_lock(&nvs_mu);
    nvs_memory_fork_prepare();
}

void nvs_fork_parent(void) {
    nvs_memory_fork_parent();
    pthread_mutex_unlock(&nvs_mu);
}

/* The child has none of the parent's threads, locks or GPU state: it starts from scratch and
 * registers anew if it ever uses CUDA. The inherited connection is closed without a word, so
 * the parent's registration stays the parent's (the scheduler watches the parent's pid). */
void nvs_fork_child(void) {
    nvs_memory_reset_after_fork();
    pthread_mutex_init(&nvs_mu, NULL);
    pthread_mutex_init(&nvs_ctx_mu, NULL);
    pthread_cond_init(&nvs_gate_cv, NULL);
    pthread_cond_init(&worker_cv, NULL);
    nvs_transport_close(&C.transport);
    if (wake_fds[0] >= 0) close(wake_fds[0]);
    if (wake_fds[1] >= 0) close(wake_fds[1]);
    wake_fds[0] = wake_fds[1] = -1;
    starting = 0;
    worker_kicked = 0;
    atomic_store(&memory_dirty, 0);
    atomic_store(&started, 0);
    for (int i = 0; i < NVS_MAX_DEVICES; i++) {
        struct nvs_device *d = &nvs_devices[i];
        atomic_store(&d->gate_open, 0);
        atomic_store(&d->entered, 0);
        atomic_store(&d->exited, 0);
        atomic_store(&d->bytes, 0);
        d->state = NVS_IDLE;
        d->grant = 0;
        d->grant_known = 0;
        d->waiters = 0;
        d->drop_pending = 0;
        d->job = NVS_JOB_NONE;
        d->job_running = 0;
        d->job_result = NVS_RESULT_NONE;
        d->announced = 0;
        d->predrain_at = 0;
        d->quantum_ms = 0;
        d->drain_started = 0;
        d->drains_known = 0;
        d->drain_next = 0;
        d->n_contexts = 0;
    }
    nvs_tls.device = NULL;
}
