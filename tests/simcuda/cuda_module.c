/*
 * Modules, libraries and launches. Any image loads; every module and library holds the three
 * fake kernels of docs/architecture.md:
 *   nvshare_sleep(uint64_t duration_us)                          occupies the device that long
 *   nvshare_fill(CUdeviceptr dst, uint32_t value, uint64_t count) writes count 32-bit words
 *   nvshare_allreduce(CUdeviceptr dst, uint32_t value, uint64_t count) the same with the sum of
 *       every rank's value, once all have launched theirs (cuda_collective.c)
 * A CUkernel and the CUfunction it yields are the same object, so the CUDA runtime's habit of
 * launching a CUkernel through cuLaunchKernel works as with the real driver.
 */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "simcuda.h"

struct sim_module {
    enum sim_magic magic;
    struct sim_function sleep, fill, allreduce;
};

/* Limits of a Hopper device, checked as the real driver checks them. */
#define MAX_THREADS_PER_BLOCK 1024
#define MAX_SHARED_MEMORY_PER_BLOCK 232448

static CUresult new_module(struct sim_module **out)
{
    struct sim_module *module = calloc(1, sizeof *module);
    if (!module)
        return CUDA_ERROR_OUT_OF_MEMORY;
    module->magic = SIM_MAGIC_MODULE;
    module->sleep = (struct sim_function){SIM_MAGIC_FUNCTION, SIM_KERNEL_SLEEP, "nvshare_sleep"};
    module->fill = (struct sim_function){SIM_MAGIC_FUNCTION, SIM_KERNEL_FILL, "nvshare_fill"};
    module->allreduce = (struct sim_function){SIM_MAGIC_FUNCTION, SIM_KERNEL_ALLREDUCE, "nvshare_allreduce"};
    *out = module;
    return CUDA_SUCCESS;
}

static CUresult check_module(void *handle, struct sim_module **out)
{
    struct sim_module *module = handle;
    if (!module || module->magic != SIM_MAGIC_MODULE)
        return CUDA_ERROR_INVALID_HANDLE;
    *out = module;
    return CUDA_SUCCESS;
}

static CUresult load_module(CUmodule *module, const void *image)
{
    SIM_ENTER();
    if (!module || !image)
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_ctx *ctx;
    CUresult result = sim_ctx_require(&ctx);
    if (result != CUDA_SUCCESS)
        return result;
    return new_module((struct sim_module **)module);
}

SIM_EXPORT CUresult cuModuleLoad(CUmodule *module, const char *fname)
{
    SIM_ENTER();
    if (fname && access(fname, R_OK) != 0)
        return CUDA_ERROR_FILE_NOT_FOUND;
    return load_module(module, fname);
}

SIM_EXPORT CUresult cuModuleLoadData(CUmodule *module, const void *image)
{
    return load_module(module, image);
}

SIM_EXPORT CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions,
                                       CUjit_option *options, void **optionValues)
{
    SIM_ENTER();
    if (numOptions > 0 && (!options || !optionValues))
        return CUDA_ERROR_INVALID_VALUE;
    return load_module(module, image);
}

static CUresult get_function(struct sim_module *module, const char *name, struct sim_function **out)
{
    if (!out || !name)
        return CUDA_ERROR_INVALID_VALUE;
    if (strcmp(name, module->sleep.name) == 0)
        *out = &module->sleep;
    else if (strcmp(name, module->fill.name) == 0)
        *out = &module->fill;
    else if (strcmp(name, module->allreduce.name) == 0)
        *out = &module->allreduce;
    else
        return CUDA_ERROR_NOT_FOUND;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name)
{
    SIM_ENTER();
    struct sim_module *module;
    CUresult result = check_module(hmod, &module);
    return result != CUDA_SUCCESS ? result : get_function(module, name, (struct sim_function **)hfunc);
}

static CUresult unload(void *handle)
{
    SIM_ENTER();
    struct sim_module *module;
    CUresult result = check_module(handle, &module);
    if (result == CUDA_SUCCESS) {
        module->magic = module->sleep.magic = module->fill.magic = module->allreduce.magic = SIM_MAGIC_DEAD;
        free(module);
    }
    return result;
}

SIM_EXPORT CUresult cuModuleUnload(CUmodule hmod)
{
    return unload(hmod);
}

/* Libraries are context-independent: loading one needs no current context. */
SIM_EXPORT CUresult cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jitOptions,
                                      void **jitOptionsValues, unsigned int numJitOptions,
                                      CUlibraryOption *libraryOptions, void **libraryOptionValues,
                                      unsigned int numLibraryOptions)
{
    SIM_ENTER();
    if (!library || !code || (numJitOptions > 0 && (!jitOptions || !jitOptionsValues)) ||
        (numLibraryOptions > 0 && (!libraryOptions || !libraryOptionValues)))
        return CUDA_ERROR_INVALID_VALUE;
    return new_module((struct sim_module **)library);
}

SIM_EXPORT CUresult cuLibraryUnload(CUlibrary library)
{
    return unload(library);
}

SIM_EXPORT CUresult cuLibraryGetKernel(CUkernel *pKernel, CUlibrary library, const char *name)
{
    SIM_ENTER();
    struct sim_module *module;
    CUresult result = check_module(library, &module);
    return result != CUDA_SUCCESS ? result : get_function(module, name, (struct sim_function **)pKernel);
}

static CUresult check_function(const void *handle, const struct sim_function **out)
{
    const struct sim_function *function = handle;
    if (!function || function->magic != SIM_MAGIC_FUNCTION)
        return CUDA_ERROR_INVALID_HANDLE;
    *out = function;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuKernelGetFunction(CUfunction *pFunc, CUkernel kernel)
{
    SIM_ENTER();
    if (!pFunc)
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_ctx *ctx;
    const struct sim_function *function;
    CUresult result = sim_ctx_require(&ctx);
    if (result == CUDA_SUCCESS)
        result = check_function(kernel, &function);
    if (result == CUDA_SUCCESS)
        *pFunc = (CUfunction)kernel;
    return result;
}

/* ---- Launches ---- */

/* Copies the kernel's arguments from kernelParams (one pointer per parameter) or from an
 * `extra` parameter buffer (natural alignment: dst at 0, value at 8, count at 16). */
static CUresult read_arguments(const struct sim_function *function, void **kernelParams, void **extra,
                               struct sim_op *op)
{
    if ((kernelParams == NULL) == (extra == NULL))
        return CUDA_ERROR_INVALID_VALUE;
    size_t count = function->kind == SIM_KERNEL_SLEEP ? 1 : 3;
    const void *arguments[3];
    if (kernelParams) {
        for (size_t i = 0; i < count; i++)
            arguments[i] = kernelParams[i];
    } else {
        const char *buffer = NULL;
        size_t size = 0;
        for (size_t i = 0; extra[i] != CU_LAUNCH_PARAM_END; i += 2) {
            if (extra[i] == CU_LAUNCH_PARAM_BUFFER_POINTER)
                buffer = extra[i + 1];
            else if (extra[i] == CU_LAUNCH_PARAM_BUFFER_SIZE)
                size = *(size_t *)extra[i + 1];
            else
                return CUDA_ERROR_INVALID_VALUE;
        }
        if (!buffer || size < 8 * count)
            return CUDA_ERROR_INVALID_VALUE;
        for (size_t i = 0; i < count; i++)
            arguments[i] = buffer + 8 * i;
    }
    op->u.kernel.kind = function->kind;
    if (function->kind == SIM_KERNEL_SLEEP) {
        memcpy(&op->u.kernel.duration_us, arguments[0], sizeof(uint64_t));
    } else {
        CUdeviceptr dst;
        memcpy(&dst, arguments[0], sizeof dst);
        op->u.kernel.dst = (uintptr_t)dst;
        memcpy(&op->u.kernel.value, arguments[1], sizeof(uint32_t));
        memcpy(&op->u.kernel.count, arguments[2], sizeof(uint64_t));
    }
    return CUDA_SUCCESS;
}

static CUresult launch(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                       unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                       unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra,
                       const char *api)
{
    SIM_ENTER();
    const struct sim_function *function;
    CUresult result = check_function(f, &function);
    if (result != CUDA_SUCCESS)
        return result;
    if (!gridDimX || !gridDimY || !gridDimZ || !blockDimX || !blockDimY || !blockDimZ ||
        (unsigned long long)blockDimX * blockDimY * blockDimZ > MAX_THREADS_PER_BLOCK ||
        sharedMemBytes > MAX_SHARED_MEMORY_PER_BLOCK)
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_ctx *ctx;
    struct sim_stream *stream;
    result = sim_stream_resolve(hStream, &ctx, &stream);
    if (result != CUDA_SUCCESS)
        return result;
    struct sim_op *op = sim_op_new(SIM_OP_KERNEL, api);
    result = read_arguments(function, kernelParams, extra, op);
    if (result != CUDA_SUCCESS) {
        sim_op_free(op);
        return result;
    }
    return sim_submit(ctx, stream, op, 0);
}

SIM_WITH_TWIN(cuLaunchKernel, cuLaunchKernel_ptsz,
              (CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ, unsigned int blockDimX,
               unsigned int blockDimY, unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
               void **kernelParams, void **extra),
              return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream,
                            kernelParams, extra, __func__);)

static CUresult launch_ex(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra,
                          const char *api)
{
    SIM_ENTER();
    if (!config || (config->numAttrs > 0 && !config->attrs))
        return CUDA_ERROR_INVALID_VALUE;
    return launch(f, config->gridDimX, config->gridDimY, config->gridDimZ, config->blockDimX, config->blockDimY,
                  config->blockDimZ, config->sharedMemBytes, config->hStream, kernelParams, extra, api);
}

SIM_WITH_TWIN(cuLaunchKernelEx, cuLaunchKernelEx_ptsz,
              (const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra),
              return launch_ex(config, f, kernelParams, extra, __func__);)
SIM_WITH_TWIN(cuLaunchCooperativeKernel, cuLaunchCooperativeKernel_ptsz,
              (CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ, unsigned int blockDimX,
               unsigned int blockDimY, unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
               void **kernelParams),
              return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream,
                            kernelParams, NULL, __func__);)

/* Each entry launched on its own stream (and so its own device); `flags` change nothing here. */
SIM_EXPORT CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *launchParamsList, unsigned int numDevices,
                                                         unsigned int flags)
{
    (void)flags;
    SIM_ENTER();
    if (!launchParamsList || numDevices == 0)
        return CUDA_ERROR_INVALID_VALUE;
    for (unsigned int i = 0; i < numDevices; i++) {
        const CUDA_LAUNCH_PARAMS *p = &launchParamsList[i];
        CUresult result = launch(p->function, p->gridDimX, p->gridDimY, p->gridDimZ, p->blockDimX, p->blockDimY,
                                 p->blockDimZ, p->sharedMemBytes, p->hStream, p->kernelParams, NULL, __func__);
        if (result != CUDA_SUCCESS)
            return result;
    }
    return CUDA_SUCCESS;
}

/* The execution control API of CUDA 2.x (cuFuncSetBlockShape, cuParamSet*) is not simulated:
 * its launches exist and answer CUDA_ERROR_NOT_SUPPORTED. */
SIM_IGNORING_PARAMETERS(
    SIM_EXPORT CUresult cuLaunch(CUfunction f) { SIM_ENTER(); return CUDA_ERROR_NOT_SUPPORTED; }
    SIM_EXPORT CUresult cuLaunchGrid(CUfunction f, int grid_width, int grid_height)
    { SIM_ENTER(); return CUDA_ERROR_NOT_SUPPORTED; }
    SIM_EXPORT CUresult cuLaunchGridAsync(CUfunction f, int grid_width, int grid_height, CUstream hStream)
    { SIM_ENTER(); return CUDA_ERROR_NOT_SUPPORTED; })
