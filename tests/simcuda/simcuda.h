/*
 * Internal declarations of the simulated CUDA driver (libcuda.so.1). Not installed, not part
 * of any ABI: applications see only the entry points of cuda_entry_points.h.
 *
 * Model: device memory is host memory (mmap), every context has one executor thread that runs
 * the operations queued on any of its streams in submission order, and every executed
 * operation can be traced (see cuda_exec.c and docs/architecture.md).
 */
#ifndef SIMCUDA_H
#define SIMCUDA_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "cuda_types.h"
#include "sim_devices.h"

/* The library is built with -fvisibility=hidden: only entry points are exported. */
#define SIM_EXPORT __attribute__((visibility("default")))

#define CU_ENTRY(symbol, base, version, per_thread, params) SIM_EXPORT CUresult symbol params;
#include "cuda_entry_points.h"
#undef CU_ENTRY

/* Not a CUDA entry point: simapp (through dlsym) labels the trace lines of the calling thread. */
SIM_EXPORT void simcudaSetTag(const char *tag);
/* Not a CUDA entry point either: how many threads wait inside the driver for queued work right
 * now, so that a test can tell a blocking call from a slow one without a timer. */
SIM_EXPORT int simcudaBlockedThreads(void);

#define SIM_DRIVER_VERSION 13000
#define SIM_TAG_MAX 128
/* Granularity of cuMemCreate / cuMemMap, as on current data-centre GPUs. */
#define SIM_VMM_GRANULARITY (2u << 20)

/* Handle validation: every object handed out starts with one of these. */
enum sim_magic {
    SIM_MAGIC_CTX = 0x5c7c7a11,
    SIM_MAGIC_STREAM = 0x5c57ea11,
    SIM_MAGIC_EVENT = 0x5ce7e711,
    SIM_MAGIC_MODULE = 0x5c30d011,
    SIM_MAGIC_FUNCTION = 0x5cf0c711,
    SIM_MAGIC_GRAPH = 0x5c6a9811,
    SIM_MAGIC_GRAPH_EXEC = 0x5c6ae711,
    SIM_MAGIC_POOL = 0x5cb0b011,
    SIM_MAGIC_PHYS = 0x5cf1a511,
    SIM_MAGIC_DEAD = 0x5cdead11,
};

/* ---- cuda_init.c: configuration, devices, initialisation state ---- */

struct sim_pool;

struct sim_device {
    int ordinal;         /* CUdevice value seen by the application */
    int index;           /* simulated physical index (UUID, NVML index) */
    char uuid_text[48];  /* GPU-5151ad00-... */
    CUuuid uuid;
    size_t total;        /* SIMCUDA_MEMORY */
    size_t used;         /* non-managed bytes allocated by this process; registry lock */
    struct sim_ctx *primary;      /* created by cuInit, never freed */
    struct sim_pool *default_pool; /* created by cuInit, never freed */
};

/* Written once by cuInit (under its pthread_once), read-only afterwards. */
extern struct sim_device sim_devices[SIM_MAX_DEVICES];
extern int sim_device_count;

/* The driver version it answers as (SIMCUDA_DRIVER_VERSION, at most SIM_DRIVER_VERSION); entry
 * points newer than it are unknown to cuGetProcAddress. */
int sim_driver_version(void);
/* Returns CUDA_SUCCESS when the driver may be used by the calling process. */
CUresult sim_check_init(void);
#define SIM_ENTER()                          \
    do {                                     \
        CUresult sim_enter_result_ = sim_check_init(); \
        if (sim_enter_result_ != CUDA_SUCCESS) \
            return sim_enter_result_;        \
        sim_driver_wait();                   \
    } while (0)

/* Defines an entry point and its _ptds/_ptsz twin with one body (__func__ names each). */
#define SIM_WITH_TWIN(symbol, twin, params, ...) \
    SIM_EXPORT CUresult symbol params { __VA_ARGS__ } \
    SIM_EXPORT CUresult twin params { __VA_ARGS__ }

/* Definitions whose parameters go unused: they keep the names of cuda_entry_points.h. */
#define SIM_IGNORING_PARAMETERS(...)                                                        \
    _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wunused-parameter\"") \
    __VA_ARGS__ _Pragma("GCC diagnostic pop")

/* An entry point of the 32-bit ABI of CUDA 2.x: it exists but cannot be used with the contexts
 * of today's API, the real driver answers CUDA_ERROR_INVALID_CONTEXT. */
#define SIM_32BIT_ABI_ENTRY(symbol, params) \
    SIM_IGNORING_PARAMETERS(SIM_EXPORT CUresult symbol params { SIM_ENTER(); return CUDA_ERROR_INVALID_CONTEXT; })

/* An entry point and its twin for a feature that is not simulated (CUDA arrays, 3D batches). */
#define SIM_NOT_SUPPORTED_WITH_TWIN(symbol, twin, params) \
    SIM_IGNORING_PARAMETERS(SIM_WITH_TWIN(symbol, twin, params, SIM_ENTER(); return CUDA_ERROR_NOT_SUPPORTED;))

struct sim_device *sim_device_get(CUdevice ordinal); /* NULL when out of range */
/* Declares `out`, the device of ordinal `dev`; returns CUDA_ERROR_INVALID_DEVICE when there is none. */
#define SIM_REQUIRE_DEVICE(dev, out)                  \
    struct sim_device *out = sim_device_get(dev);     \
    if (!out)                                         \
        return CUDA_ERROR_INVALID_DEVICE
/* Zeroed memory for the driver's own objects; aborts (with a message) when the host is out of
 * memory, which the simulation cannot report as a device error. */
void *sim_calloc(size_t count, size_t size);
double sim_now(void);                               /* CLOCK_MONOTONIC seconds */

/* ---- cuda_context.c: contexts and the per-thread current-context stack ---- */

struct sim_op;

struct sim_ctx {
    enum sim_magic magic;
    int id;                       /* small number for the trace, unique per process */
    struct sim_device *device;
    int is_primary;
    unsigned int flags;           /* cuda_context.c's admin lock */
    int retained;                 /* primary context: retain count; admin lock */
    atomic_int active;            /* usable by the application */
    atomic_int sticky;            /* first asynchronous failure (CUresult); the context stays broken */
    /* The fields below are guarded by `lock`. */
    pthread_mutex_t lock;
    pthread_cond_t work_cv;       /* executor waits for work or for `stopping` */
    pthread_cond_t done_cv;       /* waiters wait for `completed` to advance */
    int running;                  /* executor started and not told to stop: accepts work */
    int stopping;
    struct sim_op *head, *tail;   /* queued, not yet started */
    struct sim_stream *captures;  /* streams in capture (active or invalidated), linked by next_capture */
    uint64_t submitted;           /* sequence number of the last queued operation */
    uint64_t completed;           /* sequence number of the last finished operation */
    pthread_t executor;
};

/* A context object, not yet active. Aborts on memory exhaustion. */
struct sim_ctx *sim_ctx_new(struct sim_device *device, int is_primary, unsigned int flags);

/* Validates an application-supplied context handle (NULL is not valid). */
CUresult sim_ctx_check(CUcontext handle, struct sim_ctx **out);
/* Whether work may be submitted to the context: CUDA_ERROR_INVALID_CONTEXT when it is not a live
 * context, its sticky error when it has one. */
CUresult sim_ctx_usable(struct sim_ctx *ctx);
/* The current context if there is a usable one (sim_ctx_usable says why not). */
CUresult sim_ctx_require(struct sim_ctx **out);

/* ---- cuda_exec.c: operation queue, executor, trace ---- */

enum sim_kernel_kind { SIM_KERNEL_SLEEP, SIM_KERNEL_FILL, SIM_KERNEL_ALLREDUCE };

/* Bytes spanned by `height` rows of `width` bytes in each of `depth` slices. */
static inline size_t sim_extent(size_t width, size_t height, size_t depth, size_t pitch, size_t slice)
{
    return (depth - 1) * slice + (height - 1) * pitch + width;
}

/* A strided 3D copy; 1D and 2D copies have depth (and height) 1. */
/* The engines of a device's residency model (cuda_residency.c): the compute engine, the link's
 * copy engine in each direction, and the turns that copies of managed memory take (either way,
 * whichever process: on an H200 two processes' managed copies the opposite ways ran at 24 GB/s
 * each where cuMemAlloc memory's ran at 51 and 50, benchmarks/results/swap-paths-h200-2026-11-28-handoff.json). */
enum sim_engine { SIM_ENGINE_COMPUTE, SIM_ENGINE_D2H, SIM_ENGINE_H2D, SIM_ENGINE_MANAGED_LINK, SIM_ENGINE_COUNT };

struct sim_copy {
    uintptr_t dst, src;
    size_t width, height, depth;
    size_t dst_pitch, src_pitch;  /* bytes between rows */
    size_t dst_slice, src_slice;  /* bytes between slices */
    int check_dst, check_src;     /* side must lie in driver memory when the copy executes */
    /* The link the copy crosses (device-side memory on one end, host memory on the other):
     * SIM_ENGINE_D2H or SIM_ENGINE_H2D, SIM_ENGINE_COMPUTE when it crosses none; `pageable`:
     * its host side is not pinned. */
    enum sim_engine link;
    int pageable;
    int managed;                  /* its device side is managed memory */
};

struct sim_set {
    uintptr_t dst;
    size_t pitch;                 /* bytes between rows */
    size_t width, height;         /* in elements */
    unsigned int element_size;    /* 1, 2 or 4 */
    uint32_t value;
};

/* Several copies executed as one operation (cuMemcpyBatchAsync). */
struct sim_batch {
    size_t count;
    struct sim_copy *copies;
};

enum sim_op_kind {
    SIM_OP_KERNEL,
    SIM_OP_MEMCPY,
    SIM_OP_BATCH,
    SIM_OP_MEMSET,
    SIM_OP_PREFETCH,
    SIM_OP_HOST_FN,
    SIM_OP_EVENT,                 /* stamps an event */
    SIM_OP_WAIT,                  /* waits for another context's sequence number */
    SIM_OP_FREE,                  /* stream-ordered free */
    SIM_OP_DISCARD,               /* cuMemDiscardBatchAsync of one range */
};

struct sim_event;

struct sim_op {
    struct sim_op *next;
    enum sim_op_kind kind;
    uint64_t seq;
    const char *api;              /* entry point that submitted it (a string literal) */
    char tag[SIM_TAG_MAX];        /* submitting thread's tag, "" when none */
    void *staging;                /* copy of pageable source bytes, freed with the operation */
    union {
        struct {
            enum sim_kernel_kind kind;
            uint64_t duration_us;
            uintptr_t dst;
            uint32_t value;
            uint64_t count;
        } kernel;
        struct sim_copy copy;
        struct sim_batch batch;
        struct sim_set set;
        struct {
            uintptr_t ptr;
            size_t bytes;
            struct sim_device *target; /* NULL: the host */
            int discard;               /* cuMemDiscardAndPrefetchBatchAsync: nothing is copied */
            size_t range;              /* its place among a batch call's ranges (traced: a test
                                        * counts calls by their first ranges) */
        } prefetch;                    /* also SIM_OP_DISCARD (ptr, bytes) */
        struct {
            CUhostFn fn;
            void *data;
        } host;
        struct sim_event *event;
        struct {
            struct sim_ctx *ctx;
            uint64_t seq;
        } wait;
        uintptr_t free_ptr;
    } u;
};

struct sim_graph;

struct sim_stream {
    enum sim_magic magic;
    struct sim_ctx *ctx;
    unsigned int flags;
    int priority;
    uint64_t last_seq;            /* ctx->lock */
    /* Stream capture, all under ctx->lock. `capture` is non-NULL from cuStreamBeginCapture* to
     * cuStreamEndCapture, also after the capture was invalidated. */
    struct sim_graph *capture;
    CUstreamCaptureStatus capture_status; /* ACTIVE or INVALIDATED while `capture` is set */
    CUstreamCaptureMode capture_mode;
    int capture_graph_is_callers; /* cuStreamBeginCaptureToGraph: the graph is not ours to free */
    struct sim_stream *next_capture;
};

struct sim_event {
    enum sim_magic magic;
    unsigned int flags;
    /* Guarded by the lock of `ctx` (the context of the last record). */
    struct sim_ctx *ctx;
    uint64_t seq;                 /* 0: never recorded */
    double time;                  /* when the record executed */
};

/* A new operation of `kind` tagged with the calling thread's tag. Aborts on memory exhaustion. */
struct sim_op *sim_op_new(enum sim_op_kind kind, const char *api);
/* A copy of `op` submitted by the calling thread through `api` (graph capture and launch). */
struct sim_op *sim_op_clone(const struct sim_op *op, const char *api);
void sim_op_free(struct sim_op *op);

/* Resolves a stream argument: NULL, CU_STREAM_LEGACY and CU_STREAM_PER_THREAD name the current
 * context's default stream (*stream_out = NULL); other handles are validated. */
CUresult sim_stream_resolve(CUstream handle, struct sim_ctx **ctx_out, struct sim_stream **stream_out);

/* Queues `op` on the stream (appends it to the graph being captured, if any). With `wait`, returns
 * once it has executed, with the context's sticky error. Takes ownership of `op`. */
CUresult sim_submit(struct sim_ctx *ctx, struct sim_stream *stream, struct sim_op *op, int wait);
/* Waits until the context has executed `seq`. */
void sim_wait(struct sim_ctx *ctx, uint64_t seq);
/* Waits until the context has executed everything queued so far. */
void sim_drain(struct sim_ctx *ctx);

void sim_executor_start(struct sim_ctx *ctx);
/* Drains, then stops and joins the executor. */
void sim_executor_stop(struct sim_ctx *ctx);
/* Opens SIMCUDA_TRACE (called by cuInit). */
CUresult sim_trace_open(void);
/* Appends one trace line: pid, dev and ctx of `ctx`, then `fields` (JSON members), start, end. */
void sim_trace_write(const struct sim_ctx *ctx, const char *fields, double start, double end);
void sim_sleep_until(double deadline);              /* CLOCK_MONOTONIC seconds */
/* Appends a capture event ("begin", "end", "invalidated") of one of the context's streams to the
 * trace; `api` is the entry point that caused it, `mode` the capture mode's name. */
void sim_trace_capture(const struct sim_ctx *ctx, const char *event, const char *api, const char *mode);

/* ---- cuda_graph.c ---- */

/* Appends `op` to a graph under capture; ownership passes (ctx->lock held by the caller). */
void sim_graph_append(struct sim_graph *graph, struct sim_op *op);
/* Whether the stream is being captured (operations that cannot be captured check this). */
int sim_stream_capturing(struct sim_stream *stream);
/* With ctx->lock held, for a synchronisation that is illegal during capture: `stream` NULL for
 * the whole context (cuCtxSynchronize), else that stream. When the synchronisation would wait for
 * a stream in capture, every such capture is invalidated (traced with `api`) and the result is
 * CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED; otherwise CUDA_SUCCESS. */
CUresult sim_capture_sync_locked(struct sim_ctx *ctx, struct sim_stream *stream, const char *api);
/* With ctx->lock held: the stream leaves capture (its graph is returned, not freed). */
struct sim_graph *sim_capture_detach_locked(struct sim_stream *stream);
/* Frees a graph, a graph exec or an abandoned capture, with its operations. */
void sim_graph_free(struct sim_graph *graph);

/* ---- cuda_memory.c: allocations and the address registry ---- */

/* cuInit: the memory knobs (SIMCUDA_HOST_REGISTER_ERROR). */
CUresult sim_mem_open(void);

enum sim_family {
    SIM_MEM_DEVICE,    /* cuMemAlloc_v2, cuMemAllocPitch_v2 */
    SIM_MEM_POOL,      /* cuMemAllocAsync, cuMemAllocFromPoolAsync */
    SIM_MEM_MANAGED,   /* cuMemAllocManaged */
    SIM_MEM_HOST,      /* cuMemAllocHost_v2, cuMemHostAlloc */
    SIM_MEM_VMM,       /* a range mapped with cuMemMap */
    SIM_MEM_IPC,       /* a range opened with cuIpcOpenMemHandle */
};

struct sim_phys;

/* Residency hints of a range of device memory (cuda_residency.c), per 2 MiB chunk: the slot of
 * the device's shared table it was last put in, and what is known of its host pages. */
struct sim_chunks {
    int32_t *slots;
    uint8_t *state;
};

struct sim_alloc {
    uintptr_t start;
    size_t size;
    enum sim_family family;
    struct sim_device *device;
    struct sim_ctx *ctx;
    struct sim_pool *pool;        /* SIM_MEM_POOL */
    struct sim_phys *phys;        /* SIM_MEM_VMM */
    size_t charged;               /* bytes counted in device->used */
    uint64_t access;              /* the devices (bit: ordinal) whose work may read and write it:
                                     VMM mappings get theirs with cuMemSetAccess, one device at a
                                     time; every other family SIM_ACCESS_ALL */
    int free_queued;              /* a cuMemFreeAsync for it is queued */
    int shared_fd;                /* memfd backing once exported with cuIpcGetMemHandle, or -1 */
    int registered;               /* SIM_MEM_HOST: pageable memory pinned by cuMemHostRegister */
    struct sim_chunks chunks;     /* residency modelled: managed memory (where each chunk is) and
                                     physical device memory (the fixed slots it holds) */
};

/* The registry lock. Executors hold it for reading while they touch driver memory, so that
 * nothing is unmapped under them; allocation and free take it for writing. */
void sim_mem_read_lock(void);
void sim_mem_write_lock(void);
void sim_mem_unlock(void);
/* With the lock held: the allocation containing [ptr, ptr + bytes), or NULL. */
struct sim_alloc *sim_mem_find_range(uintptr_t ptr, size_t bytes);
/* With the write lock held: records a copy of `prototype` (NULL when out of host memory), and
 * forgets a record (freeing it, not the memory it describes). */
struct sim_alloc *sim_mem_add(const struct sim_alloc *prototype);
void sim_mem_remove(struct sim_alloc *alloc);
/* With the write lock held: counts bytes against the device budget (-1 when they do not fit). */
int sim_mem_charge(struct sim_device *device, size_t bytes);
void sim_mem_uncharge(struct sim_device *device, size_t bytes);

/* With the lock held: whether any allocation overlaps [ptr, ptr + bytes). */
int sim_mem_overlaps(uintptr_t ptr, size_t bytes);
#define SIM_ACCESS_ALL UINT64_MAX
/* With the lock held: whether work of `device` (NULL: of any device) may access [ptr, ptr +
 * bytes). */
int sim_mem_range_ok(uintptr_t ptr, size_t bytes, const struct sim_device *device);
/* Without the lock: whether [ptr, ptr + bytes) lies in driver memory; and whether it is pinned
 * host memory or managed memory (so that copies from it need no staging). */
int sim_mem_range_known(uintptr_t ptr, size_t bytes, enum sim_family *family);
/* Without the lock: whether a copy or memset that work of `device` makes would find
 * [ptr, ptr + bytes) mapped VMM memory it has no access to. The real driver refuses such a copy
 * when it is made (measured on an H200: CUDA_ERROR_INVALID_VALUE), as one of unmapped memory. */
int sim_mem_vmm_refused(uintptr_t ptr, size_t bytes, const struct sim_device *device);
/* Executes a stream-ordered free (executor thread, no lock held). */
void sim_mem_free_now(uintptr_t ptr);
/* Frees every allocation owned by a context that is being destroyed. */
void sim_mem_release_ctx(struct sim_ctx *ctx);
/* With the lock held: calls fn for every managed allocation of the process on `device`. */
void sim_mem_for_each_managed(const struct sim_device *device, void (*fn)(struct sim_alloc *, void *), void *argument);
/* A memory pool of the device: its default one (created by cuInit) or one cuMemPoolCreate makes.
 * Aborts on memory exhaustion. */
struct sim_pool *sim_pool_new(struct sim_device *device, int is_default);

/* ---- cuda_residency.c: where managed memory lives, shared by the processes of a machine ---- */

/* Residency is tracked in chunks of this size. */
#define SIM_CHUNK_BYTES ((size_t)2 << 20)
/* Maps the shared state of every device when SIMCUDA_RESIDENCY_DIR is set (called by cuInit). */
CUresult sim_residency_open(void);
int sim_residency_models(const struct sim_device *device);
/* Whether a prefetch to a device migrates in the calling thread, leaving nothing on its stream
 * (SIMCUDA_PREFETCH_IN_CALL). */
int sim_residency_prefetch_in_call(void);
/* Seconds a kernel runs before it lets other processes' work onto the simulated GPU. */
double sim_residency_timeslice(void);
/* Fair, process-shared turns on the simulated GPU for kernels and prefetches (no-ops when
 * residency is not modelled). */
void sim_engine_enter(const struct sim_device *device);
void sim_engine_leave(const struct sim_device *device);
/* Executor, no lock held: moves `bytes` over the device's link in `direction` (SIM_ENGINE_D2H or
 * _H2D) at the pinned or pageable rate, taking turns with other copies in that direction and,
 * when its device side is `managed` memory, with every other copy of managed memory; returns
 * the seconds spent waiting for turns (0 when residency is not modelled). */
double sim_link_transfer(const struct sim_device *device, enum sim_engine direction, size_t bytes, int pageable,
                         int managed);
/* How host memory was pinned: allocated by the driver (cuMemHostAlloc, cuMemAllocHost) or the
 * application's own, registered (cuMemHostRegister). */
enum sim_pinning { SIM_PIN_ALLOCATED, SIM_PIN_REGISTERED };
/* When residency is modelled: the calling thread pays for pinning `bytes` of host memory at
 * `ptr`, and the pinning is traced ("pin"); sim_unpin_trace traces its end ("unpin"). */
void sim_pin_cost(const struct sim_ctx *ctx, void *ptr, size_t bytes, enum sim_pinning how);
/* Waits while a registration of host memory runs in the process (sim_pin_cost): the real driver
 * holds every other call of the process meanwhile. Every entry point calls it (SIM_ENTER). */
void sim_driver_wait(void);
void sim_unpin_trace(const struct sim_ctx *ctx, uintptr_t ptr, size_t bytes, enum sim_pinning how);
/* With the registry write-locked: gives a new managed allocation its chunk hints (-1 when out
 * of host memory), and frees its chunks' slots when it goes. */
int sim_residency_adopt(struct sim_alloc *alloc);
void sim_residency_forget(struct sim_alloc *alloc);
/* No lock held: physical device memory of `size` bytes (identified by `key`, an address of the
 * process) takes fixed slots, evicting managed chunks for room (the calling thread pays);
 * CUDA_ERROR_OUT_OF_MEMORY when the device is full of physical memory. unfix gives them back. */
CUresult sim_residency_fix(struct sim_device *device, uint64_t key, size_t size, struct sim_chunks *chunks);
void sim_residency_unfix(struct sim_device *device, uint64_t key, size_t size, struct sim_chunks *chunks);
/* Executor, no lock held: cuMemDiscardBatchAsync of [ptr, ptr + bytes): the process's chunks there
 * leave the device without being moved, and the range's contents become indeterminate (zero).
 * Returns the resident bytes given up. */
size_t sim_residency_discard(struct sim_ctx *ctx, uintptr_t ptr, size_t bytes);
/* Executor, holding the engine, no lock held: makes the memory `op` (a kernel or a prefetch)
 * touches resident (or, for a prefetch to the host, not), sleeping for the cost and tracing
 * the migrations. */
void sim_residency_touch(struct sim_ctx *ctx, const struct sim_op *op);

/* ---- cuda_collective.c: nvshare_allreduce ---- */

/* cuInit: SIMCUDA_COLLECTIVE, the group this process's all-reduces join. */
CUresult sim_collective_open(void);
/* Executor, no lock held: contributes the all-reduce's value, waits for every rank's matching
 * one, and leaves the sum in op->u.kernel.value (then written like nvshare_fill's). */
CUresult sim_collective_join(struct sim_ctx *ctx, struct sim_op *op);

/* ---- cuda_module.c ---- */

struct sim_function {
    enum sim_magic magic;
    enum sim_kernel_kind kind;
    const char *name;
};

#endif
