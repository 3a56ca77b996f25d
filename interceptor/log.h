/*
 * Diagnostics on stderr (log.c) and the monotonic clock the shells read.
 */
#ifndef NVSHARE_LOG_H
#define NVSHARE_LOG_H

#include "compiler.h"

enum nvs_log_level { NVS_LOG_ERROR = 0, NVS_LOG_WARN = 1, NVS_LOG_INFO = 2, NVS_LOG_DEBUG = 3 };

/* Written by nvs_config_load only; read everywhere. */
extern int nvs_log_level;
void nvs_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
#define nvs_error(...) nvs_log(NVS_LOG_ERROR, __VA_ARGS__)
#define nvs_warn(...) nvs_log(NVS_LOG_WARN, __VA_ARGS__)
#define nvs_info(...) nvs_log(NVS_LOG_INFO, __VA_ARGS__)
#define nvs_debug(...)                                                                          \
    do {                                                                                        \
        if (NVS_UNLIKELY(nvs_log_level >= NVS_LOG_DEBUG)) nvs_log(NVS_LOG_DEBUG, __VA_ARGS__);  \
    } while (0)

/* Monotonic seconds. */
double nvs_now(void);

#endif
