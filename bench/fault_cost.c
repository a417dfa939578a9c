/*
 * What a page fault and a fork cost on this host: the floor under every process a sandbox,
 * a shell or a function call starts.
 *
 *     gcc -O2 -o /tmp/fault_cost bench/fault_cost.c && /tmp/fault_cost
 *
 * Prints the CPU-side cost of a first-touch anonymous fault, of a copy-on-write fault after
 * fork, of fork + _exit + wait of a process with 64 MiB touched, and of a trivial syscall.
 */
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now_us(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

int main(void)
{
	const size_t len = 64 << 20, page = 4096, pages = len / page;
	char *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (p == MAP_FAILED) {
		perror("mmap");
		return 1;
	}
	double t = now_us();
	for (size_t i = 0; i < len; i += page)
		p[i] = 1;
	printf("first-touch anonymous fault: %.2f us/page\n", (now_us() - t) / pages);

	fflush(stdout);
	pid_t c = fork();
	if (c == 0) {
		double t2 = now_us();
		for (size_t i = 0; i < len; i += page)
			p[i] = 2;
		printf("copy-on-write fault after fork: %.2f us/page\n", (now_us() - t2) / pages);
		fflush(stdout);
		_exit(0);
	}
	waitpid(c, NULL, 0);

	const int forks = 200;
	t = now_us();
	for (int i = 0; i < forks; i++) {
		c = fork();
		if (c == 0)
			_exit(0);
		waitpid(c, NULL, 0);
	}
	printf("fork + _exit + wait, 64 MiB touched: %.1f us\n", (now_us() - t) / forks);

	t = now_us();
	for (int i = 0; i < 100000; i++)
		getppid();
	printf("getppid syscall: %.3f us\n", (now_us() - t) / 100000);
	return 0;
}
