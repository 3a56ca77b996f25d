/*
 * The client core's output (client_core.h, nvs_core_pop): the queued actions, oldest first, a
 * SEND's message built when it is popped (struct nvs_out for message.c's codec). Actions lost to
 * a full queue, or a message that cannot be encoded, are a bug: said in a LOG (error), and the
 * connection is dropped rather than a message silently lost.
 */
#include <stdio.h>
#include <string.h>

#include "client_core_internal.h"

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
