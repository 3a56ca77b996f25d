/*
 * The per-device gate and the context bookkeeping behind it.
 *
 * A submission does fetch_add(entered), load(gate_open), the real call, fetch_add(exited)
 * (gate.h, nvs_gate_enter/exit). Closing is store(gate_open = 0) followed by waiting until
 * exited == entered. All of these are seq_cst, so either the submitter sees the gate closed
 * (and backs out) or the closer sees its `entered` (and waits for it): a release never overlaps
 * a submission that passed the gate.
 *
 * The device of a call is the device of the calling thread's current context, cached per
 * thread; the context hooks (hooks.c, context.c) drop the cache whenever the current context may
 * change.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "compiler.h"
#include "gate.h"
#include "hook_table.h"
#include "loader.h"
#include "log.h"
#include "notify.h"

/* Who writes these, under which lock: gate.h, where they are declared. */
pthread_mutex_t nvs_mu = PTHREAD_MUTEX_INITIALIZER;
pthread_cond_t nvs_gate_cv = PTHREAD_COND_INITIALIZER;
pthread_rwlock_t nvs_ctx_mu = PTHREAD_RWLOCK_WRITER_NONRECURSIVE_INITIALIZER_NP;

_Atomic int64_t nvs_lease_ms = INT64_MAX;

struct nvs_device nvs_devices[NVS_MAX_DEVICES];
int nvs_n_devices;

__thread struct nvs_thread_state nvs_tls __attribute__((tls_model("initial-exec")));

static void format_uuid(const CUuuid *uuid, char *out, size_t cap) {
    const unsigned char *b = (const unsigned char *)uuid->bytes;
    snprintf(out, cap,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
             b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12],
             b[13], b[14], b[15]);
}

struct nvs_device *nvs_device_get(CUdevice ordinal) {
    if (ordinal < 0 || ordinal >= NVS_MAX_DEVICES) {
        nvs_error("device ordinal %d is beyond the %d devices nvshare tracks; its work is not "
                  "scheduled",
                  ordinal, NVS_MAX_DEVICES);
        return NULL;
    }
    struct nvs_device *d = &nvs_devices[ordinal];
    pthread_mutex_lock(&nvs_mu);
    int known = d->known;
    pthread_mutex_unlock(&nvs_mu);
    if (known) return d;

    /* Identity queries happen outside the lock (they are driver calls); racing threads compute
     * the same values and the first to publish wins. */
    CUuuid uuid;
    memset(&uuid, 0, sizeof uuid);
    CUresult r = CUDA_ERROR_NOT_FOUND;
    if (nvs_real.cuDeviceGetUuid_v2 != NULL) r = nvs_real.cuDeviceGetUuid_v2(&uuid, ordinal);
    if (r != CUDA_SUCCESS && nvs_real.cuDeviceGetUuid != NULL) r = nvs_real.cuDeviceGetUuid(&uuid, ordinal);
    if (r != CUDA_SUCCESS) {
        nvs_error("cuDeviceGetUuid failed (%d) for device %d; its work is not scheduled", r, ordinal);
        return NULL;
    }
    char name[128] = "";
    if (nvs_real.cuDeviceGetName == NULL || nvs_real.cuDeviceGetName(name, sizeof name, ordinal) != CUDA_SUCCESS)
        name[0] = '\0';
    size_t total = 0;
    if (nvs_real.cuDeviceTotalMem_v2 == NULL || nvs_real.cuDeviceTotalMem_v2(&total, ordinal) != CUDA_SUCCESS)
        total = 0;

    pthread_mutex_lock(&nvs_mu);
    int published = !d->known;
    if (published) {
        d->ordinal = ordinal;
        format_uuid(&uuid, d->uuid, sizeof d->uuid);
        /* The protocol forbids control characters in values. */
        for (char *c = name; *c; c++)
            if ((unsigned char)*c < 0x20 || *c == 0x7f) *c = ' ';
        snprintf(d->name, sizeof d->name, "%s", name);
        d->total = total;
        d->known = 1;
        if (ordinal >= nvs_n_devices) nvs_n_devices = ordinal + 1;
    }
    pthread_mutex_unlock(&nvs_mu);
    /* Identity is constant once known: readable without the lock. */
    if (published) nvs_debug("device %d is %s (%s, %zu bytes)", ordinal, d->uuid, d->name, total);
    return d;
}

struct nvs_device *nvs_device_by_uuid(const char *uuid) {
    for (int i = 0; i < nvs_n_devices; i++)
        if (nvs_devices[i].known && strcmp(nvs_devices[i].uuid, uuid) == 0) return &nvs_devices[i];
    return NULL;
}

/* Returns -1 when out of memory (the caller says so, outside nvs_mu). */
static int note_context_locked(struct nvs_device *d, CUcontext ctx) {
    for (int i = 0; i < d->n_contexts; i++)
        if (d->contexts[i] == ctx) return 0;
    if (d->n_contexts == d->cap_contexts) {
        int cap = d->cap_contexts ? 2 * d->cap_contexts : 4;
        CUcontext *grown = realloc(d->contexts, (size_t)cap * sizeof *grown);
        if (grown == NULL) return -1;
        d->contexts = grown;
        d->cap_contexts = cap;
    }
    d->contexts[d->n_contexts++] = ctx;
    return 0;
}

void nvs_gate_forget_context_locked(CUcontext ctx) {
    for (int i = 0; i < nvs_n_devices; i++) {
        struct nvs_device *d = &nvs_devices[i];
        for (int j = 0; j < d->n_contexts; j++)
            if (d->contexts[j] == ctx) d->contexts[j--] = d->contexts[--d->n_contexts];
    }
}

struct nvs_device *nvs_current_device(void) {
    if (nvs_real_load() != 0 || nvs_real.cuCtxGetCurrent == NULL || nvs_real.cuCtxGetDevice == NULL) return NULL;
    CUcontext ctx = NULL;
    if (nvs_real.cuCtxGetCurrent(&ctx) != CUDA_SUCCESS || ctx == NULL) return NULL;
    CUdevice ordinal;
    if (nvs_real.cuCtxGetDevice(&ordinal) != CUDA_SUCCESS) return NULL;
    struct nvs_device *d = nvs_device_get(ordinal);
    if (d == NULL) return NULL;
    pthread_mutex_lock(&nvs_mu);
    int noted = note_context_locked(d, ctx);
    pthread_mutex_unlock(&nvs_mu);
    if (noted != 0) nvs_error("out of memory recording a context; drains may miss its work");
    return d;
}

/* Slow part of nvs_gate_enter: the thread has no cached device. No current context means the
 * call is passed through: the driver returns its own error. */
struct nvs_device *nvs_gate_resolve(void) {
    struct nvs_device *d = nvs_current_device();
    nvs_tls.device = d;
    return d;
}

void nvs_gate_wait(struct nvs_device *d) {
    nvs_runtime_start();
    pthread_mutex_lock(&nvs_mu);
    if (nvs_gate_passable(d)) {
        pthread_mutex_unlock(&nvs_mu);
        return;
    }
    if (nvs_gate_add_waiter_locked(d)) {
        /* The first waiter wakes the client thread (a write to its pipe: I/O, so not under
         * nvs_mu). The gate is checked again under the lock before waiting: an opening in
         * between is not missed. */
        pthread_mutex_unlock(&nvs_mu);
        nvs_client_wake();
        pthread_mutex_lock(&nvs_mu);
    }
    /* A closed gate, or a lapsed registration lease: the client thread opens the one and
     * checks the other (it broadcasts when either changes). */
    while (!nvs_gate_passable(d)) pthread_cond_wait(&nvs_gate_cv, &nvs_mu);
    d->waiters--;
    pthread_mutex_unlock(&nvs_mu);
}

int nvs_gate_add_waiter_locked(struct nvs_device *d) {
    if (d->waiters++ > 0) return 0;
    d->asked_at = nvs_now();
    return 1;
}

void nvs_gate_set_locked(struct nvs_device *d, int open) {
    if (open && !atomic_load(&d->gate_open)) d->gate_opened_at = nvs_now();
    atomic_store(&d->gate_open, open);
    if (open) pthread_cond_broadcast(&nvs_gate_cv);
}

static void pause_briefly(long *ns) {
    struct timespec ts = {0, *ns};
    nanosleep(&ts, NULL);
    if (*ns < 1000000) *ns *= 2;
}

int nvs_gate_sync_contexts(struct nvs_device *d) {
    if (nvs_real.cuCtxPushCurrent_v2 == NULL || nvs_real.cuCtxSynchronize == NULL || nvs_real.cuCtxPopCurrent_v2 == NULL)
        return 0; /* no driver worth the name: nothing can be in flight */
    pthread_rwlock_rdlock(&nvs_ctx_mu);
    pthread_mutex_lock(&nvs_mu);
    if (d->captures > 0) {
        pthread_mutex_unlock(&nvs_mu);
        pthread_rwlock_unlock(&nvs_ctx_mu);
        return -1;
    }
    int n = d->n_contexts;
    CUcontext stack_copy[16];
    CUcontext *contexts = n <= 16 ? stack_copy : malloc((size_t)n * sizeof *contexts);
    if (contexts == NULL) n = 0;
    if (n > 0) memcpy(contexts, d->contexts, (size_t)n * sizeof *contexts);
    pthread_mutex_unlock(&nvs_mu);

    for (int i = 0; i < n; i++) {
        CUresult r = nvs_real.cuCtxPushCurrent_v2(contexts[i]);
        if (r != CUDA_SUCCESS) {
            /* A context the application destroyed behind our back (cudaDeviceReset). */
            nvs_debug("dropping context %p of device %d: push failed (%d)", (void *)contexts[i], d->ordinal, r);
            pthread_mutex_lock(&nvs_mu);
            nvs_gate_forget_context_locked(contexts[i]);
            pthread_mutex_unlock(&nvs_mu);
            continue;
        }
        r = nvs_real.cuCtxSynchronize();
        if (r != CUDA_SUCCESS)
            nvs_debug("cuCtxSynchronize on device %d returned %d (the application sees it too)", d->ordinal, r);
        CUcontext popped;
        nvs_real.cuCtxPopCurrent_v2(&popped);
    }
    if (contexts != stack_copy) free(contexts);
    pthread_rwlock_unlock(&nvs_ctx_mu);
    return 0;
}

void nvs_gate_wait_quiet(struct nvs_device *d) {
    /* exited first, then entered: equal values mean nothing was in flight at the first read,
     * and everything entering after the gate closed backs out without submitting. */
    long pause_ns = 20000;
    for (;;) {
        uint64_t x = atomic_load(&d->exited);
        uint64_t e = atomic_load(&d->entered);
        if (x == e) break;
        pause_briefly(&pause_ns);
    }
}

/* --- stream capture ---------------------------------------------------------------------------
 * Measured on an H200: a cuCtxSynchronize from another thread while a stream is captured fails
 * with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidates the capture, in every capture mode.
 * So the device's capture count tells the client core to hold drains and idle probes until the
 * capture ends, the capturing thread passes a closed gate (its launches only build the graph),
 * and a capture never begins in the middle of a drain's synchronise (nvs_ctx_mu). */

#define MAX_CAPTURES 64
static struct {
    CUstream stream;
    struct nvs_device *device;
} captures[MAX_CAPTURES]; /* under nvs_mu */

static void capture_begun(CUstream stream) {
    struct nvs_device *d = nvs_current_device();
    if (d == NULL) return;
    pthread_mutex_lock(&nvs_mu);
    int slot = -1;
    for (int i = 0; i < MAX_CAPTURES && slot < 0; i++)
        if (captures[i].device == NULL) slot = i;
    if (slot >= 0) {
        captures[slot].stream = stream;
        captures[slot].device = d;
        d->captures++;
        nvs_tls.capturing++;
    }
    pthread_mutex_unlock(&nvs_mu);
    if (slot < 0) nvs_warn("more than %d stream captures at once: a drain may invalidate one", MAX_CAPTURES);
}

static void capture_ended(CUstream stream) {
    int found = 0;
    pthread_mutex_lock(&nvs_mu);
    for (int i = 0; i < MAX_CAPTURES && !found; i++) {
        if (captures[i].device != NULL && captures[i].stream == stream) {
            captures[i].device->captures--;
            captures[i].device = NULL;
            found = 1;
        }
    }
    pthread_mutex_unlock(&nvs_mu);
    if (!found) return;
    if (nvs_tls.capturing > 0) nvs_tls.capturing--;
    nvs_client_wake(); /* a drain may have waited for this */
    nvs_worker_kick();
}

void nvs_gate_reset_after_fork(void) {
    pthread_rwlockattr_t writers_first;
    pthread_rwlockattr_init(&writers_first);
    pthread_rwlockattr_setkind_np(&writers_first, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
    pthread_rwlock_init(&nvs_ctx_mu, &writers_first);
    pthread_rwlockattr_destroy(&writers_first);
    memset(captures, 0, sizeof captures);
    nvs_tls.capturing = 0;
}

#define BEGIN_CAPTURE(name, params, args, stream)                                               \
    NVS_EXPORT CUresult name params {                                                           \
        NVS_REAL_OR_FAIL(name);                                                                 \
        pthread_rwlock_wrlock(&nvs_ctx_mu);                                                     \
        CUresult r = nvs_real.name args;                                                        \
        pthread_rwlock_unlock(&nvs_ctx_mu);                                                     \
        if (r == CUDA_SUCCESS) capture_begun(stream);                                           \
        return r;                                                                               \
    }

BEGIN_CAPTURE(cuStreamBeginCapture, (CUstream hStream), (hStream), hStream)
BEGIN_CAPTURE(cuStreamBeginCapture_ptsz, (CUstream hStream), (hStream), hStream)
BEGIN_CAPTURE(cuStreamBeginCapture_v2, (CUstream hStream, CUstreamCaptureMode mode), (hStream, mode), hStream)
BEGIN_CAPTURE(cuStreamBeginCapture_v2_ptsz, (CUstream hStream, CUstreamCaptureMode mode), (hStream, mode), hStream)
BEGIN_CAPTURE(cuStreamBeginCaptureToGraph,
              (CUstream hStream, CUgraph hGraph, const CUgraphNode *dependencies, const CUgraphEdgeData *dependencyData,
               size_t numDependencies, CUstreamCaptureMode mode),
              (hStream, hGraph, dependencies, dependencyData, numDependencies, mode), hStream)
BEGIN_CAPTURE(cuStreamBeginCaptureToGraph_ptsz,
              (CUstream hStream, CUgraph hGraph, const CUgraphNode *dependencies, const CUgraphEdgeData *dependencyData,
               size_t numDependencies, CUstreamCaptureMode mode),
              (hStream, hGraph, dependencies, dependencyData, numDependencies, mode), hStream)

/* The capture ends whatever the result (an invalidated capture ends with an error). */
NVS_EXPORT CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph) {
    NVS_REAL_OR_FAIL(cuStreamEndCapture);
    CUresult r = nvs_real.cuStreamEndCapture(hStream, phGraph);
    capture_ended(hStream);
    return r;
}

NVS_EXPORT CUresult cuStreamEndCapture_ptsz(CUstream hStream, CUgraph *phGraph) {
    NVS_REAL_OR_FAIL(cuStreamEndCapture_ptsz);
    CUresult r = nvs_real.cuStreamEndCapture_ptsz(hStream, phGraph);
    capture_ended(hStream);
    return r;
}
