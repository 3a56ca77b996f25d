/*
 * The memory the scheduler lets this process have (docs/interceptor.md, "Admission"): the
 * admitted total (ADMIT when blocked allocations want more, ADMITTED or REFUSED in answer, a
 * surplus given back), the memory limits it sets (LIMIT), and when a device's memory calls may
 * go on (SETTLED). The shell's side of them is admission.c and limits.c.
 */
#include <stdio.h>
#include <string.h>

#include "client_core_internal.h"

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
void end_admission(struct nvs_core *c) {
    for (int i = 0; i < c->n_devices; i++) {
        struct nvs_core_device *d = &c->devices[i];
        d->admit_asked = 0;
        set_admitted(c, d, NVS_CORE_UNADMITTED);
    }
}

/* A registration's admission starts from what is allocated (the scheduler counts the reported use
 * anyway); what comes next is asked for. */
void start_admission(struct nvs_core *c, struct nvs_core_device *d) {
    d->admit_asked = 0;
    set_admitted(c, d, c->admission ? d->bytes : NVS_CORE_UNADMITTED);
}

/* ADMITTED or REFUSED, the answer to the ADMIT in flight (an older one's is stale). */
void handle_admission_answer(struct nvs_core *c, struct nvs_core_device *d, const struct nvs_msg *m) {
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
void run_admission(struct nvs_core *c, struct nvs_core_device *d, double now) {
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
        struct nvs_core_queued *q = send_message(c, NVS_MSG_ADMIT, (int)(d - c->devices), d->admit_wanted, NULL, now);
        if (q != NULL) q->request = d->admit_request;
    }
}

/* Admission more than a chunk above the use, nobody waiting, for GIVE_BACK_AFTER_S: given back
 * down to half a chunk above it, so that a use that moves by less neither asks nor gives back. */
double give_back_due(const struct nvs_core *c, const struct nvs_core_device *d) {
    return c->registered && d->surplus && d->admit_asked == 0 && d->admitted != NVS_CORE_UNADMITTED
               ? d->surplus_since + GIVE_BACK_AFTER_S
               : NO_DEADLINE;
}

void give_back_fire(struct nvs_core *c, struct nvs_core_device *d, double now) {
    d->surplus = 0;
    set_admitted(c, d, d->bytes + nvs_core_headroom(d->bytes) / 2);
    /* ADMIT request=0: a give-back, which nobody answers */
    send_message(c, NVS_MSG_ADMIT, (int)(d - c->devices), d->admitted, NULL, now);
}

/* The shell applies the scheduler's limit below the process's own (limits.c). */
static void set_scheduler_limit(struct nvs_core *c, struct nvs_core_device *d, uint64_t bytes) {
    if (d->scheduler_limit == bytes) return;
    d->scheduler_limit = bytes;
    struct nvs_core_queued *q = push(c, NVS_ACT_LIMIT, (int)(d - c->devices), 0);
    if (q != NULL) q->action.bytes = bytes;
}

/* The limit this registration was told for the device `uuid`: its own, else the one for every
 * device. */
static uint64_t told_limit(const struct nvs_core *c, const char *uuid) {
    uint64_t bytes = c->limit_every;
    for (int i = 0; i < c->n_limits; i++)
        if (strcmp(c->limits[i].device, uuid) == 0) bytes = c->limits[i].bytes;
    return bytes;
}

void apply_limit(struct nvs_core *c, struct nvs_core_device *d) { set_scheduler_limit(c, d, told_limit(c, d->uuid)); }

static void apply_limits(struct nvs_core *c) {
    for (int i = 0; i < c->n_devices; i++)
        if (c->devices[i].known) apply_limit(c, &c->devices[i]);
}

/* LIMIT: kept by device id (a device this process has not used yet gets it when it does), and
 * applied at once when registered, else with the WELCOME it precedes. */
void handle_limit(struct nvs_core *c, const struct nvs_msg *m) {
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
void settle_devices(struct nvs_core *c) {
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

uint64_t nvs_core_limit(const struct nvs_core *c, const char *uuid) {
    for (int i = 0; i < c->n_devices; i++)
        if (c->devices[i].known && strcmp(c->devices[i].uuid, uuid) == 0) return c->devices[i].scheduler_limit;
    return told_limit(c, uuid); /* a device not added yet */
}
