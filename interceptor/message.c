/*
 * Codec of the client protocol, version 1 (docs/protocol.md). It must accept and produce
 * exactly what nvshare_py/protocol.py accepts and produces: tests/test_wire.py checks the two
 * against each other. Pure functions over caller-owned buffers: no allocation, no state.
 */
#include "message.h"

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* Limits of docs/protocol.md (MAX_MESSAGE, MAX_VALUE, MAX_FIELDS in protocol.py). */
enum {
    MESSAGE_MAX = 4096,
    VALUE_MAX = 1024,
    FIELDS_MAX = 32,
    KEY_MAX = 32,
    TYPE_MAX = 16,
    VERSION_DIGITS_MAX = 4,
    UINT_DIGITS_MAX = 19,
};
#define PROTOCOL_VERSION 1
#define HEADER_PREFIX "NVSHARE/1 " /* what builders write: this side speaks version 1 */
#define UINT_LIMIT ((uint64_t)INT64_MAX) /* integers are below 2^63 */

static const char *const release_reasons[] = {"idle", "drop", "quantum", "revoke", "user", NULL};
static const char *const drop_reasons[] = {"quantum", "mode", "memory", "conflict", NULL};
static const char *const revoke_reasons[] = {"grace-expired", NULL};
static const char *const refuse_reasons[] = {"timeout", "too-large", "limit", NULL};
static const char *const error_codes[] = {
    "malformed",  "too-large",      "unsupported-version", "unknown-type",
    "bad-field",  "not-registered", "already-registered",  NULL,
};
static const char *const modes[] = {"on", "off", "auto", NULL};

/* ---- character classes ------------------------------------------------------------------ */

static int is_control(unsigned char c)
{
    return c < 0x20 || c == 0x7f;
}

static int is_device_char(unsigned char c)
{
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-';
}

static int is_key_char(unsigned char c)
{
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_';
}

/*
 * Length of the well-formed UTF-8 sequence that starts at s (n bytes available), or 0 when the
 * bytes there are not one. Overlong forms, surrogates and code points above U+10FFFF are
 * ill-formed, as for Python's strict decoder.
 */
static size_t utf8_sequence(const unsigned char *s, size_t n)
{
    unsigned char lead = s[0], second_min = 0x80, second_max = 0xbf;
    size_t len;

    if (lead < 0x80)
        return 1;
    if (lead >= 0xc2 && lead <= 0xdf) {
        len = 2;
    } else if (lead >= 0xe0 && lead <= 0xef) {
        len = 3;
        if (lead == 0xe0)
            second_min = 0xa0; /* overlong */
        else if (lead == 0xed)
            second_max = 0x9f; /* surrogates */
    } else if (lead >= 0xf0 && lead <= 0xf4) {
        len = 4;
        if (lead == 0xf0)
            second_min = 0x90; /* overlong */
        else if (lead == 0xf4)
            second_max = 0x8f; /* above U+10FFFF */
    } else {
        return 0;
    }
    if (n < len || s[1] < second_min || s[1] > second_max)
        return 0;
    for (size_t i = 2; i < len; i++)
        if (s[i] < 0x80 || s[i] > 0xbf)
            return 0;
    return len;
}

static int utf8_valid(const unsigned char *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        size_t len = utf8_sequence(s + i, n - i);
        if (len == 0)
            return 0;
        i += len;
    }
    return 1;
}

static int device_valid(const char *s, size_t n)
{
    if (n == 0 || n > NVS_DEVICE_ID_MAX)
        return 0;
    for (size_t i = 0; i < n; i++)
        if (!is_device_char((unsigned char)s[i]))
            return 0;
    return 1;
}

/* ---- parser --------------------------------------------------------------------------------- */

struct span {
    const char *p;
    size_t n;
};

static int span_equals(struct span s, const char *literal)
{
    size_t n = strlen(literal);
    return s.n == n && memcmp(s.p, literal, n) == 0;
}

/* Index of s in a NULL-terminated list, or -1. */
static int choice_index(struct span s, const char *const *choices)
{
    for (int i = 0; choices[i]; i++)
        if (span_equals(s, choices[i]))
            return i;
    return -1;
}

/* Unsigned decimal below 2^63, at most 19 ASCII digits (leading zeros allowed, as in Python). */
static int parse_uint(struct span s, uint64_t *out)
{
    uint64_t value = 0;

    if (s.n == 0 || s.n > UINT_DIGITS_MAX)
        return -1;
    for (size_t i = 0; i < s.n; i++) {
        unsigned char c = (unsigned char)s.p[i];
        if (c < '0' || c > '9')
            return -1;
        value = value * 10 + (uint64_t)(c - '0'); /* 19 digits cannot overflow 64 bits */
    }
    if (value > UINT_LIMIT)
        return -1;
    *out = value;
    return 0;
}

/*
 * Copy a valid UTF-8 value into dst (capacity cap, NUL-terminated), cut at a character boundary
 * when it does not fit: the C side keeps shorter copies of display-only texts.
 */
static void copy_text(char *dst, size_t cap, struct span s)
{
    size_t n = s.n;

    if (n > cap - 1) {
        n = cap - 1;
        while (n > 0 && ((unsigned char)s.p[n] & 0xc0) == 0x80)
            n--;
    }
    memcpy(dst, s.p, n);
    dst[n] = '\0';
}

enum field_kind {
    FIELD_DEVICE, /* device id, into a char array */
    FIELD_UINT,   /* into a uint64_t */
    FIELD_TEXT,   /* any value, into a char array (cut at a character boundary) */
    FIELD_CHOICE, /* one of `choices`, into a char array */
    FIELD_MODE,   /* on/off/auto (never stored) */
    FIELD_FLAG,   /* 0 or 1, into an int */
};

#define NOT_STORED SIZE_MAX /* validated like the Python codec, then dropped */

struct field_spec {
    const char *key;
    enum field_kind kind;
    size_t offset; /* into struct nvs_msg, or NOT_STORED */
    size_t size;   /* capacity of a char array */
    const char *const *choices;
};

#define MEMBER_SIZE(member) sizeof(((struct nvs_msg *)0)->member)
#define STORED(key, kind, member, choices) \
    { key, kind, offsetof(struct nvs_msg, member), MEMBER_SIZE(member), choices }

struct message_spec {
    const char *type;
    enum nvs_msg_type id;
    const struct field_spec *required;
    size_t n_required;
    const struct field_spec *optional;
    size_t n_optional;
};

static const struct field_spec welcome_fields[] = {
    STORED("client", FIELD_TEXT, client, NULL),
    STORED("heartbeat_ms", FIELD_UINT, heartbeat_ms, NULL),
    STORED("idle_release_ms", FIELD_UINT, idle_release_ms, NULL),
    {"version", FIELD_UINT, NOT_STORED, 0, NULL},
};
static const struct field_spec welcome_optional[] = {
    STORED("admission", FIELD_FLAG, admission, NULL),
};
static const struct field_spec admitted_fields[] = {
    STORED("device", FIELD_DEVICE, device, NULL),
    STORED("request", FIELD_UINT, request, NULL),
    STORED("bytes", FIELD_UINT, bytes, NULL),
};
static const struct field_spec refused_fields[] = {
    STORED("device", FIELD_DEVICE, device, NULL),
    STORED("request", FIELD_UINT, request, NULL),
    STORED("reason", FIELD_CHOICE, reason, refuse_reasons),
};
static const struct field_spec grant_fields[] = {
    STORED("device", FIELD_DEVICE, device, NULL),
    STORED("grant", FIELD_UINT, grant, NULL),
    {"mode", FIELD_MODE, NOT_STORED, 0, NULL},
    {"exclusive", FIELD_FLAG, NOT_STORED, 0, NULL},
    STORED("quantum_ms", FIELD_UINT, quantum_ms, NULL),
};
static const struct field_spec grant_optional[] = {
    STORED("prefetch", FIELD_UINT, prefetch_bytes, NULL),
};
static const struct field_spec drop_fields[] = {
    STORED("device", FIELD_DEVICE, device, NULL),
    STORED("grant", FIELD_UINT, grant, NULL),
    {"grace_ms", FIELD_UINT, NOT_STORED, 0, NULL},
    STORED("reason", FIELD_CHOICE, reason, drop_reasons),
};
static const struct field_spec drop_optional[] = {
    STORED("evict", FIELD_UINT, evict_bytes, NULL),
};
static const struct field_spec evict_fields[] = {
    STORED("device", FIELD_DEVICE, device, NULL),
    STORED("bytes", FIELD_UINT, evict_bytes, NULL),
};
static const struct field_spec contended_fields[] = {
    STORED("device", FIELD_DEVICE, device, NULL),
    STORED("grant", FIELD_UINT, grant, NULL),
    STORED("quantum_left_ms", FIELD_UINT, quantum_left_ms, NULL),
};
static const struct field_spec contended_optional[] = {
    STORED("evict", FIELD_UINT, evict_bytes, NULL),
    STORED("idle_ms", FIELD_UINT, idle_ms, NULL),
};
static const struct field_spec prepare_fields[] = {
    STORED("device", FIELD_DEVICE, device, NULL),
    STORED("bytes", FIELD_UINT, bytes, NULL),
};
static const struct field_spec prefetch_fields[] = {
    STORED("device", FIELD_DEVICE, device, NULL),
    STORED("resident", FIELD_UINT, resident, NULL),
};
static const struct field_spec revoke_fields[] = {
    STORED("device", FIELD_DEVICE, device, NULL),
    STORED("grant", FIELD_UINT, grant, NULL),
    STORED("reason", FIELD_CHOICE, reason, revoke_reasons),
};
static const struct field_spec mode_fields[] = {
    STORED("device", FIELD_DEVICE, device, NULL),
    {"mode", FIELD_MODE, NOT_STORED, 0, NULL},
    STORED("quantum_ms", FIELD_UINT, quantum_ms, NULL),
};
static const struct field_spec limit_fields[] = {
    STORED("device", FIELD_DEVICE, device, NULL),
    STORED("bytes", FIELD_UINT, bytes, NULL),
};
static const struct field_spec error_required[] = {
    STORED("code", FIELD_CHOICE, code, error_codes),
};
static const struct field_spec error_optional[] = {
    STORED("detail", FIELD_TEXT, detail, NULL),
    STORED("type", FIELD_TEXT, error_type, NULL),
};

#define FIELDS(array) array, sizeof(array) / sizeof(array[0])

static const struct message_spec scheduler_messages[] = {
    {"WELCOME", NVS_MSG_WELCOME, FIELDS(welcome_fields), FIELDS(welcome_optional)},
    {"GRANT", NVS_MSG_GRANT, FIELDS(grant_fields), FIELDS(grant_optional)},
    {"DROP", NVS_MSG_DROP, FIELDS(drop_fields), FIELDS(drop_optional)},
    {"EVICT", NVS_MSG_EVICT, FIELDS(evict_fields), NULL, 0},
    {"CONTENDED", NVS_MSG_CONTENDED, FIELDS(contended_fields), FIELDS(contended_optional)},
    {"PREPARE", NVS_MSG_PREPARE, FIELDS(prepare_fields), NULL, 0},
    {"PREFETCH", NVS_MSG_PREFETCH, FIELDS(prefetch_fields), NULL, 0},
    {"REVOKE", NVS_MSG_REVOKE, FIELDS(revoke_fields), NULL, 0},
    {"MODE", NVS_MSG_MODE, FIELDS(mode_fields), NULL, 0},
    {"ADMITTED", NVS_MSG_ADMITTED, FIELDS(admitted_fields), NULL, 0},
    {"REFUSED", NVS_MSG_REFUSED, FIELDS(refused_fields), NULL, 0},
    {"LIMIT", NVS_MSG_LIMIT, FIELDS(limit_fields), NULL, 0},
    {"ERROR", NVS_MSG_ERROR, FIELDS(error_required), FIELDS(error_optional)},
};

/* `NVSHARE/<1-4 digits> <[A-Z]{1,16}>`; the type is returned in *type. */
static int parse_header(struct span line, struct span *type)
{
    static const char prefix[] = "NVSHARE/";
    size_t i = sizeof prefix - 1, digits = 0;
    unsigned version = 0;

    if (line.n < i || memcmp(line.p, prefix, i) != 0)
        return -1;
    for (; i < line.n && line.p[i] >= '0' && line.p[i] <= '9'; i++, digits++)
        version = version * 10 + (unsigned)(line.p[i] - '0');
    if (digits == 0 || digits > VERSION_DIGITS_MAX || i == line.n || line.p[i] != ' ')
        return -1;
    type->p = line.p + i + 1;
    type->n = line.n - i - 1;
    if (type->n == 0 || type->n > TYPE_MAX)
        return -1;
    for (size_t k = 0; k < type->n; k++)
        if (type->p[k] < 'A' || type->p[k] > 'Z')
            return -1;
    /* A well-formed message of another version is still not one this side can read. */
    return version == PROTOCOL_VERSION ? 0 : -1;
}

/* `key=value` with the key and value rules of docs/protocol.md. */
static int parse_field_line(struct span line, struct span *key, struct span *value)
{
    const char *eq = memchr(line.p, '=', line.n);

    if (!eq)
        return -1;
    key->p = line.p;
    key->n = (size_t)(eq - line.p);
    value->p = eq + 1;
    value->n = line.n - key->n - 1;
    if (key->n == 0 || key->n > KEY_MAX || key->p[0] < 'a' || key->p[0] > 'z')
        return -1;
    for (size_t i = 1; i < key->n; i++)
        if (!is_key_char((unsigned char)key->p[i]))
            return -1;
    if (value->n > VALUE_MAX)
        return -1;
    for (size_t i = 0; i < value->n; i++)
        if (is_control((unsigned char)value->p[i]))
            return -1;
    return 0;
}

static int store_field(const struct field_spec *f, struct span value, struct nvs_msg *out)
{
    char *dst = f->offset == NOT_STORED ? NULL : (char *)out + f->offset;
    uint64_t number;
    int flag;

    switch (f->kind) {
    case FIELD_DEVICE:
        if (!device_valid(value.p, value.n))
            return -1;
        if (dst)
            copy_text(dst, f->size, value);
        return 0;
    case FIELD_UINT:
        if (parse_uint(value, &number) < 0)
            return -1;
        if (dst)
            memcpy(dst, &number, sizeof number);
        return 0;
    case FIELD_TEXT:
        if (dst)
            copy_text(dst, f->size, value);
        return 0;
    case FIELD_CHOICE:
        if (choice_index(value, f->choices) < 0)
            return -1;
        if (dst)
            copy_text(dst, f->size, value);
        return 0;
    case FIELD_MODE: /* validated only: the client does not act on the mode */
        return choice_index(value, modes) < 0 ? -1 : 0;
    case FIELD_FLAG:
        if (!span_equals(value, "0") && !span_equals(value, "1"))
            return -1;
        flag = value.p[0] == '1';
        if (dst)
            memcpy(dst, &flag, sizeof flag);
        return 0;
    }
    return -1;
}

/* The value of `key` among the message's fields, or NULL. */
static const struct span *find_value(const struct span *keys, const struct span *values, size_t n,
                                     const char *key)
{
    for (size_t i = 0; i < n; i++)
        if (span_equals(keys[i], key))
            return &values[i];
    return NULL;
}

int nvs_msg_parse(const char *buf, size_t len, struct nvs_msg *out)
{
    struct span keys[FIELDS_MAX], values[FIELDS_MAX], line, type;
    const struct message_spec *spec = NULL;
    const char *cursor, *end;
    size_t n_fields = 0;

    if (!out)
        return -1;
    memset(out, 0, sizeof *out);
    if (!buf || len > MESSAGE_MAX || !utf8_valid((const unsigned char *)buf, len))
        return -1;

    /* Lines are separated by '\n'; one empty trailing line is allowed. */
    end = buf + len;
    if (len > 0 && end[-1] == '\n')
        end--;
    cursor = buf;

    for (int first = 1;; first = 0) {
        const char *newline = memchr(cursor, '\n', (size_t)(end - cursor));
        line.p = cursor;
        line.n = (size_t)((newline ? newline : end) - cursor);

        if (first) {
            if (parse_header(line, &type) < 0)
                return -1;
            for (size_t i = 0; i < sizeof scheduler_messages / sizeof scheduler_messages[0]; i++)
                if (span_equals(type, scheduler_messages[i].type)) {
                    spec = &scheduler_messages[i];
                    break;
                }
            if (!spec && span_equals(type, "STATUS")) {
                /* The answer to this client's QUERY (a liveness check, client_core.c): only its
                 * arrival matters, so the document (longer than other values) is not read. */
                out->type = NVS_MSG_STATUS;
                return 0;
            }
            if (!spec)
                return -1;
        } else {
            if (n_fields == FIELDS_MAX)
                return -1;
            if (parse_field_line(line, &keys[n_fields], &values[n_fields]) < 0)
                return -1;
            for (size_t i = 0; i < n_fields; i++)
                if (keys[i].n == keys[n_fields].n &&
                    memcmp(keys[i].p, keys[n_fields].p, keys[i].n) == 0)
                    return -1; /* a key may appear once, known or not */
            n_fields++;
        }
        if (!newline)
            break;
        cursor = newline + 1;
    }

    for (size_t i = 0; i < spec->n_required; i++) {
        const struct span *value = find_value(keys, values, n_fields, spec->required[i].key);
        if (!value || store_field(&spec->required[i], *value, out) < 0)
            return -1;
    }
    for (size_t i = 0; i < spec->n_optional; i++) {
        const struct span *value = find_value(keys, values, n_fields, spec->optional[i].key);
        if (value && store_field(&spec->optional[i], *value, out) < 0)
            return -1;
    }
    out->type = spec->id;
    return 0;
}

/* ---- builders ------------------------------------------------------------------------------ */

/* Appends to a caller's buffer; remembers whether anything did not fit or was invalid. */
struct writer {
    char *buf;
    size_t cap; /* min(caller's capacity, MESSAGE_MAX) */
    size_t len;
    int failed;
};

static void put_bytes(struct writer *w, const void *p, size_t n)
{
    if (w->failed)
        return;
    if (n > w->cap - w->len) {
        w->failed = 1;
        return;
    }
    memcpy(w->buf + w->len, p, n);
    w->len += n;
}

static struct writer writer_start(char *buf, size_t cap, const char *type)
{
    struct writer w = {buf, cap < MESSAGE_MAX ? cap : MESSAGE_MAX, 0, buf == NULL};

    put_bytes(&w, HEADER_PREFIX, sizeof HEADER_PREFIX - 1);
    put_bytes(&w, type, strlen(type));
    return w;
}

static void put_key(struct writer *w, const char *key)
{
    put_bytes(w, "\n", 1);
    put_bytes(w, key, strlen(key));
    put_bytes(w, "=", 1);
}

static void put_uint(struct writer *w, const char *key, uint64_t value)
{
    char digits[20];
    size_t n = 0;

    if (value > UINT_LIMIT) {
        w->failed = 1;
        return;
    }
    do {
        digits[sizeof digits - 1 - n++] = (char)('0' + value % 10);
        value /= 10;
    } while (value);
    put_key(w, key);
    put_bytes(w, digits + sizeof digits - n, n);
}

static void put_device(struct writer *w, const char *key, const char *device)
{
    size_t n = device ? strlen(device) : 0;

    if (!device_valid(device, n)) {
        w->failed = 1;
        return;
    }
    put_key(w, key);
    put_bytes(w, device, n);
}

/*
 * A free text (host name, program, device name...): omitted when empty; bytes that are not
 * well-formed UTF-8 and control characters become '?', so that the scheduler accepts the
 * message; cut at a character boundary to the protocol's value limit.
 */
static void put_text(struct writer *w, const char *key, const char *text)
{
    const unsigned char *s = (const unsigned char *)text;
    size_t remaining = text ? strlen(text) : 0, written = 0;

    if (remaining == 0)
        return;
    put_key(w, key);
    while (remaining > 0) {
        size_t len = utf8_sequence(s, remaining);
        int replace = len == 0 || (len == 1 && is_control(s[0]));
        size_t out_len = replace ? 1 : len;

        if (written + out_len > VALUE_MAX)
            break;
        put_bytes(w, replace ? "?" : (const char *)s, out_len);
        written += out_len;
        if (len == 0)
            len = 1;
        s += len;
        remaining -= len;
    }
}

/* A comma-separated list of device ids; omitted when empty; too long a list is invalid. */
static void put_device_list(struct writer *w, const char *key, const char *const *ids, size_t n)
{
    size_t value_len = 0;

    if (n == 0)
        return;
    if (!ids) {
        w->failed = 1;
        return;
    }
    for (size_t i = 0; i < n; i++) {
        size_t len = ids[i] ? strlen(ids[i]) : 0;
        if (!device_valid(ids[i], len)) {
            w->failed = 1;
            return;
        }
        value_len += len + (i > 0);
    }
    if (value_len > VALUE_MAX) {
        w->failed = 1;
        return;
    }
    put_key(w, key);
    for (size_t i = 0; i < n; i++) {
        if (i > 0)
            put_bytes(w, ",", 1);
        put_bytes(w, ids[i], strlen(ids[i]));
    }
}

static int session_valid(const char *session)
{
    for (int i = 0; i < 16; i++) {
        char c = session[i];
        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f')))
            return 0;
    }
    return session[16] == '\0';
}

static size_t writer_finish(const struct writer *w)
{
    return w->failed ? 0 : w->len;
}

size_t nvs_msg_hello(char *buf, size_t cap, const struct nvs_hello *hello)
{
    struct writer w = writer_start(buf, cap, "HELLO");

    if (!hello || hello->pid < 0 || !session_valid(hello->session))
        return 0;
    put_uint(&w, "pid", (uint64_t)hello->pid);
    put_key(&w, "session");
    put_bytes(&w, hello->session, 16);
    put_text(&w, "host", hello->host);
    put_text(&w, "container", hello->container);
    put_text(&w, "pod", hello->pod);
    put_text(&w, "namespace", hello->namespace_);
    put_text(&w, "program", hello->program);
    put_device_list(&w, "held", hello->held, hello->n_held);
    put_device_list(&w, "wanted", hello->wanted, hello->n_wanted);
    return writer_finish(&w);
}

size_t nvs_msg_device(char *buf, size_t cap, const char *device, uint64_t total, const char *name)
{
    struct writer w = writer_start(buf, cap, "DEVICE");

    put_device(&w, "device", device);
    put_uint(&w, "total", total);
    put_text(&w, "name", name);
    return writer_finish(&w);
}

size_t nvs_msg_memory(char *buf, size_t cap, const char *device, uint64_t used, const uint64_t *resident,
                      const struct nvs_msg_swap *swap)
{
    struct writer w = writer_start(buf, cap, "MEMORY");
    static const char *const engines[] = {"copy", "migrate", NULL};

    put_device(&w, "device", device);
    put_uint(&w, "used", used);
    if (resident)
        put_uint(&w, "resident", *resident);
    if (swap) {
        struct span engine = {swap->engine, swap->engine ? strlen(swap->engine) : 0};
        if (!swap->engine || choice_index(engine, engines) < 0)
            return 0;
        put_key(&w, "engine");
        put_bytes(&w, swap->engine, engine.n);
        put_uint(&w, "area", swap->area);
        if (swap->out_bps)
            put_uint(&w, "out_bps", swap->out_bps);
        if (swap->in_bps)
            put_uint(&w, "in_bps", swap->in_bps);
    }
    return writer_finish(&w);
}

size_t nvs_msg_acquire(char *buf, size_t cap, const char *device)
{
    struct writer w = writer_start(buf, cap, "ACQUIRE");

    put_device(&w, "device", device);
    return writer_finish(&w);
}

size_t nvs_msg_admit(char *buf, size_t cap, const char *device, uint64_t request, uint64_t bytes)
{
    struct writer w = writer_start(buf, cap, "ADMIT");

    put_device(&w, "device", device);
    put_uint(&w, "request", request);
    put_uint(&w, "bytes", bytes);
    return writer_finish(&w);
}

size_t nvs_msg_release(char *buf, size_t cap, const char *device, uint64_t grant, const char *reason,
                       const uint64_t *resident)
{
    struct writer w = writer_start(buf, cap, "RELEASE");
    struct span reason_span = {reason, reason ? strlen(reason) : 0};

    if (!reason || choice_index(reason_span, release_reasons) < 0)
        return 0;
    put_device(&w, "device", device);
    put_uint(&w, "grant", grant);
    put_key(&w, "reason");
    put_bytes(&w, reason, reason_span.n);
    if (resident)
        put_uint(&w, "resident", *resident);
    return writer_finish(&w);
}

size_t nvs_msg_evicted(char *buf, size_t cap, const char *device, uint64_t resident)
{
    struct writer w = writer_start(buf, cap, "EVICTED");

    put_device(&w, "device", device);
    put_uint(&w, "resident", resident);
    return writer_finish(&w);
}

size_t nvs_msg_heartbeat(char *buf, size_t cap)
{
    struct writer w = writer_start(buf, cap, "HEARTBEAT");

    return writer_finish(&w);
}

size_t nvs_msg_query(char *buf, size_t cap)
{
    struct writer w = writer_start(buf, cap, "QUERY");

    return writer_finish(&w);
}

size_t nvs_msg_bye(char *buf, size_t cap)
{
    struct writer w = writer_start(buf, cap, "BYE");

    return writer_finish(&w);
}
