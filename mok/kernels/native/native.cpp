// mok's native eager path: launch plans replayed from C++; the autograd nodes of mok.rms_norm and mok.linear in C++;
// mok.moe's inference calls, whose decode plans keep their workspace.
//
// Why (docs/kernels.md, "Native eager path"): at training sizes an eager dense op is host-bound, and on the
// H200 machine a Python torch.autograd.Function alone costs 62% of torch's whole F.rms_norm forward+backward.
// Here the forward, the autograd node and the backward are C++; the launches are the ones Triton made for the
// same call, recorded once in Python (mok/kernels/launch.py, LaunchPlan.export) and replayed here with the
// addresses of each call's own tensors (host tensor descriptors encoded again over them). The kernels, their
// arguments and grids are Triton's: values and bits are those of the Python path.
//
// Sites: a site is one launcher of mok/kernels (an integer, mok/kernels/native/__init__.py's sites). A site's plans
// are keyed by the site, its scalars and, per tensor, device, dtype, sizes, strides, address modulo 16 (what Triton
// specializes on) and which earlier tensor it overlaps, plus what a site adds (the MoE decode: its settings, the
// stream and the thread). A key's first call runs the site's Python launcher inside a recording (the GIL taken) and
// keeps the exported plan, or nothing when the recording cannot be replayed: that key's calls then always run the
// Python launcher.
//
// Shapes (docs/shapes.md): x_TF [T, F] rows that may be strided (last dim contiguous for rms_norm), weight_F [F],
// w_OF [O, F]; the MoE's as mok/kernels/moe/layer.py's.

#include <torch/extension.h>
#include <torch/csrc/autograd/python_variable.h>

#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <dlfcn.h>

#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <vector>

namespace py = pybind11;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

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

// ---- plan keys and the table ------------------------------------------------------------------------------------

using Key = std::vector<int64_t>;

struct KeyHash {
  size_t operator()(const Key& key) const {
    uint64_t hash = 1469598103934665603ULL;
    for (int64_t word : key) {
      hash = (hash ^ static_cast<uint64_t>(word)) * 1099511628211ULL;
    }
    return static_cast<size_t>(hash);
  }
};

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

// The plans of a group of sites, least recently used first out. A null plan: the key's recording could not be
// replayed. Plans leave the table outside its lock: a kept tensor's last reference may take the GIL (a tensor made in
// Python), and a thread holding the GIL may be waiting for this lock.
class PlanTable {
 public:
  using Entry = std::pair<Key, std::shared_ptr<const Plan>>;

  struct Found {
    bool present;
    std::shared_ptr<const Plan> plan;
  };

  explicit PlanTable(size_t capacity) : capacity_(capacity) {}

  Found find(const Key& key) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = index_.find(key);
    if (it == index_.end()) return {false, nullptr};
    order_.splice(order_.end(), order_, it->second);
    ++replays_;
    return {true, it->second->second};
  }

  void insert(const Key& key, std::shared_ptr<const Plan> plan) {  // (plan and evicted: destroyed after the lock)
    std::list<Entry> evicted;
    std::lock_guard<std::mutex> lock(mutex_);
    ++records_;
    auto it = index_.find(key);
    if (it != index_.end()) {  // another thread recorded the same key meanwhile: the replaced plan leaves in `plan`
      std::swap(it->second->second, plan);
      return;
    }
    while (capacity_ > 0 && index_.size() >= capacity_) {
      index_.erase(order_.front().first);
      evicted.splice(evicted.end(), order_, order_.begin());
    }
    if (capacity_ == 0) return;
    order_.emplace_back(key, std::move(plan));
    index_.emplace(key, std::prev(order_.end()));
  }

  void clear() { set_capacity(capacity()); }

  // Drops every plan; the capacity (0: no plans kept).
  void set_capacity(size_t capacity) {
    std::list<Entry> dropped;  // (destroyed after the lock)
    std::lock_guard<std::mutex> lock(mutex_);
    index_.clear();
    dropped.swap(order_);
    capacity_ = capacity;
  }

  size_t capacity() {
    std::lock_guard<std::mutex> lock(mutex_);
    return capacity_;
  }

  // (keys held, keys whose plan is null, first calls recorded, calls that found their key)
  std::array<int64_t, 4> stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    int64_t unplanned = 0;
    for (const auto& entry : order_) unplanned += entry.second == nullptr;
    return {static_cast<int64_t>(index_.size()), unplanned, records_, replays_};
  }

 private:
  std::mutex mutex_;
  size_t capacity_;
  std::list<Entry> order_;
  std::unordered_map<Key, std::list<Entry>::iterator, KeyHash> index_;
  int64_t records_ = 0;
  int64_t replays_ = 0;
};

constexpr int64_t kMoeDecodeSite = 4;

// The dense ops' plans (native.configure's capacity) and the MoE decode's, which keep a workspace each: at most
// mok/kernels/moe/layer.py's decode_plans.capacity of them, as on the Python path. Never destroyed: their tensors are
// not freed after the interpreter and CUDA may have gone at exit.
PlanTable& table(int64_t site) {
  static PlanTable* dense = new PlanTable(64);
  static PlanTable* moe_decode = new PlanTable(16);
  return site == kMoeDecodeSite ? *moe_decode : *dense;
}

// Python's side (mok/kernels/native/__init__.py, _run_site): run(site, per_call, scalars, record) runs the site's
// launcher on per_call and, with record, returns the exported plan of those launches (or None) and what it keeps.
py::object& site_runner() {
  static py::object* runner = new py::object();  // never destroyed: no Python call at interpreter exit
  return *runner;
}

// mok/kernels/moe/layer.py's decode_settings, read at every MoE decode call.
py::object& moe_settings_reader() {
  static py::object* reader = new py::object();
  return *reader;
}

// Runs a site's launches on per_call (all on the current device), through a plan when its key has one. key_words:
// more of what fixes the launches, keyed but not handed to the site. plannable false: the site's launcher runs
// unrecorded and nothing is looked up or kept.
void run_site(int64_t site, const std::vector<double>& scalars, const std::vector<at::Tensor>& per_call,
              const std::vector<int64_t>& key_words = {}, bool plannable = true) {
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

// ---- rms_norm ---------------------------------------------------------------------------------------------------
// The launchers' allocation and layout, as mok/kernels/rms_norm.py's rms_norm and rms_norm_backward do them.

constexpr int64_t kRmsNormSite = 0;
constexpr int64_t kRmsNormBackwardSite = 1;
// mok/kernels/rms_norm.py's BACKWARD_MAX_PROGRAMS, set by configure() (native.load and native.clear)
std::atomic<int64_t> backward_max_programs{1024};

at::Tensor last_dim_contiguous(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

std::pair<at::Tensor, at::Tensor> rms_norm_forward(at::Tensor x_TF, std::optional<at::Tensor> residual_TF,
                                                   at::Tensor weight_F, double eps) {
  x_TF = last_dim_contiguous(x_TF);
  weight_F = weight_F.contiguous();
  const int64_t num_rows = x_TF.size(0);
  at::Tensor y_TF = at::empty({num_rows, x_TF.size(1)}, x_TF.options());
  at::Tensor new_residual_TF;
  std::vector<at::Tensor> per_call;
  if (residual_TF) {
    at::Tensor residual = last_dim_contiguous(*residual_TF);
    new_residual_TF = at::empty_like(y_TF);
    per_call = {x_TF, residual, weight_F, y_TF, new_residual_TF};
  } else {
    per_call = {x_TF, weight_F, y_TF};
  }
  if (num_rows) run_site(kRmsNormSite, {eps}, per_call);
  return {y_TF, new_residual_TF};
}

// -> (d x in x's dtype, d x in residual_dtype (undefined without one), d weight in weight's dtype)
std::array<at::Tensor, 3> rms_norm_backward(at::Tensor grad_TF, at::Tensor x_TF, at::Tensor weight_F, double eps,
                                            std::optional<at::Tensor> grad_residual_TF,
                                            std::optional<at::ScalarType> residual_dtype) {
  grad_TF = last_dim_contiguous(grad_TF);
  x_TF = last_dim_contiguous(x_TF);
  weight_F = weight_F.contiguous();
  const int64_t num_rows = x_TF.size(0), num_features = x_TF.size(1);
  const bool second = residual_dtype.has_value();
  at::Tensor grad_x_TF = at::empty({num_rows, num_features}, x_TF.options());
  // Without a second dtype the Python path returns an empty [0, F]; every caller here drops it: not allocated.
  at::Tensor grad_x2_TF = second ? at::empty({num_rows, num_features}, x_TF.options().dtype(*residual_dtype))
                                 : at::Tensor();
  const int64_t max_programs = backward_max_programs.load();
  const int64_t rows_per_program = std::max<int64_t>(1, (num_rows + max_programs - 1) / max_programs);
  const int64_t programs = (num_rows + rows_per_program - 1) / rows_per_program;
  at::Tensor partial_PF = at::empty({programs, num_features}, x_TF.options().dtype(at::kFloat));
  at::Tensor grad_weight_F = at::empty_like(weight_F);
  if (programs && num_features) {
    std::vector<at::Tensor> per_call{grad_TF, x_TF, weight_F, grad_x_TF, partial_PF, grad_weight_F};
    if (grad_residual_TF) per_call.push_back(last_dim_contiguous(*grad_residual_TF));
    if (second) per_call.push_back(grad_x2_TF);
    run_site(kRmsNormBackwardSite,
             {eps, grad_residual_TF ? 1.0 : 0.0, second ? 1.0 : 0.0, static_cast<double>(rows_per_program)}, per_call);
  } else {
    grad_weight_F.zero_();
  }
  return {grad_x_TF, grad_x2_TF, grad_weight_F};
}

// A gradient taken with create_graph=True comes out of a node that raises when it is itself differentiated, as on the
// Python path, whose backward ops (mok::rms_norm_backward, mok::linear_backward) have no autograd formula: taking the
// gradient works, differentiating it again raises. Plain tensors would silently drop the second-order terms.
struct RefusedDoubleBackward : public torch::autograd::Function<RefusedDoubleBackward> {
  static variable_list forward(AutogradContext* ctx, at::TensorList gradients, at::TensorList sources,
                               const std::string& message) {
    ctx->saved_data["message"] = message;
    return gradients.vec();
  }

  static variable_list backward(AutogradContext* ctx, variable_list) {
    TORCH_CHECK(false, ctx->saved_data["message"].toStringRef());
  }
};

// gradients, attached to RefusedDoubleBackward where autograd records the backward (grads or saved tensors that
// require grad, grad mode on); one tensor given for two inputs stays one tensor.
variable_list refuse_double_backward(variable_list gradients, const variable_list& grads, const variable_list& saved,
                                     const char* message) {
  if (!at::GradMode::is_enabled()) return gradients;
  variable_list sources;
  for (const auto* list : {&grads, &saved}) {
    for (const auto& t : *list) {
      if (t.defined() && t.requires_grad()) sources.push_back(t);
    }
  }
  if (sources.empty()) return gradients;
  variable_list distinct;
  std::vector<int64_t> position(gradients.size(), -1);
  for (size_t i = 0; i < gradients.size(); ++i) {
    if (!gradients[i].defined()) continue;
    for (size_t j = 0; j < distinct.size() && position[i] < 0; ++j) {
      if (distinct[j].is_same(gradients[i])) position[i] = static_cast<int64_t>(j);
    }
    if (position[i] < 0) {
      position[i] = static_cast<int64_t>(distinct.size());
      distinct.push_back(gradients[i]);
    }
  }
  auto attached = RefusedDoubleBackward::apply(at::TensorList(distinct), at::TensorList(sources), std::string(message));
  for (size_t i = 0; i < gradients.size(); ++i) {
    if (position[i] >= 0) gradients[i] = attached[position[i]];
  }
  return gradients;
}

constexpr const char* kRmsNormDoubleBackward =
    "mok.rms_norm: no double backward: mok::rms_norm_backward has no autograd formula";

// mok/ops/rms_norm.py's _setup_plain and _backward_plain.
struct RmsNorm : public torch::autograd::Function<RmsNorm> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x_TF, const at::Tensor& weight_F, double eps) {
    ctx->save_for_backward({x_TF, weight_F});
    ctx->saved_data["eps"] = eps;
    return rms_norm_forward(x_TF, std::nullopt, weight_F, eps).first;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto gradients = rms_norm_backward(grads[0].contiguous(), saved[0], saved[1], ctx->saved_data["eps"].toDouble(),
                                       std::nullopt, std::nullopt);
    return refuse_double_backward({gradients[0], gradients[2], at::Tensor()}, grads, saved, kRmsNormDoubleBackward);
  }
};

// mok/ops/rms_norm.py's _setup_fused and _backward_fused (an unused output's gradient comes as zeros there too).
struct FusedAddRmsNorm : public torch::autograd::Function<FusedAddRmsNorm> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x_TF, const at::Tensor& residual_TF,
                               const at::Tensor& weight_F, double eps) {
    auto [y_TF, new_residual_TF] = rms_norm_forward(x_TF, residual_TF, weight_F, eps);
    ctx->save_for_backward({new_residual_TF, weight_F});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["x_dtype"] = x_TF.scalar_type();
    ctx->saved_data["residual_dtype"] = residual_TF.scalar_type();
    return {y_TF, new_residual_TF};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto x_dtype = ctx->saved_data["x_dtype"].toScalarType();
    const auto residual_dtype = ctx->saved_data["residual_dtype"].toScalarType();
    std::optional<at::ScalarType> other_dtype;
    if (residual_dtype != x_dtype) other_dtype = residual_dtype;
    at::Tensor grad_y_TF = grads[0].defined() ? grads[0] : at::zeros_like(saved[0]);
    std::optional<at::Tensor> grad_residual_TF;
    if (grads[1].defined()) grad_residual_TF = grads[1];
    auto gradients = rms_norm_backward(grad_y_TF.contiguous(), saved[0], saved[1], ctx->saved_data["eps"].toDouble(),
                                       grad_residual_TF, other_dtype);
    return refuse_double_backward({gradients[0], other_dtype ? gradients[1] : gradients[0], gradients[2], at::Tensor()},
                                  grads, saved, kRmsNormDoubleBackward);
  }
};

// Whether torch.autograd.Function's apply has anything to do for these inputs: a node to record (grad mode on and an
// input requiring grad) or a forward-mode tangent, which apply refuses (C++ Functions have no jvp) where the forward
// alone would silently drop it. Without either, the forward runs alone (no node, nothing saved), minus apply's host
// time. (Forward-mode AD has one level, 0: torch refuses nested dual levels.)
bool needs_apply(std::initializer_list<const at::Tensor*> inputs) {
  const bool grad_mode = at::GradMode::is_enabled();
  for (const at::Tensor* t : inputs) {
    if (t && ((grad_mode && t->requires_grad()) || t->_fw_grad(/*level=*/0).defined())) return true;
  }
  return false;
}

at::Tensor rms_norm(const at::Tensor& x_TF, const at::Tensor& weight_F, double eps) {
  c10::cuda::CUDAGuard guard(x_TF.device());
  if (!needs_apply({&x_TF, &weight_F})) return rms_norm_forward(x_TF, std::nullopt, weight_F, eps).first;
  return RmsNorm::apply(x_TF, weight_F, eps);
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x_TF, const at::Tensor& residual_TF,
                                                      const at::Tensor& weight_F, double eps) {
  c10::cuda::CUDAGuard guard(x_TF.device());
  if (!needs_apply({&x_TF, &residual_TF, &weight_F})) return rms_norm_forward(x_TF, residual_TF, weight_F, eps);
  auto outputs = FusedAddRmsNorm::apply(x_TF, residual_TF, weight_F, eps);
  return {outputs[0], outputs[1]};
}

// ---- linear -----------------------------------------------------------------------------------------------------
// mok/ops/linear.py's forward and backward on CUDA: the launches of mok/kernels/linear.py's forward_site and
// backward_site, the outputs allocated and the empty cases filled as its matmul does them.

constexpr int64_t kLinearSite = 2;
constexpr int64_t kLinearBackwardSite = 3;

at::Tensor linear_forward(const at::Tensor& x_TF, const at::Tensor& w_OF, const std::optional<at::Tensor>& bias_O) {
  at::Tensor out_TO = at::empty({x_TF.size(0), w_OF.size(0)}, x_TF.options());
  if (out_TO.numel() == 0) return out_TO;
  if (x_TF.size(1) == 0) {  // an empty reduction: zeros, plus the bias
    out_TO.zero_();
    if (bias_O) out_TO.add_(bias_O->to(out_TO.scalar_type()));
    return out_TO;
  }
  std::vector<at::Tensor> per_call{x_TF, w_OF};
  if (bias_O) per_call.push_back(*bias_O);
  per_call.push_back(out_TO);
  run_site(kLinearSite, {bias_O ? 1.0 : 0.0}, per_call);
  return out_TO;
}

// -> (d x [T, F] in x's dtype, d w [O, F] in w's dtype), grad_TO contiguous
std::pair<at::Tensor, at::Tensor> linear_backward(const at::Tensor& grad_TO, const at::Tensor& x_TF,
                                                  const at::Tensor& w_OF) {
  const int64_t num_rows = x_TF.size(0), num_features = x_TF.size(1), num_outputs = w_OF.size(0);
  at::Tensor grad_x_TF = at::empty({num_rows, num_features}, x_TF.options());
  at::Tensor grad_w_OF = at::empty({num_outputs, num_features}, w_OF.options());
  if (num_rows && num_features && num_outputs) {
    run_site(kLinearBackwardSite, {}, {grad_TO, x_TF, w_OF, grad_x_TF, grad_w_OF});
  } else {  // an empty reduction gives zeros
    if (num_outputs == 0) grad_x_TF.zero_();
    if (num_rows == 0) grad_w_OF.zero_();
  }
  return {grad_x_TF, grad_w_OF};
}

// mok/ops/linear.py's _setup_context and _backward (d bias: the rows' fp32 sum in torch, cast to the bias' dtype).
struct Linear : public torch::autograd::Function<Linear> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x_TF, const at::Tensor& w_OF,
                            const std::optional<at::Tensor>& bias_O) {
    ctx->save_for_backward({x_TF, w_OF});
    ctx->saved_data["has_bias"] = bias_O.has_value();
    if (bias_O) ctx->saved_data["bias_dtype"] = bias_O->scalar_type();
    return linear_forward(x_TF, w_OF, bias_O);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor grad_TO = grads[0].contiguous();
    auto [grad_x_TF, grad_w_OF] = linear_backward(grad_TO, saved[0], saved[1]);
    at::Tensor grad_bias_O;
    if (ctx->saved_data["has_bias"].toBool()) {
      grad_bias_O = grad_TO.to(at::kFloat).sum(0).to(ctx->saved_data["bias_dtype"].toScalarType());
    }
    return refuse_double_backward({grad_x_TF, grad_w_OF, grad_bias_O}, grads, saved,
                                  "mok.linear: no double backward: mok::linear_backward has no autograd formula");
  }
};

at::Tensor linear(const at::Tensor& x_TF, const at::Tensor& w_OF, const std::optional<at::Tensor>& bias_O) {
  c10::cuda::CUDAGuard guard(x_TF.device());
  if (!needs_apply({&x_TF, &w_OF, bias_O ? &*bias_O : nullptr})) return linear_forward(x_TF, w_OF, bias_O);
  return Linear::apply(x_TF, w_OF, bias_O);
}

// ---- whole public calls -------------------------------------------------------------------------------------------
// mok.rms_norm's and mok.linear's first step (mok/ops/dispatch.py, native_call), once Python has seen a plain mode and
// a first argument that is a plain CUDA tensor. A call whose every tensor is a plain tensor (torch.Tensor or
// nn.Parameter: THPVariable_CheckExact), strided, floating point and on that CUDA device, with valid sizes and
// scalars, runs here whole: rows merged and the output shaped back as mok/ops/dispatch.py's rows and shaped do, then
// the same C++ calls as above. Any other call gets None, and the Python function checks its arguments itself (raising
// mok's typed errors) and takes its own path. What this saves is host time only: on the H200 machine the Python
// checks and dispatch of one call cost more than the C++ forward they lead to (docs/kernels.md).

bool is_float(const at::Tensor& t) {
  const auto dtype = t.scalar_type();
  return dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
}

// The tensors behind `args` when each is a plain, strided, floating-point tensor on the first one's CUDA device.
std::optional<std::vector<at::Tensor>> plain_cuda_floats(std::initializer_list<py::handle> args) {
  std::vector<at::Tensor> tensors;
  tensors.reserve(args.size());
  for (py::handle arg : args) {
    if (!THPVariable_CheckExact(arg.ptr())) return std::nullopt;
    const at::Tensor& t = THPVariable_Unpack(arg.ptr());
    if (!t.is_cuda() || t.layout() != at::kStrided || !is_float(t)) return std::nullopt;
    if (!tensors.empty() && t.device() != tensors.front().device()) return std::nullopt;
    tensors.push_back(t);
  }
  return tensors;
}

at::Tensor rows(const at::Tensor& t) { return t.dim() == 2 ? t : t.reshape({-1, t.size(-1)}); }

at::Tensor shaped(const at::Tensor& t, at::IntArrayRef sizes) { return t.sizes().equals(sizes) ? t : t.reshape(sizes); }

// mok.rms_norm(x_TF, weight_F, eps, residual_TF) for x [..., F], weight [F], eps a float >= 0, residual None or like x
py::object rms_norm_call(py::handle x, py::handle weight, py::handle eps, py::handle residual) {
  if (!PyFloat_CheckExact(eps.ptr())) return py::none();
  const double eps_value = PyFloat_AS_DOUBLE(eps.ptr());
  if (!std::isfinite(eps_value) || eps_value < 0) return py::none();
  const bool fused = !residual.is_none();
  auto tensors = fused ? plain_cuda_floats({x, weight, residual}) : plain_cuda_floats({x, weight});
  if (!tensors) return py::none();
  const at::Tensor& x_TD = (*tensors)[0];
  const at::Tensor& weight_F = (*tensors)[1];
  if (x_TD.dim() < 1 || x_TD.size(-1) == 0 || weight_F.dim() != 1 || weight_F.size(0) != x_TD.size(-1)) {
    return py::none();
  }
  if (!fused) return py::cast(shaped(mok_native::rms_norm(rows(x_TD), weight_F, eps_value), x_TD.sizes()));
  const at::Tensor& residual_TD = (*tensors)[2];
  if (!residual_TD.sizes().equals(x_TD.sizes())) return py::none();
  auto [y_TF, new_residual_TF] = mok_native::fused_add_rms_norm(rows(x_TD), rows(residual_TD), weight_F, eps_value);
  return py::make_tuple(shaped(y_TF, x_TD.sizes()), shaped(new_residual_TF, x_TD.sizes()));
}

// mok.linear(x_TF, weight_OF, bias_O) for x [..., F], weight [O, F], bias None or [O]
py::object linear_call(py::handle x, py::handle weight, py::handle bias) {
  const bool has_bias = !bias.is_none();
  auto tensors = has_bias ? plain_cuda_floats({x, weight, bias}) : plain_cuda_floats({x, weight});
  if (!tensors) return py::none();
  const at::Tensor& x_TF = (*tensors)[0];
  const at::Tensor& w_OF = (*tensors)[1];
  // (rows' reshape of an empty last dim fails in Python as here: that call goes there)
  if (x_TF.dim() < 1 || w_OF.dim() != 2 || x_TF.size(-1) != w_OF.size(1) || (x_TF.dim() != 2 && x_TF.size(-1) == 0)) {
    return py::none();
  }
  std::optional<at::Tensor> bias_O;
  if (has_bias) {
    bias_O = (*tensors)[2];
    if (bias_O->dim() != 1 || bias_O->size(0) != w_OF.size(0)) return py::none();
  }
  std::vector<int64_t> sizes(x_TF.sizes().begin(), x_TF.sizes().end());
  sizes.back() = w_OF.size(0);
  return py::cast(shaped(mok_native::linear(rows(x_TF), w_OF, bias_O), sizes));  // (not ADL's at::linear)
}

// ---- moe (inference) ---------------------------------------------------------------------------------------------
// mok/kernels/moe/layer.py's moe_infer(..., plan=True), a plain eager call of mok::moe_infer on CUDA: out allocated,
// the inputs made contiguous and the weights fp32 as there; decode sizes replay a plan that keeps its workspace
// (the key holds the stream and the thread, whose calls use it in order, and decode_settings' settings); other sizes,
// plans off (decode_plans.capacity 0) and calls under CUDA-graph capture run the launchers unrecorded.

enum DecodeLayout : int64_t { kRoute = 0, kReplay = 1, kWeights = 2 };  // layer.py's DECODE_*

at::Tensor moe_infer(const at::Tensor& hidden_TH, const at::Tensor& logits_TE, const at::Tensor& w13_E2IH,
                     const at::Tensor& w2_EHI, const std::optional<at::Tensor>& ids_TK,
                     const std::optional<at::Tensor>& weights_TK, int64_t top_k, bool renormalize) {
  c10::cuda::CUDAGuard guard(hidden_TH.device());
  const int64_t num_tokens = hidden_TH.size(0), hidden = hidden_TH.size(1);
  at::Tensor out_TH = at::empty({num_tokens, hidden}, hidden_TH.options());
  if (num_tokens == 0) return out_TH;
  const at::Tensor x_TH = hidden_TH.contiguous();
  std::vector<at::Tensor> per_call;
  int64_t layout;
  TORCH_CHECK(ids_TK || !weights_TK, "mok native: moe_infer's topk_weights come with their topk_ids");
  if (weights_TK) {
    per_call = {x_TH, ids_TK->contiguous(), weights_TK->to(at::kFloat).contiguous(), out_TH, w13_E2IH, w2_EHI};
    layout = kWeights;
  } else if (ids_TK) {
    per_call = {x_TH, logits_TE.contiguous(), ids_TK->contiguous(), out_TH, w13_E2IH, w2_EHI};
    layout = kReplay;
  } else {
    per_call = {x_TH, logits_TE.contiguous(), out_TH, w13_E2IH, w2_EHI};
    layout = kRoute;
  }
  std::vector<int64_t> settings;
  {
    py::gil_scoped_acquire gil;
    TORCH_CHECK(moe_settings_reader(), "mok native: no MoE settings reader set");
    settings = moe_settings_reader()().cast<std::vector<int64_t>>();
  }
  // (decode_plans.capacity, DECODE_PLAN_MAX_BYTES, then the settings keyed): act and y are most of the workspace
  const auto capacity = static_cast<size_t>(std::max<int64_t>(0, settings.at(0)));
  if (table(kMoeDecodeSite).capacity() != capacity) table(kMoeDecodeSite).set_capacity(capacity);
  const int64_t workspace_bytes = num_tokens * top_k * (w2_EHI.size(2) + hidden) * x_TH.element_size();
  const bool plannable = capacity > 0 && workspace_bytes <= settings.at(1) &&
                         c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None;
  std::vector<int64_t> key_words(settings.begin() + 2, settings.end());
  key_words.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(c10::cuda::getCurrentCUDAStream().stream())));
  key_words.push_back(static_cast<int64_t>(std::hash<std::thread::id>{}(std::this_thread::get_id())));
  run_site(kMoeDecodeSite, {static_cast<double>(top_k), renormalize ? 1.0 : 0.0, static_cast<double>(layout)},
           per_call, key_words, plannable);
  return out_TH;
}

}  // namespace mok_native

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace mok_native;
  m.def("rms_norm", &rms_norm, "mok::rms_norm's plain eager CUDA call, its autograd node in C++");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "mok::fused_add_rms_norm's plain eager CUDA call");
  m.def("linear", &linear, "mok::linear's plain eager CUDA call, its autograd node in C++");
  m.def("rms_norm_call", &rms_norm_call, "mok.rms_norm's whole call where this path takes it, else None");
  m.def("linear_call", &linear_call, "mok.linear's whole call where this path takes it, else None");
  m.def("moe_infer", &moe_infer, "mok::moe_infer's plain eager CUDA call (no autograd: called without gradients)");
  m.def("set_site_runner", [](py::object runner, py::object moe_settings) {
    site_runner() = std::move(runner);
    moe_settings_reader() = std::move(moe_settings);
  });
  m.def("configure", [](int64_t max_programs, size_t capacity) {
    backward_max_programs = max_programs;
    table(0).set_capacity(capacity);
    table(kMoeDecodeSite).clear();
  });
  m.def("clear", [] {
    table(0).clear();
    table(kMoeDecodeSite).clear();
  });
  m.def("stats", [] {  // both tables together
    auto dense = table(0).stats(), moe_decode = table(kMoeDecodeSite).stats();
    return py::make_tuple(dense[0] + moe_decode[0], dense[1] + moe_decode[1], dense[2] + moe_decode[2],
                          dense[3] + moe_decode[3]);
  });
}
