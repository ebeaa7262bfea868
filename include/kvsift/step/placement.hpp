#pragma once
/// Where a decode step's parts run: the second template argument of DecodeStep<S, Placement>
/// (step/decode_step.hpp). A step has three parts: the selection (the selector's append and select), the attention
/// of the selected middle, and the attention of the sink + recent window, merged with the middle's by LSE. The
/// selection always runs on the selector's context (cpu::Context or cuda::Context); the placement says where the
/// two attentions run and where the KV rows they read live:
///
/// | placement   | selector | window | middle                                             | header              |
/// |-------------|----------|--------|----------------------------------------------------|---------------------|
/// | Local       | GPU      | GPU    | GPU, from the device cache (one launch with the window) | step/decode_step.hpp |
/// | Local       | CPU      | CPU    | CPU, from the host cache (one call with the window)     | step/decode_step.hpp |
/// | MiddleOnCpu | CPU      | GPU    | CPU, from the pinned host cache it selected over    | step/split_step.hpp |
/// | MiddleOnCpu | GPU      | GPU    | CPU, from a pinned host cache; the selection copied to the host | step/split_step.hpp |
/// | MiddleOnGpu | CPU      | GPU    | GPU, its rows gathered over PCIe from the pinned host cache | step/split_step.hpp |
///
/// (A GPU selector's middle attended on the GPU is the local placement.) The split placements merge the two fp32
/// partials on the GPU and take a SplitWorkspace (a device and a pinned host block) and a SplitContext (a stream and
/// a CPU pool).
///
/// The model-level step (SpeContextStep<T, Context, Placement>, one selection per step attended by every layer)
/// takes Local, every layer's KV in the context's memory, or LayersOnHost (CUDA): its last layers' KV in pinned
/// host caches, attended from GPU-resident rows that an elastic loader keeps current with the step's selection
/// (selectors/specontext/offload.hpp; an OffloadContext: the stream and a copy stream).

#include <concepts>

#include "kvsift/core/validate.hpp"

namespace kvsift::placement {

/// Selection and attention on the selector's context: one stream (graph-capturable) or one thread pool.
struct Local {};
/// The selected middle attended on the CPU from pinned host KV, the window on the GPU, merged on the GPU.
struct MiddleOnCpu {};
/// A CPU selector's selection copied to the GPU, its rows gathered from pinned host KV and attended on the GPU
/// with the window.
struct MiddleOnGpu {};
/// A model-level step's last layers with their KV in pinned host memory, attended from GPU-resident rows copied as
/// the selection changes (SpeContextStep only; not a placement of DecodeStep).
struct LayersOnHost {};

/// Whether placement P takes a selector on `Context` (MiddleOnGpu: CPU selectors only).
template <class P, class Context>
concept Fits = std::same_as<P, Local> || std::same_as<P, MiddleOnCpu> ||
               (std::same_as<P, MiddleOnGpu> && Context::memory == MemorySpace::host);

}  // namespace kvsift::placement
