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
// Launch plans and sites: plans.h.
//
// Shapes (docs/shapes.md): x_TF [T, F] rows that may be strided (last dim contiguous for rms_norm), weight_F [F],
// w_OF [O, F]; the MoE's as mok/kernels/moe/layer.py's.

#include "plans.h"

#include <torch/csrc/autograd/python_variable.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <atomic>
#include <cmath>
#include <optional>
#include <thread>

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace mok_native {

// ---- rms_norm ---------------------------------------------------------------------------------------------------
// The launchers' allocation and layout, as mok/kernels/rms_norm.py's rms_norm and rms_norm_backward do them.

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
