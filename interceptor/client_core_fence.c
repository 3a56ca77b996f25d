/*
 * A gang's fence (docs/interceptor.md, "Gangs"). A DROP with fence=1 reaches every member of a
 * gang's turn at once, wherever each is in its step. Closing each gate there would leave a member
 * whose last collective waits for a partner that stopped before launching its own: that drain
 * never ends. So each member stops launching collectives (the shell's limit 0), says how many it
 * launched (FENCED), and the scheduler tells all of them the most any launched (FENCE); a member
 * behind opens its gate until it has launched as many, then every member drains, each after the
 * same collective. The lock rules (client_core.c) start the drain once the fence says it may.
 */
#include "client_core_internal.h"

/* The shell lets collectives be launched on the device until `limit` have been, in all. */
static void set_collective_limit(struct nvs_core *c, struct nvs_core_device *d, uint64_t limit) {
    struct nvs_core_queued *q = push(c, NVS_ACT_COLLECTIVES, (int)(d - c->devices), 0);
    if (q != NULL) q->action.bytes = limit;
    d->limited = limit != NVS_CORE_NO_LIMIT;
}

/* DROP fence=1 to a holder whose shell counts collectives: none may be launched any more, and
 * the drain waits for the gang's FENCE. */
void begin_fence(struct nvs_core *c, struct nvs_core_device *d) {
    d->fence = NVS_FENCE_FREEZING;
    set_collective_limit(c, d, 0);
}

/* A new grant: whatever fence there was is over, and collectives go again. */
void lift_fence(struct nvs_core *c, struct nvs_core_device *d) {
    d->fence = NVS_FENCE_NONE;
    if (d->limited) set_collective_limit(c, d, NVS_CORE_NO_LIMIT);
}

/* The shell's last limit holds, with `launched` collectives launched: a freezing member stopped
 * there, and tells the gang (FENCED). */
void collectives_limited(struct nvs_core *c, struct nvs_core_device *d, uint64_t launched, double now) {
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
int fence_answered(struct nvs_core *c, struct nvs_core_device *d, uint64_t collectives) {
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
int fence_reached(struct nvs_core *c, struct nvs_core_device *d) {
    return d->fence == NVS_FENCE_RUNNING && d->collectives >= d->fence_target && fence_passed(c, d);
}
