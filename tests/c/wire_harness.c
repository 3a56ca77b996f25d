/*
 * Test driver of the interceptor's wire layer (interceptor/transport.c + interceptor/message.c),
 * used by tests/test_wire.py.
 *
 *   wire_harness script          commands on stdin, one answer line on stdout per command
 *   wire_harness bench PATH N    round trips against an echoing ROUTER; prints one JSON line
 *
 * Script commands (byte strings travel as hex, "" allowed; numbers are decimal):
 *   connect PATH TIMEOUT_MS      -> rc N                  (0 or a negative errno)
 *   fdflags                      -> fdflags NONBLOCK CLOEXEC
 *   send [HEX]                   -> rc N
 *   recv TIMEOUT_MS [CAP]        -> msg HEX | none | rc N (waits for one message)
 *   serve MS                     -> served N | rc N       (receives for MS, answering PINGs)
 *   sleep MS                     -> slept                 (reads nothing: PINGs go unanswered)
 *   close                        -> closed
 *   parse [HEX]                  -> parsed {JSON} | rejected  (JSON: "type", every member of
 *                                   struct nvs_msg by name, "unknown": [[type, key, word]...])
 *   build TYPE [cap=N] KEY=HEX.. -> built HEX | invalid   (TYPE: a client message, any case;
 *                                   KEY: its fields; a device list's key may repeat)
 */
#define _GNU_SOURCE
#include "message.h"
#include "transport.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#define MAX_TOKENS 100
#define MAX_LIST 80 /* more ids than a message may carry: the builder must refuse them */

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void die(const char *what)
{
    fprintf(stderr, "wire_harness: %s\n", what);
    exit(2);
}

/* Decode hex into a fresh buffer (NUL-terminated for convenience); *len gets the byte count. */
static char *from_hex(const char *hex, size_t *len)
{
    size_t n = strlen(hex);
    char *out;

    if (n % 2)
        die("odd hex length");
    out = malloc(n / 2 + 1);
    if (!out)
        die("out of memory");
    for (size_t i = 0; i < n / 2; i++) {
        unsigned value;
        if (sscanf(hex + 2 * i, "%2x", &value) != 1)
            die("bad hex");
        out[i] = (char)value;
    }
    out[n / 2] = '\0';
    *len = n / 2;
    return out;
}

static void print_hex(const void *data, size_t len)
{
    const unsigned char *p = data;
    for (size_t i = 0; i < len; i++)
        printf("%02x", p[i]);
}

static long long to_number(const char *text)
{
    char *end;
    errno = 0;
    long long value = strtoll(text, &end, 10);
    if (errno || *text == '\0' || *end != '\0')
        die("bad number");
    return value;
}

static uint64_t to_u64(const char *text)
{
    char *end;
    errno = 0;
    unsigned long long value = strtoull(text, &end, 10);
    if (errno || *text == '\0' || *end != '\0' || *text == '-')
        die("bad unsigned number");
    return value;
}

/* Wait up to timeout_ms for one message; 1 = got one, 0 = none, negative = error. */
static int receive(struct nvs_transport *t, void *buf, size_t cap, size_t *len, int timeout_ms)
{
    int64_t deadline = now_ns() + (int64_t)timeout_ms * 1000000;

    for (;;) {
        int rc = nvs_transport_recv(t, buf, cap, len);
        if (rc != 0)
            return rc;
        int64_t left = deadline - now_ns();
        if (left <= 0)
            return 0;
        struct pollfd pfd = {.fd = nvs_transport_fd(t), .events = POLLIN};
        if (poll(&pfd, 1, (int)((left + 999999) / 1000000)) < 0 && errno != EINTR)
            return -errno;
    }
}

/* A JSON string of a text the parser stored (valid UTF-8 by then: only '"', '\' and bytes
 * below 0x20 need escaping). */
static void print_json_string(const char *key, const char *value)
{
    printf(", \"%s\": \"", key);
    for (const unsigned char *p = (const unsigned char *)value; *p; p++) {
        if (*p == '"' || *p == '\\')
            printf("\\%c", *p);
        else if (*p < 0x20)
            printf("\\u%04x", *p);
        else
            putchar(*p);
    }
    printf("\"");
}

/* parse HEX -> parsed {"type": ..., every member of struct nvs_msg by name} | rejected */
#define PRINT_UINT(name, detail) printf(", \"" #name "\": %" PRIu64, m.name);
#define PRINT_FLAG(name, detail) printf(", \"" #name "\": %d", m.name);
#define PRINT_HAS(name, detail) printf(", \"" #name "\": %d", m.name);
#define PRINT_TEXT(name, detail) print_json_string(#name, m.name);
#define PRINT_DEVICE(name, detail) print_json_string(#name, m.name);
#define PRINT_WORD_TEXT(name, detail) print_json_string(#name, m.name);
#define PRINT_WORD_NUMBER(name, detail) printf(", \"" #name "\": %d", (int)m.name);
#define PRINT_MEMBER(storage, name, detail) PRINT_##storage(name, detail)

static void command_parse(const char *hex)
{
    size_t len;
    char *data = from_hex(hex, &len);
    /* An exact-size copy, so that a read past the end is caught by AddressSanitizer. */
    char *exact = malloc(len ? len : 1);
    struct nvs_msg m;

    if (!exact)
        die("out of memory");
    memcpy(exact, data, len);
    if (nvs_msg_parse(exact, len, &m) != 0) {
        printf("rejected\n");
    } else {
        printf("parsed {\"type\": \"%s\"", m.type == NVS_MSG_UNKNOWN ? "UNKNOWN" : nvs_msg_type_name(m.type));
        NVS_SCHEDULER_MEMBERS(PRINT_MEMBER)
        printf(", \"unknown_words\": %" PRIu64, m.unknown_words);
        print_json_string("unknown_type", m.unknown_type);
        printf(", \"unknown\": [");
        for (unsigned bit = 0, n = 0; bit < 64; bit++) {
            const char *type, *key, *word;
            if (m.unknown_words >> bit & 1 && nvs_msg_unknown_word(&m, bit, &type, &key, &word) == 0)
                printf("%s[\"%s\", \"%s\", \"%s\"]", n++ ? ", " : "", type, key, word); /* words need no escaping */
        }
        printf("]}\n");
    }
    free(exact);
    free(data);
}

/* build TYPE [cap=N] KEY=HEX ...: the client message TYPE (any case) with these fields. */
#define LIST_STORAGE_DEVICES(name, detail) const char *name##_ids[MAX_LIST];
#define LIST_STORAGE_UINT(name, detail)
#define LIST_STORAGE_FLAG(name, detail)
#define LIST_STORAGE_HAS(name, detail)
#define LIST_STORAGE_TEXT(name, detail)
#define LIST_STORAGE_DEVICE(name, detail)
#define LIST_STORAGE_SESSION(name, detail)
#define LIST_STORAGE_WORD(name, detail)
#define LIST_STORAGE(storage, name, detail) LIST_STORAGE_##storage(name, detail)
#define LIST_ATTACH_DEVICES(name, detail) out.name = lists.name##_ids;
#define LIST_ATTACH_UINT(name, detail)
#define LIST_ATTACH_FLAG(name, detail)
#define LIST_ATTACH_HAS(name, detail)
#define LIST_ATTACH_TEXT(name, detail)
#define LIST_ATTACH_DEVICE(name, detail)
#define LIST_ATTACH_SESSION(name, detail)
#define LIST_ATTACH_WORD(name, detail)
#define LIST_ATTACH(storage, name, detail) LIST_ATTACH_##storage(name, detail)

#define SET_HAS_REQUIRED(member)
#define SET_HAS_OPTIONAL(member)
#define SET_HAS_NULLABLE(member) out.has_##member = 1;
#define SET_UINT(p, m) out.m = to_u64(value); SET_HAS_##p(m)
#define SET_FLAG(p, m) out.m = (int)to_number(value);
#define SET_TEXT(p, m) out.m = value;
#define SET_DEVICE(p, m) out.m = value;
#define SET_SESSION(p, m) out.m = value;
#define SET_WORD(p, m) out.m = value;
#define SET_DEVICES(p, m) if (out.n_##m < MAX_LIST) lists.m##_ids[out.n_##m++] = value;
#define SET_FIELD(T, k, kind, p, m, d, v) \
    else if (type == NVS_MSG_##T && strcmp(key, #k) == 0) { SET_##kind(p, m) }

static void command_build(char **tokens, int n_tokens)
{
    const char *name = n_tokens > 1 ? tokens[1] : "";
    char *values[MAX_TOKENS] = {0}; /* decoded values, freed at the end */
    struct { NVS_CLIENT_MEMBERS(LIST_STORAGE) } lists;
    struct nvs_out out = {0};
    enum nvs_msg_type type = NVS_MSG_NONE;
    size_t cap = 4096, len = 0, size;
    char *buf;

    for (int t = NVS_MSG_NONE + 1; t < NVS_MSG_UNKNOWN; t++)
        if (strcasecmp(name, nvs_msg_type_name((enum nvs_msg_type)t)) == 0)
            type = (enum nvs_msg_type)t;
    if (type == NVS_MSG_NONE)
        die("unknown message type");
    NVS_CLIENT_MEMBERS(LIST_ATTACH)
    for (int i = 2; i < n_tokens; i++) {
        char *eq = strchr(tokens[i], '=');
        if (!eq)
            die("build argument without '='");
        *eq = '\0';
        const char *key = tokens[i];
        if (strcmp(key, "cap") == 0) {
            cap = (size_t)to_u64(eq + 1);
            continue;
        }
        const char *value = values[i] = from_hex(eq + 1, &size);
        if (strlen(value) != size)
            die("a NUL byte cannot be passed through a C string");
        if (0) {
        }
        NVS_CLIENT_FIELDS(SET_FIELD)
        else die("not a field of this message");
    }
    /* Exactly `cap` bytes, so that a write past the end is caught by AddressSanitizer. */
    buf = malloc(cap ? cap : 1);
    if (!buf)
        die("out of memory");
    len = nvs_msg_build(buf, cap, type, &out);
    if (len == 0) {
        printf("invalid\n");
    } else {
        printf("built ");
        print_hex(buf, len);
        printf("\n");
    }
    free(buf);
    for (int i = 0; i < MAX_TOKENS; i++)
        free(values[i]);
}

static int script(void)
{
    struct nvs_transport t;
    char *line = NULL;
    size_t line_cap = 0;
    unsigned char msg[NVS_TRANSPORT_MAX_MESSAGE];

    nvs_transport_init(&t);
    while (getline(&line, &line_cap, stdin) > 0) {
        char *tokens[MAX_TOKENS], *save = NULL;
        int n = 0;
        for (char *tok = strtok_r(line, " \n", &save); tok && n < MAX_TOKENS;
             tok = strtok_r(NULL, " \n", &save))
            tokens[n++] = tok;
        if (n == 0)
            continue;
        const char *cmd = tokens[0], *arg1 = n > 1 ? tokens[1] : "", *arg2 = n > 2 ? tokens[2] : "";

        if (strcmp(cmd, "connect") == 0) {
            printf("rc %d\n", nvs_transport_connect(&t, arg1, (int)to_number(arg2)));
        } else if (strcmp(cmd, "fdflags") == 0) {
            int fd = nvs_transport_fd(&t);
            printf("fdflags %d %d\n", (fcntl(fd, F_GETFL) & O_NONBLOCK) != 0,
                   (fcntl(fd, F_GETFD) & FD_CLOEXEC) != 0);
        } else if (strcmp(cmd, "send") == 0) {
            size_t len;
            char *data = from_hex(arg1, &len);
            printf("rc %d\n", nvs_transport_send(&t, data, len, 5000));
            free(data);
        } else if (strcmp(cmd, "recv") == 0) {
            size_t cap = n > 2 ? (size_t)to_u64(arg2) : sizeof msg, len = 0;
            if (cap > sizeof msg)
                die("cap above the harness buffer");
            int rc = receive(&t, msg, cap, &len, (int)to_number(arg1));
            if (rc == 1) {
                printf("msg ");
                print_hex(msg, len);
                printf("\n");
            } else if (rc == 0) {
                printf("none\n");
            } else {
                printf("rc %d\n", rc);
            }
        } else if (strcmp(cmd, "serve") == 0) {
            int64_t deadline = now_ns() + to_number(arg1) * 1000000;
            int rc = 0, count = 0;
            for (int64_t left; rc >= 0 && (left = deadline - now_ns()) > 0;) {
                size_t len;
                rc = receive(&t, msg, sizeof msg, &len, (int)(left / 1000000) + 1);
                count += rc == 1;
            }
            if (rc < 0)
                printf("rc %d\n", rc);
            else
                printf("served %d\n", count);
        } else if (strcmp(cmd, "sleep") == 0) {
            usleep((useconds_t)to_number(arg1) * 1000);
            printf("slept\n");
        } else if (strcmp(cmd, "close") == 0) {
            nvs_transport_close(&t);
            printf("closed\n");
        } else if (strcmp(cmd, "parse") == 0) {
            command_parse(arg1);
        } else if (strcmp(cmd, "build") == 0) {
            command_build(tokens, n);
        } else {
            die("unknown command");
        }
        fflush(stdout);
    }
    free(line);
    nvs_transport_close(&t);
    return 0;
}

static int compare_ns(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Round trips of a typical client message (ACQUIRE) against an echoing ROUTER. */
static int bench(const char *path, int count)
{
    enum { WARMUP = 100 };
    struct nvs_transport t;
    char out[256], in[NVS_TRANSPORT_MAX_MESSAGE];
    size_t out_len, in_len;
    int64_t *samples = calloc((size_t)count, sizeof *samples), total = 0;
    int rc;

    if (!samples || count <= 0)
        die("bad count");
    out_len = nvs_msg_build(out, sizeof out, NVS_MSG_ACQUIRE,
                            &(struct nvs_out){.device = "GPU-5151ad00-0000-4000-8000-000000000000"});
    nvs_transport_init(&t);
    if ((rc = nvs_transport_connect(&t, path, 5000)) < 0) {
        fprintf(stderr, "connect: %d\n", rc);
        return 1;
    }
    for (int i = -WARMUP; i < count; i++) {
        int64_t start = now_ns();
        if ((rc = nvs_transport_send(&t, out, out_len, 5000)) < 0 ||
            (rc = receive(&t, in, sizeof in, &in_len, 5000)) != 1) {
            fprintf(stderr, "round trip %d: %d\n", i, rc);
            return 1;
        }
        if (in_len != out_len || memcmp(in, out, in_len) != 0)
            die("echo differs");
        if (i >= 0)
            total += samples[i] = now_ns() - start;
    }
    qsort(samples, (size_t)count, sizeof *samples, compare_ns);
    printf("{\"messages\": %d, \"mean_us\": %.1f, \"p50_us\": %.1f, \"p90_us\": %.1f, "
           "\"p99_us\": %.1f, \"max_us\": %.1f}\n",
           count, total / 1e3 / count, samples[count / 2] / 1e3, samples[count * 9 / 10] / 1e3,
           samples[count * 99 / 100] / 1e3, samples[count - 1] / 1e3);
    nvs_transport_close(&t);
    free(samples);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 2 && strcmp(argv[1], "script") == 0)
        return script();
    if (argc == 4 && strcmp(argv[1], "bench") == 0)
        return bench(argv[2], (int)to_number(argv[3]));
    fprintf(stderr, "usage: wire_harness script | wire_harness bench PATH N\n");
    return 2;
}
