/*
 * Simulated NVML (libnvidia-ml.so.1) for machines without a GPU.
 *
 * It reports the same devices as the simulated CUDA driver, read from the same variables by the
 * same code (sim_devices.c):
 *   SIMCUDA_DEVICES  number of GPUs (default 1, at most SIM_MAX_DEVICES)
 *   SIMCUDA_MEMORY   memory per GPU in bytes, K/M/G suffixes are powers of 1024 (default 16G)
 *   SIMNVML_USED     memory every GPU reports as used (default 0: as if no process used it;
 *                    for tests of what a reader that did not allocate it is shown)
 * Device i has UUID GPU-5151ad00-0000-4000-8000-%012x (i), name "nvshare simulated GPU",
 * compute capability 9.0, minor number i. Both variables are read once, by the first init; a
 * value that does not parse makes it fail with NVML_ERROR_UNKNOWN (and cuInit as well).
 *
 * Dynamic state for tests: SIMNVML_STATE names a file that is re-read on every call. Each line
 * is "<index> <state>" with <state> one of
 *   ok        the GPU is present (also the state of every GPU the file does not mention)
 *   gone      the GPU fell off the bus: nvmlDeviceGetHandleByIndex and every query on a handle
 *             fail with NVML_ERROR_GPU_IS_LOST, nvmlDeviceGetHandleByUUID with
 *             NVML_ERROR_NOT_FOUND; the device count does not change
 *   xid:<n>   the GPU works, and one critical Xid event (nvmlEventTypeXidCriticalError,
 *             eventData n) is delivered to each event set registered for it. An event set
 *             delivers the same Xid of a GPU again only after the line showed something else.
 *   hang      a wedged driver: nvmlDeviceGetHandleByUUID for the GPU blocks (saying so once on
 *             stderr: "simnvml: GPU <i>: nvmlDeviceGetHandleByUUID hangs") until the line
 *             shows something else; other calls behave as for ok
 * A missing file means every GPU is ok; a line that does not parse is reported on stderr and
 * ignored.
 *
 * Implemented: init/shutdown (reference counted, as the real library), error strings, driver,
 * NVML and CUDA versions, device count, handles by index and UUID, UUID, name, index, minor
 * number, memory info (v1 and v2: SIMNVML_USED is used, nothing else), compute capability, and the event API
 * (create, supported types, register, wait, free). Process queries are not implemented: this
 * library shares no state with the simulated driver, so it could not list real clients.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nvml_types.h"
#include "sim_devices.h"

typedef enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_MEMORY = 20,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999,
} nvmlReturn_t;

#define NVML_EVENT_TYPE_XID_CRITICAL_ERROR 0x8ULL
#define NVML_MEMORY_V2_VERSION (sizeof(nvmlMemory_v2_t) | (2u << 24))

#define SIMNVML_DRIVER_VERSION "580.00.sim"
#define SIMNVML_NVML_VERSION "13.580.00.sim"
#define SIMNVML_CUDA_VERSION 13000
#define SIMNVML_POLL_NS 10000000L /* how often a waiting event set re-reads the state file */

struct nvmlDevice_st {
    unsigned int index;
    char uuid[48];
};

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

struct nvmlEventSet_st {
    unsigned long long registered[SIM_MAX_DEVICES];    /* event mask per device */
    unsigned long long delivered_xid[SIM_MAX_DEVICES]; /* 0: none since the last non-xid */
};
typedef struct nvmlEventSet_st *nvmlEventSet_t;

enum gpu_state { GPU_OK, GPU_GONE, GPU_XID, GPU_HANG };

struct device_state {
    enum gpu_state state;
    unsigned long long xid;
};

/* Written by the first nvmlInit under state_lock, read-only afterwards. */
static struct nvmlDevice_st devices[SIM_MAX_DEVICES];
static unsigned int device_count;
static unsigned long long device_memory;
static unsigned long long device_used; /* SIMNVML_USED */
static int configured;

/* init_refcount: written under state_lock by init/shutdown; read under it by every call. */
static pthread_mutex_t state_lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned int init_refcount;

static nvmlReturn_t configure_locked(void)
{
    if (configured)
        return NVML_SUCCESS;
    int count;
    size_t memory;
    if (sim_read_config("simnvml", &count, &memory) != 0)
        return NVML_ERROR_UNKNOWN;
    for (int i = 0; i < count; i++) {
        devices[i].index = (unsigned int)i;
        snprintf(devices[i].uuid, sizeof devices[i].uuid, SIM_UUID_FORMAT, i);
    }
    const char *used_text = getenv("SIMNVML_USED");
    size_t used = 0;
    if (used_text && (sim_parse_size(used_text, &used) != 0 || used > memory)) {
        fprintf(stderr, "simnvml: SIMNVML_USED=%s is not a byte count within SIMCUDA_MEMORY\n", used_text);
        return NVML_ERROR_UNKNOWN;
    }
    device_count = (unsigned int)count;
    device_memory = memory;
    device_used = used;
    configured = 1;
    return NVML_SUCCESS;
}

/* Reads SIMNVML_STATE into states[0..device_count). */
static void read_states(struct device_state *states)
{
    for (unsigned int i = 0; i < device_count; i++)
        states[i] = (struct device_state){GPU_OK, 0};
    const char *path = getenv("SIMNVML_STATE");
    if (!path || !*path)
        return;
    FILE *file = fopen(path, "r");
    if (!file)
        return;
    char line[128];
    while (fgets(line, sizeof line, file)) {
        unsigned int index;
        char word[64];
        unsigned long long xid;
        if (line[0] == '\n' || line[0] == '#')
            continue;
        if (sscanf(line, "%u %63s", &index, word) != 2 || index >= device_count) {
            fprintf(stderr, "simnvml: %s: ignoring line %s", path, line);
            continue;
        }
        if (strcmp(word, "ok") == 0)
            states[index] = (struct device_state){GPU_OK, 0};
        else if (strcmp(word, "gone") == 0)
            states[index] = (struct device_state){GPU_GONE, 0};
        else if (strcmp(word, "hang") == 0)
            states[index] = (struct device_state){GPU_HANG, 0};
        else if (sscanf(word, "xid:%llu", &xid) == 1 && xid > 0)
            states[index] = (struct device_state){GPU_XID, xid};
        else
            fprintf(stderr, "simnvml: %s: ignoring line %s", path, line);
    }
    fclose(file);
}

static enum gpu_state state_of(unsigned int index)
{
    struct device_state states[SIM_MAX_DEVICES];
    read_states(states);
    return states[index].state;
}

static int initialized(void)
{
    pthread_mutex_lock(&state_lock);
    int result = init_refcount > 0;
    pthread_mutex_unlock(&state_lock);
    return result;
}

/* Checks a handle from the caller: initialised, one of ours, and not fallen off the bus. */
static nvmlReturn_t check_device(nvmlDevice_t device)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (device < devices || device >= devices + device_count)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (state_of(device->index) == GPU_GONE)
        return NVML_ERROR_GPU_IS_LOST;
    return NVML_SUCCESS;
}

static nvmlReturn_t copy_string(char *buffer, unsigned int length, const char *text)
{
    if (!buffer)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(text) + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(buffer, text, strlen(text) + 1);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    pthread_mutex_lock(&state_lock);
    nvmlReturn_t result = configure_locked();
    if (result == NVML_SUCCESS)
        init_refcount++;
    pthread_mutex_unlock(&state_lock);
    return result;
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void)
{
    pthread_mutex_lock(&state_lock);
    nvmlReturn_t result = NVML_ERROR_UNINITIALIZED;
    if (init_refcount > 0) {
        init_refcount--;
        result = NVML_SUCCESS;
    }
    pthread_mutex_unlock(&state_lock);
    return result;
}

const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Version mismatch";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    return copy_string(version, length, SIMNVML_DRIVER_VERSION);
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    return copy_string(version, length, SIMNVML_NVML_VERSION);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *version)
{
    if (!version)
        return NVML_ERROR_INVALID_ARGUMENT;
    *version = SIMNVML_CUDA_VERSION;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *version)
{
    return nvmlSystemGetCudaDriverVersion(version);
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    *count = device_count;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!device || index >= device_count)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (state_of(index) == GPU_GONE)
        return NVML_ERROR_GPU_IS_LOST;
    *device = &devices[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!uuid || !device)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int i = 0; i < device_count; i++) {
        if (strcmp(devices[i].uuid, uuid) == 0) {
            if (state_of(i) == GPU_HANG) {
                fprintf(stderr, "simnvml: GPU %u: nvmlDeviceGetHandleByUUID hangs\n", i);
                const struct timespec poll = {0, SIMNVML_POLL_NS};
                while (state_of(i) == GPU_HANG)
                    nanosleep(&poll, NULL);
            }
            if (state_of(i) == GPU_GONE)
                return NVML_ERROR_NOT_FOUND;
            *device = &devices[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    nvmlReturn_t result = check_device(device);
    return result != NVML_SUCCESS ? result : copy_string(uuid, length, device->uuid);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    nvmlReturn_t result = check_device(device);
    return result != NVML_SUCCESS ? result : copy_string(name, length, SIM_DEVICE_NAME);
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    nvmlReturn_t result = check_device(device);
    if (result != NVML_SUCCESS)
        return result;
    if (!index)
        return NVML_ERROR_INVALID_ARGUMENT;
    *index = device->index;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minor)
{
    return nvmlDeviceGetIndex(device, minor);
}

nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor)
{
    nvmlReturn_t result = check_device(device);
    if (result != NVML_SUCCESS)
        return result;
    if (!major || !minor)
        return NVML_ERROR_INVALID_ARGUMENT;
    *major = 9;
    *minor = 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    nvmlReturn_t result = check_device(device);
    if (result != NVML_SUCCESS)
        return result;
    if (!memory)
        return NVML_ERROR_INVALID_ARGUMENT;
    *memory = (nvmlMemory_t){.total = device_memory, .free = device_memory - device_used, .used = device_used};
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    nvmlReturn_t result = check_device(device);
    if (result != NVML_SUCCESS)
        return result;
    if (!memory)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (memory->version != NVML_MEMORY_V2_VERSION)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    memory->total = device_memory;
    memory->reserved = 0;
    memory->free = device_memory - device_used;
    memory->used = device_used;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!set)
        return NVML_ERROR_INVALID_ARGUMENT;
    *set = calloc(1, sizeof **set);
    return *set ? NVML_SUCCESS : NVML_ERROR_MEMORY;
}

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *types)
{
    nvmlReturn_t result = check_device(device);
    if (result != NVML_SUCCESS)
        return result;
    if (!types)
        return NVML_ERROR_INVALID_ARGUMENT;
    *types = NVML_EVENT_TYPE_XID_CRITICAL_ERROR;
    return NVML_SUCCESS;
}

/*
 * The event set's masks are written here and read by nvmlEventSetWait; as with the real library,
 * the caller must not register on a set while another thread waits on it.
 */
nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long types,
                                      nvmlEventSet_t set)
{
    nvmlReturn_t result = check_device(device);
    if (result != NVML_SUCCESS)
        return result;
    if (!set)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (types & ~NVML_EVENT_TYPE_XID_CRITICAL_ERROR)
        return NVML_ERROR_NOT_SUPPORTED;
    set->registered[device->index] |= types;
    return NVML_SUCCESS;
}

/* One pass over the state file: fills *data and returns 1 when an Xid is due for this set. */
static int take_pending_event(nvmlEventSet_t set, nvmlEventData_t *data)
{
    struct device_state states[SIM_MAX_DEVICES];
    read_states(states);
    for (unsigned int i = 0; i < device_count; i++) {
        if (!(set->registered[i] & NVML_EVENT_TYPE_XID_CRITICAL_ERROR))
            continue;
        if (states[i].state != GPU_XID) {
            set->delivered_xid[i] = 0;
            continue;
        }
        if (set->delivered_xid[i] == states[i].xid)
            continue;
        set->delivered_xid[i] = states[i].xid;
        *data = (nvmlEventData_t){
            .device = &devices[i],
            .eventType = NVML_EVENT_TYPE_XID_CRITICAL_ERROR,
            .eventData = states[i].xid,
            .gpuInstanceId = ~0u,
            .computeInstanceId = ~0u,
        };
        return 1;
    }
    return 0;
}

nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeout_ms)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!set || !data)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct timespec now, deadline;
    clock_gettime(CLOCK_MONOTONIC, &deadline);
    deadline.tv_sec += timeout_ms / 1000;
    deadline.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (deadline.tv_nsec >= 1000000000L) {
        deadline.tv_sec++;
        deadline.tv_nsec -= 1000000000L;
    }
    for (;;) {
        if (take_pending_event(set, data))
            return NVML_SUCCESS;
        clock_gettime(CLOCK_MONOTONIC, &now);
        long long left_ns = (long long)(deadline.tv_sec - now.tv_sec) * 1000000000LL +
                            (deadline.tv_nsec - now.tv_nsec);
        if (left_ns <= 0)
            return NVML_ERROR_TIMEOUT;
        struct timespec pause = {0, left_ns < SIMNVML_POLL_NS ? (long)left_ns : SIMNVML_POLL_NS};
        nanosleep(&pause, NULL);
    }
}

nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeout_ms)
{
    return nvmlEventSetWait_v2(set, data, timeout_ms);
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    if (!set)
        return NVML_ERROR_INVALID_ARGUMENT;
    free(set);
    return NVML_SUCCESS;
}
