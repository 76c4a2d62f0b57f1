/*
 * smr-runtime: an OCI runtime that puts smr-init in front of opted-in
 * containers, then hands every call to the real runtime (runc, or the NVIDIA
 * runtime on GPU nodes), the way nvidia-container-runtime wraps runc.
 *
 * containerd runs it as the BinaryName of the runtime handler `smr` (the
 * RuntimeClass the smr webhook gives opted-in pods), with runc's command line.
 * On `create`, for a container whose process environment has
 * SMR_CONTAINER=<name> (the webhook adds it to the containers it opts in) and
 * that is not a pod sandbox, it edits the bundle's config.json:
 *
 *   mounts       /smr             <- STATE/<container id>: a tmpfs of its own, SIZE
 *                                    bytes at most, nodev,nosuid,noexec, owned by
 *                                    the container's user (smr-init's state, the
 *                                    agent's answers: a few small files)
 *                /smr/smr-init    <- INIT                  (read-only)
 *   process.args [/smr/smr-init, --, <the args as resolved from the image
 *                 ENTRYPOINT/CMD and the pod's command/args>]
 *
 * The tmpfs is the pod's own: its pages are charged to the container's memory
 * cgroup, and SIZE bounds them, so a workload cannot fill the host's /run.
 *
 * On `delete`, once the real runtime is done, it unmounts that tmpfs (detached:
 * a process still holding it keeps only its own pages) and removes the mount
 * point by descriptors: every directory opened O_NOFOLLOW from its parent,
 * every entry unlinked relative to it, no device crossed. Nothing there is
 * ever reached through a path the workload could have swapped a link into.
 * Anything else passes through untouched. It never fails a container start
 * because of smr: if the edit cannot be made, it logs why and passes through.
 *
 * Settings come from smr-runtime.env beside the binary (KEY=VALUE lines):
 *   RUNTIME  the real runtime (default: runc on PATH)
 *   INIT     the host's smr-init (default: smr-init beside this binary)
 *   STATE    per-container directories (default: /run/smr/containers)
 *   SIZE     each container's /smr tmpfs, as tmpfs's size= takes it (default: 4m)
 *   LOG      a file to append to (default: stderr, which containerd logs)
 *   AGENT_MARK  a file the node agent touches while it runs (install.py names it)
 *   AGENT_WAIT  seconds (default: 0, none): a container created within this
 *            long of the agent's last touch of AGENT_MARK gets
 *            SMR_INIT_AGENT_WAIT, the seconds left of it, in its environment:
 *            smr-init then waits that long for an agent (one being replaced, in
 *            a DaemonSet rollout, or restarting) before it gives up on one
 *            (docs/kubernetes.md, "Upgrading smr"). No mark, or an older one:
 *            no agent is coming, and smr-init's own SMR_INIT_TIMEOUT applies.
 *
 * A static C binary: it runs on the host, which may have nothing else. JSON
 * through cJSON (Debian's source package, built in by `make setup`).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cJSON.h"

#define INIT_IN_CONTAINER "/smr/smr-init"
/* smr-init's status, the agent's decision, hold, lock and notes: a few lines. */
#define DEFAULT_SIZE "4m"
#define MAX_INODES 1024
#define MAX_DEPTH 64

static char runtime[PATH_MAX] = "runc", init_path[PATH_MAX] = "",
            state[PATH_MAX] = "/run/smr/containers", log_path[PATH_MAX] = "",
            size[PATH_MAX] = DEFAULT_SIZE, agent_mark[PATH_MAX] = "",
            agent_wait[PATH_MAX] = "0";

static void say(const char *fmt, ...) {
    FILE *out = stderr;
    if (*log_path) out = fopen(log_path, "a");
    if (!out) out = stderr;
    va_list ap;
    va_start(ap, fmt);
    fprintf(out, "smr-runtime[%d]: ", (int)getpid());
    vfprintf(out, fmt, ap);
    fputc('\n', out);
    va_end(ap);
    if (out != stderr) fclose(out);
}

static void load_settings(void) {
    char self[PATH_MAX], conf[PATH_MAX + 32];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) return;
    self[n] = 0;
    char *dir = dirname(self);
    snprintf(init_path, sizeof init_path, "%s/smr-init", dir);
    snprintf(conf, sizeof conf, "%s/smr-runtime.env", dir);
    FILE *f = fopen(conf, "r");
    if (!f) return;
    char line[PATH_MAX + 16];
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\r\n")] = 0;
        char *eq = strchr(line, '=');
        if (!eq || line[0] == '#') continue;
        *eq = 0;
        char *dst = !strcmp(line, "RUNTIME") ? runtime : !strcmp(line, "INIT") ? init_path
                  : !strcmp(line, "STATE") ? state : !strcmp(line, "LOG") ? log_path
                  : !strcmp(line, "SIZE") ? size
                  : !strcmp(line, "AGENT_MARK") ? agent_mark
                  : !strcmp(line, "AGENT_WAIT") ? agent_wait : NULL;
        if (dst) snprintf(dst, PATH_MAX, "%s", eq + 1);
    }
    fclose(f);
}

/* runc's global options that take a value (before the command). */
static int takes_value(const char *opt) {
    static const char *with[] = {"--root", "--log", "--log-format", "--criu", "--rootless"};
    for (size_t i = 0; i < sizeof with / sizeof *with; i++)
        if (!strcmp(opt, with[i])) return 1;
    return 0;
}

/* The index of the command (create, start, delete, ...), or -1. */
static int command_index(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        if (argv[i][0] != '-') return i;
        if (!strchr(argv[i], '=') && takes_value(argv[i])) i++;
    }
    return -1;
}

static char *read_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    if (fseek(f, 0, SEEK_END) != 0) { fclose(f); return NULL; }
    long size = ftell(f);
    rewind(f);
    char *buf = size >= 0 ? malloc((size_t)size + 1) : NULL;
    if (buf && fread(buf, 1, (size_t)size, f) != (size_t)size) { free(buf); buf = NULL; }
    if (buf) buf[size] = 0;
    fclose(f);
    return buf;
}

static int write_file(const char *path, const char *text) {
    char tmp[PATH_MAX * 2 + 16];
    snprintf(tmp, sizeof tmp, "%s.smr-tmp", path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) return -1;
    size_t len = strlen(text);
    int ok = write(fd, text, len) == (ssize_t)len && fsync(fd) == 0;
    close(fd);
    if (!ok || rename(tmp, path) != 0) { unlink(tmp); return -1; }
    return 0;
}

/* A container name (SMR_CONTAINER) or id: a single path component. */
static int valid_part(const char *s, size_t max) {
    size_t n = strlen(s);
    if (n == 0 || n > max || s[0] == '.') return 0;
    for (size_t i = 0; i < n; i++)
        if (!(s[i] == '-' || s[i] == '_' || s[i] == '.' || (s[i] >= '0' && s[i] <= '9')
              || (s[i] >= 'a' && s[i] <= 'z') || (s[i] >= 'A' && s[i] <= 'Z'))) return 0;
    return 1;
}

/* mkdir -p: STATE's parents need not exist (/run is a fresh tmpfs at boot). */
static int mkdirs(const char *path, mode_t mode) {
    char buf[PATH_MAX];
    snprintf(buf, sizeof buf, "%s", path);
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(buf, 0755) != 0 && errno != EEXIST) return -1;
        *p = '/';
    }
    return mkdir(buf, mode) != 0 && errno != EEXIST ? -1 : 0;
}

/* The host id of container id `id` under a user namespace's mappings (none:
   the same id). */
static long host_id(cJSON *maps, long id) {
    if (!cJSON_IsArray(maps) || cJSON_GetArraySize(maps) == 0) return id;
    cJSON *m;
    cJSON_ArrayForEach(m, maps) {
        cJSON *c = cJSON_GetObjectItemCaseSensitive(m, "containerID"),
              *h = cJSON_GetObjectItemCaseSensitive(m, "hostID"),
              *n = cJSON_GetObjectItemCaseSensitive(m, "size");
        if (cJSON_IsNumber(c) && cJSON_IsNumber(h) && cJSON_IsNumber(n)
            && id >= (long)c->valuedouble && id < (long)c->valuedouble + (long)n->valuedouble)
            return (long)h->valuedouble + id - (long)c->valuedouble;
    }
    return -1;
}

/* A tmpfs size as its size= option takes it: a number, k, m or g after. */
static int valid_size(const char *s) {
    size_t n = strspn(s, "0123456789");
    return n > 0 && n < 16 && (s[n] == 0 || (strchr("kmgKMG", s[n]) && s[n + 1] == 0));
}

/* Detach every mount at `dir` (its /smr tmpfs): a process still holding it
   keeps only what it holds; the mount point is left. */
static void unmount_state(const char *dir) {
    for (int i = 0; i < 8 && umount2(dir, MNT_DETACH | UMOUNT_NOFOLLOW) == 0; i++) {}
}

/* Remove `name` in the directory `parent` and everything under it, never by
   path: each directory is opened O_NOFOLLOW from its parent's descriptor and
   must be on `dev`, each entry is unlinked relative to it. A directory the
   workload swaps for a symlink meanwhile is unlinked as the link it now is;
   nothing outside is reached. */
static void remove_at(int parent, const char *name, dev_t dev, int depth) {
    if (unlinkat(parent, name, 0) == 0 || errno != EISDIR) return;
    int fd = openat(parent, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOTDIR || errno == ELOOP) unlinkat(parent, name, 0);  /* swapped: a link */
        return;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || st.st_dev != dev || depth > MAX_DEPTH) {
        say("left %s in place: %s", name, depth > MAX_DEPTH ? "nested too deep"
                                          : "on another file system than its parent");
        close(fd);
        return;
    }
    DIR *d = fdopendir(fd);
    if (!d) { close(fd); return; }
    /* Entries removed while listed may hide others: listed again, a few
       times at most (a process still holding it could add forever). */
    for (int pass = 0; pass < 4; pass++) {
        int seen = 0;
        rewinddir(d);
        for (struct dirent *e; (e = readdir(d));) {
            if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
            remove_at(dirfd(d), e->d_name, dev, depth + 1);
            seen = 1;
        }
        if (!seen) break;
    }
    closedir(d);
    unlinkat(parent, name, AT_REMOVEDIR);
}

/* A container's state: its tmpfs unmounted, then the mount point removed. */
static void remove_state(const char *id) {
    char dir[PATH_MAX * 2];
    snprintf(dir, sizeof dir, "%s/%s", state, id);
    unmount_state(dir);
    int top = open(state, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    struct stat st;
    if (top >= 0 && fstat(top, &st) == 0) remove_at(top, id, st.st_dev, 0);
    if (top >= 0) close(top);
}

static cJSON *bind_mount(const char *dst, const char *src, const char *mode) {
    cJSON *m = cJSON_CreateObject(), *opts = cJSON_CreateArray();
    cJSON_AddStringToObject(m, "destination", dst);
    cJSON_AddStringToObject(m, "type", "bind");
    cJSON_AddStringToObject(m, "source", src);
    /* noexec for /smr: the options of a bind are its own, not its source's. */
    const char *o[] = {"rbind", mode, "nosuid", "nodev", "noexec"};
    size_t n = strcmp(dst, INIT_IN_CONTAINER) ? 5 : 4;
    for (size_t i = 0; i < n; i++) cJSON_AddItemToArray(opts, cJSON_CreateString(o[i]));
    cJSON_AddItemToObject(m, "options", opts);
    return m;
}

/* SMR_INIT_AGENT_WAIT: how much longer than its start timeout smr-init may
   wait for the node's agent (see AGENT_WAIT at the top). Any value the
   pod's manifest set goes first: the node's setting decides. */
static void set_agent_wait(cJSON *proc) {
    cJSON *env = cJSON_GetObjectItemCaseSensitive(proc, "env");
    if (!cJSON_IsArray(env)) {
        cJSON_DeleteItemFromObjectCaseSensitive(proc, "env");
        env = cJSON_AddArrayToObject(proc, "env");
    }
    for (int i = cJSON_GetArraySize(env) - 1; i >= 0; i--) {
        cJSON *e = cJSON_GetArrayItem(env, i);
        if (cJSON_IsString(e) && !strncmp(e->valuestring, "SMR_INIT_AGENT_WAIT=", 20))
            cJSON_DeleteItemFromArray(env, i);
    }
    long wait = atol(agent_wait), left = 0;
    struct stat st;
    if (*agent_mark && wait > 0 && stat(agent_mark, &st) == 0) {
        long age = (long)(time(NULL) - st.st_mtime);
        left = age < 0 ? wait : wait - age;
    }
    if (left <= 0) return;
    char line[64];
    snprintf(line, sizeof line, "SMR_INIT_AGENT_WAIT=%ld", left);
    cJSON_AddItemToArray(env, cJSON_CreateString(line));
}

/* Wrap the container of bundle `dir` if it is ours. Returns a reason it was
   left alone (NULL: wrapped), for the log. */
static const char *wrap(const char *bundle, const char *id) {
    char path[PATH_MAX * 2];
    snprintf(path, sizeof path, "%s/config.json", bundle);
    char *text = read_file(path);
    if (!text) return "cannot read config.json";
    cJSON *spec = cJSON_Parse(text);
    free(text);
    if (!spec) return "config.json is not JSON";
    const char *why = NULL;
    cJSON *ann = cJSON_GetObjectItemCaseSensitive(spec, "annotations");
    cJSON *type = cJSON_GetObjectItemCaseSensitive(ann, "io.kubernetes.cri.container-type");
    cJSON *proc = cJSON_GetObjectItemCaseSensitive(spec, "process");
    cJSON *args = cJSON_GetObjectItemCaseSensitive(proc, "args");
    cJSON *env = cJSON_GetObjectItemCaseSensitive(proc, "env"), *e;
    const char *name = NULL;
    cJSON_ArrayForEach(e, env) {
        if (cJSON_IsString(e) && !strncmp(e->valuestring, "SMR_CONTAINER=", 14))
            name = e->valuestring + 14;
    }
    cJSON *first = cJSON_GetArrayItem(args, 0);
    if (cJSON_IsString(type) && !strcmp(type->valuestring, "sandbox")) why = "a pod sandbox";
    else if (!name) why = "not opted in (no SMR_CONTAINER)";
    else if (!valid_part(name, 63)) why = "SMR_CONTAINER is not a container name";
    else if (!cJSON_IsArray(args) || !cJSON_IsString(first)) why = "no process.args";
    else if (!strcmp(first->valuestring, INIT_IN_CONTAINER)) why = "already wrapped";
    if (why) { cJSON_Delete(spec); return why; }

    char dir[PATH_MAX * 2], mountpoint[PATH_MAX * 2 + 16], opts[PATH_MAX + 96];
    snprintf(dir, sizeof dir, "%s/%s", state, id);
    snprintf(mountpoint, sizeof mountpoint, "%s/smr-init", dir);
    /* /smr belongs to the container's user, whatever its uid: smr-init writes
       its status there as that user. */
    cJSON *user = cJSON_GetObjectItemCaseSensitive(proc, "user");
    cJSON *uid = cJSON_GetObjectItemCaseSensitive(user, "uid");
    cJSON *gid = cJSON_GetObjectItemCaseSensitive(user, "gid");
    cJSON *linux_ = cJSON_GetObjectItemCaseSensitive(spec, "linux");
    long hu = host_id(cJSON_GetObjectItemCaseSensitive(linux_, "uidMappings"),
                      cJSON_IsNumber(uid) ? (long)uid->valuedouble : 0);
    long hg = host_id(cJSON_GetObjectItemCaseSensitive(linux_, "gidMappings"),
                      cJSON_IsNumber(gid) ? (long)gid->valuedouble : 0);
    int mounted = 0;
    if (!valid_size(size)) why = "SIZE in smr-runtime.env is not a tmpfs size (such as 4m)";
    else if (hu < 0 || hg < 0) why = "its user has no id on the host";
    else if (mkdirs(state, 0711) != 0) why = "cannot create STATE";
    else if (mkdir(dir, 0700) != 0 && errno != EEXIST) why = "cannot create its state directory";
    if (!why) {
        /* A tmpfs of its own: bounded, charged to the container's memory
           cgroup as it writes, never the host's /run. An earlier create's
           (the same id) goes first. */
        unmount_state(dir);
        snprintf(opts, sizeof opts, "size=%s,nr_inodes=%d,mode=0755,uid=%ld,gid=%ld",
                 size, MAX_INODES, hu, hg);
        if (mount("smr", dir, "tmpfs", MS_NODEV | MS_NOSUID | MS_NOEXEC, opts) != 0)
            why = "cannot mount its /smr tmpfs";
        else
            mounted = 1;
    }
    int fd = why ? -1 : open(mountpoint, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                             0755);
    if (!why && fd < 0) why = "cannot create the smr-init mount point";
    if (fd >= 0) close(fd);
    if (!why && access(init_path, X_OK) != 0) why = "the host's smr-init is missing";
    if (why) {
        if (mounted) unmount_state(dir);
        cJSON_Delete(spec);
        return why;
    }

    cJSON *mounts = cJSON_GetObjectItemCaseSensitive(spec, "mounts");
    if (!cJSON_IsArray(mounts)) {
        cJSON_DeleteItemFromObjectCaseSensitive(spec, "mounts");
        mounts = cJSON_AddArrayToObject(spec, "mounts");
    }
    cJSON_AddItemToArray(mounts, bind_mount("/smr", dir, "rw"));
    cJSON_AddItemToArray(mounts, bind_mount(INIT_IN_CONTAINER, init_path, "ro"));
    cJSON_InsertItemInArray(args, 0, cJSON_CreateString("--"));
    cJSON_InsertItemInArray(args, 0, cJSON_CreateString(INIT_IN_CONTAINER));
    set_agent_wait(proc);
    char *out = cJSON_PrintUnformatted(spec);
    cJSON_Delete(spec);
    if (!out || write_file(path, out) != 0) why = "cannot write config.json";
    free(out);
    return why;
}

int main(int argc, char **argv) {
    load_settings();
    int c = command_index(argc, argv);
    const char *cmd = c > 0 ? argv[c] : "";
    const char *id = c > 0 && c < argc - 1 ? argv[argc - 1] : NULL;
    if (id && (!strcmp(cmd, "create") || !strcmp(cmd, "run"))) {
        const char *bundle = ".";
        for (int i = c + 1; i < argc; i++) {
            if ((!strcmp(argv[i], "--bundle") || !strcmp(argv[i], "-b")) && i + 1 < argc)
                bundle = argv[i + 1];
            else if (!strncmp(argv[i], "--bundle=", 9))
                bundle = argv[i] + 9;
        }
        const char *why = valid_part(id, 128) ? wrap(bundle, id) : "an unexpected container id";
        if (why) {
            if (strcmp(why, "not opted in (no SMR_CONTAINER)") && strcmp(why, "a pod sandbox"))
                say("container %s left as it is: %s", id, why);
        } else {
            say("container %s starts through smr-init", id);
        }
    }
    argv[0] = runtime;
    /* `delete`, and a `run` in the foreground (runc removes the container
       when it ends; containerd never uses it): the real runtime first, then
       the container's state. */
    int detached = 0;
    for (int i = c + 1; c > 0 && i < argc; i++)
        detached |= !strcmp(argv[i], "-d") || !strcmp(argv[i], "--detach");
    if (id && valid_part(id, 128)
        && (!strcmp(cmd, "delete") || (!strcmp(cmd, "run") && !detached))) {
        pid_t pid = fork();
        if (pid == 0) {
            execvp(runtime, argv);
            _exit(127);
        }
        int st = 0;
        while (pid > 0 && waitpid(pid, &st, 0) < 0 && errno == EINTR) {}
        if (pid > 0 && (!strcmp(cmd, "run") || (WIFEXITED(st) && WEXITSTATUS(st) == 0)))
            remove_state(id);
        return pid < 0 ? 127 : WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    }
    execvp(runtime, argv);
    say("cannot run the real runtime %s: %s", runtime, strerror(errno));
    return 127;
}
