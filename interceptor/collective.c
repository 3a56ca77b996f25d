/*
 * Collective kernels (collective.h): the launches a gang's fence counts (docs/interceptor.md,
 * "Gangs"). When a gang's turn is dropped, every member must stop after the same collective,
 * or the last collective of the member that went furthest waits for a partner that stopped
 * before launching it (issue 19's spin, within a gang). So each device counts the collectives
 * launched through its gate, and the client thread can hold them to a limit: the core freezes
 * them at the DROP (FENCED says the count), and lets a member that is behind launch up to what
 * the furthest one launched (FENCE).
 *
 * Which functions are collectives: those whose names contain one of NVSHARE_COLLECTIVES'
 * comma-separated words (default NCCL's kernel names, "ncclKernel" and "ncclDevKernel", which
 * the CUDA runtime looks up by their mangled names), found when the program looks a function up
 * by name (cuModuleGetFunction, cuLibraryGetKernel) and followed through cuKernelGetFunction.
 * Their handles are kept in a fixed table, written without a lock (a compare-and-swap per slot)
 * and never shrunk: a process looks up a bounded set of kernels.
 *
 * The count and the limit share one atomic word per device, so that a launch is counted and
 * checked against the limit in one step and the limit takes effect at one count: the low 48 bits
 * count the collectives launched; the high 16 bits are 0 (no limit) or 1 + how many more may be
 * launched (1: none).
 */
#include "collective.h"

#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "client_core.h"
#include "config.h"
#include "loader.h"
#include "log.h"
#include "notify.h"

#define COUNT_MASK ((UINT64_C(1) << 48) - 1)
#define CODE_SHIFT 48
#define CODE_MAX UINT64_C(0xFFFF)

/* --- the functions that are collectives --------------------------------------------------------*/

#define TABLE_SIZE 4096 /* slots; NCCL looks up a few hundred kernels */

_Atomic unsigned nvs_collective_functions;
/* Handles (CUfunction or CUkernel) of collectives; NULL: free. Any thread, by compare-and-swap. */
static _Atomic(const void *) table[TABLE_SIZE];

static size_t slot_of(const void *handle) {
    uintptr_t h = (uintptr_t)handle;
    h ^= h >> 17;
    h *= UINT64_C(0x9E3779B97F4A7C15);
    return (size_t)(h >> 20) % TABLE_SIZE;
}

static int is_collective(const void *handle) {
    if (handle == NULL) return 0;
    for (size_t i = slot_of(handle), n = 0; n < TABLE_SIZE; i = (i + 1) % TABLE_SIZE, n++) {
        const void *seen = atomic_load_explicit(&table[i], memory_order_acquire);
        if (seen == handle) return 1;
        if (seen == NULL) return 0;
    }
    return 0;
}

static void remember(const void *handle) {
    if (handle == NULL) return;
    for (size_t i = slot_of(handle), n = 0; n < TABLE_SIZE; i = (i + 1) % TABLE_SIZE, n++) {
        const void *expected = NULL;
        if (atomic_compare_exchange_strong(&table[i], &expected, handle)) {
            atomic_fetch_add(&nvs_collective_functions, 1);
            return;
        }
        if (expected == handle) return;
    }
    static _Atomic int warned;
    if (!atomic_exchange(&warned, 1))
        nvs_warn("more than %d collective kernels: launches of the others are not counted", TABLE_SIZE);
}

/* Whether `name` (a kernel's, mangled or not) contains one of NVSHARE_COLLECTIVES' words. */
static int names_collective(const char *name) {
    const char *words = nvs_config.collectives;
    if (name == NULL) return 0;
    while (*words != '\0') {
        size_t n = strcspn(words, ",");
        if (n > 0) {
            char word[128];
            size_t len = n < sizeof word - 1 ? n : sizeof word - 1;
            memcpy(word, words, len);
            word[len] = '\0';
            if (strstr(name, word) != NULL) return 1;
        }
        words += n;
        if (*words == ',') words++;
    }
    return 0;
}

NVS_EXPORT CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name) {
    NVS_REAL_OR_FAIL(cuModuleGetFunction);
    CUresult result = nvs_real.cuModuleGetFunction(hfunc, hmod, name);
    if (result == CUDA_SUCCESS && hfunc != NULL && names_collective(name)) remember(*hfunc);
    return result;
}

NVS_EXPORT CUresult cuLibraryGetKernel(CUkernel *pKernel, CUlibrary library, const char *name) {
    NVS_REAL_OR_FAIL(cuLibraryGetKernel);
    CUresult result = nvs_real.cuLibraryGetKernel(pKernel, library, name);
    if (result == CUDA_SUCCESS && pKernel != NULL && names_collective(name)) remember(*pKernel);
    return result;
}

NVS_EXPORT CUresult cuKernelGetFunction(CUfunction *pFunc, CUkernel kernel) {
    NVS_REAL_OR_FAIL(cuKernelGetFunction);
    CUresult result = nvs_real.cuKernelGetFunction(pFunc, kernel);
    if (result == CUDA_SUCCESS && pFunc != NULL && is_collective(kernel)) remember(*pFunc);
    return result;
}

/* --- counting and holding them ---------------------------------------------------------------*/

static int room(uint64_t word) { return word >> CODE_SHIFT != 1; }

/* Count one collective if the limit allows it; `last`: it used the last room left. */
static int claim(struct nvs_device *d, int *last) {
    uint64_t word = atomic_load(&d->collectives), next;
    do {
        uint64_t code = word >> CODE_SHIFT;
        if (code == 1) return 0;
        next = word + 1;                        /* one more launched */
        if (code > 1) next -= UINT64_C(1) << CODE_SHIFT; /* and one fewer allowed */
        *last = code == 2;
    } while (!atomic_compare_exchange_weak(&d->collectives, &word, next));
    return 1;
}

/* A launch the limit holds back waits (as one at the closed gate: it counts as the device's
 * waiter, so that the process asks for the lock again once it has released it). */
static void wait_for_room(struct nvs_device *d) {
    pthread_mutex_lock(&nvs_mu);
    if (!room(atomic_load(&d->collectives))) {
        if (nvs_gate_add_waiter_locked(d)) {
            pthread_mutex_unlock(&nvs_mu); /* waking the client thread is I/O */
            nvs_client_wake();
            pthread_mutex_lock(&nvs_mu);
        }
        while (!room(atomic_load(&d->collectives))) pthread_cond_wait(&nvs_gate_cv, &nvs_mu);
        d->waiters--;
    }
    pthread_mutex_unlock(&nvs_mu);
}

struct nvs_device *nvs_collective_enter(CUfunction f) {
    if (!is_collective(f)) return nvs_gate_enter();
    for (;;) {
        struct nvs_device *d = nvs_gate_enter();
        int last = 0;
        if (d == NULL) return NULL; /* a nested call, or no context: nothing counted */
        if (claim(d, &last)) {
            if (last) nvs_client_wake(); /* the fence's last one: the client thread closes the gate */
            return d;
        }
        nvs_gate_exit(d);
        wait_for_room(d);
    }
}

uint64_t nvs_collectives_limit_locked(struct nvs_device *d, uint64_t limit) {
    uint64_t word = atomic_load(&d->collectives), code;
    do {
        uint64_t launched = word & COUNT_MASK, more = limit > launched ? limit - launched : 0;
        code = limit == NVS_CORE_NO_LIMIT ? 0 : 1 + (more < CODE_MAX - 1 ? more : CODE_MAX - 1);
    } while (!atomic_compare_exchange_weak(&d->collectives, &word, (word & COUNT_MASK) | code << CODE_SHIFT));
    pthread_cond_broadcast(&nvs_gate_cv);
    return word & COUNT_MASK;
}

uint64_t nvs_collectives_launched(const struct nvs_device *d) { return atomic_load(&d->collectives) & COUNT_MASK; }
