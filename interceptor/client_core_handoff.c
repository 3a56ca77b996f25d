/*
 * When a holder lets its lock go before the scheduler asks (docs/interceptor.md, "The client"):
 * an idle holder after its idle window (a probe job says whether it was idle), and a contended
 * one (CONTENDED) by draining ahead of its quantum's end by the lead its drains and swap-out
 * take, so that the next holder starts on time. The lock rules (client_core.c) carry out the
 * release; this file says when.
 */
#include "client_core_internal.h"

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
void note_pause(const struct nvs_core *c, struct nvs_core_device *d, double since, double now) {
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

void reset_idle_tracking(struct nvs_core *c, struct nvs_core_device *d, double now) {
    d->idle_entered = d->entered;
    d->idle_bytes = d->bytes;
    d->idle_since = now;
    long window = idle_window_ms(c, d);
    d->idle_next_check = now + (window > 0 ? idle_check_period(window) : 1.0);
}

/* early release of an idle holder; the worker does the GPU part (never during a capture: its
 * synchronise would invalidate it, and a capturing process is not idle) */
double idle_check_due(const struct nvs_core *c, const struct nvs_core_device *d) {
    return c->registered && idle_check_possible(c, d) ? d->idle_next_check : NO_DEADLINE;
}

void idle_check_fire(struct nvs_core *c, struct nvs_core_device *d, double now) {
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
void note_drain(struct nvs_core_device *d, double now) {
    if (d->drain_started <= 0) return;
    d->drain_seconds[d->drain_next] = now - d->drain_started;
    d->drain_next = (d->drain_next + 1) % NVS_DRAIN_HISTORY;
    if (d->drains_known < NVS_DRAIN_HISTORY) d->drains_known++;
    d->drain_started = 0;
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

/* CONTENDED for the current grant: others wait. The idle window follows what the scheduler says
 * (idle_window_ms); unless the device drains with others, its drain starts ahead of the
 * quantum's end by the lead it needs (predrain_lead), and the pre-drain names the grant it will
 * release. */
void handle_contended(struct nvs_core *c, struct nvs_core_device *d, const struct nvs_msg *m, double now) {
    d->contended_evict = m->evict;
    d->contended_idle_ms = m->idle_ms;
    /* A shorter window is looked at as often as it needs from now on: the look planned for the
     * window before (up to IDLE_CHECK_PERIOD_MAX_S away) would add its wait to the waiter's. */
    long window = idle_window_ms(c, d);
    if (window > 0 && now + idle_check_period(window) < d->idle_next_check)
        d->idle_next_check = now + idle_check_period(window);
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
