/*
 * Drives interceptor/populate.c (tests/test_populate.py): makes a mapping's pages present with
 * nvs_populate and prints, as `key=value` words, what it returned (an errno, 0: none) and how
 * many pages are there.
 *   populate_harness anon BYTES            anonymous private memory
 *   populate_harness short-file BYTES FILE a shared mapping of BYTES over a memfd of FILE bytes
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "populate.h"

static size_t present_pages(char *host, size_t bytes) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE), n = (bytes + page - 1) / page, present = 0;
    unsigned char *vec = malloc(n);
    if (vec == NULL || mincore(host, bytes, vec) != 0) return 0;
    for (size_t i = 0; i < n; i++) present += vec[i] & 1;
    free(vec);
    return present;
}

int main(int argc, char **argv) {
    if (argc < 3) return 2;
    size_t bytes = strtoull(argv[2], NULL, 0), page = (size_t)sysconf(_SC_PAGESIZE);
    char *host;
    if (strcmp(argv[1], "anon") == 0) {
        host = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    } else if (strcmp(argv[1], "short-file") == 0 && argc == 4) {
        int fd = memfd_create("populate-harness", 0);
        if (fd < 0 || ftruncate(fd, (off_t)strtoull(argv[3], NULL, 0)) != 0) return 3;
        host = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    } else {
        return 2;
    }
    if (host == MAP_FAILED) return 3;
    int error = nvs_populate(host, bytes);
    printf("error=%d present=%zu pages=%zu\n", error, present_pages(host, bytes), (bytes + page - 1) / page);
    return 0;
}
