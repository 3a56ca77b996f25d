/*
 * ZMTP 3.1 client (RFC 23 and RFC 37), NULL mechanism, socket type DEALER, over a Unix stream
 * socket. Only libc: the interceptor lives inside processes that may load their own libzmq.
 *
 * Wire facts used here:
 *   greeting  64 bytes: 0xFF, 8 padding bytes, 0x7F, version major/minor, mechanism name padded
 *             with NULs to 20 bytes, as-server, 31 filler bytes;
 *   frame     flags (bit 0 MORE, bit 1 LONG = 8-byte size, bit 2 COMMAND, others zero), size
 *             (1 byte, or 8 bytes big-endian), body;
 *   command   body = name length (1 byte), name, data;
 *   READY     data = properties: name length (1 byte), name, value length (4 bytes BE), value;
 *   PING      data = TTL (2 bytes), context (0-16 bytes); answered by PONG with the context.
 */
#define _GNU_SOURCE
#include "transport.h"

#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <strings.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

enum {
    GREETING_SIZE = 64,
    SIGNATURE_SIZE = 10,
    MECHANISM_OFFSET = 12,
    MECHANISM_SIZE = 20,
    FLAG_MORE = 0x01,
    FLAG_LONG = 0x02,
    FLAG_COMMAND = 0x04,
    FLAGS_RESERVED = 0xf8,
    SHORT_HEADER = 2,
    LONG_HEADER = 9,
    PING_TTL_SIZE = 2,
    PING_CONTEXT_MAX = 16,
    /* The scheduler reads its sockets eagerly; a PONG that cannot be written within this time
     * means a hung scheduler, and the caller reconnects. */
    PONG_TIMEOUT_MS = 1000,
};

/* Our greeting: ZMTP 3.1, mechanism NULL, as-server 0, every other byte zero. */
static const unsigned char client_greeting[GREETING_SIZE] = {
    [0] = 0xff, [9] = 0x7f, [10] = 3, [11] = 1, [12] = 'N', [13] = 'U', [14] = 'L', [15] = 'L',
};

/* READY with Socket-Type DEALER and no Identity, so that the ROUTER assigns a routing id. */
static const unsigned char client_ready[] = {
    FLAG_COMMAND, 28,
    5, 'R', 'E', 'A', 'D', 'Y',
    11, 'S', 'o', 'c', 'k', 'e', 't', '-', 'T', 'y', 'p', 'e',
    0, 0, 0, 6, 'D', 'E', 'A', 'L', 'E', 'R',
};
_Static_assert(sizeof client_ready == SHORT_HEADER + 28, "READY frame size byte");

/* ---- time and blocking helpers -------------------------------------------------------------- */

static int64_t now_ms(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int remaining_ms(int64_t deadline)
{
    int64_t left = deadline - now_ms();

    if (left < 0)
        return 0;
    return left > INT_MAX ? INT_MAX : (int)left;
}

/* Wait until fd is ready for `events` (or has an error/hangup, which the next call reports). */
static int wait_fd(int fd, short events, int64_t deadline)
{
    for (;;) {
        struct pollfd pfd = {.fd = fd, .events = events};
        int n = poll(&pfd, 1, remaining_ms(deadline));
        if (n > 0)
            return 0;
        if (n == 0)
            return -ETIMEDOUT;
        if (errno != EINTR)
            return -errno;
    }
}

/* Write every byte of iov[0..count) on a non-blocking descriptor before the deadline. */
static int write_all(int fd, struct iovec *iov, int count, int64_t deadline)
{
    while (count > 0) {
        struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)count};
        ssize_t n = sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                int rc = wait_fd(fd, POLLOUT, deadline);
                if (rc < 0)
                    return rc;
                continue;
            }
            return -errno;
        }
        while (count > 0 && (size_t)n >= iov->iov_len) {
            n -= (ssize_t)iov->iov_len;
            iov++;
            count--;
        }
        if (count > 0) {
            iov->iov_base = (char *)iov->iov_base + n;
            iov->iov_len -= (size_t)n;
        }
    }
    return 0;
}

/* Read exactly n bytes before the deadline (handshake only: it must not read ahead). */
static int read_exact(int fd, unsigned char *buf, size_t n, int64_t deadline)
{
    while (n > 0) {
        ssize_t got = read(fd, buf, n);
        if (got > 0) {
            buf += got;
            n -= (size_t)got;
        } else if (got == 0) {
            return -ECONNRESET;
        } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
            int rc = wait_fd(fd, POLLIN, deadline);
            if (rc < 0)
                return rc;
        } else if (errno != EINTR) {
            return -errno;
        }
    }
    return 0;
}

static uint64_t load_be(const unsigned char *p, size_t n)
{
    uint64_t value = 0;

    for (size_t i = 0; i < n; i++)
        value = value << 8 | p[i];
    return value;
}

/* ---- connect and handshake ---------------------------------------------------------------- */

/*
 * A blocking connect bounded by SO_SNDTIMEO: a Unix stream connect only waits while the
 * listener's backlog is full, and then reports EAGAIN when the time is up. (A non-blocking
 * connect would fail with EAGAIN at once and leave us to poll by sleeping.)
 */
static int connect_until(int fd, const struct sockaddr_un *addr, int64_t deadline)
{
    for (;;) {
        int left = remaining_ms(deadline);
        struct timeval tv = {.tv_sec = left / 1000, .tv_usec = (left % 1000) * 1000};

        if (left == 0)
            return -ETIMEDOUT; /* a zero SO_SNDTIMEO would mean "wait forever" */
        if (setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) < 0)
            return -errno;
        if (connect(fd, (const struct sockaddr *)addr, sizeof *addr) == 0)
            return 0;
        if (errno == EINTR)
            continue;
        if (errno == EISCONN)
            return 0; /* an interrupted attempt had completed */
        if (errno == EAGAIN)
            return -ETIMEDOUT;
        return -errno;
    }
}

/* Check the peer's greeting piece by piece, so that a stranger is told apart without waiting
 * for 64 bytes it may never send. */
static int read_greeting(int fd, unsigned char *greeting, int64_t deadline)
{
    static const unsigned char null_mechanism[MECHANISM_SIZE] = {'N', 'U', 'L', 'L'};
    int rc;

    if ((rc = read_exact(fd, greeting, 1, deadline)) < 0)
        return rc;
    if (greeting[0] != 0xff)
        return -EPROTO;
    if ((rc = read_exact(fd, greeting + 1, SIGNATURE_SIZE - 1, deadline)) < 0)
        return rc;
    if (!(greeting[9] & 0x01)) /* ZMTP 1.0 peer */
        return -EPROTO;
    if ((rc = read_exact(fd, greeting + SIGNATURE_SIZE, 1, deadline)) < 0)
        return rc;
    if (greeting[SIGNATURE_SIZE] < 3) /* ZMTP 2.0 or older */
        return -EPROTO;
    if ((rc = read_exact(fd, greeting + SIGNATURE_SIZE + 1, GREETING_SIZE - SIGNATURE_SIZE - 1,
                         deadline)) < 0)
        return rc;
    if (memcmp(greeting + MECHANISM_OFFSET, null_mechanism, MECHANISM_SIZE) != 0)
        return -EPROTO;
    return 0;
}

/* Read one command frame of the handshake into buf; body and size describe its body. */
static int read_command(int fd, unsigned char *buf, size_t cap, const unsigned char **body,
                        size_t *size, int64_t deadline)
{
    uint64_t frame_size;
    size_t header = SHORT_HEADER;
    int rc;

    if ((rc = read_exact(fd, buf, SHORT_HEADER, deadline)) < 0)
        return rc;
    if ((buf[0] & ~FLAG_LONG) != FLAG_COMMAND)
        return -EPROTO;
    if (buf[0] & FLAG_LONG) {
        header = LONG_HEADER;
        if ((rc = read_exact(fd, buf + SHORT_HEADER, LONG_HEADER - SHORT_HEADER, deadline)) < 0)
            return rc;
    }
    frame_size = load_be(buf + 1, header - 1);
    if (frame_size > cap - header)
        return -EPROTO;
    if ((rc = read_exact(fd, buf + header, (size_t)frame_size, deadline)) < 0)
        return rc;
    *body = buf + header;
    *size = (size_t)frame_size;
    return 0;
}

static int name_is(const unsigned char *name, size_t len, const char *expected)
{
    return len == strlen(expected) && memcmp(name, expected, len) == 0;
}

static int name_is_nocase(const unsigned char *name, size_t len, const char *expected)
{
    return len == strlen(expected) && strncasecmp((const char *)name, expected, len) == 0;
}

/* The peer's READY must name a socket type a DEALER may talk to. ERROR means it refused us. */
static int check_ready(const unsigned char *body, size_t size)
{
    size_t name_len, pos;
    int socket_type_ok = 0;

    if (size < 1 || (name_len = body[0]) > size - 1)
        return -EPROTO;
    if (name_is(body + 1, name_len, "ERROR"))
        return -EACCES;
    if (!name_is(body + 1, name_len, "READY"))
        return -EPROTO;
    for (pos = 1 + name_len; pos < size;) {
        size_t key_len = body[pos], value_len;
        const unsigned char *key = body + pos + 1, *value;

        if (key_len == 0 || key_len > size - pos - 1 || size - pos - 1 - key_len < 4)
            return -EPROTO;
        value_len = (size_t)load_be(key + key_len, 4);
        value = key + key_len + 4;
        if (value_len > size - (size_t)(value - body))
            return -EPROTO;
        if (name_is_nocase(key, key_len, "Socket-Type")) {
            if (!name_is(value, value_len, "ROUTER") && !name_is(value, value_len, "DEALER"))
                return -EPROTO;
            socket_type_ok = 1;
        }
        pos = (size_t)(value - body) + value_len;
    }
    return socket_type_ok ? 0 : -EPROTO;
}

static int handshake(struct nvs_transport *t, int fd, int64_t deadline)
{
    /* The whole greeting and READY go at once: with the NULL mechanism nothing we send depends
     * on the peer's greeting, and libzmq reads our greeting in its own steps. */
    struct iovec out[2] = {
        {.iov_base = (void *)client_greeting, .iov_len = sizeof client_greeting},
        {.iov_base = (void *)client_ready, .iov_len = sizeof client_ready},
    };
    const unsigned char *body;
    size_t size;
    int rc;

    /* Closed on us (EPIPE): what the scheduler wrote first is read all the same, since a
     * scheduler without a place for this connection answers the handshake and says why (ERROR
     * too-many-connections) before it closes; the first send then fails, after that is read. */
    if ((rc = write_all(fd, out, 2, deadline)) < 0 && rc != -EPIPE)
        return rc;
    if ((rc = read_greeting(fd, t->rx, deadline)) < 0)
        return rc;
    if ((rc = read_command(fd, t->rx, sizeof t->rx, &body, &size, deadline)) < 0)
        return rc;
    return check_ready(body, size);
}

static void reset_receiver(struct nvs_transport *t)
{
    t->rx_start = t->rx_len = 0;
    t->rx_skip = 0;
    t->rx_discarding = 0;
}

void nvs_transport_init(struct nvs_transport *t)
{
    t->fd = -1;
    reset_receiver(t);
}

int nvs_transport_connect(struct nvs_transport *t, const char *path, int timeout_ms)
{
    struct sockaddr_un addr;
    size_t path_len;
    int64_t deadline;
    int fd, rc, non_blocking = 1;

    if (t->fd >= 0)
        return -EISCONN;
    if (!path || !*path || timeout_ms <= 0)
        return -EINVAL;
    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    path_len = strlen(path);
    if (path_len >= sizeof addr.sun_path)
        return -ENAMETOOLONG;
    memcpy(addr.sun_path, path, path_len + 1);

    deadline = now_ms() + timeout_ms;
    /* Close-on-exec from the start: another thread of the application may fork and exec. */
    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -errno;
    rc = connect_until(fd, &addr, deadline);
    /* From here on every wait is a poll with its own deadline (SO_SNDTIMEO is moot). FIONBIO
     * rather than fcntl: with _FILE_OFFSET_BITS=64, glibc >= 2.28 binds fcntl to fcntl64,
     * which older C libraries lack. */
    if (rc == 0 && ioctl(fd, FIONBIO, &non_blocking) < 0)
        rc = -errno;
    if (rc == 0)
        rc = handshake(t, fd, deadline);
    if (rc < 0) {
        close(fd);
        return rc;
    }
    t->fd = fd;
    reset_receiver(t);
    return 0;
}

int nvs_transport_fd(const struct nvs_transport *t)
{
    return t->fd;
}

int nvs_transport_send(struct nvs_transport *t, const void *msg, size_t len, int timeout_ms)
{
    unsigned char header[LONG_HEADER];
    struct iovec iov[2];

    if (t->fd < 0)
        return -ENOTCONN;
    if (len > NVS_TRANSPORT_MAX_MESSAGE)
        return -EMSGSIZE;
    if ((!msg && len > 0) || timeout_ms < 0)
        return -EINVAL;
    if (len <= UINT8_MAX) {
        header[0] = 0;
        header[1] = (unsigned char)len;
        iov[0].iov_len = SHORT_HEADER;
    } else {
        header[0] = FLAG_LONG;
        for (int i = 0; i < 8; i++)
            header[1 + i] = (unsigned char)((uint64_t)len >> (56 - 8 * i));
        iov[0].iov_len = LONG_HEADER;
    }
    iov[0].iov_base = header;
    iov[1].iov_base = (void *)msg;
    iov[1].iov_len = len;
    return write_all(t->fd, iov, 2, now_ms() + timeout_ms);
}

/* ---- receiving -------------------------------------------------------------------------------- */

static int send_pong(struct nvs_transport *t, const unsigned char *context, size_t context_len)
{
    unsigned char frame[SHORT_HEADER + 5 + PING_CONTEXT_MAX] = {
        FLAG_COMMAND, (unsigned char)(5 + context_len), 4, 'P', 'O', 'N', 'G',
    };
    struct iovec iov = {.iov_base = frame, .iov_len = SHORT_HEADER + 5 + context_len};

    memcpy(frame + SHORT_HEADER + 5, context, context_len);
    return write_all(t->fd, &iov, 1, now_ms() + PONG_TIMEOUT_MS);
}

static int handle_command(struct nvs_transport *t, const unsigned char *body, size_t size)
{
    size_t name_len, context_len;

    if (size < 1 || (name_len = body[0]) > size - 1)
        return -EPROTO;
    if (!name_is(body + 1, name_len, "PING"))
        return 0; /* nothing else a ROUTER sends to a DEALER concerns us */
    if (size - 1 - name_len < PING_TTL_SIZE)
        return -EPROTO;
    /* Like libzmq, echo at most the 16 context bytes the RFC allows. */
    context_len = size - 1 - name_len - PING_TTL_SIZE;
    if (context_len > PING_CONTEXT_MAX)
        context_len = PING_CONTEXT_MAX;
    return send_pong(t, body + 1 + name_len + PING_TTL_SIZE, context_len);
}

/*
 * Take what the buffer holds: 1 = a message was copied out, 0 = more bytes are needed,
 * negative = a protocol violation or a failed PONG.
 */
static int extract(struct nvs_transport *t, void *msg, size_t cap, size_t *len)
{
    size_t limit = cap < NVS_TRANSPORT_MAX_MESSAGE ? cap : NVS_TRANSPORT_MAX_MESSAGE;

    for (;;) {
        size_t avail = t->rx_len - t->rx_start, header;
        const unsigned char *frame = t->rx + t->rx_start;
        uint64_t size;
        unsigned char flags;

        if (t->rx_skip > 0) {
            size_t n = t->rx_skip < avail ? (size_t)t->rx_skip : avail;
            t->rx_start += n;
            t->rx_skip -= n;
            if (t->rx_skip > 0)
                return 0;
            continue;
        }
        if (avail < SHORT_HEADER)
            return 0;
        flags = frame[0];
        if (flags & FLAGS_RESERVED)
            return -EPROTO;
        if ((flags & FLAG_COMMAND) && (flags & FLAG_MORE))
            return -EPROTO;
        header = (flags & FLAG_LONG) ? LONG_HEADER : SHORT_HEADER;
        if (avail < header)
            return 0;
        size = load_be(frame + 1, header - 1);
        if (size > INT64_MAX)
            return -EPROTO;

        if (flags & FLAG_COMMAND) {
            if (size > NVS_TRANSPORT_MAX_MESSAGE) { /* no command we act on is this large */
                t->rx_start += header;
                t->rx_skip = size;
                continue;
            }
            if (avail - header < size)
                return 0;
            t->rx_start += header + (size_t)size;
            int rc = handle_command(t, frame + header, (size_t)size);
            if (rc < 0)
                return rc;
            continue;
        }
        if (t->rx_discarding || (flags & FLAG_MORE) || size > limit) {
            /* Not a message of ours: drop this frame, and the rest of its message if MORE. */
            t->rx_discarding = (flags & FLAG_MORE) != 0;
            t->rx_start += header;
            t->rx_skip = size;
            continue;
        }
        if (avail - header < size)
            return 0;
        if (size > 0)
            memcpy(msg, frame + header, (size_t)size);
        *len = (size_t)size;
        t->rx_start += header + (size_t)size;
        return 1;
    }
}

int nvs_transport_recv(struct nvs_transport *t, void *msg, size_t cap, size_t *len)
{
    if (t->fd < 0)
        return -ENOTCONN;
    if ((!msg && cap > 0) || !len)
        return -EINVAL;
    for (;;) {
        ssize_t got;
        int rc = extract(t, msg, cap, len);
        if (rc != 0)
            return rc;
        /* Make room: everything unconsumed moves to the front. A frame we keep is at most
         * LONG_HEADER + NVS_TRANSPORT_MAX_MESSAGE bytes, so it always fits once moved. */
        if (t->rx_start > 0) {
            memmove(t->rx, t->rx + t->rx_start, t->rx_len - t->rx_start);
            t->rx_len -= t->rx_start;
            t->rx_start = 0;
        }
        got = read(t->fd, t->rx + t->rx_len, sizeof t->rx - t->rx_len);
        if (got > 0)
            t->rx_len += (size_t)got;
        else if (got == 0)
            return -EPIPE;
        else if (errno == EAGAIN || errno == EWOULDBLOCK)
            return 0;
        else if (errno != EINTR)
            return -errno;
    }
}

void nvs_transport_close(struct nvs_transport *t)
{
    if (t->fd >= 0) {
        /* No retry on EINTR: on Linux the descriptor is released whatever close() reports. */
        close(t->fd);
        t->fd = -1;
    }
    reset_receiver(t);
}
