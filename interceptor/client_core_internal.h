/*
 * What the client core's files share, and nothing else of the interceptor sees. The core is one
 * unit (client_core.h is its interface; built alone, it is libnvshare_core.so), cut by concern
 * so that its state machine reads in one sitting. Its files, each calling only those below it:
 *
 *   client_core.c               the lock state machine: the events, each device's lock state,
 *                               GRANT/DROP/REVOKE and the release after the drain, the rules that
 *                               follow the state, the table of everything done at a time
 *   client_core_output.c        nvs_core_pop: the actions out, a SEND's message encoded
 *   client_core_registration.c  connection and registration: HELLO, WELCOME, reconnection, the
 *                               lease and its heartbeats, what the scheduler says of this process
 *   client_core_observe.c       what the shell observed (recorded only), the read-only views
 *   client_core_swap.c          swapping: PREPARE, POOL, EVICT, PREFETCH, swap jobs, MEMORY reports
 *   client_core_handoff.c       the handoffs' timing: the idle release, the pre-drain (CONTENDED)
 *   client_core_admission.c     ADMIT and its answers, the give-back, LIMIT, SETTLED
 *   client_core_fence.c         a gang's fence: FENCED, FENCE, the collectives' limit
 *   client_core_actions.c       the action queue: log records, messages, gates, jobs
 *
 * tests/test_library_hygiene.py checks from the objects that calls point down this list. None of
 * these files takes a lock, reads a clock, does I/O or calls CUDA; nothing declared here is
 * exported from libnvshare.so or libnvshare_core.so.
 */
#ifndef NVSHARE_CLIENT_CORE_INTERNAL_H
#define NVSHARE_CLIENT_CORE_INTERNAL_H

#include <math.h>
#include <stdint.h>

#include "client_core.h"

/* Levels of NVS_ACT_LOG. */
enum { LOG_ERROR = 0, LOG_WARN = 1, LOG_INFO = 2, LOG_DEBUG = 3 };
/* A timer's due when it is not pending (client_core.c, the timer table). */
#define NO_DEADLINE INFINITY
/* The heartbeat interval until a WELCOME names the scheduler's. */
#define DEFAULT_HEARTBEAT_MS 1000

/* client_core_actions.c */
struct nvs_core_queued *push(struct nvs_core *c, enum nvs_action_kind kind, int device, int value);
__attribute__((format(printf, 3, 4))) void core_log(struct nvs_core *c, int level, const char *fmt, ...);
double lease_seconds(const struct nvs_core *c);
void note_sent(struct nvs_core *c, double now);
struct nvs_core_queued *send_message(struct nvs_core *c, enum nvs_msg_type message, int device, uint64_t number,
                                     const char *reason, double now);
void set_gate(struct nvs_core_device *d, struct nvs_core *c, int open);
struct nvs_core_queued *start_job(struct nvs_core *c, struct nvs_core_device *d, enum nvs_job job);

/* client_core_fence.c */
void begin_fence(struct nvs_core *c, struct nvs_core_device *d);
void lift_fence(struct nvs_core *c, struct nvs_core_device *d);
void collectives_limited(struct nvs_core *c, struct nvs_core_device *d, uint64_t launched, double now);
int fence_answered(struct nvs_core *c, struct nvs_core_device *d, uint64_t collectives);
int fence_reached(struct nvs_core *c, struct nvs_core_device *d);

/* client_core_admission.c */
void end_admission(struct nvs_core *c);
void start_admission(struct nvs_core *c, struct nvs_core_device *d);
void handle_admission_answer(struct nvs_core *c, struct nvs_core_device *d, const struct nvs_msg *m);
void run_admission(struct nvs_core *c, struct nvs_core_device *d, double now);
void apply_limit(struct nvs_core *c, struct nvs_core_device *d);
void handle_limit(struct nvs_core *c, const struct nvs_msg *m);
void settle_devices(struct nvs_core *c);
double give_back_due(const struct nvs_core *c, const struct nvs_core_device *d);
void give_back_fire(struct nvs_core *c, struct nvs_core_device *d, double now);

/* client_core_handoff.c */
void note_pause(const struct nvs_core *c, struct nvs_core_device *d, double since, double now);
void reset_idle_tracking(struct nvs_core *c, struct nvs_core_device *d, double now);
void note_drain(struct nvs_core_device *d, double now);
void handle_contended(struct nvs_core *c, struct nvs_core_device *d, const struct nvs_msg *m, double now);
double idle_check_due(const struct nvs_core *c, const struct nvs_core_device *d);
void idle_check_fire(struct nvs_core *c, struct nvs_core_device *d, double now);

/* client_core_swap.c */
uint64_t resident_of(const struct nvs_core_device *d);
void start_swap_out(struct nvs_core *c, struct nvs_core_device *d);
void handle_evict(struct nvs_core *c, struct nvs_core_device *d, uint64_t bytes, double now);
void continue_grant(struct nvs_core *c, struct nvs_core_device *d, double now);
void swap_job_done(struct nvs_core *c, struct nvs_core_device *d, enum nvs_job job, enum nvs_job_result result,
                   double now);
void handle_prepare(struct nvs_core *c, struct nvs_core_device *d, uint64_t bytes);
void handle_pool(struct nvs_core *c, const struct nvs_msg *m);
void handle_prefetch_ahead(struct nvs_core *c, struct nvs_core_device *d, uint64_t resident, double now);
void run_due_swaps(struct nvs_core *c, struct nvs_core_device *d, double now);
int swap_running(const struct nvs_core_device *d);
int memory_report_due(const struct nvs_core *c, const struct nvs_core_device *d);
void send_memory(struct nvs_core *c, struct nvs_core_device *d, double now);
double memory_report_timer_due(const struct nvs_core *c, const struct nvs_core_device *d);
void memory_report_fire(struct nvs_core *c, struct nvs_core_device *d, double now);

/* client_core_observe.c */
int valid_device(const struct nvs_core *c, int device);

/* client_core_registration.c */
void schedule_reconnect(struct nvs_core *c, double now);
void forget_connection(struct nvs_core *c, const char *why, double now);
void send_hello(struct nvs_core *c, double now);
void forget_registration(struct nvs_core *c, double now);
void note_registration(struct nvs_core *c, const struct nvs_msg *m, double now);
void handle_status(struct nvs_core *c, double now);
void note_refused(struct nvs_core *c, const struct nvs_msg *m);
void note_unknown_type(struct nvs_core *c, const struct nvs_msg *m, double now);
void note_unknown_words(struct nvs_core *c, const struct nvs_msg *m);
double reconnect_due(const struct nvs_core *c, const struct nvs_core_device *d);
void reconnect_fire(struct nvs_core *c, struct nvs_core_device *d, double now);
double welcome_timeout_due(const struct nvs_core *c, const struct nvs_core_device *d);
void welcome_timeout_fire(struct nvs_core *c, struct nvs_core_device *d, double now);
double lease_check_due(const struct nvs_core *c, const struct nvs_core_device *d);
void lease_check_fire(struct nvs_core *c, struct nvs_core_device *d, double now);
double heartbeat_due(const struct nvs_core *c, const struct nvs_core_device *d);
void heartbeat_fire(struct nvs_core *c, struct nvs_core_device *d, double now);
double wait_warning_due(const struct nvs_core *c, const struct nvs_core_device *d);
void wait_warning_fire(struct nvs_core *c, struct nvs_core_device *d, double now);

#endif
