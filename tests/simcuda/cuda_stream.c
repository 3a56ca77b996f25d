/*
 * Streams, events and host functions. A stream is an ordering label on its context's single
 * queue: synchronising a stream waits for the last operation queued on it, synchronising a
 * default stream (NULL, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD) for everything queued so far.
 */
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

#include "simcuda.h"

/* Stream priorities run from 0 (lowest) to -5 (highest), as on Hopper. */
#define PRIORITY_LEAST 0
#define PRIORITY_GREATEST (-5)

static CUresult create_stream(CUstream *phStream, unsigned int flags, int priority)
{
    SIM_ENTER();
    if (!phStream || (flags & ~(unsigned int)CU_STREAM_NON_BLOCKING))
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_ctx *ctx;
    CUresult result = sim_ctx_require(&ctx);
    if (result != CUDA_SUCCESS)
        return result;
    struct sim_stream *stream = calloc(1, sizeof *stream);
    if (!stream)
        return CUDA_ERROR_OUT_OF_MEMORY;
    stream->magic = SIM_MAGIC_STREAM;
    stream->ctx = ctx;
    stream->flags = flags;
    stream->priority = priority > PRIORITY_LEAST ? PRIORITY_LEAST
                       : priority < PRIORITY_GREATEST ? PRIORITY_GREATEST
                                                      : priority;
    *phStream = (CUstream)stream;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags)
{
    return create_stream(phStream, Flags, PRIORITY_LEAST);
}

SIM_EXPORT CUresult cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority)
{
    return create_stream(phStream, flags, priority);
}

/* Operations already queued on the stream still run: they live on the context's queue. */
SIM_EXPORT CUresult cuStreamDestroy_v2(CUstream hStream)
{
    SIM_ENTER();
    struct sim_stream *stream = (struct sim_stream *)hStream;
    if (!stream || hStream == CU_STREAM_LEGACY || hStream == CU_STREAM_PER_THREAD ||
        stream->magic != SIM_MAGIC_STREAM)
        return CUDA_ERROR_INVALID_HANDLE;
    /* A capture in progress is abandoned. */
    pthread_mutex_lock(&stream->ctx->lock);
    int callers = stream->capture_graph_is_callers;
    struct sim_graph *capture = sim_capture_detach_locked(stream);
    pthread_mutex_unlock(&stream->ctx->lock);
    if (capture && !callers)
        sim_graph_free(capture);
    stream->magic = SIM_MAGIC_DEAD;
    free(stream);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuStreamDestroy(CUstream hStream)
{
    return cuStreamDestroy_v2(hStream);
}

/* The sequence number a synchronisation of this stream waits for; while the stream is being
 * captured, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (and the capture is invalidated). */
static CUresult stream_target(CUstream hStream, struct sim_ctx **ctx, uint64_t *seq, const char *api)
{
    SIM_ENTER();
    struct sim_stream *stream;
    CUresult result = sim_stream_resolve(hStream, ctx, &stream);
    if (result != CUDA_SUCCESS)
        return result;
    pthread_mutex_lock(&(*ctx)->lock);
    if (stream)
        result = sim_capture_sync_locked(*ctx, stream, api);
    *seq = stream ? stream->last_seq : (*ctx)->submitted;
    pthread_mutex_unlock(&(*ctx)->lock);
    return result;
}

static CUresult stream_synchronize(CUstream hStream, const char *api)
{
    struct sim_ctx *ctx;
    uint64_t seq;
    CUresult result = stream_target(hStream, &ctx, &seq, api);
    if (result != CUDA_SUCCESS)
        return result;
    sim_wait(ctx, seq);
    return atomic_load(&ctx->sticky);
}

SIM_WITH_TWIN(cuStreamSynchronize, cuStreamSynchronize_ptsz, (CUstream hStream), return stream_synchronize(hStream, __func__);)

static CUresult stream_query(CUstream hStream, const char *api)
{
    struct sim_ctx *ctx;
    uint64_t seq;
    CUresult result = stream_target(hStream, &ctx, &seq, api);
    if (result != CUDA_SUCCESS)
        return result;
    pthread_mutex_lock(&ctx->lock);
    int done = ctx->completed >= seq;
    pthread_mutex_unlock(&ctx->lock);
    return done ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

SIM_WITH_TWIN(cuStreamQuery, cuStreamQuery_ptsz, (CUstream hStream), return stream_query(hStream, __func__);)

static CUresult stream_get_ctx(CUstream hStream, CUcontext *pctx)
{
    SIM_ENTER();
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_ctx *ctx;
    struct sim_stream *stream;
    CUresult result = sim_stream_resolve(hStream, &ctx, &stream);
    if (result == CUDA_SUCCESS)
        *pctx = (CUcontext)ctx;
    return result;
}

SIM_WITH_TWIN(cuStreamGetCtx, cuStreamGetCtx_ptsz, (CUstream hStream, CUcontext *pctx),
              return stream_get_ctx(hStream, pctx);)

static CUresult launch_host_func(CUstream hStream, CUhostFn fn, void *userData, const char *api)
{
    SIM_ENTER();
    if (!fn)
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_ctx *ctx;
    struct sim_stream *stream;
    CUresult result = sim_stream_resolve(hStream, &ctx, &stream);
    if (result != CUDA_SUCCESS)
        return result;
    struct sim_op *op = sim_op_new(SIM_OP_HOST_FN, api);
    op->u.host.fn = fn;
    op->u.host.data = userData;
    return sim_submit(ctx, stream, op, 0);
}

SIM_WITH_TWIN(cuLaunchHostFunc, cuLaunchHostFunc_ptsz, (CUstream hStream, CUhostFn fn, void *userData),
              return launch_host_func(hStream, fn, userData, __func__);)

/* ---- Events ---- */

static CUresult check_event(CUevent hEvent, struct sim_event **out)
{
    struct sim_event *event = (struct sim_event *)hEvent;
    if (!event || event->magic != SIM_MAGIC_EVENT)
        return CUDA_ERROR_INVALID_HANDLE;
    *out = event;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags)
{
    SIM_ENTER();
    if (!phEvent ||
        (Flags & ~(unsigned int)(CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS)))
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_ctx *ctx;
    CUresult result = sim_ctx_require(&ctx);
    if (result != CUDA_SUCCESS)
        return result;
    struct sim_event *event = calloc(1, sizeof *event);
    if (!event)
        return CUDA_ERROR_OUT_OF_MEMORY;
    event->magic = SIM_MAGIC_EVENT;
    event->flags = Flags;
    *phEvent = (CUevent)event;
    return CUDA_SUCCESS;
}

static CUresult event_record(CUevent hEvent, CUstream hStream, const char *api)
{
    SIM_ENTER();
    struct sim_event *event;
    CUresult result = check_event(hEvent, &event);
    if (result != CUDA_SUCCESS)
        return result;
    struct sim_ctx *ctx;
    struct sim_stream *stream;
    result = sim_stream_resolve(hStream, &ctx, &stream);
    if (result != CUDA_SUCCESS)
        return result;
    struct sim_op *op = sim_op_new(SIM_OP_EVENT, api);
    op->u.event = event;
    return sim_submit(ctx, stream, op, 0);
}

SIM_WITH_TWIN(cuEventRecord, cuEventRecord_ptsz, (CUevent hEvent, CUstream hStream),
              return event_record(hEvent, hStream, __func__);)
/* Flags only matter for events inside graphs (external waits), which are not simulated. */
SIM_WITH_TWIN(cuEventRecordWithFlags, cuEventRecordWithFlags_ptsz, (CUevent hEvent, CUstream hStream, unsigned int flags),
              (void)flags; return event_record(hEvent, hStream, __func__);)

/* Whether the event's last record has executed (an event never recorded counts as done). */
static int event_done(struct sim_event *event, double *time)
{
    struct sim_ctx *ctx = event->ctx;
    if (!ctx)
        return 1;
    pthread_mutex_lock(&ctx->lock);
    int done = ctx->completed >= event->seq;
    if (time)
        *time = event->time;
    pthread_mutex_unlock(&ctx->lock);
    return done;
}

/* SIMCUDA_EVENT_QUERY_US: how long a cuEventQuery takes (default 0). A real query takes
 * microseconds, but its caller can be preempted around it for as long as a busy machine likes;
 * tests make that window wide so that what happens meanwhile in other threads is tested. */
static unsigned event_query_us(void)
{
    static _Atomic long cached = -1;
    long us = atomic_load(&cached);
    if (us < 0) {
        const char *text = getenv("SIMCUDA_EVENT_QUERY_US");
        us = text && *text ? strtol(text, NULL, 10) : 0;
        atomic_store(&cached, us < 0 ? 0 : us);
    }
    return (unsigned)us;
}

SIM_EXPORT CUresult cuEventQuery(CUevent hEvent)
{
    SIM_ENTER();
    struct sim_event *event;
    CUresult result = check_event(hEvent, &event);
    if (result != CUDA_SUCCESS)
        return result;
    unsigned delay = event_query_us();
    if (delay)
        usleep(delay);
    return event_done(event, NULL) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

SIM_EXPORT CUresult cuEventSynchronize(CUevent hEvent)
{
    SIM_ENTER();
    struct sim_event *event;
    CUresult result = check_event(hEvent, &event);
    if (result != CUDA_SUCCESS)
        return result;
    if (!event->ctx)
        return CUDA_SUCCESS;
    sim_wait(event->ctx, event->seq);
    return atomic_load(&event->ctx->sticky);
}

SIM_EXPORT CUresult cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd)
{
    SIM_ENTER();
    struct sim_event *start, *end;
    if (!pMilliseconds)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult result = check_event(hStart, &start);
    if (result == CUDA_SUCCESS)
        result = check_event(hEnd, &end);
    if (result != CUDA_SUCCESS)
        return result;
    if (!start->ctx || !end->ctx || ((start->flags | end->flags) & CU_EVENT_DISABLE_TIMING))
        return CUDA_ERROR_INVALID_HANDLE;
    double start_time = 0, end_time = 0;
    if (!event_done(start, &start_time) || !event_done(end, &end_time))
        return CUDA_ERROR_NOT_READY;
    *pMilliseconds = (float)((end_time - start_time) * 1e3);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuEventElapsedTime_v2(float *pMilliseconds, CUevent hStart, CUevent hEnd)
{
    return cuEventElapsedTime(pMilliseconds, hStart, hEnd);
}

/* A pending event is released by the executor once its last record has run. */
SIM_EXPORT CUresult cuEventDestroy_v2(CUevent hEvent)
{
    SIM_ENTER();
    struct sim_event *event;
    CUresult result = check_event(hEvent, &event);
    if (result != CUDA_SUCCESS)
        return result;
    struct sim_ctx *ctx = event->ctx;
    int pending = 0;
    if (ctx)
        pthread_mutex_lock(&ctx->lock);
    event->magic = SIM_MAGIC_DEAD;
    if (ctx) {
        pending = ctx->completed < event->seq;
        pthread_mutex_unlock(&ctx->lock);
    }
    if (!pending)
        free(event);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuEventDestroy(CUevent hEvent)
{
    return cuEventDestroy_v2(hEvent);
}

static CUresult stream_wait_event(CUstream hStream, CUevent hEvent, unsigned int Flags, const char *api)
{
    SIM_ENTER();
    if (Flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_event *event;
    CUresult result = check_event(hEvent, &event);
    if (result != CUDA_SUCCESS)
        return result;
    struct sim_ctx *ctx;
    struct sim_stream *stream;
    result = sim_stream_resolve(hStream, &ctx, &stream);
    if (result != CUDA_SUCCESS)
        return result;
    struct sim_ctx *other = event->ctx;
    /* Within one context the queue order already satisfies the wait. */
    if (!other || other == ctx)
        return CUDA_SUCCESS;
    struct sim_op *op = sim_op_new(SIM_OP_WAIT, api);
    op->u.wait.ctx = other;
    pthread_mutex_lock(&other->lock);
    op->u.wait.seq = event->seq;
    pthread_mutex_unlock(&other->lock);
    return sim_submit(ctx, stream, op, 0);
}

SIM_WITH_TWIN(cuStreamWaitEvent, cuStreamWaitEvent_ptsz, (CUstream hStream, CUevent hEvent, unsigned int Flags),
              return stream_wait_event(hStream, hEvent, Flags, __func__);)
