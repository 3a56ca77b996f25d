/*
 * Initialisation, configuration (SIMCUDA_DEVICES, SIMCUDA_MEMORY, CUDA_VISIBLE_DEVICES), fork
 * behaviour, error strings and device queries.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "simcuda.h"

struct sim_device sim_devices[SIM_MAX_DEVICES];
int sim_device_count;

static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static CUresult init_result; /* written by run_init under init_once */
static atomic_int initialized;
/* Set in a child forked after cuInit. The real driver cannot be used from such a child: every
 * call fails with CUDA_ERROR_NOT_INITIALIZED. The child never touches the parent's locks,
 * which other threads may have held at the fork. */
static atomic_int forked_after_init;

double sim_now(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + (double)now.tv_nsec * 1e-9;
}

CUresult sim_check_init(void)
{
    if (atomic_load_explicit(&forked_after_init, memory_order_relaxed))
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!atomic_load_explicit(&initialized, memory_order_acquire))
        return CUDA_ERROR_NOT_INITIALIZED;
    return CUDA_SUCCESS;
}

struct sim_device *sim_device_get(CUdevice ordinal)
{
    if (ordinal < 0 || ordinal >= sim_device_count)
        return NULL;
    return &sim_devices[ordinal];
}

static void mark_forked_child(void)
{
    if (atomic_load(&initialized))
        atomic_store(&forked_after_init, 1);
}

/* CUDA_VISIBLE_DEVICES: comma-separated indices or UUIDs (a unique prefix is enough). As with
 * the real driver, the list ends at the first entry that names no device. */
static int visible_devices(int physical_count, int map[SIM_MAX_DEVICES])
{
    const char *list = getenv("CUDA_VISIBLE_DEVICES");
    if (!list) {
        for (int i = 0; i < physical_count; i++)
            map[i] = i;
        return physical_count;
    }
    int count = 0;
    char entry[64];
    while (*list && count < SIM_MAX_DEVICES) {
        size_t len = strcspn(list, ",");
        if (len >= sizeof entry)
            break;
        memcpy(entry, list, len);
        entry[len] = '\0';
        list += len + (list[len] == ',');
        int index = -1;
        char *end;
        long number = strtol(entry, &end, 10);
        if (end != entry && *end == '\0') {
            index = (number >= 0 && number < physical_count) ? (int)number : -1;
        } else if (strncmp(entry, "GPU-", 4) == 0) {
            for (int i = 0; i < physical_count; i++) {
                char uuid[48];
                snprintf(uuid, sizeof uuid, SIM_UUID_FORMAT, i);
                if (strncmp(uuid, entry, len) == 0) {
                    if (index >= 0) { index = -1; break; } /* ambiguous prefix */
                    index = i;
                }
            }
        }
        if (index < 0)
            break;
        for (int i = 0; i < count; i++)
            if (map[i] == index)
                return count; /* a repeated device also ends the list */
        map[count++] = index;
    }
    return count;
}

static void uuid_bytes(int index, CUuuid *uuid)
{
    static const unsigned char prefix[10] = {0x51, 0x51, 0xad, 0x00, 0x00, 0x00, 0x40, 0x00, 0x80, 0x00};
    memcpy(uuid->bytes, prefix, sizeof prefix);
    for (int i = 0; i < 6; i++)
        uuid->bytes[10 + i] = (char)(((uint64_t)index >> (8 * (5 - i))) & 0xff);
}

static void run_init(void)
{
    int physical;
    size_t memory;
    if (sim_read_config("simcuda", &physical, &memory) != 0) {
        init_result = CUDA_ERROR_INVALID_VALUE;
        return;
    }
    int map[SIM_MAX_DEVICES];
    sim_device_count = visible_devices(physical, map);
    if (sim_device_count == 0) {
        init_result = CUDA_ERROR_NO_DEVICE;
        return;
    }
    init_result = sim_trace_open();
    if (init_result != CUDA_SUCCESS)
        return;
    for (int i = 0; i < sim_device_count; i++) {
        struct sim_device *device = &sim_devices[i];
        device->ordinal = i;
        device->index = map[i];
        snprintf(device->uuid_text, sizeof device->uuid_text, SIM_UUID_FORMAT, map[i]);
        uuid_bytes(map[i], &device->uuid);
        device->total = memory;
        device->primary = sim_ctx_new(device, 1, 0);
        device->default_pool = sim_pool_new(device, 1);
    }
    init_result = sim_mem_open();
    if (init_result != CUDA_SUCCESS)
        return;
    init_result = sim_residency_open();
    if (init_result != CUDA_SUCCESS)
        return;
    init_result = sim_collective_open();
    if (init_result != CUDA_SUCCESS)
        return;
    pthread_atfork(NULL, NULL, mark_forked_child);
    atomic_store_explicit(&initialized, 1, memory_order_release);
}

SIM_EXPORT CUresult cuInit(unsigned int Flags)
{
    if (atomic_load(&forked_after_init))
        return CUDA_ERROR_NOT_INITIALIZED;
    if (Flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_once(&init_once, run_init);
    return init_result;
}

/* SIMCUDA_DRIVER_VERSION (CUDA version numbers: 12080 for a 12.8 driver), at most the simulated
 * driver's own; read on first use (lookups happen before cuInit). An unusable value is the
 * driver's own version, with a message. */
static pthread_once_t version_once = PTHREAD_ONCE_INIT;
static int driver_version = SIM_DRIVER_VERSION;

static void read_driver_version(void)
{
    const char *text = getenv("SIMCUDA_DRIVER_VERSION");
    if (!text)
        return;
    char *end;
    long value = strtol(text, &end, 10);
    if (end == text || *end || value < 2000 || value > SIM_DRIVER_VERSION)
        fprintf(stderr, "simcuda: SIMCUDA_DRIVER_VERSION=%s is not a CUDA version from 2000 to %d\n", text,
                SIM_DRIVER_VERSION);
    else
        driver_version = (int)value;
}

int sim_driver_version(void)
{
    pthread_once(&version_once, read_driver_version);
    return driver_version;
}

SIM_EXPORT CUresult cuDriverGetVersion(int *driverVersion)
{
    if (!driverVersion)
        return CUDA_ERROR_INVALID_VALUE;
    *driverVersion = sim_driver_version();
    return CUDA_SUCCESS;
}

/* ---- Errors ---- */

struct error_text {
    CUresult code;
    const char *name;
    const char *text;
};

#define ERROR_TEXT(code, text) {code, #code, text}
static const struct error_text error_texts[] = {
    ERROR_TEXT(CUDA_SUCCESS, "no error"),
    ERROR_TEXT(CUDA_ERROR_INVALID_VALUE, "invalid argument"),
    ERROR_TEXT(CUDA_ERROR_OUT_OF_MEMORY, "out of memory"),
    ERROR_TEXT(CUDA_ERROR_NOT_INITIALIZED, "initialization error"),
    ERROR_TEXT(CUDA_ERROR_DEINITIALIZED, "driver shutting down"),
    ERROR_TEXT(CUDA_ERROR_NO_DEVICE, "no CUDA-capable device is detected"),
    ERROR_TEXT(CUDA_ERROR_INVALID_DEVICE, "invalid device ordinal"),
    ERROR_TEXT(CUDA_ERROR_INVALID_IMAGE, "device kernel image is invalid"),
    ERROR_TEXT(CUDA_ERROR_INVALID_CONTEXT, "invalid device context"),
    ERROR_TEXT(CUDA_ERROR_FILE_NOT_FOUND, "file not found"),
    ERROR_TEXT(CUDA_ERROR_OPERATING_SYSTEM, "OS call failed or operation not supported on this OS"),
    ERROR_TEXT(CUDA_ERROR_INVALID_HANDLE, "invalid resource handle"),
    ERROR_TEXT(CUDA_ERROR_ILLEGAL_STATE, "the operation cannot be performed in the present state"),
    ERROR_TEXT(CUDA_ERROR_NOT_FOUND, "named symbol not found"),
    ERROR_TEXT(CUDA_ERROR_NOT_READY, "device not ready"),
    ERROR_TEXT(CUDA_ERROR_ILLEGAL_ADDRESS, "an illegal memory access was encountered"),
    ERROR_TEXT(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, "part or all of the requested memory range is already mapped"),
    ERROR_TEXT(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, "pointer does not correspond to a registered memory region"),
    ERROR_TEXT(CUDA_ERROR_LAUNCH_FAILED, "unspecified launch failure"),
    ERROR_TEXT(CUDA_ERROR_NOT_PERMITTED, "operation not permitted"),
    ERROR_TEXT(CUDA_ERROR_NOT_SUPPORTED, "operation not supported"),
    ERROR_TEXT(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "operation not permitted when stream is capturing"),
    ERROR_TEXT(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, "operation failed due to a previous error during capture"),
    ERROR_TEXT(CUDA_ERROR_UNKNOWN, "unknown error"),
};
#undef ERROR_TEXT

static const struct error_text *find_error(CUresult code)
{
    for (size_t i = 0; i < sizeof error_texts / sizeof error_texts[0]; i++)
        if (error_texts[i].code == code)
            return &error_texts[i];
    return NULL;
}

SIM_EXPORT CUresult cuGetErrorString(CUresult error, const char **pStr)
{
    if (!pStr)
        return CUDA_ERROR_INVALID_VALUE;
    const struct error_text *entry = find_error(error);
    *pStr = entry ? entry->text : NULL;
    return entry ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

SIM_EXPORT CUresult cuGetErrorName(CUresult error, const char **pStr)
{
    if (!pStr)
        return CUDA_ERROR_INVALID_VALUE;
    const struct error_text *entry = find_error(error);
    *pStr = entry ? entry->name : NULL;
    return entry ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* The runtime's private tables do not exist here; callers get what the real driver answers for
 * a table id it does not know. */
SIM_EXPORT CUresult cuGetExportTable(const void **ppExportTable, const CUuuid *pExportTableId)
{
    if (ppExportTable)
        *ppExportTable = NULL;
    (void)pExportTableId;
    return CUDA_ERROR_INVALID_VALUE;
}

/* ---- Devices ---- */

SIM_EXPORT CUresult cuDeviceGet(CUdevice *device, int ordinal)
{
    SIM_ENTER();
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    SIM_REQUIRE_DEVICE(ordinal, found);
    *device = found->ordinal;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGetCount(int *count)
{
    SIM_ENTER();
    if (!count)
        return CUDA_ERROR_INVALID_VALUE;
    *count = sim_device_count;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
{
    SIM_ENTER();
    if (!name || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    SIM_REQUIRE_DEVICE(dev, device);
    (void)device;
    snprintf(name, (size_t)len, "%s", SIM_DEVICE_NAME);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)
{
    SIM_ENTER();
    if (!uuid)
        return CUDA_ERROR_INVALID_VALUE;
    SIM_REQUIRE_DEVICE(dev, device);
    *uuid = device->uuid;
    return CUDA_SUCCESS;
}

/* _v2 differs only on MIG instances, which are not simulated. */
SIM_EXPORT CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev)
{
    return cuDeviceGetUuid(uuid, dev);
}

/* The 32-bit ABI: the size saturates, as measured. */
SIM_EXPORT CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev)
{
    size_t total;
    CUresult result = cuDeviceTotalMem_v2(bytes ? &total : NULL, dev);
    if (result == CUDA_SUCCESS)
        *bytes = total > UINT32_MAX ? UINT32_MAX : (unsigned int)total;
    return result;
}

SIM_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    SIM_ENTER();
    if (!bytes)
        return CUDA_ERROR_INVALID_VALUE;
    SIM_REQUIRE_DEVICE(dev, device);
    *bytes = device->total;
    return CUDA_SUCCESS;
}

/* Values of an H100/H200-class device; attributes not listed are 0 (feature absent). */
static const struct {
    int attribute;
    int value;
} device_attributes[] = {
    {1, 1024},         /* MAX_THREADS_PER_BLOCK */
    {2, 1024},         /* MAX_BLOCK_DIM_X */
    {3, 1024},         /* MAX_BLOCK_DIM_Y */
    {4, 64},           /* MAX_BLOCK_DIM_Z */
    {5, 2147483647},   /* MAX_GRID_DIM_X */
    {6, 65535},        /* MAX_GRID_DIM_Y */
    {7, 65535},        /* MAX_GRID_DIM_Z */
    {8, 49152},        /* MAX_SHARED_MEMORY_PER_BLOCK */
    {9, 65536},        /* TOTAL_CONSTANT_MEMORY */
    {10, 32},          /* WARP_SIZE */
    {11, 2147483647},  /* MAX_PITCH */
    {12, 65536},       /* MAX_REGISTERS_PER_BLOCK */
    {13, 1980000},     /* CLOCK_RATE (kHz) */
    {14, 512},         /* TEXTURE_ALIGNMENT */
    {15, 1},           /* GPU_OVERLAP */
    {16, 132},         /* MULTIPROCESSOR_COUNT */
    {19, 1},           /* CAN_MAP_HOST_MEMORY */
    {30, 512},         /* SURFACE_ALIGNMENT */
    {31, 1},           /* CONCURRENT_KERNELS */
    {32, 1},           /* ECC_ENABLED */
    {36, 2619000},     /* MEMORY_CLOCK_RATE (kHz) */
    {37, 6144},        /* GLOBAL_MEMORY_BUS_WIDTH */
    {38, 52428800},    /* L2_CACHE_SIZE */
    {39, 2048},        /* MAX_THREADS_PER_MULTIPROCESSOR */
    {40, 3},           /* ASYNC_ENGINE_COUNT */
    {41, 1},           /* UNIFIED_ADDRESSING */
    {51, 32},          /* TEXTURE_PITCH_ALIGNMENT */
    {75, 9},           /* COMPUTE_CAPABILITY_MAJOR */
    {76, 0},           /* COMPUTE_CAPABILITY_MINOR */
    {78, 1},           /* STREAM_PRIORITIES_SUPPORTED */
    {79, 1},           /* GLOBAL_L1_CACHE_SUPPORTED */
    {80, 1},           /* LOCAL_L1_CACHE_SUPPORTED */
    {81, 233472},      /* MAX_SHARED_MEMORY_PER_MULTIPROCESSOR */
    {82, 65536},       /* MAX_REGISTERS_PER_MULTIPROCESSOR */
    {83, 1},           /* MANAGED_MEMORY */
    {87, 2},           /* SINGLE_TO_DOUBLE_PRECISION_PERF_RATIO */
    {88, 0},           /* PAGEABLE_MEMORY_ACCESS, as measured on the H200 */
    {89, 1},           /* CONCURRENT_MANAGED_ACCESS */
    {90, 1},           /* COMPUTE_PREEMPTION_SUPPORTED */
    {95, 1},           /* COOPERATIVE_LAUNCH */
    {97, 232448},      /* MAX_SHARED_MEMORY_PER_BLOCK_OPTIN */
    {99, 1},           /* HOST_REGISTER_SUPPORTED */
    {102, 1},          /* VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED */
    {103, 1},          /* HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED */
    {106, 32},         /* MAX_BLOCKS_PER_MULTIPROCESSOR */
    {108, 34603008},   /* MAX_PERSISTING_L2_CACHE_SIZE */
    {109, 134213632},  /* MAX_ACCESS_POLICY_WINDOW_SIZE */
    {111, 1024},       /* RESERVED_SHARED_MEMORY_PER_BLOCK */
    {115, 1},          /* MEMORY_POOLS_SUPPORTED */
    {119, 9},          /* MEMPOOL_SUPPORTED_HANDLE_TYPES: POSIX file descriptors, fabric */
    {120, 1},          /* CLUSTER_LAUNCH */
    {124, 1},          /* CAN_USE_64_BIT_STREAM_MEM_OPS */
    {125, 1},          /* CAN_USE_STREAM_WAIT_VALUE_NOR */
    {126, 1},          /* DMA_BUF_SUPPORTED */
};
/* One past the highest attribute id a CUDA 13 driver knows. */
#define DEVICE_ATTRIBUTE_END 150

SIM_EXPORT CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev)
{
    SIM_ENTER();
    if (!pi || (int)attrib <= 0 || (int)attrib >= DEVICE_ATTRIBUTE_END)
        return CUDA_ERROR_INVALID_VALUE;
    SIM_REQUIRE_DEVICE(dev, device);
    *pi = 0;
    if ((int)attrib == 33) /* PCI_BUS_ID: one bus per simulated GPU */
        *pi = 0x10 + device->index;
    for (size_t i = 0; i < sizeof device_attributes / sizeof device_attributes[0]; i++)
        if (device_attributes[i].attribute == (int)attrib)
            *pi = device_attributes[i].value;
    return CUDA_SUCCESS;
}
