/*
 * The compiler's help every unit of libnvshare.so may use. Nothing here is exported: the library
 * is built with -fvisibility=hidden and only the hooks (NVS_EXPORT) and dlsym leave it.
 */
#ifndef NVSHARE_COMPILER_H
#define NVSHARE_COMPILER_H

#define NVS_EXPORT __attribute__((visibility("default")))
#define NVS_LIKELY(x) __builtin_expect(!!(x), 1)
#define NVS_UNLIKELY(x) __builtin_expect(!!(x), 0)

#endif
