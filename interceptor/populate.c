/*
 * Pages made present ahead of pinning (area.c's chunks, pool.c's segments). cuMemHostRegister
 * makes absent pages present itself, one at a time, inside the driver (from four threads at once
 * it was no faster). Made present first, from several threads, the kernel spreads that work over
 * cores, and registering only pins what is mapped, in a tenth of the time:
 *
 *                                make present (4 threads)  register   (s per GiB, H200 hosts)
 *   anonymous, transparent huge   0.05                      0.02
 *   /dev/shm (4 KiB pages)        0.19-0.68                 0.04-0.11  fallocate + register: 0.14-0.19 + 0.40-0.49
 *   tmpfs mounted huge=always     0.06-0.10                 0.02-0.03  fallocate + register: 0.003 + 0.21
 *
 * (benchmarks/results/swap-paths-h200-2026-11-28-pinning.json, pool-pinning-h200-2026-11-28*.json.)
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <unistd.h>

#include "populate.h"

/* Four ran 3.6 times as fast as one on an H200's host; at most one per four online CPUs, so that
 * the application's own threads keep theirs. */
#define POPULATE_THREADS 4
#define HUGE_PAGE ((size_t)2 << 20) /* parts start on a transparent huge page's boundary */
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif

struct part {
    char *start;
    size_t bytes;
    int error;
};

static void *populate_part(void *arg) {
    struct part *p = arg;
    p->error = p->bytes == 0 || madvise(p->start, p->bytes, MADV_POPULATE_WRITE) == 0 ? 0 : errno;
    return NULL;
}

/* A helper thread's part, under a name of its own in /proc (where a stall is looked for). */
static void *populate_helper(void *arg) {
    prctl(PR_SET_NAME, "nvs-populate", 0, 0, 0);
    return populate_part(arg);
}

int nvs_populate(char *host, size_t bytes) {
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    int threads = online / 4 < 1 ? 1 : online / 4 > POPULATE_THREADS ? POPULATE_THREADS : (int)(online / 4);
    size_t share = (bytes / POPULATE_THREADS + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
    struct part parts[POPULATE_THREADS];
    for (int i = 0; i < POPULATE_THREADS; i++) {
        size_t from = (size_t)i * share < bytes ? (size_t)i * share : bytes;
        size_t to = from + share < bytes ? from + share : bytes;
        parts[i] = (struct part){.start = host + from, .bytes = to - from};
    }
    /* The parts are fixed (a quarter each); with fewer threads, the calling one takes the rest.
     * The helpers inherit the caller's signal mask: they take no signals meant for the
     * application. */
    pthread_t helpers[POPULATE_THREADS];
    int started[POPULATE_THREADS] = {0};
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 64 * 1024);
    for (int i = 1; i < threads; i++) started[i] = pthread_create(&helpers[i], &attr, populate_helper, &parts[i]) == 0;
    pthread_attr_destroy(&attr);
    for (int i = 0; i < POPULATE_THREADS; i++)
        if (!started[i]) populate_part(&parts[i]);
    int error = 0;
    for (int i = 0; i < POPULATE_THREADS; i++) {
        if (started[i]) pthread_join(helpers[i], NULL);
        if (error == 0) error = parts[i].error;
    }
    return error;
}
