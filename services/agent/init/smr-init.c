/*
 * smr-init: PID 1 of a workload container that smr can restore.
 *
 *   smr-init [--] COMMAND [ARG...]
 *
 * It runs in front of the real command. At start it announces itself in its
 * state directory ($SMR_INIT_DIR/$SMR_CONTAINER, default /smr/main) and waits
 * for the node agent's decision:
 *
 *   fresh            run COMMAND (no checkpoint, or one the policy may skip)
 *   restoring        the agent is restoring a checkpoint into this container:
 *                    keep waiting, without the start timeout
 *   restored PID     the restored process tree runs; PID is its root, which
 *                    the kernel reparents to us, the namespace's init
 *   fail MESSAGE     exit 70 with MESSAGE (the policy forbids a fresh start)
 *
 * Nothing else runs in the PID namespace before the decision, so the PIDs a
 * restore needs are free. Without an agent answer within
 * $SMR_INIT_TIMEOUT seconds (default 30) it starts COMMAND fresh, unless
 * $SMR_RESTORE_FAILURE is `fail` (the webhook sets it from the pod's label
 * restore-failure: fail): then it exits 70 as for `fail`, and the kubelet's
 * restart asks the agent again. No answer may mean a checkpoint that was
 * not restored, and a fresh run's next checkpoint would become the latest.
 * Where the node's agent ran a moment before the container was created (it
 * is being replaced, in a DaemonSet rollout, or restarts), smr-runtime sets
 * $SMR_INIT_AGENT_WAIT: smr-init then waits that long instead, when it is
 * longer, since an agent is coming. Started fresh for want of an answer, it
 * writes why to `unanswered`; the agent, when one comes, posts it in a
 * Warning Event on the pod (services/agent/unanswered.py).
 *
 * Then it is a plain init: it forwards SIGTERM and friends to the workload,
 * reaps every child, and exits with the workload's status (also when a
 * restored root exited before the agent named it); while the agent holds it
 * (a file `hold`, during a checkpoint) it waits before exiting. The agent
 * touches `hold` every HOLD_REFRESH_S (services/checkpointer/pod.py); a hold
 * not touched for HOLD_STALE_S (a crashed agent's) is ignored.
 *
 * While `hold` is held (a dump is in progress) no signal is forwarded: it is
 * kept here and forwarded once the hold is gone, to this workload only. A
 * signal the workload had pending when CRIU froze it would be saved in the
 * image and delivered again to every restored copy (a SIGTERM meant for the
 * original would stop them all). The agent creates `hold` and smr-init
 * forwards under one flock (`signal.lock`), so each signal is either
 * forwarded before the hold (and recorded in `signalled`, which the agent
 * reads under the lock) or after the dump.
 *
 *   smr-init --started
 *
 * The startupProbe the webhook gives an opted-in container with a liveness
 * probe: it succeeds once the workload runs (started fresh or restored), so
 * the kubelet's liveness probes, which start only then, cannot kill the
 * container during a long restore (each kill would start another restore).
 *
 *   smr-init --wait-final SECONDS
 *
 * The preStop hook the webhook gives an opted-in container (the kubelet runs
 * it, inside the container, before it sends SIGTERM): it waits until the
 * agent reports the final checkpoint (file `final`: "done GENERATION" or
 * "failed CODE"), the workload is no longer running (and no dump holds
 * the container), or SECONDS have passed,
 * and says which. It always exits 0: the kubelet goes on to SIGTERM anyway.
 *
 *   smr-init --local [--] COMMAND [ARG...]
 *
 * PID 1 of a local job's PID namespace (`smr exec`, smr/jobs.py): no agent,
 * no state directory; it runs COMMAND at once, forwards the signals above to
 * it, reaps every child and exits with its status. It stays root when the
 * workload drops to another user: CRIU asks the root of the dumped tree for a
 * /proc of its PID namespace, and a root that is not root cannot mount one
 * (criu/pie/parasite.c: "can't dump unprivileged task whose /proc doesn't
 * belong to it"). It moves to / once COMMAND runs, so that /proc, mounted
 * for a moment in its working directory, lands in neither the job's directory
 * nor a read-only one.
 *
 *   smr-init --local-ns [--] COMMAND [ARG...]
 *
 * What `smr exec` runs (smr/jobs.py): makes the job's PID and IPC namespaces
 * (unshare), forks the namespace's PID 1, a `smr-init --local` in its own
 * session, waits for it and exits with its status, quietly. util-linux's
 * `unshare --fork` did this before, and after a killed child (every final
 * checkpoint) wrote "unshare: sigprocmask unblock failed" into the job's log.
 *
 * A static C binary, so it runs in any image (no libc, shell or Python
 * needed there). `smr-init --set-last-pid N` writes the namespace's
 * ns_last_pid: the agent uses it so that its own tools, run inside the
 * namespace, take PIDs far from the ones a restore needs.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <sched.h>
#include <sys/prctl.h>
#include <sys/file.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define HOLD_STALE_S 60

static char dir[4096];
static volatile pid_t workload = -1;
/* Children reaped while waiting for the decision: a restored root may exit
   before the agent names it, and its status is the container's. One entry
   per PID (its last exit), however many orphans end meanwhile: a fixed ring
   lost the root's among more than its size. */
static pid_t *early_pid;
static int *early_status;
static size_t early_n, early_cap;

static void note_early(pid_t pid, int st) {
    for (size_t i = 0; i < early_n; i++)
        if (early_pid[i] == pid) { early_status[i] = st; return; }
    if (early_n == early_cap) {
        size_t cap = early_cap ? 2 * early_cap : 64;
        pid_t *p = realloc(early_pid, cap * sizeof *p);
        if (p) early_pid = p;
        int *s = p ? realloc(early_status, cap * sizeof *s) : NULL;
        if (s) early_status = s;
        if ((!p || !s) && early_n == 0) return;  /* out of memory, nothing to give way */
        if (!p || !s) {  /* out of memory: the oldest entry gives way */
            memmove(early_pid, early_pid + 1, (early_n - 1) * sizeof *early_pid);
            memmove(early_status, early_status + 1, (early_n - 1) * sizeof *early_status);
            early_n--;
        } else {
            early_cap = cap;
        }
    }
    early_pid[early_n] = pid;
    early_status[early_n++] = st;
}

static void die(const char *what) {
    fprintf(stderr, "smr-init: %s: %s\n", what, strerror(errno));
    exit(70);
}

/* Write path atomically (a reader never sees half a line). */
static void put(const char *name, const char *text) {
    char path[4200], tmp[4210];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) die(tmp);
    if (write(fd, text, strlen(text)) < 0) die(tmp);
    close(fd);
    if (rename(tmp, path) < 0) die(path);
}

static int get(const char *name, char *buf, size_t n) {
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    int fd = open(path, O_RDONLY);
    if (fd < 0) return -1;
    ssize_t r = read(fd, buf, n - 1);
    close(fd);
    if (r < 0) return -1;
    buf[r] = 0;
    return 0;
}

static void mkdirs(const char *path) {
    char p[4096];
    snprintf(p, sizeof p, "%s", path);
    for (char *s = p + 1; *s; s++)
        if (*s == '/') { *s = 0; mkdir(p, 0755); *s = '/'; }
    if (mkdir(p, 0755) < 0 && errno != EEXIST) die(p);
}

/* The signals forwarded to the workload: those a user or the runtime sends
   to ask something of it. The runtime's stop signal is the image's
   STOPSIGNAL (httpd's SIGWINCH, systemd's SIGRTMIN+3): as PID 1 without a
   handler, smr-init would drop it, and the container would wait out its
   whole grace period. Every real-time signal, then (sigs_init). */
static int sigs[8 + 64];
static size_t NSIGS;
static volatile sig_atomic_t pending[sizeof sigs / sizeof *sigs];

static void sigs_init(void) {
    static const int named[] = {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGWINCH};
    NSIGS = 0;
    for (size_t i = 0; i < sizeof named / sizeof *named; i++) sigs[NSIGS++] = named[i];
    for (int s = SIGRTMIN; s <= SIGRTMAX && NSIGS < sizeof sigs / sizeof *sigs; s++)
        sigs[NSIGS++] = s;
}

static void note(int sig) {
    for (size_t i = 0; i < NSIGS; i++)
        if (sigs[i] == sig) pending[i] = 1;
}

/* A dump holds the container: `hold` exists and was touched within
   HOLD_STALE_S (a crashed agent's hold must not keep signals or the exit
   back for ever). */
static int held(void) {
    char path[4200];
    struct stat hs;
    snprintf(path, sizeof path, "%s/hold", dir);
    return stat(path, &hs) == 0 && time(NULL) - hs.st_mtime < HOLD_STALE_S;
}

/* Forward the signals that came, unless a dump holds them (see the top). */
static int forward_pending(void) {
    int waiting = 0;
    for (size_t i = 0; i < NSIGS; i++) waiting |= pending[i];
    if (!waiting || workload <= 0) return waiting;
    char path[4200];
    snprintf(path, sizeof path, "%s/signal.lock", dir);
    /* Read-only: flock needs no more, and the agent (root) may have created
       it, 0644, for a workload of another user. */
    int lock = open(path, O_RDONLY | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (lock >= 0) flock(lock, LOCK_EX);
    int holding = held();
    if (!holding) {
        for (size_t i = 0; i < NSIGS; i++) {
            if (!pending[i]) continue;
            pending[i] = 0;
            if (sigs[i] == SIGTERM || sigs[i] == SIGINT || sigs[i] == SIGQUIT) {
                char line[64];
                snprintf(line, sizeof line, "%d\n", sigs[i]);
                put("signalled", line);
            }
            kill(workload, sigs[i]);
        }
    }
    if (lock >= 0) close(lock);
    return holding;
}

static void unput(const char *name) {
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    unlink(path);
}

static int wait_final(const char *seconds) {
    double limit = atof(seconds), t0;
    char line[4096];
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    t0 = ts.tv_sec + ts.tv_nsec / 1e9;
    /* While this file exists smr-init, done, waits a moment before it ends
       the container (and this hook with it): the hook reads `final` first. */
    put("waiter", "");
    for (;;) {
        if (get("final", line, sizeof line) == 0) {
            printf("smr: final checkpoint %s", line);
            fflush(stdout);
            unput("waiter");
            return 0;
        }
        /* A final dump ends the workload before its images are stored: `hold`. */
        if (get("status", line, sizeof line) == 0 && strncmp(line, "running ", 8) != 0
            && strncmp(line, "waiting", 7) != 0 && !held()) {
            printf("smr: no final checkpoint; the workload is %s", line);
            unput("waiter");
            return 0;
        }
        clock_gettime(CLOCK_MONOTONIC, &ts);
        if (ts.tv_sec + ts.tv_nsec / 1e9 - t0 > limit) {
            printf("smr: no final checkpoint reported within %.0fs\n", limit);
            unput("waiter");
            return 0;
        }
        usleep(100000);
    }
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

/*
 * io_uring_setup fails with ENOSYS in the workload's whole tree (a seccomp
 * filter is inherited by every child, and CRIU saves and restores it): CRIU
 * cannot save an io_uring, and libuv 1.50 and later makes one in every event
 * loop (torchrun's rendezvous store), falling back to epoll only when the
 * call fails. 425 is io_uring_setup on every architecture (x32's has bit 30
 * set). Without CAP_SYS_ADMIN (a container) the kernel takes a filter only
 * with no_new_privs, which keeps setuid programs from gaining privileges.
 * SMR_IO_URING=allow in the workload's environment keeps io_uring (its
 * checkpoint is then refused: io-uring).
 */
static void no_io_uring(void) {
    const char *v = getenv("SMR_IO_URING");
    if (v && strcmp(v, "allow") == 0) return;
    struct sock_filter f[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 425, 2, 0),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 0x40000000 | 425, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS),
    };
    struct sock_fprog prog = {sizeof f / sizeof f[0], f};
    if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) == 0) return;
    if (errno == EACCES && prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0 &&
        prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) == 0) return;
    fprintf(stderr, "smr-init: io_uring stays on (seccomp: %s); a checkpoint of a "
            "process holding one is refused\n", strerror(errno));
}

static pid_t start(char **argv) {
    pid_t pid = fork();
    if (pid < 0) die("fork");
    if (pid == 0) {
        sigset_t all;
        sigemptyset(&all);
        sigprocmask(SIG_SETMASK, &all, NULL);
        setsid();  /* CRIU dumps a tree whose root leads its own session */
        no_io_uring();
        execvp(argv[0], argv);
        fprintf(stderr, "smr-init: cannot run %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    return pid;
}

/* smr-init --local: see the top. */
static int run_local(char **argv) {
    struct sigaction sa = {0};
    sa.sa_handler = note;  /* no SA_RESTART: a signal cuts the sleep short */
    sigs_init();
    for (size_t i = 0; i < NSIGS; i++) sigaction(sigs[i], &sa, NULL);
    workload = start(argv);
    if (chdir("/") < 0) die("chdir /");
    for (;;) {
        for (size_t i = 0; i < NSIGS; i++)
            if (pending[i]) { pending[i] = 0; kill(workload, sigs[i]); }
        int st;
        pid_t pid = waitpid(-1, &st, WNOHANG);
        if (pid == workload) return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        if (pid <= 0) usleep(100000);
    }
}

/* smr-init --local-ns: see the top. */
static int run_local_ns(char **argv) {
    if (unshare(CLONE_NEWPID | CLONE_NEWIPC) < 0) die("unshare");
    pid_t init = fork();
    if (init < 0) die("fork");
    if (init == 0) {
        setsid();  /* CRIU dumps a tree whose root leads its own session */
        return run_local(argv);
    }
    int st;
    while (waitpid(init, &st, 0) < 0)
        if (errno != EINTR) die("waitpid");
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

int main(int argc, char **argv) {
    if (argc > 2 && strcmp(argv[1], "--local-ns") == 0)
        return run_local_ns(argv + (argc > 3 && strcmp(argv[2], "--") == 0 ? 3 : 2));
    if (argc > 2 && strcmp(argv[1], "--local") == 0)
        return run_local(argv + (argc > 3 && strcmp(argv[2], "--") == 0 ? 3 : 2));
    if (argc == 3 && strcmp(argv[1], "--set-last-pid") == 0) {
        int fd = open("/proc/sys/kernel/ns_last_pid", O_WRONLY);
        if (fd < 0 || write(fd, argv[2], strlen(argv[2])) < 0) die("ns_last_pid");
        return 0;
    }
    const char *base = getenv("SMR_INIT_DIR"), *name = getenv("SMR_CONTAINER");
    const char *limit = getenv("SMR_INIT_TIMEOUT");
    const char *policy = getenv("SMR_RESTORE_FAILURE");
    const char *coming = getenv("SMR_INIT_AGENT_WAIT");
    snprintf(dir, sizeof dir, "%s/%s", base && *base ? base : "/smr",
             name && *name ? name : "main");
    if (argc == 3 && strcmp(argv[1], "--wait-final") == 0) return wait_final(argv[2]);
    if (argc == 2 && strcmp(argv[1], "--started") == 0) {
        /* The startupProbe the webhook adds: liveness probes wait for it. */
        char st[4096] = "";
        if (get("status", st, sizeof st) == 0 && strncmp(st, "running ", 8) == 0) return 0;
        printf("smr: the workload is not running yet (%s)\n", *st ? st : "no status");
        return 1;
    }
    int first = 1;
    if (argc > 1 && strcmp(argv[1], "--") == 0) first = 2;
    if (first >= argc) {
        fprintf(stderr, "usage: smr-init [--] COMMAND [ARG...]\n"
                        "       smr-init --local [--] COMMAND [ARG...]\n"
                        "       smr-init --local-ns [--] COMMAND [ARG...]\n"
                        "       smr-init --wait-final SECONDS\n"
                        "       smr-init --started\n");
        return 64;
    }
    double timeout = limit && *limit ? atof(limit) : 30.0;
    double agent_wait = coming && *coming ? atof(coming) : 0.0;
    if (agent_wait > timeout) timeout = agent_wait;
    mkdirs(dir);

    /* No SA_RESTART: a signal wakes the loops below, which forward it. */
    struct sigaction sa = {0};
    sa.sa_handler = note;
    sigs_init();
    for (size_t i = 0; i < NSIGS; i++) sigaction(sigs[i], &sa, NULL);

    /* A decision left by an earlier start of this container is not ours. */
    char path[4200];
    snprintf(path, sizeof path, "%s/decision", dir);
    unlink(path);
    snprintf(path, sizeof path, "%s/signalled", dir);
    unlink(path);
    snprintf(path, sizeof path, "%s/final", dir);
    unlink(path);
    snprintf(path, sizeof path, "%s/waiter", dir);
    unlink(path);
    snprintf(path, sizeof path, "%s/unanswered", dir);
    unlink(path);
    char line[4096];
    snprintf(line, sizeof line, "waiting %d\n", (int)getpid());
    put("status", line);

    double deadline = now() + timeout;
    const char *how = NULL;
    while (!how) {
        if (get("decision", line, sizeof line) == 0) {
            if (strncmp(line, "fresh", 5) == 0) {
                workload = start(argv + first);
                how = "fresh";
            } else if (strncmp(line, "restored ", 9) == 0) {
                workload = (pid_t)atoi(line + 9);
                how = "restored";
            } else if (strncmp(line, "fail ", 5) == 0) {
                fprintf(stderr, "smr-init: %s", line + 5);
                put("status", "failed\n");
                return 70;
            } else if (strncmp(line, "restoring", 9) == 0) {
                deadline = -1;
            }
        }
        if (!how && deadline > 0 && now() > deadline) {
            /* Why no agent answered, as far as smr-init can tell. */
            const char *why = agent_wait > 0
                ? "an agent ran on this node just before this container was created, "
                  "but none answered (is the smr-agent pod of this node running?)"
                : "no agent ran on this node lately (is the smr-agent DaemonSet installed, "
                  "and its pod on this node running?)";
            if (policy && strcmp(policy, "fail") == 0) {
                fprintf(stderr, "smr-init: no answer from the smr node agent within %gs (%s), "
                                "and the pod's policy restore-failure=fail forbids a fresh "
                                "start; exiting (the container's restart asks again)\n",
                        timeout, why);
                put("status", "failed no answer from the node agent\n");
                return 70;
            }
            fprintf(stderr, "smr-init: no answer from the smr node agent within %gs (%s); "
                            "starting fresh\n", timeout, why);
            snprintf(line, sizeof line, "no answer from the smr node agent within %gs (%s); "
                     "started fresh, not from any checkpoint\n", timeout, why);
            put("unanswered", line);
            workload = start(argv + first);
            how = "fresh";
        }
        if (!how) {
            int st;
            pid_t dead;
            while ((dead = waitpid(-1, &st, WNOHANG)) > 0)  /* the agent's helpers */
                note_early(dead, st);
            usleep(50000);
        }
    }
    snprintf(line, sizeof line, "running %d %s\n", (int)workload, how);
    put("status", line);

    for (;;) {
        int st = 0;
        pid_t pid = -1;
        /* An exit reaped while waiting is the workload's only if no process
         * of that PID lives now: a restore attempt that failed after CRIU had
         * made the tree's root (and killed it) leaves an exit under the PID
         * the next attempt's restored root takes again. */
        if (kill(workload, 0) < 0 && errno == ESRCH)
            for (size_t i = 0; i < early_n; i++)
                if (early_pid[i] == workload) { pid = workload; st = early_status[i]; }
        if (pid < 0) {
            forward_pending();
            pid = waitpid(-1, &st, WNOHANG);
            if (pid == 0) {
                /* A signal cuts this short (EINTR); a held one is retried each round. */
                usleep(100000);
                continue;
            }
        }
        if (pid < 0) {
            if (errno == EINTR) continue;
            if (errno == ECHILD && kill(workload, 0) < 0) return 0;
            usleep(100000);  /* restored root not reparented to us yet */
            continue;
        }
        if (pid == workload) {
            put("status", "exited\n");
            /* A checkpoint in progress holds us until it is stored. */
            while (held())
                usleep(100000);
            /* The preStop hook (--wait-final) reads how the final checkpoint went. */
            snprintf(path, sizeof path, "%s/final", dir);
            char waiter[4200];
            snprintf(waiter, sizeof waiter, "%s/waiter", dir);
            for (int i = 0; i < 20 && access(path, F_OK) == 0 && access(waiter, F_OK) == 0; i++)
                usleep(100000);
            return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        }
    }
}
