/*
 * simapp: drives a CUDA driver the way an application does, one step per command-line word,
 * and prints one JSON line per step. Written for end-to-end tests of the interceptor against the
 * simulated driver; with --module=<ptx> it also runs on a real GPU. The step language is
 * documented in README.md.
 *
 * (Some 1,450 lines: one function for each of its forty-odd steps, and the table of every copy
 * and memset entry point that `copy:` calls with its own arguments. It stays one program because
 * the steps share its state: the resolved entry points, the buffers that later steps name by
 * number, and each thread's current device and stream.)
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cuda_types.h"
#include "sim_devices.h"

/* Prototypes (for --entry=direct) and function-pointer types of every entry point. Weak, so
 * that simapp also starts on a real driver older than the simulated one (driver 580 lacks the
 * CUDA 13.2 entry points): a symbol that driver does not export binds to NULL, and the step
 * that needs it reports the lookup as failed instead of the loader refusing to start. */
#define CU_ENTRY(symbol, base, version, per_thread, params) \
    CUresult symbol params __attribute__((weak));             \
    typedef CUresult(*symbol##_fn) params;
#include "cuda_entry_points.h"
#undef CU_ENTRY

enum api_id {
#define CU_ENTRY(symbol, base, version, per_thread, params) API_##symbol,
#include "cuda_entry_points.h"
#undef CU_ENTRY
    API_COUNT
};

struct api {
    const char *symbol, *base;
    int version, per_thread;
    void *direct;                 /* the exported symbol, bound at link time */
    void *resolved;               /* what --entry gave; NULL when the lookup failed */
};

static struct api apis[API_COUNT] = {
#define CU_ENTRY(symbol, base, version, per_thread, params) {#symbol, #base, version, per_thread, (void *)symbol, NULL},
#include "cuda_entry_points.h"
#undef CU_ENTRY
};

/* ---- Options and shared state ---- */

enum entry_mode { ENTRY_GPA, ENTRY_DLSYM, ENTRY_DIRECT };
static enum entry_mode entry_mode = ENTRY_GPA;
static const char *const entry_names[] = {"gpa", "dlsym", "direct"};
static int per_thread_streams;       /* --ptds */
static const char *module_path;      /* --module */
static void (*set_tag)(const char *); /* simcudaSetTag, when the driver has it */

#define MAX_BUFFERS 4096
#define SCRATCH_BYTES (64u << 10)

enum family {
    FAMILY_PLAIN, FAMILY_PITCH, FAMILY_ASYNC, FAMILY_POOL, FAMILY_MANAGED, FAMILY_VMM, FAMILY_VMM_SHAREABLE,
    FAMILY_HOST, FAMILY_REGISTERED, FAMILY_REGISTERED_THP, FAMILY_REGISTERED_SHARED, FAMILY_IPC
};
static const char *const family_names[] = {"plain", "pitch",         "async", "pool",       "managed",
                                           "vmm",   "vmm-shareable", "host",  "registered", "registered-thp",
                                           "registered-shared", "ipc"};

struct buffer {
    CUdeviceptr ptr;
    size_t bytes;
    enum family family;
    int device;
    CUmemGenericAllocationHandle vmm_handle;
    size_t vmm_bytes;             /* rounded to the granularity */
};

struct device_state {
    int ready;
    CUcontext ctx;
    CUfunction sleep, fill, allreduce;
    CUmemoryPool pool;            /* created by the first "pool" allocation */
    CUdeviceptr scratch_a, scratch_b;
    void *pinned;
};

/* Written under state_lock; buffers are appended, never moved. */
static pthread_mutex_t state_lock = PTHREAD_MUTEX_INITIALIZER;
static struct buffer buffers[MAX_BUFFERS];
static int buffer_count;
static struct device_state devices[SIM_MAX_DEVICES];

/* Per thread: the device and stream later steps use, the tag, and the thread number. */
static __thread int current_device;
static __thread CUstream current_stream;
static __thread char current_tag[128];
static __thread int thread_number;

static atomic_int any_failure; /* set when a step of any thread fails */

/* ---- Resolution ---- */

static void *api_pointer(enum api_id id)
{
    return apis[id].resolved;
}

#define FN(symbol) ((symbol##_fn)api_pointer(API_##symbol))
/* The per-thread-default-stream twin under --ptds, as code built with --default-stream per-thread. */
#define STREAM_FN(legacy, twin) ((legacy##_fn)api_pointer(per_thread_streams ? API_##twin : API_##legacy))

static int find_api(const char *symbol)
{
    for (int i = 0; i < API_COUNT; i++)
        if (strcmp(apis[i].symbol, symbol) == 0)
            return i;
    return -1;
}

/* Resolves every entry point up front, as the CUDA runtime does at its initialisation. */
static int resolve_all(void)
{
    void *library = NULL;
    if (entry_mode != ENTRY_DIRECT) {
        library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
        if (!library) {
            fprintf(stderr, "simapp: dlopen libcuda.so.1: %s\n", dlerror());
            return -1;
        }
    }
    set_tag = (void (*)(const char *))dlsym(RTLD_DEFAULT, "simcudaSetTag");
    if (entry_mode == ENTRY_DIRECT) {
        for (int i = 0; i < API_COUNT; i++)
            apis[i].resolved = apis[i].direct;
        return 0;
    }
    if (entry_mode == ENTRY_DLSYM) {
        for (int i = 0; i < API_COUNT; i++)
            apis[i].resolved = dlsym(library, apis[i].symbol);
        return 0;
    }
    /* cudart: dlsym cuGetProcAddress_v2, then ask it for cuGetProcAddress itself, then resolve
     * every function by base name through the pointer that came back, each with the CUDA
     * version of the ABI it wants. */
    cuGetProcAddress_v2_fn bootstrap = (cuGetProcAddress_v2_fn)dlsym(library, "cuGetProcAddress_v2");
    if (!bootstrap) {
        fprintf(stderr, "simapp: libcuda.so.1 has no cuGetProcAddress_v2\n");
        return -1;
    }
    void *pointer = NULL;
    CUdriverProcAddressQueryResult status;
    CUresult result = bootstrap("cuGetProcAddress", &pointer, 12000, CU_GET_PROC_ADDRESS_DEFAULT, &status);
    if (result != CUDA_SUCCESS || !pointer) {
        fprintf(stderr, "simapp: cuGetProcAddress(\"cuGetProcAddress\", 12000) failed: %d\n", result);
        return -1;
    }
    cuGetProcAddress_v2_fn lookup = (cuGetProcAddress_v2_fn)pointer;
    for (int i = 0; i < API_COUNT; i++) {
        cuuint64_t flags = apis[i].per_thread ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM : CU_GET_PROC_ADDRESS_DEFAULT;
        if (lookup(apis[i].base, &pointer, apis[i].version, flags, &status) == CUDA_SUCCESS)
            apis[i].resolved = pointer;
    }
    return 0;
}

/* ---- Output ---- */

struct line {
    char text[4096];
    size_t length;
};

static void add(struct line *line, const char *format, ...)
{
    va_list args;
    va_start(args, format);
    int written = vsnprintf(line->text + line->length, sizeof line->text - line->length, format, args);
    va_end(args);
    if (written > 0)
        line->length = line->length + (size_t)written < sizeof line->text ? line->length + (size_t)written
                                                                           : sizeof line->text - 1;
}

/* A JSON string body with quotes, backslashes and control characters escaped. */
static void add_escaped(struct line *line, const char *value)
{
    for (; *value; value++) {
        unsigned char c = (unsigned char)*value;
        if (c == '"' || c == '\\')
            add(line, "\\%c", c);
        else if (c < 0x20)
            add(line, "\\u%04x", c);
        else
            add(line, "%c", c);
    }
}

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* A step's result: the CUDA result (or -1 for an entry point that did not resolve) plus fields. */
struct outcome {
    int rc;
    int failed;                   /* a check failed although every call succeeded */
    struct line fields;
};

static void print_step(const char *step, int number, const struct outcome *outcome, double start, double end)
{
    struct line line = {.length = 0};
    add(&line, "{\"step\": \"");
    add_escaped(&line, step);
    add(&line, "\", \"n\": %d, \"pid\": %d, \"thread\": %d, \"rc\": %d", number, (int)getpid(), thread_number, outcome->rc);
    if (outcome->rc == -1) {
        add(&line, ", \"error\": \"unresolved\"");
    } else if (outcome->rc != 0) {
        const char *name = NULL;
        if (FN(cuGetErrorName) && FN(cuGetErrorName)(outcome->rc, &name) == CUDA_SUCCESS && name)
            add(&line, ", \"error\": \"%s\"", name);
    }
    add(&line, "%.*s, \"start\": %.9f, \"end\": %.9f}\n", (int)outcome->fields.length, outcome->fields.text, start, end);
    /* One write per line: the lines of threads and forked children never interleave. */
    if (write(STDOUT_FILENO, line.text, line.length) < 0)
        _exit(3);
    if (outcome->rc != 0 || outcome->failed)
        any_failure = 1;
}

static void usage_error(const char *format, const char *argument)
{
    fprintf(stderr, "simapp: ");
    fprintf(stderr, format, argument);
    fprintf(stderr, "\n");
    exit(2);
}

/* Memory for simapp's own bookkeeping: running out ends the run like a usage error. */
static void *host_calloc(size_t count, size_t size)
{
    void *memory = calloc(count, size);
    if (!memory)
        usage_error("out of host memory%s", "");
    return memory;
}

/* Calls an entry point through its resolved pointer; -1 when it did not resolve. */
#define CALL(pointer, ...) ((pointer) ? (int)(pointer)(__VA_ARGS__) : -1)

/* ---- Argument parsing ---- */

static unsigned long long parse_number(const char *text, const char *what)
{
    char *end;
    errno = 0;
    unsigned long long value = strtoull(text, &end, 0);
    if (errno || end == text || *end)
        usage_error("not a number: %s", what);
    return value;
}

static size_t parse_bytes(const char *text)
{
    size_t bytes;
    if (sim_parse_size(text, &bytes) != 0)
        usage_error("not a byte count (K, M, G suffixes): %s", text);
    return bytes;
}

/* Splits "a:b:c" in place; returns the number of fields (at most `max`, the last keeps the rest). */
static int split(char *text, char **fields, int max)
{
    int count = 0;
    fields[count++] = text;
    while (count < max) {
        char *colon = strchr(fields[count - 1], ':');
        if (!colon)
            break;
        *colon = '\0';
        fields[count++] = colon + 1;
    }
    return count;
}

/* ---- Devices ---- */

static char *read_file(const char *path)
{
    FILE *file = fopen(path, "rb");
    if (!file)
        usage_error("cannot read the module %s", path);
    fseek(file, 0, SEEK_END);
    long size = ftell(file);
    if (size < 0)
        usage_error("cannot read the module %s", path);
    fseek(file, 0, SEEK_SET);
    char *data = host_calloc(1, (size_t)size + 1);
    if (fread(data, 1, (size_t)size, file) != (size_t)size)
        usage_error("cannot read the module %s", path);
    fclose(file);
    return data;
}

/* Retains the device's primary context, makes it current and loads the kernels (once). */
static int use_device(int ordinal)
{
    if (ordinal < 0 || ordinal >= SIM_MAX_DEVICES)
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&state_lock);
    struct device_state *device = &devices[ordinal];
    int rc = CUDA_SUCCESS;
    if (!device->ready) {
        CUdevice handle;
        rc = CALL(FN(cuDeviceGet), &handle, ordinal);
        if (rc == CUDA_SUCCESS)
            rc = CALL(FN(cuDevicePrimaryCtxRetain), &device->ctx, handle);
        if (rc == CUDA_SUCCESS)
            rc = CALL(FN(cuCtxSetCurrent), device->ctx);
        static char *image;
        if (!image)
            image = module_path ? read_file(module_path) : strdup("simapp: any image loads in the simulated driver");
        CUmodule module;
        if (rc == CUDA_SUCCESS)
            rc = CALL(FN(cuModuleLoadData), &module, image);
        if (rc == CUDA_SUCCESS)
            rc = CALL(FN(cuModuleGetFunction), &device->sleep, module, "nvshare_sleep");
        if (rc == CUDA_SUCCESS)
            rc = CALL(FN(cuModuleGetFunction), &device->fill, module, "nvshare_fill");
        if (rc == CUDA_SUCCESS && !module_path) /* the simulated driver's collective (no PTX of it) */
            rc = CALL(FN(cuModuleGetFunction), &device->allreduce, module, "nvshare_allreduce");
        device->ready = rc == CUDA_SUCCESS;
    }
    if (rc == CUDA_SUCCESS)
        rc = CALL(FN(cuCtxSetCurrent), device->ctx);
    pthread_mutex_unlock(&state_lock);
    if (rc == CUDA_SUCCESS) {
        current_device = ordinal;
        current_stream = NULL;
    }
    return rc;
}

static struct device_state *here(void)
{
    return &devices[current_device];
}

/* ---- Buffers ---- */

static int add_buffer(struct buffer buffer)
{
    pthread_mutex_lock(&state_lock);
    int index = buffer_count < MAX_BUFFERS ? buffer_count++ : -1;
    if (index >= 0)
        buffers[index] = buffer;
    pthread_mutex_unlock(&state_lock);
    if (index < 0)
        usage_error("more than %s buffers", "4096");
    return index;
}

static struct buffer *get_buffer(const char *text)
{
    unsigned long long index = parse_number(text, text);
    pthread_mutex_lock(&state_lock);
    int count = buffer_count;
    pthread_mutex_unlock(&state_lock);
    if (index >= (unsigned long long)count)
        usage_error("no buffer %s", text);
    return &buffers[index];
}

static int allocate_vmm(struct buffer *buffer)
{
    CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
                                .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = current_device}};
    if (buffer->family == FAMILY_VMM_SHAREABLE) /* exportable as a file descriptor, as PyTorch asks */
        prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    size_t granularity;
    int rc = CALL(FN(cuMemGetAllocationGranularity), &granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
    if (rc != CUDA_SUCCESS)
        return rc;
    buffer->vmm_bytes = (buffer->bytes + granularity - 1) / granularity * granularity;
    rc = CALL(FN(cuMemCreate), &buffer->vmm_handle, buffer->vmm_bytes, &prop, 0);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = CALL(FN(cuMemAddressReserve), &buffer->ptr, buffer->vmm_bytes, 0, 0, 0);
    if (rc == CUDA_SUCCESS)
        rc = CALL(FN(cuMemMap), buffer->ptr, buffer->vmm_bytes, 0, buffer->vmm_handle, 0);
    CUmemAccessDesc access = {.location = prop.location, .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    if (rc == CUDA_SUCCESS)
        rc = CALL(FN(cuMemSetAccess), buffer->ptr, buffer->vmm_bytes, &access, 1);
    return rc;
}

static int pool_for_device(CUmemoryPool *pool)
{
    pthread_mutex_lock(&state_lock);
    int rc = CUDA_SUCCESS;
    if (!here()->pool) {
        CUmemPoolProps props = {.allocType = CU_MEM_ALLOCATION_TYPE_PINNED,
                                .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = current_device}};
        rc = CALL(FN(cuMemPoolCreate), &here()->pool, &props);
    }
    *pool = here()->pool;
    pthread_mutex_unlock(&state_lock);
    return rc;
}

static void step_alloc(char **args, int count, struct outcome *out)
{
    if (count != 3)
        usage_error("alloc:<family>:<bytes> expected, got %s", args[0]);
    struct buffer buffer = {.bytes = parse_bytes(args[2]), .device = current_device};
    int family = -1;
    for (int i = 0; i < FAMILY_IPC; i++)
        if (strcmp(args[1], family_names[i]) == 0)
            family = i;
    if (family < 0)
        usage_error("unknown allocation family %s (plain, pitch, async, pool, managed, vmm, vmm-shareable, host, "
                    "registered, registered-thp, registered-shared)", args[1]);
    buffer.family = (enum family)family;
    size_t pitch = 0;
    CUmemoryPool pool;
    switch (buffer.family) {
    case FAMILY_PLAIN:
        out->rc = CALL(FN(cuMemAlloc_v2), &buffer.ptr, buffer.bytes);
        break;
    case FAMILY_PITCH:
        out->rc = CALL(FN(cuMemAllocPitch_v2), &buffer.ptr, &pitch, buffer.bytes, 1, 4);
        break;
    case FAMILY_ASYNC:
        out->rc = CALL(STREAM_FN(cuMemAllocAsync, cuMemAllocAsync_ptsz), &buffer.ptr, buffer.bytes, current_stream);
        break;
    case FAMILY_POOL:
        out->rc = pool_for_device(&pool);
        if (out->rc == CUDA_SUCCESS)
            out->rc = CALL(STREAM_FN(cuMemAllocFromPoolAsync, cuMemAllocFromPoolAsync_ptsz), &buffer.ptr, buffer.bytes,
                           pool, current_stream);
        break;
    case FAMILY_MANAGED:
        out->rc = CALL(FN(cuMemAllocManaged), &buffer.ptr, buffer.bytes, CU_MEM_ATTACH_GLOBAL);
        break;
    case FAMILY_VMM:
    case FAMILY_VMM_SHAREABLE:
        out->rc = allocate_vmm(&buffer);
        break;
    case FAMILY_HOST: {
        void *host = NULL;
        out->rc = CALL(FN(cuMemAllocHost_v2), &host, buffer.bytes);
        buffer.ptr = (CUdeviceptr)(uintptr_t)host;
        break;
    }
    case FAMILY_REGISTERED:
    case FAMILY_REGISTERED_THP: {
        void *host = mmap(NULL, buffer.bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (host == MAP_FAILED)
            usage_error("cannot map %s of host memory", args[2]);
        if (buffer.family == FAMILY_REGISTERED_THP && madvise(host, buffer.bytes, MADV_HUGEPAGE) != 0)
            usage_error("cannot advise %s of host memory to transparent huge pages", args[2]);
        out->rc = CALL(FN(cuMemHostRegister_v2), host, buffer.bytes, 0);
        buffer.ptr = (CUdeviceptr)(uintptr_t)host;
        break;
    }
    case FAMILY_REGISTERED_SHARED: {
        /* The file SIMAPP_SHARED_FILE names, mapped MAP_SHARED (made and sized if it is not
         * there yet, its pages left to whoever touches them first), as nvshare's swap pool maps
         * its segments in every process. */
        const char *path = getenv("SIMAPP_SHARED_FILE");
        if (!path)
            usage_error("%s needs SIMAPP_SHARED_FILE, the file to map", args[0]);
        int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
        if (fd < 0 || ftruncate(fd, (off_t)buffer.bytes) != 0)
            usage_error("cannot make SIMAPP_SHARED_FILE %s long", args[2]);
        void *host = mmap(NULL, buffer.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        close(fd);
        if (host == MAP_FAILED)
            usage_error("cannot map %s", path);
        out->rc = CALL(FN(cuMemHostRegister_v2), host, buffer.bytes, CU_MEMHOSTREGISTER_PORTABLE);
        buffer.ptr = (CUdeviceptr)(uintptr_t)host;
        break;
    }
    case FAMILY_IPC:
        break;
    }
    if (out->rc == CUDA_SUCCESS) {
        add(&out->fields, ", \"index\": %d, \"ptr\": %llu", add_buffer(buffer), (unsigned long long)buffer.ptr);
        if (pitch)
            add(&out->fields, ", \"pitch\": %zu", pitch);
    }
}

static void step_free(char **args, int count, int async, struct outcome *out)
{
    if (count != 2)
        usage_error("free:<index> expected, got %s", args[0]);
    struct buffer *buffer = get_buffer(args[1]);
    if (async) {
        out->rc = CALL(STREAM_FN(cuMemFreeAsync, cuMemFreeAsync_ptsz), buffer->ptr, current_stream);
        return;
    }
    switch (buffer->family) {
    case FAMILY_HOST:
        out->rc = CALL(FN(cuMemFreeHost), (void *)(uintptr_t)buffer->ptr);
        break;
    case FAMILY_REGISTERED:
    case FAMILY_REGISTERED_THP:
    case FAMILY_REGISTERED_SHARED:
        out->rc = CALL(FN(cuMemHostUnregister), (void *)(uintptr_t)buffer->ptr);
        if (out->rc == CUDA_SUCCESS)
            munmap((void *)(uintptr_t)buffer->ptr, buffer->bytes);
        break;
    case FAMILY_VMM:
    case FAMILY_VMM_SHAREABLE:
        out->rc = CALL(FN(cuMemUnmap), buffer->ptr, buffer->vmm_bytes);
        if (out->rc == CUDA_SUCCESS)
            out->rc = CALL(FN(cuMemAddressFree), buffer->ptr, buffer->vmm_bytes);
        if (out->rc == CUDA_SUCCESS)
            out->rc = CALL(FN(cuMemRelease), buffer->vmm_handle);
        break;
    case FAMILY_IPC:
        out->rc = CALL(FN(cuIpcCloseMemHandle), buffer->ptr);
        break;
    default:
        out->rc = CALL(FN(cuMemFree_v2), buffer->ptr);
        break;
    }
}

/* ---- Kernels ---- */

enum launcher { LAUNCH_KERNEL, LAUNCH_EX, LAUNCH_COOPERATIVE, LAUNCH_GRAPH };

static int launch(enum launcher launcher, CUfunction function, unsigned int blocks, unsigned int threads,
                  void **params, CUstream stream)
{
    switch (launcher) {
    case LAUNCH_KERNEL:
        return CALL(STREAM_FN(cuLaunchKernel, cuLaunchKernel_ptsz), function, blocks, 1, 1, threads, 1, 1, 0, stream,
                    params, NULL);
    case LAUNCH_EX: {
        CUlaunchConfig config = {.gridDimX = blocks, .gridDimY = 1, .gridDimZ = 1, .blockDimX = threads,
                                 .blockDimY = 1, .blockDimZ = 1, .hStream = stream};
        return CALL(STREAM_FN(cuLaunchKernelEx, cuLaunchKernelEx_ptsz), &config, function, params, NULL);
    }
    case LAUNCH_COOPERATIVE:
        return CALL(STREAM_FN(cuLaunchCooperativeKernel, cuLaunchCooperativeKernel_ptsz), function, blocks, 1, 1,
                    threads, 1, 1, 0, stream, params);
    case LAUNCH_GRAPH: {
        /* Capture the launch on a private stream, instantiate, launch on the current stream. */
        CUstream capture;
        CUgraph graph;
        CUgraphExec exec;
        int rc = CALL(FN(cuStreamCreate), &capture, CU_STREAM_NON_BLOCKING);
        if (rc != CUDA_SUCCESS)
            return rc;
        rc = CALL(STREAM_FN(cuStreamBeginCapture_v2, cuStreamBeginCapture_v2_ptsz), capture,
                  CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
        if (rc == CUDA_SUCCESS)
            rc = launch(LAUNCH_KERNEL, function, blocks, threads, params, capture);
        int end = CALL(STREAM_FN(cuStreamEndCapture, cuStreamEndCapture_ptsz), capture, &graph);
        rc = rc != CUDA_SUCCESS ? rc : end;
        if (rc == CUDA_SUCCESS) {
            rc = CALL(FN(cuGraphInstantiateWithFlags), &exec, graph, 0);
            if (rc == CUDA_SUCCESS) {
                rc = CALL(STREAM_FN(cuGraphLaunch, cuGraphLaunch_ptsz), exec, stream);
                CALL(FN(cuGraphExecDestroy), exec);
            }
            CALL(FN(cuGraphDestroy), graph);
        }
        CALL(FN(cuStreamDestroy_v2), capture);
        return rc;
    }
    }
    return CUDA_ERROR_INVALID_VALUE;
}

static void step_sleep_kernel(enum launcher launcher, char **args, int count, struct outcome *out)
{
    if (count != 2)
        usage_error("<launcher>:<microseconds> expected, got %s", args[0]);
    uint64_t duration = parse_number(args[1], args[1]);
    void *params[] = {&duration};
    out->rc = launch(launcher, here()->sleep, 1, 1, params, current_stream);
}

/* nvshare_fill, or nvshare_allreduce (the same arguments: it writes the sum of the ranks' values). */
static int fill(CUfunction kernel, CUdeviceptr ptr, uint32_t value, uint64_t words)
{
    void *params[] = {&ptr, &value, &words};
    uint64_t blocks = (words + 255) / 256;
    return launch(LAUNCH_KERNEL, kernel, blocks > 1024 ? 1024 : blocks ? (unsigned)blocks : 1, 256, params,
                  current_stream);
}

enum fill_step { FILL, CHECK, ALLREDUCE };

/* fill:<index>:<value>[:<words>], check:<index>:<value>[:<words>], allreduce:<index>:<value>[:<words>] */
static void step_fill_or_check(enum fill_step step, char **args, int count, struct outcome *out)
{
    if (count != 3 && count != 4)
        usage_error("fill|check|allreduce:<index>:<value>[:<words>] expected, got %s", args[0]);
    struct buffer *buffer = get_buffer(args[1]);
    uint32_t value = (uint32_t)parse_number(args[2], args[2]);
    uint64_t words = count == 4 ? parse_number(args[3], args[3]) : buffer->bytes / 4;
    if (step != CHECK) {
        out->rc = fill(step == FILL ? here()->fill : here()->allreduce, buffer->ptr, value, words);
        return;
    }
    uint32_t *host = host_calloc(words + 1, 4);
    out->rc = CALL(STREAM_FN(cuMemcpyDtoH_v2, cuMemcpyDtoH_v2_ptds), host, buffer->ptr, words * 4);
    if (out->rc == CUDA_SUCCESS) {
        uint64_t mismatch = words;
        for (uint64_t i = 0; i < words && mismatch == words; i++)
            if (host[i] != value)
                mismatch = i;
        out->failed = mismatch != words;
        add(&out->fields, ", \"ok\": %s", out->failed ? "false" : "true");
        if (out->failed)
            add(&out->fields, ", \"mismatch\": %" PRIu64 ", \"found\": %u", mismatch, host[mismatch]);
    }
    free(host);
}

/* ---- copy:<entry point> ---- */

/* Layout of CUmemcpyAttributes (CUDA 12.8+), which cuda_types.h keeps opaque. */
struct batch_attributes {
    int src_access_order;         /* CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1 */
    CUmemLocation src_location, dst_location;
    unsigned int flags;
};

enum shape {
    SHAPE_HTOD, SHAPE_DTOH, SHAPE_DTOD, SHAPE_PEER, SHAPE_2D, SHAPE_3D, SHAPE_3D_PEER,
    SHAPE_BATCH, SHAPE_BATCH_V2, SHAPE_ATTRIBUTES, SHAPE_SET, SHAPE_SET_2D, SHAPE_UNSUPPORTED,
};

struct copy_api {
    const char *symbol;
    enum shape shape;
    int async;
    unsigned int element;         /* memsets: 1, 2 or 4 bytes */
};

#define PAIR(symbol, twin, shape, async, element) {#symbol, shape, async, element}, {#twin, shape, async, element}
static const struct copy_api copy_apis[] = {
    PAIR(cuMemcpy, cuMemcpy_ptds, SHAPE_DTOD, 0, 0),
    PAIR(cuMemcpyAsync, cuMemcpyAsync_ptsz, SHAPE_DTOD, 1, 0),
    PAIR(cuMemcpyPeer, cuMemcpyPeer_ptds, SHAPE_PEER, 0, 0),
    PAIR(cuMemcpyPeerAsync, cuMemcpyPeerAsync_ptsz, SHAPE_PEER, 1, 0),
    PAIR(cuMemcpyHtoD_v2, cuMemcpyHtoD_v2_ptds, SHAPE_HTOD, 0, 0),
    PAIR(cuMemcpyDtoH_v2, cuMemcpyDtoH_v2_ptds, SHAPE_DTOH, 0, 0),
    PAIR(cuMemcpyDtoD_v2, cuMemcpyDtoD_v2_ptds, SHAPE_DTOD, 0, 0),
    PAIR(cuMemcpyHtoDAsync_v2, cuMemcpyHtoDAsync_v2_ptsz, SHAPE_HTOD, 1, 0),
    PAIR(cuMemcpyDtoHAsync_v2, cuMemcpyDtoHAsync_v2_ptsz, SHAPE_DTOH, 1, 0),
    PAIR(cuMemcpyDtoDAsync_v2, cuMemcpyDtoDAsync_v2_ptsz, SHAPE_DTOD, 1, 0),
    PAIR(cuMemcpy2D_v2, cuMemcpy2D_v2_ptds, SHAPE_2D, 0, 0),
    PAIR(cuMemcpy2DUnaligned_v2, cuMemcpy2DUnaligned_v2_ptds, SHAPE_2D, 0, 0),
    PAIR(cuMemcpy2DAsync_v2, cuMemcpy2DAsync_v2_ptsz, SHAPE_2D, 1, 0),
    PAIR(cuMemcpy3D_v2, cuMemcpy3D_v2_ptds, SHAPE_3D, 0, 0),
    PAIR(cuMemcpy3DAsync_v2, cuMemcpy3DAsync_v2_ptsz, SHAPE_3D, 1, 0),
    PAIR(cuMemcpy3DPeer, cuMemcpy3DPeer_ptds, SHAPE_3D_PEER, 0, 0),
    PAIR(cuMemcpy3DPeerAsync, cuMemcpy3DPeerAsync_ptsz, SHAPE_3D_PEER, 1, 0),
    PAIR(cuMemcpyBatchAsync, cuMemcpyBatchAsync_ptsz, SHAPE_BATCH, 1, 0),
    PAIR(cuMemcpyBatchAsync_v2, cuMemcpyBatchAsync_v2_ptsz, SHAPE_BATCH_V2, 1, 0),
    {"cuMemcpyWithAttributesAsync", SHAPE_ATTRIBUTES, 1, 0},
    PAIR(cuMemsetD8_v2, cuMemsetD8_v2_ptds, SHAPE_SET, 0, 1),
    PAIR(cuMemsetD16_v2, cuMemsetD16_v2_ptds, SHAPE_SET, 0, 2),
    PAIR(cuMemsetD32_v2, cuMemsetD32_v2_ptds, SHAPE_SET, 0, 4),
    PAIR(cuMemsetD2D8_v2, cuMemsetD2D8_v2_ptds, SHAPE_SET_2D, 0, 1),
    PAIR(cuMemsetD2D16_v2, cuMemsetD2D16_v2_ptds, SHAPE_SET_2D, 0, 2),
    PAIR(cuMemsetD2D32_v2, cuMemsetD2D32_v2_ptds, SHAPE_SET_2D, 0, 4),
    PAIR(cuMemsetD8Async, cuMemsetD8Async_ptsz, SHAPE_SET, 1, 1),
    PAIR(cuMemsetD16Async, cuMemsetD16Async_ptsz, SHAPE_SET, 1, 2),
    PAIR(cuMemsetD32Async, cuMemsetD32Async_ptsz, SHAPE_SET, 1, 4),
    PAIR(cuMemsetD2D8Async, cuMemsetD2D8Async_ptsz, SHAPE_SET_2D, 1, 1),
    PAIR(cuMemsetD2D16Async, cuMemsetD2D16Async_ptsz, SHAPE_SET_2D, 1, 2),
    PAIR(cuMemsetD2D32Async, cuMemsetD2D32Async_ptsz, SHAPE_SET_2D, 1, 4),
};
#undef PAIR

/* Everything else of the two families (arrays, the 32-bit ABI, 3D batches) is called with zero
 * arguments: all its parameters are integers or pointers, so on x86-64 and AArch64 a call with
 * six zeros reaches it with zeros. The simulated driver answers CUDA_ERROR_NOT_SUPPORTED
 * (arrays, 3D batches) or CUDA_ERROR_INVALID_CONTEXT (32-bit ABI). */
typedef CUresult (*zeros_fn)(uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t);

#define COPY_BYTES 4096

static unsigned char pattern(size_t i, unsigned seed)
{
    return (unsigned char)(seed + i * 7 + (i >> 8));
}

static int scratch(struct device_state **out)
{
    pthread_mutex_lock(&state_lock);
    struct device_state *device = here();
    int rc = CUDA_SUCCESS;
    if (!device->scratch_a) {
        rc = CALL(FN(cuMemAlloc_v2), &device->scratch_a, SCRATCH_BYTES);
        if (rc == CUDA_SUCCESS)
            rc = CALL(FN(cuMemAlloc_v2), &device->scratch_b, SCRATCH_BYTES);
        if (rc == CUDA_SUCCESS)
            rc = CALL(FN(cuMemAllocHost_v2), &device->pinned, SCRATCH_BYTES);
        if (rc != CUDA_SUCCESS)
            device->scratch_a = 0;
    }
    pthread_mutex_unlock(&state_lock);
    *out = device;
    return rc;
}

/* Device scratch contents, through the plain synchronous entry points. */
static int upload(CUdeviceptr dst, const unsigned char *src, size_t bytes)
{
    return CALL(FN(cuMemcpyHtoD_v2), dst, src, bytes);
}

static int download(unsigned char *dst, CUdeviceptr src, size_t bytes)
{
    return CALL(FN(cuMemcpyDtoH_v2), dst, src, bytes);
}

static int run_copy_api(const struct copy_api *api, void *pointer, unsigned char *expected, unsigned char *actual,
                        int *destination_is_b)
{
    struct device_state *device;
    int rc = scratch(&device);
    if (rc != CUDA_SUCCESS)
        return rc;
    static __thread unsigned seed = 1;
    seed += 17;
    unsigned char *source = host_calloc(1, SCRATCH_BYTES);
    for (size_t i = 0; i < SCRATCH_BYTES; i++)
        source[i] = pattern(i, seed);
    memset(expected, 0, SCRATCH_BYTES);
    memset(actual, 0, SCRATCH_BYTES);
    rc = upload(device->scratch_a, source, SCRATCH_BYTES);
    if (rc == CUDA_SUCCESS)
        rc = upload(device->scratch_b, expected, SCRATCH_BYTES); /* zeros */
    *destination_is_b = 1;
    CUstream stream = current_stream;
    CUcontext ctx = device->ctx;
    if (rc != CUDA_SUCCESS) {
        free(source);
        return rc;
    }
    switch (api->shape) {
    case SHAPE_HTOD:
        memcpy(expected, source, COPY_BYTES);
        rc = api->async ? (int)((cuMemcpyHtoDAsync_v2_fn)pointer)(device->scratch_b, source, COPY_BYTES, stream)
                        : (int)((cuMemcpyHtoD_v2_fn)pointer)(device->scratch_b, source, COPY_BYTES);
        break;
    case SHAPE_DTOH:
        memcpy(expected, source, COPY_BYTES);
        *destination_is_b = 0; /* the host buffer is the destination */
        rc = api->async ? (int)((cuMemcpyDtoHAsync_v2_fn)pointer)(actual, device->scratch_a, COPY_BYTES, stream)
                        : (int)((cuMemcpyDtoH_v2_fn)pointer)(actual, device->scratch_a, COPY_BYTES);
        break;
    case SHAPE_DTOD:
        memcpy(expected, source, COPY_BYTES);
        rc = api->async ? (int)((cuMemcpyDtoDAsync_v2_fn)pointer)(device->scratch_b, device->scratch_a, COPY_BYTES, stream)
                        : (int)((cuMemcpyDtoD_v2_fn)pointer)(device->scratch_b, device->scratch_a, COPY_BYTES);
        break;
    case SHAPE_PEER:
        memcpy(expected, source, COPY_BYTES);
        rc = api->async ? (int)((cuMemcpyPeerAsync_fn)pointer)(device->scratch_b, ctx, device->scratch_a, ctx,
                                                               COPY_BYTES, stream)
                        : (int)((cuMemcpyPeer_fn)pointer)(device->scratch_b, ctx, device->scratch_a, ctx, COPY_BYTES);
        break;
    case SHAPE_2D: {
        /* 4 rows of 256 bytes from (x 16, y 1) of a pageable host image with pitch 512 to
         * (x 32, y 2) of device memory with pitch 1024. */
        CUDA_MEMCPY2D copy = {.srcXInBytes = 16, .srcY = 1, .srcMemoryType = CU_MEMORYTYPE_HOST, .srcHost = source,
                              .srcPitch = 512, .dstXInBytes = 32, .dstY = 2, .dstMemoryType = CU_MEMORYTYPE_DEVICE,
                              .dstDevice = device->scratch_b, .dstPitch = 1024, .WidthInBytes = 256, .Height = 4};
        for (size_t row = 0; row < 4; row++)
            memcpy(expected + (2 + row) * 1024 + 32, source + (1 + row) * 512 + 16, 256);
        rc = api->async ? (int)((cuMemcpy2DAsync_v2_fn)pointer)(&copy, stream) : (int)((cuMemcpy2D_v2_fn)pointer)(&copy);
        break;
    }
    case SHAPE_3D:
    case SHAPE_3D_PEER: {
        /* 2 slices of 4 rows of 128 bytes: source slices of 8 rows of pitch 512 starting at
         * (x 8, y 1, z 1); destination slices of 6 rows of pitch 1024 at (x 40, y 1, z 0). The
         * 3D copy reads pageable host memory, the peer copy device memory. */
        int peer = api->shape == SHAPE_3D_PEER;
        for (size_t z = 0; z < 2; z++)
            for (size_t y = 0; y < 4; y++)
                memcpy(expected + z * 6144 + (1 + y) * 1024 + 40, source + (1 + z) * 4096 + (1 + y) * 512 + 8, 128);
        if (peer) {
            CUDA_MEMCPY3D_PEER copy = {
                .srcXInBytes = 8, .srcY = 1, .srcZ = 1, .srcMemoryType = CU_MEMORYTYPE_DEVICE,
                .srcDevice = device->scratch_a, .srcContext = ctx, .srcPitch = 512, .srcHeight = 8,
                .dstXInBytes = 40, .dstY = 1, .dstMemoryType = CU_MEMORYTYPE_DEVICE, .dstDevice = device->scratch_b,
                .dstContext = ctx, .dstPitch = 1024, .dstHeight = 6, .WidthInBytes = 128, .Height = 4, .Depth = 2};
            rc = api->async ? (int)((cuMemcpy3DPeerAsync_fn)pointer)(&copy, stream) : (int)((cuMemcpy3DPeer_fn)pointer)(&copy);
        } else {
            CUDA_MEMCPY3D copy = {
                .srcXInBytes = 8, .srcY = 1, .srcZ = 1, .srcMemoryType = CU_MEMORYTYPE_HOST, .srcHost = source,
                .srcPitch = 512, .srcHeight = 8, .dstXInBytes = 40, .dstY = 1, .dstMemoryType = CU_MEMORYTYPE_DEVICE,
                .dstDevice = device->scratch_b, .dstPitch = 1024, .dstHeight = 6, .WidthInBytes = 128, .Height = 4,
                .Depth = 2};
            rc = api->async ? (int)((cuMemcpy3DAsync_v2_fn)pointer)(&copy, stream) : (int)((cuMemcpy3D_v2_fn)pointer)(&copy);
        }
        break;
    }
    case SHAPE_BATCH:
    case SHAPE_BATCH_V2: {
        CUdeviceptr dsts[] = {device->scratch_b + 4096, device->scratch_b + 8192};
        CUdeviceptr srcs[] = {device->scratch_a, device->scratch_a + 2048};
        size_t sizes[] = {1024, 512};
        memcpy(expected + 4096, source, 1024);
        memcpy(expected + 8192, source + 2048, 512);
        struct batch_attributes attributes = {.src_access_order = 1};
        size_t attribute_indices[] = {0};
        size_t fail_index;
        CUmemcpyAttributes *attrs = (CUmemcpyAttributes *)&attributes;
        if (stream == NULL || stream == CU_STREAM_LEGACY) /* batches refuse the legacy stream */
            stream = CU_STREAM_PER_THREAD;
        rc = api->shape == SHAPE_BATCH
                 ? (int)((cuMemcpyBatchAsync_fn)pointer)(dsts, srcs, sizes, 2, attrs, attribute_indices, 1, &fail_index,
                                                          stream)
                 : (int)((cuMemcpyBatchAsync_v2_fn)pointer)(dsts, srcs, sizes, 2, attrs, attribute_indices, 1, stream);
        break;
    }
    case SHAPE_ATTRIBUTES: {
        struct batch_attributes attributes = {.src_access_order = 1};
        memcpy(expected + 4096, source, 1024);
        if (stream == NULL || stream == CU_STREAM_LEGACY)
            stream = CU_STREAM_PER_THREAD;
        rc = (int)((cuMemcpyWithAttributesAsync_fn)pointer)(device->scratch_b + 4096, device->scratch_a, 1024,
                                                            (CUmemcpyAttributes *)&attributes, stream);
        break;
    }
    case SHAPE_SET:
    case SHAPE_SET_2D: {
        /* A value whose bytes differ, so that a wrong element size shows. */
        uint32_t value = api->element == 1 ? 0xa5 : api->element == 2 ? 0xa5c3 : 0xa5c3e7f1u;
        size_t offset = 64 * api->element, width = 200, height = api->shape == SHAPE_SET_2D ? 4 : 1, pitch = 1024;
        for (size_t y = 0; y < height; y++)
            for (size_t x = 0; x < width; x++)
                memcpy(expected + offset + y * pitch + x * api->element, &value, api->element);
        CUdeviceptr dst = device->scratch_b + offset;
        if (api->shape == SHAPE_SET && !api->async)
            rc = api->element == 1 ? (int)((cuMemsetD8_v2_fn)pointer)(dst, (unsigned char)value, width)
               : api->element == 2 ? (int)((cuMemsetD16_v2_fn)pointer)(dst, (unsigned short)value, width)
                                   : (int)((cuMemsetD32_v2_fn)pointer)(dst, value, width);
        else if (api->shape == SHAPE_SET)
            rc = api->element == 1 ? (int)((cuMemsetD8Async_fn)pointer)(dst, (unsigned char)value, width, stream)
               : api->element == 2 ? (int)((cuMemsetD16Async_fn)pointer)(dst, (unsigned short)value, width, stream)
                                   : (int)((cuMemsetD32Async_fn)pointer)(dst, value, width, stream);
        else if (!api->async)
            rc = api->element == 1 ? (int)((cuMemsetD2D8_v2_fn)pointer)(dst, pitch, (unsigned char)value, width, height)
               : api->element == 2 ? (int)((cuMemsetD2D16_v2_fn)pointer)(dst, pitch, (unsigned short)value, width, height)
                                   : (int)((cuMemsetD2D32_v2_fn)pointer)(dst, pitch, value, width, height);
        else
            rc = api->element == 1
                     ? (int)((cuMemsetD2D8Async_fn)pointer)(dst, pitch, (unsigned char)value, width, height, stream)
                 : api->element == 2
                     ? (int)((cuMemsetD2D16Async_fn)pointer)(dst, pitch, (unsigned short)value, width, height, stream)
                     : (int)((cuMemsetD2D32Async_fn)pointer)(dst, pitch, value, width, height, stream);
        break;
    }
    case SHAPE_UNSUPPORTED:
        rc = (int)((zeros_fn)pointer)(0, 0, 0, 0, 0, 0);
        break;
    }
    free(source);
    if (rc == CUDA_SUCCESS)
        rc = CALL(FN(cuCtxSynchronize));
    if (rc == CUDA_SUCCESS && *destination_is_b)
        rc = download(actual, device->scratch_b, SCRATCH_BYTES);
    if (!*destination_is_b)
        memset(actual + COPY_BYTES, 0, SCRATCH_BYTES - COPY_BYTES); /* only COPY_BYTES were asked for */
    return rc;
}

static void step_copy(char **args, int count, struct outcome *out)
{
    if (count != 2)
        usage_error("copy:<entry point> expected, got %s", args[0]);
    int id = find_api(args[1]);
    if (id < 0 || (strncmp(args[1], "cuMemcpy", 8) != 0 && strncmp(args[1], "cuMemset", 8) != 0))
        usage_error("not a cuMemcpy/cuMemset entry point: %s", args[1]);
    struct copy_api api = {args[1], SHAPE_UNSUPPORTED, 0, 0};
    for (size_t i = 0; i < sizeof copy_apis / sizeof copy_apis[0]; i++)
        if (strcmp(copy_apis[i].symbol, args[1]) == 0)
            api = copy_apis[i];
    void *pointer = api_pointer((enum api_id)id);
    if (!pointer) {
        out->rc = -1;
        return;
    }
    unsigned char *expected = host_calloc(1, SCRATCH_BYTES), *actual = host_calloc(1, SCRATCH_BYTES);
    int destination_is_b;
    out->rc = run_copy_api(&api, pointer, expected, actual, &destination_is_b);
    if (out->rc == CUDA_SUCCESS) {
        size_t mismatch = SCRATCH_BYTES;
        for (size_t i = 0; i < SCRATCH_BYTES && mismatch == SCRATCH_BYTES; i++)
            if (expected[i] != actual[i])
                mismatch = i;
        out->failed = mismatch != SCRATCH_BYTES;
        add(&out->fields, ", \"ok\": %s", out->failed ? "false" : "true");
        if (out->failed)
            add(&out->fields, ", \"mismatch\": %zu", mismatch);
    }
    free(expected);
    free(actual);
}

/* ---- Moving memory the way a swap engine does ---- */

/* dtoh:<from>:<to> and htod:<from>:<to>: cuMemcpyDtoHAsync_v2 / cuMemcpyHtoDAsync_v2 of the smaller
 * buffer's size on the current stream (the host side is buffer <to> or <from>, pinned or not). */
static void step_transfer(int to_host, char **args, int count, struct outcome *out)
{
    if (count != 3)
        usage_error("dtoh|htod:<from>:<to> expected, got %s", args[0]);
    struct buffer *from = get_buffer(args[1]), *to = get_buffer(args[2]);
    size_t bytes = from->bytes < to->bytes ? from->bytes : to->bytes;
    if (to_host)
        out->rc = CALL(STREAM_FN(cuMemcpyDtoHAsync_v2, cuMemcpyDtoHAsync_v2_ptsz), (void *)(uintptr_t)to->ptr,
                       from->ptr, bytes, current_stream);
    else
        out->rc = CALL(STREAM_FN(cuMemcpyHtoDAsync_v2, cuMemcpyHtoDAsync_v2_ptsz), to->ptr,
                       (const void *)(uintptr_t)from->ptr, bytes, current_stream);
    add(&out->fields, ", \"bytes\": %zu", bytes);
}

/* discard:<i> and discard-prefetch:<i>: cuMemDiscardBatchAsync of the buffer, or
 * cuMemDiscardAndPrefetchBatchAsync of it to the current device, on the current stream. */
static void step_discard(int prefetch, char **args, int count, struct outcome *out)
{
    if (count != 2)
        usage_error("discard|discard-prefetch:<index> expected, got %s", args[0]);
    struct buffer *buffer = get_buffer(args[1]);
    CUdeviceptr pointers[] = {buffer->ptr};
    size_t sizes[] = {buffer->bytes}, first[] = {0};
    CUmemLocation here_location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = current_device};
    if (prefetch)
        out->rc = CALL(STREAM_FN(cuMemDiscardAndPrefetchBatchAsync, cuMemDiscardAndPrefetchBatchAsync_ptsz), pointers,
                       sizes, 1, &here_location, first, 1, 0, current_stream);
    else
        out->rc = CALL(STREAM_FN(cuMemDiscardBatchAsync, cuMemDiscardBatchAsync_ptsz), pointers, sizes, 1, 0,
                       current_stream);
}

/* retain:<i>: cuMemRetainAllocationHandle of a VMM buffer's address (prints whether it is the
 * handle cuMemCreate gave); export:<i>: cuMemExportToShareableHandle as a file descriptor. */
static void step_vmm_handle(int export, char **args, int count, struct outcome *out)
{
    if (count != 2)
        usage_error("retain|export:<index> expected, got %s", args[0]);
    struct buffer *buffer = get_buffer(args[1]);
    if (export) {
        int fd = -1;
        out->rc = CALL(FN(cuMemExportToShareableHandle), &fd, buffer->vmm_handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
        if (out->rc == CUDA_SUCCESS)
            add(&out->fields, ", \"fd\": %d", fd);
        return;
    }
    CUmemGenericAllocationHandle handle = 0;
    out->rc = CALL(FN(cuMemRetainAllocationHandle), &handle, (void *)(uintptr_t)buffer->ptr);
    if (out->rc == CUDA_SUCCESS)
        add(&out->fields, ", \"same\": %s", handle == buffer->vmm_handle ? "true" : "false");
}

/* ---- Other steps ---- */

static void step_ptr(char **args, int count, struct outcome *out)
{
    if (count != 2)
        usage_error("ptr:<index> expected, got %s", args[0]);
    struct buffer *buffer = get_buffer(args[1]);
    unsigned int memory_type = 0, managed = 0;
    int ordinal = 0;
    CUdeviceptr start = 0;
    size_t size = 0;
    CUmemoryPool pool = NULL;
    CUcontext ctx = NULL;
    CUpointer_attribute attributes[] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_IS_MANAGED,
                                        CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                                        CU_POINTER_ATTRIBUTE_RANGE_SIZE, CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
                                        CU_POINTER_ATTRIBUTE_CONTEXT};
    void *data[] = {&memory_type, &managed, &ordinal, &start, &size, &pool, &ctx};
    out->rc = CALL(FN(cuPointerGetAttributes), 7, attributes, data, buffer->ptr);
    if (out->rc == CUDA_SUCCESS)
        add(&out->fields,
            ", \"family\": \"%s\", \"memory_type\": %u, \"managed\": %s, \"device\": %d, \"range_start\": %llu, "
            "\"range_size\": %zu, \"pool\": %s, \"has_context\": %s",
            family_names[buffer->family], memory_type, managed ? "true" : "false", ordinal, (unsigned long long)start,
            size, pool ? "true" : "false", ctx ? "true" : "false");
}

static void step_ipc(char **args, int count, struct outcome *out)
{
    if (count != 2)
        usage_error("ipc:<index> expected, got %s", args[0]);
    CUipcMemHandle handle;
    out->rc = CALL(FN(cuIpcGetMemHandle), &handle, get_buffer(args[1])->ptr);
    if (out->rc != CUDA_SUCCESS)
        return;
    char hex[2 * CU_IPC_HANDLE_SIZE + 1];
    for (int i = 0; i < CU_IPC_HANDLE_SIZE; i++)
        snprintf(hex + 2 * i, 3, "%02x", (unsigned char)handle.reserved[i]);
    add(&out->fields, ", \"handle\": \"%s\"", hex);
}

static void step_ipc_open(char **args, int count, struct outcome *out)
{
    if (count != 2 || strlen(args[1]) != 2 * CU_IPC_HANDLE_SIZE)
        usage_error("ipc-open:<128 hex digits> expected, got %s", args[0]);
    CUipcMemHandle handle;
    for (int i = 0; i < CU_IPC_HANDLE_SIZE; i++) {
        unsigned byte;
        if (sscanf(args[1] + 2 * i, "%2x", &byte) != 1)
            usage_error("not a hex handle: %s", args[1]);
        handle.reserved[i] = (char)byte;
    }
    struct buffer buffer = {.family = FAMILY_IPC, .device = current_device};
    out->rc = CALL(FN(cuIpcOpenMemHandle_v2), &buffer.ptr, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
    if (out->rc == CUDA_SUCCESS)
        out->rc = CALL(FN(cuPointerGetAttribute), &buffer.bytes, CU_POINTER_ATTRIBUTE_RANGE_SIZE, buffer.ptr);
    if (out->rc == CUDA_SUCCESS)
        add(&out->fields, ", \"index\": %d, \"ptr\": %llu, \"bytes\": %zu", add_buffer(buffer),
            (unsigned long long)buffer.ptr, buffer.bytes);
}

static void step_stream(char **args, int count, struct outcome *out)
{
    if (count != 2)
        usage_error("stream:new|default|legacy|per-thread expected, got %s", args[0]);
    if (strcmp(args[1], "new") == 0)
        out->rc = CALL(FN(cuStreamCreate), &current_stream, CU_STREAM_NON_BLOCKING);
    else if (strcmp(args[1], "default") == 0)
        current_stream = NULL;
    else if (strcmp(args[1], "legacy") == 0)
        current_stream = CU_STREAM_LEGACY;
    else if (strcmp(args[1], "per-thread") == 0)
        current_stream = CU_STREAM_PER_THREAD;
    else
        usage_error("unknown stream %s", args[1]);
}

/* ---- Stream capture ---- */

/* The graph of the last capture-end, launched by graph-launch; under state_lock. */
static CUgraphExec captured_graph;

static const char *const capture_modes[] = {"global", "thread-local", "relaxed"};
static const char *const capture_statuses[] = {"none", "active", "invalidated"};

static void step_capture_begin(char **args, int count, struct outcome *out)
{
    if (count > 3)
        usage_error("capture-begin[:<mode>[:v2|v1|to-graph]] expected, got %s", args[0]);
    int mode = 0;
    if (count >= 2) {
        for (mode = 0; mode < 3 && strcmp(args[1], capture_modes[mode]) != 0; mode++)
            ;
        if (mode == 3)
            usage_error("capture mode global, thread-local or relaxed expected, got %s", args[1]);
    }
    const char *entry = count == 3 ? args[2] : "v2";
    if (strcmp(entry, "v2") == 0) {
        out->rc = CALL(STREAM_FN(cuStreamBeginCapture_v2, cuStreamBeginCapture_v2_ptsz), current_stream,
                       (CUstreamCaptureMode)mode);
    } else if (strcmp(entry, "v1") == 0) {
        if (mode != CU_STREAM_CAPTURE_MODE_GLOBAL)
            usage_error("cuStreamBeginCapture (v1) captures in global mode only, got %s", args[0]);
        out->rc = CALL(STREAM_FN(cuStreamBeginCapture, cuStreamBeginCapture_ptsz), current_stream);
    } else if (strcmp(entry, "to-graph") == 0) {
        CUgraph graph;
        out->rc = CALL(FN(cuGraphCreate), &graph, 0);
        if (out->rc == CUDA_SUCCESS)
            out->rc = CALL(STREAM_FN(cuStreamBeginCaptureToGraph, cuStreamBeginCaptureToGraph_ptsz), current_stream,
                           graph, NULL, NULL, 0, (CUstreamCaptureMode)mode);
    } else {
        usage_error("capture entry v2, v1 or to-graph expected, got %s", entry);
    }
    add(&out->fields, ", \"mode\": \"%s\"", capture_modes[mode]);
}

static void step_capture_end(struct outcome *out)
{
    CUgraph graph = NULL;
    out->rc = CALL(STREAM_FN(cuStreamEndCapture, cuStreamEndCapture_ptsz), current_stream, &graph);
    if (out->rc != CUDA_SUCCESS)
        return;
    CUgraphExec exec;
    out->rc = CALL(FN(cuGraphInstantiateWithFlags), &exec, graph, 0);
    CALL(FN(cuGraphDestroy), graph);
    if (out->rc != CUDA_SUCCESS)
        return;
    pthread_mutex_lock(&state_lock);
    CUgraphExec previous = captured_graph;
    captured_graph = exec;
    pthread_mutex_unlock(&state_lock);
    if (previous)
        CALL(FN(cuGraphExecDestroy), previous);
}

static void step_capture_status(struct outcome *out)
{
    CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
    out->rc = CALL(STREAM_FN(cuStreamIsCapturing, cuStreamIsCapturing_ptsz), current_stream, &status);
    add(&out->fields, ", \"status\": \"%s\"", (unsigned)status < 3 ? capture_statuses[status] : "unknown");
}

static void step_graph_launch(struct outcome *out)
{
    pthread_mutex_lock(&state_lock);
    CUgraphExec exec = captured_graph;
    pthread_mutex_unlock(&state_lock);
    /* Without a graph (no capture-end succeeded) the driver answers for the NULL handle. */
    out->rc = CALL(STREAM_FN(cuGraphLaunch, cuGraphLaunch_ptsz), exec, current_stream);
}

static void step_lookup(char **args, int count, struct outcome *out)
{
    if (count != 4)
        usage_error("lookup:<base name>:<cudaVersion>:<flags> expected, got %s", args[0]);
    void *pointer = NULL;
    CUdriverProcAddressQueryResult status = -1;
    out->rc = CALL(FN(cuGetProcAddress_v2), args[1], &pointer, (int)parse_number(args[2], args[2]),
                   parse_number(args[3], args[3]), &status);
    Dl_info info;
    add(&out->fields, ", \"status\": %d", (int)status);
    if (pointer && dladdr(pointer, &info) && info.dli_sname && info.dli_saddr == pointer) {
        const char *object = strrchr(info.dli_fname, '/');
        add(&out->fields, ", \"symbol\": \"%s\", \"object\": \"%s\"", info.dli_sname, object ? object + 1 : info.dli_fname);
    } else {
        add(&out->fields, ", \"symbol\": %s", pointer ? "\"?\"" : "null");
    }
}

static void apply_tag(const char *tag)
{
    snprintf(current_tag, sizeof current_tag, "%s", tag);
    if (set_tag)
        set_tag(current_tag);
}

/* ---- Step dispatch ---- */

static void run_steps(char *body, int *number);

struct thread_start {
    char *body;
    int device, number;
    CUstream stream;
    const char *tag;
};

static void *thread_main(void *argument)
{
    struct thread_start *start = argument;
    thread_number = start->number;
    apply_tag(start->tag);
    int rc = use_device(start->device);
    current_stream = start->stream;
    int step_number = 0;
    if (rc != CUDA_SUCCESS) {
        struct outcome outcome = {.rc = rc};
        double t = now();
        print_step("thread-start", 0, &outcome, t, t);
    } else {
        run_steps(start->body, &step_number);
    }
    return NULL;
}

static void step_threads(char **args, int count, struct outcome *out)
{
    if (count != 3)
        usage_error("threads:<n>:<steps> expected, got %s", args[0]);
    unsigned long long n = parse_number(args[1], args[1]);
    pthread_t *threads = host_calloc(n, sizeof *threads);
    struct thread_start *starts = host_calloc(n, sizeof *starts);
    for (unsigned long long i = 0; i < n; i++) {
        starts[i] = (struct thread_start){strdup(args[2]), current_device, (int)i + 1, current_stream, current_tag};
        if (pthread_create(&threads[i], NULL, thread_main, &starts[i]) != 0)
            usage_error("cannot start thread %s", args[1]);
    }
    for (unsigned long long i = 0; i < n; i++) {
        pthread_join(threads[i], NULL);
        free(starts[i].body);
    }
    free(threads);
    free(starts);
    out->rc = CUDA_SUCCESS;
}

/* Threads started by spawn: and not yet joined; under state_lock. */
#define MAX_SPAWNED 16
#define FIRST_SPAWNED_NUMBER 101
static struct spawned {
    pthread_t thread;
    struct thread_start start;
} spawned[MAX_SPAWNED];
static int spawned_count, spawned_total;

static void step_spawn(char **args, int count, struct outcome *out)
{
    if (count != 2)
        usage_error("spawn:<steps> expected, got %s", args[0]);
    pthread_mutex_lock(&state_lock);
    if (spawned_count == MAX_SPAWNED)
        usage_error("more than 16 spawned threads at once (join them): %s", args[1]);
    struct spawned *slot = &spawned[spawned_count++];
    slot->start = (struct thread_start){strdup(args[1]), current_device, FIRST_SPAWNED_NUMBER + spawned_total++,
                                        current_stream, strdup(current_tag)};
    if (pthread_create(&slot->thread, NULL, thread_main, &slot->start) != 0)
        usage_error("cannot start a thread for %s", args[1]);
    add(&out->fields, ", \"spawned\": %d", slot->start.number);
    pthread_mutex_unlock(&state_lock);
}

/* Waits for every thread spawn: started (simapp does so before it exits, too). */
static void join_spawned(void)
{
    pthread_mutex_lock(&state_lock);
    int n = spawned_count;
    struct spawned joining[MAX_SPAWNED];
    memcpy(joining, spawned, sizeof joining);
    spawned_count = 0;
    pthread_mutex_unlock(&state_lock);
    for (int i = 0; i < n; i++) {
        pthread_join(joining[i].thread, NULL);
        free(joining[i].start.body);
        free((char *)joining[i].start.tag);
    }
}

static void step_fork(char **args, int count, struct outcome *out)
{
    if (count != 2)
        usage_error("fork:<steps> expected, got %s", args[0]);
    pid_t child = fork();
    if (child < 0)
        usage_error("fork failed: %s", strerror(errno));
    if (child == 0) {
        any_failure = 0;
        int number = 0;
        run_steps(args[1], &number);
        _exit(any_failure ? 1 : 0);
    }
    int status;
    waitpid(child, &status, 0);
    add(&out->fields, ", \"child\": %d, \"child_exit\": %d", (int)child,
        WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
}

static void run_step(char *text, int *number);

/* Runs a comma-separated list of steps. */
static void run_steps(char *body, int *number)
{
    char *save = NULL;
    for (char *step = strtok_r(body, ",", &save); step; step = strtok_r(NULL, ",", &save))
        run_step(step, number);
}

static int is_step(const char *text, const char *name)
{
    size_t length = strlen(name);
    return strncmp(text, name, length) == 0 && (text[length] == ':' || text[length] == '\0');
}

static void run_step(char *text, int *number)
{
    char *original = strdup(text);
    struct outcome out = {.rc = CUDA_SUCCESS};
    char *args[5];
    double start = now();

    /* Steps that contain steps: the body keeps its colons. A repeat prints no line of its own. */
    if (is_step(text, "repeat")) {
        int count = split(text, args, 3);
        if (count != 3)
            usage_error("repeat:<n>:<steps> expected, got %s", original);
        unsigned long long n = parse_number(args[1], args[1]);
        for (unsigned long long i = 0; i < n; i++) {
            char *body = strdup(args[2]);
            run_steps(body, number);
            free(body);
        }
        free(original);
        return;
    }
    int my_number = (*number)++;
    if (is_step(text, "spawn")) {
        step_spawn(args, split(text, args, 2), &out);
        print_step(original, my_number, &out, start, now());
        free(original);
        return;
    }
    if (is_step(text, "threads") || is_step(text, "fork")) {
        int fork_step = is_step(text, "fork");
        int count = split(text, args, fork_step ? 2 : 3);
        if (fork_step)
            step_fork(args, count, &out);
        else
            step_threads(args, count, &out);
        print_step(original, my_number, &out, start, now());
        free(original);
        return;
    }

    int count = split(text, args, 5);
    const char *name = args[0];
    if (strcmp(name, "alloc") == 0)
        step_alloc(args, count, &out);
    else if (strcmp(name, "free") == 0)
        step_free(args, count, 0, &out);
    else if (strcmp(name, "free-async") == 0)
        step_free(args, count, 1, &out);
    else if (strcmp(name, "kernel") == 0)
        step_sleep_kernel(LAUNCH_KERNEL, args, count, &out);
    else if (strcmp(name, "kernelex") == 0)
        step_sleep_kernel(LAUNCH_EX, args, count, &out);
    else if (strcmp(name, "coop") == 0)
        step_sleep_kernel(LAUNCH_COOPERATIVE, args, count, &out);
    else if (strcmp(name, "graph") == 0)
        step_sleep_kernel(LAUNCH_GRAPH, args, count, &out);
    else if (strcmp(name, "fill") == 0)
        step_fill_or_check(FILL, args, count, &out);
    else if (strcmp(name, "check") == 0)
        step_fill_or_check(CHECK, args, count, &out);
    else if (strcmp(name, "allreduce") == 0)
        step_fill_or_check(ALLREDUCE, args, count, &out);
    else if (strcmp(name, "copy") == 0)
        step_copy(args, count, &out);
    else if (strcmp(name, "dtoh") == 0 || strcmp(name, "htod") == 0)
        step_transfer(name[0] == 'd', args, count, &out);
    else if (strcmp(name, "discard") == 0 || strcmp(name, "discard-prefetch") == 0)
        step_discard(name[7] == '-', args, count, &out);
    else if (strcmp(name, "retain") == 0 || strcmp(name, "export") == 0)
        step_vmm_handle(name[0] == 'e', args, count, &out);
    else if (strcmp(name, "sync") == 0 && count == 1)
        out.rc = CALL(FN(cuCtxSynchronize));
    else if (strcmp(name, "stream-sync") == 0 && count == 1)
        out.rc = CALL(STREAM_FN(cuStreamSynchronize, cuStreamSynchronize_ptsz), current_stream);
    else if (strcmp(name, "stream") == 0)
        step_stream(args, count, &out);
    else if (strcmp(name, "join") == 0 && count == 1)
        join_spawned();
    else if (strcmp(name, "stream-query") == 0 && count == 1)
        out.rc = CALL(STREAM_FN(cuStreamQuery, cuStreamQuery_ptsz), current_stream);
    else if (strcmp(name, "capture-begin") == 0)
        step_capture_begin(args, count, &out);
    else if (strcmp(name, "capture-end") == 0 && count == 1)
        step_capture_end(&out);
    else if (strcmp(name, "capture-status") == 0 && count == 1)
        step_capture_status(&out);
    else if (strcmp(name, "graph-launch") == 0 && count == 1)
        step_graph_launch(&out);
    else if (strcmp(name, "prefetch") == 0 && (count == 2 || (count == 3 && strcmp(args[2], "host") == 0))) {
        struct buffer *buffer = get_buffer(args[1]);
        CUmemLocation location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = current_device};
        if (count == 3)
            location.type = CU_MEM_LOCATION_TYPE_HOST;
        out.rc = CALL(STREAM_FN(cuMemPrefetchAsync_v2, cuMemPrefetchAsync_v2_ptsz), buffer->ptr, buffer->bytes, location,
                      0, current_stream);
    } else if (strcmp(name, "sleep") == 0 && count == 2) {
        long long nanoseconds = (long long)(strtod(args[1], NULL) * 1e6);
        struct timespec pause = {.tv_sec = (time_t)(nanoseconds / 1000000000), .tv_nsec = (long)(nanoseconds % 1000000000)};
        while (nanosleep(&pause, &pause) == -1 && errno == EINTR)
            ;
    } else if (strcmp(name, "meminfo") == 0 && count == 1) {
        size_t free_bytes = 0, total = 0;
        out.rc = CALL(FN(cuMemGetInfo_v2), &free_bytes, &total);
        add(&out.fields, ", \"free\": %zu, \"total\": %zu", free_bytes, total);
    } else if (strcmp(name, "ptr") == 0)
        step_ptr(args, count, &out);
    else if (strcmp(name, "ipc") == 0)
        step_ipc(args, count, &out);
    else if (strcmp(name, "ipc-open") == 0)
        step_ipc_open(args, count, &out);
    else if (strcmp(name, "device") == 0 && count == 2)
        out.rc = use_device((int)parse_number(args[1], args[1]));
    else if (strcmp(name, "tag") == 0)
        apply_tag(strchr(original, ':') ? strchr(original, ':') + 1 : "");
    else if (strcmp(name, "lookup") == 0)
        step_lookup(args, count, &out);
    else if (strcmp(name, "exit") == 0 && count == 2) {
        int code = (int)parse_number(args[1], args[1]);
        print_step(original, my_number, &out, start, now());
        exit(code);
    } else if (strcmp(name, "crash") == 0 && count == 1) {
        print_step(original, my_number, &out, start, now());
        kill(getpid(), SIGKILL);
    } else
        usage_error("unknown step %s (see tests/simcuda/README.md)", original);
    print_step(original, my_number, &out, start, now());
    free(original);
}

static void usage(void)
{
    fprintf(stderr, "usage: simapp [--entry=gpa|dlsym|direct] [--ptds] [--module=<image>] <step>...\n"
                    "steps are described in tests/simcuda/README.md\n");
    exit(2);
}

int main(int argc, char **argv)
{
    int first = 1;
    for (; first < argc && strncmp(argv[first], "--", 2) == 0; first++) {
        const char *option = argv[first];
        if (strcmp(option, "--entry=gpa") == 0)
            entry_mode = ENTRY_GPA;
        else if (strcmp(option, "--entry=dlsym") == 0)
            entry_mode = ENTRY_DLSYM;
        else if (strcmp(option, "--entry=direct") == 0)
            entry_mode = ENTRY_DIRECT;
        else if (strcmp(option, "--ptds") == 0)
            per_thread_streams = 1;
        else if (strncmp(option, "--module=", 9) == 0)
            module_path = option + 9;
        else
            usage();
    }
    if (resolve_all() != 0)
        return 2;

    /* The "init" step: what the CUDA runtime does before the first real call. */
    double start = now();
    struct outcome out = {.rc = CALL(FN(cuInit), 0)};
    int count = 0, version = 0;
    if (out.rc == CUDA_SUCCESS)
        out.rc = CALL(FN(cuDriverGetVersion), &version);
    if (out.rc == CUDA_SUCCESS)
        out.rc = CALL(FN(cuDeviceGetCount), &count);
    if (out.rc == CUDA_SUCCESS)
        out.rc = use_device(0);
    add(&out.fields, ", \"entry\": \"%s\", \"ptds\": %s, \"driver\": %d, \"devices\": %d", entry_names[entry_mode],
        per_thread_streams ? "true" : "false", version, count);
    print_step("init", -1, &out, start, now());
    if (out.rc != CUDA_SUCCESS)
        return 1;

    int number = 0;
    for (int i = first; i < argc; i++)
        run_step(argv[i], &number);
    join_spawned();
    return any_failure ? 1 : 0;
}
