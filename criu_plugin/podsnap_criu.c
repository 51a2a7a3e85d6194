/*
 * podsnap's CRIU plugin: forwards CRIU's device hooks to the engine process.
 *
 * A podsnap engine listens on HOOK_DIR/<pid>.sock (HOOK_DIR: $PODSNAP_HOOK_DIR,
 * default /run/podsnap/hooks). For such a process:
 *
 *   PAUSE_DEVICES(pid)       before the task is frozen at dump: send "pause",
 *                            the engine quiesces, makes sure its state is in the
 *                            store, drops its tensors and communicators, and
 *                            answers "ok <device>" ("cpu" or "cuda").
 *                            For "cuda" the plugin then runs
 *                            `cuda-checkpoint --action lock`.
 *   CHECKPOINT_DEVICES(pid)  after freezing: the engine is frozen and cannot
 *                            answer; for "cuda" run `--action checkpoint`.
 *   RESUME_DEVICES_LATE(pid) after restore, while the task is still stopped:
 *                            for a CUDA process run `--action restore` and
 *                            `unlock` first, then leave "resume <metadata>"
 *                            in its socket ($PODSNAP_RESTORE_METADATA of the
 *                            restoring criu); once running, the engine maps
 *                            its tensors back from the store and rebuilds
 *                            communication.
 *   end of a dump            every paused engine is told to resume (it runs
 *                            on after --leave-running or a failed dump).
 *
 * For any other process every hook returns -ENOTSUP, so that other plugins
 * (CRIU's own CUDA or AMD GPU plugins) handle it. The socket's peer must be
 * the pid being dumped (SO_PEERCRED), so no process can answer for another.
 * Replies are awaited for at most $PODSNAP_HOOK_TIMEOUT seconds (default 120).
 *
 * The CUDA actions are not verified on these machines (no GPU).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <criu/criu-plugin.h>

/* Exported by the criu binary (criu/log.h is not installed with the plugin header). */
extern void print_on_level(unsigned int loglevel, const char *format, ...) __attribute__((format(printf, 2, 3)));
#define LOG_ERROR 1
#define LOG_INFO 3
#define pr_err(fmt, ...) print_on_level(LOG_ERROR, "Error (podsnap): " fmt "\n", ##__VA_ARGS__)
#define pr_info(fmt, ...) print_on_level(LOG_INFO, "podsnap: " fmt "\n", ##__VA_ARGS__)

#define MAX_TASKS 256
#define REPLY_MAX 1024


/* Devices the engines of this dump answered with, by pid (one criu run). */
static struct {
	int pid;
	int cuda;
} tasks[MAX_TASKS];
static int ntasks;

static const char *hook_dir(void)
{
	const char *dir = getenv("PODSNAP_HOOK_DIR");
	return dir && *dir ? dir : "/run/podsnap/hooks";
}

static int timeout_ms(void)
{
	const char *t = getenv("PODSNAP_HOOK_TIMEOUT");
	int s = t ? atoi(t) : 0;
	return (s > 0 ? s : 120) * 1000;
}

static int socket_path(int pid, struct sockaddr_un *addr)
{
	memset(addr, 0, sizeof(*addr));
	addr->sun_family = AF_UNIX;
	int n = snprintf(addr->sun_path, sizeof(addr->sun_path), "%s/%d.sock", hook_dir(), pid);
	return n > 0 && (size_t)n < sizeof(addr->sun_path) ? 0 : -1;
}

static int is_podsnap_engine(int pid)
{
	struct sockaddr_un addr;
	struct stat st;
	return socket_path(pid, &addr) == 0 && stat(addr.sun_path, &st) == 0 && S_ISSOCK(st.st_mode);
}

static long elapsed_ms(const struct timespec *since)
{
	struct timespec now;
	clock_gettime(CLOCK_MONOTONIC, &now);
	return (now.tv_sec - since->tv_sec) * 1000 + (now.tv_nsec - since->tv_nsec) / 1000000;
}

/* Read until the peer closes the connection (the engine closes after its
 * reply, so that no half-open socket of ours is left in the image). */
static int read_reply(int fd, char *buf, size_t size, const struct timespec *start)
{
	size_t len = 0;
	for (;;) {
		long left = timeout_ms() - elapsed_ms(start);
		struct pollfd p = { .fd = fd, .events = POLLIN };
		if (left <= 0 || poll(&p, 1, (int)left) <= 0)
			return -ETIMEDOUT;
		ssize_t n = read(fd, buf + len, size - 1 - len);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			break;
		len += n;
		if (len == size - 1)
			break;
	}
	buf[len] = '\0';
	char *nl = strchr(buf, '\n');
	if (nl)
		*nl = '\0';
	return 0;
}

/* Send one request line to the engine of pid and read its one-line reply. */
static int ask_engine(int pid, const char *request, char *reply)
{
	struct sockaddr_un addr;
	struct ucred cred;
	socklen_t len = sizeof(cred);
	struct timespec start;
	int fd, ret = -1;

	clock_gettime(CLOCK_MONOTONIC, &start);
	if (socket_path(pid, &addr))
		return -1;
	fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0) {
		pr_err("socket: %s", strerror(errno));
		return -1;
	}
	if (connect(fd, (struct sockaddr *)&addr, sizeof(addr))) {
		pr_err("engine %d: cannot connect to %s: %s", pid, addr.sun_path, strerror(errno));
		goto out;
	}
	if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) || cred.pid != pid) {
		pr_err("engine %d: %s is served by pid %d, not by the task being checkpointed", pid, addr.sun_path,
		       (int)cred.pid);
		goto out;
	}
	if (dprintf(fd, "%s\n", request) < 0) {
		pr_err("engine %d: cannot send '%s': %s", pid, request, strerror(errno));
		goto out;
	}
	shutdown(fd, SHUT_WR);
	if (read_reply(fd, reply, REPLY_MAX, &start)) {
		pr_err("engine %d: no reply to '%s' within %d s (PODSNAP_HOOK_TIMEOUT)", pid, request, timeout_ms() / 1000);
		goto out;
	}
	if (strncmp(reply, "ok", 2) != 0) {
		pr_err("engine %d: '%s' failed: %s", pid, request, reply[0] ? reply : "connection closed without a reply");
		goto out;
	}
	ret = 0;
out:
	close(fd);
	return ret;
}

/* Run `cuda-checkpoint --action ACTION --pid PID` (found in PATH). */
static int cuda_checkpoint(const char *action, int pid)
{
	char pidstr[16];
	int status;
	snprintf(pidstr, sizeof(pidstr), "%d", pid);
	pid_t child = fork();
	if (child < 0)
		return -1;
	if (child == 0) {
		execlp("cuda-checkpoint", "cuda-checkpoint", "--action", action, "--pid", pidstr, (char *)NULL);
		_exit(127);
	}
	if (waitpid(child, &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
		pr_err("engine %d: cuda-checkpoint --action %s failed (status %d)", pid, action, status);
		return -1;
	}
	return 0;
}

static int cuda_context_checkpointed(int pid)
{
	char cmd[96], state[64] = "";
	snprintf(cmd, sizeof(cmd), "cuda-checkpoint --get-state --pid %d 2>/dev/null", pid);
	FILE *p = popen(cmd, "r");
	if (!p)
		return 0;
	if (!fgets(state, sizeof(state), p))
		state[0] = '\0';
	pclose(p);
	return strncmp(state, "checkpointed", 12) == 0;
}

static int pause_devices(int pid)
{
	char reply[REPLY_MAX];
	if (!is_podsnap_engine(pid))
		return -ENOTSUP;
	pr_info("engine %d: pause", pid);
	if (ask_engine(pid, "pause", reply))
		return -1;
	int cuda = strstr(reply, "cuda") != NULL;
	if (ntasks < MAX_TASKS) {
		tasks[ntasks].pid = pid;
		tasks[ntasks].cuda = cuda;
		ntasks++;
	}
	pr_info("engine %d: paused (%s)", pid, reply);
	return cuda ? cuda_checkpoint("lock", pid) : 0;
}
CR_PLUGIN_REGISTER_HOOK(CR_PLUGIN_HOOK__PAUSE_DEVICES, pause_devices)

static int checkpoint_devices(int pid)
{
	for (int i = 0; i < ntasks; i++)
		if (tasks[i].pid == pid)
			return tasks[i].cuda ? cuda_checkpoint("checkpoint", pid) : 0;
	return -ENOTSUP;
}
CR_PLUGIN_REGISTER_HOOK(CR_PLUGIN_HOOK__CHECKPOINT_DEVICES, checkpoint_devices)

/* Tell an engine to resume without waiting for its answer: when CRIU runs
 * these hooks the tasks are still stopped (after restore) or may still be
 * frozen (end of a dump); the engine reads the request once it runs, and a
 * task that was killed after its dump never does. */
static void notify_resume(int pid, const char *metadata)
{
	struct sockaddr_un addr;
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	if (fd < 0 || socket_path(pid, &addr))
		goto out;
	if (connect(fd, (struct sockaddr *)&addr, sizeof(addr)) == 0 &&
	    dprintf(fd, "resume %s\n", metadata && *metadata ? metadata : "-") > 0)
		pr_info("engine %d: told to resume (metadata %s)", pid, metadata && *metadata ? metadata : "-");
	else
		pr_info("engine %d: not told to resume: %s", pid, strerror(errno));
out:
	if (fd >= 0)
		close(fd);
}

static int resume_devices_late(int pid)
{
	if (!is_podsnap_engine(pid))
		return -ENOTSUP;
	if (cuda_context_checkpointed(pid) && (cuda_checkpoint("restore", pid) || cuda_checkpoint("unlock", pid)))
		return -1;
	notify_resume(pid, getenv("PODSNAP_RESTORE_METADATA"));
	return 0;
}
CR_PLUGIN_REGISTER_HOOK(CR_PLUGIN_HOOK__RESUME_DEVICES_LATE, resume_devices_late)

static int plugin_init(int stage)
{
	ntasks = 0;
	return 0;
}

static void plugin_fini(int stage, int ret)
{
	if (stage != CR_PLUGIN_STAGE__DUMP)
		return;
	if (ret)
		pr_err("dump failed; the %d paused engine(s) resume", ntasks);
	for (int i = 0; i < ntasks; i++)
		notify_resume(tasks[i].pid, NULL);
}

CR_PLUGIN_REGISTER("podsnap", plugin_init, plugin_fini)
