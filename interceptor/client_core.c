/*
 * The client's lock logic (client_core.h): no locks, no clock, no I/O, no CUDA. The rules are
 * those of docs/protocol.md ("Client behaviour") and docs/interceptor.md ("The client");
 * the comments say why each one is there. It is long (some 1,300 lines) because it is every rule
 * of one state machine, which must stay one file to be read whole: events, the rules that follow
 * the state, the timer table (everything done at a time), swapping, the output.
 */
#include "client_core.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#define WELCOME_TIMEOUT_S 5.0
#define FAST_RETRY_PERIOD_S 3.0 /* reconnect every 100 ms for this long, then back off to 1 s */
#define WAIT_WARNING_PERIOD_S 10.0
#define UNKNOWN_WARNING_PERIOD_S 60.0 /* unknown message types from the scheduler */
#define MEMORY_REPORT_PERIOD_S 0.1
#define DEFAULT_HEARTBEAT_MS 1000
#define DEFAULT_IDLE_RELEASE_MS 1000
/* An idle holder is looked at every quarter of its idle window, at most this long apart: its
 * release comes at most twice this long after the window (the check that saw the last work, then
 * the one that sees the window over), which a request waiting behind it pays
 * (issue 29: at most the idle window + 0.1 s). Each look compares two counters. */
#define IDLE_CHECK_PERIOD_MAX_S 0.025
/* Pre-drain lead: the longest recent drain of the device times PREDRAIN_LEAD_FACTOR (a margin
 * for drains that grow), at least PREDRAIN_LEAD_MIN_S, at most half the quantum. */
#define PREDRAIN_LEAD_FACTOR 1.5
#define PREDRAIN_LEAD_MIN_S 0.02
/* What moving memory out costs ahead of a measurement: the swap engine's link bandwidth is
 * about twice this, the old prefetch path a third (issue 18); the lead covers it with margin. */
#define SWAP_OUT_BPS_UNMEASURED 25e9
#define SWAP_LEAD_FACTOR 1.2
/* Admission chunks: CHUNK_MIN and CHUNK_FRACTION of nvshare_py/scheduler/admission.py. */
#define ADMISSION_CHUNK_MIN (64ULL << 20)
#define ADMISSION_CHUNK_FRACTION 4
/* A surplus of admission (more than a chunk above the use, nobody waiting) is given back only
 * once it has lasted this long. Frameworks free and allocate again within moments (PyTorch's
 * caching allocator on an out-of-memory retry or empty_cache, a loop of cudaMalloc/cudaFree),
 * and an admitted total just answered is above the use until the waiting thread has charged its
 * allocation: giving it back at once made such a thread ask again and again (issue 20: 35,707
 * ADMITs in one second). Others waiting for that memory wait this much longer at most. */
#define GIVE_BACK_AFTER_S 1.0

enum { LOG_ERROR = 0, LOG_WARN = 1, LOG_INFO = 2, LOG_DEBUG = 3 };

/* --- actions --------------------------------------------------------------------------------*/

static struct nvs_core_queued *push(struct nvs_core *c, enum nvs_action_kind kind, int device, int value) {
    if (c->count == NVS_CORE_MAX_ACTIONS) {
        c->dropped_actions++; /* bounded by construction; reported by nvs_core_pop */
        return NULL;
    }
    struct nvs_core_queued *q = &c->queue[(c->head + c->count++) % NVS_CORE_MAX_ACTIONS];
    memset(q, 0, sizeof *q);
    q->action.kind = kind;
    q->action.device = device;
    q->action.value = value;
    return q;
}

static unsigned logs_queued(const struct nvs_core *c) {
    unsigned n = 0;
    for (unsigned i = 0; i < c->count; i++)
        if (c->queue[(c->head + i) % NVS_CORE_MAX_ACTIONS].action.kind == NVS_ACT_LOG) n++;
    return n;
}

__attribute__((format(printf, 3, 4))) static void core_log(struct nvs_core *c, int level, const char *fmt, ...) {
    if (level > c->config.log_level) return;
    /* A record names its text by slot: never more records waiting than slots. */
    if (logs_queued(c) >= NVS_CORE_MAX_LOGS) return;
    struct nvs_core_queued *q = push(c, NVS_ACT_LOG, -1, level);
    if (q == NULL) return;
    q->log = (int)(c->log_next++ % NVS_CORE_MAX_LOGS);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->logs[q->log], NVS_CORE_LOG_MAX, fmt, ap);
    va_end(ap);
}

static double lease_seconds(const struct nvs_core *c) { return c->heartbeat_ms / 1000.0; }

/* A message goes out while the lease holds: the scheduler will not forget this client for
 * another heartbeat timeout (longer than the interval) after it arrives. */
static void note_sent(struct nvs_core *c, double now) {
    c->last_sent = now;
    if (c->registered && c->ping_sent == 0 && now < c->lease_until) c->lease_until = now + lease_seconds(c);
}

static struct nvs_core_queued *send_message(struct nvs_core *c, enum nvs_msg_type message, int device,
                                            uint64_t number, const char *reason, double now) {
    struct nvs_core_queued *q = push(c, NVS_ACT_SEND, device, 0);
    if (q == NULL) return NULL;
    q->message = message;
    q->number = number;
    q->reason = reason;
    note_sent(c, now);
    return q;
}

static void set_gate(struct nvs_core_device *d, struct nvs_core *c, int open) {
    d->gate_open = open;
    push(c, NVS_ACT_GATE, (int)(d - c->devices), open);
}

static struct nvs_core_queued *start_job(struct nvs_core *c, struct nvs_core_device *d, enum nvs_job job) {
    d->job = job;
    return push(c, NVS_ACT_JOB, (int)(d - c->devices), job);
}

/* --- admission ------------------------------------------------------------------------------*/

uint64_t nvs_core_headroom(uint64_t total) {
    uint64_t part = total / ADMISSION_CHUNK_FRACTION;
    return part > ADMISSION_CHUNK_MIN ? part : ADMISSION_CHUNK_MIN;
}

/* The shell learns every change of the admitted total: blocked allocations may go on. */
static void set_admitted(struct nvs_core *c, struct nvs_core_device *d, uint64_t total) {
    if (d->admitted == total) return;
    d->admitted = total;
    push(c, NVS_ACT_ADMISSION, (int)(d - c->devices), 1);
}

/* No scheduler answers ADMIT any more (connection or registration lost, exit): nothing waits,
 * and the question in flight is void. A new registration starts admission again. */
static void end_admission(struct nvs_core *c) {
    for (int i = 0; i < c->n_devices; i++) {
        struct nvs_core_device *d = &c->devices[i];
        d->admit_asked = 0;
        set_admitted(c, d, NVS_CORE_UNADMITTED);
    }
}

static void handle_admission_answer(struct nvs_core *c, struct nvs_core_device *d, const struct nvs_msg *m) {
    if (d->admit_asked == 0 || m->request != d->admit_request) {
        core_log(c, LOG_DEBUG, "stale admission answer %llu ignored", (unsigned long long)m->request);
        return;
    }
    d->admit_asked = 0;
    if (m->type == NVS_MSG_ADMITTED) {
        core_log(c, LOG_DEBUG, "%s: admitted %llu bytes", d->uuid, (unsigned long long)m->bytes);
        set_admitted(c, d, m->bytes);
        return;
    }
    core_log(c, LOG_ERROR,
             "the scheduler refused %llu bytes on %s (%s): the waiting allocation fails with "
             "CUDA_ERROR_OUT_OF_MEMORY",
             (unsigned long long)d->admit_wanted, d->uuid, m->reason_text);
    d->admit_wanted = 0; /* the shell fails its waiters; asking again is theirs to decide */
    push(c, NVS_ACT_ADMISSION, (int)(d - c->devices), 0);
}

/* Ask for what blocked allocations wait for, and note since when the admitted total has been a
 * surplus (more than a chunk above the use, nobody waiting): the give-back timer (give_back_due)
 * hands it back once that has lasted GIVE_BACK_AFTER_S. */
static void run_admission(struct nvs_core *c, struct nvs_core_device *d, double now) {
    int device = (int)(d - c->devices);
    int surplus = d->admit_wanted == 0 && d->admitted != NVS_CORE_UNADMITTED &&
                  d->admitted > d->bytes + nvs_core_headroom(d->bytes);
    if (!surplus) {
        d->surplus = 0;
    } else if (!d->surplus) {
        d->surplus = 1;
        d->surplus_since = now;
    }
    if (d->admit_asked != 0 || d->admitted == NVS_CORE_UNADMITTED) return;
    if (d->admit_wanted > d->admitted) {
        d->admit_asked = d->admit_wanted;
        d->admit_request = ++c->admit_numbers;
        struct nvs_core_queued *q = push(c, NVS_ACT_SEND, device, 0);
        if (q == NULL) return;
        q->message = NVS_MSG_ADMIT;
        q->number = d->admit_wanted;
        q->request = d->admit_request;
        note_sent(c, now);
    }
}

/* --- small rules ------------------------------------------------------------------------------*/

/* The idle window of a device as the process (or the scheduler's default) sets it. 0: never. */
static long base_idle_window_ms(const struct nvs_core *c) {
    return c->config.idle_release_ms >= 0 ? c->config.idle_release_ms : c->scheduler_idle_ms;
}

/* The idle window in force. While others wait, what the scheduler says (CONTENDED idle_ms=):
 * - more than the window: what the handoff would cost this holder; releasing for a shorter pause
 *   would swap its memory out and back for less time than the swapping takes. Unless its last
 *   pause lasted at least that long: a program's pauses repeat (a training step's CPU phase), so
 *   waiting out the cost again would only waste that much of each. Waiting for the cost when the
 *   last pause was shorter, or none was seen, is the ski-rental rule: a release it lets happen
 *   wastes at most as much idle time as it costs.
 * - less: the handoff moves nothing of this holder's; its pause is worth nothing to it, and
 *   another tenant is waiting (issue 29: one asked every second would keep the lock from the
 *   others for a quantum).
 * 0: the window as it is. A window of 0 (never release early) stays 0. */
static long idle_window_ms(const struct nvs_core *c, const struct nvs_core_device *d) {
    long window = base_idle_window_ms(c);
    uint64_t told = d->contended_idle_ms;
    if (window > 0 && told > (uint64_t)window && d->last_pause * 1000.0 < (double)told)
        window = (long)told;
    else if (window > 0 && told > 0 && told < (uint64_t)window)
        window = (long)told;
    return window;
}

/* A pause of the application ended `now` (it submitted work): what idle_window_ms learns from
 * it. Only pauses that reached the base window count (shorter ones never release anything). */
static void note_pause(const struct nvs_core *c, struct nvs_core_device *d, double since, double now) {
    long base = base_idle_window_ms(c);
    if (base > 0 && now - since >= base / 1000.0) d->last_pause = now - since;
}

/* How long apart an idle holder is looked at. */
static double idle_check_period(long window_ms) {
    double quarter = window_ms / 4000.0;
    return quarter < IDLE_CHECK_PERIOD_MAX_S ? quarter : IDLE_CHECK_PERIOD_MAX_S;
}

/* An idle check may run: a holder whose grant is known, no job out, no capture (a capture's
 * process is not idle, and the probe's synchronise would invalidate it). */
static int idle_check_possible(const struct nvs_core *c, const struct nvs_core_device *d) {
    return d->state == NVS_HOLDING && d->grant_known && d->job == NVS_JOB_NONE && !d->drain_wanted &&
           !d->grant_swap_due && d->captures == 0 && idle_window_ms(c, d) > 0;
}

static void reset_idle_tracking(struct nvs_core *c, struct nvs_core_device *d, double now) {
    d->idle_entered = d->entered;
    d->idle_bytes = d->bytes;
    d->idle_since = now;
    long window = idle_window_ms(c, d);
    d->idle_next_check = now + (window > 0 ? idle_check_period(window) : 1.0);
}

static int grant_matches(const struct nvs_core_device *d, uint64_t grant) {
    /* After a reconnection the client does not know the new daemon's grant id of a lock it
     * claimed: the first message naming one tells it. */
    return !d->grant_known || d->grant == grant;
}

/* How long before the quantum's end a contended device's drain should start (see
 * PREDRAIN_LEAD_FACTOR); with no drain seen yet, the minimum. When CONTENDED said the release
 * will move memory out, at least the time that move takes at the measured bandwidth. */
static double predrain_lead(const struct nvs_core *c, const struct nvs_core_device *d) {
    double longest = 0;
    for (int i = 0; i < d->drains_known; i++)
        if (d->drain_seconds[i] > longest) longest = d->drain_seconds[i];
    double lead = longest * PREDRAIN_LEAD_FACTOR;
    double bps = c->swap.out_bps > 0 ? (double)c->swap.out_bps : SWAP_OUT_BPS_UNMEASURED;
    double swap = PREDRAIN_LEAD_MIN_S + SWAP_LEAD_FACTOR * (double)d->contended_evict / bps;
    if (lead < swap) lead = swap;
    if (lead < PREDRAIN_LEAD_MIN_S) lead = PREDRAIN_LEAD_MIN_S;
    double half_quantum = d->quantum_ms / 2000.0; /* a process never gives more of it to its queue */
    return lead < half_quantum ? lead : half_quantum;
}

/* The drain that began at drain_started ends with this RELEASE: remember how long it took. */
static void note_drain(struct nvs_core_device *d, double now) {
    if (d->drain_started <= 0) return;
    d->drain_seconds[d->drain_next] = now - d->drain_started;
    d->drain_next = (d->drain_next + 1) % NVS_DRAIN_HISTORY;
    if (d->drains_known < NVS_DRAIN_HISTORY) d->drains_known++;
    d->drain_started = 0;
}

/* Start the drain unless the worker is busy with the device (its result decides) or a stream
 * capture runs on it: a context synchronise from another thread invalidates a capture
 * (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED), so the drain waits for the capture's end. */
static void request_drain(struct nvs_core *c, struct nvs_core_device *d) {
    /* (a gang's fence first: this member may have collectives to launch before it may stop) */
    if (d->job != NVS_JOB_NONE || d->captures > 0 || d->fence != NVS_FENCE_NONE) {
        d->drain_wanted = 1;
        return;
    }
    d->drain_wanted = 0;
    start_job(c, d, NVS_JOB_DRAIN);
}

/* DROP, REVOKE, a due pre-drain or a lost registration: stop submitting, drain, then RELEASE.
 * A second cause joins the running drain (a REVOKE changes the reason it gives). */
static void begin_release(struct nvs_core *c, struct nvs_core_device *d, const char *reason, double now) {
    set_gate(d, c, 0);
    if (!d->release_due) d->drain_started = now;
    d->release_due = 1;
    d->release_reason = reason;
    d->predrain_at = 0;
    d->grant_swap_due = 0; /* a prefetch for a grant that ends is wasted: the drain follows it */
    d->prefetch_due = 0;
    if (d->state == NVS_HOLDING) d->state = NVS_DRAINING;
    if (strcmp(reason, "revoke") == 0) d->fence = NVS_FENCE_NONE; /* the grant is gone: drain now */
    if (d->job == NVS_JOB_DRAIN || d->drain_wanted || d->release_drained) return; /* already on its way */
    request_drain(c, d);
}

/* --- gangs' fence (docs/interceptor.md, "Gangs") ---------------------------------------------
 * A DROP with fence=1 reaches every member of a gang's turn at once, wherever each is in its
 * step. Closing each gate there would leave a member whose last collective waits for a partner
 * that stopped before launching its own: that drain never ends. So each member stops launching
 * collectives (the shell's limit 0), says how many it launched (FENCED), and the scheduler tells
 * all of them the most any launched (FENCE); a member behind opens its gate until it has launched
 * as many, then every member drains, each after the same collective. */

static void set_collective_limit(struct nvs_core *c, struct nvs_core_device *d, uint64_t limit) {
    struct nvs_core_queued *q = push(c, NVS_ACT_COLLECTIVES, (int)(d - c->devices), 0);
    if (q != NULL) q->action.bytes = limit;
    d->limited = limit != NVS_CORE_NO_LIMIT;
}

/* DROP fence=1 to a holder whose shell counts collectives: none may be launched any more, and
 * the drain waits for the gang's FENCE. */
static void begin_fence(struct nvs_core *c, struct nvs_core_device *d) {
    d->fence = NVS_FENCE_FREEZING;
    set_collective_limit(c, d, 0);
}

/* A new grant: whatever fence there was is over, and collectives go again. */
static void lift_fence(struct nvs_core *c, struct nvs_core_device *d) {
    d->fence = NVS_FENCE_NONE;
    if (d->limited) set_collective_limit(c, d, NVS_CORE_NO_LIMIT);
}

/* The shell's last limit holds, with `launched` collectives launched: a freezing member stopped
 * there, and tells the gang (FENCED). */
static void collectives_limited(struct nvs_core *c, struct nvs_core_device *d, uint64_t launched, double now) {
    d->collectives = launched;
    if (d->fence == NVS_FENCE_FREEZING) { /* none launched any more: where this member stopped */
        d->fence = NVS_FENCE_WAITING;
        struct nvs_core_queued *q = send_message(c, NVS_MSG_FENCED, (int)(d - c->devices), d->grant, NULL, now);
        if (q != NULL) q->collectives = launched;
        core_log(c, LOG_DEBUG, "%s: stopped after collective %llu; waiting for the gang's FENCE", d->uuid,
                 (unsigned long long)launched);
    }
}

/* This member launched what the gang stops after: the fence is over and the gate closed; the
 * DROP's drain may begin (1: the lock rules request it). */
static int fence_passed(struct nvs_core *c, struct nvs_core_device *d) {
    d->fence = NVS_FENCE_NONE;
    if (d->gate_open) set_gate(d, c, 0);
    return 1;
}

/* The gang's FENCE to a member waiting at the fence: 1 when it has launched as many collectives
 * as the gang stops after (fence_passed); otherwise its gate opens until it has (fence_reached). */
static int fence_answered(struct nvs_core *c, struct nvs_core_device *d, uint64_t collectives) {
    if (d->collectives >= collectives) return fence_passed(c, d);
    core_log(c, LOG_DEBUG, "%s: the gang stops after collective %llu; this process launched %llu: running on",
             d->uuid, (unsigned long long)collectives, (unsigned long long)d->collectives);
    d->fence = NVS_FENCE_RUNNING;
    d->fence_target = collectives;
    set_collective_limit(c, d, collectives);
    set_gate(d, c, 1);
    return 0;
}

/* A member running on to the gang's collective: 1 once it has launched it (fence_passed). */
static int fence_reached(struct nvs_core *c, struct nvs_core_device *d) {
    return d->fence == NVS_FENCE_RUNNING && d->collectives >= d->fence_target && fence_passed(c, d);
}

static void schedule_reconnect(struct nvs_core *c, double now) {
    if (c->outage_since == 0) c->outage_since = now;
    if (now - c->outage_since < FAST_RETRY_PERIOD_S)
        c->backoff_s = 0.1;
    else
        c->backoff_s = c->backoff_s * 2 > 1.0 ? 1.0 : c->backoff_s * 2;
    c->next_attempt = now + c->backoff_s;
}

static void forget_connection(struct nvs_core *c, const char *why, double now) {
    if (c->registered) {
        core_log(c, LOG_WARN,
                 "lost the scheduler at %s (%s); reconnecting. Processes holding a GPU lock keep running, the "
                 "others wait (NVSHARE_FAIL_MODE=%s)",
                 c->config.socket_path, why, c->config.fail_open ? "open" : "closed");
        c->lost_warned = 1; /* the reconnection is said too */
    }
    c->connected = 0;
    c->registered = 0;
    c->lease_until = 0;
    c->ping_sent = 0;
    end_admission(c);
    schedule_reconnect(c, now);
    for (int i = 0; i < c->n_devices; i++) {
        struct nvs_core_device *d = &c->devices[i];
        d->announced = 0;
        d->grant_known = 0; /* grant ids are per connection: a new one names them again */
        d->predrain_at = 0; /* so is contention: the scheduler tells a re-registered holder again */
        d->evicted_due = 0; /* and EVICT: the new connection's scheduler did not ask */
        d->evict_asked = 0;
        d->prefetch_ahead = 0; /* and PREFETCH */
        if (d->state == NVS_WAITING) d->state = NVS_IDLE; /* asked again after re-registration */
    }
}

static void send_hello(struct nvs_core *c, double now) {
    uint64_t held = 0, wanted = 0;
    for (int i = 0; i < c->n_devices; i++) {
        struct nvs_core_device *d = &c->devices[i];
        if (!d->known) continue;
        /* A draining device is still ours until its RELEASE: a restarted daemon must not grant
         * it to anyone before the drain ends (it names the grant; the RELEASE follows the drain).
         * A grant that died with a lost registration is not claimed: it may be someone else's. */
        if (d->state == NVS_HOLDING || d->state == NVS_UNSCHEDULED ||
            (d->state == NVS_DRAINING && !d->release_unanswerable))
            held |= 1ULL << i;
        else if (c->was_registered && (d->state == NVS_WAITING || (d->state == NVS_IDLE && d->waiters > 0)))
            wanted |= 1ULL << i; /* keeps its place in the queue of the same daemon; a first
                                  * registration asks with DEVICE, MEMORY, ACQUIRE */
    }
    /* The new registration's limits follow this HELLO; until its WELCOME the last ones hold. */
    c->limit_every = 0;
    c->n_limits = 0;
    struct nvs_core_queued *q = push(c, NVS_ACT_SEND, -1, 0);
    if (q == NULL) return;
    q->message = NVS_MSG_HELLO;
    q->held = held;
    q->wanted = wanted;
    c->last_sent = now;
    c->ping_sent = 0;
}

/* The scheduler dropped this client while the connection stayed up (lose_registration): what it
 * knew of this registration is gone, apart from the grants (the lock rules' to void). */
static void forget_registration(struct nvs_core *c, double now) {
    core_log(c, LOG_WARN,
             "the scheduler dropped this process's registration (silent past its heartbeat timeout); "
             "registering again, GPU work waits for the lock");
    c->registered = 0;
    c->lease_until = 0;
    c->ping_sent = 0;
    end_admission(c);
    c->connected_at = now; /* the WELCOME timeout counts from the new HELLO */
    for (int i = 0; i < c->n_devices; i++) {
        struct nvs_core_device *d = &c->devices[i];
        d->announced = 0; /* the scheduler forgot its DEVICE and MEMORY reports too */
        d->evicted_due = 0; /* and the EVICT it asked */
        d->evict_asked = 0;
    }
}

/* The registration died with its grants: the scheduler forgot this process, or may have (it was
 * silent past its lease). Each lock it held may be someone else's by now: close the gates and
 * drain what already passed them (nothing to release: the scheduler forgot those grants). */
static void void_grants(struct nvs_core *c, double now) {
    for (int i = 0; i < c->n_devices; i++) {
        struct nvs_core_device *d = &c->devices[i];
        if (d->state == NVS_HOLDING || d->state == NVS_DRAINING) {
            d->grant_known = 0;
            d->release_unanswerable = 1;
            begin_release(c, d, "revoke", now);
        }
    }
}

/* The scheduler answered `not-registered` although it had welcomed us: it dropped this client
 * while the connection stayed up (silent past its heartbeat timeout: the process was stopped,
 * or starved). Every grant is void; register again, asking for the devices waited for. */
static void lose_registration(struct nvs_core *c, double now) {
    forget_registration(c, now);
    void_grants(c, now);
    send_hello(c, now);
}

/* --- events ---------------------------------------------------------------------------------*/

size_t nvs_core_size(void) { return sizeof(struct nvs_core); }

void nvs_core_init(struct nvs_core *c, const struct nvs_core_config *config) {
    memset(c, 0, sizeof *c);
    for (int i = 0; i < NVS_CORE_MAX_DEVICES; i++) c->devices[i].admitted = NVS_CORE_UNADMITTED;
    c->config = *config;
    c->heartbeat_ms = DEFAULT_HEARTBEAT_MS;
    c->scheduler_idle_ms = DEFAULT_IDLE_RELEASE_MS;
}

void nvs_core_forked(struct nvs_core *c, long pid, const char *session) {
    struct nvs_core_config config = c->config;
    config.pid = pid;
    snprintf(config.session, sizeof config.session, "%s", session);
    struct nvs_core_device identity[NVS_CORE_MAX_DEVICES];
    int n = c->n_devices;
    memcpy(identity, c->devices, sizeof identity);
    nvs_core_init(c, &config);
    c->n_devices = n;
    for (int i = 0; i < n; i++) {
        struct nvs_core_device *d = &c->devices[i];
        d->known = identity[i].known;
        memcpy(d->uuid, identity[i].uuid, sizeof d->uuid);
        memcpy(d->name, identity[i].name, sizeof d->name);
        d->total = identity[i].total;
    }
}

static void apply_limit(struct nvs_core *c, struct nvs_core_device *d);

static int valid_device(const struct nvs_core *c, int device) {
    return device >= 0 && device < NVS_CORE_MAX_DEVICES && c->devices[device].known;
}

int nvs_core_add_device(struct nvs_core *c, int device, const char *uuid, const char *name, uint64_t total) {
    if (device < 0 || device >= NVS_CORE_MAX_DEVICES || uuid == NULL || strlen(uuid) > NVS_DEVICE_ID_MAX) return -1;
    struct nvs_core_device *d = &c->devices[device];
    if (d->known) {
        if (strcmp(d->uuid, uuid) != 0) return -1;
        /* A program that names its device's size later (nvshare_py.client's announce): DEVICE again. */
        if (name != NULL && (total != d->total || strcmp(name, d->name) != 0)) {
            snprintf(d->name, sizeof d->name, "%s", name);
            d->total = total;
            d->announced = 0;
        }
        return 0;
    }
    snprintf(d->uuid, sizeof d->uuid, "%s", uuid);
    snprintf(d->name, sizeof d->name, "%s", name ? name : "");
    d->total = total;
    d->known = 1;
    if (device >= c->n_devices) c->n_devices = device + 1;
    if (c->registered) apply_limit(c, d);
    return 0;
}

void nvs_core_use_device(struct nvs_core *c, int device) {
    if (valid_device(c, device)) c->devices[device].used = 1;
}

void nvs_core_observe(struct nvs_core *c, int device, int waiters, int captures, uint64_t entered, uint64_t bytes) {
    if (!valid_device(c, device)) return;
    struct nvs_core_device *d = &c->devices[device];
    d->waiters = waiters;
    d->captures = captures;
    d->entered = entered;
    d->bytes = bytes;
}

void nvs_core_observe_admission(struct nvs_core *c, int device, uint64_t wanted) {
    if (valid_device(c, device)) c->devices[device].admit_wanted = wanted;
}

void nvs_core_observe_collectives(struct nvs_core *c, int device, uint64_t launched) {
    if (valid_device(c, device)) c->devices[device].collectives = launched;
}

void nvs_core_observe_residency(struct nvs_core *c, int device, uint64_t converted, uint64_t swapped) {
    if (!valid_device(c, device)) return;
    c->devices[device].converted = converted;
    c->devices[device].swapped = swapped;
}

void nvs_core_observe_swap(struct nvs_core *c, const struct nvs_core_swap *swap) { c->swap = *swap; }

static void run_due(struct nvs_core *c, double now);
static void continue_grant(struct nvs_core *c, struct nvs_core_device *d, double now);
static void handle_evict(struct nvs_core *c, struct nvs_core_device *d, uint64_t bytes, double now);
static void swap_job_done(struct nvs_core *c, struct nvs_core_device *d, enum nvs_job job, enum nvs_job_result result,
                          double now);
static void start_swap_out(struct nvs_core *c, struct nvs_core_device *d);
static void finish_release(struct nvs_core *c, struct nvs_core_device *d, double now);
static void handle_prefetch_ahead(struct nvs_core *c, struct nvs_core_device *d, uint64_t resident);
static void handle_prepare(struct nvs_core *c, struct nvs_core_device *d, uint64_t bytes);
static void handle_pool(struct nvs_core *c, uint64_t bytes);
static void start_prefetch_ahead(struct nvs_core *c, struct nvs_core_device *d);

void nvs_core_collectives_limited(struct nvs_core *c, int device, uint64_t launched, double now) {
    if (!valid_device(c, device)) return;
    collectives_limited(c, &c->devices[device], launched, now);
    run_due(c, now);
}

void nvs_core_connected(struct nvs_core *c, double now) {
    c->connecting = 0;
    c->connected = 1;
    c->registered = 0;
    c->connected_at = now;
    send_hello(c, now);
    run_due(c, now);
}

void nvs_core_connect_failed(struct nvs_core *c, int err, int path_too_long, double now) {
    c->connecting = 0;
    c->refusal[0] = '\0'; /* nobody answers now: the waiters' warning says that, not an old refusal */
    core_log(c, LOG_DEBUG, "cannot connect to %s: %s", c->config.socket_path, strerror(err));
    if (path_too_long && c->outage_since == 0)
        core_log(c, LOG_ERROR, "the scheduler socket path %s is too long for a Unix socket", c->config.socket_path);
    schedule_reconnect(c, now);
    run_due(c, now);
}

void nvs_core_disconnected(struct nvs_core *c, const char *why, double now) {
    c->connecting = 0;
    if (c->connected && c->registered && c->lease_until > 0 && now >= c->lease_until) {
        /* Silent past the lease before the connection went: the scheduler may have dropped
         * this process and granted its locks to others. Holders keep running through an outage
         * only while they were known to be registered. */
        core_log(c, LOG_WARN, "lost the scheduler after a silence: GPU work waits for the lock again");
        void_grants(c, now);
    }
    if (c->connected) forget_connection(c, why, now);
    run_due(c, now);
}

/* The shell applies the scheduler's limit below the process's own (limits.c). */
static void set_scheduler_limit(struct nvs_core *c, struct nvs_core_device *d, uint64_t bytes) {
    if (d->scheduler_limit == bytes) return;
    d->scheduler_limit = bytes;
    struct nvs_core_queued *q = push(c, NVS_ACT_LIMIT, (int)(d - c->devices), 0);
    if (q != NULL) q->action.bytes = bytes;
}

/* The device's limit as this registration was told: its own, else the one for every device. */
static void apply_limit(struct nvs_core *c, struct nvs_core_device *d) {
    uint64_t bytes = c->limit_every;
    for (int i = 0; i < c->n_limits; i++)
        if (strcmp(c->limits[i].device, d->uuid) == 0) bytes = c->limits[i].bytes;
    set_scheduler_limit(c, d, bytes);
}

static void apply_limits(struct nvs_core *c) {
    for (int i = 0; i < c->n_devices; i++)
        if (c->devices[i].known) apply_limit(c, &c->devices[i]);
}

/* LIMIT: kept by device id (a device this process has not used yet gets it when it does), and
 * applied at once when registered, else with the WELCOME it precedes. */
static void handle_limit(struct nvs_core *c, const struct nvs_msg *m) {
    if (m->device[0] == '\0') {
        c->limit_every = m->bytes;
    } else {
        int i = 0;
        while (i < c->n_limits && strcmp(c->limits[i].device, m->device) != 0) i++;
        if (i == NVS_CORE_MAX_DEVICES) {
            if (!c->limits_overflow_warned)
                core_log(c, LOG_WARN, "the scheduler set limits on more than %d devices: the one for %s is not kept",
                         NVS_CORE_MAX_DEVICES, m->device);
            c->limits_overflow_warned = 1;
            return;
        }
        if (i == c->n_limits) {
            snprintf(c->limits[i].device, sizeof c->limits[i].device, "%s", m->device);
            c->n_limits++;
        }
        c->limits[i].bytes = m->bytes;
    }
    if (c->registered) apply_limits(c);
}

/* Memory calls on a device wait (admission.c) until its limits are known: those of this
 * registration, or none when no scheduler answers for now (then they go on as without one). */
static void settle_devices(struct nvs_core *c) {
    int unreachable = !c->registered && c->outage_since != 0;
    if (!c->registered && !unreachable) return;
    for (int i = 0; i < c->n_devices; i++) {
        struct nvs_core_device *d = &c->devices[i];
        if (!d->known || d->settled) continue;
        if (unreachable && !c->unscheduled_memory_warned) {
            core_log(c, LOG_WARN, "%s at %s: allocations go on without its memory limits and admission "
                     "until it is reachable", c->refusal[0] ? "no place at the scheduler" : "no scheduler",
                     c->config.socket_path);
            c->unscheduled_memory_warned = 1;
        }
        d->settled = 1;
        push(c, NVS_ACT_SETTLED, i, 1);
    }
}

/* A registration's admission starts from what is allocated (the scheduler counts the reported use
 * anyway); what comes next is asked for. */
static void start_admission(struct nvs_core *c, struct nvs_core_device *d) {
    d->admit_asked = 0;
    set_admitted(c, d, c->admission ? d->bytes : NVS_CORE_UNADMITTED);
}

/* WELCOME: registered. The lease counts from the HELLO; the scheduler's heartbeat interval, idle
 * window and admission hold from now on, and the limits that came before the WELCOME apply. */
static void note_registration(struct nvs_core *c, const struct nvs_msg *m, double now) {
    /* After a warning that the scheduler was missing, say that it is here: "again" only if this
     * process had been registered before (not when it started before the scheduler). */
    if (c->lost_warned || c->fail_open_warned || c->refused_warned)
        core_log(c, LOG_WARN, "connected to the scheduler at %s%s", c->config.socket_path,
                 c->was_registered ? " again" : "");
    c->registered = 1;
    c->was_registered = 1;
    c->heartbeat_ms = m->heartbeat_ms > 0 ? (long)m->heartbeat_ms : DEFAULT_HEARTBEAT_MS;
    c->lease_until = c->connected_at + lease_seconds(c); /* counted from the HELLO */
    c->ping_sent = 0;
    c->scheduler_idle_ms = (long)m->idle_release_ms;
    snprintf(c->client_id, sizeof c->client_id, "%s", m->client);
    core_log(c, LOG_INFO, "registered with the scheduler as %s", c->client_id);
    c->outage_since = 0;
    c->lost_warned = 0;
    c->fail_open_warned = 0;
    c->refused_warned = 0;
    c->refusal[0] = '\0';
    c->admission = m->admission;
    for (int i = 0; i < c->n_devices; i++) {
        start_admission(c, &c->devices[i]);
        /* The limits of this registration came before its WELCOME (none: a restarted scheduler
         * knows none of the last one's). */
        apply_limit(c, &c->devices[i]);
    }
}

/* WELCOME (note_registration: what the registration starts). A lock claimed in HELLO (held=)
 * keeps its gate open until the scheduler decides, under a grant id it has yet to name. */
static void handle_welcome(struct nvs_core *c, const struct nvs_msg *m, double now) {
    note_registration(c, m, now);
    for (int i = 0; i < c->n_devices; i++) {
        struct nvs_core_device *d = &c->devices[i];
        if (d->state == NVS_UNSCHEDULED || d->state == NVS_HOLDING) {
            d->state = NVS_HOLDING;
            d->grant_known = 0;
            reset_idle_tracking(c, d, now);
        }
    }
}

/* A gang member, or a process holding several devices (a gang of one): its devices must stop
 * together. A pre-drain starts each device's drain at its own lead (its own drain history), so
 * one device would close its gate while work on another still runs, and a collective launched
 * on that other one would spin for a partner that cannot launch. They drain at the DROP, which
 * the scheduler sends to all of them at once (docs/interceptor.md, "Gangs"). */
static int drains_with_others(const struct nvs_core *c) {
    if (c->config.gang[0] != '\0') return 1;
    int held = 0;
    for (int i = 0; i < c->n_devices; i++) held += c->devices[i].state == NVS_HOLDING || c->devices[i].state == NVS_DRAINING;
    return held > 1;
}

/* A GRANT for a device whose grant ended while it drains: the scheduler revoked it (the GRANT
 * has a new id), or it died with a lost registration (every GRANT is the new registration's:
 * a gang's grant comes without an ACQUIRE, also while that drain runs). */
static int grant_comes_back(const struct nvs_core_device *d, uint64_t grant) {
    if (!d->release_due) return 0;
    if (d->release_unanswerable) return 1;
    return d->grant_known && d->grant != grant && d->release_reason != NULL &&
           strcmp(d->release_reason, "revoke") == 0;
}

/* CONTENDED for the current grant: others wait. The idle window follows what the scheduler says
 * (idle_window_ms); unless the device drains with others, its drain starts ahead of the
 * quantum's end by the lead it needs (predrain_lead), and the pre-drain names the grant it will
 * release. */
static void handle_contended(struct nvs_core *c, struct nvs_core_device *d, const struct nvs_msg *m, double now) {
    d->contended_evict = m->evict;
    d->contended_idle_ms = m->idle_ms;
    if (!c->config.predrain) {
        core_log(c, LOG_DEBUG, "others wait for %s; no pre-drain (NVSHARE_PREDRAIN=0)", d->uuid);
    } else if (drains_with_others(c)) {
        core_log(c, LOG_DEBUG, "others wait for %s; no pre-drain (a gang's devices drain together at its DROP)",
                 d->uuid);
    } else {
        d->grant = m->grant;
        d->grant_known = 1;
        double left = m->quantum_left_ms / 1000.0, lead = predrain_lead(c, d);
        d->predrain_at = now + (left > lead ? left - lead : 0); /* due now at the latest */
        core_log(c, LOG_DEBUG, "others wait for %s: draining in %.3f s, %.3f s before the quantum ends", d->uuid,
                 d->predrain_at - now, lead);
    }
}

static void handle_device_message(struct nvs_core *c, struct nvs_core_device *d, const struct nvs_msg *m, double now) {
    switch (m->type) {
    case NVS_MSG_GRANT:
        if (d->state == NVS_DRAINING && grant_comes_back(d, m->grant)) {
            /* A revoked grant's device, granted again before its drain ended: a gang's next
             * turn. The revoked work may wait for that very turn (a collective whose partners
             * run in it), so the drain could never end first. The revoked grant is answered
             * now (the scheduler gave it away already: its RELEASE only closes its books) and
             * the new one taken; its gate opens once the running drain is done (job_done). */
            core_log(c, LOG_INFO, "%s granted again (grant %llu) while its revoked grant drained", d->uuid,
                     (unsigned long long)m->grant);
            if (!d->release_unanswerable) /* a lost registration's grant has nobody to answer */
                send_message(c, NVS_MSG_RELEASE, (int)(d - c->devices), d->grant, "revoke", now);
            d->drain_wanted = 0;
            d->evict_due = 0;
            d->release_drained = 0;
        } else if (d->state == NVS_DRAINING) {
            /* A draining device claimed in HELLO: the restarted daemon names its grant. The
             * gate stays closed; the RELEASE with this id follows the drain. */
            if (!d->grant_known && !d->release_unanswerable) {
                d->grant = m->grant;
                d->grant_known = 1;
            }
            break;
        }
        d->state = NVS_HOLDING;
        lift_fence(c, d);
        d->grant = m->grant;
        d->grant_known = 1;
        d->release_due = 0;
        d->release_unanswerable = 0;
        d->quantum_ms = m->quantum_ms;
        d->predrain_at = 0; /* a CONTENDED follows when others wait */
        d->contended_evict = 0;
        d->contended_idle_ms = 0;
        d->prefetch_ahead = 0; /* the grant's prefetch brings back the rest */
        reset_idle_tracking(c, d, now);
        core_log(c, LOG_DEBUG, "granted %s (grant %llu, prefetch %llu)", d->uuid, (unsigned long long)m->grant,
                 (unsigned long long)m->prefetch);
        d->grant_swap_due = 1;
        d->prefetch_deferred = 0;
        d->prefetch_due = m->prefetch;
        continue_grant(c, d, now);
        break;
    case NVS_MSG_CONTENDED:
        if (d->state != NVS_HOLDING || !grant_matches(d, m->grant))
            core_log(c, LOG_DEBUG, "stale CONTENDED for grant %llu ignored", (unsigned long long)m->grant);
        else
            handle_contended(c, d, m, now);
        break;
    case NVS_MSG_DROP:
    case NVS_MSG_REVOKE:
        if ((d->state == NVS_HOLDING || d->state == NVS_DRAINING) && !d->release_unanswerable &&
            grant_matches(d, m->grant)) {
            d->grant = m->grant;
            d->grant_known = 1;
            if (m->type == NVS_MSG_REVOKE) {
                core_log(c, LOG_WARN, "the scheduler revoked the lock of %s (%s): its work did not drain in time",
                         d->uuid, m->reason_text);
                begin_release(c, d, "revoke", now);
            } else if (!d->release_due) {
                if (m->fence && c->config.counts_collectives && d->state == NVS_HOLDING) begin_fence(c, d);
                begin_release(c, d, "drop", now);
            }
            if (m->evict > d->evict_due) d->evict_due = m->evict; /* DROP evict= (REVOKE: 0) */
        } else if (m->type == NVS_MSG_DROP && m->evict > 0 && (d->state == NVS_IDLE || d->state == NVS_WAITING) &&
                   d->grant_known && d->grant == m->grant && d->release_reason != NULL &&
                   strcmp(d->release_reason, "idle") == 0) {
            /* The DROP crossed this grant's idle RELEASE: the shell saw the probe's result before
             * it read the DROP (client.c), so the RELEASE left without a swap-out. The room is
             * still wanted: it moves out as for an EVICT, whose answer says what stays. */
            core_log(c, LOG_DEBUG, "DROP of %s crossed its idle release (grant %llu): moving %llu bytes out",
                     d->uuid, (unsigned long long)m->grant, (unsigned long long)m->evict);
            handle_evict(c, d, m->evict, now);
        } else {
            core_log(c, LOG_DEBUG, "stale %s for grant %llu ignored", m->type == NVS_MSG_DROP ? "DROP" : "REVOKE",
                     (unsigned long long)m->grant);
        }
        break;
    case NVS_MSG_FENCE:
        if (d->fence != NVS_FENCE_WAITING || !grant_matches(d, m->grant))
            core_log(c, LOG_DEBUG, "stale FENCE for grant %llu ignored", (unsigned long long)m->grant);
        else if (fence_answered(c, d, m->collectives))
            request_drain(c, d);
        break;
    case NVS_MSG_ADMITTED:
    case NVS_MSG_REFUSED:
        handle_admission_answer(c, d, m);
        break;
    case NVS_MSG_EVICT:
        handle_evict(c, d, m->bytes, now);
        break;
    case NVS_MSG_PREPARE:
        handle_prepare(c, d, m->bytes);
        break;
    case NVS_MSG_PREFETCH:
        handle_prefetch_ahead(c, d, m->resident);
        break;
    case NVS_MSG_MODE:
        d->quantum_ms = m->quantum_ms;
        core_log(c, LOG_DEBUG, "%s: quantum %llu ms", d->uuid, (unsigned long long)m->quantum_ms);
        break;
    default:
        break;
    }
}

/* The scheduler has no place for this process now (too many processes of its user or pod are
 * connected): it closes the connection after this ERROR, and the process connects again as after
 * any loss (every second, once past the first attempts). Said once, not at every attempt, until
 * a registration succeeds; the waiters' periodic warning says why they wait. */
static void note_refused(struct nvs_core *c, const struct nvs_msg *m) {
    if (!c->refused_warned)
        core_log(c, LOG_WARN, "the scheduler at %s has no place for this process now (%s); it connects again "
                 "until it is served, and its GPU work %s meanwhile",
                 c->config.socket_path, m->detail, c->config.fail_open ? "runs unscheduled" : "waits");
    c->refused_warned = 1;
    snprintf(c->refusal, sizeof c->refusal, "%s", m->detail);
}

/* STATUS, the answer to a QUERY: after a lapsed lease's QUERY (lease_check_fire) with no
 * not-registered answer before it, the HEARTBEAT found the registration: the lease is renewed. */
static void handle_status(struct nvs_core *c, double now) {
    if (!c->registered || c->ping_sent == 0) return;
    core_log(c, LOG_INFO, "the scheduler still knows this process after %.3f s of silence; carrying on",
             now - c->ping_sent);
    c->lease_until = c->ping_sent + lease_seconds(c);
    c->ping_sent = 0;
}

/* A newer scheduler's message: ignored, and said (a warning at most once a period). */
static void note_unknown_type(struct nvs_core *c, const struct nvs_msg *m, double now) {
    int warn = now >= c->unknown_type_next_warning;
    if (warn) c->unknown_type_next_warning = now + UNKNOWN_WARNING_PERIOD_S;
    core_log(c, warn ? LOG_WARN : LOG_DEBUG, "ignored a %s message from the scheduler: this nvshare does not know the type",
             m->unknown_type);
}

/* Words a newer scheduler may send: the message is acted on all the same (a REVOKE closes the
 * gate, a DROP drains and releases, a GRANT opens the gate whatever its mode); each field is
 * warned about once. */
static void note_unknown_words(struct nvs_core *c, const struct nvs_msg *m) {
    for (unsigned bit = 0; bit < 64; bit++) {
        const char *type, *key, *word;
        if (!(m->unknown_words >> bit & 1) || nvs_msg_unknown_word(m, bit, &type, &key, &word) != 0) continue;
        int warn = !(c->unknown_words_warned >> bit & 1);
        c->unknown_words_warned |= 1ULL << bit;
        core_log(c, warn ? LOG_WARN : LOG_DEBUG, "the scheduler sent %s %s=%s, a word this nvshare does not know: acting on the %s as usual",
                 type, key, word, type);
    }
}

void nvs_core_receive(struct nvs_core *c, const char *buf, size_t len, double now) {
    struct nvs_msg m;
    if (!c->connected) return; /* left over from a connection already given up */
    int parsed = nvs_msg_parse(buf, len, &m) == 0;
    if (parsed && m.unknown_words) note_unknown_words(c, &m);
    if (!parsed) {
        core_log(c, LOG_DEBUG, "unparseable scheduler message ignored");
    } else if (m.type == NVS_MSG_UNKNOWN) {
        note_unknown_type(c, &m, now);
    } else if (m.type == NVS_MSG_WELCOME) {
        handle_welcome(c, &m, now);
    } else if (m.type == NVS_MSG_STATUS) {
        handle_status(c, now);
    } else if (m.type == NVS_MSG_ERROR && m.error_code == NVS_ERROR_CODE_TOO_MANY_CONNECTIONS) {
        note_refused(c, &m);
    } else if (m.type == NVS_MSG_ERROR) {
        if (m.error_code != NVS_ERROR_CODE_NOT_REGISTERED)
            core_log(c, LOG_WARN, "the scheduler rejected a message: %s (%s)", m.code_text, m.detail);
        else if (c->registered)
            lose_registration(c, now);
        else /* an answer to what was sent before our HELLO; WELCOME follows */
            core_log(c, LOG_DEBUG, "not-registered answer to %s ignored: registering", m.error_type);
    } else if (m.type == NVS_MSG_LIMIT) {
        handle_limit(c, &m);
    } else if (m.type == NVS_MSG_POOL) {
        handle_pool(c, m.bytes);
    } else {
        struct nvs_core_device *d = NULL;
        for (int i = 0; i < c->n_devices && d == NULL; i++)
            if (c->devices[i].known && strcmp(c->devices[i].uuid, m.device) == 0) d = &c->devices[i];
        if (d == NULL)
            core_log(c, LOG_DEBUG, "scheduler message for unknown device %s ignored", m.device);
        else
            handle_device_message(c, d, &m, now);
    }
    run_due(c, now);
}

void nvs_core_job_done(struct nvs_core *c, int device, enum nvs_job_result result, double now) {
    if (!valid_device(c, device)) return;
    struct nvs_core_device *d = &c->devices[device];
    enum nvs_job job = d->job;
    d->job = NVS_JOB_NONE;
    if (job == NVS_JOB_DRAIN && !d->release_due) {
        continue_grant(c, d, now); /* its release was called off: the grant came back (see GRANT) */
    } else if (job == NVS_JOB_SWAP_OUT && result == NVS_RESULT_MOVED && d->release_drained) {
        finish_release(c, d, now); /* the swap-out a DROP asked for is done: the RELEASE follows */
        continue_grant(c, d, now); /* a GRANT that came while it ran */
    } else if (job == NVS_JOB_SWAP_OUT || job == NVS_JOB_PREFETCH || job == NVS_JOB_PREFETCH_AHEAD) {
        swap_job_done(c, d, job, result, now);
    } else if (result == NVS_RESULT_ACTIVE || (job == NVS_JOB_PROBE && result == NVS_RESULT_DRAINED &&
                                               !d->release_due && d->admit_wanted > 0)) {
        /* (an allocation began waiting for admission while the probe ran: not idle) */
        if (d->release_due) {
            request_drain(c, d); /* an idle probe met a DROP: drain now */
        } else {
            reset_idle_tracking(c, d, now);
            if (d->state == NVS_HOLDING) set_gate(d, c, 1); /* the probe may have closed it */
        }
    } else if (result == NVS_RESULT_DEFERRED) {
        d->drain_wanted = 1; /* a capture began before the drain could synchronise */
    } else if (result == NVS_RESULT_DRAINED && d->fence != NVS_FENCE_NONE) {
        d->drain_wanted = 1; /* an idle probe's: the release waits for the gang's fence, then drains */
    } else if (result == NVS_RESULT_DRAINED) {
        d->drain_wanted = 0; /* the drain it waited for has happened */
        int answerable = c->registered && d->grant_known && !d->release_unanswerable;
        if (d->release_due && d->evict_due > 0 && answerable) {
            /* DROP evict=: the memory moves out between the drain and the RELEASE */
            d->release_drained = 1;
            start_swap_out(c, d);
        } else {
            finish_release(c, d, now);
        }
    }
    run_due(c, now);
}

/* --- swapping (docs/protocol.md "Residency", docs/interceptor.md "Swapping") -------------------
 * Kept apart from the lock rules above: they only decide when the worker moves memory, and the
 * lock rules (release after the drain, no drain or swap during a capture) hold around them. */

static uint64_t resident_of(const struct nvs_core_device *d) {
    return d->swapped < d->converted ? d->converted - d->swapped : 0;
}

/* Drain done (and its swap-out, if one was asked): the device is released. An idle probe's
 * DRAINED comes here too, with no release due. */
static void finish_release(struct nvs_core *c, struct nvs_core_device *d, double now) {
    const char *reason = d->release_due ? d->release_reason : "idle";
    d->release_reason = reason; /* a DROP that crossed an idle release is told by it (DROP) */
    int answerable = d->grant_known && !d->release_unanswerable;
    if (!d->release_due) d->idle_released_since = d->idle_since; /* its pause goes on: see note_pause */
    if (d->release_due) note_drain(d, now); /* the swap-out counts: the pre-drain must cover it */
    if (d->state == NVS_HOLDING || d->state == NVS_DRAINING) {
        d->state = NVS_IDLE;
        set_gate(d, c, 0);
        if (c->registered && answerable) {
            core_log(c, LOG_DEBUG, "releasing %s (grant %llu, %s)", d->uuid, (unsigned long long)d->grant, reason);
            struct nvs_core_queued *q = send_message(c, NVS_MSG_RELEASE, (int)(d - c->devices), d->grant, reason, now);
            if (q != NULL && d->evict_due > 0) { /* the scheduler asked for room: say what stays */
                q->has_resident = 1;
                q->resident = resident_of(d);
            }
        }
    }
    d->release_due = 0;
    d->release_unanswerable = 0;
    d->release_drained = 0;
    d->evict_due = 0;
}

/* The swap-out due now, if the worker is free and no capture runs (its prefetches and
 * synchronise are as unsafe during a capture as a drain's). The release's swap-out comes
 * first: a holder has no EVICT to answer (handle_evict). */
static void start_swap_out(struct nvs_core *c, struct nvs_core_device *d) {
    if (d->job != NVS_JOB_NONE || d->captures > 0) return; /* run_due tries again */
    uint64_t bytes = d->release_drained ? d->evict_due : d->evict_asked;
    struct nvs_core_queued *q = start_job(c, d, NVS_JOB_SWAP_OUT);
    if (q != NULL) q->action.bytes = bytes;
}

static void send_evicted(struct nvs_core *c, struct nvs_core_device *d, double now) {
    d->evicted_due = 0;
    d->evict_asked = 0;
    if (!c->registered || c->exiting) return; /* nothing after BYE */
    struct nvs_core_queued *q = send_message(c, NVS_MSG_EVICTED, (int)(d - c->devices), 0, NULL, now);
    if (q != NULL) q->resident = resident_of(d);
}

/* EVICT: room for someone else's grant. A process that does not hold the device moves the
 * bytes out now; a holder (or one draining towards a RELEASE, whose DROP says what to move)
 * cannot take memory away from its own kernels, and answers at once with what stays. */
static void handle_evict(struct nvs_core *c, struct nvs_core_device *d, uint64_t bytes, double now) {
    if ((d->state != NVS_IDLE && d->state != NVS_WAITING) || (bytes == 0 && !d->evicted_due)) {
        core_log(c, LOG_DEBUG, "EVICT of %llu bytes of %s answered at once (%s)", (unsigned long long)bytes, d->uuid,
                 bytes == 0 ? "nothing to move" : "it holds the device");
        send_evicted(c, d, now);
        return;
    }
    if (bytes > d->evict_asked) d->evict_asked = bytes; /* one move serves every EVICT not yet answered */
    d->evicted_due = 1;
    start_swap_out(c, d);
}

/* The gate of a GRANT opens once its swap work is done: a swap-out for an EVICT that still
 * runs (the memory must not move under the new holder's kernels), then the PREFETCH, which is
 * due whenever this process's memory was swapped out (it also marks all of it resident again).
 * The gate opens AFTER the prefetch, not with it: the application's streams cannot be ordered
 * after the internal one without touching each of them (non-blocking streams ignore the legacy
 * stream's implicit ordering), and kernels that run while their memory is still on its way
 * would read it from the swap area's place, which is nowhere the device can see. The grantee's
 * quantum pays for what could not come back before the grant (PREFETCH_AHEAD).
 * A capture in progress does not stop the PREFETCH: the worker's copies on a stream of its own
 * are no calls a capture forbids; memory the driver moved by prefetch faults back in, and only
 * VMM memory (whose handles must be made again) waits for the capture's end, keeping the gate
 * closed (DEFERRED). Memory that was never swapped moves nothing and the gate opens at once, as
 * before swapping existed. */
static void continue_grant(struct nvs_core *c, struct nvs_core_device *d, double now) {
    if (!d->grant_swap_due || d->job != NVS_JOB_NONE) return; /* the running job's end calls again */
    if (d->state != NVS_HOLDING) { /* the grant ended meanwhile (an idle probe released it) */
        d->grant_swap_due = 0;
        d->prefetch_due = 0;
        return;
    }
    /* An EVICT whose move a capture held back: this process holds the device now, and memory
     * must not move under its kernels, so it answers with what stays, as a holder does. */
    if (d->evicted_due) send_evicted(c, d, now);
    if (d->swapped > 0 && d->prefetch_deferred && d->captures > 0) return; /* after the capture */
    if (d->swapped > 0) {
        struct nvs_core_queued *q = start_job(c, d, NVS_JOB_PREFETCH);
        if (q != NULL) q->action.bytes = d->prefetch_due;
        return;
    }
    d->grant_swap_due = 0;
    d->prefetch_due = 0;
    d->prefetch_deferred = 0;
    reset_idle_tracking(c, d, now);
    set_gate(d, c, 1);
}

static void swap_job_done(struct nvs_core *c, struct nvs_core_device *d, enum nvs_job job, enum nvs_job_result result,
                          double now) {
    if (job == NVS_JOB_PREFETCH) {
        if (result == NVS_RESULT_DEFERRED && d->state == NVS_HOLDING && !d->release_due) {
            d->prefetch_deferred = 1; /* VMM memory waits for the capture's end; so does the gate */
            return;
        }
        d->prefetch_due = 0;
        d->grant_swap_due = 0;
        d->prefetch_deferred = 0;
        if (d->state == NVS_HOLDING && !d->release_due) {
            reset_idle_tracking(c, d, now);
            set_gate(d, c, 1);
        }
        return;
    }
    if (job == NVS_JOB_PREFETCH_AHEAD) {
        /* PREFETCHes that came while it ran (the old holder's swap-out reports its progress
         * every piece, so they come faster than a job ends) are room still to fill now; without
         * them it did what it could, and a later PREFETCH asks again. */
        if (d->prefetch_ahead > d->prefetch_ahead_started)
            start_prefetch_ahead(c, d);
        else
            d->prefetch_ahead = 0;
        return;
    }
    /* (a release's swap-out is the lock rules' to finish: nvs_core_job_done) */
    if (result != NVS_RESULT_MOVED) return; /* a capture began: run_due starts it again after it */
    if (d->evicted_due) send_evicted(c, d, now);
    continue_grant(c, d, now); /* a GRANT that came while the swap-out ran */
}

/* PREFETCH (a waiter, ahead of its grant): room others made is room this process may fill
 * while it waits, so that less of its memory is left to come back when the gate is to open.
 * Only while it does not hold the device (a grant's own PREFETCH brings everything back). */
static void start_prefetch_ahead(struct nvs_core *c, struct nvs_core_device *d) {
    uint64_t resident = resident_of(d);
    if (d->job != NVS_JOB_NONE || d->captures > 0 || d->evicted_due || d->prefetch_ahead <= resident ||
        d->swapped == 0 || (d->state != NVS_WAITING && d->state != NVS_IDLE))
        return;
    struct nvs_core_queued *q = start_job(c, d, NVS_JOB_PREFETCH_AHEAD);
    if (q != NULL) {
        q->action.bytes = d->prefetch_ahead - resident;
        d->prefetch_ahead_started = d->prefetch_ahead;
    }
}

/* PREPARE: the shell keeps a swap area of this size ready for the device (once announced). */
static void handle_prepare(struct nvs_core *c, struct nvs_core_device *d, uint64_t bytes) {
    if (!d->announced) return;
    struct nvs_core_queued *q = push(c, NVS_ACT_SWAP_AREA, (int)(d - c->devices), 0);
    if (q != NULL) q->action.bytes = bytes;
}

/* POOL: the shell sizes the swap pool (the process's: no device). */
static void handle_pool(struct nvs_core *c, uint64_t bytes) {
    struct nvs_core_queued *q = push(c, NVS_ACT_POOL, -1, 0);
    if (q != NULL) q->action.bytes = bytes;
}

static void handle_prefetch_ahead(struct nvs_core *c, struct nvs_core_device *d, uint64_t resident) {
    if (d->state != NVS_WAITING && d->state != NVS_IDLE) {
        core_log(c, LOG_DEBUG, "PREFETCH of %s ignored: it holds the device", d->uuid);
        return;
    }
    if (resident > d->prefetch_ahead) d->prefetch_ahead = resident;
    start_prefetch_ahead(c, d);
}

/* Swap work that waited for the worker or for a capture's end (run_due). */
static void run_due_swaps(struct nvs_core *c, struct nvs_core_device *d, double now) {
    if (d->job != NVS_JOB_NONE) return;
    if ((d->release_drained || d->evicted_due) && d->captures == 0)
        start_swap_out(c, d);
    else if (d->grant_swap_due)
        continue_grant(c, d, now);
    else if (d->prefetch_ahead > 0)
        start_prefetch_ahead(c, d);
}

/* A swap job is moving the device's memory: its progress is reported as it goes, so that the
 * scheduler can pipeline the next holder's swap-in behind this one's swap-out. */
static int swap_running(const struct nvs_core_device *d) {
    return d->job == NVS_JOB_SWAP_OUT || d->job == NVS_JOB_PREFETCH || d->job == NVS_JOB_PREFETCH_AHEAD;
}

/* A process takes part in residency once it has converted memory on the device (then the
 * scheduler may ask it to move some): its MEMORY reports say resident= from then on, on this
 * connection. Without converted memory (NVSHARE_MANAGED=0, or VMM only) it says nothing, and
 * the scheduler counts all of `used` as resident and never asks it to move. */
static int reports_residency(const struct nvs_core_device *d) {
    return d->converted > 0 || d->reported_resident != UINT64_MAX;
}

/* A MEMORY report is due: the allocated bytes changed, or the resident bytes did, or (for a
 * process that takes part in residency) its swap engine became known or its area changed. */
static int memory_report_due(const struct nvs_core *c, const struct nvs_core_device *d) {
    if (!d->announced) return 0;
    if (d->bytes != d->reported_bytes) return 1;
    if (!reports_residency(d)) return 0;
    return resident_of(d) != d->reported_resident ||
           (c->swap.engine != 0 && (c->swap.engine != d->reported_engine || c->swap.area != d->reported_area ||
                                    c->swap.pool != d->reported_pool));
}

static void send_memory(struct nvs_core *c, struct nvs_core_device *d, double now) {
    int with_resident = reports_residency(d);
    struct nvs_core_queued *q = send_message(c, NVS_MSG_MEMORY, (int)(d - c->devices), d->bytes, NULL, now);
    if (q != NULL && with_resident) {
        q->has_resident = 1;
        q->resident = resident_of(d);
        q->has_swap = c->swap.engine != 0;
        q->swap = c->swap;
    }
    d->reported_bytes = d->bytes;
    d->reported_resident = with_resident ? resident_of(d) : UINT64_MAX;
    d->reported_engine = with_resident ? c->swap.engine : 0;
    d->reported_area = c->swap.area;
    d->reported_pool = c->swap.pool;
}

void nvs_core_tick(struct nvs_core *c, double now) { run_due(c, now); }

static const char *const program_release_reasons[] = {"user", "quantum"};

int nvs_core_release(struct nvs_core *c, int device, const char *reason, double now) {
    const char *known = NULL;
    for (size_t i = 0; i < sizeof program_release_reasons / sizeof *program_release_reasons; i++)
        if (reason != NULL && strcmp(reason, program_release_reasons[i]) == 0) known = program_release_reasons[i];
    if (!valid_device(c, device) || known == NULL) return -1;
    struct nvs_core_device *d = &c->devices[device];
    if (d->state != NVS_HOLDING) return 0;
    begin_release(c, d, known, now);
    run_due(c, now);
    return 0;
}

void nvs_core_exit(struct nvs_core *c, double now) {
    if (c->exiting || !c->registered) return;
    /* A holder's last kernels may still run while atexit handlers do (nothing here may call
     * CUDA any more to drain them): its lock passes when the scheduler sees the process end,
     * after the driver has torn its contexts down. It goes on as before until then. */
    for (int i = 0; i < c->n_devices; i++) {
        enum nvs_lock_state state = c->devices[i].state;
        if (state == NVS_HOLDING || state == NVS_DRAINING) {
            core_log(c, LOG_DEBUG, "exiting while holding %s: no BYE, the scheduler sees the exit", c->devices[i].uuid);
            return;
        }
    }
    /* Everyone else leaves the queues at once. A GPU call made later in the exit (another
     * library's destructor) must not wait for a lock nobody will grant: it runs unscheduled. */
    c->exiting = 1;
    send_message(c, NVS_MSG_BYE, -1, 0, NULL, now);
    end_admission(c);
    push(c, NVS_ACT_SETTLED, -1, 1); /* nothing waits for a scheduler any more */
    for (int i = 0; i < c->n_devices; i++) {
        struct nvs_core_device *d = &c->devices[i];
        if (!d->known) continue;
        d->state = NVS_UNSCHEDULED;
        set_gate(d, c, 1);
    }
}

/* --- what is due: the rules that follow what was observed, then the timers -----------------
 * Level rules act on the state as it is (a drain or swap that waited, DEVICE, an ACQUIRE for a
 * new waiter, an ADMIT); they need no clock. Every rule that waits for a time is a timer in
 * the table below: when it is due (NO_DEADLINE: not pending) and what it does then.
 * nvs_core_next_deadline is the earliest `due` over the table and run_due fires each entry whose
 * `due` has come, both through timer_due, so the two cannot disagree (a deadline reported but not
 * acted on would make the shell spin; a rule acted on with no deadline reported would be late). */

#define NO_DEADLINE INFINITY
/* The shell looks again at least this often: what it observes (waiters, allocations) is read
 * when it looks, and application threads wake it only for some of it. */
#define LOOK_AGAIN_S 1.0

/* Things the process's devices need now, whatever the time (see above). */
static void run_device_rules(struct nvs_core *c, struct nvs_core_device *d, double now) {
    int i = (int)(d - c->devices);
    if (fence_reached(c, d)) request_drain(c, d); /* the gang's last collective is launched */
    /* a drain that waited for the worker or for a capture's end */
    if (d->drain_wanted && d->job == NVS_JOB_NONE && d->captures == 0) request_drain(c, d);
    run_due_swaps(c, d, now);

    if (!c->registered) {
        /* fail-open: with no scheduler, nothing is scheduled */
        if (c->config.fail_open && c->outage_since != 0 && d->state == NVS_IDLE) {
            d->state = NVS_UNSCHEDULED;
            set_gate(d, c, 1);
        }
        return;
    }
    int wants = d->state == NVS_IDLE && d->waiters > 0;
    /* Announced once used, not once resolved: PyTorch resolves every device at start-up, and
     * the scheduler counts a process as a member of each device it announced (a gang is
     * granted all of its members' devices together). Before the first MEMORY, ADMIT or ACQUIRE. */
    if (!d->used)
        d->used = d->bytes > 0 || d->entered > 0 || d->waiters > 0 || d->admit_wanted > 0 ||
                  d->state == NVS_WAITING || d->state == NVS_HOLDING || d->state == NVS_DRAINING;
    if (d->used && !d->announced) {
        d->announced = 1;
        d->reported_bytes = UINT64_MAX;
        d->reported_resident = UINT64_MAX;
        send_message(c, NVS_MSG_DEVICE, i, 0, NULL, now);
    }
    /* The scheduler needs the use before an ACQUIRE, and while memory moves (the memory-report
     * timer spaces out the other reports). */
    if (memory_report_due(c, d) && (wants || swap_running(d))) {
        c->last_memory_report = now;
        send_memory(c, d, now);
    }
    if (wants) {
        if (d->idle_released_since > 0) { /* the pause an idle release was made for ended */
            note_pause(c, d, d->idle_released_since, now);
            d->idle_released_since = 0;
        }
        d->state = NVS_WAITING;
        send_message(c, NVS_MSG_ACQUIRE, i, 0, NULL, now);
    }
    run_admission(c, d, now);
}

/* The timers. `device` is NULL for the process's own; a device timer is asked for every known
 * device. In table order: the connection first, then the devices, then the registration's
 * keep-alive (a message sent for a device counts as one), then the outage warning. */

static double reconnect_due(const struct nvs_core *c, const struct nvs_core_device *d) {
    return !c->connected && !c->connecting ? c->next_attempt : NO_DEADLINE;
}
static void reconnect_fire(struct nvs_core *c, struct nvs_core_device *d, double now) {
    c->connecting = 1;
    push(c, NVS_ACT_CONNECT, -1, 0);
}

static double welcome_timeout_due(const struct nvs_core *c, const struct nvs_core_device *d) {
    return c->connected && !c->registered ? c->connected_at + WELCOME_TIMEOUT_S : NO_DEADLINE;
}
static void welcome_timeout_fire(struct nvs_core *c, struct nvs_core_device *d, double now) {
    forget_connection(c, "no WELCOME from the scheduler", now);
    push(c, NVS_ACT_DISCONNECT, -1, 0);
}

/* others wait and the quantum is nearly over: drain now, so the handoff is on time */
static double predrain_due(const struct nvs_core *c, const struct nvs_core_device *d) {
    return d->predrain_at > 0 ? d->predrain_at : NO_DEADLINE;
}
static void predrain_fire(struct nvs_core *c, struct nvs_core_device *d, double now) {
    d->predrain_at = 0;
    if (d->state != NVS_HOLDING || !d->grant_known || !c->registered) return;
    core_log(c, LOG_DEBUG, "draining %s ahead of its quantum's end (grant %llu)", d->uuid, (unsigned long long)d->grant);
    begin_release(c, d, "quantum", now);
    /* The release makes the room its waiter needs, as a DROP evict= would ask. */
    if (d->contended_evict > d->evict_due) d->evict_due = d->contended_evict;
}

/* A changed use is reported at most every MEMORY_REPORT_PERIOD_S (over all devices). */
static double memory_report_timer_due(const struct nvs_core *c, const struct nvs_core_device *d) {
    return c->registered && memory_report_due(c, d) ? c->last_memory_report + MEMORY_REPORT_PERIOD_S : NO_DEADLINE;
}
static void memory_report_fire(struct nvs_core *c, struct nvs_core_device *d, double now) {
    c->last_memory_report = now;
    send_memory(c, d, now);
}

/* Admission more than a chunk above the use, nobody waiting, for GIVE_BACK_AFTER_S: given back
 * down to half a chunk above it, so that a use that moves by less neither asks nor gives back. */
static double give_back_due(const struct nvs_core *c, const struct nvs_core_device *d) {
    return c->registered && d->surplus && d->admit_asked == 0 && d->admitted != NVS_CORE_UNADMITTED
               ? d->surplus_since + GIVE_BACK_AFTER_S
               : NO_DEADLINE;
}
static void give_back_fire(struct nvs_core *c, struct nvs_core_device *d, double now) {
    d->surplus = 0;
    set_admitted(c, d, d->bytes + nvs_core_headroom(d->bytes) / 2);
    struct nvs_core_queued *q = push(c, NVS_ACT_SEND, (int)(d - c->devices), 0);
    if (q == NULL) return;
    q->message = NVS_MSG_ADMIT;
    q->number = d->admitted;
    q->request = 0; /* a give-back: no answer */
    note_sent(c, now);
}

/* early release of an idle holder; the worker does the GPU part (never during a capture: its
 * synchronise would invalidate it, and a capturing process is not idle) */
static double idle_check_due(const struct nvs_core *c, const struct nvs_core_device *d) {
    return c->registered && idle_check_possible(c, d) ? d->idle_next_check : NO_DEADLINE;
}
static void idle_check_fire(struct nvs_core *c, struct nvs_core_device *d, double now) {
    long window = idle_window_ms(c, d);
    /* An allocation, or one waiting for admission, is activity too: a burst that allocates as
     * it goes must not lose the lock in its middle. */
    if (d->entered != d->idle_entered || d->bytes != d->idle_bytes || d->admit_wanted > 0) {
        /* A pause seen from its start while the device stayed quiet ended: it was idle, as long
         * as the window's probes said; one cut short by work still running counts from the
         * probe that saw that work end. */
        note_pause(c, d, d->idle_since, now);
        d->idle_entered = d->entered;
        d->idle_bytes = d->bytes;
        d->idle_since = now;
    } else if (now - d->idle_since >= window / 1000.0) {
        start_job(c, d, NVS_JOB_PROBE);
    }
    d->idle_next_check = now + idle_check_period(window);
}

/* The lease lapsed (the process was stopped or starved): ask whether the scheduler still knows
 * this process. Heartbeats (below) keep it from lapsing while this thread runs. */
static double lease_check_due(const struct nvs_core *c, const struct nvs_core_device *d) {
    return c->registered && c->ping_sent == 0 ? c->lease_until : NO_DEADLINE;
}
static void lease_check_fire(struct nvs_core *c, struct nvs_core_device *d, double now) {
    core_log(c, LOG_INFO, "silent for %.3f s: checking that the scheduler still knows this process", now - c->last_sent);
    c->ping_sent = now;
    send_message(c, NVS_MSG_HEARTBEAT, -1, 0, NULL, now);
    send_message(c, NVS_MSG_QUERY, -1, 0, NULL, now);
}

/* Heartbeats at half the interval keep the lease (one interval) from lapsing. */
static double heartbeat_due(const struct nvs_core *c, const struct nvs_core_device *d) {
    return c->registered ? c->last_sent + c->heartbeat_ms / 2000.0 : NO_DEADLINE;
}
static void heartbeat_fire(struct nvs_core *c, struct nvs_core_device *d, double now) {
    send_message(c, NVS_MSG_HEARTBEAT, -1, 0, NULL, now);
}

/* An outage with fail-closed: waiters are told why they wait, every WAIT_WARNING_PERIOD_S. */
static double wait_warning_due(const struct nvs_core *c, const struct nvs_core_device *d) {
    return !c->registered && c->outage_since != 0 && !c->config.fail_open && nvs_core_any_waiters(c)
               ? c->last_wait_warning + WAIT_WARNING_PERIOD_S
               : NO_DEADLINE;
}
static void wait_warning_fire(struct nvs_core *c, struct nvs_core_device *d, double now) {
    if (c->refusal[0] != '\0')
        core_log(c, LOG_WARN,
                 "waiting for a place at the scheduler at %s (%s): GPU work is held until it serves this process "
                 "(NVSHARE_FAIL_MODE=closed; set NVSHARE_FAIL_MODE=open to run unscheduled meanwhile)",
                 c->config.socket_path, c->refusal);
    else
        core_log(c, LOG_WARN,
                 "waiting for the scheduler at %s: GPU work is held until it is reachable "
                 "(NVSHARE_FAIL_MODE=closed; set NVSHARE_FAIL_MODE=open to run unscheduled meanwhile)",
                 c->config.socket_path);
    c->last_wait_warning = now;
    c->lost_warned = 1;
}

static const struct core_timer {
    int per_device;
    double (*due)(const struct nvs_core *c, const struct nvs_core_device *d);
    void (*fire)(struct nvs_core *c, struct nvs_core_device *d, double now);
} timers[] = {
    {0, reconnect_due, reconnect_fire},
    {0, welcome_timeout_due, welcome_timeout_fire},
    {1, predrain_due, predrain_fire},
    {1, memory_report_timer_due, memory_report_fire},
    {1, give_back_due, give_back_fire},
    {1, idle_check_due, idle_check_fire},
    {0, lease_check_due, lease_check_fire},
    {0, heartbeat_due, heartbeat_fire},
    {0, wait_warning_due, wait_warning_fire},
};

#define N_TIMERS (sizeof timers / sizeof timers[0])

/* A timer's subjects: the process once (subject NULL), or each device slot. */
static int n_subjects(const struct nvs_core *c, const struct core_timer *t) { return t->per_device ? c->n_devices : 1; }

/* When the timer is due for subject k; nothing is after BYE, nothing for an unknown device. */
static double timer_due(const struct nvs_core *c, const struct core_timer *t, int k) {
    const struct nvs_core_device *d = t->per_device ? &c->devices[k] : NULL;
    return c->exiting || (d != NULL && !d->known) ? NO_DEADLINE : t->due(c, d);
}

/* The rules that follow the state, for every device and the process. */
static void run_rules(struct nvs_core *c, double now) {
    settle_devices(c);
    for (int i = 0; i < c->n_devices; i++)
        if (c->devices[i].known) run_device_rules(c, &c->devices[i], now);
    if (!c->registered && c->outage_since != 0 && c->config.fail_open && !c->fail_open_warned) {
        core_log(c, LOG_WARN, "no scheduler at %s: running unscheduled (NVSHARE_FAIL_MODE=open) until it is reachable",
                 c->config.socket_path);
        c->fail_open_warned = 1;
    }
}

/* Fire every timer due at `now`, in table order; 1 if one fired. A timer's due is asked again
 * right before it fires, after the ones before it ran (a lease check that sent a HEARTBEAT makes
 * the heartbeat not due), and a timer that fires moves its own deadline past `now`. */
static int fire_due_timers(struct nvs_core *c, double now) {
    int fired = 0;
    for (const struct core_timer *t = timers; t < timers + N_TIMERS; t++) {
        for (int k = 0; k < n_subjects(c, t); k++) {
            if (timer_due(c, t, k) > now) continue;
            t->fire(c, t->per_device ? &c->devices[k] : NULL, now);
            fired = 1;
        }
    }
    return fired;
}

/* Everything due at `now`: the rules, the timers, and the rules again for what the timers
 * changed (a WELCOME timeout's outage lets fail-open devices run and memory calls go on), so
 * that nothing waits for the next deadline. */
static void run_due(struct nvs_core *c, double now) {
    if (c->exiting) return;
    run_rules(c, now);
    if (fire_due_timers(c, now)) run_rules(c, now);
}

double nvs_core_next_deadline(const struct nvs_core *c, double now) {
    double due = now + LOOK_AGAIN_S;
    for (const struct core_timer *t = timers; t < timers + N_TIMERS; t++) {
        for (int k = 0; k < n_subjects(c, t); k++) {
            double when = timer_due(c, t, k);
            if (when < due) due = when;
        }
    }
    return due;
}

/* --- output ---------------------------------------------------------------------------------*/

static size_t encode(const struct nvs_core *c, const struct nvs_core_queued *q, char *buf, size_t cap) {
    const struct nvs_core_device *d = q->action.device >= 0 ? &c->devices[q->action.device] : NULL;
    const struct nvs_core_config *k = &c->config;
    const char *held[NVS_CORE_MAX_DEVICES], *wanted[NVS_CORE_MAX_DEVICES];
    struct nvs_out out = {
        .device = d != NULL ? d->uuid : NULL,
        .pid = k->pid < 0 ? UINT64_MAX : (uint64_t)k->pid, /* a negative pid is refused */
        .session = k->session,
        .host = k->host,
        .container = k->container,
        .pod = k->pod,
        .namespace_ = k->pod_namespace,
        .program = k->program,
        .gang = k->gang,
        .gang_size = k->gang_size,
        .held = held,
        .wanted = wanted,
        .total = d != NULL ? d->total : 0,
        .name = d != NULL ? d->name : NULL,
        .used = q->number,   /* MEMORY */
        .bytes = q->number,  /* ADMIT */
        .grant = q->number,  /* RELEASE */
        .request = q->request,
        .reason = q->reason,
        .resident = q->resident,
        .has_resident = q->has_resident,
        .collectives = q->collectives, /* FENCED */
        /* MEMORY: the swap engine's figures, from a process that swaps */
        .engine = q->has_swap ? (q->swap.engine == 2 ? "migrate" : "copy") : "",
        .area = q->swap.area,
        .has_area = q->has_swap,
        .out_bps = q->has_swap ? q->swap.out_bps : 0,
        .in_bps = q->has_swap ? q->swap.in_bps : 0,
        .pool = q->has_swap && q->swap.pool,
    };
    for (int i = 0; q->message == NVS_MSG_HELLO && i < NVS_CORE_MAX_DEVICES; i++) {
        if (q->held & (1ULL << i)) held[out.n_held++] = c->devices[i].uuid;
        if (q->wanted & (1ULL << i)) wanted[out.n_wanted++] = c->devices[i].uuid;
    }
    return nvs_msg_build(buf, cap, q->message, &out); /* it reads the fields of q->message's type */
}

int nvs_core_pop(struct nvs_core *c, struct nvs_action *out, char *buf, size_t cap, double now) {
    if (c->dropped_actions > 0) {
        /* Never expected (every event queues a bounded number of actions); say so loudly. */
        snprintf(buf, cap, "internal error: %u client actions lost; reconnecting", c->dropped_actions);
        c->dropped_actions = 0;
        *out = (struct nvs_action){.kind = NVS_ACT_LOG, .device = -1, .value = LOG_ERROR, .len = strlen(buf)};
        if (c->connected) {
            forget_connection(c, "internal error", now);
            push(c, NVS_ACT_DISCONNECT, -1, 0);
        }
        return 1;
    }
    if (c->count == 0) return 0;
    struct nvs_core_queued *q = &c->queue[c->head];
    c->head = (c->head + 1) % NVS_CORE_MAX_ACTIONS;
    c->count--;
    *out = q->action;
    out->len = 0;
    if (q->action.kind == NVS_ACT_LOG) {
        snprintf(buf, cap, "%s", c->logs[q->log]);
        out->len = strlen(buf);
    } else if (q->action.kind == NVS_ACT_SEND) {
        out->len = encode(c, q, buf, cap);
        if (out->len == 0) {
            snprintf(buf, cap, "could not encode a protocol message (a bug); dropping the connection");
            *out = (struct nvs_action){.kind = NVS_ACT_LOG, .device = -1, .value = LOG_ERROR, .len = strlen(buf)};
            if (c->connected) {
                forget_connection(c, "encoding failed", now);
                push(c, NVS_ACT_DISCONNECT, -1, 0);
            }
        }
    }
    return 1;
}

/* --- views ----------------------------------------------------------------------------------*/

enum nvs_lock_state nvs_core_state(const struct nvs_core *c, int device) {
    return valid_device(c, device) ? c->devices[device].state : NVS_IDLE;
}

int nvs_core_gate(const struct nvs_core *c, int device) {
    return valid_device(c, device) ? c->devices[device].gate_open : 0;
}

int nvs_core_registered(const struct nvs_core *c) { return c->registered; }

double nvs_core_lease_until(const struct nvs_core *c) { return c->registered ? c->lease_until : 0; }

uint64_t nvs_core_limit(const struct nvs_core *c, const char *uuid) {
    for (int i = 0; i < c->n_devices; i++)
        if (c->devices[i].known && strcmp(c->devices[i].uuid, uuid) == 0) return c->devices[i].scheduler_limit;
    uint64_t bytes = c->limit_every;
    for (int i = 0; i < c->n_limits; i++)
        if (strcmp(c->limits[i].device, uuid) == 0) bytes = c->limits[i].bytes;
    return bytes;
}

uint64_t nvs_core_admitted(const struct nvs_core *c, int device) {
    return valid_device(c, device) ? c->devices[device].admitted : NVS_CORE_UNADMITTED;
}

int nvs_core_any_waiters(const struct nvs_core *c) {
    for (int i = 0; i < c->n_devices; i++)
        if (c->devices[i].waiters > 0) return 1;
    return 0;
}
