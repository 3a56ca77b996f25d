/*
 * Admission, the allocator's side (admission.c).
 */
#ifndef NVSHARE_ADMISSION_H
#define NVSHARE_ADMISSION_H

#include <stddef.h>
#include <stdint.h>

struct nvs_device;

/* What the scheduler admitted for d (NVS_NO_LIMIT: no admission in force). Any thread, no lock. */
uint64_t nvs_admitted(const struct nvs_device *d);
/* Block until d's admitted total reaches `total` (0), or the scheduler refuses (-1, logged
 * naming `call` and `size`). Takes nvs_mu; call it holding no lock. */
int nvs_admission_wait(struct nvs_device *d, uint64_t total, const char *call, size_t size);
/* Under nvs_mu (client thread): the core's admitted total for d, and whether the last answer
 * granted (1) or refused (0) what the waiters asked. Wakes the waiters. */
void nvs_admission_answer_locked(struct nvs_device *d, uint64_t admitted, int granted);
/* A process's first memory call on a device (an allocation, cuMemGetInfo, cuDeviceTotalMem, an
 * NVML memory query) waits here until the scheduler's memory limits for it are known: those it
 * sends with the registration, or none when no scheduler answers (bounded by the client's
 * connection and WELCOME timeouts). Starts the client thread. Call it holding no lock; d may be
 * NULL (nothing to wait for). Afterwards one atomic load. */
void nvs_admission_await_registration(struct nvs_device *d);
/* Under nvs_mu (client thread): memory calls on d may go on (d NULL: on every device, now and
 * later, when nvshare cannot or no longer asks a scheduler). Wakes the waiters. */
void nvs_admission_settled_locked(struct nvs_device *d);
/* Fork child: no admission until the child registers. */
void nvs_admission_reset_after_fork(void);

#endif
