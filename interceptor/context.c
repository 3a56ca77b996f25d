/*
 * The hooks that may end a context's life: cuCtxDestroy_v2, and the release and reset of a
 * primary context. Before the driver destroys a context, its pending stream-ordered frees are
 * completed (memory.c) and the gate forgets it (gate.c), all under nvs_ctx_mu so that no drain
 * or poll touches it meanwhile. This unit sits above gate.c and memory.c, so that gate.c needs
 * nothing of memory.c (memory.c uses the gate's device table). The hooks that only change which context is current (cuCtxSetCurrent, Push/Pop,
 * cuCtxCreate) are generated in hooks.c (kind CONTEXT).
 */
#include <stdlib.h>
#include <string.h>

#include "compiler.h"
#include "gate.h"
#include "hook_table.h"
#include "loader.h"
#include "memory.h"

NVS_EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx) {
    NVS_REAL_OR_FAIL(cuCtxDestroy_v2);
    /* Settle its pending frees and forget it first, and keep drains and polls away until the
     * driver has destroyed it. */
    pthread_rwlock_wrlock(&nvs_ctx_mu);
    if (ctx != NULL) nvs_memory_settle_frees(ctx, NULL);
    pthread_mutex_lock(&nvs_mu);
    nvs_gate_forget_context_locked(ctx);
    pthread_mutex_unlock(&nvs_mu);
    CUresult r = nvs_real.cuCtxDestroy_v2(ctx);
    pthread_rwlock_unlock(&nvs_ctx_mu);
    nvs_tls.device = NULL;
    return r;
}

/* Releasing or resetting a primary context may destroy it: drop every recorded context of the
 * device that the driver no longer knows. The caller holds nvs_ctx_mu, which keeps drains away
 * meanwhile; the driver is asked outside nvs_mu (no CUDA call under it). */
static void forget_dead_contexts(struct nvs_device *d) {
    if (nvs_real.cuCtxGetApiVersion == NULL) return;
    pthread_mutex_lock(&nvs_mu);
    int n = d->n_contexts;
    CUcontext *contexts = n > 0 ? malloc((size_t)n * sizeof *contexts) : NULL;
    if (contexts != NULL) memcpy(contexts, d->contexts, (size_t)n * sizeof *contexts);
    pthread_mutex_unlock(&nvs_mu);
    if (contexts == NULL) return;
    for (int i = 0; i < n; i++) {
        unsigned int version;
        if (nvs_real.cuCtxGetApiVersion(contexts[i], &version) == CUDA_SUCCESS) continue;
        pthread_mutex_lock(&nvs_mu);
        nvs_gate_forget_context_locked(contexts[i]);
        pthread_mutex_unlock(&nvs_mu);
    }
    free(contexts);
}

/* Release or reset of a primary context (`primary` is the real function): the device's pending
 * frees are settled first (the context may be gone afterwards), drains and polls are kept away
 * until the driver is done, and dead contexts are forgotten afterwards. */
static CUresult change_primary_context(CUresult (*primary)(CUdevice), CUdevice dev) {
    struct nvs_device *d = dev >= 0 && dev < NVS_MAX_DEVICES ? &nvs_devices[dev] : NULL;
    pthread_rwlock_wrlock(&nvs_ctx_mu);
    if (d != NULL) nvs_memory_settle_frees(NULL, d);
    CUresult r = primary(dev);
    if (d != NULL) forget_dead_contexts(d);
    pthread_rwlock_unlock(&nvs_ctx_mu);
    nvs_tls.device = NULL;
    return r;
}

NVS_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    NVS_REAL_OR_FAIL(cuDevicePrimaryCtxRelease_v2);
    return change_primary_context(nvs_real.cuDevicePrimaryCtxRelease_v2, dev);
}

NVS_EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev) {
    NVS_REAL_OR_FAIL(cuDevicePrimaryCtxReset_v2);
    return change_primary_context(nvs_real.cuDevicePrimaryCtxReset_v2, dev);
}
