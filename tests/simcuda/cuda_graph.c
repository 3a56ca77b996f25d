/*
 * CUDA graphs built by stream capture: while a (non-default) stream is captured, the
 * operations submitted to it are recorded instead of queued; launching the instantiated graph
 * queues copies of them, traced with the launching entry point as "api". Only single-stream
 * capture is simulated: a capture does not spread to streams that wait on its events. A
 * synchronisation that would wait for a capturing stream invalidates the capture, as measured
 * (sim_capture_sync_locked).
 */
#include <stdlib.h>

#include "simcuda.h"

struct sim_graph {
    enum sim_magic magic; /* SIM_MAGIC_GRAPH or SIM_MAGIC_GRAPH_EXEC */
    struct sim_op *head, *tail;
};

static struct sim_graph *graph_new(enum sim_magic magic)
{
    struct sim_graph *graph = calloc(1, sizeof *graph);
    if (graph)
        graph->magic = magic;
    return graph;
}

void sim_graph_free(struct sim_graph *graph)
{
    while (graph->head) {
        struct sim_op *next = graph->head->next;
        sim_op_free(graph->head);
        graph->head = next;
    }
    graph->magic = SIM_MAGIC_DEAD;
    free(graph);
}

void sim_graph_append(struct sim_graph *graph, struct sim_op *op)
{
    op->next = NULL;
    if (graph->tail)
        graph->tail->next = op;
    else
        graph->head = op;
    graph->tail = op;
}

int sim_stream_capturing(struct sim_stream *stream)
{
    if (!stream)
        return 0;
    pthread_mutex_lock(&stream->ctx->lock);
    int capturing = stream->capture != NULL;
    pthread_mutex_unlock(&stream->ctx->lock);
    return capturing;
}

static const char *mode_name(CUstreamCaptureMode mode)
{
    switch (mode) {
    case CU_STREAM_CAPTURE_MODE_GLOBAL:
        return "global";
    case CU_STREAM_CAPTURE_MODE_THREAD_LOCAL:
        return "thread-local";
    default:
        return "relaxed";
    }
}

struct sim_graph *sim_capture_detach_locked(struct sim_stream *stream)
{
    struct sim_graph *graph = stream->capture;
    if (!graph)
        return NULL;
    for (struct sim_stream **link = &stream->ctx->captures; *link; link = &(*link)->next_capture)
        if (*link == stream) {
            *link = stream->next_capture;
            break;
        }
    stream->capture = NULL;
    stream->next_capture = NULL;
    stream->capture_status = CU_STREAM_CAPTURE_STATUS_NONE;
    return graph;
}

/* Measured on an H200 (driver 580): a synchronisation that would wait for a capturing stream
 * fails with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED whichever thread makes it and whatever the
 * capture mode (global, thread-local, relaxed), and the capture is invalidated: its stream
 * refuses further work and cuStreamEndCapture fails with CUDA_ERROR_STREAM_CAPTURE_INVALIDATED. */
CUresult sim_capture_sync_locked(struct sim_ctx *ctx, struct sim_stream *stream, const char *api)
{
    CUresult result = CUDA_SUCCESS;
    for (struct sim_stream *s = ctx->captures; s; s = s->next_capture) {
        if (stream && s != stream)
            continue;
        result = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
        if (s->capture_status == CU_STREAM_CAPTURE_STATUS_ACTIVE) {
            s->capture_status = CU_STREAM_CAPTURE_STATUS_INVALIDATED;
            sim_trace_capture(ctx, "invalidated", api, mode_name(s->capture_mode));
        }
    }
    return result;
}

/* `into`: the caller's graph (cuStreamBeginCaptureToGraph), NULL: a new one. */
static CUresult begin_capture(CUstream hStream, CUstreamCaptureMode mode, struct sim_graph *into, const char *api)
{
    SIM_ENTER();
    if ((int)mode < CU_STREAM_CAPTURE_MODE_GLOBAL || mode > CU_STREAM_CAPTURE_MODE_RELAXED)
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_ctx *ctx;
    struct sim_stream *stream;
    CUresult result = sim_stream_resolve(hStream, &ctx, &stream);
    if (result != CUDA_SUCCESS)
        return result;
    if (!stream) /* the default streams cannot be captured */
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    struct sim_graph *graph = into ? into : graph_new(SIM_MAGIC_GRAPH);
    if (!graph)
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&ctx->lock);
    if (stream->capture) {
        result = CUDA_ERROR_ILLEGAL_STATE;
    } else {
        stream->capture = graph;
        stream->capture_status = CU_STREAM_CAPTURE_STATUS_ACTIVE;
        stream->capture_mode = mode;
        stream->capture_graph_is_callers = into != NULL;
        stream->next_capture = ctx->captures;
        ctx->captures = stream;
        sim_trace_capture(ctx, "begin", api, mode_name(mode));
    }
    pthread_mutex_unlock(&ctx->lock);
    if (result != CUDA_SUCCESS && !into)
        free(graph);
    return result;
}

SIM_WITH_TWIN(cuStreamBeginCapture, cuStreamBeginCapture_ptsz, (CUstream hStream),
              return begin_capture(hStream, CU_STREAM_CAPTURE_MODE_GLOBAL, NULL, __func__);)
SIM_WITH_TWIN(cuStreamBeginCapture_v2, cuStreamBeginCapture_v2_ptsz, (CUstream hStream, CUstreamCaptureMode mode),
              return begin_capture(hStream, mode, NULL, __func__);)

static CUresult check_graph(void *handle, enum sim_magic magic, struct sim_graph **out);

/* Dependencies are accepted and ignored: the simulated graph is a sequence, not a DAG. */
static CUresult begin_capture_to_graph(CUstream hStream, CUgraph hGraph, size_t numDependencies,
                                       CUstreamCaptureMode mode, const char *api)
{
    (void)numDependencies;
    SIM_ENTER();
    struct sim_graph *graph;
    if (check_graph(hGraph, SIM_MAGIC_GRAPH, &graph) != CUDA_SUCCESS)
        return CUDA_ERROR_INVALID_VALUE;
    return begin_capture(hStream, mode, graph, api);
}

SIM_WITH_TWIN(cuStreamBeginCaptureToGraph, cuStreamBeginCaptureToGraph_ptsz,
              (CUstream hStream, CUgraph hGraph, const CUgraphNode *dependencies,
               const CUgraphEdgeData *dependencyData, size_t numDependencies, CUstreamCaptureMode mode),
              (void)dependencies; (void)dependencyData;
              return begin_capture_to_graph(hStream, hGraph, numDependencies, mode, __func__);)

static CUresult end_capture(CUstream hStream, CUgraph *phGraph, const char *api)
{
    SIM_ENTER();
    if (!phGraph)
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_ctx *ctx;
    struct sim_stream *stream;
    CUresult result = sim_stream_resolve(hStream, &ctx, &stream);
    if (result != CUDA_SUCCESS)
        return result;
    if (!stream)
        return CUDA_ERROR_ILLEGAL_STATE;
    pthread_mutex_lock(&ctx->lock);
    int invalidated = stream->capture_status == CU_STREAM_CAPTURE_STATUS_INVALIDATED;
    int callers = stream->capture_graph_is_callers;
    const char *mode = mode_name(stream->capture_mode);
    struct sim_graph *graph = sim_capture_detach_locked(stream);
    if (graph)
        sim_trace_capture(ctx, invalidated ? "end-invalidated" : "end", api, mode);
    pthread_mutex_unlock(&ctx->lock);
    if (!graph)
        return CUDA_ERROR_ILLEGAL_STATE;
    if (invalidated) {
        if (!callers)
            sim_graph_free(graph);
        *phGraph = NULL;
        return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    }
    *phGraph = (CUgraph)graph;
    return CUDA_SUCCESS;
}

SIM_WITH_TWIN(cuStreamEndCapture, cuStreamEndCapture_ptsz, (CUstream hStream, CUgraph *phGraph),
              return end_capture(hStream, phGraph, __func__);)

static CUresult is_capturing(CUstream hStream, CUstreamCaptureStatus *captureStatus)
{
    SIM_ENTER();
    if (!captureStatus)
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_ctx *ctx;
    struct sim_stream *stream;
    CUresult result = sim_stream_resolve(hStream, &ctx, &stream);
    if (result != CUDA_SUCCESS)
        return result;
    pthread_mutex_lock(&ctx->lock);
    *captureStatus = stream && stream->capture ? stream->capture_status : CU_STREAM_CAPTURE_STATUS_NONE;
    pthread_mutex_unlock(&ctx->lock);
    return CUDA_SUCCESS;
}

SIM_WITH_TWIN(cuStreamIsCapturing, cuStreamIsCapturing_ptsz, (CUstream hStream, CUstreamCaptureStatus *captureStatus),
              return is_capturing(hStream, captureStatus);)

SIM_EXPORT CUresult cuGraphCreate(CUgraph *phGraph, unsigned int flags)
{
    SIM_ENTER();
    if (!phGraph || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_graph *graph = graph_new(SIM_MAGIC_GRAPH);
    if (!graph)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *phGraph = (CUgraph)graph;
    return CUDA_SUCCESS;
}

static CUresult check_graph(void *handle, enum sim_magic magic, struct sim_graph **out)
{
    struct sim_graph *graph = handle;
    if (!graph || graph->magic != magic)
        return CUDA_ERROR_INVALID_VALUE;
    *out = graph;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph, unsigned long long flags)
{
    (void)flags; /* auto-free-on-launch, upload, device launch, priority: nothing to simulate */
    SIM_ENTER();
    struct sim_graph *graph;
    if (!phGraphExec || check_graph(hGraph, SIM_MAGIC_GRAPH, &graph) != CUDA_SUCCESS)
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_graph *exec = graph_new(SIM_MAGIC_GRAPH_EXEC);
    if (!exec)
        return CUDA_ERROR_OUT_OF_MEMORY;
    for (struct sim_op *op = graph->head; op; op = op->next)
        sim_graph_append(exec, sim_op_clone(op, op->api));
    *phGraphExec = (CUgraphExec)exec;
    return CUDA_SUCCESS;
}

static CUresult graph_launch(CUgraphExec hGraphExec, CUstream hStream, const char *api)
{
    SIM_ENTER();
    struct sim_graph *exec;
    CUresult result = check_graph(hGraphExec, SIM_MAGIC_GRAPH_EXEC, &exec);
    if (result != CUDA_SUCCESS)
        return result;
    struct sim_ctx *ctx;
    struct sim_stream *stream;
    result = sim_stream_resolve(hStream, &ctx, &stream);
    for (struct sim_op *op = exec->head; op && result == CUDA_SUCCESS; op = op->next)
        result = sim_submit(ctx, stream, sim_op_clone(op, api), 0);
    return result;
}

SIM_WITH_TWIN(cuGraphLaunch, cuGraphLaunch_ptsz, (CUgraphExec hGraphExec, CUstream hStream),
              return graph_launch(hGraphExec, hStream, __func__);)

SIM_EXPORT CUresult cuGraphExecDestroy(CUgraphExec hGraphExec)
{
    SIM_ENTER();
    struct sim_graph *exec;
    CUresult result = check_graph(hGraphExec, SIM_MAGIC_GRAPH_EXEC, &exec);
    if (result == CUDA_SUCCESS)
        sim_graph_free(exec);
    return result;
}

SIM_EXPORT CUresult cuGraphDestroy(CUgraph hGraph)
{
    SIM_ENTER();
    struct sim_graph *graph;
    CUresult result = check_graph(hGraph, SIM_MAGIC_GRAPH, &graph);
    if (result == CUDA_SUCCESS)
        sim_graph_free(graph);
    return result;
}
