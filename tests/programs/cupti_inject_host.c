/* Stands in for the CUDA driver's side of the injection contract: dlopen the library named by
 * CUDA_INJECTION64_PATH and call its InitializeInjection, as cuInit does. Prints the return value and exits 0,
 * so a test can check that the library never disturbs its host whatever CUPTI does on this machine.
 *
 * usage: CUDA_INJECTION64_PATH=lib.so cupti_inject_host
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

int main(void) {
    const char *path = getenv("CUDA_INJECTION64_PATH");
    void *lib = path ? dlopen(path, RTLD_NOW) : NULL;
    if (!lib) {
        fprintf(stderr, "dlopen: %s\n", dlerror());
        return 3;
    }
    int (*init)(void) = (int (*)(void))dlsym(lib, "InitializeInjection");
    if (!init)
        return 4;
    printf("InitializeInjection=%d\n", init());
    return 0;
}
