/*
 * The collective kernel: NCCL's all-reduce in miniature, so that tests can run data-parallel
 * jobs whose ranks wait for each other on the GPU (issue 19's deadlock needs exactly that).
 *   nvshare_allreduce(CUdeviceptr dst, uint32_t value, uint64_t count)
 * contributes `value`, waits until every rank of the group has launched its matching
 * all-reduce, then writes the sum of the contributions into `count` 32-bit words at dst.
 *
 * SIMCUDA_COLLECTIVE=<ranks>:<file> makes the process a member of the group whose rendezvous is
 * <file> (created by the first member; a fresh file per job). One rank per simulated GPU, as
 * NCCL's data-parallel communicators have it: a launch on GPU i (its physical index, whatever
 * CUDA_VISIBLE_DEVICES maps it to) is rank i, so the GPUs 0..ranks-1 take part, from one
 * process or from several. The n-th all-reduce a process runs on a GPU matches the n-th of
 * every other rank.
 *
 * While it waits the kernel keeps its stream busy, as NCCL's spinning kernel does: the context
 * cannot be synchronised, so a drain waits and an idle probe sees work in flight. It does not
 * hold the simulated compute engine while it waits (the residency model's turns).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "simcuda.h"

#define POLL_S 0.0002

/* The rendezvous file, shared by every rank: how many all-reduces each rank has arrived at,
 * and its contributions to the last two (a rank cannot be two ahead of another: it would have
 * to complete the one between, which needs the other's arrival). */
struct rendezvous {
    _Atomic uint64_t arrived[SIM_MAX_DEVICES];
    _Atomic uint32_t value[SIM_MAX_DEVICES][2];
};

/* Written once by sim_collective_open (cuInit's pthread_once), read-only afterwards. */
static struct rendezvous *shared;
static int ranks;
/* All-reduces this process ran on each GPU (executor threads; atomic). */
static _Atomic uint64_t runs[SIM_MAX_DEVICES];

CUresult sim_collective_open(void)
{
    const char *setting = getenv("SIMCUDA_COLLECTIVE");
    if (!setting || !*setting)
        return CUDA_SUCCESS;
    char *path = NULL;
    long n = strtol(setting, &path, 10);
    if (n < 1 || n > SIM_MAX_DEVICES || *path != ':' || path[1] == '\0') {
        fprintf(stderr, "simcuda: SIMCUDA_COLLECTIVE=%s is not <ranks>:<file>\n", setting);
        return CUDA_ERROR_INVALID_VALUE;
    }
    path++;
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0 || ftruncate(fd, sizeof *shared) != 0) { /* the same size again keeps what is there */
        fprintf(stderr, "simcuda: cannot open the collective's file %s: %s\n", path, strerror(errno));
        if (fd >= 0)
            close(fd);
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    void *memory = mmap(NULL, sizeof *shared, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (memory == MAP_FAILED) {
        fprintf(stderr, "simcuda: cannot map the collective's file %s: %s\n", path, strerror(errno));
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    shared = memory;
    ranks = (int)n;
    return CUDA_SUCCESS;
}

CUresult sim_collective_join(struct sim_ctx *ctx, struct sim_op *op)
{
    int rank = ctx->device->index;
    if (!shared || rank >= ranks)
        return CUDA_ERROR_INVALID_VALUE; /* not in a group, or this GPU is not one of its ranks */
    uint64_t n = atomic_fetch_add(&runs[rank], 1) + 1;
    atomic_store(&shared->value[rank][n % 2], op->u.kernel.value);
    atomic_store(&shared->arrived[rank], n);
    for (int other = 0; other < ranks; other++)
        while (atomic_load(&shared->arrived[other]) < n)
            sim_sleep_until(sim_now() + POLL_S);
    uint32_t sum = 0;
    for (int other = 0; other < ranks; other++)
        sum += atomic_load(&shared->value[other][n % 2]);
    op->u.kernel.value = sum; /* written to dst like nvshare_fill's value */
    return CUDA_SUCCESS;
}
