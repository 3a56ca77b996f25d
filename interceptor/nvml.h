/*
 * NVML's memory queries (nvml.c): their list, their wrappers, and dlsym's substitution (hooks.c).
 */
#ifndef NVSHARE_NVML_H
#define NVSHARE_NVML_H

#include "nvml_types.h"

/*
 * NVML (nvml.c): the memory queries of libnvidia-ml.so.1, so that nvidia-smi and pynvml inside a
 * process with a memory limit report the limit. Kept apart from the driver's hooks: they are not
 * exported and reached only through dlsym (nvidia-smi and pynvml dlopen NVML and look each
 * function up), and only in a process with a limit; without one, dlsym hands out NVML's own
 * functions and nothing of NVML is touched.
 *
 *   N(name, (parameters), (arguments))   the wrapper is nvs_nvml_<name>, hand-written in nvml.c
 *
 * NVS_FOR_EACH_NVML_REAL lists NVML functions nvshare only calls.
 */
typedef int nvmlReturn_t;

#define NVS_FOR_EACH_NVML_HOOK(N)                                                               \
    N(nvmlDeviceGetMemoryInfo, (nvmlDevice_t device, nvmlMemory_t *memory), (device, memory))   \
    N(nvmlDeviceGetMemoryInfo_v2, (nvmlDevice_t device, nvmlMemory_v2_t *memory), (device, memory))

#define NVS_FOR_EACH_NVML_REAL(N)                                                               \
    N(nvmlDeviceGetUUID, (nvmlDevice_t device, char *uuid, unsigned int length))

#define NVS_DECLARE_NVML_HOOK(name, params, args) nvmlReturn_t nvs_nvml_##name params;
NVS_FOR_EACH_NVML_HOOK(NVS_DECLARE_NVML_HOOK)
#undef NVS_DECLARE_NVML_HOOK

/* dlsym's answer for an NVML symbol: the wrapper standing for `address` if it is the address of
 * a hooked NVML function of libnvidia-ml.so.1, else `address`. */
void *nvs_nvml_substitute(void *address);

#endif
