/*
 * Collective kernels (collective.c; docs/interceptor.md, "Gangs"): which functions the program
 * launches are collectives (NCCL's kernels, known by their names when the program looks them
 * up), how many each device launched, and the limit a gang's fence holds them to.
 */
#ifndef NVSHARE_COLLECTIVE_H
#define NVSHARE_COLLECTIVE_H

#include <stdatomic.h>
#include <stdint.h>

#include "compiler.h"
#include "cuda_types.h"
#include "gate.h"

/* Functions known to be collectives: 0 in a process that looked none up, where a launch costs
 * one load more than nvs_gate_enter. Written by collective.c's lookup hooks. */
extern _Atomic unsigned nvs_collective_functions;

struct nvs_device *nvs_collective_enter(CUfunction f);

/* Enter the gate for a launch of `f` (as nvs_gate_enter); a collective is counted too, and
 * waits while the device's limit (a gang's fence) allows no more. */
static inline struct nvs_device *nvs_launch_enter(CUfunction f) {
    if (NVS_LIKELY(atomic_load_explicit(&nvs_collective_functions, memory_order_relaxed) == 0))
        return nvs_gate_enter();
    return nvs_collective_enter(f);
}

/* Under nvs_mu (the client thread, carrying out NVS_ACT_COLLECTIVES): let collectives be
 * launched on the device until `limit` have been in all (0: none from now on;
 * NVS_CORE_NO_LIMIT: as many as wanted). Returns how many had been launched when it took effect;
 * launches waiting for room are woken. */
uint64_t nvs_collectives_limit_locked(struct nvs_device *d, uint64_t limit);
/* Collectives launched on the device so far (any thread). */
uint64_t nvs_collectives_launched(const struct nvs_device *d);

#endif
