/*
 * Contexts: primary contexts (one per device, reference counted), created contexts, and each
 * thread's stack of current contexts.
 */
#include "simcuda.h"

/* Serialises context creation, activation and destruction (retain counts, executor start and
 * stop). Never held while waiting for an executor other than the one being stopped. */
static pthread_mutex_t admin_lock = PTHREAD_MUTEX_INITIALIZER;
static atomic_int next_context_id;

/* The calling thread's context stack; the top is the current context. Only this thread writes it. */
#define CONTEXT_STACK_DEPTH 64
static __thread struct sim_ctx *context_stack[CONTEXT_STACK_DEPTH];
static __thread int context_depth;

struct sim_ctx *sim_ctx_new(struct sim_device *device, int is_primary, unsigned int flags)
{
    struct sim_ctx *ctx = sim_calloc(1, sizeof *ctx);
    ctx->magic = SIM_MAGIC_CTX;
    ctx->id = atomic_fetch_add(&next_context_id, 1) + 1;
    ctx->device = device;
    ctx->is_primary = is_primary;
    ctx->flags = flags;
    pthread_mutex_init(&ctx->lock, NULL);
    pthread_cond_init(&ctx->work_cv, NULL);
    pthread_cond_init(&ctx->done_cv, NULL);
    return ctx;
}

/* The calling thread's current context, or NULL. */
static struct sim_ctx *sim_ctx_current(void)
{
    return context_depth > 0 ? context_stack[context_depth - 1] : NULL;
}

/* Whether `ctx` is a context that exists and is active (NULL is not). */
static int is_live(struct sim_ctx *ctx)
{
    return ctx && ctx->magic == SIM_MAGIC_CTX && atomic_load(&ctx->active);
}

CUresult sim_ctx_check(CUcontext handle, struct sim_ctx **out)
{
    struct sim_ctx *ctx = (struct sim_ctx *)handle;
    if (!is_live(ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    *out = ctx;
    return CUDA_SUCCESS;
}

CUresult sim_ctx_usable(struct sim_ctx *ctx)
{
    return is_live(ctx) ? atomic_load(&ctx->sticky) : CUDA_ERROR_INVALID_CONTEXT;
}

CUresult sim_ctx_require(struct sim_ctx **out)
{
    *out = sim_ctx_current();
    return sim_ctx_usable(*out);
}

static void activate(struct sim_ctx *ctx)
{
    atomic_store(&ctx->sticky, CUDA_SUCCESS);
    atomic_store(&ctx->active, 1);
    sim_executor_start(ctx);
}

/* Waits for queued work, stops the executor and frees the context's memory. */
static void deactivate(struct sim_ctx *ctx)
{
    atomic_store(&ctx->active, 0);
    sim_executor_stop(ctx);
    sim_mem_release_ctx(ctx);
}

static void forget_current(struct sim_ctx *ctx)
{
    if (sim_ctx_current() == ctx)
        context_depth--;
}

/* ---- Primary contexts ---- */

SIM_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    SIM_ENTER();
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    SIM_REQUIRE_DEVICE(dev, device);
    pthread_mutex_lock(&admin_lock);
    if (device->primary->retained++ == 0)
        activate(device->primary);
    pthread_mutex_unlock(&admin_lock);
    *pctx = (CUcontext)device->primary;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    SIM_ENTER();
    SIM_REQUIRE_DEVICE(dev, device);
    CUresult result = CUDA_SUCCESS;
    pthread_mutex_lock(&admin_lock);
    if (device->primary->retained == 0)
        result = CUDA_ERROR_INVALID_CONTEXT;
    else if (--device->primary->retained == 0)
        deactivate(device->primary);
    pthread_mutex_unlock(&admin_lock);
    return result;
}

SIM_EXPORT CUresult cuDevicePrimaryCtxRelease(CUdevice dev)
{
    return cuDevicePrimaryCtxRelease_v2(dev);
}

SIM_EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev)
{
    SIM_ENTER();
    SIM_REQUIRE_DEVICE(dev, device);
    pthread_mutex_lock(&admin_lock);
    if (device->primary->retained > 0) {
        deactivate(device->primary);
        /* Those who retained it still hold a handle: it comes back clean on their next use
         * only after a new retain, as with the real driver. */
        device->primary->retained = 0;
    }
    device->primary->flags = 0;
    pthread_mutex_unlock(&admin_lock);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDevicePrimaryCtxReset(CUdevice dev)
{
    return cuDevicePrimaryCtxReset_v2(dev);
}

SIM_EXPORT CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active)
{
    SIM_ENTER();
    if (!flags || !active)
        return CUDA_ERROR_INVALID_VALUE;
    SIM_REQUIRE_DEVICE(dev, device);
    pthread_mutex_lock(&admin_lock);
    *flags = device->primary->flags;
    *active = device->primary->retained > 0;
    pthread_mutex_unlock(&admin_lock);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDevicePrimaryCtxSetFlags_v2(CUdevice dev, unsigned int flags)
{
    SIM_ENTER();
    SIM_REQUIRE_DEVICE(dev, device);
    pthread_mutex_lock(&admin_lock);
    device->primary->flags = flags;
    pthread_mutex_unlock(&admin_lock);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDevicePrimaryCtxSetFlags(CUdevice dev, unsigned int flags)
{
    return cuDevicePrimaryCtxSetFlags_v2(dev, flags);
}

/* ---- Created contexts ---- */

static CUresult push(struct sim_ctx *ctx)
{
    if (context_depth == CONTEXT_STACK_DEPTH)
        return CUDA_ERROR_INVALID_VALUE;
    context_stack[context_depth++] = ctx;
    return CUDA_SUCCESS;
}

static CUresult create_context(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    SIM_ENTER();
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    SIM_REQUIRE_DEVICE(dev, device);
    if (context_depth == CONTEXT_STACK_DEPTH)
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_ctx *ctx = sim_ctx_new(device, 0, flags);
    pthread_mutex_lock(&admin_lock);
    activate(ctx);
    pthread_mutex_unlock(&admin_lock);
    push(ctx);
    *pctx = (CUcontext)ctx;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    return create_context(pctx, flags, dev);
}

SIM_EXPORT CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    return create_context(pctx, flags, dev);
}

/* Execution affinity (SM partitions) is not simulated: the parameters are accepted. */
SIM_EXPORT CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *paramsArray, int numParams,
                                   unsigned int flags, CUdevice dev)
{
    SIM_ENTER();
    if (numParams < 0 || (numParams > 0 && !paramsArray))
        return CUDA_ERROR_INVALID_VALUE;
    return create_context(pctx, flags, dev);
}

SIM_EXPORT CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *ctxCreateParams, unsigned int flags,
                                   CUdevice dev)
{
    (void)ctxCreateParams;
    return create_context(pctx, flags, dev);
}

/* A destroyed context's memory is kept (marked dead) so that a stale handle on another
 * thread's stack is reported as invalid instead of being read after free. */
SIM_EXPORT CUresult cuCtxDestroy_v2(CUcontext handle)
{
    SIM_ENTER();
    struct sim_ctx *ctx = (struct sim_ctx *)handle;
    if (!ctx || ctx->magic != SIM_MAGIC_CTX || ctx->is_primary)
        return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&admin_lock);
    deactivate(ctx);
    ctx->magic = SIM_MAGIC_DEAD;
    pthread_mutex_unlock(&admin_lock);
    forget_current(ctx);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxDestroy(CUcontext ctx)
{
    return cuCtxDestroy_v2(ctx);
}

SIM_EXPORT CUresult cuCtxPushCurrent_v2(CUcontext handle)
{
    SIM_ENTER();
    struct sim_ctx *ctx;
    CUresult result = sim_ctx_check(handle, &ctx);
    return result != CUDA_SUCCESS ? result : push(ctx);
}

SIM_EXPORT CUresult cuCtxPushCurrent(CUcontext ctx)
{
    return cuCtxPushCurrent_v2(ctx);
}

SIM_EXPORT CUresult cuCtxPopCurrent_v2(CUcontext *pctx)
{
    SIM_ENTER();
    if (context_depth == 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    struct sim_ctx *ctx = context_stack[--context_depth];
    if (pctx)
        *pctx = (CUcontext)ctx;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxPopCurrent(CUcontext *pctx)
{
    return cuCtxPopCurrent_v2(pctx);
}

SIM_EXPORT CUresult cuCtxSetCurrent(CUcontext handle)
{
    SIM_ENTER();
    if (!handle) {
        if (context_depth > 0)
            context_depth--;
        return CUDA_SUCCESS;
    }
    struct sim_ctx *ctx = (struct sim_ctx *)handle;
    if (ctx->magic != SIM_MAGIC_CTX)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (context_depth == 0)
        return push(ctx);
    context_stack[context_depth - 1] = ctx;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxGetCurrent(CUcontext *pctx)
{
    SIM_ENTER();
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    *pctx = (CUcontext)sim_ctx_current();
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxGetDevice(CUdevice *device)
{
    SIM_ENTER();
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_ctx *ctx;
    CUresult result = sim_ctx_check((CUcontext)sim_ctx_current(), &ctx);
    if (result != CUDA_SUCCESS)
        return result;
    *device = ctx->device->ordinal;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxSynchronize(void)
{
    SIM_ENTER();
    struct sim_ctx *ctx;
    CUresult result = sim_ctx_check((CUcontext)sim_ctx_current(), &ctx);
    if (result != CUDA_SUCCESS)
        return result;
    pthread_mutex_lock(&ctx->lock);
    result = sim_capture_sync_locked(ctx, NULL, __func__);
    pthread_mutex_unlock(&ctx->lock);
    if (result != CUDA_SUCCESS)
        return result;
    sim_drain(ctx);
    return atomic_load(&ctx->sticky);
}
