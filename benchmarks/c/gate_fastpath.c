/*
 * The gate's lock-held fast path (interceptor/gate.h: nvs_gate_enter/nvs_gate_exit) in a
 * loop, against the same loop without the registration lease check, and the coarse clock alone.
 * Prints one JSON line (ns per call, median of 7 rounds). Build and run:
 *   cc -O2 -pthread -iquote interceptor -include interceptor/glibc_compat.h benchmarks/c/gate_fastpath.c \
 *      -o /tmp/gate_fastpath && /tmp/gate_fastpath
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>

#include "gate.h"

/* What the fast path links against; the slow paths are never taken here. */
__thread struct nvs_thread_state nvs_tls __attribute__((tls_model("initial-exec")));
_Atomic int64_t nvs_lease_ms = INT64_MAX;
struct nvs_device *nvs_gate_resolve(void) { abort(); }
void nvs_gate_wait(struct nvs_device *d) { (void)d; abort(); }

static struct nvs_device device;

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

/* The fast path as it was before the lease: the gate flag only. */
static inline struct nvs_device *enter_without_lease(void) {
    struct nvs_thread_state *t = &nvs_tls;
    if (t->depth++ != 0) return NULL;
    struct nvs_device *d = t->device;
    atomic_fetch_add(&d->entered, 1);
    if (NVS_LIKELY(atomic_load(&d->gate_open))) return d;
    abort();
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

#define ROUNDS 7
#define CALLS 20000000L

int main(void) {
    atomic_store(&device.gate_open, 1);
    nvs_tls.device = &device;
    double with_lease[ROUNDS], without[ROUNDS], clock_only[ROUNDS];
    volatile int64_t sink = 0;
    for (int r = 0; r < ROUNDS; r++) {
        double t0 = now_ns();
        for (long i = 0; i < CALLS; i++) nvs_gate_exit(nvs_gate_enter());
        double t1 = now_ns();
        for (long i = 0; i < CALLS; i++) nvs_gate_exit(enter_without_lease());
        double t2 = now_ns();
        for (long i = 0; i < CALLS; i++) sink += nvs_coarse_ms();
        double t3 = now_ns();
        with_lease[r] = (t1 - t0) / CALLS;
        without[r] = (t2 - t1) / CALLS;
        clock_only[r] = (t3 - t2) / CALLS;
    }
    qsort(with_lease, ROUNDS, sizeof(double), cmp);
    qsort(without, ROUNDS, sizeof(double), cmp);
    qsort(clock_only, ROUNDS, sizeof(double), cmp);
    printf("{\"gate_fast_path_ns\": %.2f, \"without_lease_ns\": %.2f, \"coarse_clock_ns\": %.2f, \"calls\": %ld}\n",
           with_lease[ROUNDS / 2], without[ROUNDS / 2], clock_only[ROUNDS / 2], CALLS);
    return (int)(sink & 0);
}
