/*
 * Per-device memory limits (limits.c). Compile with -iquote, not -I, for this directory: with
 * -I, this header would stand in for the C library's <limits.h>.
 */
#ifndef NVSHARE_LIMITS_H
#define NVSHARE_LIMITS_H

#include <stddef.h>
#include <stdint.h>

struct nvs_device;

#define NVS_NO_LIMIT UINT64_MAX

/* The memory limit of device `d` in bytes (NVS_NO_LIMIT: none). Any thread, no lock: one atomic
 * load once decided (from NVSHARE_MEMORY_LIMIT, on first use). */
uint64_t nvs_limit_of(const struct nvs_device *d);
/* Change d's limit at run time (NVS_NO_LIMIT lifts it); any thread, takes no lock, makes no
 * CUDA call. Allocations from then on are charged against the new limit; memory already
 * allocated stays (a limit below the current use refuses every allocation until frees bring the
 * use under it). */
void nvs_limit_set(struct nvs_device *d, uint64_t bytes);
/* The scheduler's limit of d changed to `bytes` (0: none; LIMIT in docs/protocol.md): the
 * limit becomes the smaller of it and the configured one (NVSHARE_MEMORY_LIMIT), so the
 * scheduler can lower what the environment allows, never raise it. Any thread, no lock. */
void nvs_limit_from_scheduler(struct nvs_device *d, uint64_t bytes);
/* The configured limit of a device this process has not used through CUDA, by UUID (NVML). */
uint64_t nvs_limit_of_unopened(const char *uuid);
/* What a limited process is told: total = min(limit, real_total); free = total - used, but no
 * more than `available` (what it would be told without a limit). */
void nvs_limit_figures(uint64_t limit, uint64_t real_total, uint64_t used, uint64_t available,
                       uint64_t *total_out, uint64_t *free_out);
/* Log (at most once a second) that `call` of `size` bytes was refused by d's limit. Call it
 * with no lock held (it writes to stderr). */
void nvs_limit_refused(const struct nvs_device *d, const char *call, size_t size, uint64_t used, uint64_t limit);

#endif
