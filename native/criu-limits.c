/*
 * criu-limits.so: lets CRIU read the resource limits of a process of another
 * user where the host withholds CAP_SYS_RESOURCE from root.
 *
 * CRIU reads each dumped task's limits with prlimit64(pid, res, NULL, &old)
 * (criu/cr-dump.c, dump_task_rlimits). The kernel lets a caller read another
 * task's limits only if their uids and gids all match or the caller has
 * CAP_SYS_RESOURCE (kernel/sys.c, check_prlimit_permission): root without it,
 * as in VMs and containers that drop it from the bounding set, gets EPERM for
 * every task that dropped root (PostgreSQL, a pod's runAsUser), and the dump
 * fails with "Can't get rlimit 0: Operation not permitted". The same values are
 * in /proc/PID/limits, which anyone may read: on EPERM, and only for a read,
 * this answers from there. Nothing else changes; with CAP_SYS_RESOURCE the
 * kernel answers and this is never used.
 *
 * Loaded into CRIU only (smr.process.criu sets LD_PRELOAD for its runs).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>

struct rlim64 { uint64_t cur, max; };

static int parse(const char *s, uint64_t *v) {
    if (strncmp(s, "unlimited", 9) == 0) { *v = UINT64_MAX; return 0; }
    char *end;
    errno = 0;
    unsigned long long n = strtoull(s, &end, 10);
    if (errno || end == s) return -1;
    *v = n;
    return 0;
}

/* Row res+1 of /proc/PID/limits (the kernel prints them in resource order):
   a 25-column name, then the soft and the hard limit. */
static int from_proc(long pid, long res, struct rlim64 *out) {
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%ld/limits", pid);
    FILE *f = fopen(path, "re");
    if (!f) return -1;
    int row = 0, ok = -1;
    while (fgets(line, sizeof line, f)) {
        if (row++ != res + 1) continue;
        char soft[32], hard[32];
        if (strlen(line) > 26 && sscanf(line + 26, "%31s %31s", soft, hard) == 2
            && parse(soft, &out->cur) == 0 && parse(hard, &out->max) == 0)
            ok = 0;
        break;
    }
    fclose(f);
    return ok;
}

long syscall(long nr, ...) {
    static long (*real)(long, ...);
    if (!real) real = (long (*)(long, ...))dlsym(RTLD_NEXT, "syscall");
    va_list ap;
    va_start(ap, nr);
    long a = va_arg(ap, long), b = va_arg(ap, long), c = va_arg(ap, long);
    long d = va_arg(ap, long), e = va_arg(ap, long), f = va_arg(ap, long);
    va_end(ap);
    long r = real(nr, a, b, c, d, e, f);
    if (r < 0 && errno == EPERM && nr == SYS_prlimit64 && a > 0 && c == 0 && d != 0
        && from_proc(a, b, (struct rlim64 *)d) == 0) {
        errno = 0;
        return 0;
    }
    return r;
}
