/*
 * The worker thread (worker.c), for the client thread.
 */
#ifndef NVSHARE_WORKER_H
#define NVSHARE_WORKER_H

#include <stdint.h>

#include "client_core.h"

struct nvs_device;

/* The worker thread does what needs the GPU for the client core: drains, idle probes and swap
 * jobs (handed over in struct nvs_device under nvs_mu), and deferred stream-ordered frees; the
 * pinner thread beside it pins the swap area. Starts both. */
int nvs_worker_spawn(void);
/* Under nvs_mu: hand the worker a job for the device. */
void nvs_worker_assign_locked(struct nvs_device *d, enum nvs_job job, uint64_t bytes);
void nvs_worker_signal(void);
/* Under nvs_mu: the pinner looks at the swap area's or the pool's size again (it changed). */
void nvs_pinner_wake_locked(void);
/* Set at process exit: the worker stops calling CUDA (the driver may be torn down). */
void nvs_worker_stop_for_exit(void);
/* Fork child: no worker thread, no job. */
void nvs_worker_reset_after_fork(void);

#endif
