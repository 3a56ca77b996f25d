/*
 * The driver loader (loader.c): the real driver's functions, one slot per entry of the hook table
 * (hook_table.h), and the first line of every wrapper (NVS_REAL_OR_FAIL).
 */
#ifndef NVSHARE_LOADER_H
#define NVSHARE_LOADER_H

#include <stddef.h>

#include "compiler.h"
#include "cuda_types.h"
#include "hook_table.h"

/* The real driver's functions, resolved once from libcuda.so.1 (loader.c). A pointer stays
 * NULL when the installed driver lacks the symbol. Each slot is written once, with release
 * semantics, by the thread that loads the driver; read a slot that may not have been published
 * to the calling thread with NVS_REAL_OR_FAIL (acquire) or after nvs_real_load() returned 0. */
struct nvs_real_table {
#define NVS_REAL_FIELD(kind, name, params, args) CUresult(*name) params;
    NVS_FOR_EACH_HOOK(NVS_REAL_FIELD)
#undef NVS_REAL_FIELD
#define NVS_REAL_ONLY_FIELD(name, params) CUresult(*name) params;
    NVS_FOR_EACH_REAL(NVS_REAL_ONLY_FIELD)
#undef NVS_REAL_ONLY_FIELD
};

extern struct nvs_real_table nvs_real;

/* Resolve the real driver once (dlopen libcuda.so.1). Cheap after the first call. Returns 0
 * when the driver could be loaded. Safe before cuInit and from any thread. */
int nvs_real_load(void);
/* nvs_real_load(), but only if the process has loaded libcuda.so.1 itself (-1 otherwise). */
int nvs_real_load_if_present(void);
/* The slot of nvs_real at `offset` (offsetof(struct nvs_real_table, name)), loaded with acquire. */
void *nvs_real_slot(size_t offset);

/* The name of a CUDA error for messages ("an unknown CUDA error" where the driver cannot say);
 * after nvs_real_load() returned 0. */
const char *nvs_real_error_name(CUresult r);

typedef void *(*nvs_dlsym_fn)(void *, const char *);
/* glibc's dlsym (the one after libnvshare's), found with dlvsym. */
nvs_dlsym_fn nvs_real_dlsym(void);

/* First line of every wrapper: the error a caller expects when the driver cannot be loaded, or
 * when the installed driver lacks this entry point. Checks the pointer first: once the driver
 * is loaded this is one load (acquire: it pairs with the loader's release store, so the thread
 * sees what the loading thread wrote before it) and one branch. */
#define NVS_REAL_OR_FAIL(name)                                                                  \
    do {                                                                                        \
        if (NVS_UNLIKELY(__atomic_load_n(&nvs_real.name, __ATOMIC_ACQUIRE) == NULL) &&          \
            nvs_real_load() != 0)                                                               \
            return CUDA_ERROR_NOT_INITIALIZED;                                                  \
        if (NVS_UNLIKELY(nvs_real.name == NULL)) return CUDA_ERROR_NOT_FOUND;                   \
    } while (0)

#endif
