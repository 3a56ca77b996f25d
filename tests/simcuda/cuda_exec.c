/*
 * The executor: one thread per active context runs the context's queued operations in
 * submission order (all its streams share that order), and appends one trace line per executed
 * GPU operation to SIMCUDA_TRACE.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "simcuda.h"

/* Opened by cuInit (under its pthread_once) and never closed; -1 when tracing is off. */
static int trace_fd = -1;

/* The calling thread's tag, copied into every operation it submits. */
static __thread char thread_tag[SIM_TAG_MAX];

SIM_EXPORT void simcudaSetTag(const char *tag)
{
    snprintf(thread_tag, sizeof thread_tag, "%s", tag ? tag : "");
}

/* Threads waiting inside the driver for queued work to finish (wait_locked); see simcuda.h. */
static atomic_int blocked_threads;

SIM_EXPORT int simcudaBlockedThreads(void)
{
    return atomic_load(&blocked_threads);
}

CUresult sim_trace_open(void)
{
    const char *path = getenv("SIMCUDA_TRACE");
    if (!path || !*path)
        return CUDA_SUCCESS;
    trace_fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (trace_fd < 0) {
        fprintf(stderr, "simcuda: cannot open SIMCUDA_TRACE=%s: %s\n", path, strerror(errno));
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    return CUDA_SUCCESS;
}

void *sim_calloc(size_t count, size_t size)
{
    void *memory = calloc(count, size);
    if (!memory) {
        fprintf(stderr, "simcuda: out of host memory\n");
        abort();
    }
    return memory;
}

struct sim_op *sim_op_new(enum sim_op_kind kind, const char *api)
{
    struct sim_op *op = sim_calloc(1, sizeof *op);
    op->kind = kind;
    op->api = api;
    memcpy(op->tag, thread_tag, sizeof op->tag);
    return op;
}

struct sim_op *sim_op_clone(const struct sim_op *original, const char *api)
{
    struct sim_op *op = sim_calloc(1, sizeof *op);
    *op = *original;
    op->next = NULL;
    op->seq = 0;
    op->api = api;
    memcpy(op->tag, thread_tag, sizeof op->tag);
    if (op->kind == SIM_OP_BATCH) {
        op->u.batch.copies = sim_calloc(op->u.batch.count, sizeof(struct sim_copy));
        memcpy(op->u.batch.copies, original->u.batch.copies, op->u.batch.count * sizeof(struct sim_copy));
    }
    /* Staged operations are never captured (pageable copies cannot be), so never cloned. */
    op->staging = NULL;
    return op;
}

void sim_op_free(struct sim_op *op)
{
    if (op->kind == SIM_OP_BATCH)
        free(op->u.batch.copies);
    free(op->staging);
    free(op);
}

CUresult sim_stream_resolve(CUstream handle, struct sim_ctx **ctx_out, struct sim_stream **stream_out)
{
    struct sim_ctx *current;
    CUresult result = sim_ctx_require(&current);
    if (result != CUDA_SUCCESS)
        return result;
    if (handle == NULL || handle == CU_STREAM_LEGACY || handle == CU_STREAM_PER_THREAD) {
        *ctx_out = current;
        *stream_out = NULL;
        return CUDA_SUCCESS;
    }
    struct sim_stream *stream = (struct sim_stream *)handle;
    if (stream->magic != SIM_MAGIC_STREAM)
        return CUDA_ERROR_INVALID_HANDLE;
    result = sim_ctx_usable(stream->ctx);
    if (result != CUDA_SUCCESS)
        return result;
    *ctx_out = stream->ctx;
    *stream_out = stream;
    return CUDA_SUCCESS;
}

/* With ctx->lock held. */
static uint64_t append_locked(struct sim_ctx *ctx, struct sim_op *op)
{
    op->seq = ++ctx->submitted;
    if (ctx->tail)
        ctx->tail->next = op;
    else
        ctx->head = op;
    ctx->tail = op;
    pthread_cond_signal(&ctx->work_cv);
    return op->seq;
}

CUresult sim_submit(struct sim_ctx *ctx, struct sim_stream *stream, struct sim_op *op, int wait)
{
    pthread_mutex_lock(&ctx->lock);
    if (stream && stream->capture) {
        /* Recorded, not executed; an invalidated capture refuses further work. */
        CUresult result = CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
        if (stream->capture_status == CU_STREAM_CAPTURE_STATUS_ACTIVE) {
            sim_graph_append(stream->capture, op);
            result = CUDA_SUCCESS;
        } else {
            sim_op_free(op);
        }
        pthread_mutex_unlock(&ctx->lock);
        return result;
    }
    if (!ctx->running) {
        pthread_mutex_unlock(&ctx->lock);
        sim_op_free(op);
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    uint64_t seq = append_locked(ctx, op);
    if (stream)
        stream->last_seq = seq;
    if (op->kind == SIM_OP_EVENT) {
        /* The event is pending from its record until the record executes. */
        op->u.event->ctx = ctx;
        op->u.event->seq = seq;
    }
    pthread_mutex_unlock(&ctx->lock);
    if (!wait)
        return CUDA_SUCCESS;
    sim_wait(ctx, seq);
    return atomic_load(&ctx->sticky);
}

/* With ctx->lock held. */
static void wait_locked(struct sim_ctx *ctx, uint64_t seq)
{
    if (ctx->completed >= seq)
        return;
    atomic_fetch_add(&blocked_threads, 1);
    while (ctx->completed < seq)
        pthread_cond_wait(&ctx->done_cv, &ctx->lock);
    atomic_fetch_sub(&blocked_threads, 1);
}

void sim_wait(struct sim_ctx *ctx, uint64_t seq)
{
    pthread_mutex_lock(&ctx->lock);
    wait_locked(ctx, seq);
    pthread_mutex_unlock(&ctx->lock);
}

void sim_drain(struct sim_ctx *ctx)
{
    pthread_mutex_lock(&ctx->lock);
    wait_locked(ctx, ctx->submitted);
    pthread_mutex_unlock(&ctx->lock);
}

/* ---- Execution ---- */

void sim_sleep_until(double deadline)
{
    struct timespec until = {.tv_sec = (time_t)deadline};
    until.tv_nsec = (long)((deadline - (double)until.tv_sec) * 1e9);
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &until, NULL) == EINTR)
        ;
}

static size_t copy_bytes(const struct sim_copy *copy)
{
    return copy->width * copy->height * copy->depth;
}

static CUresult run_copy(const struct sim_device *device, const struct sim_copy *copy)
{
    if (copy_bytes(copy) == 0)
        return CUDA_SUCCESS;
    if (copy->check_dst &&
        !sim_mem_range_ok(copy->dst, sim_extent(copy->width, copy->height, copy->depth, copy->dst_pitch, copy->dst_slice), device))
        return CUDA_ERROR_ILLEGAL_ADDRESS;
    if (copy->check_src &&
        !sim_mem_range_ok(copy->src, sim_extent(copy->width, copy->height, copy->depth, copy->src_pitch, copy->src_slice), device))
        return CUDA_ERROR_ILLEGAL_ADDRESS;
    for (size_t z = 0; z < copy->depth; z++)
        for (size_t y = 0; y < copy->height; y++)
            memmove((char *)copy->dst + z * copy->dst_slice + y * copy->dst_pitch,
                    (const char *)copy->src + z * copy->src_slice + y * copy->src_pitch, copy->width);
    return CUDA_SUCCESS;
}

static CUresult run_set(const struct sim_device *device, const struct sim_set *set)
{
    if (set->width == 0 || set->height == 0)
        return CUDA_SUCCESS;
    size_t row_bytes = set->width * set->element_size;
    if (!sim_mem_range_ok(set->dst, sim_extent(row_bytes, set->height, 1, set->pitch, 0), device))
        return CUDA_ERROR_ILLEGAL_ADDRESS;
    for (size_t y = 0; y < set->height; y++) {
        char *row = (char *)set->dst + y * set->pitch;
        switch (set->element_size) {
        case 1:
            memset(row, (int)set->value, set->width);
            break;
        case 2:
            for (size_t x = 0; x < set->width; x++)
                ((uint16_t *)row)[x] = (uint16_t)set->value;
            break;
        default:
            for (size_t x = 0; x < set->width; x++)
                ((uint32_t *)row)[x] = set->value;
            break;
        }
    }
    return CUDA_SUCCESS;
}

/* Runs a GPU operation of work of `device` that touches driver memory, with the registry
 * read-locked. */
static CUresult run_memory_op(const struct sim_device *device, struct sim_op *op)
{
    CUresult result = CUDA_SUCCESS;
    sim_mem_read_lock();
    switch (op->kind) {
    case SIM_OP_KERNEL: {
        uint64_t count = op->u.kernel.count;
        if (count > SIZE_MAX / 4 || !sim_mem_range_ok(op->u.kernel.dst, (size_t)count * 4, device)) {
            result = count ? CUDA_ERROR_ILLEGAL_ADDRESS : CUDA_SUCCESS;
            break;
        }
        uint32_t *words = (uint32_t *)op->u.kernel.dst;
        for (uint64_t i = 0; i < count; i++)
            words[i] = op->u.kernel.value;
        break;
    }
    case SIM_OP_MEMCPY:
        result = run_copy(device, &op->u.copy);
        break;
    case SIM_OP_BATCH:
        for (size_t i = 0; i < op->u.batch.count && result == CUDA_SUCCESS; i++)
            result = run_copy(device, &op->u.batch.copies[i]);
        break;
    case SIM_OP_MEMSET:
        result = run_set(device, &op->u.set);
        break;
    case SIM_OP_PREFETCH:
        if (!sim_mem_range_ok(op->u.prefetch.ptr, op->u.prefetch.bytes, NULL))
            result = CUDA_ERROR_ILLEGAL_ADDRESS;
        break;
    default:
        break;
    }
    sim_mem_unlock();
    return result;
}

static size_t op_bytes(const struct sim_op *op)
{
    size_t bytes = 0;
    switch (op->kind) {
    case SIM_OP_MEMCPY:
        return copy_bytes(&op->u.copy);
    case SIM_OP_BATCH:
        for (size_t i = 0; i < op->u.batch.count; i++)
            bytes += copy_bytes(&op->u.batch.copies[i]);
        return bytes;
    case SIM_OP_MEMSET:
        return op->u.set.width * op->u.set.height * op->u.set.element_size;
    case SIM_OP_PREFETCH:
    case SIM_OP_DISCARD:
        return op->u.prefetch.bytes;
    case SIM_OP_KERNEL:
        return op->u.kernel.count * 4; /* nvshare_fill, nvshare_allreduce */
    default:
        return 0;
    }
}

/* JSON string body: quotes, backslashes and control characters escaped. */
static void json_escape(char *out, size_t size, const char *text)
{
    size_t used = 0;
    for (; *text && used + 7 < size; text++) {
        unsigned char c = (unsigned char)*text;
        if (c == '"' || c == '\\')
            used += (size_t)snprintf(out + used, size - used, "\\%c", c);
        else if (c < 0x20)
            used += (size_t)snprintf(out + used, size - used, "\\u%04x", c);
        else
            out[used++] = (char)c;
    }
    out[used] = '\0';
}

/* What an operation did beyond its kind, for its trace line: the link a copy crossed, how long
 * it waited for its turns there and whether its host side was pinned, what a discard gave up. */
struct outcome {
    enum sim_engine link;         /* SIM_ENGINE_COMPUTE: none */
    double link_wait;
    int pageable;                 /* a copy over the link had pageable host memory on its side */
    size_t released;
};

static void trace(const struct sim_ctx *ctx, const struct sim_op *op, double start, double end, CUresult error,
                  const struct outcome *outcome)
{
    if (trace_fd < 0)
        return;
    const char *name = NULL, *kind;
    switch (op->kind) {
    case SIM_OP_KERNEL:
        kind = "kernel";
        name = op->u.kernel.kind == SIM_KERNEL_SLEEP  ? "nvshare_sleep"
               : op->u.kernel.kind == SIM_KERNEL_FILL ? "nvshare_fill"
                                                      : "nvshare_allreduce";
        break;
    case SIM_OP_MEMCPY:
    case SIM_OP_BATCH:
        kind = "memcpy";
        break;
    case SIM_OP_MEMSET:
        kind = "memset";
        break;
    case SIM_OP_PREFETCH:
        kind = "prefetch";
        break;
    case SIM_OP_HOST_FN:
        kind = "host";
        break;
    case SIM_OP_DISCARD:
        kind = "discard";
        break;
    default:
        return; /* events, waits and frees are bookkeeping, not GPU work */
    }
    char fields[768], tag[2 * SIM_TAG_MAX];
    int length = snprintf(fields, sizeof fields, "\"op\": \"%s\"", kind);
    if (name)
        length += snprintf(fields + length, sizeof fields - (size_t)length, ", \"name\": \"%s\"", name);
    if (op->kind != SIM_OP_HOST_FN && !(op->kind == SIM_OP_KERNEL && op->u.kernel.kind == SIM_KERNEL_SLEEP))
        length += snprintf(fields + length, sizeof fields - (size_t)length, ", \"bytes\": %zu", op_bytes(op));
    length += snprintf(fields + length, sizeof fields - (size_t)length, ", \"api\": \"%s\"", op->api);
    if (outcome->link != SIM_ENGINE_COMPUTE)
        length += snprintf(fields + length, sizeof fields - (size_t)length,
                           ", \"link\": \"%s\", \"link_wait\": %.6f, \"pinned\": %s",
                           outcome->link == SIM_ENGINE_D2H ? "d2h" : "h2d", outcome->link_wait,
                           outcome->pageable ? "false" : "true");
    if (op->kind == SIM_OP_DISCARD)
        length += snprintf(fields + length, sizeof fields - (size_t)length, ", \"released\": %zu", outcome->released);
    if (op->kind == SIM_OP_DISCARD || op->kind == SIM_OP_PREFETCH)
        length += snprintf(fields + length, sizeof fields - (size_t)length, ", \"range\": %zu", op->u.prefetch.range);
    if (op->tag[0]) {
        json_escape(tag, sizeof tag, op->tag);
        length += snprintf(fields + length, sizeof fields - (size_t)length, ", \"tag\": \"%s\"", tag);
    }
    if (error != CUDA_SUCCESS) {
        const char *error_name = "CUDA_ERROR_UNKNOWN";
        cuGetErrorName(error, &error_name);
        snprintf(fields + length, sizeof fields - (size_t)length, ", \"error\": \"%s\"", error_name);
    }
    sim_trace_write(ctx, fields, start, end);
}

void sim_trace_write(const struct sim_ctx *ctx, const char *fields, double start, double end)
{
    if (trace_fd < 0)
        return;
    char line[1024];
    int length = snprintf(line, sizeof line, "{\"pid\": %d, \"dev\": \"%s\", \"ctx\": %d, %s, \"start\": %.9f, \"end\": %.9f}\n",
                          (int)getpid(), ctx->device->uuid_text, ctx->id, fields, start, end);
    if (length >= (int)sizeof line)
        length = (int)sizeof line - 1;
    /* One write on an O_APPEND descriptor: lines of concurrent processes never interleave. */
    if (write(trace_fd, line, (size_t)length) != length)
        fprintf(stderr, "simcuda: trace write failed: %s\n", strerror(errno));
}

void sim_trace_capture(const struct sim_ctx *ctx, const char *event, const char *api, const char *mode)
{
    char fields[256];
    snprintf(fields, sizeof fields, "\"op\": \"capture\", \"event\": \"%s\", \"mode\": \"%s\", \"api\": \"%s\"", event,
             mode, api);
    double at = sim_now();
    sim_trace_write(ctx, fields, at, at);
}

/* nvshare_sleep. With residency modelled it runs in time slices, each on the simulated GPU
 * alone and with its memory resident (faulted back in if another process took it meanwhile). */
static void run_sleep(struct sim_ctx *ctx, const struct sim_op *op, double start)
{
    double duration = (double)op->u.kernel.duration_us * 1e-6;
    if (!sim_residency_models(ctx->device)) {
        sim_sleep_until(start + duration);
        return;
    }
    double slice = sim_residency_timeslice();
    do {
        sim_engine_enter(ctx->device);
        sim_residency_touch(ctx, op);
        double run = duration < slice ? duration : slice;
        sim_sleep_until(sim_now() + run);
        duration -= run;
        sim_engine_leave(ctx->device);
    } while (duration > 0);
}

/* With residency modelled, a copy between device-side memory and host memory first takes its
 * turns on the link (cuda_residency.c) for its cost; the bytes move when it has paid. */
static void cross_link(struct sim_ctx *ctx, const struct sim_op *op, struct outcome *outcome)
{
    if (!sim_residency_models(ctx->device))
        return;
    const struct sim_copy *copies = op->kind == SIM_OP_BATCH ? op->u.batch.copies : &op->u.copy;
    size_t count = op->kind == SIM_OP_BATCH ? op->u.batch.count : 1;
    for (size_t i = 0; i < count; i++) {
        if (copies[i].link == SIM_ENGINE_COMPUTE)
            continue;
        if (outcome->link == SIM_ENGINE_COMPUTE)
            outcome->link = copies[i].link;
        outcome->pageable |= copies[i].pageable;
        outcome->link_wait += sim_link_transfer(ctx->device, copies[i].link, copy_bytes(&copies[i]), copies[i].pageable,
                                                copies[i].managed);
    }
}

/* A fill, an all-reduce or a prefetch: on the compute engine. An all-reduce first waits for its
 * partners without it (its stream stays busy meanwhile), then writes the sum like a fill. */
static CUresult run_on_engine(struct sim_ctx *ctx, struct sim_op *op)
{
    if (op->kind == SIM_OP_KERNEL && op->u.kernel.kind == SIM_KERNEL_ALLREDUCE) {
        CUresult joined = sim_collective_join(ctx, op);
        if (joined != CUDA_SUCCESS)
            return joined;
    }
    sim_engine_enter(ctx->device);
    sim_residency_touch(ctx, op);
    CUresult error = run_memory_op(ctx->device, op);
    sim_engine_leave(ctx->device);
    return error;
}

static void execute(struct sim_ctx *ctx, struct sim_op *op)
{
    if (op->kind == SIM_OP_WAIT) {
        sim_wait(op->u.wait.ctx, op->u.wait.seq);
        return;
    }
    if (op->kind == SIM_OP_FREE) {
        sim_mem_free_now(op->u.free_ptr);
        return;
    }
    if (op->kind == SIM_OP_EVENT) {
        op->u.event->time = sim_now(); /* published by the completion under ctx->lock */
        return;
    }
    /* A context that hit an error runs no further work, as after a GPU fault. */
    if (atomic_load(&ctx->sticky) != CUDA_SUCCESS)
        return;
    double start = sim_now();
    CUresult error = CUDA_SUCCESS;
    struct outcome outcome = {.link = SIM_ENGINE_COMPUTE};
    if (op->kind == SIM_OP_KERNEL && op->u.kernel.kind == SIM_KERNEL_SLEEP) {
        run_sleep(ctx, op, start);
    } else if (op->kind == SIM_OP_HOST_FN) {
        op->u.host.fn(op->u.host.data);
    } else if (op->kind == SIM_OP_DISCARD) {
        outcome.released = sim_residency_discard(ctx, op->u.prefetch.ptr, op->u.prefetch.bytes);
    } else if (op->kind == SIM_OP_PREFETCH && op->u.prefetch.discard) {
        /* Nothing is copied: the pages are made anew where they go, without the compute engine. */
        sim_residency_discard(ctx, op->u.prefetch.ptr, op->u.prefetch.bytes);
        sim_residency_touch(ctx, op);
        error = run_memory_op(ctx->device, op);
    } else if (op->kind == SIM_OP_KERNEL || op->kind == SIM_OP_PREFETCH) {
        error = run_on_engine(ctx, op);
    } else {
        if (op->kind == SIM_OP_MEMCPY || op->kind == SIM_OP_BATCH)
            cross_link(ctx, op, &outcome);
        error = run_memory_op(ctx->device, op);
    }
    double end = sim_now();
    if (error != CUDA_SUCCESS) {
        int expected = CUDA_SUCCESS;
        atomic_compare_exchange_strong(&ctx->sticky, &expected, error);
    }
    trace(ctx, op, start, end, error, &outcome);
}

static void *executor_main(void *argument)
{
    struct sim_ctx *ctx = argument;
    pthread_mutex_lock(&ctx->lock);
    for (;;) {
        while (!ctx->head && !ctx->stopping)
            pthread_cond_wait(&ctx->work_cv, &ctx->lock);
        if (!ctx->head)
            break;
        struct sim_op *op = ctx->head;
        ctx->head = op->next;
        if (!ctx->head)
            ctx->tail = NULL;
        pthread_mutex_unlock(&ctx->lock);
        execute(ctx, op);
        pthread_mutex_lock(&ctx->lock);
        ctx->completed = op->seq;
        struct sim_event *event = op->kind == SIM_OP_EVENT ? op->u.event : NULL;
        /* cuEventDestroy on a pending event leaves its release to its last record. */
        if (event && event->magic == SIM_MAGIC_DEAD && event->seq == op->seq)
            free(event);
        pthread_cond_broadcast(&ctx->done_cv);
        pthread_mutex_unlock(&ctx->lock);
        sim_op_free(op);
        pthread_mutex_lock(&ctx->lock);
    }
    pthread_mutex_unlock(&ctx->lock);
    return NULL;
}

void sim_executor_start(struct sim_ctx *ctx)
{
    /* The executor takes no signals: they belong to the application's threads. */
    sigset_t all, previous;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &previous);
    pthread_mutex_lock(&ctx->lock);
    ctx->running = 1;
    ctx->stopping = 0;
    pthread_mutex_unlock(&ctx->lock);
    int error = pthread_create(&ctx->executor, NULL, executor_main, ctx);
    pthread_sigmask(SIG_SETMASK, &previous, NULL);
    if (error) {
        fprintf(stderr, "simcuda: cannot start an executor thread: %s\n", strerror(error));
        abort();
    }
}

void sim_executor_stop(struct sim_ctx *ctx)
{
    pthread_mutex_lock(&ctx->lock);
    ctx->running = 0;
    wait_locked(ctx, ctx->submitted);
    ctx->stopping = 1;
    pthread_cond_signal(&ctx->work_cv);
    pthread_mutex_unlock(&ctx->lock);
    pthread_join(ctx->executor, NULL);
}
