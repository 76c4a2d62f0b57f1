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
 * Only where SMR_CRIU_ENTER_ROOT=1 (the agent's runs); CRIU's configuration
 * files and plugins are kept out by its options (--no-default-config, -L).
 * A failure ends the process before CRIU could resolve a path against the
 * wrong root.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

__attribute__((constructor)) static void enter_container_root(void) {
    const char *want = getenv("SMR_CRIU_ENTER_ROOT");
    if (!want || strcmp(want, "1") != 0)
        return;
    unsetenv("SMR_CRIU_ENTER_ROOT");
    int ns = open("/proc/self/ns/mnt", O_RDONLY | O_CLOEXEC);
    if (ns < 0 || setns(ns, CLONE_NEWNS) != 0) {
        perror("smr criu-root.so: cannot take the container's root as / "
               "(setns of its own mount namespace)");
        _exit(125);
    }
    close(ns);
}
