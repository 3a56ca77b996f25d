/*
 * Codec of the client protocol, version 1 (docs/protocol.md). It must accept and produce
 * exactly what nvshare_py/protocol.py accepts and produces: tests/test_wire.py checks the two
 * against each other. Pure functions over caller-owned buffers: no allocation, no state.
 *
 * The parser and the builder walk field tables expanded from protocol_table.h (generated from
 * nvshare_py/protocol_table.py): one loop per direction, one case per kind of value. Its length
 * (some 700 lines) is strict UTF-8 and value checking, a parser and a builder; nothing in it is
 * per message, so it does not grow with the protocol.
 */
#include "message.h"

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* Line and key limits of docs/protocol.md the table does not name. */
enum {
    KEY_MAX = 32,
    VERSION_DIGITS_MAX = 4,
    UINT_DIGITS_MAX = 19,
};
#define HEADER_PREFIX "NVSHARE/1 " /* what builders write: this side speaks version 1 */

/* Each vocabulary's words, NULL-terminated, in the order of its enum (index + 1 = number). */
#define WORD_TEXT(constant, text) text,
#define VOCABULARY_WORDS(name, NAME) static const char *const name##_words[] = {NVS_##NAME##_WORDS(WORD_TEXT) NULL};
NVS_VOCABULARIES(VOCABULARY_WORDS)
#undef VOCABULARY_WORDS
#undef WORD_TEXT
/* The parser stores a word's number through an int (memcpy): every word enum is int-sized. */
#define INT_SIZED(name, NAME) _Static_assert(sizeof(enum nvs_##name) == sizeof(int), "enum nvs_" #name " is not int-sized");
NVS_VOCABULARIES(INT_SIZED)
#undef INT_SIZED

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

/* A word of the protocol's form: [a-z][a-z0-9-]*, at most NVS_WORD_MAX characters. */
static int word_valid(const char *s, size_t n)
{
    if (n == 0 || n > NVS_WORD_MAX || s[0] < 'a' || s[0] > 'z')
        return 0;
    for (size_t i = 1; i < n; i++)
        if (!((s[i] >= 'a' && s[i] <= 'z') || (s[i] >= '0' && s[i] <= '9') || s[i] == '-'))
            return 0;
    return 1;
}

/* ---- the field tables --------------------------------------------------------------------- */

enum field_kind { FIELD_DEVICE, FIELD_UINT, FIELD_TEXT, FIELD_SESSION, FIELD_DEVICES, FIELD_FLAG, FIELD_WORD, FIELD_JSON };
enum field_presence { FIELD_REQUIRED, FIELD_OPTIONAL, FIELD_NULLABLE };

#define NO_MEMBER SIZE_MAX

struct field_spec {
    enum nvs_msg_type type;
    const char *key;
    size_t key_len;
    enum field_kind kind;
    enum field_presence presence;
    size_t offset;              /* the value's member (a word's text when parsed) */
    size_t size;                /* capacity of a char array member; a JSON value's byte limit */
    size_t number_offset;       /* parsed word: its number's member; nullable: has_<member> */
    const char *const *words;   /* word: its vocabulary */
    uint64_t default_number;    /* optional number or flag: its value when absent */
    const char *default_text;   /* optional text or word: its value when absent */
};

#define MSG_MEMBER(member) offsetof(struct nvs_msg, member), sizeof(((struct nvs_msg *)0)->member)
#define OUT_MEMBER(member) offsetof(struct nvs_out, member), 0
#define HAS_MSG_REQUIRED(member) NO_MEMBER
#define HAS_MSG_OPTIONAL(member) NO_MEMBER
#define HAS_MSG_NULLABLE(member) offsetof(struct nvs_msg, has_##member)
#define HAS_OUT_REQUIRED(member) NO_MEMBER
#define HAS_OUT_OPTIONAL(member) NO_MEMBER
#define HAS_OUT_NULLABLE(member) offsetof(struct nvs_out, has_##member)

/* What the parser reads: F(TYPE, key, KIND, PRESENCE, member, detail, default). */
#define READ_DEVICE(t, k, p, m, d, v) {NVS_MSG_##t, #k, sizeof #k - 1, FIELD_DEVICE, FIELD_##p, MSG_MEMBER(m), NO_MEMBER, NULL, 0, v},
#define READ_UINT(t, k, p, m, d, v) {NVS_MSG_##t, #k, sizeof #k - 1, FIELD_UINT, FIELD_##p, MSG_MEMBER(m), HAS_MSG_##p(m), NULL, v, ""},
#define READ_TEXT(t, k, p, m, d, v) {NVS_MSG_##t, #k, sizeof #k - 1, FIELD_TEXT, FIELD_##p, MSG_MEMBER(m), NO_MEMBER, NULL, 0, v},
#define READ_FLAG(t, k, p, m, d, v) {NVS_MSG_##t, #k, sizeof #k - 1, FIELD_FLAG, FIELD_##p, MSG_MEMBER(m), NO_MEMBER, NULL, v, ""},
#define READ_WORD(t, k, p, m, d, v) \
    {NVS_MSG_##t, #k, sizeof #k - 1, FIELD_WORD, FIELD_##p, MSG_MEMBER(m##_text), offsetof(struct nvs_msg, d), d##_words, 0, v},
#define READ_JSON(t, k, p, m, d, v) {NVS_MSG_##t, #k, sizeof #k - 1, FIELD_JSON, FIELD_##p, NO_MEMBER, d, NO_MEMBER, NULL, 0, ""},
#define READ(t, k, kind, p, m, d, v) READ_##kind(t, k, p, m, d, v)
static const struct field_spec read_fields[] = {NVS_SCHEDULER_FIELDS(READ)};

/* What the builder writes. */
#define WRITE_DEVICE(t, k, p, m, d, v) {NVS_MSG_##t, #k, sizeof #k - 1, FIELD_DEVICE, FIELD_##p, OUT_MEMBER(m), NO_MEMBER, NULL, 0, v},
#define WRITE_UINT(t, k, p, m, d, v) {NVS_MSG_##t, #k, sizeof #k - 1, FIELD_UINT, FIELD_##p, OUT_MEMBER(m), HAS_OUT_##p(m), NULL, v, ""},
#define WRITE_TEXT(t, k, p, m, d, v) {NVS_MSG_##t, #k, sizeof #k - 1, FIELD_TEXT, FIELD_##p, OUT_MEMBER(m), NO_MEMBER, NULL, 0, v},
#define WRITE_SESSION(t, k, p, m, d, v) {NVS_MSG_##t, #k, sizeof #k - 1, FIELD_SESSION, FIELD_##p, OUT_MEMBER(m), NO_MEMBER, NULL, 0, v},
#define WRITE_DEVICES(t, k, p, m, d, v) \
    {NVS_MSG_##t, #k, sizeof #k - 1, FIELD_DEVICES, FIELD_##p, OUT_MEMBER(m), offsetof(struct nvs_out, n_##m), NULL, 0, ""},
#define WRITE_FLAG(t, k, p, m, d, v) {NVS_MSG_##t, #k, sizeof #k - 1, FIELD_FLAG, FIELD_##p, OUT_MEMBER(m), NO_MEMBER, NULL, v, ""},
#define WRITE_WORD(t, k, p, m, d, v) {NVS_MSG_##t, #k, sizeof #k - 1, FIELD_WORD, FIELD_##p, OUT_MEMBER(m), NO_MEMBER, d##_words, 0, v},
#define WRITE(t, k, kind, p, m, d, v) WRITE_##kind(t, k, p, m, d, v)
static const struct field_spec write_fields[] = {NVS_CLIENT_FIELDS(WRITE)};

#define COUNT(array) (sizeof(array) / sizeof((array)[0]))

#define TYPE_NAME(TYPE) [NVS_MSG_##TYPE] = #TYPE,
static const char *const type_names[NVS_MSG_UNKNOWN + 1] = {NVS_SCHEDULER_MESSAGES(TYPE_NAME) NVS_CLIENT_MESSAGES(TYPE_NAME)};
#undef TYPE_NAME

const char *nvs_msg_type_name(enum nvs_msg_type type)
{
    return (unsigned)type <= NVS_MSG_UNKNOWN && type_names[type] ? type_names[type] : "";
}

static int is_scheduler_message(enum nvs_msg_type type)
{
#define IS_TYPE(TYPE) || type == NVS_MSG_##TYPE
    return 0 NVS_SCHEDULER_MESSAGES(IS_TYPE);
#undef IS_TYPE
}

static int is_client_message(enum nvs_msg_type type)
{
#define IS_TYPE(TYPE) || type == NVS_MSG_##TYPE
    return 0 NVS_CLIENT_MESSAGES(IS_TYPE);
#undef IS_TYPE
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

static int key_is(struct span key, const struct field_spec *f)
{
    return key.n == f->key_len && memcmp(key.p, f->key, key.n) == 0;
}

/* Number of s in a NULL-terminated vocabulary (index + 1), 0 when it is not there. */
static int word_number(struct span s, const char *const *words)
{
    for (int i = 0; words[i]; i++)
        if (span_equals(s, words[i]))
            return i + 1;
    return 0;
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
    if (value > NVS_UINT_MAX)
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

/* `NVSHARE/<1-4 digits> <[A-Z]{1,16}>`; the type is returned in *type, the version in *version. */
static int parse_header(struct span line, struct span *type, unsigned *version)
{
    static const char prefix[] = "NVSHARE/";
    size_t i = sizeof prefix - 1, digits = 0;

    *version = 0;
    if (line.n < i || memcmp(line.p, prefix, i) != 0)
        return -1;
    for (; i < line.n && line.p[i] >= '0' && line.p[i] <= '9'; i++, digits++)
        *version = *version * 10 + (unsigned)(line.p[i] - '0');
    if (digits == 0 || digits > VERSION_DIGITS_MAX || i == line.n || line.p[i] != ' ')
        return -1;
    type->p = line.p + i + 1;
    type->n = line.n - i - 1;
    if (type->n == 0 || type->n > NVS_TYPE_MAX)
        return -1;
    for (size_t k = 0; k < type->n; k++)
        if (type->p[k] < 'A' || type->p[k] > 'Z')
            return -1;
    return 0;
}

/* `key=value` with the key rules of docs/protocol.md and no control character in the value
 * (its length is checked once its field is known). */
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
    for (size_t i = 0; i < value->n; i++)
        if (is_control((unsigned char)value->p[i]))
            return -1;
    return 0;
}

/* Store `value` (or, for an absent optional field, its default) into its member. `bit`: the
 * field's bit in unknown_words (word fields). */
static void store_word_number(struct nvs_msg *out, const struct field_spec *f, int number)
{
    memcpy((char *)out + f->number_offset, &number, sizeof number);
}

/* An absent optional field reads as its default (a nullable number's has_ stays 0). */
static int read_default(const struct field_spec *f, struct nvs_msg *out)
{
    char *member = (char *)out + f->offset;
    struct span text = {f->default_text, strlen(f->default_text)};
    int flag;

    switch (f->kind) {
    case FIELD_UINT:
        memcpy(member, &f->default_number, sizeof f->default_number);
        return 0;
    case FIELD_FLAG:
        flag = (int)f->default_number;
        memcpy(member, &flag, sizeof flag);
        return 0;
    case FIELD_WORD:
        store_word_number(out, f, word_number(text, f->words));
        copy_text(member, f->size, text);
        return 0;
    case FIELD_DEVICE:
    case FIELD_TEXT:
        copy_text(member, f->size, text);
        return 0;
    default:
        return -1; /* JSON, and the kinds only client messages have, are never optional here */
    }
}

/* Store `value` into its member. `bit`: the field's bit in unknown_words (word fields). */
static int read_value(const struct field_spec *f, struct span value, unsigned bit, struct nvs_msg *out)
{
    uint64_t number;
    int flag, known;

    if (f->kind == FIELD_JSON) /* only its length: no client reads the document (nvs_msg_parse) */
        return value.n <= f->size ? 0 : -1;
    char *member = (char *)out + f->offset;
    switch (f->kind) {
    case FIELD_DEVICE:
        if (!device_valid(value.p, value.n))
            return -1;
        copy_text(member, f->size, value);
        return 0;
    case FIELD_UINT:
        if (parse_uint(value, &number) < 0)
            return -1;
        memcpy(member, &number, sizeof number);
        if (f->number_offset != NO_MEMBER) { /* a nullable number: it was said */
            flag = 1;
            memcpy((char *)out + f->number_offset, &flag, sizeof flag);
        }
        return 0;
    case FIELD_TEXT:
        copy_text(member, f->size, value);
        return 0;
    case FIELD_FLAG:
        if (!span_equals(value, "0") && !span_equals(value, "1"))
            return -1;
        flag = value.p[0] == '1';
        memcpy(member, &flag, sizeof flag);
        return 0;
    case FIELD_WORD:
        /* Open: a word of the right form is read even when it is not in the vocabulary. */
        if (!word_valid(value.p, value.n))
            return -1;
        copy_text(member, f->size, value);
        known = word_number(value, f->words);
        store_word_number(out, f, known);
        if (!known)
            out->unknown_words |= (uint64_t)1 << bit;
        return 0;
    default:
        return -1; /* a kind only client messages have: protocol_gen.py keeps it out */
    }
}

int nvs_msg_parse(const char *buf, size_t len, struct nvs_msg *out)
{
    struct span keys[NVS_FIELDS_MAX], values[NVS_FIELDS_MAX], line, type;
    const char *cursor, *end;
    size_t n_fields = 0;
    enum nvs_msg_type id = NVS_MSG_NONE;
    unsigned version;

    if (!out)
        return -1;
    memset(out, 0, sizeof *out);
    if (!buf || len > NVS_MESSAGE_MAX || !utf8_valid((const unsigned char *)buf, len))
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
            /* A well-formed message of another version is still not one this side can read. */
            if (parse_header(line, &type, &version) < 0 || version != NVS_PROTOCOL_VERSION)
                return -1;
            for (int t = NVS_MSG_NONE + 1; t < NVS_MSG_UNKNOWN && id == NVS_MSG_NONE; t++)
                if (is_scheduler_message((enum nvs_msg_type)t) && span_equals(type, type_names[t]))
                    id = (enum nvs_msg_type)t;
            if (id == NVS_MSG_NONE) {
                /* Not one a client reads (a newer scheduler's): the caller ignores it. */
                out->type = NVS_MSG_UNKNOWN;
                copy_text(out->unknown_type, sizeof out->unknown_type, type);
                return 0;
            }
        } else {
            if (n_fields == NVS_FIELDS_MAX)
                return -1;
            if (parse_field_line(line, &keys[n_fields], &values[n_fields]) < 0)
                return -1;
            for (size_t i = 0; i < n_fields; i++)
                if (keys[i].n == keys[n_fields].n && memcmp(keys[i].p, keys[n_fields].p, keys[i].n) == 0)
                    return -1; /* a key may appear once, known or not */
            n_fields++;
        }
        if (!newline)
            break;
        cursor = newline + 1;
    }

    /* Every value within NVS_VALUE_MAX, except a JSON document (read_value checks its own limit). */
    for (size_t i = 0; i < n_fields; i++) {
        int json = 0;
        for (size_t k = 0; values[i].n > NVS_VALUE_MAX && k < COUNT(read_fields) && !json; k++)
            json = read_fields[k].type == id && read_fields[k].kind == FIELD_JSON && key_is(keys[i], &read_fields[k]);
        if (values[i].n > NVS_VALUE_MAX && !json)
            return -1;
    }
    unsigned bit = 0;
    for (size_t k = 0; k < COUNT(read_fields); k++) {
        const struct field_spec *f = &read_fields[k];
        if (f->type == id) {
            const struct span *value = NULL;
            for (size_t i = 0; i < n_fields && !value; i++)
                if (key_is(keys[i], f))
                    value = &values[i];
            if ((value ? read_value(f, *value, bit, out) : f->presence == FIELD_REQUIRED ? -1 : read_default(f, out)) < 0) {
                memset(out, 0, sizeof *out);
                return -1;
            }
        }
        bit += f->kind == FIELD_WORD;
    }
    out->type = id;
    return 0;
}

int nvs_msg_unknown_word(const struct nvs_msg *m, unsigned bit, const char **type, const char **key,
                         const char **word)
{
    unsigned index = 0;

    for (size_t k = 0; m && k < COUNT(read_fields); k++) {
        const struct field_spec *f = &read_fields[k];
        if (f->kind != FIELD_WORD)
            continue;
        if (index++ != bit)
            continue;
        if (f->type != m->type)
            return -1;
        *type = type_names[f->type];
        *key = f->key;
        *word = (const char *)m + f->offset;
        return 0;
    }
    return -1;
}

/* ---- builder ------------------------------------------------------------------------------- */

/* Appends to a caller's buffer; remembers whether anything did not fit or was invalid. */
struct writer {
    char *buf;
    size_t cap; /* min(caller's capacity, NVS_MESSAGE_MAX) */
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

    if (value > NVS_UINT_MAX) {
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

/* A value checked by `valid` (device id, word, session): NULL or "" is left out when optional. */
static void put_checked(struct writer *w, const struct field_spec *f, const char *value, int valid)
{
    if ((!value || !*value) && f->presence != FIELD_REQUIRED)
        return;
    if (!value || !valid) {
        w->failed = 1;
        return;
    }
    put_key(w, f->key);
    put_bytes(w, value, strlen(value));
}

/*
 * A free text (host name, program, device name...): omitted when empty and optional; bytes that
 * are not well-formed UTF-8 and control characters become '?', so that the scheduler accepts the
 * message; cut at a character boundary to the protocol's value limit.
 */
static void put_text(struct writer *w, const struct field_spec *f, const char *text)
{
    const unsigned char *s = (const unsigned char *)text;
    size_t remaining = text ? strlen(text) : 0, written = 0;

    if (remaining == 0 && f->presence != FIELD_REQUIRED)
        return;
    put_key(w, f->key);
    while (remaining > 0) {
        size_t len = utf8_sequence(s, remaining);
        int replace = len == 0 || (len == 1 && is_control(s[0]));
        size_t out_len = replace ? 1 : len;

        if (written + out_len > NVS_VALUE_MAX)
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
    if (!ids || n > NVS_DEVICES_MAX) {
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
    if (value_len > NVS_VALUE_MAX) {
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
    size_t n = strlen(session);

    if (n != NVS_SESSION_DIGITS)
        return 0;
    for (size_t i = 0; i < n; i++)
        if (!((session[i] >= '0' && session[i] <= '9') || (session[i] >= 'a' && session[i] <= 'f')))
            return 0;
    return 1;
}

static void write_field(struct writer *w, const struct field_spec *f, const struct nvs_out *out)
{
    const char *member = (const char *)out + f->offset;
    const char *text;
    uint64_t number;
    int flag;

    switch (f->kind) {
    case FIELD_UINT:
        memcpy(&number, member, sizeof number);
        if (f->presence == FIELD_NULLABLE) {
            memcpy(&flag, (const char *)out + f->number_offset, sizeof flag);
            if (!flag)
                return;
        } else if (f->presence == FIELD_OPTIONAL && number == f->default_number) {
            return;
        }
        put_uint(w, f->key, number);
        return;
    case FIELD_FLAG:
        memcpy(&flag, member, sizeof flag);
        if (f->presence == FIELD_OPTIONAL && (uint64_t)(flag != 0) == f->default_number)
            return;
        put_key(w, f->key);
        put_bytes(w, flag ? "1" : "0", 1);
        return;
    case FIELD_DEVICES: {
        const char *const *ids;
        size_t n;
        memcpy(&ids, member, sizeof ids);
        memcpy(&n, (const char *)out + f->number_offset, sizeof n);
        put_device_list(w, f->key, ids, n);
        return;
    }
    default:
        break;
    }
    memcpy(&text, member, sizeof text);
    switch (f->kind) {
    case FIELD_DEVICE:
        put_checked(w, f, text, text && device_valid(text, strlen(text)));
        return;
    case FIELD_SESSION:
        put_checked(w, f, text, text && session_valid(text));
        return;
    case FIELD_WORD: {
        /* A sender speaks only words it knows; its default goes without saying. */
        struct span word = {text, text ? strlen(text) : 0};
        if (text && f->presence == FIELD_OPTIONAL && strcmp(text, f->default_text) == 0)
            return;
        put_checked(w, f, text, text && word_number(word, f->words) > 0);
        return;
    }
    case FIELD_TEXT:
        put_text(w, f, text);
        return;
    default:
        w->failed = 1; /* a kind only scheduler messages have: protocol_gen.py keeps it out */
        return;
    }
}

size_t nvs_msg_build(char *buf, size_t cap, enum nvs_msg_type type, const struct nvs_out *out)
{
    struct writer w = {buf, cap < NVS_MESSAGE_MAX ? cap : NVS_MESSAGE_MAX, 0, buf == NULL || out == NULL};

    if (!is_client_message(type))
        return 0;
    put_bytes(&w, HEADER_PREFIX, sizeof HEADER_PREFIX - 1);
    put_bytes(&w, type_names[type], strlen(type_names[type]));
    for (size_t k = 0; k < COUNT(write_fields) && !w.failed; k++)
        if (write_fields[k].type == type)
            write_field(&w, &write_fields[k], out);
    return w.failed ? 0 : w.len;
}
