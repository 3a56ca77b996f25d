/* Diagnostics on stderr, one write() per line so lines of concurrent threads never mix. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "log.h"

/* Written once by nvs_config_load, inside its pthread_once, which the loader runs before the
 * driver table is published (release): every thread that reached a wrapper reads the final value
 * (NVML wrappers are handed out only after nvs_config_load returned, nvml.c). */
int nvs_log_level = NVS_LOG_WARN;

void nvs_log(int level, const char *fmt, ...) {
    if (level > nvs_log_level) return;
    static const char *const names[] = {"error", "warning", "info", "debug"};
    int saved_errno = errno;
    char line[1024];
    int n = snprintf(line, sizeof line, "nvshare[%ld]: %s: ", (long)getpid(), names[level]);
    if (level == NVS_LOG_DEBUG) { /* the wall-clock time, as the scheduler's events say it, to line them up */
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        n += snprintf(line + n, sizeof line - (size_t)n, "[%ld.%06ld] ", (long)ts.tv_sec, ts.tv_nsec / 1000);
    }
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
    va_end(ap);
    size_t len = (size_t)n + (m < 0 ? 0 : (size_t)m);
    if (len > sizeof line - 2) len = sizeof line - 2;
    line[len++] = '\n';
    ssize_t ignored = write(STDERR_FILENO, line, len);
    (void)ignored;
    errno = saved_errno;
}

double nvs_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}
