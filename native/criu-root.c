/*
 * criu-root.so: CRIU takes a container's root as `/` only once the agent's
 * own files are loaded, so nothing of the image is read as code or config.
 *
 * The node agent starts CRIU in the container's namespaces but with its own
 * root as `/` (nsenter --root): the dynamic loader then reads the agent's
 * /etc/ld.so.preload and maps the agent's libraries, never the image's. CRIU
 * itself must resolve the paths of the tree's files against the container's
 * root: when it shares the tree's mount namespace it takes its own `/` as
 * that namespace's root (criu/mount.c, __mntns_get_root_fd). This constructor
 * runs after every library is mapped and before CRIU's main: it joins again
 * the mount namespace it is in, which puts its root and working directory at
 * that namespace's root (setns(2)), the container's.
 *
 * From then on, what CRIU would take from that root besides the tree's files
 * is the tenant's, so this library answers for it:
 *
 * - Programs. CRIU runs programs by name in places (criu/kerndat.c probes
 *   `iptables -L`, `sh -c "iptables -n -w -L"`; criu/net.c `ip`,
 *   `iptables-save`; criu/filesystems.c `tar`): with the container's root as
 *   `/` those are the image's, run as root with CRIU's capabilities. Every
 *   exec entry of libc (execve and the rest, posix_spawn, system, popen) is
 *   refused here with EACCES and a line in CRIU's log, whatever the program:
 *   the agent's CRIU runs nothing. What needed one fails (a tree in a network
 *   namespace of its own: CRIU would save it with `ip`), and the tree runs on.
 * - Its kernel-feature cache. CRIU reads /run/criu.kdat at start and writes it
 *   back (criu/kerndat.c); there that is the container's /run. Reads of it are
 *   answered from the agent's own cache (SMR_CRIU_KDAT_FD, a descriptor the
 *   agent made by running its CRIU outside any container), and writes and
 *   removals are refused: no file of the tenant is read as CRIU's
 *   configuration or changed. With the cache CRIU also skips its probes,
 *   whose helper processes the tenant could stop (they run in its PID
 *   namespace) and so fail the run.
 *
 * Only where SMR_CRIU_ENTER_ROOT=1 (the agent's runs); CRIU's configuration
 * files and plugins are kept out by its options (--no-default-config, -L).
 * A failure ends the process before CRIU could resolve a path against the
 * wrong root.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define KDAT "/run/criu.kdat"
#define KDAT_TMP KDAT ".tmp"
/* CRIU's struct kerndat_s is under 1 KiB; anything larger is not one. */
#define KDAT_MAX 65536

static int active;
static char kdat[KDAT_MAX];
static ssize_t kdat_len = -1;

/* The agent's cache, read whole now (pread: the descriptor's offset is shared
 * with every other CRIU run the agent started from it), then closed. */
static void load_kdat(void) {
    const char *s = getenv("SMR_CRIU_KDAT_FD");
    if (!s)
        return;
    char *end;
    long fd = strtol(s, &end, 10);
    unsetenv("SMR_CRIU_KDAT_FD");
    struct stat st;
    if (*s == '\0' || *end != '\0' || fd < 3 || fd > 65535 || fstat((int)fd, &st) != 0 ||
        !S_ISREG(st.st_mode) || st.st_size <= 0 || st.st_size > KDAT_MAX)
        return;
    ssize_t n = pread((int)fd, kdat, (size_t)st.st_size, 0);
    close((int)fd);
    if (n == st.st_size)
        kdat_len = n;
}

__attribute__((constructor)) static void enter_container_root(void) {
    const char *want = getenv("SMR_CRIU_ENTER_ROOT");
    if (!want || strcmp(want, "1") != 0)
        return;
    unsetenv("SMR_CRIU_ENTER_ROOT");
    load_kdat();
    int ns = open("/proc/self/ns/mnt", O_RDONLY | O_CLOEXEC);
    if (ns < 0 || setns(ns, CLONE_NEWNS) != 0) {
        perror("smr criu-root.so: cannot take the container's root as / "
               "(setns of its own mount namespace)");
        _exit(125);
    }
    close(ns);
    active = 1;
}

/* ---- the kernel-feature cache ---- */

static int is_kdat(const char *path) {
    return active && path && (strcmp(path, KDAT) == 0 || strcmp(path, KDAT_TMP) == 0);
}

/* The agent's cache as a new descriptor of its own (a sealed memfd), or
 * ENOENT: CRIU then probes, as with no cache at all. */
static int kdat_open(const char *path, int flags) {
    if (strcmp(path, KDAT) != 0 || (flags & O_ACCMODE) != O_RDONLY || (flags & O_CREAT)) {
        errno = EACCES;
        return -1;
    }
    if (kdat_len < 0) {
        errno = ENOENT;
        return -1;
    }
    int fd = memfd_create("smr-criu-kdat", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0)
        return -1;
    if (write(fd, kdat, (size_t)kdat_len) != kdat_len || lseek(fd, 0, SEEK_SET) != 0) {
        close(fd);
        errno = EIO;
        return -1;
    }
    fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE | F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL);
    return fd;
}

#define NEXT(name) ((__typeof__(&name))dlsym(RTLD_NEXT, #name))

static mode_t mode_of(int flags, va_list ap) {
    return (flags & (O_CREAT | __O_TMPFILE)) ? (mode_t)va_arg(ap, int) : 0;
}

int open(const char *path, int flags, ...) {
    va_list ap;
    va_start(ap, flags);
    mode_t mode = mode_of(flags, ap);
    va_end(ap);
    if (is_kdat(path))
        return kdat_open(path, flags);
    return NEXT(open)(path, flags, mode);
}

int open64(const char *path, int flags, ...) {
    va_list ap;
    va_start(ap, flags);
    mode_t mode = mode_of(flags, ap);
    va_end(ap);
    if (is_kdat(path))
        return kdat_open(path, flags);
    return NEXT(open64)(path, flags, mode);
}

int openat(int dirfd, const char *path, int flags, ...) {
    va_list ap;
    va_start(ap, flags);
    mode_t mode = mode_of(flags, ap);
    va_end(ap);
    if (is_kdat(path))
        return kdat_open(path, flags);
    return NEXT(openat)(dirfd, path, flags, mode);
}

int openat64(int dirfd, const char *path, int flags, ...) {
    va_list ap;
    va_start(ap, flags);
    mode_t mode = mode_of(flags, ap);
    va_end(ap);
    if (is_kdat(path))
        return kdat_open(path, flags);
    return NEXT(openat64)(dirfd, path, flags, mode);
}

/* CRIU removes a cache it finds stale: never the tenant's file of that name. */
int unlink(const char *path) {
    if (is_kdat(path)) {
        errno = EACCES;
        return -1;
    }
    return NEXT(unlink)(path);
}

int unlinkat(int dirfd, const char *path, int flags) {
    if (is_kdat(path)) {
        errno = EACCES;
        return -1;
    }
    return NEXT(unlinkat)(dirfd, path, flags);
}

int rename(const char *from, const char *to) {
    if (is_kdat(from) || is_kdat(to)) {
        errno = EACCES;
        return -1;
    }
    return NEXT(rename)(from, to);
}

/* ---- programs: none ---- */

static int refuse(const char *what) {
    /* In CRIU's log: a cr_system child's stderr is it. */
    dprintf(2, "smr criu-root.so: refused to run %s: the node agent's CRIU runs no program "
            "(with the container's root as /, it would be the image's, run as root)\n",
            what ? what : "a program");
    errno = EACCES;
    return -1;
}

int execve(const char *path, char *const argv[], char *const envp[]) {
    if (active)
        return refuse(path);
    return NEXT(execve)(path, argv, envp);
}

int execv(const char *path, char *const argv[]) {
    if (active)
        return refuse(path);
    return NEXT(execv)(path, argv);
}

int execvp(const char *file, char *const argv[]) {
    if (active)
        return refuse(file);
    return NEXT(execvp)(file, argv);
}

int execvpe(const char *file, char *const argv[], char *const envp[]) {
    if (active)
        return refuse(file);
    return NEXT(execvpe)(file, argv, envp);
}

int fexecve(int fd, char *const argv[], char *const envp[]) {
    if (active)
        return refuse("a program by descriptor");
    return NEXT(fexecve)(fd, argv, envp);
}

int execveat(int dirfd, const char *path, char *const argv[], char *const envp[], int flags) {
    if (active)
        return refuse(path);
    return NEXT(execveat)(dirfd, path, argv, envp, flags);
}

/* The variadic forms, as glibc's: the list into an argv (and envp after it). */
#define ARGV_MAX 256
enum how { BY_PATH, BY_NAME, WITH_ENV };

static int exec_list(enum how how, const char *path, const char *arg, va_list ap) {
    if (active)
        return refuse(path);
    char *argv[ARGV_MAX];
    size_t i = 0;
    argv[i++] = (char *)arg;
    while (i < ARGV_MAX && (argv[i] = va_arg(ap, char *)) != NULL)
        i++;
    if (i == ARGV_MAX) {
        errno = E2BIG;
        return -1;
    }
    if (how == WITH_ENV)
        return NEXT(execve)(path, argv, va_arg(ap, char *const *));
    return how == BY_NAME ? NEXT(execvp)(path, argv) : NEXT(execv)(path, argv);
}

int execl(const char *path, const char *arg, ...) {
    va_list ap;
    va_start(ap, arg);
    int rc = exec_list(BY_PATH, path, arg, ap);
    va_end(ap);
    return rc;
}

int execlp(const char *file, const char *arg, ...) {
    va_list ap;
    va_start(ap, arg);
    int rc = exec_list(BY_NAME, file, arg, ap);
    va_end(ap);
    return rc;
}

int execle(const char *path, const char *arg, ...) {
    va_list ap;
    va_start(ap, arg);
    int rc = exec_list(WITH_ENV, path, arg, ap);
    va_end(ap);
    return rc;
}

int posix_spawn(pid_t *pid, const char *path, const posix_spawn_file_actions_t *actions,
                const posix_spawnattr_t *attr, char *const argv[], char *const envp[]) {
    if (active) {
        refuse(path);
        return EACCES;
    }
    return NEXT(posix_spawn)(pid, path, actions, attr, argv, envp);
}

int posix_spawnp(pid_t *pid, const char *file, const posix_spawn_file_actions_t *actions,
                 const posix_spawnattr_t *attr, char *const argv[], char *const envp[]) {
    if (active) {
        refuse(file);
        return EACCES;
    }
    return NEXT(posix_spawnp)(pid, file, actions, attr, argv, envp);
}

int system(const char *command) {
    if (active)
        return refuse(command);
    return NEXT(system)(command);
}

FILE *popen(const char *command, const char *type) {
    if (active) {
        refuse(command);
        return NULL;
    }
    return NEXT(popen)(command, type);
}
