/*
 * The client's lock logic as a pure state machine (sans-I/O), the C counterpart of
 * nvshare_py/scheduler/core.py: the protocol state of every device (docs/protocol.md),
 * registration and reconnection, heartbeats, memory reports, idle release, pre-drain, and the
 * rules that keep a release after the drain and a drain out of a CUDA-graph capture.
 *
 * Events in, actions out. Nothing in the core (client_core.c, the state machine, and the files of
 * its concerns: client_core_internal.h) takes a lock, reads a clock, touches a file descriptor or
 * calls CUDA: every event carries `now` (seconds, monotonic), and the caller carries out the
 * actions popped with nvs_core_pop() in order. In libnvshare.so the caller is
 * client.c (under nvs_mu, see there); built alone as libnvshare_core.so, it is driven through
 * ctypes (nvshare_py/client_core.py) by nvshare_py.client and, paired with the scheduler's
 * SchedulerCore on virtual time, by the tests (tests/fixtures/client_core.py).
 *
 * Devices are numbered by the caller (the CUDA ordinal in libnvshare.so), 0..NVS_CORE_MAX_DEVICES-1.
 */
#ifndef NVSHARE_CLIENT_CORE_H
#define NVSHARE_CLIENT_CORE_H

#include <stddef.h>
#include <stdint.h>

#include "message.h"

#define NVS_CORE_MAX_DEVICES 64
#define NVS_CORE_MAX_ACTIONS 512
#define NVS_CORE_LOG_MAX 384
#define NVS_CORE_MAX_LOGS 32

/* Lock state of one device as this process sees it. */
enum nvs_lock_state {
    NVS_IDLE = 0,    /* gate closed, lock not asked for */
    NVS_WAITING,     /* ACQUIRE sent, gate closed */
    NVS_HOLDING,     /* gate open (a GRANT, or a claim re-registered after a reconnection) */
    NVS_DRAINING,    /* gate closed, the worker drains (or will, once no capture runs) before RELEASE */
    NVS_UNSCHEDULED, /* fail-open without a scheduler: gate open, no lock */
};

/* Work for the worker thread (it needs the GPU). The swap jobs (docs/interceptor.md, "Swapping")
 * move swappable memory in bulk on an internal stream and synchronise it:
 * SWAP_OUT: at least `bytes` (of the action) to the host, least recently used first; after the
 *   drain of a DROP that asked for evict= (or of a pre-drain told evict= by CONTENDED), before its
 *   RELEASE, or for an EVICT (non-holder);
 * PREFETCH: back to the device before the gate of a GRANT opens: everything in the swap area, of
 *   the rest up to `bytes`, most recently used first; afterwards all of the process's memory
 *   counts as resident again;
 * PREFETCH_AHEAD: up to `bytes` back to the device ahead of a grant (the scheduler's PREFETCH to a
 *   waiter), the gate staying closed. */
enum nvs_job { NVS_JOB_NONE = 0, NVS_JOB_DRAIN, NVS_JOB_PROBE, NVS_JOB_SWAP_OUT, NVS_JOB_PREFETCH, NVS_JOB_PREFETCH_AHEAD };
/* What a job found: DRAINED = nothing in flight and every context synchronised (the gate is
 * closed); ACTIVE = an idle probe saw submissions (the gate may have been closed by the probe:
 * the core says whether to reopen it); DEFERRED = a drain found a stream capture begun on the
 * device and synchronised nothing (it runs again once the capture ends). */
/* MOVED = a swap job moved what it could (the shell observes the swapped bytes before it
 * reports the result); a swap job that met a capture reports DEFERRED: a SWAP_OUT or a
 * PREFETCH_AHEAD moved nothing, a PREFETCH brought back what it could and leaves VMM memory
 * for after the capture. */
enum nvs_job_result { NVS_RESULT_NONE = 0, NVS_RESULT_DRAINED, NVS_RESULT_ACTIVE, NVS_RESULT_DEFERRED, NVS_RESULT_MOVED };

enum nvs_action_kind {
    NVS_ACT_SEND = 1,   /* send the encoded message (buf/len of nvs_core_pop) */
    NVS_ACT_GATE,       /* open (value 1) or close (value 0) the device's gate */
    NVS_ACT_JOB,        /* hand the worker job `value` (enum nvs_job) for the device */
    NVS_ACT_LOG,        /* a log line: level `value` (0 error .. 3 debug), text in buf */
    NVS_ACT_CONNECT,    /* open a connection; report with nvs_core_connected / _connect_failed */
    NVS_ACT_DISCONNECT, /* close the connection (the core already counts it as closed) */
    NVS_ACT_ADMISSION,  /* the device's admitted total changed (value 1: read nvs_core_admitted),
                         * or (value 0) the scheduler refused what the waiting allocations asked */
    NVS_ACT_LIMIT,      /* the scheduler's memory limit of the device is `bytes` (0: none) */
    NVS_ACT_SETTLED,    /* memory calls on the device may go on (device -1: on every device, now
                         * and later): this registration's limits are applied (a LIMIT action
                         * before it said so), or no scheduler answers for now */
    NVS_ACT_SWAP_AREA,  /* keep a swap area of `bytes` ready for the device (the scheduler's PREPARE) */
    NVS_ACT_POOL,       /* the swap pool this process shares with its user's (its pod's) other processes
                         * should hold `bytes` (the scheduler's POOL; device -1) */
    NVS_ACT_COLLECTIVES, /* let collectives be launched on the device until `bytes` of them have
                          * been in all (0: none from now on; NVS_CORE_NO_LIMIT: as many as
                          * wanted); report with nvs_core_observe_collectives */
    NVS_ACT_SWAP_OUT_CUT, /* the device's running SWAP_OUT stops after the pieces in flight and
                           * reports what it moved (the scheduler took its EVICT back) */
    NVS_ACT_POOL_NEED,    /* register segments of the pool others made for at most `bytes` of this
                           * process's memory (POOL need=; NVS_CORE_NO_LIMIT: all it has) */
};

struct nvs_action {
    enum nvs_action_kind kind;
    int device; /* -1 when the action is not about one device */
    int value;
    size_t len; /* SEND, LOG: bytes written to buf */
    uint64_t bytes; /* JOB SWAP_OUT: at least this many bytes to move; PREFETCH, PREFETCH_AHEAD: at
                     * most; LIMIT: the scheduler's memory limit, 0: none; SWAP_AREA, POOL: their
                     * sizes; COLLECTIVES: the limit */
};

/* No limit on the collectives launched (NVS_ACT_COLLECTIVES). */
#define NVS_CORE_NO_LIMIT UINT64_MAX

/* Read once at nvs_core_init. */
struct nvs_core_config {
    int fail_open;         /* run unscheduled while no scheduler is reachable */
    long idle_release_ms;  /* -1: take the scheduler's (WELCOME); 0: never */
    int predrain;          /* drain ahead of a contended quantum's end */
    int log_level;         /* records above it are not produced */
    /* HELLO identity; texts may be empty. Copied. */
    long pid;
    char session[17];
    char host[256];
    char container[80];
    char pod[256];
    char pod_namespace[256];
    char program[128];
    char socket_path[256]; /* named in log records */
    char gang[128];        /* HELLO's gang (gang.h), "": none */
    uint64_t gang_size;    /* its ranks on this node */
    int counts_collectives; /* the shell counts the collectives launched (collective.c) and
                             * carries out NVS_ACT_COLLECTIVES: a gang's DROP fence=1 is answered */
};

/* A gang member's way to its RELEASE after a DROP with fence=1 (docs/interceptor.md, "Gangs"):
 * FREEZING: no collective may be launched any more (NVS_ACT_COLLECTIVES 0), the gate is closed;
 *   FENCED goes out once the shell says the limit holds (nvs_core_collectives_limited);
 * WAITING: FENCED sent, FENCE awaited (nothing drains yet: this member may be behind);
 * RUNNING: FENCE named more collectives than were launched: the gate is open until they are,
 *   then it closes and the drain of the DROP begins. */
enum nvs_fence { NVS_FENCE_NONE = 0, NVS_FENCE_FREEZING, NVS_FENCE_WAITING, NVS_FENCE_RUNNING };

#define NVS_DRAIN_HISTORY 4 /* drains remembered per device to foresee the next one's length */

struct nvs_core_device {
    int known;
    char uuid[NVS_DEVICE_ID_MAX + 1];
    char name[128];
    uint64_t total;

    /* What the shell observed (nvs_core_observe). */
    int waiters;       /* application threads blocked at the closed gate */
    int captures;      /* stream captures in progress on the device */
    uint64_t entered;  /* the gate's submission counter */
    uint64_t bytes;    /* bytes allocated by the process */
    uint64_t converted; /* of them, converted to managed memory (nvs_core_observe_residency) */
    uint64_t swapped;   /* of those, moved to the host by swap jobs and not brought back:
                         * resident = converted - swapped */

    enum nvs_lock_state state;
    int gate_open;            /* as last told to the shell */
    uint64_t grant;
    int grant_known;          /* 0 after a reconnection until the scheduler names the grant */
    int release_due;          /* DROP/REVOKE/pre-drain/lost registration: the drain ends in a release */
    const char *release_reason; /* of the due release; after it, of the last one made */
    int release_unanswerable; /* the grant died with the registration: nothing to RELEASE */
    enum nvs_job job;         /* handed to the worker, result not in yet */
    int drain_wanted;         /* a drain is due but waits for captures to end (or the job) */
    int used;                 /* the process allocated on the device, waited for it or held it
                               * (or its program said so: nvs_core_use_device): it is announced
                               * from then on (resolving it is not using it) */
    int announced;            /* DEVICE sent on the current connection */
    uint64_t reported_bytes;  /* last MEMORY sent on the current connection */
    uint64_t idle_entered;    /* idle detection: `entered` at the last check */
    double idle_since, idle_next_check;
    double idle_released_since; /* an idle release's pause began then and goes on (0: none) */
    double last_pause;          /* seconds the last pause that reached the idle window lasted */
    double predrain_at;       /* after CONTENDED: when the drain starts (0: none due) */
    uint64_t quantum_ms;      /* of the current grant */
    uint64_t scheduler_limit; /* the memory limit the scheduler set (LIMIT), 0: none */
    int settled;              /* SETTLED handed out for the device */
    double drain_started;     /* start of the drain that ends in a RELEASE, 0: none */
    double drain_seconds[NVS_DRAIN_HISTORY];
    int drains_known, drain_next;

    /* Admission (docs/interceptor.md, "Admission"). */
    uint64_t admit_wanted;  /* observed: the total blocked allocations wait for, 0: none */
    uint64_t admitted;      /* what this process may hold; NVS_CORE_UNADMITTED: nothing waits */
    uint64_t admit_asked;   /* the unanswered ADMIT's total, 0: none */
    uint64_t admit_request; /* its number */
    int surplus;            /* admitted has been more than a chunk above the use, nobody waiting, */
    double surplus_since;   /* since this time: given back once that lasted (run_admission) */
    uint64_t idle_bytes;    /* idle detection: `bytes` at the last check (an allocation is activity) */
    /* Swapping (docs/protocol.md, "Residency"). */
    uint64_t evict_due;        /* DROP evict=: to move out after the drain, before the RELEASE */
    int release_drained;       /* the drain of the due release is done; its swap-out runs or waits */
    uint64_t evict_asked;      /* EVICT bytes= (a non-holder): to move out now, then EVICTED */
    uint64_t bytes_at_evict;   /* `bytes` when that move began: an allocation since is the application back */
    int evicted_due;           /* an EVICTED answer is owed on the current connection */
    int grant_swap_due;        /* a GRANT's gate waits for its PREFETCH (or a running swap job) */
    uint64_t prefetch_due;     /* of that GRANT: bring back up to this many bytes */
    int prefetch_deferred;     /* its PREFETCH left VMM memory out for a capture: wait for its end */
    uint64_t reported_resident; /* resident= of the last MEMORY; UINT64_MAX: none sent */
    /* Pipelined handoffs (issue 18): CONTENDED's evict= (moved out by a pre-drain before its
     * RELEASE) and idle_ms= (the shortest idle window while others wait) for the current grant;
     * a waiter's PREFETCH (the resident bytes it may reach ahead of its grant, 0: none), and
     * what it had said when the running PREFETCH_AHEAD job was started. */
    uint64_t contended_evict;
    uint64_t contended_idle_ms;
    uint64_t prefetch_ahead;
    uint64_t prefetch_ahead_started;
    int reported_engine;       /* the swap figures of the last MEMORY (engine 0: none sent) */
    uint64_t reported_area;
    int reported_pool;
    /* Gangs' fence: the collectives the shell saw launched (nvs_core_observe_collectives), the
     * fence's step and the count FENCE named; `limited`: a limit was set since the last GRANT. */
    uint64_t collectives;
    enum nvs_fence fence;
    uint64_t fence_target;
    int limited;
};

/* The swap engine of the process (docs/interceptor.md, "Swapping"), as the shell observes it. */
struct nvs_core_swap {
    int engine;                /* 0 not known yet, 1 copy (pinned copies and discards), 2 migrate */
    uint64_t area;             /* pinned bytes ready */
    uint64_t out_bps, in_bps;  /* the last moves through the area (0: none yet) */
    int pool;                  /* the area is its user's swap pool (MEMORY pool=1) */
};

/* The admitted total while admission is not in force (no scheduler, or one without it). */
#define NVS_CORE_UNADMITTED UINT64_MAX
/* Admission chunks, as nvshare_py/scheduler/admission.py grants them above an asked total. Once
 * the admitted total is more than one of them above the use, the client gives admission back
 * down to half of one above it. */
uint64_t nvs_core_headroom(uint64_t total);

/* A memory limit the scheduler told this registration for one device (LIMIT with `device`). */
struct nvs_core_limit {
    char device[NVS_DEVICE_ID_MAX + 1];
    uint64_t bytes;
};

struct nvs_core_queued {
    struct nvs_action action;
    enum nvs_msg_type message; /* SEND: a client message (message.h), built when popped */
    uint64_t number;      /* RELEASE grant, MEMORY bytes, ADMIT bytes */
    uint64_t request;     /* ADMIT */
    int has_resident;     /* MEMORY, RELEASE: resident= is sent (EVICTED: always) */
    uint64_t resident;
    int has_swap;         /* MEMORY: the swap engine's figures are sent */
    struct nvs_core_swap swap;
    const char *reason;   /* RELEASE */
    uint64_t held, wanted; /* HELLO: device bit sets */
    uint64_t collectives;  /* FENCED */
    int log;              /* LOG: slot in logs[] */
};

struct nvs_core {
    struct nvs_core_config config;
    struct nvs_core_device devices[NVS_CORE_MAX_DEVICES];
    int n_devices; /* highest known index + 1 */

    int connecting;      /* CONNECT handed out, no answer yet */
    int connected;       /* connection up, HELLO sent */
    int registered;      /* WELCOME received */
    int was_registered;  /* registered at least once: a HELLO is a re-registration */
    int exiting;         /* BYE sent: nothing more */
    int admission;       /* the scheduler answers ADMIT (WELCOME admission=1) */
    struct nvs_core_swap swap; /* observed (nvs_core_observe_swap) */
    uint64_t admit_numbers;
    /* The scheduler's memory limits told since the last HELLO (they come before WELCOME, which
     * applies them; later ones apply at once): for every device, and devices' own, by id, also
     * of devices this process has not used yet. */
    uint64_t limit_every;
    struct nvs_core_limit limits[NVS_CORE_MAX_DEVICES];
    int n_limits;
    int limits_overflow_warned, unscheduled_memory_warned;
    double connected_at, next_attempt, outage_since, backoff_s;
    double last_wait_warning;
    int fail_open_warned, lost_warned;
    /* The scheduler had no place for this process (ERROR code=too-many-connections): said once
     * until a registration succeeds; `refusal` is its reason, for the waiters' warning. */
    int refused_warned;
    char refusal[256];
    double last_sent, last_memory_report;
    long heartbeat_ms, scheduler_idle_ms;
    /* The registration lease (see nvs_core_lease_until): 0 while there is none to keep. */
    double lease_until;
    double ping_sent; /* > 0: the lease lapsed, HEARTBEAT + QUERY went out at this time and
                       * the STATUS answer (or a not-registered ERROR before it) decides */
    char client_id[64];
    /* What the scheduler sent that this build cannot read (docs/protocol.md, "Unknown words"):
     * each unknown word field is warned about once (a bit per field, as nvs_msg's
     * unknown_words), unknown message types at most once per UNKNOWN_WARNING_PERIOD_S. */
    uint64_t unknown_words_warned;
    double unknown_type_next_warning;

    struct nvs_core_queued queue[NVS_CORE_MAX_ACTIONS];
    unsigned head, count;
    char logs[NVS_CORE_MAX_LOGS][NVS_CORE_LOG_MAX];
    unsigned log_next;
    unsigned dropped_actions; /* a bug if ever > 0: reported in a log record */
};

/* Size of struct nvs_core, for callers that allocate it without the header (ctypes). */
size_t nvs_core_size(void);
void nvs_core_init(struct nvs_core *c, const struct nvs_core_config *config);
/* A forked child: the parent's connection, grants and counters are not the child's. A fresh
 * state with the child's pid and a new session; the devices stay known. */
void nvs_core_forked(struct nvs_core *c, long pid, const char *session);

/* A device's identity (before other events name it). Again for a known device: a new name or
 * total is announced again (DEVICE); another uuid is -1. 0, or -1 for a bad index/id. */
int nvs_core_add_device(struct nvs_core *c, int device, const char *uuid, const char *name, uint64_t total);

/* The program uses the device from now on, so it is announced (DEVICE) even before it
 * allocates, waits or holds there (which the interceptor observes by itself): for a client that
 * speaks for its program, nvshare_py.client's announce. */
void nvs_core_use_device(struct nvs_core *c, int device);
/* What the gate and the allocator counted. Level-triggered: report the current values before
 * every other event (cheap; nothing happens until the next event or tick). */
void nvs_core_observe(struct nvs_core *c, int device, int waiters, int captures, uint64_t entered, uint64_t bytes);
/* The device's converted bytes (allocations made managed memory, those a swap can move) and,
 * of them, what swap jobs moved to the host and did not bring back. Level-triggered like
 * nvs_core_observe; report it before nvs_core_job_done of a swap job. A process with converted
 * memory says resident= (converted - swapped) in every MEMORY; one without (NVSHARE_MANAGED=0)
 * takes no part in residency. */
void nvs_core_observe_residency(struct nvs_core *c, int device, uint64_t converted, uint64_t swapped);
/* The process's swap engine (struct nvs_core_swap); level-triggered like nvs_core_observe. MEMORY
 * reports of a process with converted memory carry it once the engine is known. */
void nvs_core_observe_swap(struct nvs_core *c, const struct nvs_core_swap *swap);
/* Collectives launched on the device so far (collective.c counts them); level-triggered like
 * nvs_core_observe. */
void nvs_core_observe_collectives(struct nvs_core *c, int device, uint64_t launched);
/* The shell carried out the device's last NVS_ACT_COLLECTIVES: from now on its limit holds, and
 * `launched` collectives had been launched when it took effect (under a limit of 0, all there
 * will be until the limit is raised). */
void nvs_core_collectives_limited(struct nvs_core *c, int device, uint64_t launched, double now);

void nvs_core_connected(struct nvs_core *c, double now);
void nvs_core_connect_failed(struct nvs_core *c, int err, int path_too_long, double now);
void nvs_core_disconnected(struct nvs_core *c, const char *why, double now);
/* One message from the scheduler (undecoded bytes). */
void nvs_core_receive(struct nvs_core *c, const char *buf, size_t len, double now);
/* What the allocator's blocked threads wait for on the device (0: none); level-triggered like
 * nvs_core_observe. Past the admitted total, the core asks the scheduler (ADMIT). */
void nvs_core_observe_admission(struct nvs_core *c, int device, uint64_t wanted);
/* The worker finished the device's job. */
void nvs_core_job_done(struct nvs_core *c, int device, enum nvs_job_result result, double now);
/* Time passed: whatever is due (reconnection, heartbeat, reports, idle checks, pre-drain). */
void nvs_core_tick(struct nvs_core *c, double now);
/* The program gives the device back itself (a library client, nvshare_py.client, whose program
 * says when its GPU work is done instead of the gate's idle detection): as for a DROP, the gate
 * closes and the drain job follows, then RELEASE with `reason` ("user" or "quantum"). Nothing
 * unless the device is held; -1 for a bad device or reason. */
int nvs_core_release(struct nvs_core *c, int device, const char *reason, double now);
/* Clean exit: BYE, so that the scheduler takes this process out of its queues at once, and
 * the gates open (a late call from a destructor must not wait forever). Not while it holds a
 * lock (its last kernels may still run: the scheduler's process-exit watch passes that lock on
 * once the process, and its contexts, are gone); then nothing changes. */
void nvs_core_exit(struct nvs_core *c, double now);

/* When nvs_core_tick is due next: the earliest of the core's timers (client_core.c's table: the
 * reconnection, the WELCOME timeout, each device's pre-drain, memory report, admission
 * give-back and idle check, the lease check, the heartbeat, the outage warning), and at most
 * 1 s ahead. A tick before it does nothing a timer does; a tick at it fires that timer. */
double nvs_core_next_deadline(const struct nvs_core *c, double now);
/* Take the oldest action: 1 and *out filled (SEND: the message in buf, LOG: the text), 0 when
 * none is left. A SEND whose message cannot be encoded comes out as a LOG (error) followed by
 * DISCONNECT: a bug, never a silent drop (the connection counts as lost at `now`). */
int nvs_core_pop(struct nvs_core *c, struct nvs_action *out, char *buf, size_t cap, double now);

/* Until when the open gates may be used without hearing from the scheduler (seconds, same
 * clock as `now`; 0: no limit, the gates alone decide). The scheduler forgets a client that is
 * silent past its heartbeat timeout, which is longer than the heartbeat interval: so while this
 * process sends something at least every interval it is registered, and a process that was
 * stopped or starved for longer must not submit before it knows. When the lease has lapsed the
 * core sends HEARTBEAT and QUERY: the STATUS answer renews it, a `not-registered` ERROR before it
 * means the registration was lost (gates stay closed, the work drains, it registers again). */
double nvs_core_lease_until(const struct nvs_core *c);

/* Read-only views for the shell and the tests. */
enum nvs_lock_state nvs_core_state(const struct nvs_core *c, int device);
int nvs_core_gate(const struct nvs_core *c, int device);
int nvs_core_registered(const struct nvs_core *c);
int nvs_core_any_waiters(const struct nvs_core *c);
uint64_t nvs_core_admitted(const struct nvs_core *c, int device);
/* The scheduler's memory limit of a device by id (0: none), also of one not added yet. */
uint64_t nvs_core_limit(const struct nvs_core *c, const char *uuid);

#endif
