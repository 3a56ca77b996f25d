/*
 * The client core's connection and registration (docs/protocol.md, "Client behaviour"):
 * reconnection with back-off, HELLO (claiming the locks it holds) and the WELCOME timeout, what
 * a WELCOME starts, the lease and the heartbeats that keep it, and what the scheduler says of this
 * process rather than of a device (a refusal, a message or word this build does not know). A lost
 * connection forgets what was the connection's (grant ids, announcements, what was asked: an
 * ACQUIRE goes out again); what losing the scheduler means for the locks held is the lock rules'
 * (client_core.c).
 */
#include <stdio.h>
#include <string.h>

#include "client_core_internal.h"

#define WELCOME_TIMEOUT_S 5.0
#define FAST_RETRY_PERIOD_S 3.0 /* reconnect every 100 ms for this long, then back off to 1 s */
#define WAIT_WARNING_PERIOD_S 10.0
#define UNKNOWN_WARNING_PERIOD_S 60.0 /* unknown message types from the scheduler */

void schedule_reconnect(struct nvs_core *c, double now) {
    if (c->outage_since == 0) c->outage_since = now;
    if (now - c->outage_since < FAST_RETRY_PERIOD_S)
        c->backoff_s = 0.1;
    else
        c->backoff_s = c->backoff_s * 2 > 1.0 ? 1.0 : c->backoff_s * 2;
    c->next_attempt = now + c->backoff_s;
}

void forget_connection(struct nvs_core *c, const char *why, double now) {
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

void send_hello(struct nvs_core *c, double now) {
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
    struct nvs_core_queued *q = send_message(c, NVS_MSG_HELLO, -1, 0, NULL, now); /* (no lease to renew yet) */
    if (q == NULL) return;
    q->held = held;
    q->wanted = wanted;
    c->ping_sent = 0;
}

/* The scheduler dropped this client while the connection stayed up (lose_registration): what it
 * knew of this registration is gone, apart from the grants (the lock rules' to void). */
void forget_registration(struct nvs_core *c, double now) {
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

/* WELCOME: registered. The lease counts from the HELLO; the scheduler's heartbeat interval, idle
 * window and admission hold from now on, and the limits that came before the WELCOME apply. */
void note_registration(struct nvs_core *c, const struct nvs_msg *m, double now) {
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

/* STATUS, the answer to a QUERY: after a lapsed lease's QUERY (lease_check_fire) with no
 * not-registered answer before it, the HEARTBEAT found the registration: the lease is renewed. */
void handle_status(struct nvs_core *c, double now) {
    if (!c->registered || c->ping_sent == 0) return;
    core_log(c, LOG_INFO, "the scheduler still knows this process after %.3f s of silence; carrying on",
             now - c->ping_sent);
    c->lease_until = c->ping_sent + lease_seconds(c);
    c->ping_sent = 0;
}

/* The scheduler has no place for this process now (too many processes of its user or pod are
 * connected): it closes the connection after this ERROR, and the process connects again as after
 * any loss (every second, once past the first attempts). Said once, not at every attempt, until
 * a registration succeeds; the waiters' periodic warning says why they wait. */
void note_refused(struct nvs_core *c, const struct nvs_msg *m) {
    if (!c->refused_warned)
        core_log(c, LOG_WARN, "the scheduler at %s has no place for this process now (%s); it connects again "
                 "until it is served, and its GPU work %s meanwhile",
                 c->config.socket_path, m->detail, c->config.fail_open ? "runs unscheduled" : "waits");
    c->refused_warned = 1;
    snprintf(c->refusal, sizeof c->refusal, "%s", m->detail);
}

/* A newer scheduler's message: ignored, and said (a warning at most once a period). */
void note_unknown_type(struct nvs_core *c, const struct nvs_msg *m, double now) {
    int warn = now >= c->unknown_type_next_warning;
    if (warn) c->unknown_type_next_warning = now + UNKNOWN_WARNING_PERIOD_S;
    core_log(c, warn ? LOG_WARN : LOG_DEBUG, "ignored a %s message from the scheduler: this nvshare does not know the type",
             m->unknown_type);
}

/* Words a newer scheduler may send: the message is acted on all the same (a REVOKE closes the
 * gate, a DROP drains and releases, a GRANT opens the gate whatever its mode); each field is
 * warned about once. */
void note_unknown_words(struct nvs_core *c, const struct nvs_msg *m) {
    for (unsigned bit = 0; bit < 64; bit++) {
        const char *type, *key, *word;
        if (!(m->unknown_words >> bit & 1) || nvs_msg_unknown_word(m, bit, &type, &key, &word) != 0) continue;
        int warn = !(c->unknown_words_warned >> bit & 1);
        c->unknown_words_warned |= 1ULL << bit;
        core_log(c, warn ? LOG_WARN : LOG_DEBUG, "the scheduler sent %s %s=%s, a word this nvshare does not know: acting on the %s as usual",
                 type, key, word, type);
    }
}

double reconnect_due(const struct nvs_core *c, const struct nvs_core_device *d) {
    return !c->connected && !c->connecting ? c->next_attempt : NO_DEADLINE;
}

void reconnect_fire(struct nvs_core *c, struct nvs_core_device *d, double now) {
    c->connecting = 1;
    push(c, NVS_ACT_CONNECT, -1, 0);
}

double welcome_timeout_due(const struct nvs_core *c, const struct nvs_core_device *d) {
    return c->connected && !c->registered ? c->connected_at + WELCOME_TIMEOUT_S : NO_DEADLINE;
}

void welcome_timeout_fire(struct nvs_core *c, struct nvs_core_device *d, double now) {
    forget_connection(c, "no WELCOME from the scheduler", now);
    push(c, NVS_ACT_DISCONNECT, -1, 0);
}

/* The lease lapsed (the process was stopped or starved): ask whether the scheduler still knows
 * this process. Heartbeats (below) keep it from lapsing while this thread runs. */
double lease_check_due(const struct nvs_core *c, const struct nvs_core_device *d) {
    return c->registered && c->ping_sent == 0 ? c->lease_until : NO_DEADLINE;
}

void lease_check_fire(struct nvs_core *c, struct nvs_core_device *d, double now) {
    core_log(c, LOG_INFO, "silent for %.3f s: checking that the scheduler still knows this process", now - c->last_sent);
    c->ping_sent = now;
    send_message(c, NVS_MSG_HEARTBEAT, -1, 0, NULL, now);
    send_message(c, NVS_MSG_QUERY, -1, 0, NULL, now);
}

/* Heartbeats at half the interval keep the lease (one interval) from lapsing. */
double heartbeat_due(const struct nvs_core *c, const struct nvs_core_device *d) {
    return c->registered ? c->last_sent + c->heartbeat_ms / 2000.0 : NO_DEADLINE;
}

void heartbeat_fire(struct nvs_core *c, struct nvs_core_device *d, double now) {
    send_message(c, NVS_MSG_HEARTBEAT, -1, 0, NULL, now);
}

/* An outage with fail-closed: waiters are told why they wait, every WAIT_WARNING_PERIOD_S. */
double wait_warning_due(const struct nvs_core *c, const struct nvs_core_device *d) {
    return !c->registered && c->outage_since != 0 && !c->config.fail_open && nvs_core_any_waiters(c)
               ? c->last_wait_warning + WAIT_WARNING_PERIOD_S
               : NO_DEADLINE;
}

void wait_warning_fire(struct nvs_core *c, struct nvs_core_device *d, double now) {
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
