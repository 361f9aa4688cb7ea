// Kept eager calls of the FlashAttention kernels, looked up, allocated for and launched from C++.
//
// launch.py works out an eager call once per signature (input shapes, strides, dtypes, devices and
// causality) and keeps its compiled launches; native.py hands them here. A later call of that signature
// then costs one call from Python: this module finds the kept launches by the signature, allocates the
// outputs through ATen's caching allocator and launches each compiled kernel with cuLaunchKernel on the
// current stream, with the arguments Triton's own launcher would pass (native.py packs them from the
// kernel's compiled signature). A kernel that loads through tensor descriptors gets a CUtensorMap for
// each, encoded over the call's address as Triton's launcher encodes it (only the address changes
// between calls of one signature). A call whose signature is not kept, or whose tensors start off a 16-byte
// boundary, returns None and takes launch.py's path.
//
// It links against ATen and c10 alone (the stream comes through c10's device-guard interface, libcuda
// through dlopen), so the same source builds with a CPU-only torch, where nothing is ever kept.
// Every entry point is called from Python with the GIL held, which serialises access to the kept maps.

#include <torch/extension.h>

#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <cuda.h>
#include <dlfcn.h>

#include <array>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace {

// Messages are built from strings and std::to_string, not through std::ostream (as c10::str and
// TORCH_CHECK build them): compiled by g++ 13 against torch 2.11's wheel, an int streamed into a message
// crashed inside libstdc++.
void append(std::string& out, const char* part) { out += part; }
void append(std::string& out, const std::string& part) { out += part; }
template <typename Number, typename = std::enable_if_t<std::is_arithmetic_v<Number>>>
void append(std::string& out, Number part) {
  out += std::to_string(part);
}

template <typename... Parts>
std::string text(const Parts&... parts) {
  std::string out;
  (append(out, parts), ...);
  return out;
}

// Refusals raise ValueError in Python: pybind translates std::invalid_argument itself.
template <typename... Parts>
void require(bool condition, const Parts&... message) {
  if (!condition) throw std::invalid_argument(text(message...));
}

constexpr int64_t kAlignmentBytes = 16;
// Kernel parameters a launch may take: the widest kernel (dK/dV with its four descriptors, each a
// tensor map, 4 dims and 4 strides) takes 69 with its two scratch pointers.
constexpr size_t kMaxParams = 96;
// A pointer parameter names the launch's address by its position in the list each call site builds.
constexpr int64_t kMaxAddresses = 8;
// Tensor descriptors a launch may take (ours take 4) and the most dims of one (TMA's limit).
constexpr size_t kMaxTensorMaps = 8;
constexpr int64_t kMaxRank = 5;

enum class Kind : int64_t { kAddress = 0, kI32 = 1, kI64 = 2, kF32 = 3, kTensorMap = 4 };

struct Param {
  Kind kind;
  int64_t integer;  // the address's position, the int's value, or the tensor map's index
  double real;      // the float's value
};

// A tensor descriptor's CUtensorMap, all but its address fixed for a signature, in
// cuTensorMapEncodeTiled's order: innermost dim first, strides in bytes (the innermost, 1 element, left
// out), as Triton's fill_tma_descriptor passes them.
struct TensorMapSpec {
  int64_t position = 0;      // the address it is over
  int64_t offset_bytes = 0;  // from that address (the tail's columns)
  CUtensorMapDataType data_type{};
  cuuint32_t rank = 0;
  CUtensorMapSwizzle swizzle{};
  std::array<cuuint64_t, kMaxRank> dims{};
  std::array<cuuint64_t, kMaxRank> strides{};
  std::array<cuuint32_t, kMaxRank> box{};
  std::array<cuuint32_t, kMaxRank> element_strides{1, 1, 1, 1, 1};
};

// native.py's tensor_map list: position, offset, data type, rank, swizzle, element size, then the shape,
// strides (elements) and block, outermost first.
TensorMapSpec tensor_map_spec(const std::vector<int64_t>& fields, size_t index) {
  require(fields.size() >= 6, "tensor map ", index, " has ", fields.size(), " fields, fewer than 6");
  TensorMapSpec spec;
  const int64_t rank = fields[3], element_bytes = fields[5];
  require(rank >= 1 && rank <= kMaxRank, "tensor map ", index, " has rank ", rank, ": out of [1, ", kMaxRank, "]");
  require(static_cast<int64_t>(fields.size()) == 6 + 3 * rank, "tensor map ", index, " of rank ", rank, " has ",
          fields.size(), " fields, not ", 6 + 3 * rank);
  require(fields[0] >= 0 && fields[0] < kMaxAddresses, "tensor map ", index, " is over address ", fields[0],
          ": out of [0, ", kMaxAddresses, ")");
  require(fields[1] >= 0 && fields[1] % kAlignmentBytes == 0, "tensor map ", index, " starts ", fields[1],
          " bytes in: not a multiple of ", kAlignmentBytes);
  require(element_bytes == 1 || element_bytes == 2 || element_bytes == 4 || element_bytes == 8, "tensor map ",
          index, " has elements of ", element_bytes, " bytes");
  spec.position = fields[0];
  spec.offset_bytes = fields[1];
  spec.data_type = static_cast<CUtensorMapDataType>(fields[2]);
  spec.rank = static_cast<cuuint32_t>(rank);
  spec.swizzle = static_cast<CUtensorMapSwizzle>(fields[4]);
  const int64_t* shape = fields.data() + 6;
  const int64_t* strides = shape + rank;
  const int64_t* block = strides + rank;
  require(strides[rank - 1] == 1, "tensor map ", index, "'s innermost stride is ", strides[rank - 1], ", not 1");
  for (int64_t i = 0; i < rank; ++i) {
    const int64_t inner = rank - 1 - i;  // the driver's order: innermost first
    require(shape[i] >= 1, "tensor map ", index, " has dim ", i, " of ", shape[i]);
    require(block[i] >= 1 && block[i] <= 256, "tensor map ", index, " has a block dim ", i, " of ", block[i],
            ": out of [1, 256]");
    spec.dims[inner] = static_cast<cuuint64_t>(shape[i]);
    spec.box[inner] = static_cast<cuuint32_t>(block[i]);
    if (i < rank - 1) {
      require(strides[i] >= 1 && strides[i] * element_bytes % kAlignmentBytes == 0, "tensor map ", index,
              " has a stride of ", strides[i], " elements in dim ", i, ": not a positive multiple of ",
              kAlignmentBytes, " bytes");
      spec.strides[rank - 2 - i] = static_cast<cuuint64_t>(strides[i] * element_bytes);
    }
  }
  return spec;
}

// One compiled kernel's launch: its driver handle, grid and block, dynamic shared memory, and its
// parameters in order, then `null_pointers` zero pointers (Triton's scratch buffers, unused by ours).
class Launch {
 public:
  Launch(int64_t function, std::vector<int64_t> grid, int64_t threads, int64_t shared_bytes,
         int64_t null_pointers, const std::vector<int64_t>& kinds, const std::vector<int64_t>& integers,
         const std::vector<double>& reals, const std::vector<std::vector<int64_t>>& tensor_maps)
      : function_(reinterpret_cast<CUfunction>(function)), null_pointers_(null_pointers) {
    require(tensor_maps.size() <= kMaxTensorMaps, tensor_maps.size(), " tensor maps: more than ", kMaxTensorMaps);
    for (size_t i = 0; i < tensor_maps.size(); ++i) tensor_maps_.push_back(tensor_map_spec(tensor_maps[i], i));
    require(function != 0, "a kept launch needs a loaded kernel's CUfunction, got 0");
    require(grid.size() == 3, "a kept launch's grid has 3 dims, got ", grid.size());
    for (size_t i = 0; i < 3; ++i) {
      require(grid[i] >= 1 && grid[i] < (int64_t{1} << 31), "grid dim ", i, " is ", grid[i],
                  ": out of [1, 2^31)");
      grid_[i] = static_cast<unsigned>(grid[i]);
    }
    require(threads >= 32 && threads <= 1024 && threads % 32 == 0, "a block of ", threads,
                " threads: not a multiple of 32 in [32, 1024]");
    require(shared_bytes >= 0, "shared memory of ", shared_bytes, " bytes");
    threads_ = static_cast<unsigned>(threads);
    shared_bytes_ = static_cast<unsigned>(shared_bytes);
    require(kinds.size() == integers.size() && kinds.size() == reals.size(),
                "one kind, int and float per parameter: got ", kinds.size(), ", ", integers.size(), " and ",
                reals.size());
    require(null_pointers >= 0 && kinds.size() + null_pointers <= kMaxParams, kinds.size(),
                " parameters and ", null_pointers, " null pointers: more than ", kMaxParams);
    for (size_t i = 0; i < kinds.size(); ++i) {
      const Kind kind = static_cast<Kind>(kinds[i]);
      switch (kind) {
        case Kind::kAddress:
          require(integers[i] >= 0 && integers[i] < kMaxAddresses, "parameter ", i, " takes address ",
                      integers[i], ": out of [0, ", kMaxAddresses, ")");
          break;
        case Kind::kI32:
          require(integers[i] >= INT32_MIN && integers[i] <= INT32_MAX, "parameter ", i, " is i32 but ",
                      integers[i], " does not fit");
          break;
        case Kind::kI64:
        case Kind::kF32:
          break;
        case Kind::kTensorMap:
          require(integers[i] >= 0 && integers[i] < static_cast<int64_t>(tensor_maps_.size()), "parameter ", i,
                  " takes tensor map ", integers[i], " of ", tensor_maps_.size());
          break;
        default:
          require(false, "parameter ", i, " has kind ", kinds[i],
                  ": not 0 (address), 1 (i32), 2 (i64), 3 (f32) or 4 (tensor map)");
      }
      params_.push_back(Param{kind, integers[i], reals[i]});
    }
  }

  // The kernel's parameters as cuLaunchKernel reads them: each in an 8-byte slot, `pointers[i]` at slot i,
  // but a tensor map, which `pointers[i]` finds in `maps` (encoded by encode_maps first).
  size_t pack(const uint64_t* addresses, std::array<uint64_t, kMaxParams>& slots,
              std::array<void*, kMaxParams>& pointers, std::array<CUtensorMap, kMaxTensorMaps>& maps) const {
    size_t n = 0;
    for (const Param& param : params_) {
      slots[n] = 0;
      pointers[n] = &slots[n];
      switch (param.kind) {
        case Kind::kAddress:
          slots[n] = addresses[param.integer];
          break;
        case Kind::kTensorMap:
          pointers[n] = &maps[param.integer];
          break;
        case Kind::kI32: {
          const int32_t value = static_cast<int32_t>(param.integer);
          std::memcpy(&slots[n], &value, sizeof value);
          break;
        }
        case Kind::kI64:
          std::memcpy(&slots[n], &param.integer, sizeof param.integer);
          break;
        case Kind::kF32: {
          const float value = static_cast<float>(param.real);
          std::memcpy(&slots[n], &value, sizeof value);
          break;
        }
      }
      ++n;
    }
    for (int64_t i = 0; i < null_pointers_; ++i, ++n) {
      slots[n] = 0;
      pointers[n] = &slots[n];
    }
    return n;
  }

  // pack's slots as bytes, each parameter's 8-byte slot in order (what the tests compare). A launch with
  // tensor maps is refused: encoding them takes the driver.
  py::bytes packed(const std::vector<int64_t>& addresses) const {
    require(tensor_maps_.empty(), "a launch with tensor maps packs only where the driver encodes them");
    require(static_cast<int64_t>(addresses.size()) <= kMaxAddresses, "at most ", kMaxAddresses, " addresses");
    std::array<uint64_t, kMaxAddresses> given{};
    for (size_t i = 0; i < addresses.size(); ++i) given[i] = static_cast<uint64_t>(addresses[i]);
    for (const Param& param : params_) {
      require(param.kind != Kind::kAddress || param.integer < static_cast<int64_t>(addresses.size()),
                  "the launch takes address ", param.integer, " of ", addresses.size());
    }
    std::array<uint64_t, kMaxParams> slots;
    std::array<void*, kMaxParams> pointers;
    std::array<CUtensorMap, kMaxTensorMaps> maps;
    const size_t n = pack(given.data(), slots, pointers, maps);
    return py::bytes(reinterpret_cast<const char*>(slots.data()), n * sizeof(uint64_t));
  }

  // Each tensor map over this call's addresses, into `maps` by index.
  void encode_maps(const uint64_t* addresses, std::array<CUtensorMap, kMaxTensorMaps>& maps) const;

  void operator()(const uint64_t* addresses, CUstream stream) const;

 private:
  CUfunction function_;
  std::array<unsigned, 3> grid_{};
  unsigned threads_ = 0;
  unsigned shared_bytes_ = 0;
  int64_t null_pointers_ = 0;
  std::vector<TensorMapSpec> tensor_maps_;
  std::vector<Param> params_;
};

// The driver's launch entry point, found in libcuda on the first launch (the CUDA runtime torch links
// holds the same context, which Triton's kernels were loaded into).
struct Driver {
  using LaunchKernel = CUresult (*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                    unsigned, CUstream, void**, void**);
  using ErrorName = CUresult (*)(CUresult, const char**);
  using CtxGetCurrent = CUresult (*)(CUcontext*);
  using DeviceGet = CUresult (*)(CUdevice*, int);
  using PrimaryCtxRetain = CUresult (*)(CUcontext*, CUdevice);
  using CtxSetCurrent = CUresult (*)(CUcontext);
  using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  LaunchKernel launch_kernel = nullptr;
  ErrorName error_name = nullptr;
  CtxGetCurrent ctx_get_current = nullptr;
  DeviceGet device_get = nullptr;
  PrimaryCtxRetain primary_ctx_retain = nullptr;
  CtxSetCurrent ctx_set_current = nullptr;
  EncodeTiled encode_tiled = nullptr;  // absent before CUDA 12: then no kernel has tensor maps
};

const Driver& driver() {
  static const Driver found = [] {
    void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (library == nullptr) {
      throw std::runtime_error(text("cannot open libcuda.so.1 to launch the kept kernels: ", dlerror()));
    }
    Driver d;
    d.launch_kernel = reinterpret_cast<Driver::LaunchKernel>(dlsym(library, "cuLaunchKernel"));
    d.error_name = reinterpret_cast<Driver::ErrorName>(dlsym(library, "cuGetErrorName"));
    d.encode_tiled = reinterpret_cast<Driver::EncodeTiled>(dlsym(library, "cuTensorMapEncodeTiled"));
    d.ctx_get_current = reinterpret_cast<Driver::CtxGetCurrent>(dlsym(library, "cuCtxGetCurrent"));
    d.device_get = reinterpret_cast<Driver::DeviceGet>(dlsym(library, "cuDeviceGet"));
    d.primary_ctx_retain = reinterpret_cast<Driver::PrimaryCtxRetain>(dlsym(library, "cuDevicePrimaryCtxRetain"));
    d.ctx_set_current = reinterpret_cast<Driver::CtxSetCurrent>(dlsym(library, "cuCtxSetCurrent"));
    if (d.launch_kernel == nullptr || d.error_name == nullptr || d.ctx_get_current == nullptr ||
        d.device_get == nullptr || d.primary_ctx_retain == nullptr || d.ctx_set_current == nullptr) {
      throw std::runtime_error("libcuda.so.1 lacks one of the driver calls the kept launches make");
    }
    return d;
  }();
  return found;
}

[[noreturn]] void driver_failed(const char* what, CUresult result) {
  const char* name = "unknown";
  driver().error_name(result, &name);
  throw std::runtime_error(text(what, " failed: ", name));
}

// Make the device's primary context (torch's, which Triton loaded the kernels into) current on this thread
// where none is: the runtime binds one only when a thread first does CUDA work, so a thread that has done
// none (autograd's backward thread, a caller's own) has none, and the driver calls below would refuse.
void bind_context(const c10::Device& device) {
  const Driver& d = driver();
  CUcontext context = nullptr;
  CUresult result = d.ctx_get_current(&context);
  if (result != CUDA_SUCCESS) driver_failed("cuCtxGetCurrent", result);
  if (context != nullptr) return;
  CUdevice handle = 0;
  if ((result = d.device_get(&handle, device.index())) != CUDA_SUCCESS) driver_failed("cuDeviceGet", result);
  if ((result = d.primary_ctx_retain(&context, handle)) != CUDA_SUCCESS) {
    driver_failed("cuDevicePrimaryCtxRetain", result);
  }
  if ((result = d.ctx_set_current(context)) != CUDA_SUCCESS) driver_failed("cuCtxSetCurrent", result);
}

void Launch::encode_maps(const uint64_t* addresses, std::array<CUtensorMap, kMaxTensorMaps>& maps) const {
  if (tensor_maps_.empty()) return;
  const Driver& d = driver();
  if (d.encode_tiled == nullptr) throw std::runtime_error("libcuda.so.1 has no cuTensorMapEncodeTiled");
  for (size_t i = 0; i < tensor_maps_.size(); ++i) {
    const TensorMapSpec& spec = tensor_maps_[i];
    void* start = reinterpret_cast<void*>(addresses[spec.position] + static_cast<uint64_t>(spec.offset_bytes));
    // Triton's launcher encodes with 128-byte L2 promotion and no fill value (rows past the end read zero).
    const CUresult result = d.encode_tiled(&maps[i], spec.data_type, spec.rank, start, spec.dims.data(),
                                           spec.strides.data(), spec.box.data(), spec.element_strides.data(),
                                           CU_TENSOR_MAP_INTERLEAVE_NONE, spec.swizzle,
                                           CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (result != CUDA_SUCCESS) driver_failed("cuTensorMapEncodeTiled for a kept FlashAttention kernel", result);
  }
}

void Launch::operator()(const uint64_t* addresses, CUstream stream) const {
  std::array<uint64_t, kMaxParams> slots;
  std::array<void*, kMaxParams> pointers;
  std::array<CUtensorMap, kMaxTensorMaps> maps;
  encode_maps(addresses, maps);
  pack(addresses, slots, pointers, maps);
  const Driver& d = driver();
  const CUresult result = d.launch_kernel(function_, grid_[0], grid_[1], grid_[2], threads_, 1, 1, shared_bytes_,
                                          stream, pointers.data(), nullptr);
  if (result != CUDA_SUCCESS) driver_failed("cuLaunchKernel of a kept FlashAttention kernel", result);
}

CUstream current_stream(const c10::Device& device) {
  const c10::impl::VirtualGuardImpl guard_impl(device.type());
  return static_cast<CUstream>(guard_impl.getStream(device).native_handle());
}

// ------------------------------------------------------------------------------------------ signatures

using Signature = std::vector<int64_t>;

struct SignatureHash {
  size_t operator()(const Signature& signature) const {
    size_t h = signature.size();
    for (const int64_t value : signature) {
      h ^= std::hash<int64_t>{}(value) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
    }
    return h;
  }
};

// What launch.py's _signature holds: causality, then each tensor's sizes, strides, dtype and device.
template <size_t N>
Signature signature_of(bool is_causal, const std::array<const at::Tensor*, N>& tensors) {
  Signature signature;
  signature.reserve(1 + N * 14);
  signature.push_back(is_causal);
  for (const at::Tensor* t : tensors) {
    signature.push_back(t->dim());
    for (const int64_t size : t->sizes()) signature.push_back(size);
    for (const int64_t stride : t->strides()) signature.push_back(stride);
    signature.push_back(static_cast<int64_t>(t->scalar_type()));
    signature.push_back(static_cast<int64_t>(t->device().type()));
    signature.push_back(t->device().index());
  }
  return signature;
}

template <size_t N>
bool all_aligned(const std::array<const at::Tensor*, N>& tensors) {
  uintptr_t any = 0;
  for (const at::Tensor* t : tensors) any |= reinterpret_cast<uintptr_t>(t->data_ptr());
  return any % kAlignmentBytes == 0;
}

template <size_t N>
void check_keepable(const std::array<const at::Tensor*, N>& tensors) {
  for (const at::Tensor* t : tensors) {
    require(t->defined() && t->is_cuda() && t->layout() == at::kStrided,
                "only dense CUDA tensors' launches are kept, got one on ", t->device().str());
  }
}

uint64_t address(const at::Tensor& t) { return reinterpret_cast<uint64_t>(t.data_ptr()); }

using Strides = std::vector<int64_t>;

// An output as launch.py's first call laid it out: shaped like `like`, with the strides it kept.
at::Tensor empty_laid_out(const at::Tensor& like, const Strides& strides) {
  return at::empty_strided(like.sizes(), strides, like.options());
}

at::Tensor row_statistic(const at::Tensor& like) {  // L or D: (..., n) fp32 for (..., n, d) inputs
  return at::empty(like.sizes().slice(0, like.dim() - 1), like.options().dtype(at::kFloat));
}

// ------------------------------------------------------------------------------------------ kept calls

struct KeptForward {
  Launch launch;
  Strides o_strides;
  int64_t partial_elements;   // the split forward's fp32 partials; -1 for the whole forward
  int64_t arrival_elements;   // the split forward's zeroed int32 arrival counts
};

struct KeptBackward {
  Launch dq;
  Launch dkdv;
  Strides dq_strides, dk_strides, dv_strides;
};

std::unordered_map<Signature, KeptForward, SignatureHash> kept_forwards;
std::unordered_map<Signature, KeptBackward, SignatureHash> kept_backwards;

template <typename Map, typename Entry>
void keep(Map& kept, Signature signature, Entry entry, int64_t limit) {
  if (static_cast<int64_t>(kept.size()) >= limit) kept.clear();  // bounded: signatures hold sizes
  kept.insert_or_assign(std::move(signature), std::move(entry));
}

void keep_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool is_causal, const Launch& launch,
                  Strides o_strides, int64_t partial_elements, int64_t arrival_elements, int64_t limit) {
  const std::array<const at::Tensor*, 3> inputs{&q, &k, &v};
  check_keepable(inputs);
  require(o_strides.size() == static_cast<size_t>(q.dim()), "o's strides name ", o_strides.size(), " dims, q has ",
          q.dim());
  require(partial_elements < 0 || arrival_elements > 0, "a split forward keeps arrival counts");
  keep(kept_forwards, signature_of(is_causal, inputs),
       KeptForward{launch, std::move(o_strides), partial_elements, arrival_elements}, limit);
}

void keep_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& o,
                   const at::Tensor& lse, const at::Tensor& d_o, bool is_causal, const Launch& dq,
                   const Launch& dkdv, Strides dq_strides, Strides dk_strides, Strides dv_strides, int64_t limit) {
  const std::array<const at::Tensor*, 6> inputs{&q, &k, &v, &o, &lse, &d_o};
  check_keepable(inputs);
  require(dq_strides.size() == static_cast<size_t>(q.dim()) && dk_strides.size() == static_cast<size_t>(k.dim()) &&
              dv_strides.size() == static_cast<size_t>(v.dim()),
          "the gradients' strides name other dims than q, k and v have");
  keep(kept_backwards, signature_of(is_causal, inputs),
       KeptBackward{dq, dkdv, std::move(dq_strides), std::move(dk_strides), std::move(dv_strides)}, limit);
}

// (o, L) as launch.forward returns them, or None where this signature is not kept.
std::optional<std::tuple<at::Tensor, at::Tensor>> forward(const at::Tensor& q, const at::Tensor& k,
                                                          const at::Tensor& v, bool is_causal) {
  if (kept_forwards.empty()) return std::nullopt;
  const std::array<const at::Tensor*, 3> inputs{&q, &k, &v};
  const auto found = kept_forwards.find(signature_of(is_causal, inputs));
  if (found == kept_forwards.end() || !all_aligned(inputs)) return std::nullopt;
  const KeptForward& kept = found->second;
  const c10::DeviceGuard on_device(q.device());
  bind_context(q.device());
  at::Tensor o = empty_laid_out(q, kept.o_strides);
  at::Tensor lse = row_statistic(q);
  // Workspaces live until the launch is queued: freed before it, their blocks could be handed out again.
  at::Tensor partial, arrivals;
  std::array<uint64_t, kMaxAddresses> addresses{address(q), address(k), address(v), address(o), address(lse)};
  if (kept.partial_elements >= 0) {
    partial = at::empty({kept.partial_elements}, q.options().dtype(at::kFloat));
    arrivals = at::zeros({kept.arrival_elements}, q.options().dtype(at::kInt));
    addresses[5] = address(partial);
    addresses[6] = address(arrivals);
  }
  kept.launch(addresses.data(), current_stream(q.device()));
  return std::make_tuple(std::move(o), std::move(lse));
}

// (dQ, dK, dV) as launch.backward returns them, or None where this signature is not kept.
std::optional<std::tuple<at::Tensor, at::Tensor, at::Tensor>> backward(const at::Tensor& q, const at::Tensor& k,
                                                                       const at::Tensor& v, const at::Tensor& o,
                                                                       const at::Tensor& lse, const at::Tensor& d_o,
                                                                       bool is_causal) {
  if (kept_backwards.empty()) return std::nullopt;
  const std::array<const at::Tensor*, 6> inputs{&q, &k, &v, &o, &lse, &d_o};
  const auto found = kept_backwards.find(signature_of(is_causal, inputs));
  if (found == kept_backwards.end() || !all_aligned(inputs)) return std::nullopt;
  const KeptBackward& kept = found->second;
  const c10::DeviceGuard on_device(q.device());
  bind_context(q.device());
  at::Tensor dq = empty_laid_out(q, kept.dq_strides), dk = empty_laid_out(k, kept.dk_strides),
             dv = empty_laid_out(v, kept.dv_strides);
  at::Tensor delta = row_statistic(q);
  const CUstream stream = current_stream(q.device());
  // The kernels' pointer order: dQ (q, k, v, o, dO, L, D, dQ), then dK/dV (q, k, v, dO, L, D, dK, dV).
  const std::array<uint64_t, kMaxAddresses> dq_addresses{address(q), address(k), address(v), address(o),
                                                         address(d_o), address(lse), address(delta), address(dq)};
  const std::array<uint64_t, kMaxAddresses> dkdv_addresses{address(q), address(k), address(v), address(d_o),
                                                           address(lse), address(delta), address(dk), address(dv)};
  kept.dq(dq_addresses.data(), stream);
  kept.dkdv(dkdv_addresses.data(), stream);
  return std::make_tuple(std::move(dq), std::move(dk), std::move(dv));
}

std::tuple<int64_t, int64_t> kept_counts() {
  return {static_cast<int64_t>(kept_forwards.size()), static_cast<int64_t>(kept_backwards.size())};
}

void clear() {
  kept_forwards.clear();
  kept_backwards.clear();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Kept eager FlashAttention launches, looked up by signature and launched from C++";
  py::class_<Launch>(m, "Launch")
      .def(py::init<int64_t, std::vector<int64_t>, int64_t, int64_t, int64_t, const std::vector<int64_t>&,
                    const std::vector<int64_t>&, const std::vector<double>&,
                    const std::vector<std::vector<int64_t>>&>(),
           py::arg("function"), py::arg("grid"), py::arg("threads"), py::arg("shared_bytes"),
           py::arg("null_pointers"), py::arg("kinds"), py::arg("integers"), py::arg("reals"),
           py::arg("tensor_maps") = std::vector<std::vector<int64_t>>{})
      .def("packed", &Launch::packed, py::arg("addresses"));
  m.def("keep_forward", &keep_forward, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("is_causal"),
        py::arg("launch"), py::arg("o_strides"), py::arg("partial_elements"), py::arg("arrival_elements"),
        py::arg("limit"));
  m.def("keep_backward", &keep_backward, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("o"), py::arg("lse"),
        py::arg("do"), py::arg("is_causal"), py::arg("dq"), py::arg("dkdv"), py::arg("dq_strides"),
        py::arg("dk_strides"), py::arg("dv_strides"), py::arg("limit"));
  m.def("forward", &forward, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("is_causal"));
  m.def("backward", &backward, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("o"), py::arg("lse"),
        py::arg("do"), py::arg("is_causal"));
  m.def("kept_counts", &kept_counts);
  m.def("clear", &clear);
}
