/*
 * Admission, the allocator's side (docs/interceptor.md, "Admission"): an allocation that would
 * take the process's total on a device past what the scheduler admitted blocks its thread here
 * until the scheduler admits more (ADMITTED) or refuses (REFUSED: timeout, too-large), instead
 * of spilling past what the node's host memory can hold. The client core (client_core.c) asks
 * and reads the answers; client.c hands them over with nvs_admission_answer_locked.
 *
 * While no scheduler answers ADMIT (none reachable, fail-open, or one without admission) a
 * device's admitted total is "none": nothing waits, and allocations cost one more atomic load.
 */
#include "admission.h"
#include "compiler.h"
#include "gate.h"
#include "limits.h"
#include "log.h"
#include "notify.h"

/* With nvs_mu: broadcast whenever a device's admitted total changes, a refusal comes, or memory
 * calls may go on. */
static pthread_cond_t admission_cv = PTHREAD_COND_INITIALIZER;
/* Set (under nvs_mu) when memory calls on every device may go on without waiting; read
 * without a lock. */
static _Atomic int all_settled;

uint64_t nvs_admitted(const struct nvs_device *d) {
    uint64_t stored = atomic_load_explicit(&d->admission, memory_order_acquire);
    return stored == 0 ? NVS_NO_LIMIT : stored - 1;
}

void nvs_admission_answer_locked(struct nvs_device *d, uint64_t admitted, int granted) {
    atomic_store_explicit(&d->admission, admitted == NVS_NO_LIMIT ? 0 : admitted + 1, memory_order_release);
    if (!granted) {
        d->admit_refusals++;
        d->admit_wanted = 0;
    } else if (admitted >= d->admit_wanted) {
        d->admit_wanted = 0;
    }
    pthread_cond_broadcast(&admission_cv);
}

static int memory_ready(const struct nvs_device *d) {
    return atomic_load_explicit(&d->memory_ready, memory_order_acquire) ||
           atomic_load_explicit(&all_settled, memory_order_acquire);
}

void nvs_admission_settled_locked(struct nvs_device *d) {
    if (d != NULL)
        atomic_store_explicit(&d->memory_ready, 1, memory_order_release);
    else
        atomic_store_explicit(&all_settled, 1, memory_order_release);
    pthread_cond_broadcast(&admission_cv);
}

void nvs_admission_await_registration(struct nvs_device *d) {
    if (d == NULL || NVS_LIKELY(memory_ready(d))) return;
    nvs_runtime_start();
    /* The client thread learns of the device when it next looks at the table: wake it (a pipe
     * write, not under nvs_mu). It answers at once, or after a connection and a WELCOME. */
    nvs_client_wake();
    pthread_mutex_lock(&nvs_mu);
    while (!memory_ready(d)) pthread_cond_wait(&admission_cv, &nvs_mu);
    pthread_mutex_unlock(&nvs_mu);
}

int nvs_admission_wait(struct nvs_device *d, uint64_t total, const char *call, size_t size) {
    pthread_mutex_lock(&nvs_mu);
    unsigned refusals = d->admit_refusals;
    int asked = 0;
    while (nvs_admitted(d) < total && d->admit_refusals == refusals) {
        if (d->admit_wanted < total) {
            d->admit_wanted = total;
            asked = 0;
        }
        if (!asked) {
            /* The client thread asks; waking it is I/O (a pipe), so not under nvs_mu. */
            asked = 1;
            pthread_mutex_unlock(&nvs_mu);
            nvs_client_wake();
            pthread_mutex_lock(&nvs_mu);
            continue;
        }
        pthread_cond_wait(&admission_cv, &nvs_mu);
    }
    int refused = d->admit_refusals != refusals;
    pthread_mutex_unlock(&nvs_mu);
    if (refused)
        nvs_error("%s of %zu bytes on device %d (%s) refused: the scheduler did not admit a total of %llu bytes "
                  "(see the line before for why); returning CUDA_ERROR_OUT_OF_MEMORY, nothing was allocated",
                  call, size, d->ordinal, d->uuid, (unsigned long long)total);
    return refused ? -1 : 0;
}

void nvs_admission_reset_after_fork(void) {
    pthread_cond_init(&admission_cv, NULL);
    atomic_store(&all_settled, 0); /* the child registers on its own if it uses CUDA */
    for (int i = 0; i < NVS_MAX_DEVICES; i++) {
        atomic_store(&nvs_devices[i].memory_ready, 0);
        atomic_store(&nvs_devices[i].admission, 0);
        nvs_devices[i].admit_wanted = 0;
        nvs_devices[i].admit_refusals = 0;
    }
}
