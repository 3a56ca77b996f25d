/*
 * Codec of the client protocol, version 1 (docs/protocol.md): builds the messages a client
 * sends and parses the messages the scheduler sends. Pure functions, no allocation, no state.
 */
#ifndef NVSHARE_MESSAGE_H
#define NVSHARE_MESSAGE_H

#include <stddef.h>
#include <stdint.h>

#define NVS_DEVICE_ID_MAX 96

enum nvs_msg_type {
    NVS_MSG_WELCOME = 1,
    NVS_MSG_GRANT,
    NVS_MSG_DROP,
    NVS_MSG_REVOKE,
    NVS_MSG_MODE,
    NVS_MSG_ERROR,
    NVS_MSG_CONTENDED,
    NVS_MSG_STATUS, /* the answer to QUERY; only its arrival is reported, not its document */
    NVS_MSG_ADMITTED,
    NVS_MSG_REFUSED,
    NVS_MSG_EVICT,  /* move bytes of a device's memory to the host now (a client not holding it) */
    NVS_MSG_LIMIT,  /* the scheduler's memory limit for this process on a device */
    NVS_MSG_PREPARE,  /* swapping: keep a swap area of `bytes` ready for a device */
    NVS_MSG_PREFETCH, /* swapping: bring memory back ahead of a grant, up to `resident` bytes resident */
};

/* A parsed scheduler message; only the fields of its type are meaningful. */
struct nvs_msg {
    enum nvs_msg_type type;
    char device[NVS_DEVICE_ID_MAX + 1];
    uint64_t grant;
    uint64_t quantum_ms;      /* GRANT, MODE */
    uint64_t quantum_left_ms; /* CONTENDED */
    uint64_t heartbeat_ms;
    uint64_t idle_release_ms;
    int admission;       /* WELCOME: 1 when the scheduler answers ADMIT */
    uint64_t request;    /* ADMITTED, REFUSED: the ADMIT answered */
    uint64_t bytes;      /* ADMITTED: the admitted total; LIMIT: the scheduler's memory limit, 0: none;
                          * PREPARE: the swap area to keep ready */
    uint64_t prefetch_bytes;  /* GRANT prefetch= (0 when absent): bring back up to this many bytes */
    uint64_t evict_bytes;     /* DROP evict= (0 when absent), EVICT bytes=, CONTENDED evict= (what
                               * the release will be asked to move): move at least this many bytes
                               * to the host */
    uint64_t idle_ms;         /* CONTENDED idle_ms= (0 when absent): the shortest idle window now */
    uint64_t resident;        /* PREFETCH resident= */
    char client[64];     /* WELCOME client id, cut at a character boundary if longer */
    char reason[32];     /* DROP / REVOKE / REFUSED reason */
    char code[32];       /* ERROR code */
    char detail[256];    /* ERROR detail, cut at a character boundary */
    char error_type[32]; /* ERROR: type of the rejected message ("" when not given), cut */
};

/* Parse one scheduler message. 0 on success, -1 if malformed or of a type a client does not
 * accept (the caller logs and ignores it). Accepts exactly what nvshare_py.protocol.decode
 * accepts for scheduler messages (plus STATUS, the answer to QUERY, whose document it does
 * not read); unknown keys are ignored, as the protocol says. Fields the client does not use
 * (GRANT mode/exclusive, DROP grace_ms, MODE mode) are validated but not stored. `out` is
 * zeroed first, also on failure. */
int nvs_msg_parse(const char *buf, size_t len, struct nvs_msg *out);

/* Identity sent in HELLO. Strings may be empty (then omitted); control characters are replaced. */
struct nvs_hello {
    long pid;
    char session[17];          /* 16 lowercase hex digits */
    const char *host, *container, *pod, *namespace_, *program;
    const char *const *held;   /* device ids, `n_held` of them */
    size_t n_held;
    const char *const *wanted;
    size_t n_wanted;
};

/* Builders: write the message into buf (capacity cap; no NUL terminator) and return its length,
 * or 0 if it does not fit (in cap, or in the protocol's 4096 bytes) or an argument is invalid:
 * a device id that is not [A-Za-z0-9-]{1,96} (NULL included), a number above 2^63-1, a negative
 * pid, a session that is not 16 lowercase hex digits, a device list longer than 1024 bytes once
 * joined, a RELEASE reason other than idle/drop/quantum/revoke/user (NULL included).
 * Free texts (host ... program, DEVICE name; NULL or "" = omitted) are made acceptable to the
 * scheduler: bytes that are not UTF-8 and control characters become '?', and the text is cut
 * at a character boundary to 1024 bytes. The output is what nvshare_py.protocol encodes. */
size_t nvs_msg_hello(char *buf, size_t cap, const struct nvs_hello *hello);
size_t nvs_msg_device(char *buf, size_t cap, const char *device, uint64_t total, const char *name);
/* `resident` (MEMORY, RELEASE): the optional resident= field (bytes this process believes are
 * on the device, docs/protocol.md "Residency"); NULL omits it. */
/* MEMORY's swap engine fields (docs/protocol.md "Residency"): `engine` "copy" (pinned copies and
 * discards) or "migrate" (cuMemPrefetchAsync), the pinned area and the measured bandwidths (a 0
 * bandwidth is omitted). */
struct nvs_msg_swap {
    const char *engine;
    uint64_t area, out_bps, in_bps;
};
size_t nvs_msg_memory(char *buf, size_t cap, const char *device, uint64_t used, const uint64_t *resident,
                      const struct nvs_msg_swap *swap);
size_t nvs_msg_acquire(char *buf, size_t cap, const char *device);
size_t nvs_msg_admit(char *buf, size_t cap, const char *device, uint64_t request, uint64_t bytes);
size_t nvs_msg_release(char *buf, size_t cap, const char *device, uint64_t grant, const char *reason,
                       const uint64_t *resident);
size_t nvs_msg_evicted(char *buf, size_t cap, const char *device, uint64_t resident);
size_t nvs_msg_heartbeat(char *buf, size_t cap);
size_t nvs_msg_bye(char *buf, size_t cap);
size_t nvs_msg_query(char *buf, size_t cap);

#endif
