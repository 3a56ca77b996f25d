/*
 * A scheduler client for benchmarks that speaks the protocol exactly as libnvshare.so does:
 * the interceptor's own transport (ZMTP over the Unix socket, no libzmq) and message codec.
 *
 *   lock_client SOCKET DEVICE
 *
 * Registers, announces DEVICE, prints "ready", then obeys commands on stdin (heart-beating
 * while it waits for them):
 *   uncontended N                       N x (ACQUIRE -> GRANT, RELEASE); prints one line
 *                                       "samples NS..." of acquire -> grant latencies
 *   handoff START_NS SECONDS HOLD_US    from START_NS (CLOCK_MONOTONIC) loop ACQUIRE -> GRANT,
 *                                       hold, RELEASE for SECONDS; prints one line
 *                                       "records ASKED,GRANTED,RELEASED ..." (ns)
 *   exit
 */
#define _GNU_SOURCE
#include "message.h"
#include "transport.h"

#include <inttypes.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static struct nvs_transport link_;
static const char *device;
static char buf[NVS_TRANSPORT_MAX_MESSAGE + 1];

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void fail(const char *what, int code) {
    fprintf(stderr, "lock_client: %s (%d)\n", what, code);
    exit(1);
}

static void send_message(size_t len) {
    if (len == 0) fail("message does not fit", 0);
    int r = nvs_transport_send(&link_, buf, len, 5000);
    if (r < 0) fail("send failed", r);
}

/* Wait for the next scheduler message of `type` (others are skipped); 0 on timeout. */
static int wait_for(enum nvs_msg_type type, struct nvs_msg *msg, int timeout_ms) {
    int64_t deadline = now_ns() + (int64_t)timeout_ms * 1000000;
    for (;;) {
        size_t len = 0;
        int r = nvs_transport_recv(&link_, buf, sizeof buf - 1, &len);
        if (r < 0) fail("receive failed", r);
        if (r == 1) {
            if (nvs_msg_parse(buf, len, msg) == 0 && msg->type == type) return 1;
            continue;
        }
        int64_t left = (deadline - now_ns()) / 1000000;
        if (left <= 0) return 0;
        struct pollfd pfd = {.fd = nvs_transport_fd(&link_), .events = POLLIN};
        poll(&pfd, 1, (int)left);
    }
}

static uint64_t acquire(void) {
    struct nvs_msg msg;
    send_message(nvs_msg_build(buf, sizeof buf, NVS_MSG_ACQUIRE, &(struct nvs_out){.device = device}));
    for (;;) {
        if (!wait_for(NVS_MSG_GRANT, &msg, 600000)) fail("no GRANT within 600 s", 0);
        if (strcmp(msg.device, device) == 0) return msg.grant;
    }
}

static void release(uint64_t grant) {
    send_message(nvs_msg_build(buf, sizeof buf, NVS_MSG_RELEASE, &(struct nvs_out){.device = device, .grant = grant}));
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: lock_client SOCKET DEVICE\n");
        return 2;
    }
    device = argv[2];
    nvs_transport_init(&link_);
    int r = nvs_transport_connect(&link_, argv[1], 10000);
    if (r < 0) fail("connect failed", r);
    char session[NVS_SESSION_DIGITS + 1];
    snprintf(session, sizeof session, "%016" PRIx64, (uint64_t)now_ns() ^ ((uint64_t)getpid() << 40));
    send_message(nvs_msg_build(buf, sizeof buf, NVS_MSG_HELLO,
                               &(struct nvs_out){.pid = (uint64_t)getpid(), .session = session, .program = "lock_client"}));
    struct nvs_msg welcome;
    if (!wait_for(NVS_MSG_WELCOME, &welcome, 10000)) fail("no WELCOME", 0);
    send_message(nvs_msg_build(buf, sizeof buf, NVS_MSG_DEVICE,
                               &(struct nvs_out){.device = device, .total = 80ULL << 30, .name = "benchmark"}));
    printf("ready\n");
    fflush(stdout);

    char line[256];
    for (;;) {
        /* Idle: wait for a command, heart-beating as the scheduler asked. */
        struct pollfd fds[2] = {{.fd = 0, .events = POLLIN}, {.fd = nvs_transport_fd(&link_), .events = POLLIN}};
        if (poll(fds, 2, (int)welcome.heartbeat_ms) == 0 || !(fds[0].revents & POLLIN)) {
            size_t len;
            while (nvs_transport_recv(&link_, buf, sizeof buf - 1, &len) == 1) {
            }
            send_message(nvs_msg_build(buf, sizeof buf, NVS_MSG_HEARTBEAT, &(struct nvs_out){0}));
            continue;
        }
        if (!fgets(line, sizeof line, stdin)) return 0;
        long long n, start, hold_us;
        double seconds;
        if (sscanf(line, "uncontended %lld", &n) == 1) {
            printf("samples");
            for (long long i = 0; i < n; i++) {
                int64_t asked = now_ns();
                uint64_t grant = acquire();
                printf(" %" PRId64, now_ns() - asked);
                release(grant);
            }
            printf("\n");
        } else if (sscanf(line, "handoff %lld %lf %lld", &start, &seconds, &hold_us) == 3) {
            while (now_ns() < start) usleep(200);
            int64_t end = start + (int64_t)(seconds * 1e9);
            printf("records");
            for (;;) {
                int64_t asked = now_ns();
                uint64_t grant = acquire();
                int64_t granted = now_ns();
                if (hold_us > 0) {
                    struct timespec hold = {hold_us / 1000000, (hold_us % 1000000) * 1000};
                    nanosleep(&hold, NULL);
                }
                int64_t released = now_ns();
                release(grant);
                printf(" %" PRId64 ",%" PRId64 ",%" PRId64, asked, granted, released);
                if (released > end) break;
            }
            printf("\n");
        } else if (strncmp(line, "exit", 4) == 0) {
            send_message(nvs_msg_build(buf, sizeof buf, NVS_MSG_BYE, &(struct nvs_out){0}));
            return 0;
        } else {
            fail("unknown command", 0);
        }
        fflush(stdout);
    }
}
