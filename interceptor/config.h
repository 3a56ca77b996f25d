/*
 * The NVSHARE_* settings (config.c), read once from the environment.
 */
#ifndef NVSHARE_CONFIG_H
#define NVSHARE_CONFIG_H

#include <stdint.h>

#include "protocol_table.h"

/* One entry of NVSHARE_MEMORY_LIMIT (limits.c applies them). */
#define NVS_MAX_LIMIT_RULES 64
struct nvs_memory_limit_rule {
    int ordinal;                         /* CUDA device ordinal, -1: by uuid or every device */
    char uuid[NVS_DEVICE_ID_MAX + 1];    /* "GPU-…"/"MIG-…", "": by ordinal or every device */
    uint64_t bytes;
};

/* Read once from the environment by nvs_config_load() (first use, in an application thread,
 * before any nvshare thread exists) and never written afterwards. */
struct nvs_config {
    char socket_path[256];     /* <socket-dir>/client/scheduler.sock */
    int fail_open;             /* NVSHARE_FAIL_MODE=open */
    long idle_release_ms;      /* NVSHARE_IDLE_RELEASE_MS, -1: take the scheduler's */
    int managed;               /* NVSHARE_MANAGED (default 1): convert allocations */
    int vmm_hide;              /* NVSHARE_VMM=hide: VMM reported unsupported (vmm_swap stays 1) */
    int vmm_swap;              /* NVSHARE_VMM=swap (the default): VMM memory is swapped too (vmm.c) */
    int predrain;              /* NVSHARE_PREDRAIN (default 1): drain ahead of a contended quantum's end */
    int advise;                /* NVSHARE_ADVISE (default 0): advise converted memory onto its device */
    int pool;                  /* NVSHARE_POOL (default 1): swap through the user's shared pool (pool.c) */
    char pool_dir[200];        /* NVSHARE_POOL_DIR (default /dev/shm): where the pool's directory is */
    uint64_t pool_segment;     /* NVSHARE_POOL_SEGMENT (default 512 MiB): bytes per segment of a new pool */
    long pinning_grace_ms;     /* NVSHARE_PINNING_GRACE_MS (default 250): the pinner keeps out of the way (worker.c) */
    char pod[256];             /* NVSHARE_POD_NAME */
    char pod_namespace[256];   /* NVSHARE_POD_NAMESPACE */
    char program[128];         /* NVSHARE_PROGRAM, "" = /proc/self/comm */
    /* NVSHARE_COLLECTIVES: comma-separated words; a kernel whose name contains one is a
     * collective (collective.c). Unset: NCCL's kernels. */
    char collectives[256];
    /* NVSHARE_MEMORY_LIMIT: the limits the process starts with; memory_limit_invalid: the
     * setting did not parse (every device is limited to 0 bytes, limits.c says why). */
    struct nvs_memory_limit_rule memory_limits[NVS_MAX_LIMIT_RULES];
    int n_memory_limits;
    int memory_limit_invalid;
};

extern struct nvs_config nvs_config;
/* Load the configuration once (pthread_once; any thread, cheap afterwards). The driver loader
 * calls it first; NVML lookups (nvml.c) call it in processes that never load the CUDA driver. */
void nvs_config_load(void);

#endif
