/*
 * The client core's action queue (client_core_internal.h): every file of the core asks the shell
 * for something by queueing an action here, in the order the shell is to carry them out; a log
 * record keeps its text in a slot of its own. nvs_core_pop (client_core_output.c) hands them out.
 * A message counts as sent when it is queued: that renews the lease (nvs_core_lease_until).
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "client_core_internal.h"

struct nvs_core_queued *push(struct nvs_core *c, enum nvs_action_kind kind, int device, int value) {
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

__attribute__((format(printf, 3, 4))) void core_log(struct nvs_core *c, int level, const char *fmt, ...) {
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

/* The registration's lease lasts a heartbeat interval from the last message sent. */
double lease_seconds(const struct nvs_core *c) { return c->heartbeat_ms / 1000.0; }

/* A message goes out while the lease holds: the scheduler will not forget this client for
 * another heartbeat timeout (longer than the interval) after it arrives. */
void note_sent(struct nvs_core *c, double now) {
    c->last_sent = now;
    if (c->registered && c->ping_sent == 0 && now < c->lease_until) c->lease_until = now + lease_seconds(c);
}

struct nvs_core_queued *send_message(struct nvs_core *c, enum nvs_msg_type message, int device,
                                     uint64_t number, const char *reason, double now) {
    struct nvs_core_queued *q = push(c, NVS_ACT_SEND, device, 0);
    if (q == NULL) return NULL;
    q->message = message;
    q->number = number;
    q->reason = reason;
    note_sent(c, now);
    return q;
}

void set_gate(struct nvs_core_device *d, struct nvs_core *c, int open) {
    d->gate_open = open;
    push(c, NVS_ACT_GATE, (int)(d - c->devices), open);
}

struct nvs_core_queued *start_job(struct nvs_core *c, struct nvs_core_device *d, enum nvs_job job) {
    d->job = job;
    return push(c, NVS_ACT_JOB, (int)(d - c->devices), job);
}
