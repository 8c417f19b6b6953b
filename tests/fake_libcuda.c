/* A stand-in libcuda.so.1 for tests/test_cuda_loader.py: lets the real loader's
 * driver path (cuGetProcAddress_v2, symbol versions, cuInit failure) run on a
 * machine without an NVIDIA driver.
 *
 * memkernels' loader asks with CU_GET_PROC_ADDRESS_LEGACY_STREAM; those
 * requests get a stub (cuInit reports CUDA_ERROR_NO_DEVICE, cuGetErrorName
 * names it, anything else is CUDA_ERROR_NOT_SUPPORTED). libcudart's own
 * requests (other flags) are refused, so it fails as it does without a
 * driver. Every request is appended to $FAKE_LIBCUDA_LOG as
 * "<symbol> <version> <flags>". Types come from the real cuda.h. */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static CUresult fake_init(unsigned int flags) {
  (void)flags;
  return CUDA_ERROR_NO_DEVICE;
}

static CUresult fake_error_name(CUresult error, const char** name) {
  *name = error == CUDA_ERROR_NO_DEVICE ? "CUDA_ERROR_NO_DEVICE" : "CUDA_ERROR_UNKNOWN";
  return CUDA_SUCCESS;
}

static CUresult fake_unsupported(void) { return CUDA_ERROR_NOT_SUPPORTED; }

CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int version, cuuint64_t flags,
                             CUdriverProcAddressQueryResult* status) {
  const char* log = getenv("FAKE_LIBCUDA_LOG");
  FILE* f = log ? fopen(log, "a") : NULL;
  if (f) {
    fprintf(f, "%s %d %llu\n", symbol, version, (unsigned long long)flags);
    fclose(f);
  }
  *pfn = NULL;
  if (status) *status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  if (flags != CU_GET_PROC_ADDRESS_LEGACY_STREAM) return CUDA_ERROR_NOT_FOUND;
  if (strcmp(symbol, "cuInit") == 0)
    *pfn = (void*)fake_init;
  else if (strcmp(symbol, "cuGetErrorName") == 0)
    *pfn = (void*)fake_error_name;
  else
    *pfn = (void*)fake_unsupported;
  if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
  return CUDA_SUCCESS;
}
