/*
 * A ZMTP 3.1 client (NULL security mechanism, socket type DEALER) over a Unix stream socket:
 * just enough ZeroMQ to talk to the scheduler's pyzmq ROUTER without making the host process
 * depend on libzmq, and without disturbing a libzmq the application loads itself.
 *
 * Not thread-safe: the client thread owns a transport. No global state.
 */
#ifndef NVSHARE_TRANSPORT_H
#define NVSHARE_TRANSPORT_H

#include <stddef.h>
#include <stdint.h>

#define NVS_TRANSPORT_MAX_MESSAGE 4096

/* Private to transport.c; the caller only embeds it. */
struct nvs_transport {
    int fd; /* -1 while not connected */
    /* receive buffer: rx[rx_start, rx_len) was read but not yet consumed */
    unsigned char rx[2 * (NVS_TRANSPORT_MAX_MESSAGE + 16)];
    size_t rx_start, rx_len;
    uint64_t rx_skip;  /* bytes of a discarded frame still to be read and dropped */
    int rx_discarding; /* the frame being dropped had MORE set: drop its message's later frames */
};

/* Prepare an unconnected transport (fd = -1). */
void nvs_transport_init(struct nvs_transport *t);

/*
 * Connect to the Unix socket at `path` and complete the ZMTP handshake (greeting + READY),
 * waiting at most `timeout_ms` (> 0) in total. The descriptor is close-on-exec and non-blocking
 * afterwards. The handshake reads no byte beyond the peer's READY, so poll(fd) sees whatever
 * follows. Returns 0, or a negative errno: -ENOENT (no socket), -ECONNREFUSED (no listener),
 * -EACCES (no permission, or the peer answered with a ZMTP ERROR command), -ETIMEDOUT,
 * -EPROTO (a peer that does not speak ZMTP 3 with the NULL mechanism as a ROUTER or DEALER),
 * -ECONNRESET (the peer closed during the handshake), -ENAMETOOLONG (path over 107 bytes),
 * -EINVAL (empty path, timeout <= 0), -EISCONN (already connected), or what socket() gives.
 */
int nvs_transport_connect(struct nvs_transport *t, const char *path, int timeout_ms);

/* The descriptor to poll for input, or -1. */
int nvs_transport_fd(const struct nvs_transport *t);

/*
 * Send one single-frame message of `len` <= NVS_TRANSPORT_MAX_MESSAGE bytes. Waits (poll) until
 * it is fully written, at most `timeout_ms`. Never raises SIGPIPE. 0 or a negative errno
 * (-EPIPE / -ECONNRESET when the scheduler has gone, -ETIMEDOUT, -ENOTCONN; -EMSGSIZE or
 * -EINVAL for a bad argument, nothing sent).
 *
 * After any negative result from send or recv other than -EMSGSIZE/-EINVAL the stream may be
 * cut inside a frame: close the transport and connect again.
 */
int nvs_transport_send(struct nvs_transport *t, const void *msg, size_t len, int timeout_ms);

/*
 * Read whatever is available without blocking and extract at most one complete message into
 * `msg` (capacity `cap`). Returns 1 with *len set when a message was extracted, 0 when more
 * bytes are needed (poll the fd), or a negative errno when the connection is broken or the peer
 * violated the protocol (-EPIPE on orderly close, -ECONNRESET, -EPROTO, -ENOTCONN; -ETIMEDOUT
 * when a PONG could not be written within a second). ZMTP commands are handled inside: PING is
 * answered with PONG, others are ignored. Messages of several frames or over `cap` (or
 * NVS_TRANSPORT_MAX_MESSAGE) bytes are discarded without losing the messages that follow (the
 * scheduler never sends them). Call it again until it returns 0 before polling.
 */
int nvs_transport_recv(struct nvs_transport *t, void *msg, size_t cap, size_t *len);

/* Close the descriptor (if open) without sending anything; safe to call twice. */
void nvs_transport_close(struct nvs_transport *t);

#endif
