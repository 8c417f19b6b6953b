// Backend selection and the real CUDA loader. See api.hpp for the contract.
//
// Only this file and csrc/sim/ know where the table's functions come from.
// The real path runs code that needs an NVIDIA driver past the point of
// "cudaGetDeviceCount failed", so it is kept short: find libraries, resolve
// symbols, initialise the driver, report clearly when anything is missing.
#include "cuda/api.hpp"

#include <cudaTypedefs.h>  // PFN_cuGetProcAddress_* (shipped next to cuda.h)
#include <dlfcn.h>
#include <link.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <vector>

#include "sim/sim.hpp"

namespace mk {
namespace cuda {
namespace {

constexpr const char* kEnvDevice = "MEMKERNELS_DEVICE";
constexpr const char* kInstallHint = "install the NVIDIA driver or set MEMKERNELS_DEVICE=sim";

// Sonames of the CUDA runtime this build's headers (CUDA 12/13 ABI) work with,
// newest first, and the driver's.
const std::vector<std::string> kCudartSonames = {"libcudart.so.13", "libcudart.so.12"};
const std::string kLibcudaSoname = "libcuda.so.1";

std::mutex g_mutex;
std::optional<Backend> g_selected;              // explicit select_backend()
std::atomic<const Api*> g_handed_out{nullptr};  // fixed once api() succeeded
std::optional<Backend> g_locked_backend;

Backend backend_from_env() {
  const char* value = std::getenv(kEnvDevice);
  if (value == nullptr || *value == '\0') return Backend::cuda;
  const std::string name(value);
  if (name == "sim") return Backend::sim;
  if (name == "cuda") return Backend::cuda;
  throw user_error(std::string(kEnvDevice) + "='" + name + "' is not a device backend; use 'sim' or 'cuda' (or unset it)");
}

// ---------------------------------------------------------------- real loader

struct Library {
  void* handle = nullptr;
  std::string path;
};

std::string loaded_path(void* handle, const std::string& fallback) {
  link_map* map = nullptr;
  if (dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr && map->l_name != nullptr && *map->l_name)
    return map->l_name;
  return fallback;
}

std::string last_dlerror() {
  const char* err = dlerror();
  return err ? err : "unknown dlopen error";
}

// Prefer a copy already in the process (torch's, whose driver state we must
// share), then the dynamic linker's search path, then explicit paths.
Library open_first(const std::vector<std::string>& sonames, const std::vector<std::string>& extra_paths,
                   std::vector<std::string>& tried) {
  for (const auto& soname : sonames) {
    if (void* handle = dlopen(soname.c_str(), RTLD_NOW | RTLD_NOLOAD)) return {handle, loaded_path(handle, soname)};
  }
  for (const auto& name : sonames) {
    if (void* handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL)) return {handle, loaded_path(handle, name)};
    tried.push_back(name + " (" + last_dlerror() + ")");
  }
  for (const auto& path : extra_paths) {
    if (void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL)) return {handle, loaded_path(handle, path)};
    tried.push_back(path + " (" + last_dlerror() + ")");
  }
  return {};
}

std::vector<std::string> toolkit_cudart_paths() {
  std::vector<std::string> dirs;
  for (const char* var : {"CUDA_HOME", "CUDA_PATH"}) {
    if (const char* value = std::getenv(var)) dirs.push_back(std::string(value) + "/lib64");
  }
  dirs.push_back("/usr/local/cuda/lib64");
  std::vector<std::string> paths;
  for (const auto& dir : dirs)
    for (const auto& soname : kCudartSonames) paths.push_back(dir + "/" + soname);
  return paths;
}

std::string join(const std::vector<std::string>& parts, const char* sep) {
  std::string text;
  for (std::size_t i = 0; i < parts.size(); ++i) text += (i ? sep : "") + parts[i];
  return text;
}

// Driver symbols: cuGetProcAddress(name, &fn, CUDA_VERSION, ...) returns the
// version of `name` whose ABI matches the headers we compiled against (e.g.
// it maps cuMemGetInfo to cuMemGetInfo_v2; on an older driver, the newest
// version it has), which a plain dlsym of the base name does not guarantee.
// cuGetProcAddress_v2 (driver >= 12.0) has the extra symbolStatus argument;
// the original (11.3+) does not. When the driver answers, its answer stands
// (a null means the driver is too old for that entry point); plain dlsym is
// only for drivers older than 11.3, which cannot run CUDA 12 code anyway.
// LEGACY_STREAM: memkernels uses the legacy default stream throughout (the
// runtime's plain, non-_ptsz names), so ask for the matching variants.
void resolve_driver(Api& table, void* libcuda, std::vector<std::string>& missing) {
  auto get_v2 = reinterpret_cast<PFN_cuGetProcAddress_v12000>(dlsym(libcuda, "cuGetProcAddress_v2"));
  auto get_v1 = reinterpret_cast<PFN_cuGetProcAddress_v11030>(dlsym(libcuda, "cuGetProcAddress"));
  auto resolve = [&](const char* name) -> void* {
    void* fn = nullptr;
    if (get_v2) {
      CUdriverProcAddressQueryResult status{};
      const bool ok = get_v2(name, &fn, CUDA_VERSION, CU_GET_PROC_ADDRESS_LEGACY_STREAM, &status) == CUDA_SUCCESS &&
                      status == CU_GET_PROC_ADDRESS_SUCCESS;
      return ok ? fn : nullptr;
    }
    if (get_v1) return get_v1(name, &fn, CUDA_VERSION, CU_GET_PROC_ADDRESS_LEGACY_STREAM) == CUDA_SUCCESS ? fn : nullptr;
    return dlsym(libcuda, name);
  };
#define MK_RESOLVE_DRIVER(name)                                                    \
  table.name = reinterpret_cast<decltype(table.name)>(resolve(#name));             \
  if (table.name == nullptr) missing.push_back(#name);
  MK_CUDA_DRIVER_FUNCTIONS(MK_RESOLVE_DRIVER)
#undef MK_RESOLVE_DRIVER
}

void resolve_runtime(Api& table, void* cudart, std::vector<std::string>& missing) {
#define MK_RESOLVE_RUNTIME(name)                                            \
  table.name = reinterpret_cast<decltype(table.name)>(dlsym(cudart, #name)); \
  if (table.name == nullptr) missing.push_back(#name);
  MK_CUDA_RUNTIME_FUNCTIONS(MK_RESOLVE_RUNTIME)
#undef MK_RESOLVE_RUNTIME
}

struct RealLoad {
  Api table;
  RealInfo info;
  std::string error;  // empty on success
};

RealLoad load_real() {
  RealLoad out;
  out.table.backend = "cuda";
  std::vector<std::string> cudart_tried, libcuda_tried;
  Library cudart = open_first(kCudartSonames, toolkit_cudart_paths(), cudart_tried);
  Library libcuda = open_first({kLibcudaSoname}, {}, libcuda_tried);

  // What went wrong, driver first: it is the usual culprit.
  std::string driver_problem, runtime_problem, found;
  if (libcuda.handle) {
    found += "libcuda: " + libcuda.path;
    std::vector<std::string> missing;
    resolve_driver(out.table, libcuda.handle, missing);
    if (!missing.empty()) {
      driver_problem += "libcuda at " + libcuda.path + " lacks " + join(missing, ", ") + "; ";
    } else if (CUresult err = out.table.cuInit(0); err != CUDA_SUCCESS) {
      const char* name = nullptr;
      out.table.cuGetErrorName(err, &name);
      driver_problem += std::string("cuInit(0) returned ") + (name ? name : "an unknown error") + " (" +
                        std::to_string(static_cast<int>(err)) + "); ";
    }
  } else {
    driver_problem += "tried " + join(libcuda_tried, ", ") + "; ";
  }
  if (cudart.handle) {
    found += (libcuda.handle ? "; libcudart: " : "libcudart: ") + cudart.path;
    std::vector<std::string> missing;
    resolve_runtime(out.table, cudart.handle, missing);
    if (!missing.empty()) {
      runtime_problem += "libcudart at " + cudart.path + " lacks " + join(missing, ", ") + " (too old?); ";
    } else {
      // Without a usable driver the runtime says so here (insufficient
      // driver / no device): the first call that needs libcuda.
      int count = 0;
      cudaError_t err = out.table.cudaGetDeviceCount(&count);
      if (err != cudaSuccess)
        runtime_problem += std::string("cudaGetDeviceCount returned ") + out.table.cudaGetErrorName(err) + " (" +
                           out.table.cudaGetErrorString(err) + "); ";
      else if (count == 0)
        runtime_problem += "cudaGetDeviceCount found no CUDA device; ";
      out.info.device_count = count;
      out.table.cudaDriverGetVersion(&out.info.runtime_driver_version);
    }
  } else {
    runtime_problem += "no CUDA runtime library: tried " + join(cudart_tried, ", ") + "; ";
  }

  const std::string problems = driver_problem + runtime_problem;
  if (!problems.empty()) {
    out.error = "no CUDA driver/library: " + problems + (found.empty() ? "" : "found " + found + "; ") + kInstallHint;
    return out;
  }
  out.info.cudart_path = cudart.path;
  out.info.libcuda_path = libcuda.path;
  return out;
}

const RealLoad& real_load() {
  static const RealLoad loaded = load_real();  // thread-safe, once
  return loaded;
}

const Api& table_for(Backend backend) {
  if (backend == Backend::sim) return sim::table();
  return real_api();
}

[[noreturn]] void throw_with(const std::string& call, int code, const char* name, const char* text) {
  throw call_error(call + " failed: " + (name ? name : "unknown error") + " (" + std::to_string(code) + "): " +
                       (text ? text : ""),
                   code, call);
}

}  // namespace

const char* backend_name(Backend backend) { return backend == Backend::sim ? "sim" : "cuda"; }

const Api& real_api() {
  const RealLoad& loaded = real_load();
  if (!loaded.error.empty()) throw cuda_error(loaded.error);
  return loaded.table;
}

RealInfo real_info() {
  real_api();
  return real_load().info;
}

const Api& api() {
  if (const Api* table = g_handed_out.load(std::memory_order_acquire)) return *table;
  std::lock_guard<std::mutex> lock(g_mutex);
  if (const Api* table = g_handed_out.load(std::memory_order_relaxed)) return *table;
  const Backend backend = g_selected ? *g_selected : backend_from_env();
  const Api& table = table_for(backend);  // throws before anything is fixed
  g_locked_backend = backend;
  g_handed_out.store(&table, std::memory_order_release);
  return table;
}

void select_backend(Backend backend) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_locked_backend && *g_locked_backend != backend)
    throw user_error(std::string("memkernels device backend is already '") + backend_name(*g_locked_backend) +
                     "' (fixed at first use); cannot switch to '" + backend_name(backend) +
                     "'. Choose it before any device call, e.g. start Python with MEMKERNELS_DEVICE=" +
                     backend_name(backend));
  g_selected = backend;
}

Backend selected_backend() {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_locked_backend) return *g_locked_backend;
  return g_selected ? *g_selected : backend_from_env();
}

bool backend_locked() { return g_handed_out.load(std::memory_order_acquire) != nullptr; }

void throw_call_error(const Api& table, cudaError_t err, const std::string& call) {
  throw_with(call, static_cast<int>(err), table.cudaGetErrorName(err), table.cudaGetErrorString(err));
}

void throw_call_error(const Api& table, CUresult err, const std::string& call) {
  const char* name = nullptr;
  const char* text = nullptr;
  table.cuGetErrorName(err, &name);
  table.cuGetErrorString(err, &text);
  throw_with(call, static_cast<int>(err), name, text);
}

}  // namespace cuda
}  // namespace mk
