/*
 * The client protocol as the C codec needs it: GENERATED from nvshare_py/protocol_table.py by
 * `python -m nvshare_py.protocol_gen`. Edit the table, not this file: tests/test_protocol.py fails while
 * it is stale.
 *
 * X-macro lists, expanded by message.h (enum nvs_msg_type, the word enums, struct nvs_msg and
 * struct nvs_out) and message.c (the parser's and the builder's field tables):
 *
 *   NVS_<VOCABULARY>_WORDS(W)  W(CONSTANT, "word") for each word of a vocabulary, in order
 *   NVS_VOCABULARIES(V)        V(name, NAME) for each vocabulary a message uses
 *   NVS_SCHEDULER_MESSAGES(M)  M(TYPE) for each message the client reads
 *   NVS_CLIENT_MESSAGES(M)     M(TYPE) for each message the client writes
 *   NVS_SCHEDULER_FIELDS(F)    F(TYPE, key, KIND, PRESENCE, member, detail, default), in each
 *   NVS_CLIENT_FIELDS(F)       message's order
 *   NVS_SCHEDULER_MEMBERS(X)   X(STORAGE, member, detail): the members of struct nvs_msg
 *   NVS_CLIENT_MEMBERS(X)      X(STORAGE, member, detail): the members of struct nvs_out
 *
 * KIND: DEVICE UINT TEXT SESSION DEVICES FLAG WORD JSON (docs/protocol.md, Encoding).
 * PRESENCE: REQUIRED; OPTIONAL (absent, it reads as `default`, and a builder leaves it out
 * while it holds `default`); NULLABLE (absent, it says nothing: has_<member> is 0).
 * detail: a WORD's vocabulary, the bytes a TEXT keeps in struct nvs_msg (NUL included), the
 * byte limit of a JSON value; else 0. A WORD the parser reads is kept twice: its text in
 * <member>_text and its number in the member named after its vocabulary (0: unknown).
 */
#ifndef NVSHARE_PROTOCOL_TABLE_H
#define NVSHARE_PROTOCOL_TABLE_H

#define NVS_PROTOCOL_VERSION 1
#define NVS_MESSAGE_MAX 4096
#define NVS_VALUE_MAX 1024
#define NVS_FIELDS_MAX 32
#define NVS_UINT_MAX 9223372036854775807ULL
#define NVS_DEVICES_MAX 64
#define NVS_SESSION_DIGITS 16
#define NVS_DEVICE_ID_MAX 96
#define NVS_WORD_MAX 32
#define NVS_TYPE_MAX 16

#define NVS_MODE_WORDS(W)    \
    W(NVS_MODE_ON, "on")     \
    W(NVS_MODE_OFF, "off")   \
    W(NVS_MODE_AUTO, "auto")

#define NVS_RELEASE_REASON_WORDS(W)          \
    W(NVS_RELEASE_REASON_IDLE, "idle")       \
    W(NVS_RELEASE_REASON_DROP, "drop")       \
    W(NVS_RELEASE_REASON_QUANTUM, "quantum") \
    W(NVS_RELEASE_REASON_REVOKE, "revoke")   \
    W(NVS_RELEASE_REASON_USER, "user")

#define NVS_DROP_REASON_WORDS(W)            \
    W(NVS_DROP_REASON_QUANTUM, "quantum")   \
    W(NVS_DROP_REASON_MODE, "mode")         \
    W(NVS_DROP_REASON_MEMORY, "memory")     \
    W(NVS_DROP_REASON_CONFLICT, "conflict") \
    W(NVS_DROP_REASON_GANG, "gang")

#define NVS_REVOKE_REASON_WORDS(W)                      \
    W(NVS_REVOKE_REASON_GRACE_EXPIRED, "grace-expired")

#define NVS_REFUSE_REASON_WORDS(W)              \
    W(NVS_REFUSE_REASON_TIMEOUT, "timeout")     \
    W(NVS_REFUSE_REASON_TOO_LARGE, "too-large") \
    W(NVS_REFUSE_REASON_LIMIT, "limit")

#define NVS_ERROR_CODE_WORDS(W)                                    \
    W(NVS_ERROR_CODE_MALFORMED, "malformed")                       \
    W(NVS_ERROR_CODE_TOO_LARGE, "too-large")                       \
    W(NVS_ERROR_CODE_UNSUPPORTED_VERSION, "unsupported-version")   \
    W(NVS_ERROR_CODE_UNKNOWN_TYPE, "unknown-type")                 \
    W(NVS_ERROR_CODE_BAD_FIELD, "bad-field")                       \
    W(NVS_ERROR_CODE_NOT_REGISTERED, "not-registered")             \
    W(NVS_ERROR_CODE_ALREADY_REGISTERED, "already-registered")     \
    W(NVS_ERROR_CODE_TOO_MANY_CONNECTIONS, "too-many-connections")

#define NVS_VOCABULARIES(V)           \
    V(mode, MODE)                     \
    V(release_reason, RELEASE_REASON) \
    V(drop_reason, DROP_REASON)       \
    V(revoke_reason, REVOKE_REASON)   \
    V(refuse_reason, REFUSE_REASON)   \
    V(error_code, ERROR_CODE)

#define NVS_SCHEDULER_MESSAGES(M) \
    M(WELCOME)                    \
    M(GRANT)                      \
    M(DROP)                       \
    M(FENCE)                      \
    M(EVICT)                      \
    M(CONTENDED)                  \
    M(PREPARE)                    \
    M(POOL)                       \
    M(PREFETCH)                   \
    M(REVOKE)                     \
    M(MODE)                       \
    M(ADMITTED)                   \
    M(REFUSED)                    \
    M(LIMIT)                      \
    M(ERROR)                      \
    M(STATUS)

#define NVS_CLIENT_MESSAGES(M) \
    M(HELLO)                   \
    M(DEVICE)                  \
    M(MEMORY)                  \
    M(ACQUIRE)                 \
    M(ADMIT)                   \
    M(RELEASE)                 \
    M(EVICTED)                 \
    M(FENCED)                  \
    M(HEARTBEAT)               \
    M(BYE)                     \
    M(QUERY)

#define NVS_SCHEDULER_FIELDS(F)                                          \
    F(WELCOME, client, TEXT, REQUIRED, client, 64, "")                   \
    F(WELCOME, heartbeat_ms, UINT, REQUIRED, heartbeat_ms, 0, 0)         \
    F(WELCOME, idle_release_ms, UINT, REQUIRED, idle_release_ms, 0, 0)   \
    F(WELCOME, version, UINT, REQUIRED, version, 0, 0)                   \
    F(WELCOME, admission, FLAG, OPTIONAL, admission, 0, 0)               \
    F(GRANT, device, DEVICE, REQUIRED, device, 0, "")                    \
    F(GRANT, grant, UINT, REQUIRED, grant, 0, 0)                         \
    F(GRANT, mode, WORD, REQUIRED, mode, mode, "")                       \
    F(GRANT, exclusive, FLAG, REQUIRED, exclusive, 0, 0)                 \
    F(GRANT, quantum_ms, UINT, REQUIRED, quantum_ms, 0, 0)               \
    F(GRANT, prefetch, UINT, OPTIONAL, prefetch, 0, 0)                   \
    F(DROP, device, DEVICE, REQUIRED, device, 0, "")                     \
    F(DROP, grant, UINT, REQUIRED, grant, 0, 0)                          \
    F(DROP, grace_ms, UINT, REQUIRED, grace_ms, 0, 0)                    \
    F(DROP, reason, WORD, REQUIRED, reason, drop_reason, "")             \
    F(DROP, evict, UINT, OPTIONAL, evict, 0, 0)                          \
    F(DROP, fence, FLAG, OPTIONAL, fence, 0, 0)                          \
    F(FENCE, device, DEVICE, REQUIRED, device, 0, "")                    \
    F(FENCE, grant, UINT, REQUIRED, grant, 0, 0)                         \
    F(FENCE, collectives, UINT, REQUIRED, collectives, 0, 0)             \
    F(EVICT, device, DEVICE, REQUIRED, device, 0, "")                    \
    F(EVICT, bytes, UINT, REQUIRED, bytes, 0, 0)                         \
    F(CONTENDED, device, DEVICE, REQUIRED, device, 0, "")                \
    F(CONTENDED, grant, UINT, REQUIRED, grant, 0, 0)                     \
    F(CONTENDED, quantum_left_ms, UINT, REQUIRED, quantum_left_ms, 0, 0) \
    F(CONTENDED, evict, UINT, OPTIONAL, evict, 0, 0)                     \
    F(CONTENDED, idle_ms, UINT, OPTIONAL, idle_ms, 0, 0)                 \
    F(PREPARE, device, DEVICE, REQUIRED, device, 0, "")                  \
    F(PREPARE, bytes, UINT, REQUIRED, bytes, 0, 0)                       \
    F(POOL, bytes, UINT, REQUIRED, bytes, 0, 0)                          \
    F(POOL, need, UINT, NULLABLE, need, 0, 0)                            \
    F(PREFETCH, device, DEVICE, REQUIRED, device, 0, "")                 \
    F(PREFETCH, resident, UINT, REQUIRED, resident, 0, 0)                \
    F(REVOKE, device, DEVICE, REQUIRED, device, 0, "")                   \
    F(REVOKE, grant, UINT, REQUIRED, grant, 0, 0)                        \
    F(REVOKE, reason, WORD, REQUIRED, reason, revoke_reason, "")         \
    F(MODE, device, DEVICE, REQUIRED, device, 0, "")                     \
    F(MODE, mode, WORD, REQUIRED, mode, mode, "")                        \
    F(MODE, quantum_ms, UINT, REQUIRED, quantum_ms, 0, 0)                \
    F(ADMITTED, device, DEVICE, REQUIRED, device, 0, "")                 \
    F(ADMITTED, request, UINT, REQUIRED, request, 0, 0)                  \
    F(ADMITTED, bytes, UINT, REQUIRED, bytes, 0, 0)                      \
    F(REFUSED, device, DEVICE, REQUIRED, device, 0, "")                  \
    F(REFUSED, request, UINT, REQUIRED, request, 0, 0)                   \
    F(REFUSED, reason, WORD, REQUIRED, reason, refuse_reason, "")        \
    F(LIMIT, bytes, UINT, REQUIRED, bytes, 0, 0)                         \
    F(LIMIT, device, DEVICE, OPTIONAL, device, 0, "")                    \
    F(ERROR, code, WORD, REQUIRED, code, error_code, "")                 \
    F(ERROR, detail, TEXT, OPTIONAL, detail, 256, "")                    \
    F(ERROR, type, TEXT, OPTIONAL, error_type, 32, "")                   \
    F(STATUS, json, JSON, REQUIRED, json, 4074, 0)

#define NVS_CLIENT_FIELDS(F)                                           \
    F(HELLO, pid, UINT, REQUIRED, pid, 0, 0)                           \
    F(HELLO, session, SESSION, REQUIRED, session, 0, "")               \
    F(HELLO, host, TEXT, OPTIONAL, host, 0, "")                        \
    F(HELLO, container, TEXT, OPTIONAL, container, 0, "")              \
    F(HELLO, pod, TEXT, OPTIONAL, pod, 0, "")                          \
    F(HELLO, namespace, TEXT, OPTIONAL, namespace_, 0, "")             \
    F(HELLO, program, TEXT, OPTIONAL, program, 0, "")                  \
    F(HELLO, held, DEVICES, OPTIONAL, held, 0, 0)                      \
    F(HELLO, wanted, DEVICES, OPTIONAL, wanted, 0, 0)                  \
    F(HELLO, gang, TEXT, OPTIONAL, gang, 0, "")                        \
    F(HELLO, gang_size, UINT, OPTIONAL, gang_size, 0, 0)               \
    F(DEVICE, device, DEVICE, REQUIRED, device, 0, "")                 \
    F(DEVICE, total, UINT, REQUIRED, total, 0, 0)                      \
    F(DEVICE, name, TEXT, OPTIONAL, name, 0, "")                       \
    F(MEMORY, device, DEVICE, REQUIRED, device, 0, "")                 \
    F(MEMORY, used, UINT, REQUIRED, used, 0, 0)                        \
    F(MEMORY, resident, UINT, NULLABLE, resident, 0, 0)                \
    F(MEMORY, engine, TEXT, OPTIONAL, engine, 0, "")                   \
    F(MEMORY, area, UINT, NULLABLE, area, 0, 0)                        \
    F(MEMORY, out_bps, UINT, OPTIONAL, out_bps, 0, 0)                  \
    F(MEMORY, in_bps, UINT, OPTIONAL, in_bps, 0, 0)                    \
    F(MEMORY, pool, FLAG, OPTIONAL, pool, 0, 0)                        \
    F(ACQUIRE, device, DEVICE, REQUIRED, device, 0, "")                \
    F(ADMIT, device, DEVICE, REQUIRED, device, 0, "")                  \
    F(ADMIT, request, UINT, REQUIRED, request, 0, 0)                   \
    F(ADMIT, bytes, UINT, REQUIRED, bytes, 0, 0)                       \
    F(RELEASE, device, DEVICE, REQUIRED, device, 0, "")                \
    F(RELEASE, grant, UINT, REQUIRED, grant, 0, 0)                     \
    F(RELEASE, reason, WORD, OPTIONAL, reason, release_reason, "user") \
    F(RELEASE, resident, UINT, NULLABLE, resident, 0, 0)               \
    F(EVICTED, device, DEVICE, REQUIRED, device, 0, "")                \
    F(EVICTED, resident, UINT, REQUIRED, resident, 0, 0)               \
    F(FENCED, device, DEVICE, REQUIRED, device, 0, "")                 \
    F(FENCED, grant, UINT, REQUIRED, grant, 0, 0)                      \
    F(FENCED, collectives, UINT, REQUIRED, collectives, 0, 0)

#define NVS_SCHEDULER_MEMBERS(X)     \
    X(TEXT, client, 64)              \
    X(UINT, heartbeat_ms, 0)         \
    X(UINT, idle_release_ms, 0)      \
    X(UINT, version, 0)              \
    X(FLAG, admission, 0)            \
    X(DEVICE, device, 0)             \
    X(UINT, grant, 0)                \
    X(WORD_TEXT, mode_text, 0)       \
    X(WORD_NUMBER, mode, 0)          \
    X(FLAG, exclusive, 0)            \
    X(UINT, quantum_ms, 0)           \
    X(UINT, prefetch, 0)             \
    X(UINT, grace_ms, 0)             \
    X(WORD_TEXT, reason_text, 0)     \
    X(WORD_NUMBER, drop_reason, 0)   \
    X(UINT, evict, 0)                \
    X(FLAG, fence, 0)                \
    X(UINT, collectives, 0)          \
    X(UINT, bytes, 0)                \
    X(UINT, quantum_left_ms, 0)      \
    X(UINT, idle_ms, 0)              \
    X(UINT, need, 0)                 \
    X(HAS, has_need, 0)              \
    X(UINT, resident, 0)             \
    X(WORD_NUMBER, revoke_reason, 0) \
    X(UINT, request, 0)              \
    X(WORD_NUMBER, refuse_reason, 0) \
    X(WORD_TEXT, code_text, 0)       \
    X(WORD_NUMBER, error_code, 0)    \
    X(TEXT, detail, 256)             \
    X(TEXT, error_type, 32)

#define NVS_CLIENT_MEMBERS(X) \
    X(UINT, pid, 0)           \
    X(SESSION, session, 0)    \
    X(TEXT, host, 0)          \
    X(TEXT, container, 0)     \
    X(TEXT, pod, 0)           \
    X(TEXT, namespace_, 0)    \
    X(TEXT, program, 0)       \
    X(DEVICES, held, 0)       \
    X(DEVICES, wanted, 0)     \
    X(TEXT, gang, 0)          \
    X(UINT, gang_size, 0)     \
    X(DEVICE, device, 0)      \
    X(UINT, total, 0)         \
    X(TEXT, name, 0)          \
    X(UINT, used, 0)          \
    X(UINT, resident, 0)      \
    X(HAS, has_resident, 0)   \
    X(TEXT, engine, 0)        \
    X(UINT, area, 0)          \
    X(HAS, has_area, 0)       \
    X(UINT, out_bps, 0)       \
    X(UINT, in_bps, 0)        \
    X(FLAG, pool, 0)          \
    X(UINT, request, 0)       \
    X(UINT, bytes, 0)         \
    X(UINT, grant, 0)         \
    X(WORD, reason, 0)        \
    X(UINT, collectives, 0)

#endif
