/*
 * The three ways into the driver, all leading to the same wrappers:
 *   1. the exported ABI symbols (an application linked against libcuda, or dlsym(RTLD_DEFAULT));
 *   2. dlsym on a libcuda handle (PyTorch, ctypes): the overridden dlsym below;
 *   3. cuGetProcAddress / cuGetProcAddress_v2 (the CUDA runtime, JAX, CuPy).
 * Paths 2 and 3 ask the real library first and then swap the address it returned for the
 * wrapper of exactly that symbol: the driver decides which ABI version a caller gets (by its
 * cudaVersion and flags), nvshare never guesses suffixes.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <string.h>

#include "nvshare.h"

struct nvs_real_table nvs_real;

/* --- generated wrappers of the GATED and CONTEXT hooks -------------------------------------*/

#define NVS_WRAPPER_GATED(name, params, args)                                                   \
    NVS_EXPORT CUresult name params {                                                           \
        NVS_REAL_OR_FAIL(name);                                                                 \
        struct nvs_device *gate = nvs_gate_enter();                                             \
        CUresult result = nvs_real.name args;                                                   \
        nvs_gate_exit(gate);                                                                    \
        return result;                                                                          \
    }
#define NVS_WRAPPER_CONTEXT(name, params, args)                                                 \
    NVS_EXPORT CUresult name params {                                                           \
        NVS_REAL_OR_FAIL(name);                                                                 \
        CUresult result = nvs_real.name args;                                                   \
        nvs_tls.device = NULL; /* resolved again on the thread's next gated call */             \
        return result;                                                                          \
    }
#define NVS_WRAPPER_CUSTOM(name, params, args)
#define NVS_WRAPPER(kind, name, params, args) NVS_WRAPPER_##kind(name, params, args)
NVS_FOR_EACH_HOOK(NVS_WRAPPER)

/* --- the table: name, wrapper, where its real pointer lives --------------------------------*/

struct hook_entry {
    const char *name;
    void *wrapper;
    size_t real_offset;
};

static const struct hook_entry hook_table[] = {
#define NVS_ENTRY(kind, name, params, args) {#name, (void *)name, offsetof(struct nvs_real_table, name)},
    NVS_FOR_EACH_HOOK(NVS_ENTRY)
#undef NVS_ENTRY
};
#define N_HOOKS (sizeof hook_table / sizeof hook_table[0])

static const struct {
    const char *name;
    size_t real_offset;
} real_only_table[] = {
#define NVS_REAL_ENTRY(name, params) {#name, offsetof(struct nvs_real_table, name)},
    NVS_FOR_EACH_REAL(NVS_REAL_ENTRY)
#undef NVS_REAL_ENTRY
};

static void **real_slot(size_t offset) { return (void **)((char *)&nvs_real + offset); }

/* --- the real dlsym --------------------------------------------------------------------------*/

typedef void *(*dlsym_fn)(void *, const char *);

/* The next dlsym (glibc's), looked up with dlvsym on first use. Any thread may race to store
 * the same value: relaxed atomics. */
static dlsym_fn real_dlsym_ptr;

static dlsym_fn real_dlsym(void) {
    dlsym_fn fn = __atomic_load_n(&real_dlsym_ptr, __ATOMIC_RELAXED);
    if (NVS_LIKELY(fn != NULL)) return fn;
    /* glibc >= 2.34 has dlsym@@GLIBC_2.34 in libc; older ones only dlsym@GLIBC_2.2.5 (libdl). */
    fn = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (fn == NULL) fn = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
    __atomic_store_n(&real_dlsym_ptr, fn, __ATOMIC_RELAXED);
    return fn;
}

/* --- lazy loading of the real driver --------------------------------------------------------*/

static pthread_once_t load_once = PTHREAD_ONCE_INIT;
/* 1 after a successful load, -1 after a failed one; written once inside load_once. */
static int load_state;

static void load_driver(void) {
    nvs_config_load();
    pthread_atfork(nvs_fork_prepare, nvs_fork_parent, nvs_fork_child);
    dlsym_fn dlsym_next = real_dlsym();
    void *libcuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (libcuda == NULL || dlsym_next == NULL) {
        const char *why = dlerror();
        nvs_error("cannot load the CUDA driver libcuda.so.1: %s", why != NULL ? why : "dlsym not found");
        __atomic_store_n(&load_state, -1, __ATOMIC_RELEASE);
        return;
    }
    for (size_t i = 0; i < N_HOOKS; i++)
        *real_slot(hook_table[i].real_offset) = dlsym_next(libcuda, hook_table[i].name);
    for (size_t i = 0; i < sizeof real_only_table / sizeof real_only_table[0]; i++)
        *real_slot(real_only_table[i].real_offset) = dlsym_next(libcuda, real_only_table[i].name);
    nvs_debug("loaded the CUDA driver; socket %s", nvs_config.socket_path);
    __atomic_store_n(&load_state, 1, __ATOMIC_RELEASE);
}

int nvs_real_load(void) {
    if (NVS_UNLIKELY(__atomic_load_n(&load_state, __ATOMIC_ACQUIRE) == 0)) pthread_once(&load_once, load_driver);
    return __atomic_load_n(&load_state, __ATOMIC_ACQUIRE) == 1 ? 0 : -1;
}

/* The wrapper standing for `address` if it is the real address of a hooked symbol. */
static void *substitute(void *address) {
    if (address == NULL) return address;
    if (__atomic_load_n(&load_state, __ATOMIC_ACQUIRE) == 0) {
        /* Not loaded yet: an address can only be the driver's if the process loaded it. */
        void *loaded = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
        if (loaded == NULL) return address;
        dlclose(loaded);
    }
    if (nvs_real_load() != 0) return address;
    for (size_t i = 0; i < N_HOOKS; i++)
        if (*real_slot(hook_table[i].real_offset) == address) return hook_table[i].wrapper;
    return address;
}

/* --- cuGetProcAddress -----------------------------------------------------------------------*/

NVS_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags) {
    if (nvs_real_load() != 0) return CUDA_ERROR_NOT_INITIALIZED;
    if (nvs_real.cuGetProcAddress == NULL) return CUDA_ERROR_NOT_FOUND;
    CUresult result = nvs_real.cuGetProcAddress(symbol, pfn, cudaVersion, flags);
    if (result == CUDA_SUCCESS && pfn != NULL) *pfn = substitute(*pfn);
    return result;
}

NVS_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                        CUdriverProcAddressQueryResult *symbolStatus) {
    if (nvs_real_load() != 0) return CUDA_ERROR_NOT_INITIALIZED;
    if (nvs_real.cuGetProcAddress_v2 == NULL) return CUDA_ERROR_NOT_FOUND;
    CUresult result = nvs_real.cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, symbolStatus);
    if (result == CUDA_SUCCESS && pfn != NULL) *pfn = substitute(*pfn);
    return result;
}

/* --- dlsym ------------------------------------------------------------------------------------
 * Exported twice: dlsym@GLIBC_2.2.5 (what PyTorch, JAX and Python's ctypes import) and
 * dlsym@@GLIBC_2.34 (newer binaries). Lookups that cannot concern the driver are passed on as
 * tail calls, so that glibc sees the application's return address: RTLD_NEXT and
 * dlmopen namespaces keep working for other interposers. */

__attribute__((noinline)) static void *dlsym_driver_symbol(dlsym_fn next, void *handle, const char *name) {
    return substitute(next(handle, name));
}

static inline void *dlsym_common(void *handle, const char *name) {
    dlsym_fn next = real_dlsym();
    if (handle == RTLD_NEXT || name == NULL || name[0] != 'c' || name[1] != 'u') return next(handle, name);
    return dlsym_driver_symbol(next, handle, name);
}

NVS_EXPORT void *nvs_dlsym_glibc_2_2_5(void *handle, const char *name) { return dlsym_common(handle, name); }
NVS_EXPORT void *nvs_dlsym_glibc_2_34(void *handle, const char *name) { return dlsym_common(handle, name); }
__asm__(".symver nvs_dlsym_glibc_2_2_5, dlsym@GLIBC_2.2.5");
__asm__(".symver nvs_dlsym_glibc_2_34, dlsym@@GLIBC_2.34");
