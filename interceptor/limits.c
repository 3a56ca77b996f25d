/*
 * Per-device memory limits of this process (NVSHARE_MEMORY_LIMIT; docs/interceptor.md). This
 * file says what each device's limit is, lets it change at run time, and explains refusals.
 * Charging allocations against it is memory.c's (the byte counts live there); what the
 * application is told (cuMemGetInfo, cuDeviceTotalMem, NVML) is memory.c's and nvml.c's, from
 * the figures computed here.
 */
#include <stdio.h>
#include <string.h>

#include "compiler.h"
#include "config.h"
#include "gate.h"
#include "limits.h"
#include "log.h"

/* A device's limit, by ordinal, stored as limit + 1 so that 0 means "not decided yet": the
 * first reader decides it from the configuration with a compare-and-swap, and nvs_limit_set
 * simply stores, so a limit set at run time is never overwritten by a late first reader. Any
 * thread; no lock (the allocation path reads it with one load). NVS_NO_LIMIT stays as it is. */
static _Atomic uint64_t limit_slot[NVS_MAX_DEVICES];
#define UNDECIDED 0

static uint64_t encode(uint64_t limit) { return limit == NVS_NO_LIMIT ? NVS_NO_LIMIT : limit + 1; }
static uint64_t decode(uint64_t slot) { return slot == NVS_NO_LIMIT ? NVS_NO_LIMIT : slot - 1; }

/* The configured limit of a device: its UUID's entry, else its ordinal's (ordinal < 0: the
 * ordinal is unknown), else the entry for every device. */
static uint64_t configured_limit(int ordinal, const char *uuid) {
    if (nvs_config.memory_limit_invalid) return 0;
    uint64_t every = NVS_NO_LIMIT, by_ordinal = NVS_NO_LIMIT;
    for (int i = 0; i < nvs_config.n_memory_limits; i++) {
        const struct nvs_memory_limit_rule *rule = &nvs_config.memory_limits[i];
        if (rule->uuid[0] != '\0') {
            if (uuid != NULL && strcmp(rule->uuid, uuid) == 0) return rule->bytes;
        } else if (rule->ordinal >= 0) {
            if (rule->ordinal == ordinal) by_ordinal = rule->bytes;
        } else {
            every = rule->bytes;
        }
    }
    return by_ordinal != NVS_NO_LIMIT ? by_ordinal : every;
}

uint64_t nvs_limit_of(const struct nvs_device *d) {
    _Atomic uint64_t *slot = &limit_slot[d->ordinal];
    uint64_t value = atomic_load(slot);
    if (NVS_LIKELY(value != UNDECIDED)) return decode(value);
    /* d's identity is constant once the device is known (gate.c), as it is for any device
     * handed out by nvs_device_get. */
    uint64_t decided = encode(configured_limit(d->ordinal, d->uuid));
    if (!atomic_compare_exchange_strong(slot, &value, decided)) return decode(value); /* set meanwhile */
    return decode(decided);
}

void nvs_limit_set(struct nvs_device *d, uint64_t bytes) {
    uint64_t old = decode(atomic_exchange(&limit_slot[d->ordinal], encode(bytes)));
    if (old == bytes) return;
    if (bytes == NVS_NO_LIMIT)
        nvs_info("device %d (%s): memory limit lifted", d->ordinal, d->uuid);
    else
        nvs_info("device %d (%s): memory limit %llu bytes (this process uses %llu)", d->ordinal, d->uuid,
                 (unsigned long long)bytes, (unsigned long long)atomic_load(&d->bytes));
}

void nvs_limit_from_scheduler(struct nvs_device *d, uint64_t bytes) {
    uint64_t configured = configured_limit(d->ordinal, d->uuid);
    nvs_limit_set(d, bytes != 0 && bytes < configured ? bytes : configured);
}

uint64_t nvs_limit_of_unopened(const char *uuid) {
    /* Only the UUID entries and the entry for every device can be matched without CUDA, which
     * alone knows the ordinals; say so once rather than show an ordinal-limited device whole. */
    static _Atomic int explained; /* any thread; the first to set it explains, once */
    int by_ordinal = 0;
    for (int i = 0; i < nvs_config.n_memory_limits; i++)
        by_ordinal |= nvs_config.memory_limits[i].ordinal >= 0;
    if (by_ordinal && configured_limit(-1, uuid) == NVS_NO_LIMIT && !atomic_exchange(&explained, 1))
        nvs_warn("NVSHARE_MEMORY_LIMIT names devices by CUDA ordinal, which NVML cannot map to %s in a "
                 "process that has not used it through CUDA (nvidia-smi): its figures are shown unlimited. "
                 "Name the device by UUID (%s=SIZE) to limit what NVML reports here too",
                 uuid, uuid);
    return configured_limit(-1, uuid);
}

void nvs_limit_figures(uint64_t limit, uint64_t real_total, uint64_t used, uint64_t available,
                       uint64_t *total_out, uint64_t *free_out) {
    uint64_t total = limit < real_total ? limit : real_total;
    uint64_t free = used >= total ? 0 : total - used;
    *total_out = total;
    *free_out = free < available ? free : available;
}

void nvs_limit_refused(const struct nvs_device *d, const char *call, size_t size, uint64_t used, uint64_t limit) {
    /* One line a second at most: a framework that retries with smaller sizes, or a loop that
     * keeps failing, must not flood the notebook; the next line says how many were not shown. */
    static _Atomic uint64_t last_ns, unreported; /* any thread */
    uint64_t now = (uint64_t)(nvs_now() * 1e9), last = atomic_load(&last_ns);
    if (last != 0 && now - last < 1000000000ULL) {
        atomic_fetch_add(&unreported, 1);
        return;
    }
    if (!atomic_compare_exchange_strong(&last_ns, &last, now)) {
        atomic_fetch_add(&unreported, 1);
        return;
    }
    uint64_t others = atomic_exchange(&unreported, 0);
    char more[64] = "";
    if (others > 0) snprintf(more, sizeof more, " (%llu more refused since the last line)", (unsigned long long)others);
    if (nvs_config.memory_limit_invalid)
        nvs_error("%s of %zu bytes on device %d refused: NVSHARE_MEMORY_LIMIT is malformed (see the first "
                  "message); returning CUDA_ERROR_OUT_OF_MEMORY%s",
                  call, size, d->ordinal, more);
    else
        nvs_error("%s of %zu bytes on device %d (%s) refused: this process uses %llu of its %llu-byte memory "
                  "limit (NVSHARE_MEMORY_LIMIT, or nvsharectl set-limit); returning CUDA_ERROR_OUT_OF_MEMORY%s",
                  call, size, d->ordinal, d->uuid, (unsigned long long)used, (unsigned long long)limit, more);
}
