/*
 * The narrow upward interface (notify.c): what the lower units may ask of the runtime.
 */
#ifndef NVSHARE_NOTIFY_H
#define NVSHARE_NOTIFY_H

/* What the lower units may ask of the runtime (client.c and worker.c), through pointers that
 * client.c registers: no link dependency upward. */
struct nvs_runtime_ops {
    void (*start)(void);
    void (*wake_client)(void);
    void (*memory_changed)(void);
    void (*kick_worker)(void);
    void (*fork_prepare)(void);
    void (*fork_parent)(void);
    void (*fork_child)(void);
};
void nvs_notify_register(const struct nvs_runtime_ops *ops);

/* Start the client and worker threads once per process (again in a forked child). */
void nvs_runtime_start(void);
/* Wake the client thread (never from a signal handler). */
void nvs_client_wake(void);
/* A device's allocated bytes changed: the client thread sends a (coalesced) MEMORY report. */
void nvs_client_memory_changed(void);
/* Tell the worker thread that stream-ordered frees are pending. */
void nvs_worker_kick(void);
/* Fork handlers (hooks.c registers them with pthread_atfork). */
void nvs_fork_prepare(void);
void nvs_fork_parent(void);
void nvs_fork_child(void);

#endif
