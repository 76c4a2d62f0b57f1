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
 * $SMR_INIT_TIMEOUT seconds (default 30) it starts COMMAND fresh.
 *
 * Then it is a plain init: it forwards SIGTERM and friends to the workload,
 * reaps every child, and exits with the workload's status (also when a
 * restored root exited before the agent named it); while the agent holds it
 * (a file `hold`, during a checkpoint) it waits before exiting. The agent
 * touches `hold` every HOLD_REFRESH_S (services/checkpointer/pod.py); a hold
 * not touched for HOLD_STALE_S (a crashed agent's) is ignored.
 *
 * A static C binary, so it runs in any image (no libc, shell or Python
 * needed there). `smr-init --set-last-pid N` writes the namespace's
 * ns_last_pid: the agent uses it so that its own tools, run inside the
 * namespace, take PIDs far from the ones a restore needs.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
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
   before the agent names it, and its status is the container's. */
static pid_t early_pid[64];
static int early_status[64], early_n;

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

static void forward(int sig) {
    if (workload > 0) kill(workload, sig);
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static pid_t start(char **argv) {
    pid_t pid = fork();
    if (pid < 0) die("fork");
    if (pid == 0) {
        sigset_t all;
        sigemptyset(&all);
        sigprocmask(SIG_SETMASK, &all, NULL);
        setsid();  /* CRIU dumps a tree whose root leads its own session */
        execvp(argv[0], argv);
        fprintf(stderr, "smr-init: cannot run %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    return pid;
}

int main(int argc, char **argv) {
    if (argc == 3 && strcmp(argv[1], "--set-last-pid") == 0) {
        int fd = open("/proc/sys/kernel/ns_last_pid", O_WRONLY);
        if (fd < 0 || write(fd, argv[2], strlen(argv[2])) < 0) die("ns_last_pid");
        return 0;
    }
    int first = 1;
    if (argc > 1 && strcmp(argv[1], "--") == 0) first = 2;
    if (first >= argc) {
        fprintf(stderr, "usage: smr-init [--] COMMAND [ARG...]\n");
        return 64;
    }
    const char *base = getenv("SMR_INIT_DIR"), *name = getenv("SMR_CONTAINER");
    const char *limit = getenv("SMR_INIT_TIMEOUT");
    snprintf(dir, sizeof dir, "%s/%s", base && *base ? base : "/smr",
             name && *name ? name : "main");
    double timeout = limit && *limit ? atof(limit) : 30.0;
    mkdirs(dir);

    static const int sigs[] = {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2};
    struct sigaction sa = {0};
    sa.sa_handler = forward;
    for (size_t i = 0; i < sizeof sigs / sizeof *sigs; i++) sigaction(sigs[i], &sa, NULL);

    /* A decision left by an earlier start of this container is not ours. */
    char path[4200];
    snprintf(path, sizeof path, "%s/decision", dir);
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
            fprintf(stderr, "smr-init: no answer from the smr node agent within %.0fs; "
                            "starting fresh\n", timeout);
            workload = start(argv + first);
            how = "fresh";
        }
        if (!how) {
            int st;
            pid_t dead;
            while ((dead = waitpid(-1, &st, WNOHANG)) > 0) {  /* the agent's helpers */
                early_pid[early_n % 64] = dead;
                early_status[early_n++ % 64] = st;
            }
            usleep(50000);
        }
    }
    snprintf(line, sizeof line, "running %d %s\n", (int)workload, how);
    put("status", line);

    for (;;) {
        int st = 0;
        pid_t pid = -1;
        for (int i = 0; i < early_n && i < 64; i++)
            if (early_pid[i] == workload) { pid = workload; st = early_status[i]; }
        if (pid < 0) pid = waitpid(-1, &st, 0);
        if (pid < 0) {
            if (errno == EINTR) continue;
            if (errno == ECHILD && kill(workload, 0) < 0) return 0;
            usleep(100000);  /* restored root not reparented to us yet */
            continue;
        }
        if (pid == workload) {
            put("status", "exited\n");
            /* A checkpoint in progress holds us until it is stored. */
            snprintf(path, sizeof path, "%s/hold", dir);
            struct stat hs;
            while (stat(path, &hs) == 0 && time(NULL) - hs.st_mtime < HOLD_STALE_S)
                usleep(100000);
            return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        }
    }
}
