#ifndef NVS_POPULATE_H
#define NVS_POPULATE_H

#include <stddef.h>

/* Makes the pages of [host, host + bytes) present and mapped (MADV_POPULATE_WRITE) before they
 * are pinned, a part per thread: 0, or the errno of the first part that failed (EINVAL: the
 * kernel has no MADV_POPULATE_WRITE, before 5.14; EFAULT or ENOMEM: no memory for them). */
int nvs_populate(char *host, size_t bytes);

#endif
