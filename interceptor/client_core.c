/*
 * The client's lock state machine (client_core.h): no locks, no clock, no I/O, no CUDA. The rules
 * are those of docs/protocol.md ("Client behaviour") and docs/interceptor.md ("The client"); the
 * comments say why each one is there. This file is the machine itself, to be read in one sitting:
 * the events (the entry points that act), each device's lock state and the messages that change
 * it (GRANT, DROP, REVOKE; the release after the drain), the rules that follow the state, and the
 * table of everything done at a time. What it decides with lies beside it, one concern a file
 * (client_core_internal.h lists them): registration, admission, swapping, the gang fence, the
 * handoffs' timing, the shell's observations, the action queue and its output.
 */
#include <stdio.h>
#include <string.h>

#include "client_core_internal.h"

/* The idle window until a WELCOME names the scheduler's (client_core_handoff.c). */
#define DEFAULT_IDLE_RELEASE_MS 1000

static void run_due(struct nvs_core *c, double now);

/* --- the lock rules: a release drains first -------------------------------------------------*/

static int grant_matches(const struct nvs_core_device *d, uint64_t grant) {
    /* After a reconnection the client does not know the new daemon's grant id of a lock it
     * claimed: the first message naming one tells it. */
    return !d->grant_known || d->grant == grant;
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

/* A GRANT for a device whose grant ended while it drains: the scheduler revoked it (the GRANT
 * has a new id), or it died with a lost registration (every GRANT is the new registration's:
 * a gang's grant comes without an ACQUIRE, also while that drain runs). */
static int grant_comes_back(const struct nvs_core_device *d, uint64_t grant) {
    if (!d->release_due) return 0;
    if (d->release_unanswerable) return 1;
    return d->grant_known && d->grant != grant && d->release_reason != NULL &&
           strcmp(d->release_reason, "revoke") == 0;
}

/* A scheduler message about one of this process's devices. */
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
        handle_prefetch_ahead(c, d, m->resident, now);
        break;
    case NVS_MSG_MODE:
        d->quantum_ms = m->quantum_ms;
        core_log(c, LOG_DEBUG, "%s: quantum %llu ms", d->uuid, (unsigned long long)m->quantum_ms);
        break;
    default:
        break;
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
        handle_pool(c, &m);
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
    /* An application that allocates while its memory moves out for an EVICT is back at work: a
     * request's first allocations come before its first kernel, and on an H200 its first GPU call
     * came 1.1-5.3 s after the request, its main thread held in brk and in the driver meanwhile
     * by its own process's eviction (the segments it registered on the way hold the memory map
     * and the driver). Asking then lets the scheduler take the EVICT back that much sooner. */
    int allocating_while_evicted = d->state == NVS_IDLE && d->evicted_due && d->bytes > d->bytes_at_evict;
    int wants = d->state == NVS_IDLE && (d->waiters > 0 || allocating_while_evicted);
    if (wants && d->waiters == 0)
        core_log(c, LOG_DEBUG, "the application allocates on %s while its memory moves out: asking for it now", d->uuid);
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

/* The timers, each defined with its concern (the pre-drain's here). `device` is NULL for the
 * process's own; a device timer is asked for every known device. In table order: the connection
 * first, then the devices, then the registration's keep-alive (a message sent for a device counts
 * as one), then the outage warning. */

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
