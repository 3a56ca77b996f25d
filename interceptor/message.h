/*
 * Codec of the client protocol, version 1 (docs/protocol.md): parses the messages the scheduler
 * sends and builds the messages a client sends. Pure functions, no allocation, no state.
 *
 * The messages, their fields and the words of each vocabulary are declared once, in
 * nvshare_py/protocol_table.py; protocol_table.h is generated from it, and what follows is
 * expanded from its lists: a message or field added there needs nothing here or in message.c.
 */
#ifndef NVSHARE_MESSAGE_H
#define NVSHARE_MESSAGE_H

#include <stddef.h>
#include <stdint.h>

#include "protocol_table.h"

#define NVS_MSG_CONSTANT(TYPE) NVS_MSG_##TYPE,
enum nvs_msg_type {
    NVS_MSG_NONE = 0,
    NVS_SCHEDULER_MESSAGES(NVS_MSG_CONSTANT)
    NVS_CLIENT_MESSAGES(NVS_MSG_CONSTANT)
    NVS_MSG_UNKNOWN, /* a well-formed message of a type a client does not read: ignored */
};
#undef NVS_MSG_CONSTANT

/* One enum per vocabulary: enum nvs_mode { NVS_MODE_UNKNOWN, NVS_MODE_ON, ... }. UNKNOWN is
 * a word the parser read but this build does not know (a newer scheduler's): the receiver acts
 * on the message all the same (docs/protocol.md, "Unknown words"). */
#define NVS_WORD_CONSTANT(constant, text) constant,
#define NVS_VOCABULARY_ENUM(name, NAME) enum nvs_##name { NVS_##NAME##_UNKNOWN = 0, NVS_##NAME##_WORDS(NVS_WORD_CONSTANT) };
NVS_VOCABULARIES(NVS_VOCABULARY_ENUM)
#undef NVS_VOCABULARY_ENUM
#undef NVS_WORD_CONSTANT

/* A parsed scheduler message; only the fields of its type are meaningful (the others are 0 or
 * ""). A word field is kept twice: its text (<key>_text) and its number (the member named after
 * its vocabulary). A text longer than its member is cut at a character boundary. */
#define NVS_MSG_MEMBER_UINT(name, detail) uint64_t name;
#define NVS_MSG_MEMBER_FLAG(name, detail) int name;
#define NVS_MSG_MEMBER_HAS(name, detail) int name;
#define NVS_MSG_MEMBER_TEXT(name, size) char name[size];
#define NVS_MSG_MEMBER_DEVICE(name, detail) char name[NVS_DEVICE_ID_MAX + 1];
#define NVS_MSG_MEMBER_WORD_TEXT(name, detail) char name[NVS_WORD_MAX + 1];
#define NVS_MSG_MEMBER_WORD_NUMBER(vocabulary, detail) enum nvs_##vocabulary vocabulary;
#define NVS_MSG_MEMBER(storage, name, detail) NVS_MSG_MEMBER_##storage(name, detail)
struct nvs_msg {
    enum nvs_msg_type type;
    NVS_SCHEDULER_MEMBERS(NVS_MSG_MEMBER)
    /* Bit i: the i-th word field of the scheduler's messages (nvs_msg_unknown_word) holds a
     * word this build does not know. */
    uint64_t unknown_words;
    char unknown_type[NVS_TYPE_MAX + 1]; /* NVS_MSG_UNKNOWN: the type as it came */
};
#undef NVS_MSG_MEMBER

/* Parse one scheduler message. 0 on success, -1 if malformed (the caller logs and ignores it).
 * Accepts exactly what nvshare_py.protocol.decode accepts for scheduler messages (plus STATUS,
 * the answer to QUERY, whose JSON document it checks only for its length); unknown keys are
 * ignored and unknown words kept, as the protocol says. A well-formed message of a type a
 * client does not read is type NVS_MSG_UNKNOWN (its fields not read). `out` is zeroed first,
 * also on failure. */
int nvs_msg_parse(const char *buf, size_t len, struct nvs_msg *out);

/* Of a parsed message's unknown_words bit `bit`: the message type and key, and the word. 0, or
 * -1 when the bit is not one of a word field of m's type. */
int nvs_msg_unknown_word(const struct nvs_msg *m, unsigned bit, const char **type, const char **key,
                         const char **word);

/* "GRANT" for NVS_MSG_GRANT, "" for NONE and UNKNOWN. */
const char *nvs_msg_type_name(enum nvs_msg_type type);

/* What a client sends: the fields of every client message (the builder reads those of the type
 * it builds). Texts, device ids, the session and words are NUL-terminated strings; NULL or ""
 * leaves an optional one out, as does an optional number equal to its default; has_<member>
 * says whether a nullable number is said at all. A device list is `n_<member>` ids at
 * `<member>`. */
#define NVS_OUT_MEMBER_UINT(name, detail) uint64_t name;
#define NVS_OUT_MEMBER_FLAG(name, detail) int name;
#define NVS_OUT_MEMBER_HAS(name, detail) int name;
#define NVS_OUT_MEMBER_TEXT(name, detail) const char *name;
#define NVS_OUT_MEMBER_DEVICE(name, detail) const char *name;
#define NVS_OUT_MEMBER_SESSION(name, detail) const char *name;
#define NVS_OUT_MEMBER_WORD(name, detail) const char *name;
#define NVS_OUT_MEMBER_DEVICES(name, detail) const char *const *name; size_t n_##name;
#define NVS_OUT_MEMBER(storage, name, detail) NVS_OUT_MEMBER_##storage(name, detail)
struct nvs_out {
    NVS_CLIENT_MEMBERS(NVS_OUT_MEMBER)
};
#undef NVS_OUT_MEMBER

/* Build a client message of `type` from `out` into buf (capacity cap; no NUL terminator) and
 * return its length, or 0 if it does not fit (in cap, or in the protocol's 4096 bytes), `type`
 * is not a client message, or a field is invalid: a missing required one, a device id that is
 * not [A-Za-z0-9-]{1,96}, a number above 2^63-1, a session that is not 16 lowercase hex
 * digits, a device list longer than 1024 bytes once joined or than 64 ids, a word that is not
 * in its vocabulary (a sender speaks only words it knows). Free texts are made acceptable to
 * the scheduler: bytes that are not UTF-8 and control characters become '?', and the text is
 * cut at a character boundary to 1024 bytes. The output is what nvshare_py.protocol encodes. */
size_t nvs_msg_build(char *buf, size_t cap, enum nvs_msg_type type, const struct nvs_out *out);

#endif
