#pragma once
/// One driver for every workspace API (issue 19), after CUB's launch helper (catch2_test_launch_helper.h):
/// from the size query's bytes it runs the call through
///   1. a buffer one 256-byte block smaller: refused with "workspace too small", outputs untouched;
///   2. the exact size at pointer + 16: refused as misaligned, outputs untouched;
///   3. the exact size filled with 0xff, then with 0x00: the same output bytes (the contents do not matter);
///   4. on CUDA, the call captured in a CUDA graph (thread-local capture mode, so a host sync or an allocation
///      in the call fails the capture) and replayed twice: the same bytes again.
/// A query of 0 bytes instead runs with an empty span (and, on CUDA, its graph). Outputs are poisoned before
/// every run, so an output the call does not write shows as poison, and compared as raw bytes, so NaN counts.
/// The driver returns the result's bytes; the outputs then hold that result, for the test's reference check.
///
/// The CPU and CUDA drivers share check_workspace_with; a memory policy (HostWorkspaceMemory,
/// DeviceWorkspaceMemory) allocates, fills and invokes the call (with a stream on CUDA).

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kvsift/core/workspace.hpp"
#include "kvsift/cpu/context.hpp"
#include "test_util.hpp"

#if defined(KVSIFT_WITH_CUDA)
#include <cuda_runtime_api.h>

#include "kvsift/cuda/check.hpp"
#endif

namespace kvsift::test {

/// The bytes of host arrays, concatenated: a read() callable's result.
template <class... V>
std::vector<std::byte> bytes_of(const V&... arrays) {
  std::vector<std::byte> out;
  const auto append = [&](const auto& a) {
    const auto* p = reinterpret_cast<const std::byte*>(a.data());
    out.insert(out.end(), p, p + a.size() * sizeof(a[0]));
  };
  (append(arrays), ...);
  return out;
}

/// Expects two output images to be equal, naming the first differing byte (not dumping both).
inline void expect_same_bytes(const std::vector<std::byte>& got, const std::vector<std::byte>& want,
                              const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what << ": the outputs' size changed";
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i]) {
      ADD_FAILURE() << what << ": first difference at output byte " << i << " of " << got.size() << " (0x"
                    << std::hex << int(got[i]) << " instead of 0x" << int(want[i]) << std::dec << ")";
      return;
    }
  }
}

/// Host memory: the call is run(std::span<std::byte>).
class HostWorkspaceMemory {
 public:
  static constexpr bool kGraphs = false;
  using Storage = cpu::Array<std::byte>;  // 256-byte aligned

  Storage allocate(std::size_t bytes) const { return Storage(bytes); }
  static std::byte* data(Storage& s) { return s.data(); }
  void fill(std::span<std::byte> buffer, std::uint8_t value) const {
    std::memset(buffer.data(), value, buffer.size());
  }
  template <class Run>
  void run(Run& call, std::span<std::byte> workspace) const {
    call(workspace);
  }
  template <class Poison>
  void poison(Poison& poison_outputs) const {
    poison_outputs();
  }
};

#if defined(KVSIFT_WITH_CUDA)
/// Device memory: the call is run(std::span<std::byte>, cudaStream_t) on a stream owned here; each run is
/// followed by a stream sync (the test's reads and poisoning use the legacy stream).
class DeviceWorkspaceMemory {
 public:
  static constexpr bool kGraphs = true;
  class Storage {
   public:
    explicit Storage(std::size_t bytes) { KVSIFT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&data_), bytes)); }
    Storage(const Storage&) = delete;
    Storage& operator=(const Storage&) = delete;
    ~Storage() { cudaFree(data_); }
    std::byte* data() const { return data_; }

   private:
    std::byte* data_ = nullptr;  // cudaMalloc: 256-byte aligned
  };

  DeviceWorkspaceMemory() { KVSIFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  DeviceWorkspaceMemory(const DeviceWorkspaceMemory&) = delete;
  DeviceWorkspaceMemory& operator=(const DeviceWorkspaceMemory&) = delete;
  ~DeviceWorkspaceMemory() { cudaStreamDestroy(stream_); }

  Storage allocate(std::size_t bytes) const { return Storage(bytes); }
  static std::byte* data(Storage& s) { return s.data(); }
  void fill(std::span<std::byte> buffer, std::uint8_t value) const {
    if (!buffer.empty()) KVSIFT_CUDA_CHECK(cudaMemset(buffer.data(), value, buffer.size()));
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  }
  template <class Run>
  void run(Run& call, std::span<std::byte> workspace) const {
    call(workspace, stream_);
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  template <class Poison>
  void poison(Poison& poison_outputs) const {
    poison_outputs();
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());  // the non-blocking stream does not wait for the legacy one
  }

  /// Captures one call into a graph (thread-local mode: a host sync or allocation in the call invalidates the
  /// capture), then replays it twice over `buffer` filled with 0xff, then 0x00, with outputs poisoned before
  /// each replay; each replay must give `want`.
  template <class Run, class Read, class Poison>
  void check_graph_replays(Run& call, Read& read, Poison& poison_outputs, std::span<std::byte> buffer,
                           const std::vector<std::byte>& want) const {
    cudaGraph_t graph = nullptr;
    KVSIFT_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    try {
      call(buffer, stream_);
    } catch (const std::exception& e) {
      cudaStreamEndCapture(stream_, &graph);
      if (graph != nullptr) cudaGraphDestroy(graph);
      (void)cudaGetLastError();  // capture errors are not sticky; clear them for the next test
      ADD_FAILURE() << "the call fails under CUDA graph capture: " << e.what();
      return;
    }
    const cudaError_t end = cudaStreamEndCapture(stream_, &graph);
    if (end != cudaSuccess) {
      (void)cudaGetLastError();
      ADD_FAILURE() << "CUDA graph capture of the call failed: " << cudaGetErrorString(end)
                    << " (a host synchronization or allocation inside the call?)";
      return;
    }
    cudaGraphExec_t exec = nullptr;
    const cudaError_t made = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    ASSERT_EQ(made, cudaSuccess) << "cudaGraphInstantiate: " << cudaGetErrorString(made);
    for (const std::uint8_t contents : {std::uint8_t{0xff}, std::uint8_t{0x00}}) {
      fill(buffer, contents);
      poison(poison_outputs);
      KVSIFT_CUDA_CHECK(cudaGraphLaunch(exec, stream_));
      KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream_));
      expect_same_bytes(read(), want, "graph replay over a workspace of 0x" + std::to_string(int(contents)) +
                                          " bytes vs the eager run");
    }
    cudaGraphExecDestroy(exec);
  }

 private:
  cudaStream_t stream_ = nullptr;
};
#endif

/// The shared driver (see the top of the file). `bytes`: the size query's result; `call`: run(workspace) on the
/// host, run(workspace, stream) on CUDA; `read`: the outputs' bytes (a host copy); `poison_outputs`: poisons
/// every output (and restores any input the call updates in place). Returns the result's bytes.
template <class Memory, class Run, class Read, class Poison>
std::vector<std::byte> check_workspace_with(Memory& memory, std::size_t bytes, Run call, Read read,
                                            Poison poison_outputs) {
  constexpr std::size_t kBlock = WorkspaceLayout::kAlignment;
  const auto run_poisoned = [&](std::span<std::byte> workspace) {
    memory.poison(poison_outputs);
    memory.run(call, workspace);
    return read();
  };
  if (bytes == 0) {
    SCOPED_TRACE("the query gives 0 bytes: an empty workspace");
    std::vector<std::byte> result;
    try {
      result = run_poisoned({});
    } catch (const Error& e) {
      ADD_FAILURE() << "an empty workspace, as the query's 0 bytes allow, is refused: " << e.what();
      return {};
    }
    if constexpr (Memory::kGraphs) memory.check_graph_replays(call, read, poison_outputs, {}, result);
    return result;
  }

  auto storage = memory.allocate(bytes + kBlock);
  std::byte* const base = Memory::data(storage);
  const std::span<std::byte> exact(base, bytes);

  memory.poison(poison_outputs);
  const std::vector<std::byte> poisoned = read();
  const std::size_t smaller = bytes > kBlock ? bytes - kBlock : 0;
  memory.fill(exact, 0xff);
  expect_error([&] { memory.run(call, exact.first(smaller)); }, {"workspace too small"});
  expect_same_bytes(read(), poisoned,
                    "outputs after the refused call with " + std::to_string(smaller) + " of " +
                        std::to_string(bytes) + " bytes");
  expect_error([&] { memory.run(call, std::span<std::byte>(base + 16, bytes)); }, {"is not 256-byte aligned"});
  expect_same_bytes(read(), poisoned, "outputs after the refused call with a workspace at pointer + 16");

  memory.fill(exact, 0xff);
  const std::vector<std::byte> result = run_poisoned(exact);
  EXPECT_NE(result, poisoned) << "the exact-size run wrote no output";
  memory.fill(exact, 0x00);
  expect_same_bytes(run_poisoned(exact), result, "the run over a workspace of 0x00 bytes vs one of 0xff bytes");
  if constexpr (Memory::kGraphs) memory.check_graph_replays(call, read, poison_outputs, exact, result);
  return result;
}

/// The host driver: run(std::span<std::byte>).
template <class Run, class Read, class Poison>
std::vector<std::byte> check_workspace(std::size_t bytes, Run call, Read read, Poison poison_outputs) {
  HostWorkspaceMemory memory;
  return check_workspace_with(memory, bytes, std::move(call), std::move(read), std::move(poison_outputs));
}

#if defined(KVSIFT_WITH_CUDA)
/// The CUDA driver: run(std::span<std::byte>, cudaStream_t); the graph checks included.
template <class Run, class Read, class Poison>
std::vector<std::byte> check_device_workspace(std::size_t bytes, Run call, Read read, Poison poison_outputs) {
  DeviceWorkspaceMemory memory;
  return check_workspace_with(memory, bytes, std::move(call), std::move(read), std::move(poison_outputs));
}
#endif

}  // namespace kvsift::test
