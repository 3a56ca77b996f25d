/*
 * The NVML memory-query types nvshare needs, declared here (ABI of nvml.h, NVML 12/13) so that
 * neither the interceptor's NVML hooks (interceptor/nvml.c) nor the simulated NVML
 * (tests/simcuda/nvml.c) needs the NVML headers to build, and both agree on one layout.
 */
#ifndef NVSHARE_NVML_TYPES_H
#define NVSHARE_NVML_TYPES_H

typedef struct nvmlDevice_st *nvmlDevice_t;

typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;

#endif
