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
 *   parse [HEX]                  -> parsed {JSON} | rejected
 *   build TYPE [cap=N] KEY=HEX.. -> built HEX | invalid   (TYPE: hello device memory acquire
 *                                   release evicted heartbeat bye; held=/wanted= may repeat)
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
#include <time.h>
#include <unistd.h>

#define MAX_TOKENS 80
#define MAX_LIST 64

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

static void print_json_hex(const char *key, const char *value)
{
    printf(", \"%s\": \"", key);
    print_hex(value, strlen(value));
    printf("\"");
}

static void command_parse(const char *hex)
{
    static const char *const type_names[] = {"", "WELCOME", "GRANT", "DROP", "REVOKE", "MODE", "ERROR",
                                             "CONTENDED", "STATUS", "ADMITTED", "REFUSED", "EVICT"};
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
        printf("parsed {\"type\": \"%s\"", type_names[m.type]);
        print_json_hex("device", m.device);
        printf(", \"grant\": %" PRIu64, m.grant);
        printf(", \"quantum_ms\": %" PRIu64 ", \"quantum_left_ms\": %" PRIu64, m.quantum_ms, m.quantum_left_ms);
        printf(", \"heartbeat_ms\": %" PRIu64 ", \"idle_release_ms\": %" PRIu64, m.heartbeat_ms,
               m.idle_release_ms);
        print_json_hex("client", m.client);
        print_json_hex("reason", m.reason);
        print_json_hex("code", m.code);
        print_json_hex("detail", m.detail);
        print_json_hex("error_type", m.error_type);
        printf(", \"prefetch\": %" PRIu64 ", \"evict\": %" PRIu64, m.prefetch_bytes, m.evict_bytes);
        printf("}\n");
    }
    free(exact);
    free(data);
}

/* build TYPE [cap=N] KEY=HEX ... */
static void command_build(char **tokens, int n_tokens)
{
    const char *type = n_tokens > 1 ? tokens[1] : "";
    char *values[MAX_TOKENS] = {0}; /* decoded values, freed at the end */
    const char *held[MAX_LIST], *wanted[MAX_LIST];
    const char *pid = NULL, *session = NULL, *device = NULL, *number = NULL, *reason = NULL;
    const char *name = NULL, *resident = NULL;
    uint64_t resident_bytes = 0;
    struct nvs_hello hello = {0};
    size_t cap = 4096, len = 0, size;
    char *buf;

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
        char *value = values[i] = from_hex(eq + 1, &size);
        if (strlen(value) != size)
            die("a NUL byte cannot be passed through a C string");
        if (strcmp(key, "pid") == 0)
            pid = value;
        else if (strcmp(key, "session") == 0)
            session = value;
        else if (strcmp(key, "host") == 0)
            hello.host = value;
        else if (strcmp(key, "container") == 0)
            hello.container = value;
        else if (strcmp(key, "pod") == 0)
            hello.pod = value;
        else if (strcmp(key, "namespace") == 0)
            hello.namespace_ = value;
        else if (strcmp(key, "program") == 0)
            hello.program = value;
        else if (strcmp(key, "name") == 0)
            name = value;
        else if (strcmp(key, "held") == 0 && hello.n_held < MAX_LIST)
            held[hello.n_held++] = value;
        else if (strcmp(key, "wanted") == 0 && hello.n_wanted < MAX_LIST)
            wanted[hello.n_wanted++] = value;
        else if (strcmp(key, "device") == 0)
            device = value;
        else if (strcmp(key, "total") == 0 || strcmp(key, "used") == 0 || strcmp(key, "grant") == 0)
            number = value;
        else if (strcmp(key, "reason") == 0)
            reason = value;
        else if (strcmp(key, "resident") == 0)
            resident = value;
        else
            die("unknown build argument");
    }
    hello.held = held;
    hello.wanted = wanted;
    /* Exactly `cap` bytes, so that a write past the end is caught by AddressSanitizer. */
    buf = malloc(cap ? cap : 1);
    if (!buf)
        die("out of memory");
    if (resident)
        resident_bytes = to_u64(resident);

    if (strcmp(type, "hello") == 0) {
        hello.pid = pid ? (long)to_number(pid) : 0;
        /* Copied without forcing a terminator: a 17-character session fills the array. */
        if (session)
            memcpy(hello.session, session,
                   strlen(session) < sizeof hello.session ? strlen(session) : sizeof hello.session);
        len = nvs_msg_hello(buf, cap, &hello);
    } else if (strcmp(type, "device") == 0) {
        len = nvs_msg_device(buf, cap, device, number ? to_u64(number) : 0, name);
    } else if (strcmp(type, "memory") == 0) {
        len = nvs_msg_memory(buf, cap, device, number ? to_u64(number) : 0, resident ? &resident_bytes : NULL, NULL);
    } else if (strcmp(type, "acquire") == 0) {
        len = nvs_msg_acquire(buf, cap, device);
    } else if (strcmp(type, "release") == 0) {
        len = nvs_msg_release(buf, cap, device, number ? to_u64(number) : 0, reason,
                              resident ? &resident_bytes : NULL);
    } else if (strcmp(type, "evicted") == 0) {
        len = nvs_msg_evicted(buf, cap, device, resident_bytes);
    } else if (strcmp(type, "heartbeat") == 0) {
        len = nvs_msg_heartbeat(buf, cap);
    } else if (strcmp(type, "bye") == 0) {
        len = nvs_msg_bye(buf, cap);
    } else {
        die("unknown message type");
    }
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
    out_len = nvs_msg_acquire(out, sizeof out, "GPU-5151ad00-0000-4000-8000-000000000000");
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
