// Launch plans: what mok/kernels/launch.py's LaunchPlan.export records, kept per key and replayed from C++
// (plans.cpp). The ops of native.cpp hand a site's tensors to run_site; the first call of a key records the site's
// Python launcher, later calls replay its launches with the addresses of their own tensors.
//
// Sites: a site is one launcher of mok/kernels (an integer, mok/kernels/native/__init__.py's sites). A site's plans
// are keyed by the site, its scalars and, per tensor, device, dtype, sizes, strides, address modulo 16 (what Triton
// specializes on) and which earlier tensor it overlaps, plus what a site adds (the MoE decode: its settings, the
// stream and the thread). A key's first call runs the site's Python launcher inside a recording (the GIL taken) and
// keeps the exported plan, or nothing when the recording cannot be replayed: that key's calls then always run the
// Python launcher.

#pragma once

#include <torch/extension.h>

#include <array>
#include <list>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace mok_native {

// The sites, as mok/kernels/native/__init__.py names them (the two lists must agree).
constexpr int64_t kRmsNormSite = 0;
constexpr int64_t kRmsNormBackwardSite = 1;
constexpr int64_t kLinearSite = 2;
constexpr int64_t kLinearBackwardSite = 3;
constexpr int64_t kMoeDecodeSite = 4;

struct Plan;  // a recorded plan's launches and what they keep reading (plans.cpp)

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

// The dense ops' plans (site < kMoeDecodeSite) or the MoE decode's.
PlanTable& table(int64_t site);

// Python's side (mok/kernels/native/__init__.py, _run_site): run(site, per_call, scalars, record) runs the site's
// launcher on per_call and, with record, returns the exported plan of those launches (or None) and what it keeps.
py::object& site_runner();

// mok/kernels/moe/layer.py's decode_settings, read at every MoE decode call.
py::object& moe_settings_reader();

// Runs a site's launches on per_call (all on the current device), through a plan when its key has one. key_words:
// more of what fixes the launches, keyed but not handed to the site. plannable false: the site's launcher runs
// unrecorded and nothing is looked up or kept.
void run_site(int64_t site, const std::vector<double>& scalars, const std::vector<at::Tensor>& per_call,
              const std::vector<int64_t>& key_words = {}, bool plannable = true);

}  // namespace mok_native
