/* Launch-shaped calls for the nesting test (tests/integration/test_launch_nesting.py). rt_launch calls
 * drv_launch inside it, as cudart's cudaLaunchKernel reaches the driver's cuLaunchKernel on a GPU; rt_tail jumps
 * to it as its last act (built with sibling calls on); drv_launch is also called on its own, from main's depth
 * and from deeper in the stack, right after a runtime launch returned. Each round launches kernel 1 through
 * rt_launch, 2 and 3 through drv_launch directly, 4 through rt_tail. Waits for a line on stdin before the
 * rounds, so the probes are in first. */
#include <stdio.h>
#include <stdlib.h>

__attribute__((noipa)) long drv_launch(long kernel) {
    __asm__ volatile("" ::: "memory");
    return kernel + 1;
}

__attribute__((noipa)) long rt_launch(long kernel) {
    long r = drv_launch(kernel);
    __asm__ volatile("" ::: "memory");
    return r + 1;
}

__attribute__((noipa)) long rt_tail(long kernel) {
    __asm__ volatile("" ::: "memory");
    return drv_launch(kernel);
}

__attribute__((noipa)) long deeper(long kernel, int depth) {
    long r = depth ? deeper(kernel, depth - 1) : drv_launch(kernel);
    __asm__ volatile("" ::: "memory");
    return r;
}

int main(int argc, char **argv) {
    long rounds = argc > 1 ? atol(argv[1]) : 1000, sum = 0;
    char line[8];
    if (!fgets(line, sizeof line, stdin))
        return 1;
    for (long i = 0; i < rounds; i++) {
        sum += rt_launch(1);
        sum += deeper(2, 3);
        sum += drv_launch(3);
        sum += rt_tail(4);
    }
    printf("%ld\n", sum);
    return 0;
}
