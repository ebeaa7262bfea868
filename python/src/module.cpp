// kvsift._kvsift: the Python bindings (nanobind). Arrays arrive through DLPack or the buffer protocol without a
// copy (numpy on the CPU, torch on the CPU or CUDA); every function checks dtypes, shapes, strides and devices
// and hands views to the C++ entry points, whose kvsift::Error messages reach Python as kvsift.Error. The Python
// layer (python/kvsift/__init__.py) fills defaults: workspaces, torch's current stream.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kvsift/core/error.hpp"
#include "kvsift/cpu/backend.hpp"
#include "kvsift/selectors/a2ats/a2ats.hpp"
#include "kvsift/selectors/a2ats/codebook.hpp"
#include "kvsift/selectors/centroid_kv/centroid_kv.hpp"
#include "kvsift/selectors/csattention/csattention.hpp"
#include "kvsift/selectors/ctkvr/ctkvr.hpp"
#include "kvsift/selectors/oracle_topk/oracle_topk.hpp"
#include "kvsift/selectors/quest/quest.hpp"
#include "kvsift/selectors/rerank.hpp"
#include "kvsift/selectors/specontext/specontext.hpp"
#include "kvsift/selectors/streaming_llm/streaming_llm.hpp"
#include "kvsift/step/decode_step.hpp"
#include "kvsift/selectors/specontext/step.hpp"
#ifndef KVSIFT_WITH_CUDA
#define KVSIFT_WITH_CUDA 0
#endif
#if KVSIFT_WITH_CUDA
#include "kvsift/cuda/backend.hpp"
#include "kvsift/step/split_step.hpp"
#endif

namespace nb = nanobind;
using namespace nb::literals;

namespace kvsift::python {
namespace {

using Array = nb::ndarray<>;
enum class Device { cpu, cuda };

constexpr nb::dlpack::dtype kHalf{std::uint8_t(nb::dlpack::dtype_code::Float), 16, 1};
constexpr nb::dlpack::dtype kBfloat16{std::uint8_t(nb::dlpack::dtype_code::Bfloat), 16, 1};

std::string dtype_name(nb::dlpack::dtype t) {
  if (t == kHalf) return "float16";
  if (t == kBfloat16) return "bfloat16";
  if (t == nb::dtype<float>()) return "float32";
  if (t == nb::dtype<double>()) return "float64";
  if (t == nb::dtype<std::int32_t>()) return "int32";
  if (t == nb::dtype<std::int64_t>()) return "int64";  // torch's default integers, e.g. a block table built as long
  if (t == nb::dtype<std::uint8_t>()) return "uint8";
  return fmt::format("(DLPack code {}, {} bits)", t.code, t.bits);
}

std::string shape_of(const Array& a) {
  std::string s = "[";
  for (std::size_t i = 0; i < a.ndim(); ++i) s += fmt::format("{}{}", i ? ", " : "", a.shape(i));
  return s + "]";
}

Device device_of(const char* where, const char* name, const Array& a) {
  if (a.device_type() == nb::device::cpu::value) return Device::cpu;
  if (a.device_type() == nb::device::cuda::value) {
#if KVSIFT_WITH_CUDA
    return Device::cuda;
#else
    detail::throw_error(where, fmt::format("{} is a CUDA array, but this kvsift build has no CUDA backend", name));
#endif
  }
  detail::throw_error(where, fmt::format("{} is on DLPack device type {}; kvsift takes CPU and CUDA arrays", name,
                                         a.device_type()));
}

/// The arguments of one call, checked against each other as they are read: one device for all of them.
class Args {
 public:
  explicit Args(const char* where) : where_(where) {}
  const char* where() const { return where_; }
  Device device() const { return device_; }

  /// `a` as a `ndim`-dimensional array of dtype `dtype`, last dimension contiguous, on the call's device.
  const Array& take(const char* name, const Array& a, std::size_t ndim, nb::dlpack::dtype dtype) {
    KVSIFT_CHECK(a.ndim() == ndim, where_, "{} has {} dimensions (shape {}); expected {}", name, a.ndim(), shape_of(a),
                 ndim);
    KVSIFT_CHECK(a.dtype() == dtype, where_, "{} has dtype {}; expected {}", name, dtype_name(a.dtype()),
                 dtype_name(dtype));
    KVSIFT_CHECK(a.shape(ndim - 1) <= 1 || a.stride(ndim - 1) == 1, where_,
                 "{} (shape {}) must be contiguous in its last dimension (stride {})", name, shape_of(a),
                 a.stride(ndim - 1));
    const Device d = device_of(where_, name, a);
    if (!first_) {
      first_ = name;
      device_ = d;
      device_id_ = a.device_id();
    }
    KVSIFT_CHECK(d == device_ && a.device_id() == device_id_, where_, "{} is on {}:{}, {} on {}:{}: one device per call",
                 name, d == Device::cpu ? "cpu" : "cuda", a.device_id(), first_,
                 device_ == Device::cpu ? "cpu" : "cuda", device_id_);
    return a;
  }
  /// A dense (C-order) array: the index and count arrays the kernels read with their own strides.
  const Array& take_packed(const char* name, const Array& a, std::size_t ndim, nb::dlpack::dtype dtype) {
    take(name, a, ndim, dtype);
    std::int64_t expected = 1;
    for (std::size_t i = ndim; i-- > 0;) {
      KVSIFT_CHECK(a.shape(i) <= 1 || a.stride(i) == expected, where_, "{} (shape {}) must be C-contiguous", name,
                   shape_of(a));
      expected *= std::int64_t(a.shape(i));
    }
    return a;
  }
  void check_dim(const char* name, const Array& a, std::size_t dim, std::int64_t expected, const char* what) const {
    KVSIFT_CHECK(std::int64_t(a.shape(dim)) == expected, where_, "{} has shape {}: dimension {} ({}) must be {}", name,
                 shape_of(a), dim, what, expected);
  }

 private:
  const char* where_;
  const char* first_ = nullptr;
  Device device_ = Device::cpu;
  std::int32_t device_id_ = 0;
};

std::int32_t dim32(const Args& args, const char* name, const Array& a, std::size_t dim) {
  KVSIFT_CHECK(a.shape(dim) <= std::size_t(std::numeric_limits<std::int32_t>::max()), args.where(),
               "{} has shape {}: dimension {} exceeds int32", name, shape_of(a), dim);
  return std::int32_t(a.shape(dim));
}

template <class T>
T* data_of(const Array& a) {
  return static_cast<T*>(a.data());
}

/// Calls f(T{}) with the storage type of `a` (float16 or bfloat16).
template <class F>
decltype(auto) with_storage_type(const Args& args, const char* name, const Array& a, F&& f) {
  if (a.dtype() == kHalf) return f(half{});
  if (a.dtype() == kBfloat16) return f(bfloat16{});
  detail::throw_error(args.where(), fmt::format("{} has dtype {}; kvsift stores float16 or bfloat16 (numpy has no "
                                                "bfloat16: use float16, or torch)",
                                                name, dtype_name(a.dtype())));
}

template <class T>
nb::dlpack::dtype storage_dtype() {
  return std::is_same_v<T, half> ? kHalf : kBfloat16;
}

/// [batch, heads, head_dim] rows of storage type T (q, a step's new k and v).
template <class T>
HeadsView<const T> heads_view(Args& args, const char* name, const Array& a) {
  args.take(name, a, 3, storage_dtype<T>());
  return {data_of<const T>(a), dim32(args, name, a, 0), dim32(args, name, a, 1), dim32(args, name, a, 2),
          a.stride(0), a.stride(1)};
}

/// The engine's cache as Python holds it: contiguous [batch, kv_heads, capacity, head_dim] K and V with
/// lengths [batch]; paged (pages of page_size tokens, NHD or HND) with FlashInfer's page_indptr, page_indices and
/// last_page_len; or vLLM's (core/views.hpp's block-table form): key_cache and value_cache, or one kv_cache
/// [num_blocks, 2, ...] with K and V interleaved per block, with block_tables [batch, max_blocks] and seq_lens
/// [batch]. Keeps its arrays alive; views are made per call.
class Cache {
 public:
  static Cache contiguous(Array k, Array v, Array lengths) {
    Cache c;
    c.form_ = Form::contiguous;
    c.k_ = std::move(k), c.v_ = std::move(v), c.lengths_ = std::move(lengths);
    return c;
  }
  static Cache paged(Array k_pages, Array v_pages, Array page_indptr, Array page_indices, Array last_page_len,
                     const std::string& layout) {
    Cache c = paged_form("KVCache.paged", Form::paged, layout);
    c.k_ = std::move(k_pages), c.v_ = std::move(v_pages);
    c.indptr_ = std::move(page_indptr), c.indices_ = std::move(page_indices), c.last_ = std::move(last_page_len);
    return c;
  }
  static Cache vllm(Array key_cache, Array value_cache, Array block_tables, Array seq_lens, const std::string& layout) {
    Cache c = paged_form("KVCache.vllm", Form::vllm, layout);
    c.k_ = std::move(key_cache), c.v_ = std::move(value_cache);
    c.indices_ = std::move(block_tables), c.lengths_ = std::move(seq_lens);
    return c;
  }
  /// kv_cache [num_blocks, 2, block_size, kv_heads, head_size] (NHD) or [num_blocks, 2, kv_heads, block_size,
  /// head_size] (HND), C-contiguous (PagedKVView::vllm_interleaved's strides), held in k_.
  static Cache vllm_interleaved(Array kv_cache, Array block_tables, Array seq_lens, const std::string& layout) {
    Cache c = paged_form("KVCache.vllm_interleaved", Form::vllm_interleaved, layout);
    c.k_ = std::move(kv_cache);
    c.indices_ = std::move(block_tables), c.lengths_ = std::move(seq_lens);
    return c;
  }
  bool is_paged() const { return form_ != Form::contiguous; }
  const Array& k() const { return k_; }
  std::int32_t batch() const {
    if (form_ == Form::contiguous) return std::int32_t(k_.shape(0));
    if (form_ == Form::paged) return std::int32_t(indptr_.shape(0) - 1);
    return indices_.ndim() == 0 ? 0 : std::int32_t(indices_.shape(0));  // view() refuses a 0-dimensional table
  }
  /// ("cpu" | "cuda" | "other", device id) of the keys: where a step's defaults (slots, stream) are made.
  std::pair<std::string, std::int32_t> device() const {
    const auto type = k_.device_type();
    return {type == nb::device::cpu::value ? "cpu" : type == nb::device::cuda::value ? "cuda" : "other",
            k_.device_id()};
  }

  /// The cache as kvsift's KVCache<T>, checked against `args` (device) and itself (shapes, strides, dtypes).
  template <class T>
  KVCache<T> view(Args& args) const {
    const auto i32 = nb::dtype<std::int32_t>();
    if (form_ == Form::vllm_interleaved) {
      // [num_blocks, 2, page...]: the page's dimensions are 2..4.
      args.take_packed("cache.kv_cache", k_, 5, storage_dtype<T>());
      args.check_dim("cache.kv_cache", k_, 1, 2, "K and V");
      const std::size_t token_dim = hnd_ ? 3 : 2, head_dim_index = hnd_ ? 2 : 3;
      const BlockTables tables = block_tables(args);
      return PagedKVView<T>::vllm_interleaved(
          data_of<T>(k_), tables.block_tables, tables.seq_lens, tables.batch, tables.max_blocks,
          dim32(args, "cache.kv_cache", k_, 0), dim32(args, "cache.kv_cache", k_, token_dim),
          dim32(args, "cache.kv_cache", k_, head_dim_index), dim32(args, "cache.kv_cache", k_, 4),
          hnd_ ? PageLayout::hnd : PageLayout::nhd);
    }
    const char* k_name = form_ == Form::vllm ? "cache.key_cache" : "cache.k";
    const char* v_name = form_ == Form::vllm ? "cache.value_cache" : "cache.v";
    args.take(k_name, k_, 4, storage_dtype<T>());
    args.take(v_name, v_, 4, storage_dtype<T>());
    for (std::size_t i = 0; i < 4; ++i) {
      KVSIFT_CHECK(k_.shape(i) == v_.shape(i) && k_.stride(i) == v_.stride(i), args.where(),
                   "{} (shape {}) and {} (shape {}) must have one shape and one set of strides", k_name, shape_of(k_),
                   v_name, shape_of(v_));
    }
    if (form_ == Form::contiguous) {
      args.take_packed("cache.lengths", lengths_, 1, i32);
      args.check_dim("cache.lengths", lengths_, 0, std::int64_t(k_.shape(0)), "batch, cache.k's dimension 0");
      return ContiguousKVView<T>{.k = data_of<T>(k_), .v = data_of<T>(v_), .seq_lens = data_of<const std::int32_t>(lengths_),
                                 .batch = dim32(args, "cache.k", k_, 0), .kv_heads = dim32(args, "cache.k", k_, 1),
                                 .capacity = dim32(args, "cache.k", k_, 2), .head_dim = dim32(args, "cache.k", k_, 3),
                                 .batch_stride = k_.stride(0), .head_stride = k_.stride(1), .token_stride = k_.stride(2)};
    }
    // NHD pages are [pages, page_size, kv_heads, head_dim], HND [pages, kv_heads, page_size, head_dim]; any strides
    // but head_dim's (a vLLM kv_cache[:, 0] and [:, 1] too).
    const std::size_t token_dim = hnd_ ? 2 : 1, head_dim_index = hnd_ ? 1 : 2;
    PagedKVView<T> view{.k_pages = data_of<T>(k_), .v_pages = data_of<T>(v_),
                        .kv_heads = dim32(args, k_name, k_, head_dim_index),
                        .head_dim = dim32(args, k_name, k_, 3),
                        .page_size = dim32(args, k_name, k_, token_dim),
                        .num_pages = dim32(args, k_name, k_, 0),
                        .page_stride = k_.stride(0),
                        .token_stride = k_.stride(token_dim),
                        .head_stride = k_.stride(head_dim_index)};
    if (form_ == Form::vllm) {
      const BlockTables tables = block_tables(args);
      view.page_indices = tables.block_tables, view.seq_lens = tables.seq_lens;
      view.batch = tables.batch, view.block_table_stride = tables.max_blocks;
      return view;
    }
    args.take_packed("cache.page_indptr", indptr_, 1, i32);
    args.take_packed("cache.page_indices", indices_, 1, i32);
    args.take_packed("cache.last_page_len", last_, 1, i32);
    KVSIFT_CHECK(indptr_.shape(0) >= 2, args.where(), "cache.page_indptr has shape {}: it holds batch + 1 >= 2 entries",
                 shape_of(indptr_));
    args.check_dim("cache.last_page_len", last_, 0, std::int64_t(indptr_.shape(0)) - 1, "batch");
    view.page_indptr = data_of<const std::int32_t>(indptr_);
    view.page_indices = data_of<const std::int32_t>(indices_);
    view.last_page_len = data_of<const std::int32_t>(last_);
    view.batch = std::int32_t(indptr_.shape(0) - 1);
    return view;
  }

 private:
  enum class Form { contiguous, paged, vllm, vllm_interleaved };

  /// A paged form's cache, its layout checked ('NHD' or 'HND', the page's order of tokens and kv heads).
  static Cache paged_form(const char* where, Form form, const std::string& layout) {
    KVSIFT_CHECK(layout == "NHD" || layout == "HND", where, "layout (= '{}') must be 'NHD' or 'HND'", layout);
    Cache c;
    c.form_ = form;
    c.hnd_ = layout == "HND";
    return c;
  }

  /// vLLM's block_tables [batch, max_blocks] and seq_lens [batch] (int32, packed), checked against each other;
  /// their contents (lengths, block ids, a row's room) are validate()'s, on the host.
  struct BlockTables {
    const std::int32_t* block_tables;
    const std::int32_t* seq_lens;
    std::int32_t batch, max_blocks;
  };
  BlockTables block_tables(Args& args) const {
    const auto i32 = nb::dtype<std::int32_t>();
    args.take_packed("cache.block_tables", indices_, 2, i32);
    args.take_packed("cache.seq_lens", lengths_, 1, i32);
    // max_blocks 0 would read as the CSR form (PagedKVView::block_table_stride == 0).
    KVSIFT_CHECK(indices_.shape(0) >= 1 && indices_.shape(1) >= 1, args.where(),
                 "cache.block_tables has shape {}: it holds batch >= 1 rows of max_blocks >= 1 entries",
                 shape_of(indices_));
    args.check_dim("cache.seq_lens", lengths_, 0, std::int64_t(indices_.shape(0)),
                   "batch, cache.block_tables' dimension 0");
    return {data_of<const std::int32_t>(indices_), data_of<const std::int32_t>(lengths_),
            dim32(args, "cache.block_tables", indices_, 0), dim32(args, "cache.block_tables", indices_, 1)};
  }

  Form form_ = Form::contiguous;
  bool hnd_ = false;
  // lengths_: contiguous lengths or vLLM's seq_lens; indices_: CSR page_indices or vLLM's block_tables.
  Array k_, v_, lengths_, indptr_, indices_, last_;
};

/// O [batch, heads, head_dim] (storage type T or float32) and LSE [batch, heads] (float32).
template <class TO>
StateView<TO> state_view(Args& args, const char* o_name, const Array& o, const char* lse_name, const Array& lse) {
  args.take(o_name, o, 3, std::is_same_v<TO, float> ? nb::dtype<float>() : storage_dtype<TO>());
  args.take(lse_name, lse, 2, nb::dtype<float>());
  args.check_dim(lse_name, lse, 0, std::int64_t(o.shape(0)), "batch");
  args.check_dim(lse_name, lse, 1, std::int64_t(o.shape(1)), "heads");
  return {data_of<TO>(o), data_of<float>(lse), dim32(args, o_name, o, 0), dim32(args, o_name, o, 1),
          dim32(args, o_name, o, 2), o.stride(0), o.stride(1), lse.stride(0)};
}

/// Calls f(TO{}) with the output type of o: the storage type T or float32.
template <class T, class F>
decltype(auto) with_output_type(const Args& args, const char* name, const Array& o, F&& f) {
  if (o.dtype() == nb::dtype<float>()) return f(float{});
  if (o.dtype() == storage_dtype<T>()) return f(T{});
  detail::throw_error(args.where(), fmt::format("{} has dtype {}; expected {} (the storage type) or float32", name,
                                                dtype_name(o.dtype()), dtype_name(storage_dtype<T>())));
}

SelectionView selection_view(Args& args, const Array& indices, const Array& counts,
                             const std::optional<Array>& log_weights) {
  const auto i32 = nb::dtype<std::int32_t>();
  args.take_packed("indices", indices, 3, i32);
  args.take_packed("counts", counts, 2, i32);
  args.check_dim("counts", counts, 0, std::int64_t(indices.shape(0)), "batch");
  args.check_dim("counts", counts, 1, std::int64_t(indices.shape(1)), "kv_heads");
  float* weights = nullptr;
  if (log_weights) {
    args.take_packed("log_weights", *log_weights, 3, nb::dtype<float>());
    for (std::size_t i = 0; i < 3; ++i) args.check_dim("log_weights", *log_weights, i, std::int64_t(indices.shape(i)), "indices' shape");
    weights = data_of<float>(*log_weights);
  }
  return {.indices = data_of<std::int32_t>(indices), .counts = data_of<std::int32_t>(counts), .log_weights = weights,
          .batch = dim32(args, "indices", indices, 0), .kv_heads = dim32(args, "indices", indices, 1),
          .capacity = dim32(args, "indices", indices, 2)};
}

std::span<std::byte> workspace_span(Args& args, const std::optional<Array>& workspace) {
  if (!workspace) return {};
  args.take_packed("workspace", *workspace, 1, nb::dtype<std::uint8_t>());
  return {static_cast<std::byte*>(workspace->data()), workspace->shape(0)};
}

AttentionOptions attention_options(std::pair<std::int32_t, std::int32_t> window, float sm_scale) {
  return {.sm_scale = sm_scale, .window = {.sink = window.first, .recent = window.second}};
}

/// Owns a cpu::ThreadPool for Python (kvsift.ThreadPool).
struct Pool {
  explicit Pool(int threads) : pool(std::make_unique<cpu::ThreadPool>(threads)) {}
  std::unique_ptr<cpu::ThreadPool> pool;
};

cpu::ThreadPool* pool_of(Pool* pool) { return pool ? pool->pool.get() : nullptr; }

#if KVSIFT_WITH_CUDA
cudaStream_t stream_of(std::uintptr_t stream) { return reinterpret_cast<cudaStream_t>(stream); }

/// CUDA dense decode's options: a paged cache needs a bound on the lengths (the host cannot read them); without
/// the caller's, the pool's token count bounds every sequence.
template <class KV>
cuda::DecodeOptions dense_options(const KV& view, const AttentionOptions& attention, std::int32_t max_seq_len) {
  cuda::DecodeOptions options{.attention = attention, .max_seq_len = max_seq_len};
  if constexpr (requires { view.num_pages; }) {
    if (max_seq_len == 0) {
      options.max_seq_len = std::int32_t(std::min<std::int64_t>(std::int64_t(view.num_pages) * view.page_size,
                                                               std::numeric_limits<std::int32_t>::max()));
    }
  }
  return options;
}
#endif

/// The backend a context runs on, and the context of one call: the pool's threads, or the CUDA stream.
template <class Context>
constexpr Device kDeviceOf = Context::memory == MemorySpace::host ? Device::cpu : Device::cuda;

template <class Context>
Context context_of(Pool* pool, [[maybe_unused]] std::uintptr_t stream) {
  if constexpr (kDeviceOf<Context> == Device::cpu) {
    return Context{pool_of(pool)};
  } else {
#if KVSIFT_WITH_CUDA
    return Context{stream_of(stream)};
#endif
  }
}

/// The arrays of a step's call are on the device it was built for.
void check_step_device(const Args& args, Device built_for) {
  KVSIFT_CHECK(args.device() == built_for, args.where(), "the arrays are on {}, the step was built for {}",
               args.device() == Device::cpu ? "cpu" : "cuda", built_for == Device::cpu ? "cpu" : "cuda");
}

/// A step's slots [batch] (int32, packed): each batch row's selector slot.
const std::int32_t* slots_of(Args& args, const Array& slots, std::int32_t batch) {
  args.take_packed("slots", slots, 1, nb::dtype<std::int32_t>());
  args.check_dim("slots", slots, 0, batch, "batch");
  return data_of<const std::int32_t>(slots);
}

/// A selection's first `batch` rows on the host (indices, counts): for evaluation, after the step's stream (on
/// CUDA the caller synchronizes it first).
template <class Context>
std::pair<std::vector<std::int32_t>, std::vector<std::int32_t>> selection_on_host(const SelectionView& s,
                                                                                  std::int32_t batch,
                                                                                  const Context& ctx) {
  std::vector<std::int32_t> indices(std::size_t(batch) * s.kv_heads * s.capacity), counts(std::size_t(batch) * s.kv_heads);
  copy_to_host(s.indices, indices.size(), indices.data(), ctx);
  copy_to_host(s.counts, counts.size(), counts.data(), ctx);
  return {std::move(indices), std::move(counts)};
}

// ---- functional API ------------------------------------------------------------------------------------------

std::size_t decode_workspace_bytes(const std::string& kind, Array q, const Cache& cache, std::int32_t capacity,
                                   std::pair<std::int32_t, std::int32_t> window, bool validate, std::int32_t max_seq_len,
                                   Pool* pool) {
  Args args("decode_workspace_bytes");
  KVSIFT_CHECK(kind == "sparse" || kind == "dense", args.where(), "kind (= '{}') must be 'sparse' or 'dense'", kind);
  return with_storage_type(args, "q", q, [&](auto t) -> std::size_t {
    using T = decltype(t);
    const HeadsView<const T> qv = heads_view<T>(args, "q", q);
    const KVCache<const T> kv = cache.view<T>(args);
    if (args.device() == Device::cpu) return cpu::decode_workspace_bytes(qv.batch, qv.heads, kv.kv_heads(), qv.head_dim, pool_of(pool));
#if KVSIFT_WITH_CUDA
    const cuda::DecodeOptions options{.attention = attention_options(window, 0.0f), .validate_indices = validate};
    if (kind == "sparse") {
      return cuda::sparse_decode_workspace_bytes(
          cuda::SparseDecodeShape{qv.batch, qv.heads, kv.kv_heads(), qv.head_dim, capacity}, options);
    }
    return kv.visit([&](const auto& view) {
      return cuda::dense_decode_workspace_bytes(qv, view, dense_options(view, options.attention, max_seq_len));
    });
#else
    return 0;
#endif
  });
}

void sparse_decode(Array q, const Cache& cache, Array indices, Array counts, Array o, Array lse,
                   std::optional<Array> workspace, std::optional<Array> log_weights,
                   std::pair<std::int32_t, std::int32_t> window, float sm_scale, bool validate,
                   Pool* pool, std::uintptr_t stream) {
  Args args("sparse_decode");
  with_storage_type(args, "q", q, [&](auto t) {
    using T = decltype(t);
    const HeadsView<const T> qv = heads_view<T>(args, "q", q);
    const KVCache<const T> kv = cache.view<T>(args);
    const SelectionView selection = selection_view(args, indices, counts, log_weights);
    with_output_type<T>(args, "o", o, [&](auto to) {
      using TO = decltype(to);
      const StateView<TO> out = state_view<TO>(args, "o", o, "lse", lse);
      const std::span<std::byte> ws = workspace_span(args, workspace);
      const AttentionOptions attention = attention_options(window, sm_scale);
      if (args.device() == Device::cpu) {
        nb::gil_scoped_release unlocked;
        cpu::sparse_decode(qv, kv, selection, out, attention, validate, false, ws, cpu::Context{pool_of(pool)});
        return;
      }
#if KVSIFT_WITH_CUDA
      cuda::sparse_decode(qv, kv, selection, out, attention, validate, false, ws, cuda::Context{stream_of(stream)});
#endif
    });
  });
}

void dense_decode(Array q, const Cache& cache, Array o, Array lse, std::optional<Array> workspace, float sm_scale,
                  std::int32_t max_seq_len, Pool* pool, std::uintptr_t stream) {
  Args args("dense_decode");
  with_storage_type(args, "q", q, [&](auto t) {
    using T = decltype(t);
    const HeadsView<const T> qv = heads_view<T>(args, "q", q);
    const KVCache<const T> kv = cache.view<T>(args);
    with_output_type<T>(args, "o", o, [&](auto to) {
      using TO = decltype(to);
      const StateView<TO> out = state_view<TO>(args, "o", o, "lse", lse);
      const std::span<std::byte> ws = workspace_span(args, workspace);
      const AttentionOptions attention{.sm_scale = sm_scale};
      kv.visit([&](const auto& view) {
        if (args.device() == Device::cpu) {
          nb::gil_scoped_release unlocked;
          cpu::dense_decode(qv, view, out, cpu::DecodeOptions{.attention = attention}, pool_of(pool), ws);
          return;
        }
#if KVSIFT_WITH_CUDA
        cuda::dense_decode(qv, view, out, ws, stream_of(stream), dense_options(view, attention, max_seq_len));
#endif
      });
    });
  });
}

void merge_states(std::vector<std::pair<Array, Array>> partials, Array o, Array lse, std::uintptr_t stream) {
  Args args("merge_states");
  KVSIFT_CHECK(!partials.empty(), args.where(), "partials is empty");
  const Array& first = partials.front().first;
  const auto run = [&](auto ti, auto to) {
    using TI = decltype(ti);
    using TO = decltype(to);
    std::vector<StateView<const TI>> views;
    for (std::size_t i = 0; i < partials.size(); ++i) {
      views.push_back(state_view<TI>(args, "partials[i][0]", partials[i].first, "partials[i][1]", partials[i].second).as_const());
    }
    const StateView<TO> out = state_view<TO>(args, "o", o, "lse", lse);
    if (args.device() == Device::cpu) return cpu::merge_states<TI, TO>(views, out);
#if KVSIFT_WITH_CUDA
    cuda::merge_states<TI, TO>(views, out, stream_of(stream));
#endif
  };
  // The instantiated pairs: fp32 partials into fp32 or a storage type; a storage type into itself.
  if (first.dtype() == nb::dtype<float>()) {
    if (o.dtype() == nb::dtype<float>()) return run(float{}, float{});
    if (o.dtype() == kHalf) return run(float{}, half{});
    if (o.dtype() == kBfloat16) return run(float{}, bfloat16{});
  } else if (first.dtype() == o.dtype() && (o.dtype() == kHalf || o.dtype() == kBfloat16)) {
    return o.dtype() == kHalf ? run(half{}, half{}) : run(bfloat16{}, bfloat16{});
  }
  detail::throw_error(args.where(), fmt::format("partials of dtype {} into o of dtype {}: kvsift merges float32 "
                                                "partials into float32, float16 or bfloat16, or a storage type into itself",
                                                dtype_name(first.dtype()), dtype_name(o.dtype())));
}

std::size_t topk_rows_workspace_bytes(std::int64_t score_rows, std::int32_t max_tokens, std::int32_t k,
                                      std::pair<std::int32_t, std::int32_t> window, std::int32_t heads_per_row,
                                      const std::string& device, Pool* pool) {
  const TopKRowsOptions options{.window = {window.first, window.second}, .heads_per_row = heads_per_row};
  if (device == "cpu") return cpu::topk_rows_workspace_bytes(score_rows, max_tokens, k, options, pool_of(pool));
#if KVSIFT_WITH_CUDA
  if (device == "cuda") return cuda::topk_rows_workspace_bytes(score_rows, max_tokens, k, options);
#endif
  detail::throw_error("topk_rows_workspace_bytes", fmt::format("device (= '{}') must be 'cpu'{}", device,
                                                               KVSIFT_WITH_CUDA ? " or 'cuda'" : " (no CUDA backend)"));
}

void topk_rows(Array scores, std::optional<Array> lengths, std::int32_t k, Array indices, Array counts,
               std::optional<Array> workspace, std::pair<std::int32_t, std::int32_t> window,
               std::int32_t heads_per_row, Pool* pool, std::uintptr_t stream) {
  Args args("topk_rows");
  args.take("scores", scores, 2, nb::dtype<float>());
  const MatrixView<const float> sv{data_of<const float>(scores), std::int64_t(scores.shape(0)),
                                   dim32(args, "scores", scores, 1), scores.stride(0)};
  const SelectionView out = selection_view(args, indices, counts, std::nullopt);
  const std::int32_t* lens = nullptr;
  if (lengths) {
    args.take_packed("lengths", *lengths, 1, nb::dtype<std::int32_t>());
    args.check_dim("lengths", *lengths, 0, out.batch, "batch, indices' dimension 0");
    lens = data_of<const std::int32_t>(*lengths);
  }
  const TopKRowsOptions options{.window = {window.first, window.second}, .heads_per_row = heads_per_row};
  const std::span<std::byte> ws = workspace_span(args, workspace);
  if (args.device() == Device::cpu) {
    nb::gil_scoped_release unlocked;
    return cpu::topk_rows(sv, lens, k, options, out, ws, pool_of(pool));
  }
#if KVSIFT_WITH_CUDA
  cuda::topk_rows(sv, lens, k, options, out, ws, stream_of(stream));
#endif
}

// ---- the decode step -----------------------------------------------------------------------------------------

struct StepConfig {
  std::string selector, dtype, device;
  nb::dict selector_config;
  std::int32_t q_heads, kv_heads, head_dim, max_batch, max_seq_len, max_slots;
  std::pair<std::int32_t, std::int32_t> window;
  float sm_scale;
  bool validate;
  bool page_selections = false;  ///< the local placement: DecodeStepConfig::page_selections
};

/// Every placement's DecodeStepConfig from the Python step's arguments.
DecodeStepConfig decode_step_config(const StepConfig& c) {
  return {.attention = attention_options(c.window, c.sm_scale), .max_batch = c.max_batch, .q_heads = c.q_heads,
          .kv_heads = c.kv_heads, .head_dim = c.head_dim, .max_seq_len = c.max_seq_len, .validate_indices = c.validate,
          .page_selections = c.page_selections};
}

/// f(T{}) for the step's dtype name, 'float16' or 'bfloat16' (else refused).
template <class F>
decltype(auto) with_step_dtype(const std::string& dtype, F&& f) {
  KVSIFT_CHECK(dtype == "float16" || dtype == "bfloat16", "DecodeStep", "dtype (= '{}') must be 'float16' or 'bfloat16'",
               dtype);
  return dtype == "float16" ? f(half{}) : f(bfloat16{});
}

/// A step's prepare inputs: the cache and slots, and the last W prefill queries [batch, q_heads, W, head_dim] when
/// given, on the step's device.
template <class T>
PrefillInputs<T> prefill_inputs(const Cache& cache, const Array& slots, const std::optional<Array>& queries,
                                Device step_device) {
  Args args("DecodeStep.prepare");
  const KVCache<const T> kv = cache.view<T>(args);
  check_step_device(args, step_device);
  PrefillInputs<T> in{.cache = kv, .slots = slots_of(args, slots, kv.batch())};
  if (queries) {
    const Array& a = args.take("queries", *queries, 4, storage_dtype<T>());
    in.queries = {data_of<const T>(a), dim32(args, "queries", a, 0), dim32(args, "queries", a, 1),
                  dim32(args, "queries", a, 2), dim32(args, "queries", a, 3), a.stride(0), a.stride(1), a.stride(2)};
  }
  return in;
}

/// A DecodeStep of any selector, storage type and backend behind one Python class.
class Step {
 public:
  virtual ~Step() = default;
  virtual void prepare(const Cache& cache, Array slots, std::optional<Array> queries, std::uintptr_t stream) = 0;
  virtual void run(Array q, const Cache& cache, Array slots, Array o, Array lse, std::optional<Array> k,
                   std::optional<Array> v, std::uintptr_t stream) = 0;
  virtual void release(const std::vector<std::int32_t>& slots) = 0;
  virtual std::pair<std::vector<std::int32_t>, std::vector<std::int32_t>> selection(std::int32_t batch) = 0;
  virtual std::vector<std::int32_t> union_sizes(std::int32_t batch) = 0;
  virtual std::vector<std::int32_t> store_sizes() = 0;
  virtual std::int32_t capacity() const = 0;
  virtual std::int32_t selection_page_size() const = 0;
  virtual std::size_t workspace_bytes() const = 0;
  virtual std::string name() const = 0;
  virtual bool prepared(std::int32_t slot) const = 0;
};

template <class S>
class StepOf final : public Step {
 public:
  using T = typename S::value_type;
  using Context = typename S::context_type;
  static constexpr Device kDevice = kDeviceOf<Context>;

  StepOf(S selector, const StepConfig& config, Pool* pool)
      : pool_(pool), step_(std::move(selector), decode_step_config(config), context(0)), workspace_(step_.workspace_bytes()) {}

  void prepare(const Cache& cache, Array slots, std::optional<Array> queries, std::uintptr_t stream) override {
    step_.prepare(prefill_inputs<T>(cache, slots, queries, kDevice), context(stream));
  }

  void run(Array q, const Cache& cache, Array slots, Array o, Array lse, std::optional<Array> k,
           std::optional<Array> v, std::uintptr_t stream) override {
    Args args("DecodeStep.run");
    StepInputs<T> in{.q = heads_view<T>(args, "q", q), .cache = cache.view<T>(args)};
    check_step_device(args, kDevice);
    in.slots = slots_of(args, slots, in.q.batch);
    KVSIFT_CHECK(k.has_value() == v.has_value(), args.where(), "k and v must be given together");
    if (k) {
      const HeadsView<const T> kh = heads_view<T>(args, "k", *k);
      const HeadsView<const T> vh = heads_view<T>(args, "v", *v);
      in.k = kh, in.v = vh;
    }
    with_output_type<T>(args, "o", o, [&](auto to) {
      using TO = decltype(to);
      const StateView<TO> out = state_view<TO>(args, "o", o, "lse", lse);
      if constexpr (kDevice == Device::cpu) {
        nb::gil_scoped_release unlocked;
        step_.run(in, out, workspace(), context(stream));
      } else {
        step_.run(in, out, workspace(), context(stream));
      }
    });
  }

  void release(const std::vector<std::int32_t>& slots) override { step_.release(slots); }

  std::pair<std::vector<std::int32_t>, std::vector<std::int32_t>> selection(std::int32_t batch) override {
    KVSIFT_CHECK(batch >= 1 && batch <= step_.config().max_batch, "DecodeStep.selection",
                 "batch (= {}) is outside [1, max_batch = {}]", batch, step_.config().max_batch);
    return selection_on_host(step_.selection(workspace(), batch), batch, context(0));
  }
  std::vector<std::int32_t> union_sizes(std::int32_t batch) override {
    constexpr const char* where = "DecodeStep.union_sizes";
    if constexpr (requires { step_.selector().last_union_sizes(); }) {
      KVSIFT_CHECK(batch >= 1 && batch <= step_.config().max_batch, where, "batch (= {}) is outside [1, max_batch = {}]",
                   batch, step_.config().max_batch);
      std::vector<std::int32_t> sizes(std::size_t(batch) * step_.config().kv_heads);
      copy_to_host(step_.selector().last_union_sizes(), sizes.size(), sizes.data(), context(0));
      return sizes;
    } else {
      detail::throw_error(where, fmt::format("the selector ({}) reports no union sizes (ctkvr does)",
                                             step_.selector().name()));
    }
  }
  std::vector<std::int32_t> store_sizes() override {
    if constexpr (requires { step_.selector().store(); }) {
      const auto store = step_.selector().store();
      std::vector<std::int32_t> sizes(std::size_t(store.slots) * std::size_t(store.kv_heads));
      copy_to_host(store.count, sizes.size(), sizes.data(), context(0));
      return sizes;
    } else {
      detail::throw_error("DecodeStep.store_sizes", fmt::format("the selector ({}) keeps no store of its own "
                                                                "(centroidkv does)",
                                                                step_.selector().name()));
    }
  }
  std::int32_t capacity() const override { return step_.selector().capacity(); }
  std::int32_t selection_page_size() const override { return step_.selection_page_size(); }
  std::size_t workspace_bytes() const override { return step_.workspace_bytes(); }
  std::string name() const override { return std::string(step_.selector().name()); }
  bool prepared(std::int32_t slot) const override { return selector_slot_prepared(step_.selector(), slot); }

 private:
  Context context(std::uintptr_t stream) const { return context_of<Context>(pool_, stream); }

  std::span<std::byte> workspace() { return {workspace_.data(), workspace_.size()}; }

  Pool* pool_;  // kept alive by the Python object (nb::keep_alive)
  DecodeStep<S> step_;
  typename Context::template array<std::byte> workspace_;
};

#if KVSIFT_WITH_CUDA
/// A DecodeStep split over the GPU and the CPU (step/split_step.hpp: placement 'middle_on_cpu' or 'middle_on_gpu')
/// of any selector, storage type and selector backend behind one Python class. The step's arrays on the selector's
/// side (q, cache, slots) are on its device; a CPU selector's run also takes the device's q and cache (the window),
/// a GPU selector's the pinned host cache (the middle). The object owns its workspace (a device and a pinned host
/// block), allocated once.
class SplitStep {
 public:
  virtual ~SplitStep() = default;
  virtual void prepare(const Cache& cache, Array slots, std::optional<Array> queries, std::uintptr_t stream) = 0;
  virtual void run(Array q, const Cache& cache, Array slots, Array o, Array lse, std::optional<Array> q_device,
                   std::optional<Cache> device_cache, std::optional<Cache> host_cache, std::uintptr_t stream) = 0;
  virtual void release(const std::vector<std::int32_t>& slots) = 0;
  virtual std::pair<std::vector<std::int32_t>, std::vector<std::int32_t>> selection() = 0;
  virtual nb::dict stats() const = 0;
  virtual std::int32_t capacity() const = 0;
  virtual std::pair<std::size_t, std::size_t> workspace_bytes() const = 0;
  virtual std::string name() const = 0;
  virtual bool prepared(std::int32_t slot) const = 0;
};

template <class S, class Placement>
class SplitStepOf final : public SplitStep {
 public:
  using T = typename S::value_type;
  using Context = typename S::context_type;
  static constexpr Device kDevice = kDeviceOf<Context>;

  SplitStepOf(S selector, const StepConfig& config, Pool* pool)
      : pool_(pool),
        step_(std::move(selector), decode_step_config(config), SplitContext{.cpu = {pool_of(pool)}}),
        device_(step_.workspace_bytes().device),
        host_(step_.workspace_bytes().host) {}

  void prepare(const Cache& cache, Array slots, std::optional<Array> queries, std::uintptr_t stream) override {
    step_.prepare(prefill_inputs<T>(cache, slots, queries, kDevice), context_of<Context>(pool_, stream));
  }

  void run(Array q, const Cache& cache, Array slots, Array o, Array lse, std::optional<Array> q_device,
           std::optional<Cache> device_cache, std::optional<Cache> host_cache, std::uintptr_t stream) override {
    constexpr const char* where = "DecodeStep.run";
    Args args(where), device_args(where), host_args(where);
    StepInputs<T> in{.q = heads_view<T>(args, "q", q), .cache = cache.view<T>(args)};
    check_step_device(args, kDevice);
    in.slots = slots_of(args, slots, in.q.batch);
    if constexpr (kDevice == Device::cpu) {
      KVSIFT_CHECK(q_device && device_cache && !host_cache, where,
                   "a CPU selector's split step takes q_device and device_cache (the window's, on the GPU), not "
                   "host_cache (its cache is `cache`)");
      in.q_device = heads_view<T>(device_args, "q_device", *q_device);
      in.device_cache = device_cache->view<T>(device_args);
      check_step_device(device_args, Device::cuda);
    } else {
      KVSIFT_CHECK(host_cache && !q_device && !device_cache, where,
                   "a GPU selector's split step takes host_cache (the middle's, pinned), not q_device or device_cache "
                   "(its query and cache are `q` and `cache`)");
      in.host_cache = host_cache->view<T>(host_args);
      check_step_device(host_args, Device::cpu);
    }
    Args out_args(where);
    with_output_type<T>(out_args, "o", o, [&](auto to) {
      using TO = decltype(to);
      const StateView<TO> out = state_view<TO>(out_args, "o", o, "lse", lse);
      check_step_device(out_args, Device::cuda);
      if constexpr (std::is_same_v<Placement, placement::MiddleOnCpu> && !std::is_same_v<TO, T>) {
        detail::throw_error(where, "o must have the storage type with placement 'middle_on_cpu' (its merge rounds once)");
      } else {
        nb::gil_scoped_release unlocked;
        step_.run(in, out, workspace(), SplitContext{.gpu = {stream_of(stream)}, .cpu = {pool_of(pool_)}});
      }
    });
  }

  void release(const std::vector<std::int32_t>& slots) override { step_.release(slots); }
  std::pair<std::vector<std::int32_t>, std::vector<std::int32_t>> selection() override {
    const SelectionView s = step_.selection(workspace());
    std::vector<std::int32_t> indices(s.indices, s.indices + std::size_t(s.batch) * s.kv_heads * s.capacity);
    std::vector<std::int32_t> counts(s.counts, s.counts + std::size_t(s.batch) * s.kv_heads);
    return {std::move(indices), std::move(counts)};
  }
  nb::dict stats() const override {
    const StepStats& s = step_.last_step_stats();
    nb::dict d;
    d["select_seconds"] = s.select_seconds;
    d["cpu_attention_seconds"] = s.cpu_attention_seconds;
    d["call_seconds"] = s.call_seconds;
    d["to_host_bytes"] = s.to_host_bytes;
    d["to_device_bytes"] = s.to_device_bytes;
    d["gathered_kv_bytes"] = s.gathered_kv_bytes;
    return d;
  }
  std::int32_t capacity() const override { return step_.selector().capacity(); }
  std::pair<std::size_t, std::size_t> workspace_bytes() const override {
    return {step_.workspace_bytes().device, step_.workspace_bytes().host};
  }
  std::string name() const override { return std::string(step_.selector().name()); }
  bool prepared(std::int32_t slot) const override { return selector_slot_prepared(step_.selector(), slot); }

 private:
  SplitWorkspace workspace() { return {{device_.data(), device_.size()}, {host_.data(), host_.size()}}; }

  Pool* pool_;  // kept alive by the Python object (nb::keep_alive)
  DecodeStep<S, Placement> step_;
  cuda::Array<std::byte> device_;
  cuda::PinnedArray<std::byte> host_;
};
#endif

/// selector_config[key], popped: a Python int (True and False count as 1 and 0) in int32's range. Anything else
/// is refused naming the key and the value (a float, a string, 2**40), not converted.
std::int32_t config_int(const char* where, nb::dict& config, const char* key, std::optional<std::int32_t> fallback) {
  if (!config.contains(key)) {
    KVSIFT_CHECK(fallback.has_value(), where, "selector_config lacks '{}'", key);
    return *fallback;
  }
  const nb::object value = config.attr("pop")(key);
  std::int64_t v = 0;
  const bool integer = nb::isinstance<nb::int_>(value) && nb::try_cast<std::int64_t>(value, v);
  KVSIFT_CHECK(integer && v >= std::numeric_limits<std::int32_t>::min() && v <= std::numeric_limits<std::int32_t>::max(),
               where, "selector_config['{}'] (= {}) must be an integer in [-2**31, 2**31 - 1]", key,
               nb::repr(value).c_str());
  return std::int32_t(v);
}

/// selector_config[key], popped: a finite Python float or int; anything else is refused naming the key and value.
double config_float(const char* where, nb::dict& config, const char* key, double fallback) {
  if (!config.contains(key)) return fallback;
  const nb::object value = config.attr("pop")(key);
  double v = 0;
  const bool number = (nb::isinstance<nb::float_>(value) || nb::isinstance<nb::int_>(value)) &&
                      nb::try_cast<double>(value, v);
  KVSIFT_CHECK(number && std::isfinite(v), where, "selector_config['{}'] (= {}) must be a finite number", key,
               nb::repr(value).c_str());
  return v;
}

/// The selector c names, on Context, handed to wrap(selector) (a step of some placement), whose result it returns.
template <class T, class Context, class Wrap>
auto make_selector_step(const StepConfig& c, Wrap&& wrap) {
  constexpr const char* where = "DecodeStep";
  const SelectorLimits limits{.max_slots = c.max_slots, .max_tokens = c.max_seq_len, .q_heads = c.q_heads,
                              .kv_heads = c.kv_heads, .head_dim = c.head_dim};
  // A copy: each key read is removed, and what remains is refused by name.
  nb::dict config = nb::cast<nb::dict>(c.selector_config.attr("copy")());
  decltype(wrap(StreamingLLM<T, Context>(limits))) step;
  // selector_config['rerank'] (Quest, CSAttention, A²ATS): the rerank stage after the selector (selectors/rerank.hpp),
  // keeping that many of its selection by the exact scores; the selector's own budget is its proposals'. With
  // 'rerank_mass' (RerankConfig::mass, top-p; 0: off) and 'rerank_floor' (::floor) a row keeps fewer; their bounds
  // are checked by Reranked. Without 'rerank' they have no stage to configure and are refused.
  const auto maybe_reranked = [&](auto selector) {
    if (!config.contains("rerank")) {
      for (const char* key : {"rerank_mass", "rerank_floor"}) {
        KVSIFT_CHECK(!config.contains(key), where,
                     "selector_config['{}'] needs selector_config['rerank'] (the rerank stage it adapts)", key);
      }
      return wrap(std::move(selector));
    }
    RerankConfig rerank{.budget = config_int(where, config, "rerank", std::nullopt)};
    rerank.mass = config_float(where, config, "rerank_mass", rerank.mass);
    rerank.floor = config_int(where, config, "rerank_floor", rerank.floor);
    return wrap(Reranked(std::move(selector), rerank));
  };
  if (c.selector == "oracle_topk") {
    const OracleTopKConfig sc{.budget = config_int(where, config, "budget", std::nullopt)};
    step = wrap(OracleTopK<T, Context>(limits, sc));
  } else if (c.selector == "quest") {
    const std::int32_t budget = config_int(where, config, "budget", std::nullopt);
    const QuestConfig sc{.budget = budget, .page_size = config_int(where, config, "page_size", 16)};
    step = maybe_reranked(Quest<T, Context>(limits, sc));
  } else if (c.selector == "ctkvr") {
    CtkvrConfig sc{};
    sc.budget = config_int(where, config, "budget", sc.budget);
    sc.list_size = config_int(where, config, "list_size", sc.list_size);
    sc.centroids = config_int(where, config, "centroids", sc.centroids);
    sc.max_centroids = config_int(where, config, "max_centroids", sc.max_centroids);
    sc.recalled_centroids = config_int(where, config, "recalled_centroids", sc.recalled_centroids);
    sc.dynamic_update = config_int(where, config, "dynamic_update", sc.dynamic_update ? 1 : 0) != 0;
    sc.prepare_chunk = config_int(where, config, "prepare_chunk", sc.prepare_chunk);
    sc.budget_fraction = config_float(where, config, "budget_fraction", sc.budget_fraction);
    sc.pin_prefill_centroids =
        config_int(where, config, "pin_prefill_centroids", sc.pin_prefill_centroids ? 1 : 0) != 0;
    sc.max_unindexed = config_int(where, config, "max_unindexed", sc.max_unindexed);
    step = wrap(Ctkvr<T, Context>(limits, sc));
  } else if (c.selector == "csattention") {
    CsattentionConfig sc{};
    sc.budget = config_int(where, config, "budget", sc.budget);
    sc.keep_fraction = config_float(where, config, "keep_fraction", sc.keep_fraction);
    sc.list_fraction = config_float(where, config, "list_fraction", sc.list_fraction);
    sc.subspaces = config_int(where, config, "subspaces", sc.subspaces);
    sc.centroids = config_int(where, config, "centroids", sc.centroids);
    sc.probes = config_int(where, config, "probes", sc.probes);
    sc.search_period = config_int(where, config, "search_period", sc.search_period);
    if (config_int(where, config, "per_query_head", 0) != 0) sc.tables = CsattentionTables::per_query_head;
    sc.weight_by_norm = config_int(where, config, "weight_by_norm", sc.weight_by_norm ? 1 : 0) != 0;
    sc.from_floor = config_int(where, config, "from_floor", sc.from_floor ? 1 : 0) != 0;
    step = maybe_reranked(Csattention<T, Context>(limits, sc));
  } else if (c.selector == "a2ats") {
    // The codebook file (kvsift_a2ats_codebook) and the layer this step decodes; the file must match the step's
    // shapes (its RoPE is the one the selector rotates with).
    KVSIFT_CHECK(config.contains("codebooks"), where, "selector_config lacks 'codebooks' (a codebook file's path)");
    const nb::object path_value = config.attr("pop")("codebooks");
    KVSIFT_CHECK(nb::isinstance<nb::str>(path_value), where, "selector_config['codebooks'] (= {}) must be a file path (str)",
                 nb::repr(path_value).c_str());
    const std::string path = nb::cast<std::string>(path_value);
    const std::int32_t layer = config_int(where, config, "layer", std::nullopt);
    A2atsCodebookExpectation expected;
    expected.q_heads = c.q_heads;
    expected.kv_heads = c.kv_heads;
    expected.head_dim = c.head_dim;
    if (config.contains("rope_theta")) {  // the model's RoPE, compared with the file's (no scaling here)
      RopeConfig rope{.theta = config_float(where, config, "rope_theta", 0.0)};
      rope.rotary_dim = config_int(where, config, "rope_dim", 0);
      rope.layout = config_int(where, config, "rope_interleaved", 0) != 0 ? RopeLayout::interleaved : RopeLayout::neox;
      expected.rope = rope;
    }
    const A2atsCodebooks codebooks = load_a2ats_codebooks(path, expected);
    A2atsConfig sc{};
    sc.budget_fraction = config_float(where, config, "budget_fraction", sc.budget_fraction);
    sc.max_budget = config_int(where, config, "max_budget", sc.max_budget);
    if (config_int(where, config, "group_max", 0) != 0) sc.group_rule = A2atsGroupRule::group_max;
    step = maybe_reranked(A2ats<T, Context>(limits, sc, codebooks.layer(layer), Context{}));
  } else if (c.selector == "centroidkv") {
    CentroidKVConfig sc{};
    sc.budget_ratio = float(config_float(where, config, "budget_ratio", sc.budget_ratio));
    sc.sinks = config_int(where, config, "sinks", sc.sinks);
    sc.recent = config_int(where, config, "recent", sc.recent);
    sc.chunk = config_int(where, config, "chunk", sc.chunk);
    sc.r_init = float(config_float(where, config, "r_init", sc.r_init));
    sc.r_step = float(config_float(where, config, "r_step", sc.r_step));
    sc.r_min = float(config_float(where, config, "r_min", sc.r_min));
    sc.interval = config_int(where, config, "interval", sc.interval);
    sc.max_rounds = config_int(where, config, "max_rounds", sc.max_rounds);
    step = wrap(CentroidKV<T, Context>(limits, sc, Context{}));
  } else if (c.selector == "streaming_llm") {
    step = wrap(StreamingLLM<T, Context>(limits));
  } else {
    detail::throw_error(where, fmt::format("selector (= '{}') must be one of 'oracle_topk', 'quest', 'streaming_llm', "
                                           "'ctkvr', 'csattention', 'a2ats', 'centroidkv'",
                                           c.selector));
  }
  KVSIFT_CHECK(nb::len(config) == 0, where, "selector_config has keys {} that {} does not take",
               nb::cast<std::string>(nb::str(config.attr("keys")())), c.selector);
  return step;
}

template <class T, class Context>
std::unique_ptr<Step> make_step_of(const StepConfig& c, Pool* pool) {
  return make_selector_step<T, Context>(c, [&](auto selector) -> std::unique_ptr<Step> {
    return std::make_unique<StepOf<decltype(selector)>>(std::move(selector), c, pool);
  });
}

#if KVSIFT_WITH_CUDA
/// A split step (placement 'middle_on_cpu' or 'middle_on_gpu') of the selector c names, on `device`'s backend.
std::unique_ptr<SplitStep> make_split_step(const std::string& selector, nb::dict selector_config,
                                           const std::string& dtype, const std::string& device,
                                           const std::string& placement_name, std::int32_t q_heads, std::int32_t kv_heads,
                                           std::int32_t head_dim, std::int32_t max_batch, std::int32_t max_seq_len,
                                           std::int32_t max_slots, std::pair<std::int32_t, std::int32_t> window,
                                           float sm_scale, bool validate, Pool* pool) {
  const StepConfig c{selector, dtype, device, selector_config, q_heads, kv_heads, head_dim, max_batch, max_seq_len,
                     max_slots, window, sm_scale, validate};
  const auto with_context = [&](auto t, auto context, auto place) -> std::unique_ptr<SplitStep> {
    using T = decltype(t);
    using Context = decltype(context);
    using Placement = decltype(place);
    return make_selector_step<T, Context>(c, [&](auto s) -> std::unique_ptr<SplitStep> {
      if constexpr (placement::Fits<Placement, Context>) {
        return std::make_unique<SplitStepOf<decltype(s), Placement>>(std::move(s), c, pool);
      } else {
        return nullptr;  // refused above
      }
    });
  };
  const auto with_placement = [&](auto t) {
    constexpr const char* where = "DecodeStep";
    KVSIFT_CHECK(device == "cpu" || device == "cuda", where, "device (= '{}') must be 'cpu' or 'cuda'", device);
    KVSIFT_CHECK(placement_name == "middle_on_cpu" || (placement_name == "middle_on_gpu" && device == "cpu"), where,
                 "placement (= '{}') with device '{}' must be 'local', 'middle_on_cpu', or 'middle_on_gpu' with a CPU "
                 "selector (a GPU selector's middle on the GPU is 'local')",
                 placement_name, device);
    if (device == "cuda") return with_context(t, cuda::Context{}, placement::MiddleOnCpu{});
    if (placement_name == "middle_on_cpu") return with_context(t, cpu::Context{}, placement::MiddleOnCpu{});
    return with_context(t, cpu::Context{}, placement::MiddleOnGpu{});
  };
  return with_step_dtype(dtype, with_placement);
}
#endif

std::unique_ptr<Step> make_step(const std::string& selector, nb::dict selector_config, const std::string& dtype,
                                const std::string& device, std::int32_t q_heads, std::int32_t kv_heads,
                                std::int32_t head_dim, std::int32_t max_batch, std::int32_t max_seq_len,
                                std::int32_t max_slots, std::pair<std::int32_t, std::int32_t> window, float sm_scale,
                                bool validate, Pool* pool, bool page_selections) {
  const StepConfig c{selector, dtype,     device,  selector_config, q_heads,  kv_heads,       head_dim,
                     max_batch, max_seq_len, max_slots, window,        sm_scale, validate, page_selections};
  constexpr const char* where = "DecodeStep";
  const auto with_context = [&](auto t) -> std::unique_ptr<Step> {
    using T = decltype(t);
    if (device == "cpu") return make_step_of<T, cpu::Context>(c, pool);
#if KVSIFT_WITH_CUDA
    if (device == "cuda") return make_step_of<T, cuda::Context>(c, nullptr);
#endif
    detail::throw_error(where, fmt::format("device (= '{}') must be 'cpu'{}", device,
                                           KVSIFT_WITH_CUDA ? " or 'cuda'" : " (this build has no CUDA backend)"));
  };
  return with_step_dtype(dtype, with_context);
}

// ---- SpeContext's model-level step ---------------------------------------------------------------------------

struct SpeStepConfig {
  std::string dtype, device, mode;
  std::int32_t layers, q_heads, kv_heads, head_dim, max_batch, max_seq_len, max_slots, budget;
  std::pair<std::int32_t, std::int32_t> window;
  float sm_scale, head_sm_scale;
  double rope_theta;
  std::int32_t rope_dim;
  bool rope_interleaved;
  std::optional<double> yarn_factor;
  std::int32_t yarn_original_max_position_embeddings;
  bool validate;
  RerankConfig rerank;  ///< SpeContextStepConfig::rerank (budget 0: off)
};

/// A SpeContextStep (one per model: one selection per step from the retrieval head, attended by every layer) of
/// any storage type and backend behind one Python class. Its head cache is the selector's own (owned).
class SpeStep {
 public:
  virtual ~SpeStep() = default;
  virtual void prepare(const Cache& cache, Array slots, Array k_pre, std::uintptr_t stream) = 0;
  virtual void select(Array q, Array k, const Cache& cache, Array slots, std::uintptr_t stream) = 0;
  virtual void attend(std::int32_t layer, Array q, const Cache& cache, Array o, Array lse, std::optional<Array> k,
                      std::optional<Array> v, std::optional<Array> indices, std::optional<Array> counts,
                      bool validate_selection, std::uintptr_t stream) = 0;
  virtual void release(const std::vector<std::int32_t>& slots) = 0;
  virtual std::pair<std::vector<std::int32_t>, std::vector<std::int32_t>> selection(std::int32_t batch) = 0;
  virtual std::int32_t capacity() const = 0;
  virtual std::pair<std::int32_t, std::int32_t> window() const = 0;
  virtual std::size_t workspace_bytes() const = 0;
  virtual bool prepared(std::int32_t slot) const = 0;
};

template <class T, class Context>
class SpeStepOf final : public SpeStep {
 public:
  static constexpr Device kDevice = kDeviceOf<Context>;

  SpeStepOf(const SpeStepConfig& c, Pool* pool)
      : pool_(pool), step_(SpeContext<T, Context>(limits(c), selector_config(c), context(0)), step_config(c), context(0)),
        workspace_(step_.workspace_bytes()) {}

  void prepare(const Cache& cache, Array slots, Array k_pre, std::uintptr_t stream) override {
    Args args("SpeContextStep.prepare");
    PrefillInputs<T> in{.cache = cache.view<T>(args)};
    check_step_device(args, kDevice);
    in.slots = slots_of(args, slots, in.cache.batch());
    args.take("k_pre", k_pre, 4, storage_dtype<T>());  // [batch, kv_heads, n, head_dim]
    in.k_pre_rope = {data_of<const T>(k_pre), dim32(args, "k_pre", k_pre, 0), dim32(args, "k_pre", k_pre, 1),
                     dim32(args, "k_pre", k_pre, 2), dim32(args, "k_pre", k_pre, 3), k_pre.stride(0), k_pre.stride(1),
                     k_pre.stride(2)};
    step_.prepare(in, context(stream));
  }

  void select(Array q, Array k, const Cache& cache, Array slots, std::uintptr_t stream) override {
    Args args("SpeContextStep.select");
    SpeContextHeadInputs<T> in{.q = heads_view<T>(args, "q", q), .k = heads_view<T>(args, "k", k),
                               .cache = cache.view<T>(args)};
    check_step_device(args, kDevice);
    in.slots = slots_of(args, slots, in.q.batch);
    call_unlocked([&] { step_.select(in, workspace(), context(stream)); });
  }

  void attend(std::int32_t layer, Array q, const Cache& cache, Array o, Array lse, std::optional<Array> k,
              std::optional<Array> v, std::optional<Array> indices, std::optional<Array> counts,
              bool validate_selection, std::uintptr_t stream) override {
    Args args("SpeContextStep.attend");
    SpeContextLayerInputs<T> in{.q = heads_view<T>(args, "q", q), .cache = cache.view<T>(args), .layer = layer};
    check_step_device(args, kDevice);
    KVSIFT_CHECK(k.has_value() == v.has_value(), args.where(), "k and v must be given together");
    if (k) {
      const HeadsView<const T> kh = heads_view<T>(args, "k", *k);
      const HeadsView<const T> vh = heads_view<T>(args, "v", *v);
      in.k = kh, in.v = vh;
    }
    KVSIFT_CHECK(indices.has_value() == counts.has_value(), args.where(), "indices and counts must be given together");
    // A given selection (e.g. one kept from an earlier select) is attended with the step's window and its rerank,
    // as its own.
    std::optional<SelectionView> given;
    if (indices) given = selection_view(args, *indices, *counts, std::nullopt);
    with_output_type<T>(args, "o", o, [&](auto to) {
      using TO = decltype(to);
      const StateView<TO> out = state_view<TO>(args, "o", o, "lse", lse);
      call_unlocked([&] {
        if (given) {
          step_.attend_candidates(in, *given, out, workspace(), context(stream), validate_selection);
        } else {
          step_.attend(in, out, workspace(), context(stream));
        }
      });
    });
  }

  void release(const std::vector<std::int32_t>& slots) override { step_.release(slots); }
  std::pair<std::vector<std::int32_t>, std::vector<std::int32_t>> selection(std::int32_t batch) override {
    return selection_on_host(step_.selection(workspace(), batch), batch, context(0));
  }
  std::int32_t capacity() const override { return step_.selector().capacity(); }
  std::pair<std::int32_t, std::int32_t> window() const override {
    const AttentionWindow w = step_.attention().window;
    return {w.sink, w.recent};
  }
  std::size_t workspace_bytes() const override { return step_.workspace_bytes(); }
  bool prepared(std::int32_t slot) const override { return step_.selector().prepared(slot); }

 private:
  static SelectorLimits limits(const SpeStepConfig& c) {
    return {.max_slots = c.max_slots, .max_tokens = c.max_seq_len, .q_heads = c.q_heads, .kv_heads = c.kv_heads,
            .head_dim = c.head_dim};
  }
  static SpeContextConfig selector_config(const SpeStepConfig& c) {
    constexpr const char* where = "SpeContextStep";
    KVSIFT_CHECK(c.mode == "per_kv_head" || c.mode == "batch_level", where,
                 "mode (= '{}') must be 'per_kv_head' or 'batch_level'", c.mode);
    SpeContextConfig sc{.budget = c.budget,
                        .mode = c.mode == "per_kv_head" ? SpeContextMode::per_kv_head : SpeContextMode::batch_level,
                        .sm_scale = c.head_sm_scale};
    sc.rope = c.yarn_factor ? specontext_yarn_rope(c.rope_theta, *c.yarn_factor, c.yarn_original_max_position_embeddings)
                            : RopeConfig{.theta = c.rope_theta};
    sc.rope.rotary_dim = c.rope_dim;
    sc.rope.layout = c.rope_interleaved ? RopeLayout::interleaved : RopeLayout::neox;
    return sc;
  }
  static SpeContextStepConfig step_config(const SpeStepConfig& c) {
    return {.step = {.attention = attention_options(c.window, c.sm_scale), .max_batch = c.max_batch,
                     .q_heads = c.q_heads, .kv_heads = c.kv_heads, .head_dim = c.head_dim,
                     .max_seq_len = c.max_seq_len, .validate_indices = c.validate},
            .layers = c.layers,
            .rerank = c.rerank};
  }
  Context context(std::uintptr_t stream) const { return context_of<Context>(pool_, stream); }
  /// CPU work runs without the GIL (other Python threads go on); CUDA work only enqueues.
  template <class F>
  static void call_unlocked(F&& f) {
    if constexpr (kDevice == Device::cpu) {
      nb::gil_scoped_release unlocked;
      f();
    } else {
      f();
    }
  }
  std::span<std::byte> workspace() { return {workspace_.data(), workspace_.size()}; }

  Pool* pool_;  // kept alive by the Python object (nb::keep_alive)
  SpeContextStep<T, Context> step_;
  typename Context::template array<std::byte> workspace_;
};

std::unique_ptr<SpeStep> make_specontext_step(const std::string& dtype, const std::string& device, std::int32_t layers,
                                              std::int32_t q_heads, std::int32_t kv_heads, std::int32_t head_dim,
                                              std::int32_t max_seq_len, std::int32_t budget, const std::string& mode,
                                              std::pair<std::int32_t, std::int32_t> window, double rope_theta,
                                              std::int32_t rope_dim, bool rope_interleaved,
                                              std::optional<double> yarn_factor,
                                              std::int32_t yarn_original_max_position_embeddings, float sm_scale,
                                              float head_sm_scale, std::int32_t max_batch, std::int32_t max_slots,
                                              bool validate, Pool* pool, std::int32_t rerank, double rerank_mass,
                                              std::int32_t rerank_floor) {
  const SpeStepConfig c{dtype,      device,      mode,        layers,       q_heads,    kv_heads,
                        head_dim,   max_batch,   max_seq_len, max_slots,    budget,     window,
                        sm_scale,   head_sm_scale, rope_theta, rope_dim,    rope_interleaved, yarn_factor,
                        yarn_original_max_position_embeddings, validate,
                        RerankConfig{.budget = rerank, .mass = rerank_mass, .floor = rerank_floor}};
  constexpr const char* where = "SpeContextStep";
  KVSIFT_CHECK(dtype == "float16" || dtype == "bfloat16", where, "dtype (= '{}') must be 'float16' or 'bfloat16'", dtype);
  const auto with_context = [&](auto t) -> std::unique_ptr<SpeStep> {
    using T = decltype(t);
    if (device == "cpu") return std::make_unique<SpeStepOf<T, cpu::Context>>(c, pool);
#if KVSIFT_WITH_CUDA
    if (device == "cuda") return std::make_unique<SpeStepOf<T, cuda::Context>>(c, nullptr);
#endif
    detail::throw_error(where, fmt::format("device (= '{}') must be 'cpu'{}", device,
                                           KVSIFT_WITH_CUDA ? " or 'cuda'" : " (this build has no CUDA backend)"));
  };
  return dtype == "float16" ? with_context(half{}) : with_context(bfloat16{});
}

}  // namespace
}  // namespace kvsift::python

NB_MODULE(_kvsift, m) {
  using namespace kvsift::python;
  m.doc() = "kvsift's C++ entry points; use the kvsift package (python/kvsift/__init__.py), which fills defaults";
  nb::exception<kvsift::Error>(m, "Error", PyExc_ValueError);
  m.attr("has_cuda") = bool(KVSIFT_WITH_CUDA);

  nb::class_<Pool>(m, "ThreadPool", "A pool of CPU threads (the calling thread counts as one)")
      .def(nb::init<int>(), "threads"_a)
      .def_prop_ro("size", [](const Pool& p) { return p.pool->size(); });

  nb::class_<Cache>(m, "KVCache", "A contiguous, paged or vLLM block-table KV cache over the caller's arrays "
                                  "(no copy)")
      .def_static("contiguous", &Cache::contiguous, "k"_a, "v"_a, "lengths"_a)
      .def_static("paged", &Cache::paged, "k_pages"_a, "v_pages"_a, "page_indptr"_a, "page_indices"_a,
                  "last_page_len"_a, "layout"_a = "NHD")
      .def_static("vllm", &Cache::vllm, "key_cache"_a, "value_cache"_a, "block_tables"_a, "seq_lens"_a,
                  "layout"_a = "NHD")
      .def_static("vllm_interleaved", &Cache::vllm_interleaved, "kv_cache"_a, "block_tables"_a, "seq_lens"_a,
                  "layout"_a = "NHD")
      .def_prop_ro("is_paged", &Cache::is_paged)
      .def_prop_ro("batch", &Cache::batch)
      .def_prop_ro("device", &Cache::device);

  m.def("decode_workspace_bytes", &decode_workspace_bytes, "kind"_a, "q"_a, "cache"_a, "capacity"_a = 0,
        "window"_a = std::pair{0, 0}, "validate"_a = false, "max_seq_len"_a = 0, "pool"_a.none() = nb::none());
  m.def("sparse_decode", &sparse_decode, "q"_a, "cache"_a, "indices"_a, "counts"_a, "o"_a, "lse"_a,
        "workspace"_a = nb::none(), "log_weights"_a = nb::none(), "window"_a = std::pair{0, 0}, "sm_scale"_a = 0.0f,
        "validate"_a = false, "pool"_a.none() = nb::none(), "stream"_a = 0);
  m.def("dense_decode", &dense_decode, "q"_a, "cache"_a, "o"_a, "lse"_a, "workspace"_a = nb::none(),
        "sm_scale"_a = 0.0f, "max_seq_len"_a = 0, "pool"_a.none() = nb::none(), "stream"_a = 0);
  m.def("merge_states", &merge_states, "partials"_a, "o"_a, "lse"_a, "stream"_a = 0);
  m.def("topk_rows_workspace_bytes", &topk_rows_workspace_bytes, "score_rows"_a, "max_tokens"_a, "k"_a,
        "window"_a = std::pair{0, 0}, "heads_per_row"_a = 1, "device"_a = "cpu", "pool"_a.none() = nb::none());
  m.def("topk_rows", &topk_rows, "scores"_a, "lengths"_a, "k"_a, "indices"_a, "counts"_a, "workspace"_a = nb::none(),
        "window"_a = std::pair{0, 0}, "heads_per_row"_a = 1, "pool"_a.none() = nb::none(), "stream"_a = 0);

  nb::class_<Step>(m, "Step", "One layer's decode step (a selector, sparse attention and its window)")
      .def("prepare", &Step::prepare, "cache"_a, "slots"_a, "queries"_a = nb::none(), "stream"_a = 0)
      .def("run", &Step::run, "q"_a, "cache"_a, "slots"_a, "o"_a, "lse"_a, "k"_a = nb::none(), "v"_a = nb::none(),
           "stream"_a = 0)
      .def("release", &Step::release, "slots"_a)
      .def("selection", &Step::selection, "batch"_a)
      .def("union_sizes", &Step::union_sizes, "batch"_a)
      .def("store_sizes", &Step::store_sizes)
      .def_prop_ro("capacity", &Step::capacity)
      .def_prop_ro("selection_page_size", &Step::selection_page_size)
      .def_prop_ro("workspace_bytes", &Step::workspace_bytes)
      .def_prop_ro("name", &Step::name)
      .def("prepared", &Step::prepared, "slot"_a);
#if KVSIFT_WITH_CUDA
  nb::class_<SplitStep>(m, "SplitStep", "One layer's decode step split over the GPU and the CPU (step/split_step.hpp)")
      .def("prepare", &SplitStep::prepare, "cache"_a, "slots"_a, "queries"_a = nb::none(), "stream"_a = 0)
      .def("run", &SplitStep::run, "q"_a, "cache"_a, "slots"_a, "o"_a, "lse"_a, "q_device"_a = nb::none(),
           "device_cache"_a = nb::none(), "host_cache"_a = nb::none(), "stream"_a = 0)
      .def("release", &SplitStep::release, "slots"_a)
      .def("selection", &SplitStep::selection)
      .def("stats", &SplitStep::stats)
      .def_prop_ro("capacity", &SplitStep::capacity)
      .def_prop_ro("workspace_bytes", &SplitStep::workspace_bytes)
      .def_prop_ro("name", &SplitStep::name)
      .def("prepared", &SplitStep::prepared, "slot"_a);
  m.def("make_split_step", &make_split_step, "selector"_a, "selector_config"_a, "dtype"_a, "device"_a, "placement"_a,
        "q_heads"_a, "kv_heads"_a, "head_dim"_a, "max_batch"_a, "max_seq_len"_a, "max_slots"_a, "window"_a,
        "sm_scale"_a, "validate"_a, "pool"_a.none() = nb::none(), nb::keep_alive<0, 15>());
#endif
  nb::class_<SpeStep>(m, "SpeContextStep", "A model's decode step with one SpeContext selection per step")
      .def("prepare", &SpeStep::prepare, "cache"_a, "slots"_a, "k_pre"_a, "stream"_a = 0)
      .def("select", &SpeStep::select, "q"_a, "k"_a, "cache"_a, "slots"_a, "stream"_a = 0)
      .def("attend", &SpeStep::attend, "layer"_a, "q"_a, "cache"_a, "o"_a, "lse"_a, "k"_a = nb::none(),
           "v"_a = nb::none(), "indices"_a = nb::none(), "counts"_a = nb::none(), "validate_selection"_a = true,
           "stream"_a = 0)
      .def("release", &SpeStep::release, "slots"_a)
      .def("selection", &SpeStep::selection, "batch"_a)
      .def_prop_ro("capacity", &SpeStep::capacity)
      .def_prop_ro("window", &SpeStep::window)
      .def_prop_ro("workspace_bytes", &SpeStep::workspace_bytes)
      .def("prepared", &SpeStep::prepared, "slot"_a);
  m.def("make_specontext_step", &make_specontext_step, "dtype"_a, "device"_a, "layers"_a, "q_heads"_a, "kv_heads"_a,
        "head_dim"_a, "max_seq_len"_a, "budget"_a, "mode"_a, "window"_a, "rope_theta"_a, "rope_dim"_a,
        "rope_interleaved"_a, "yarn_factor"_a.none(), "yarn_original_max_position_embeddings"_a, "sm_scale"_a,
        "head_sm_scale"_a, "max_batch"_a, "max_slots"_a, "validate"_a, "pool"_a.none() = nb::none(),
        "rerank"_a = 0, "rerank_mass"_a = 0.0, "rerank_floor"_a = 1, nb::keep_alive<0, 21>());
  m.def("make_step", &make_step, "selector"_a, "selector_config"_a, "dtype"_a, "device"_a, "q_heads"_a, "kv_heads"_a,
        "head_dim"_a, "max_batch"_a, "max_seq_len"_a, "max_slots"_a, "window"_a, "sm_scale"_a, "validate"_a,
        "pool"_a.none() = nb::none(), "page_selections"_a = false, nb::keep_alive<0, 14>());
}
