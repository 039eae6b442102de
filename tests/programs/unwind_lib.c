/* The shared library of unwind_work.c: called through the PLT, built without frame pointers. */
volatile unsigned long lib_sink;

__attribute__((noipa)) static unsigned long lib_inner(unsigned long n) {
    unsigned long x = lib_sink;
    for (unsigned long i = 0; i < n; i++)
        x = x * 2862933555777941757UL + i;
    return x;
}

unsigned long lib_spin(unsigned long n) {
    unsigned long r = lib_inner(n);
    lib_sink += r;
    return r;
}
