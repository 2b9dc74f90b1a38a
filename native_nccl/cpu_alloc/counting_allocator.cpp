// Counting CPU allocator: exact live / peak bytes of tensor storage in this process, and an
// optional capacity past which allocations fail like a GPU out-of-memory.
//
// install() wraps whatever c10::GetCPUAllocator() returns at that moment and puts the wrapper in
// force with c10::SetCPUAllocator at kPriority (above the default allocator's 0).
//
// Layout of one allocation of n bytes: the wrapped allocator is asked for kHeader + n bytes; the
// first kHeader bytes hold a Record (the wrapped allocator's DataPtr context and deleter, n, and
// a tag), the caller gets the n bytes after it. The returned DataPtr has context == data and
// the deleter counted_delete, which finds the Record just below the data, subtracts exactly the
// n that allocate() added and frees through the original context and deleter.
//
// Why not a separate heap context (context != data): torch's CPU code also uses the raw
// interface of the CPU allocator (Allocator::raw_allocate/raw_deallocate: oneDNN/ideep buffers,
// e.g. in gelu and linear), which requires context == data and a fixed raw_deleter(); a wrapper
// without it aborts the process on the first such free. It would also make Tensor._lazy_clone()
// fail. kHeader is c10::gAlignment (64 on x86), so the data keeps the wrapped allocator's
// alignment; the header is real memory but not counted.
//
// Storage allocated before install() keeps its own DataPtr deleter and never touches the
// counters. The one way a pre-install pointer can reach counted_delete is the raw interface (a
// raw_allocate before install, a raw_deallocate after); its Record tag does not match, and it
// is handed to the wrapped allocator's raw deleter uncounted. Tags are cleared on free.
//
// Counts are what was requested (storage nbytes), not what malloc rounds up to: the quantity
// torch.cuda.max_memory_allocated reports is also the requested size (rounded to the caching
// allocator's block), so this is the CPU analogue minus the rounding.
//
// Built by prism_core/memory/native.py (torch.utils.cpp_extension); only c10 and pybind11
// headers are included so that the build takes seconds.

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <mutex>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/alignment.h>
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>

namespace prism_cpu_alloc {
namespace {

// Above the default CPU allocator (registered at priority 0). SetAllocator only replaces an
// allocator of lower or equal priority, so once installed the wrapper stays in force unless
// something installs at a higher priority later, which installed() reports.
constexpr uint8_t kPriority = 100;

struct Record {
  void* context;  // the wrapped allocator's DataPtr context and deleter
  c10::DeleterFnPtr deleter;
  int64_t nbytes;
  uintptr_t tag;  // kTagSeed ^ address of the data: tells our records from foreign memory
};

constexpr size_t kHeader = std::max<size_t>(c10::gAlignment, 64);
static_assert(sizeof(Record) <= kHeader, "Record must fit in the header");
constexpr uintptr_t kTagSeed = static_cast<uintptr_t>(0x5072697a6d4c4c4dULL);  // "PrizmLLM"

std::atomic<int64_t> g_current{0};
std::atomic<int64_t> g_peak{0};
std::atomic<int64_t> g_limit{0};  // 0: no capacity
c10::DeleterFnPtr g_inner_raw_deleter = nullptr;  // for raw pointers from before install()

void raise_peak(int64_t value) {
  int64_t peak = g_peak.load(std::memory_order_relaxed);
  while (value > peak &&
         !g_peak.compare_exchange_weak(peak, value, std::memory_order_relaxed)) {
  }
}

Record* record_of(void* data) {
  return reinterpret_cast<Record*>(static_cast<char*>(data) - kHeader);
}

void counted_delete(void* data) {
  if (data == nullptr) {
    return;  // zero-byte allocation: nothing was allocated or counted
  }
  Record* record = record_of(data);
  if (record->tag != (kTagSeed ^ reinterpret_cast<uintptr_t>(data))) {
    // Not ours: a raw pointer the wrapped allocator handed out before install().
    if (g_inner_raw_deleter != nullptr) {
      g_inner_raw_deleter(data);
      return;
    }
    std::fprintf(stderr, "PrismLLM: counting CPU allocator asked to free unknown pointer %p\n", data);
    std::abort();
  }
  const int64_t nbytes = record->nbytes;
  void* context = record->context;
  c10::DeleterFnPtr deleter = record->deleter;
  record->tag = 0;
  if (deleter != nullptr) {
    deleter(context);
  }
  g_current.fetch_sub(nbytes, std::memory_order_relaxed);
}

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(size_t n) override {
    const c10::Device cpu(c10::DeviceType::CPU);
    if (n == 0) {
      return c10::DataPtr(nullptr, nullptr, &counted_delete, cpu);
    }
    TORCH_CHECK_WITH(
        OutOfMemoryError,
        n <= static_cast<size_t>(std::numeric_limits<int64_t>::max()) - kHeader,
        "PrismLLM: device out of memory: tried to allocate ", n, " bytes");
    const auto nbytes = static_cast<int64_t>(n);
    const int64_t now = reserve(nbytes);
    c10::DataPtr original;
    try {
      original = inner_->allocate(kHeader + n);
    } catch (...) {
      g_current.fetch_sub(nbytes, std::memory_order_relaxed);
      throw;
    }
    char* base = static_cast<char*>(original.get());
    void* data = base + kHeader;
    auto* record = reinterpret_cast<Record*>(base);
    record->deleter = original.get_deleter();
    record->context = original.release_context();
    record->nbytes = nbytes;
    record->tag = kTagSeed ^ reinterpret_cast<uintptr_t>(data);
    raise_peak(now);
    return c10::DataPtr(data, data, &counted_delete, cpu);
  }

  // allocate() always returns context == data with this deleter, so the raw interface works.
  c10::DeleterFnPtr raw_deleter() const override {
    return &counted_delete;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

 private:
  // Adds nbytes to the live count, or throws OutOfMemoryError if that would pass the capacity.
  // Returns the live count right after adding.
  static int64_t reserve(int64_t nbytes) {
    const int64_t limit = g_limit.load(std::memory_order_relaxed);
    if (limit <= 0) {
      return g_current.fetch_add(nbytes, std::memory_order_relaxed) + nbytes;
    }
    int64_t current = g_current.load(std::memory_order_relaxed);
    do {
      TORCH_CHECK_WITH(
          OutOfMemoryError,
          current + nbytes <= limit,
          "PrismLLM: device out of memory: tried to allocate ",
          nbytes,
          " bytes with ",
          current,
          " bytes live of capacity ",
          limit,
          " (job.device_memory_bytes)");
    } while (!g_current.compare_exchange_weak(
        current, current + nbytes, std::memory_order_relaxed));
    return current + nbytes;
  }

  c10::Allocator* inner_;
};

std::mutex g_install_mutex;
CountingAllocator* g_allocator = nullptr;  // leaked on purpose: storages keep pointers to it

void install() {
  std::lock_guard<std::mutex> lock(g_install_mutex);
  if (g_allocator == nullptr) {
    c10::Allocator* inner = c10::GetCPUAllocator();
    g_inner_raw_deleter = inner->raw_deleter();
    g_allocator = new CountingAllocator(inner);
  }
  c10::SetCPUAllocator(g_allocator, kPriority);
  TORCH_CHECK(
      c10::GetCPUAllocator() == g_allocator,
      "PrismLLM: could not install the counting CPU allocator: another CPU allocator is "
      "installed at a priority above ",
      static_cast<int>(kPriority));
}

bool installed() {
  return g_allocator != nullptr && c10::GetCPUAllocator() == g_allocator;
}

void set_limit(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "PrismLLM: capacity must be >= 0 bytes (0: none), got ", bytes);
  g_limit.store(bytes, std::memory_order_relaxed);
}

}  // namespace
}  // namespace prism_cpu_alloc

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace a = prism_cpu_alloc;
  m.doc() = "PrismLLM counting CPU allocator (live and peak bytes of tensor storage)";
  m.def("install", &a::install, "Wrap the CPU allocator in force and install the counter.");
  m.def("installed", &a::installed, "Whether the counting allocator is the CPU allocator now.");
  m.def("current_bytes", [] { return a::g_current.load(std::memory_order_relaxed); });
  m.def("peak_bytes", [] { return a::g_peak.load(std::memory_order_relaxed); });
  m.def(
      "reset_peak",
      [] { a::g_peak.store(a::g_current.load(std::memory_order_relaxed), std::memory_order_relaxed); },
      "Set the peak to the current live bytes.");
  m.def("set_limit", &a::set_limit, pybind11::arg("bytes"), "Capacity in bytes; 0 for none.");
  m.def("limit", [] { return a::g_limit.load(std::memory_order_relaxed); });
  m.attr("PRIORITY") = static_cast<int>(a::kPriority);
  m.attr("HEADER_BYTES") = static_cast<int64_t>(a::kHeader);  // uncounted bytes per allocation
}
