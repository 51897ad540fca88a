/* A stand-in for the CUDA driver (libcuda.so.1), as far as gpumagic asks it: like the real driver, every
   entry point answers CUDA_ERROR_NOT_INITIALIZED (3) until cuInit has been called, and CUDA_SUCCESS after.
   nvidia-ml-py's nvmlInit loads the real driver on GPU machines without calling cuInit; the fake pynvml
   loads this one the same way. */
static int initialized = 0;

int cuInit(unsigned int flags) {
    (void)flags;
    initialized = 1;
    return 0;
}

int cuDeviceGetCount(int *count) {
    if (!initialized) return 3;
    *count = 1;
    return 0;
}

int cuDriverGetVersion(int *version) {
    *version = 13000;
    return 0;
}
