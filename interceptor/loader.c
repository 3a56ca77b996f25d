/*
 * The driver loader: finds the real libcuda.so.1 and the real dlsym, and fills nvs_real with the
 * driver's own functions. It knows the names of the hooks (hook_table.h's X-macro list) but not the
 * wrappers: swapping a driver address for a wrapper is hooks.c's business. Nothing here calls
 * into the rest of libnvshare except configuration and the fork handlers it registers.
 *
 * Publication: load_driver() stores every slot of nvs_real with release semantics and last
 * load_state (release). NVS_REAL_OR_FAIL reads a slot with acquire semantics, so a thread that
 * sees a non-NULL slot also sees everything the loading thread wrote before it (the other slots,
 * the configuration). On x86-64 both are plain moves; on aarch64 an LDAR: the fast path stays
 * one load and one branch.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>

#include "compiler.h"
#include "config.h"
#include "hook_table.h"
#include "loader.h"
#include "log.h"
#include "notify.h"

/* Written once by load_driver (each slot stored with release), read everywhere. */
struct nvs_real_table nvs_real;

static const struct {
    const char *name;
    size_t offset;
} driver_symbols[] = {
#define NVS_HOOK_SLOT(kind, name, params, args) {#name, offsetof(struct nvs_real_table, name)},
    NVS_FOR_EACH_HOOK(NVS_HOOK_SLOT)
#undef NVS_HOOK_SLOT
#define NVS_REAL_SLOT(name, params) {#name, offsetof(struct nvs_real_table, name)},
    NVS_FOR_EACH_REAL(NVS_REAL_SLOT)
#undef NVS_REAL_SLOT
};

void *nvs_real_slot(size_t offset) {
    return __atomic_load_n((void **)((char *)&nvs_real + offset), __ATOMIC_ACQUIRE);
}

/* --- the real dlsym ------------------------------------------------------------------------- */

/* The next dlsym (glibc's), looked up with dlvsym on first use. Racing threads store the same
 * value, and the value is a function of glibc, not of memory another thread wrote: relaxed. */
static nvs_dlsym_fn real_dlsym_ptr;

nvs_dlsym_fn nvs_real_dlsym(void) {
    nvs_dlsym_fn fn = __atomic_load_n(&real_dlsym_ptr, __ATOMIC_RELAXED);
    if (NVS_LIKELY(fn != NULL)) return fn;
    /* glibc >= 2.34 has dlsym@@GLIBC_2.34 in libc; older ones only dlsym@GLIBC_2.2.5 (libdl). */
    fn = (nvs_dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (fn == NULL) fn = (nvs_dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
    __atomic_store_n(&real_dlsym_ptr, fn, __ATOMIC_RELAXED);
    return fn;
}

/* --- lazy loading of the real driver -------------------------------------------------------- */

static pthread_once_t load_once = PTHREAD_ONCE_INIT;
/* 0 before, 1 after a successful load, -1 after a failed one; written once inside load_once
 * (release), read with acquire. */
static int load_state;

static void load_driver(void) {
    nvs_config_load();
    pthread_atfork(nvs_fork_prepare, nvs_fork_parent, nvs_fork_child);
    nvs_dlsym_fn dlsym_next = nvs_real_dlsym();
    void *libcuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (libcuda == NULL || dlsym_next == NULL) {
        const char *why = dlerror();
        nvs_error("cannot load the CUDA driver libcuda.so.1: %s", why != NULL ? why : "dlsym not found");
        __atomic_store_n(&load_state, -1, __ATOMIC_RELEASE);
        return;
    }
    for (size_t i = 0; i < sizeof driver_symbols / sizeof driver_symbols[0]; i++)
        __atomic_store_n((void **)((char *)&nvs_real + driver_symbols[i].offset),
                         dlsym_next(libcuda, driver_symbols[i].name), __ATOMIC_RELEASE);
    nvs_debug("loaded the CUDA driver; socket %s", nvs_config.socket_path);
    __atomic_store_n(&load_state, 1, __ATOMIC_RELEASE);
}

int nvs_real_load(void) {
    if (NVS_UNLIKELY(__atomic_load_n(&load_state, __ATOMIC_ACQUIRE) == 0)) pthread_once(&load_once, load_driver);
    return __atomic_load_n(&load_state, __ATOMIC_ACQUIRE) == 1 ? 0 : -1;
}

int nvs_real_load_if_present(void) {
    if (__atomic_load_n(&load_state, __ATOMIC_ACQUIRE) == 0) {
        /* Loading the driver on behalf of a process that never did would be a side effect of a
         * lookup: only load it when the process already has it. */
        void *loaded = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
        if (loaded == NULL) return -1;
        dlclose(loaded);
    }
    return nvs_real_load();
}

const char *nvs_real_error_name(CUresult r) {
    const char *name = NULL;
    if (nvs_real.cuGetErrorName == NULL || nvs_real.cuGetErrorName(r, &name) != CUDA_SUCCESS || name == NULL)
        return "an unknown CUDA error";
    return name;
}
