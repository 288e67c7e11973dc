// Launch plans replayed from C++ (plans.h): Triton's launches as LaunchPlan.export records them, the host tensor
// descriptors encoded again over each call's addresses, and the per-key table of plans.

#include "plans.h"

#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <dlfcn.h>

#include <cstring>

namespace mok_native {

// ---- launches -------------------------------------------------------------------------------------------------

// A driver entry point, found as Triton's own launchers find it (no link against libcuda).
void* driver_function(const char* name) {
  static void* library = [] {
    void* opened = dlopen("libcuda.so.1", RTLD_LAZY);
    TORCH_CHECK(opened != nullptr, "mok native: cannot open libcuda.so.1");
    return opened;
  }();
  void* found = dlsym(library, name);
  TORCH_CHECK(found != nullptr, "mok native: libcuda.so.1 has no ", name);
  return found;
}

using LaunchKernelEx = CUresult (*)(const CUlaunchConfig*, CUfunction, void**, void**);

LaunchKernelEx launch_kernel_ex() {
  static auto function = reinterpret_cast<LaunchKernelEx>(driver_function("cuLaunchKernelEx"));
  return function;
}

using TensorMapEncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                          const cuuint64_t*, const cuuint32_t*, const cuuint32_t*,
                                          CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion,
                                          CUtensorMapFloatOOBfill);

TensorMapEncodeTiled tensor_map_encode_tiled() {
  static auto function = reinterpret_cast<TensorMapEncodeTiled>(driver_function("cuTensorMapEncodeTiled"));
  return function;
}

// A host tensor descriptor's tensor map, as Triton's fill_tma_descriptor encodes it (Triton 3.6's
// backends/nvidia/driver.c): dimensions innermost first, byte strides of all but the innermost, unit element
// strides, no interleave, 128-byte L2 promotion. Only the base address changes between calls.
struct TensorMapSpec {
  CUtensorMapDataType data_type;
  CUtensorMapSwizzle swizzle;
  CUtensorMapFloatOOBfill fill;
  cuuint32_t rank;
  std::array<cuuint64_t, 5> dims;
  std::array<cuuint64_t, 5> byte_strides;
  std::array<cuuint32_t, 5> box;
};

void encode_tensor_map(CUtensorMap* map, const TensorMapSpec& spec, uint64_t address) {
  static const std::array<cuuint32_t, 5> unit_strides{1, 1, 1, 1, 1};
  const CUresult result = tensor_map_encode_tiled()(
      map, spec.data_type, spec.rank, reinterpret_cast<void*>(address), spec.dims.data(), spec.byte_strides.data(),
      spec.box.data(), unit_strides.data(), CU_TENSOR_MAP_INTERLEAVE_NONE, spec.swizzle,
      CU_TENSOR_MAP_L2_PROMOTION_L2_128B, spec.fill);
  TORCH_CHECK(result == CUDA_SUCCESS, "mok native: cuTensorMapEncodeTiled failed (CUresult ",
              static_cast<int>(result), ")");
}

// One kernel parameter: its bytes (little-endian, in the low bytes), or, with source >= 0, the address of the
// call's tensor number `source` plus `value` bytes; with tensor_map >= 0, the launch's tensor map of that number
// over that address (the parameter is the map itself, by value).
struct Param {
  uint64_t value;
  int64_t source;
  int64_t tensor_map = -1;
};

struct Launch {
  CUfunction function;
  std::array<unsigned, 3> grid;
  unsigned block_threads;
  unsigned shared_bytes;
  bool cooperative;
  bool pdl;
  std::vector<Param> params;  // every parameter the compiled kernel takes, Triton's two scratch pointers last
  std::vector<TensorMapSpec> tensor_maps;
};

struct Plan {
  std::vector<Launch> launches;
  std::vector<at::Tensor> kept;  // what the launches keep reading between calls (the MoE decode's workspace)
};

namespace {  // what only this file uses

constexpr size_t kMaxParams = 64;
constexpr size_t kMaxTensorMaps = 4;

void replay(const Plan& plan, const std::vector<at::Tensor>& per_call, CUstream stream) {
  for (const Launch& launch : plan.launches) {
    if (launch.grid[0] == 0 || launch.grid[1] == 0 || launch.grid[2] == 0) continue;  // as Triton's launcher
    std::array<uint64_t, kMaxParams> slots;
    std::array<void*, kMaxParams> pointers;
    struct alignas(128) AlignedMap {  // the alignment Triton's launcher asks of a tensor map
      CUtensorMap map;
    };
    std::array<AlignedMap, kMaxTensorMaps> maps;
    const size_t count = launch.params.size();
    for (size_t i = 0; i < count; ++i) {
      const Param& param = launch.params[i];
      slots[i] = param.source < 0
          ? param.value
          : reinterpret_cast<uint64_t>(per_call[param.source].data_ptr()) + param.value;
      pointers[i] = &slots[i];
      if (param.tensor_map >= 0) {
        encode_tensor_map(&maps[param.tensor_map].map, launch.tensor_maps[param.tensor_map], slots[i]);
        pointers[i] = &maps[param.tensor_map].map;
      }
    }
    CUlaunchAttribute attributes[2] = {};
    unsigned num_attributes = 0;
    if (launch.pdl) {
      attributes[num_attributes].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
      attributes[num_attributes].value.programmaticStreamSerializationAllowed = 1;
      ++num_attributes;
    }
    if (launch.cooperative) {
      attributes[num_attributes].id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
      attributes[num_attributes].value.cooperative = 1;
      ++num_attributes;
    }
    CUlaunchConfig config{};
    config.gridDimX = launch.grid[0];
    config.gridDimY = launch.grid[1];
    config.gridDimZ = launch.grid[2];
    config.blockDimX = launch.block_threads;
    config.blockDimY = 1;
    config.blockDimZ = 1;
    config.sharedMemBytes = launch.shared_bytes;
    config.hStream = stream;
    config.attrs = attributes;
    config.numAttrs = num_attributes;
    const CUresult result = launch_kernel_ex()(&config, launch.function, pointers.data(), nullptr);
    TORCH_CHECK(result == CUDA_SUCCESS, "mok native: cuLaunchKernelEx failed (CUresult ", static_cast<int>(result),
                ")");
  }
}

// A tensor map's encoding as LaunchPlan.export gives it: (data type, swizzle, element bytes, OOB fill (1: NaN), block,
// shape, strides), sizes outermost first and strides in elements, as fill_tma_descriptor receives them.
TensorMapSpec tensor_map_from_export(const py::tuple& encoding) {
  TensorMapSpec spec{};
  spec.data_type = static_cast<CUtensorMapDataType>(encoding[0].cast<int>());
  spec.swizzle = static_cast<CUtensorMapSwizzle>(encoding[1].cast<int>());
  const auto element_bytes = encoding[2].cast<uint64_t>();
  spec.fill = encoding[3].cast<int>() == 1 ? CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA
                                           : CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE;
  auto block = encoding[4].cast<std::vector<uint32_t>>();
  auto shape = encoding[5].cast<std::vector<uint64_t>>();
  auto strides = encoding[6].cast<std::vector<uint64_t>>();
  const size_t rank = block.size();
  TORCH_CHECK(rank >= 1 && rank <= 5 && shape.size() == rank && strides.size() == rank,
              "mok native: a tensor map of rank ", rank);
  spec.rank = static_cast<cuuint32_t>(rank);
  for (size_t i = 0; i < rank; ++i) {
    spec.box[rank - 1 - i] = block[i];
    spec.dims[rank - 1 - i] = shape[i];
  }
  for (size_t i = 0; i + 1 < rank; ++i) spec.byte_strides[rank - 2 - i] = element_bytes * strides[i];
  return spec;
}

// A plan as LaunchPlan.export gives it: [(function, (gx, gy, gz), block_threads, shared_bytes, cooperative, pdl,
// [(value, source) or (offset, source, tensor map encoding), ...]), ...], and the tensors it keeps reading.
std::shared_ptr<const Plan> plan_from_export(const py::handle& exported, std::vector<at::Tensor> kept) {
  auto plan = std::make_shared<Plan>();
  plan->kept = std::move(kept);
  for (const py::handle& item : exported) {
    auto fields = item.cast<py::tuple>();
    Launch launch;
    launch.function = reinterpret_cast<CUfunction>(fields[0].cast<uint64_t>());
    auto grid = fields[1].cast<py::tuple>();
    for (int axis = 0; axis < 3; ++axis) {
      launch.grid[axis] = grid[axis].cast<unsigned>();
    }
    launch.block_threads = fields[2].cast<unsigned>();
    launch.shared_bytes = fields[3].cast<unsigned>();
    launch.cooperative = fields[4].cast<bool>();
    launch.pdl = fields[5].cast<bool>();
    for (const py::handle& param : fields[6]) {
      auto entry = param.cast<py::tuple>();
      Param parsed{entry[0].cast<uint64_t>(), entry[1].cast<int64_t>()};
      if (entry.size() == 3) {
        parsed.tensor_map = static_cast<int64_t>(launch.tensor_maps.size());
        launch.tensor_maps.push_back(tensor_map_from_export(entry[2].cast<py::tuple>()));
      }
      launch.params.push_back(parsed);
    }
    TORCH_CHECK(launch.params.size() <= kMaxParams, "mok native: a kernel with more than ", kMaxParams,
                " parameters");
    TORCH_CHECK(launch.tensor_maps.size() <= kMaxTensorMaps, "mok native: a kernel with more than ", kMaxTensorMaps,
                " tensor maps");
    plan->launches.push_back(std::move(launch));
  }
  return plan;
}

void add_tensor(Key& key, const at::Tensor& t) {
  key.push_back(t.get_device());
  key.push_back(static_cast<int64_t>(t.scalar_type()));
  key.push_back(t.dim());
  for (int64_t size : t.sizes()) key.push_back(size);
  for (int64_t stride : t.strides()) key.push_back(stride);
  key.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16));
}

// [first, last] bytes a tensor's elements span (first > last without elements: overlaps nothing).
std::pair<uintptr_t, uintptr_t> byte_span(const at::Tensor& t) {
  const auto first = reinterpret_cast<uintptr_t>(t.data_ptr());
  if (t.numel() == 0) return {first + 1, first};
  int64_t extent = 0;
  for (int64_t d = 0; d < t.dim(); ++d) extent += (t.size(d) - 1) * t.stride(d);
  return {first, first + (extent + 1) * t.element_size() - 1};
}

// Per tensor, the first earlier tensor whose bytes overlap it (or -1): a call with aliased tensors (the residual
// being x, one gradient tensor for both outputs) gets no plan (LaunchPlan.build), and this keeps it from sharing a
// key, and so that unplanned entry, with the calls of the same sizes that do not alias.
void add_overlaps(Key& key, const std::vector<at::Tensor>& tensors) {
  std::array<std::pair<uintptr_t, uintptr_t>, 16> spans;
  TORCH_CHECK(tensors.size() <= spans.size(), "mok native: a site with more than 16 tensors");
  for (size_t i = 0; i < tensors.size(); ++i) {
    spans[i] = byte_span(tensors[i]);
    int64_t overlapping = -1;
    for (size_t j = 0; j < i && overlapping < 0; ++j) {
      if (spans[i].first <= spans[j].second && spans[j].first <= spans[i].second) overlapping = j;
    }
    key.push_back(overlapping);
  }
}

}  // namespace

// The dense ops' plans (native.configure's capacity) and the MoE decode's, which keep a workspace each: at most
// mok/kernels/moe/layer.py's decode_plans.capacity of them, as on the Python path. Never destroyed: their tensors are
// not freed after the interpreter and CUDA may have gone at exit.
PlanTable& table(int64_t site) {
  static PlanTable* dense = new PlanTable(64);
  static PlanTable* moe_decode = new PlanTable(16);
  return site == kMoeDecodeSite ? *moe_decode : *dense;
}

py::object& site_runner() {
  static py::object* runner = new py::object();  // never destroyed: no Python call at interpreter exit
  return *runner;
}

py::object& moe_settings_reader() {
  static py::object* reader = new py::object();
  return *reader;
}

void run_site(int64_t site, const std::vector<double>& scalars, const std::vector<at::Tensor>& per_call,
              const std::vector<int64_t>& key_words, bool plannable) {
  Key key{site};
  PlanTable::Found found{false, nullptr};
  if (plannable) {
    for (double scalar : scalars) {
      int64_t bits;
      std::memcpy(&bits, &scalar, sizeof bits);
      key.push_back(bits);
    }
    for (const at::Tensor& t : per_call) add_tensor(key, t);
    add_overlaps(key, per_call);
    key.insert(key.end(), key_words.begin(), key_words.end());
    found = table(site).find(key);
    if (found.present && found.plan) {
      replay(*found.plan, per_call, c10::cuda::getCurrentCUDAStream().stream());
      return;
    }
  }
  TORCH_CHECK(Py_IsInitialized(), "mok native: a launch needs Python's launcher after the interpreter finished");
  py::gil_scoped_acquire gil;
  TORCH_CHECK(site_runner(), "mok native: no site runner set");
  // -> (the exported plan or None, whether to keep that answer for the key, the tensors the plan keeps): the
  // launches have run by now.
  const bool record = plannable && !found.present;
  auto answer = site_runner()(site, per_call, scalars, record).cast<py::tuple>();
  if (!record || !answer[1].cast<bool>()) return;
  std::shared_ptr<const Plan> plan;
  if (!answer[0].is_none()) {
    try {
      plan = plan_from_export(answer[0], answer[2].cast<std::vector<at::Tensor>>());
    } catch (const std::exception&) {  // a plan this code cannot hold: the key runs Python's launcher
      plan = nullptr;
    }
  }
  table(site).insert(key, std::move(plan));
}

}  // namespace mok_native
