/*
 * NVML's memory queries (nvml.h, NVS_FOR_EACH_NVML_HOOK): nvidia-smi or pynvml inside a process
 * with a memory limit see a device of the limit's size. They are substituted in every process,
 * since the scheduler may set a limit at any time after the lookup (pynvml looks a function up
 * once); without a limit NVML's figures are handed on unchanged.
 *
 * used: where this process has used the device through CUDA, its own allocations (what its
 * limit counts); otherwise (nvidia-smi, a separate process that allocated nothing) NVML's own
 * figure for the whole device, which includes every process's memory, clipped to the limit.
 * total = min(limit, the device's memory), free = total - used; the v2 query's `reserved` (the
 * driver's own memory, not charged to the limit) is reported as 0. docs/interceptor.md.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <string.h>

#include "admission.h"
#include "config.h"
#include "gate.h"
#include "limits.h"
#include "loader.h"
#include "nvml.h"

#define NVML_SUCCESS 0

/* NVML's own functions, resolved once (inside load_once) from the libnvidia-ml.so.1 the process
 * has loaded; read only after pthread_once returned, so without further synchronisation. */
static struct {
#define NVML_FIELD(name, params, args) nvmlReturn_t(*name) params;
    NVS_FOR_EACH_NVML_HOOK(NVML_FIELD)
#undef NVML_FIELD
#define NVML_REAL_FIELD(name, params) nvmlReturn_t(*name) params;
    NVS_FOR_EACH_NVML_REAL(NVML_REAL_FIELD)
#undef NVML_REAL_FIELD
} real;
static pthread_once_t load_once = PTHREAD_ONCE_INIT;

static void load_nvml(void) {
    /* Only the copy the process loaded itself (a lookup must not load NVML). The reference
     * RTLD_NOLOAD takes is kept, so the library cannot be unloaded under the addresses below. */
    void *nvml = dlopen("libnvidia-ml.so.1", RTLD_LAZY | RTLD_NOLOAD);
    nvs_dlsym_fn next = nvs_real_dlsym();
    if (nvml == NULL || next == NULL) return;
#define NVML_RESOLVE(name, ...) real.name = (__typeof__(real.name))next(nvml, #name);
    NVS_FOR_EACH_NVML_HOOK(NVML_RESOLVE)
    NVS_FOR_EACH_NVML_REAL(NVML_RESOLVE)
#undef NVML_RESOLVE
}

void *nvs_nvml_substitute(void *address) {
    if (address == NULL) return address;
    nvs_config_load();
    pthread_once(&load_once, load_nvml);
#define NVML_SUBSTITUTE(name, params, args)                                                     \
    if ((void *)real.name == address) return (void *)nvs_nvml_##name;
    NVS_FOR_EACH_NVML_HOOK(NVML_SUBSTITUTE)
#undef NVML_SUBSTITUTE
    return address;
}

/* Replace NVML's figures for `device` by the limited view; leaves them alone (returns 0) when
 * the device has no limit or cannot be identified. */
static int limit_figures(nvmlDevice_t device, unsigned long long *total, unsigned long long *free,
                         unsigned long long *used) {
    char uuid[NVS_DEVICE_ID_MAX + 1];
    if (real.nvmlDeviceGetUUID == NULL || real.nvmlDeviceGetUUID(device, uuid, sizeof uuid) != NVML_SUCCESS)
        return 0;
    pthread_mutex_lock(&nvs_mu);
    struct nvs_device *d = nvs_device_by_uuid(uuid);
    pthread_mutex_unlock(&nvs_mu);
    nvs_admission_await_registration(d); /* used through CUDA: the scheduler's limits apply too */
    uint64_t limit = d != NULL ? nvs_limit_of(d) : nvs_limit_of_unopened(uuid);
    if (limit == NVS_NO_LIMIT) return 0;
    uint64_t own = d != NULL ? atomic_load(&d->bytes) : *used;
    uint64_t limited_total, limited_free;
    nvs_limit_figures(limit, *total, own, UINT64_MAX, &limited_total, &limited_free);
    *total = limited_total;
    *used = own < limited_total ? own : limited_total;
    *free = limited_free;
    return 1;
}

nvmlReturn_t nvs_nvml_nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    nvmlReturn_t r = real.nvmlDeviceGetMemoryInfo(device, memory);
    if (r == NVML_SUCCESS) limit_figures(device, &memory->total, &memory->free, &memory->used);
    return r;
}

nvmlReturn_t nvs_nvml_nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    nvmlReturn_t r = real.nvmlDeviceGetMemoryInfo_v2(device, memory);
    if (r == NVML_SUCCESS && limit_figures(device, &memory->total, &memory->free, &memory->used))
        memory->reserved = 0;
    return r;
}
