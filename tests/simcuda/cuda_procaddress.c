/*
 * cuGetProcAddress: maps (base name, cudaVersion, flags) to the address of an exported entry
 * point, the way the real driver does (every address it returns is that of an exported symbol).
 *
 * Rules, as measured on driver 580 (CUDA 13):
 * - among the entries of the base name whose version is at most cudaVersion, the newest wins;
 * - with CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, a base name that has _ptds/_ptsz
 *   entries is looked up among those only (cuLaunchKernel at 4000 with that flag is "version
 *   not sufficient": its _ptsz entry appeared in 7000); other names ignore the flag;
 * - a known name without an entry old enough: CUDA_SUCCESS, status VERSION_NOT_SUFFICIENT;
 * - an unknown name: CUDA_SUCCESS, status SYMBOL_NOT_FOUND (both with *pfn = NULL);
 * - cudaVersion above the driver's version, or an unknown flag: CUDA_ERROR_INVALID_VALUE.
 * SIMCUDA_DRIVER_VERSION makes it an older driver: entry points newer than it are unknown.
 * The library is linked with -Bsymbolic, so these addresses are the driver's own even when a
 * preloaded library exports the same names (an interceptor relies on that to reach the real
 * functions).
 */
#include <string.h>

#include "simcuda.h"

struct entry_point {
    const char *symbol;
    const char *base;
    int version;
    int per_thread;
    void *address;
};

static const struct entry_point entry_points[] = {
#define CU_ENTRY(symbol, base, version, per_thread, params) {#symbol, #base, version, per_thread, (void *)symbol},
#include "cuda_entry_points.h"
#undef CU_ENTRY
};
#define ENTRY_POINT_COUNT (sizeof entry_points / sizeof entry_points[0])

static CUresult lookup(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                       CUdriverProcAddressQueryResult *symbolStatus)
{
    int driver = sim_driver_version();
    if (!symbol || !pfn || cudaVersion > driver ||
        (flags & ~(cuuint64_t)(CU_GET_PROC_ADDRESS_LEGACY_STREAM | CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM)))
        return CUDA_ERROR_INVALID_VALUE;
    int per_thread = 0;
    if (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM)
        for (size_t i = 0; i < ENTRY_POINT_COUNT && !per_thread; i++)
            per_thread = entry_points[i].per_thread && strcmp(entry_points[i].base, symbol) == 0;
    const struct entry_point *best = NULL;
    int known = 0;
    for (size_t i = 0; i < ENTRY_POINT_COUNT; i++) {
        const struct entry_point *entry = &entry_points[i];
        if (entry->per_thread != per_thread || entry->version > driver || strcmp(entry->base, symbol) != 0)
            continue;
        known = 1;
        if (entry->version <= cudaVersion && (!best || entry->version > best->version))
            best = entry;
    }
    *pfn = best ? best->address : NULL;
    CUdriverProcAddressQueryResult status = best    ? CU_GET_PROC_ADDRESS_SUCCESS
                                            : known ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT
                                                    : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    if (symbolStatus)
        *symbolStatus = status;
    return CUDA_SUCCESS;
}

/* Both work before cuInit: the CUDA runtime resolves the driver before initialising it. */
SIM_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    return lookup(symbol, pfn, cudaVersion, flags, NULL);
}

SIM_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                        CUdriverProcAddressQueryResult *symbolStatus)
{
    return lookup(symbol, pfn, cudaVersion, flags, symbolStatus);
}
