/*
 * alloc_loop: the cost of one cuMemAlloc_v2 + cuMemFree_v2 pair, timed pair by pair.
 *
 *   alloc_loop ITERATIONS BYTES [SETTLE_MS [PAUSE_US]]  ->  {"median_ns": ..., "p90_ns": ..., "iterations": ...}
 *
 * SETTLE_MS: one untimed pair first, then a pause of that many milliseconds, so that a
 * preloaded interceptor has registered with its scheduler before the timing starts.
 * PAUSE_US: an untimed pause after each pair, long enough for the interceptor to give its
 * admission back, so that every timed allocation asks the scheduler again
 * (benchmarks/bench_admission.py).
 *
 * Links against libcuda.so.1 (the simulated driver in benchmarks/bench_memory_limit.py) and is
 * run with or without libnvshare.so preloaded.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef unsigned long long CUdeviceptr;
CUresult cuInit(unsigned int flags);
CUresult cuDeviceGet(CUdevice *device, int ordinal);
CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes);
CUresult cuMemFree_v2(CUdeviceptr dptr);

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static int by_value(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc < 3 || argc > 5) {
        fprintf(stderr, "usage: alloc_loop ITERATIONS BYTES [SETTLE_MS [PAUSE_US]]\n");
        return 2;
    }
    long iterations = atol(argv[1]);
    size_t bytes = (size_t)atoll(argv[2]);
    CUdevice device;
    CUcontext ctx;
    if (cuInit(0) || cuDeviceGet(&device, 0) || cuDevicePrimaryCtxRetain(&ctx, device) || cuCtxSetCurrent(ctx)) {
        fprintf(stderr, "alloc_loop: no CUDA device\n");
        return 1;
    }
    long pause_us = argc == 5 ? atol(argv[4]) : 0;
    if (argc >= 4) {
        long settle_ms = atol(argv[3]);
        CUdeviceptr p;
        if (cuMemAlloc_v2(&p, bytes) == 0) cuMemFree_v2(p);
        struct timespec pause = {settle_ms / 1000, (settle_ms % 1000) * 1000000L};
        nanosleep(&pause, NULL);
    }
    uint64_t *samples = malloc(sizeof *samples * (size_t)iterations);
    for (long i = 0; i < iterations; i++) {
        CUdeviceptr p;
        uint64_t start = now_ns();
        CUresult r = cuMemAlloc_v2(&p, bytes);
        if (r == 0) r = cuMemFree_v2(p);
        samples[i] = now_ns() - start;
        if (pause_us > 0) {
            struct timespec pause = {pause_us / 1000000, (pause_us % 1000000) * 1000L};
            nanosleep(&pause, NULL);
        }
        if (r != 0) {
            fprintf(stderr, "alloc_loop: allocation %ld failed (%d)\n", i, r);
            return 1;
        }
    }
    qsort(samples, (size_t)iterations, sizeof *samples, by_value);
    printf("{\"median_ns\": %llu, \"p90_ns\": %llu, \"iterations\": %ld}\n",
           (unsigned long long)samples[iterations / 2], (unsigned long long)samples[iterations * 9 / 10], iterations);
    return 0;
}
