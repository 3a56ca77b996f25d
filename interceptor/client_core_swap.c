/*
 * Swapping (docs/protocol.md "Residency", docs/interceptor.md "Swapping"): the swap area and pool
 * the scheduler sizes (PREPARE, POOL), moving memory out (EVICT, a DROP's evict=) and back (a
 * GRANT's prefetch, PREFETCH ahead of a grant), the swap jobs' results, and the MEMORY reports
 * that say what is resident. Kept apart from the lock rules (client_core.c): these only decide
 * when the worker moves memory, and the lock rules (release after the drain, no drain or swap
 * during a capture) hold around them.
 */
#include "client_core_internal.h"

#define MEMORY_REPORT_PERIOD_S 0.1

/* Of the device's converted memory, what is on the device (not swapped out). */
uint64_t resident_of(const struct nvs_core_device *d) {
    return d->swapped < d->converted ? d->converted - d->swapped : 0;
}

/* PREPARE: the shell keeps a swap area of this size ready for the device (once announced). */
void handle_prepare(struct nvs_core *c, struct nvs_core_device *d, uint64_t bytes) {
    if (!d->announced) return;
    struct nvs_core_queued *q = push(c, NVS_ACT_SWAP_AREA, (int)(d - c->devices), 0);
    if (q != NULL) q->action.bytes = bytes;
}

/* POOL: the shell sizes the swap pool (the process's: no device), and registers others'
 * segments for as much of its memory as it may be asked to move out soon (need=; a scheduler
 * that does not say: all of it). */
void handle_pool(struct nvs_core *c, const struct nvs_msg *m) {
    struct nvs_core_queued *q = push(c, NVS_ACT_POOL, -1, 0);
    if (q != NULL) q->action.bytes = m->bytes;
    q = push(c, NVS_ACT_POOL_NEED, -1, 0);
    if (q != NULL) q->action.bytes = m->has_need ? m->need : NVS_CORE_NO_LIMIT;
}

/* The swap-out due now, if the worker is free and no capture runs (its prefetches and
 * synchronise are as unsafe during a capture as a drain's). The release's swap-out comes
 * first: a holder has no EVICT to answer (handle_evict). */
void start_swap_out(struct nvs_core *c, struct nvs_core_device *d) {
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
void handle_evict(struct nvs_core *c, struct nvs_core_device *d, uint64_t bytes, double now) {
    if ((d->state != NVS_IDLE && d->state != NVS_WAITING) || (bytes == 0 && !d->evicted_due)) {
        core_log(c, LOG_DEBUG, "EVICT of %llu bytes of %s answered at once (%s)", (unsigned long long)bytes, d->uuid,
                 bytes == 0 ? "nothing to move" : "it holds the device");
        send_evicted(c, d, now);
        return;
    }
    if (bytes > d->evict_asked) d->evict_asked = bytes; /* one move serves every EVICT not yet answered */
    if (!d->evicted_due) d->bytes_at_evict = d->bytes;
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
void continue_grant(struct nvs_core *c, struct nvs_core_device *d, double now) {
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

void handle_prefetch_ahead(struct nvs_core *c, struct nvs_core_device *d, uint64_t resident, double now) {
    if (d->state != NVS_WAITING && d->state != NVS_IDLE) {
        core_log(c, LOG_DEBUG, "PREFETCH of %s ignored: it holds the device", d->uuid);
        return;
    }
    if (resident > d->prefetch_ahead) d->prefetch_ahead = resident;
    /* A PREFETCH while a move out for an EVICT runs takes the EVICT back: this process asked for
     * the device meanwhile (docs/protocol.md, EVICT). The move stops after the pieces in flight,
     * its EVICTED says what stayed, and what left before the cut comes back as this PREFETCH
     * allows, once the move is over. A move that has not begun (a capture or another job held it
     * back) never does: the EVICT is answered now. */
    if (d->evicted_due && d->job == NVS_JOB_SWAP_OUT) {
        core_log(c, LOG_DEBUG, "EVICT of %s taken back: its move out stops", d->uuid);
        push(c, NVS_ACT_SWAP_OUT_CUT, (int)(d - c->devices), 0);
    } else if (d->evicted_due && !d->release_drained) {
        core_log(c, LOG_DEBUG, "EVICT of %s taken back before its move began", d->uuid);
        send_evicted(c, d, now);
    }
    start_prefetch_ahead(c, d);
}

/* A swap job's result: the gate a PREFETCH kept closed opens, a PREFETCH_AHEAD goes on while
 * room was added, a swap-out for an EVICT is answered. */
void swap_job_done(struct nvs_core *c, struct nvs_core_device *d, enum nvs_job job, enum nvs_job_result result,
                   double now) {
    /* A move in ends with a report of it at once: the scheduler grants a waiter once its memory
     * is back, and the report timer would send the last of it up to MEMORY_REPORT_PERIOD_S later
     * (on an H200 requests to sleeping tenants waited 0.1 s for it between their memory's return
     * and their grant). A move out ends with EVICTED, which says what stays. */
    if (job != NVS_JOB_SWAP_OUT && memory_report_due(c, d)) memory_report_fire(c, d, now);
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

/* Swap work that waited for the worker or for a capture's end (run_due). */
void run_due_swaps(struct nvs_core *c, struct nvs_core_device *d, double now) {
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
int swap_running(const struct nvs_core_device *d) {
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
int memory_report_due(const struct nvs_core *c, const struct nvs_core_device *d) {
    if (!d->announced) return 0;
    if (d->bytes != d->reported_bytes) return 1;
    if (!reports_residency(d)) return 0;
    return resident_of(d) != d->reported_resident ||
           (c->swap.engine != 0 && (c->swap.engine != d->reported_engine || c->swap.area != d->reported_area ||
                                    c->swap.pool != d->reported_pool));
}

void send_memory(struct nvs_core *c, struct nvs_core_device *d, double now) {
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

/* A changed use is reported at most every MEMORY_REPORT_PERIOD_S (over all devices). */
double memory_report_timer_due(const struct nvs_core *c, const struct nvs_core_device *d) {
    return c->registered && memory_report_due(c, d) ? c->last_memory_report + MEMORY_REPORT_PERIOD_S : NO_DEADLINE;
}

void memory_report_fire(struct nvs_core *c, struct nvs_core_device *d, double now) {
    c->last_memory_report = now;
    send_memory(c, d, now);
}
