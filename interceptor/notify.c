/*
 * The narrow upward interface: the lower units (hooks.c, gate.c, memory.c) tell the runtime
 * that something happened without depending on client.c or worker.c, so the objects' link
 * dependencies have no cycle (docs/architecture.md). client.c registers the runtime's
 * functions from a constructor (a pointer store: nothing heavy at load time); until then, and
 * in a build without a runtime, every notification is a no-op.
 */
#include <stdatomic.h>
#include <stddef.h>

#include "notify.h"

static const struct nvs_runtime_ops *_Atomic runtime_ops;

void nvs_notify_register(const struct nvs_runtime_ops *ops) { atomic_store(&runtime_ops, ops); }

#define FORWARD(function, member)                                   \
    void function(void) {                                           \
        const struct nvs_runtime_ops *ops = atomic_load(&runtime_ops); \
        if (ops != NULL) ops->member();                             \
    }

FORWARD(nvs_runtime_start, start)
FORWARD(nvs_client_wake, wake_client)
FORWARD(nvs_client_memory_changed, memory_changed)
FORWARD(nvs_worker_kick, kick_worker)
FORWARD(nvs_fork_prepare, fork_prepare)
FORWARD(nvs_fork_parent, fork_parent)
FORWARD(nvs_fork_child, fork_child)
