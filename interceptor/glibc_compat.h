/*
 * Force-included into every source of libnvshare.so (Makefile: -include). Binds the glibc
 * functions whose default version is newer than 2.17 to their oldest version, so the library
 * loads on any glibc >= 2.17 (CentOS 7, old CUDA base images) although it is built on a new one.
 * glibc keeps these old versions as compatibility symbols; their behaviour is the same for the
 * way nvshare calls them. tests/test_library_hygiene.py fails when a new reference needs an
 * entry here.
 */
#ifndef NVSHARE_GLIBC_COMPAT_H
#define NVSHARE_GLIBC_COMPAT_H
#if defined(__x86_64__)
/* libdl moved into libc in 2.34 */
__asm__(".symver dlopen, dlopen@GLIBC_2.2.5");
__asm__(".symver dlclose, dlclose@GLIBC_2.2.5");
__asm__(".symver dlerror, dlerror@GLIBC_2.2.5");
__asm__(".symver dlvsym, dlvsym@GLIBC_2.2.5");
/* libpthread moved into libc in 2.34 */
__asm__(".symver pthread_create, pthread_create@GLIBC_2.2.5");
__asm__(".symver pthread_join, pthread_join@GLIBC_2.2.5");
__asm__(".symver pthread_once, pthread_once@GLIBC_2.2.5");
__asm__(".symver pthread_rwlock_init, pthread_rwlock_init@GLIBC_2.2.5");
__asm__(".symver pthread_rwlock_rdlock, pthread_rwlock_rdlock@GLIBC_2.2.5");
__asm__(".symver pthread_rwlock_tryrdlock, pthread_rwlock_tryrdlock@GLIBC_2.2.5");
__asm__(".symver pthread_rwlock_wrlock, pthread_rwlock_wrlock@GLIBC_2.2.5");
__asm__(".symver pthread_rwlock_unlock, pthread_rwlock_unlock@GLIBC_2.2.5");
__asm__(".symver pthread_rwlockattr_init, pthread_rwlockattr_init@GLIBC_2.2.5");
__asm__(".symver pthread_rwlockattr_setkind_np, pthread_rwlockattr_setkind_np@GLIBC_2.2.5");
__asm__(".symver pthread_rwlockattr_destroy, pthread_rwlockattr_destroy@GLIBC_2.2.5");
__asm__(".symver pthread_attr_setstacksize, pthread_attr_setstacksize@GLIBC_2.2.5");
__asm__(".symver pthread_sigmask, pthread_sigmask@GLIBC_2.2.5");
__asm__(".symver pthread_mutexattr_init, pthread_mutexattr_init@GLIBC_2.2.5");
__asm__(".symver pthread_mutexattr_destroy, pthread_mutexattr_destroy@GLIBC_2.2.5");
__asm__(".symver pthread_mutexattr_setpshared, pthread_mutexattr_setpshared@GLIBC_2.2.5");
__asm__(".symver pthread_mutexattr_setrobust, pthread_mutexattr_setrobust@GLIBC_2.12");
__asm__(".symver pthread_mutex_consistent, pthread_mutex_consistent@GLIBC_2.12");
/* fstat is a symbol of its own only since 2.33 (before, <sys/stat.h> made it a call of
 * __fxstat): pool.c makes the system call itself. */
/* memcpy@GLIBC_2.14 only stopped copying overlapping buffers backwards; nvshare never
 * copies overlapping buffers */
__asm__(".symver memcpy, memcpy@GLIBC_2.2.5");
#endif
#endif
