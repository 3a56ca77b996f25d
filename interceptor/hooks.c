/*
 * The hook table and the three ways into the driver, all leading to the same wrappers:
 *   1. the exported ABI symbols (an application linked against libcuda, or dlsym(RTLD_DEFAULT));
 *   2. dlsym on a libcuda handle (PyTorch, ctypes): the overridden dlsym below;
 *   3. cuGetProcAddress / cuGetProcAddress_v2 (the CUDA runtime, JAX, CuPy).
 * dlsym also leads NVML's memory queries to nvml.c (they show a memory limit).
 * Paths 2 and 3 ask the real library first and then swap the address it returned for the
 * wrapper of exactly that symbol: the driver decides which ABI version a caller gets (by its
 * cudaVersion and flags), nvshare never guesses suffixes. Finding the real driver is loader.c's.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <string.h>

#include "collective.h"
#include "compiler.h"
#include "gate.h"
#include "hook_table.h"
#include "loader.h"
#include "nvml.h"

/* --- generated wrappers of the GATED, LAUNCH and CONTEXT hooks -----------------------------*/

#define NVS_WRAPPER_GATED(name, params, args)                                                   \
    NVS_EXPORT CUresult name params {                                                           \
        NVS_REAL_OR_FAIL(name);                                                                 \
        struct nvs_device *gate = nvs_gate_enter();                                             \
        CUresult result = nvs_real.name args;                                                   \
        nvs_gate_exit(gate);                                                                    \
        return result;                                                                          \
    }
#define NVS_WRAPPER_LAUNCH(name, params, args)                                                  \
    NVS_EXPORT CUresult name params {                                                           \
        NVS_REAL_OR_FAIL(name);                                                                 \
        struct nvs_device *gate = nvs_launch_enter(f);                                          \
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

/* --- the table: each wrapper and where the real function it stands for lives ----------------*/

struct hook_entry {
    void *wrapper;
    size_t real_offset;
};

static const struct hook_entry hook_table[] = {
#define NVS_ENTRY(kind, name, params, args) {(void *)name, offsetof(struct nvs_real_table, name)},
    NVS_FOR_EACH_HOOK(NVS_ENTRY)
#undef NVS_ENTRY
};
#define N_HOOKS (sizeof hook_table / sizeof hook_table[0])

/* The wrapper standing for `address` if it is the real address of a hooked symbol. */
static void *substitute(void *address) {
    if (address == NULL || nvs_real_load_if_present() != 0) return address;
    for (size_t i = 0; i < N_HOOKS; i++)
        if (nvs_real_slot(hook_table[i].real_offset) == address) return hook_table[i].wrapper;
    return address;
}

/* --- cuGetProcAddress -----------------------------------------------------------------------*/

NVS_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags) {
    NVS_REAL_OR_FAIL(cuGetProcAddress);
    CUresult result = nvs_real.cuGetProcAddress(symbol, pfn, cudaVersion, flags);
    if (result == CUDA_SUCCESS && pfn != NULL) *pfn = substitute(*pfn);
    return result;
}

NVS_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                        CUdriverProcAddressQueryResult *symbolStatus) {
    NVS_REAL_OR_FAIL(cuGetProcAddress_v2);
    CUresult result = nvs_real.cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, symbolStatus);
    if (result == CUDA_SUCCESS && pfn != NULL) *pfn = substitute(*pfn);
    return result;
}

/* --- dlsym ------------------------------------------------------------------------------------
 * Exported twice: dlsym@GLIBC_2.2.5 (what PyTorch, JAX and Python's ctypes import) and
 * dlsym@@GLIBC_2.34 (newer binaries). glibc's dlsym finds its caller by its return address:
 * RTLD_NEXT searches the objects after the caller, RTLD_DEFAULT the caller's dlmopen namespace.
 * Lookups that cannot concern the driver must therefore reach glibc with the application's
 * return address. A C tail call does not guarantee that (at -O0, or with -fsanitize=thread, the
 * compiler emits a call and glibc sees libnvshare as the caller: another interposer's
 * dlsym(RTLD_NEXT) then finds itself). So the entry is a few instructions of assembly: it asks
 * nvs_dlsym_route where the lookup goes and jumps there with the caller's arguments, stack and
 * return address untouched. */

static void *dlsym_unavailable(void *handle, const char *name) { return NULL; }

/* Driver symbols: the real dlsym's answer, swapped for the wrapper where there is one. Here
 * glibc sees libnvshare as the caller, which is right for a libcuda handle. */
static void *dlsym_driver_symbol(void *handle, const char *name) {
    return substitute(nvs_real_dlsym()(handle, name));
}

/* NVML symbols: the memory queries show a memory limit (nvml.c). */
static void *dlsym_nvml_symbol(void *handle, const char *name) {
    return nvs_nvml_substitute(nvs_real_dlsym()(handle, name));
}

/* Called by the assembly entry with the caller's arguments: the function to jump to. */
__attribute__((used)) nvs_dlsym_fn nvs_dlsym_route(void *handle, const char *name) {
    nvs_dlsym_fn next = nvs_real_dlsym();
    if (next == NULL) return dlsym_unavailable;
    if (handle == RTLD_NEXT || name == NULL) return next;
    if (name[0] == 'c' && name[1] == 'u') return dlsym_driver_symbol;
    if (strncmp(name, "nvml", 4) == 0) return dlsym_nvml_symbol;
    return next;
}

#if defined(__x86_64__)
/* rsp is 8 mod 16 at entry; two pushes and 8 bytes keep the call aligned. endbr64 is a no-op
 * without CET. */
__asm__(".text\n"
        ".p2align 4\n"
        ".globl nvs_dlsym_glibc_2_2_5\n"
        ".globl nvs_dlsym_glibc_2_34\n"
        ".type nvs_dlsym_glibc_2_2_5, @function\n"
        ".type nvs_dlsym_glibc_2_34, @function\n"
        "nvs_dlsym_glibc_2_2_5:\n"
        "nvs_dlsym_glibc_2_34:\n"
        "  .cfi_startproc\n"
        "  endbr64\n"
        "  pushq %rdi\n"
        "  .cfi_adjust_cfa_offset 8\n"
        "  pushq %rsi\n"
        "  .cfi_adjust_cfa_offset 8\n"
        "  subq $8, %rsp\n"
        "  .cfi_adjust_cfa_offset 8\n"
        "  call nvs_dlsym_route\n"
        "  addq $8, %rsp\n"
        "  .cfi_adjust_cfa_offset -8\n"
        "  popq %rsi\n"
        "  .cfi_adjust_cfa_offset -8\n"
        "  popq %rdi\n"
        "  .cfi_adjust_cfa_offset -8\n"
        "  jmp *%rax\n"
        "  .cfi_endproc\n"
        ".size nvs_dlsym_glibc_2_2_5, .-nvs_dlsym_glibc_2_2_5\n"
        ".size nvs_dlsym_glibc_2_34, .-nvs_dlsym_glibc_2_34\n");
#elif defined(__aarch64__)
/* The frame holds x29/x30 and the two arguments; the jump goes through x16 (the register BTI
 * landing pads accept for an indirect branch), with x30 = the caller's return address again.
 * `hint 34` is BTI C, a no-op on cores without BTI. */
__asm__(".text\n"
        ".p2align 4\n"
        ".globl nvs_dlsym_glibc_2_2_5\n"
        ".globl nvs_dlsym_glibc_2_34\n"
        ".type nvs_dlsym_glibc_2_2_5, %function\n"
        ".type nvs_dlsym_glibc_2_34, %function\n"
        "nvs_dlsym_glibc_2_2_5:\n"
        "nvs_dlsym_glibc_2_34:\n"
        "  .cfi_startproc\n"
        "  hint 34\n"
        "  stp x29, x30, [sp, #-32]!\n"
        "  .cfi_def_cfa_offset 32\n"
        "  .cfi_offset 29, -32\n"
        "  .cfi_offset 30, -24\n"
        "  mov x29, sp\n"
        "  stp x0, x1, [sp, #16]\n"
        "  bl nvs_dlsym_route\n"
        "  mov x16, x0\n"
        "  ldp x0, x1, [sp, #16]\n"
        "  ldp x29, x30, [sp], #32\n"
        "  .cfi_def_cfa_offset 0\n"
        "  .cfi_restore 29\n"
        "  .cfi_restore 30\n"
        "  br x16\n"
        "  .cfi_endproc\n"
        ".size nvs_dlsym_glibc_2_2_5, .-nvs_dlsym_glibc_2_2_5\n"
        ".size nvs_dlsym_glibc_2_34, .-nvs_dlsym_glibc_2_34\n");
#else
#error "libnvshare's dlsym entry is written for x86-64 and aarch64; port the few instructions in hooks.c"
#endif
__asm__(".symver nvs_dlsym_glibc_2_2_5, dlsym@GLIBC_2.2.5");
__asm__(".symver nvs_dlsym_glibc_2_34, dlsym@@GLIBC_2.34");
