/* The parent busy-loops in parent_work while a forked child busy-loops in child_work; then both exit.
 * With an argument "exec", the child re-executes this binary as "forker child" instead.
 * Usage: forker [seconds] [exec]: seconds of CPU time each, not of wall time (a fixed amount of work). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static volatile unsigned long sink;

static double now(void) {  /* this process's CPU time: a fixed amount of work, however busy the host */
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

__attribute__((noinline)) void busy(double seconds) {
    double end = now() + seconds;
    unsigned long x = sink;
    while (now() < end)
        for (int i = 0; i < 100000; i++)
            x = x * 6364136223846793005UL + 1;
    sink = x;
}

__attribute__((noinline)) void child_work(double s) { busy(s); }
__attribute__((noinline)) void parent_work(double s) { busy(s); }

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "child") == 0) {
        child_work(argc > 2 ? atof(argv[2]) : 2.0);
        return 0;
    }
    double seconds = argc > 1 ? atof(argv[1]) : 2.0;
    pid_t pid = fork();
    if (pid == 0) {
        if (argc > 2 && strcmp(argv[2], "exec") == 0) {
            char arg[32];
            snprintf(arg, sizeof arg, "%f", seconds);
            execl("/proc/self/exe", "forker", "child", arg, (char *)NULL);
            _exit(127);
        }
        child_work(seconds);
        _exit(0);
    }
    parent_work(seconds);
    waitpid(pid, NULL, 0);
    return 0;
}
