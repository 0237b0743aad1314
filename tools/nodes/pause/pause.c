/*
 * The pause container of the kubelet nodes' pod sandboxes: it holds the
 * pod's namespaces open, reaps the zombies of a shared PID namespace, and
 * exits 0 on SIGINT or SIGTERM. Built static (`make nodes`) into an image
 * `FROM scratch` that containerd's CRI plugin runs as every sandbox.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void stop(int signo) {
	(void)signo;
	_exit(0);
}

static void reap(int signo) {
	(void)signo;
	while (waitpid(-1, NULL, WNOHANG) > 0) {
	}
}

static int on(int signo, void (*handler)(int), int flags) {
	struct sigaction action;
	memset(&action, 0, sizeof(action));
	action.sa_handler = handler;
	action.sa_flags = flags;
	sigemptyset(&action.sa_mask);
	return sigaction(signo, &action, NULL);
}

int main(int argc, char **argv) {
	if (argc > 1 && strcmp(argv[1], "-v") == 0) {
		puts("pause (skipper kubelet nodes)");
		return 0;
	}
	if (getpid() != 1) {
		fprintf(stderr, "pause: warning: not PID 1\n");
	}
	if (on(SIGINT, stop, 0) < 0 || on(SIGTERM, stop, 0) < 0 ||
	    on(SIGCHLD, reap, SA_NOCLDSTOP) < 0) {
		perror("pause: sigaction");
		return 1;
	}
	for (;;) {
		pause();
	}
}
