"""kvsift as torch operators: `import kvsift.torch_ops` registers custom ops in the namespace "kvsift"
(torch.library, torch >= 2.4) with fake implementations, so that torch.compile(fullgraph=True) traces a model
calling them without a graph break and a CUDA graph captures them (they run on torch's current stream, never
synchronize, and read no device value on the host).

A KV cache is passed as a list of tensors and its layout: 'contiguous' [k, v, lengths] (k, v [batch, kv_heads,
capacity, head_dim], lengths [batch] int32), 'NHD' / 'HND' [k_pages, v_pages, page_indptr, page_indices,
last_page_len] (kvsift.paged_cache's arguments), or 'vllm_NHD' / 'vllm_HND' [key_cache, value_cache, block_tables,
seq_lens] (vLLM's per-layer cache and block tables, kvsift.vllm_cache's arguments). Each operation comes twice:
  - functional (kvsift::sparse_decode, dense_decode, merge_states, topk_rows, decode_step): returns new tensors;
    under torch.compile with CUDA graphs their memory comes from the graph's pool;
  - `_into` (kvsift::sparse_decode_into, ...): writes caller-given outputs and workspace (size it with the
    *_workspace_bytes functions below) and returns nothing: nothing is allocated in the call.
Sparse decode does not validate its selection here (validation synchronizes): pass selections the engine trusts,
or check them once with kvsift.sparse_decode(validate=True).

The decode step: register a kvsift.DecodeStep with register_step, which returns the integer handle the decode_step
ops take; prepare and release sequences on the step itself, outside the hot path. The op reads the cache (the engine
has written the step's token to it) and the slots tensor (on the step's device). A step of a split placement
('middle_on_cpu', 'middle_on_gpu') takes its second cache in the same list and, for a CPU selector, the GPU's query
(q_device); it synchronizes with the host every step, so it runs eagerly and under torch.compile but not inside a
CUDA graph capture, where the op refuses it. A
kvsift.SpeContextStep registers the same way for specontext_select (once per model step; it returns a ticket) and
specontext_attend (per layer, taking the ticket, which orders it after the select).
docs/python.md#torch-operators is the reference."""
from typing import List, Optional, Tuple

import torch

from . import DecodeStep, Error, KVCache, SpeContextStep, _kvsift, _stream, _workspace

__all__ = ["register_step", "unregister_step", "sparse_decode_workspace_bytes", "dense_decode_workspace_bytes",
           "topk_rows_workspace_bytes"]

Tensor = torch.Tensor

_PAGED = ["k_pages", "v_pages", "page_indptr", "page_indices", "last_page_len"]
_VLLM = ["key_cache", "value_cache", "block_tables", "seq_lens"]
# layout -> the cache's tensors, in order.
_CACHE_TENSORS = {"contiguous": ["k", "v", "lengths"], "NHD": _PAGED, "HND": _PAGED, "vllm_NHD": _VLLM,
                  "vllm_HND": _VLLM}


def _tensor_names(where, layout):
    """The names of a cache's tensors in `layout`, in order."""
    if layout not in _CACHE_TENSORS:
        raise Error(f"kvsift::{where}: layout (= {layout!r}) must be one of "
                    f"{', '.join(repr(name) for name in _CACHE_TENSORS)}")
    return _CACHE_TENSORS[layout]


def _cache(where, cache, layout):
    """The kvsift.KVCache over `cache`'s tensors in `layout`."""
    names = _tensor_names(where, layout)
    if len(cache) != len(names):
        raise Error(f"kvsift::{where}: a {layout} cache is {len(names)} tensors [{', '.join(names)}], "
                    f"got {len(cache)}")
    if layout == "contiguous":
        return KVCache.contiguous(*cache)
    if layout.startswith("vllm_"):
        return KVCache.vllm(*cache, layout[len("vllm_"):])
    return KVCache.paged(*cache, layout)


def _new_state(q, heads, out_dtype):
    """O [batch, heads, head_dim] in out_dtype (default q's) and LSE [batch, heads] float32, beside q."""
    o = q.new_empty((q.shape[0], heads, q.shape[-1]), dtype=out_dtype or q.dtype)
    return o, q.new_empty((q.shape[0], heads), dtype=torch.float32)


# ---- workspace sizes of the _into ops ---------------------------------------------------------------------------

def sparse_decode_workspace_bytes(q, cache, layout, capacity, window=(0, 0)):
    """Bytes of sparse_decode_into's workspace for q, this cache and selections of `capacity` entries."""
    return _kvsift.decode_workspace_bytes("sparse", q, _cache("sparse_decode_into", cache, layout), capacity,
                                          tuple(window), False, 0, None)


def dense_decode_workspace_bytes(q, cache, layout, max_seq_len=0):
    """Bytes of dense_decode_into's workspace (max_seq_len: as dense_decode's)."""
    return _kvsift.decode_workspace_bytes("dense", q, _cache("dense_decode_into", cache, layout), 0, (0, 0), False,
                                          max_seq_len, None)


def topk_rows_workspace_bytes(scores, k, window=(0, 0), heads_per_row=1):
    """Bytes of topk_rows_into's workspace for these scores."""
    return _kvsift.topk_rows_workspace_bytes(scores.shape[0], scores.shape[1], k, tuple(window), heads_per_row,
                                             "cuda" if scores.is_cuda else "cpu", None)


# ---- sparse and dense decode ------------------------------------------------------------------------------------

@torch.library.custom_op("kvsift::sparse_decode_into", mutates_args=("o", "lse", "workspace"))
def sparse_decode_into(q: Tensor, cache: List[Tensor], layout: str, indices: Tensor, counts: Tensor,
                       log_weights: Optional[Tensor], window: List[int], sm_scale: float, o: Tensor, lse: Tensor,
                       workspace: Optional[Tensor]) -> None:
    _kvsift.sparse_decode(q, _cache("sparse_decode_into", cache, layout), indices, counts, o, lse, workspace,
                          log_weights, tuple(window), sm_scale, False, None, _stream(q, None))


@sparse_decode_into.register_fake
def _(q, cache, layout, indices, counts, log_weights, window, sm_scale, o, lse, workspace):
    return None


@torch.library.custom_op("kvsift::sparse_decode", mutates_args=())
def sparse_decode(q: Tensor, cache: List[Tensor], layout: str, indices: Tensor, counts: Tensor,
                  log_weights: Optional[Tensor], window: List[int], sm_scale: float,
                  out_dtype: Optional[torch.dtype]) -> Tuple[Tensor, Tensor]:
    o, lse = _new_state(q, q.shape[1], out_dtype)
    workspace = _workspace(sparse_decode_workspace_bytes(q, cache, layout, indices.shape[-1], window), q)
    sparse_decode_into(q, cache, layout, indices, counts, log_weights, window, sm_scale, o, lse, workspace)
    return o, lse


@sparse_decode.register_fake
def _(q, cache, layout, indices, counts, log_weights, window, sm_scale, out_dtype):
    return _new_state(q, q.shape[1], out_dtype)


@torch.library.custom_op("kvsift::dense_decode_into", mutates_args=("o", "lse", "workspace"))
def dense_decode_into(q: Tensor, cache: List[Tensor], layout: str, sm_scale: float, max_seq_len: int, o: Tensor,
                      lse: Tensor, workspace: Optional[Tensor]) -> None:
    _kvsift.dense_decode(q, _cache("dense_decode_into", cache, layout), o, lse, workspace, sm_scale, max_seq_len,
                         None, _stream(q, None))


@dense_decode_into.register_fake
def _(q, cache, layout, sm_scale, max_seq_len, o, lse, workspace):
    return None


@torch.library.custom_op("kvsift::dense_decode", mutates_args=())
def dense_decode(q: Tensor, cache: List[Tensor], layout: str, sm_scale: float, max_seq_len: int,
                 out_dtype: Optional[torch.dtype]) -> Tuple[Tensor, Tensor]:
    o, lse = _new_state(q, q.shape[1], out_dtype)
    workspace = _workspace(dense_decode_workspace_bytes(q, cache, layout, max_seq_len), q)
    dense_decode_into(q, cache, layout, sm_scale, max_seq_len, o, lse, workspace)
    return o, lse


@dense_decode.register_fake
def _(q, cache, layout, sm_scale, max_seq_len, out_dtype):
    return _new_state(q, q.shape[1], out_dtype)


# ---- merge and top-k --------------------------------------------------------------------------------------------

def _check_partials(where, o_parts, lse_parts):
    if len(o_parts) == 0 or len(o_parts) != len(lse_parts):
        raise Error(f"kvsift::{where}: o_parts ({len(o_parts)} tensors) and lse_parts ({len(lse_parts)}) must be "
                    f"the same number of partial states, at least one")


@torch.library.custom_op("kvsift::merge_states_into", mutates_args=("o", "lse"))
def merge_states_into(o_parts: List[Tensor], lse_parts: List[Tensor], o: Tensor, lse: Tensor) -> None:
    _check_partials("merge_states_into", o_parts, lse_parts)
    _kvsift.merge_states(list(zip(o_parts, lse_parts)), o, lse, _stream(o_parts[0], None))


@merge_states_into.register_fake
def _(o_parts, lse_parts, o, lse):
    return None


@torch.library.custom_op("kvsift::merge_states", mutates_args=())
def merge_states(o_parts: List[Tensor], lse_parts: List[Tensor],
                 out_dtype: Optional[torch.dtype]) -> Tuple[Tensor, Tensor]:
    _check_partials("merge_states", o_parts, lse_parts)
    o, lse = _new_state(o_parts[0], o_parts[0].shape[1], out_dtype)
    merge_states_into(o_parts, lse_parts, o, lse)
    return o, lse


@merge_states.register_fake
def _(o_parts, lse_parts, out_dtype):
    _check_partials("merge_states", o_parts, lse_parts)
    return _new_state(o_parts[0], o_parts[0].shape[1], out_dtype)


@torch.library.custom_op("kvsift::topk_rows_into", mutates_args=("indices", "counts", "workspace"))
def topk_rows_into(scores: Tensor, lengths: Tensor, k: int, window: List[int], heads_per_row: int, indices: Tensor,
                   counts: Tensor, workspace: Optional[Tensor]) -> None:
    _kvsift.topk_rows(scores, lengths, k, indices, counts, workspace, tuple(window), heads_per_row, None,
                      _stream(scores, None))


@topk_rows_into.register_fake
def _(scores, lengths, k, window, heads_per_row, indices, counts, workspace):
    return None


def _new_selection(scores, lengths, k, kv_heads, heads_per_row):
    batch = lengths.shape[0]
    return (scores.new_empty((batch, kv_heads, heads_per_row * k), dtype=torch.int32),
            scores.new_empty((batch, kv_heads), dtype=torch.int32))


@torch.library.custom_op("kvsift::topk_rows", mutates_args=())
def topk_rows(scores: Tensor, lengths: Tensor, k: int, kv_heads: int, window: List[int],
              heads_per_row: int) -> Tuple[Tensor, Tensor]:
    """Per (sequence b, kv head) the k best of its scores rows, as kvsift.topk_rows; lengths [batch] int32 gives
    the batch."""
    indices, counts = _new_selection(scores, lengths, k, kv_heads, heads_per_row)
    workspace = _workspace(topk_rows_workspace_bytes(scores, k, window, heads_per_row), scores)
    topk_rows_into(scores, lengths, k, window, heads_per_row, indices, counts, workspace)
    return indices, counts


@topk_rows.register_fake
def _(scores, lengths, k, kv_heads, window, heads_per_row):
    return _new_selection(scores, lengths, k, kv_heads, heads_per_row)


# ---- the decode step ---------------------------------------------------------------------------------------------

_steps = {}
_next_handle = [1]


def register_step(step):
    """The handle the ops take for `step`, which this module keeps alive until unregister_step: a kvsift.DecodeStep
    of any placement (the decode_step ops) or a kvsift.SpeContextStep (the specontext ops)."""
    if not isinstance(step, (DecodeStep, SpeContextStep)):
        raise Error(f"kvsift.torch_ops.register_step: step must be a kvsift.DecodeStep or SpeContextStep, not "
                    f"{type(step).__name__}")
    handle = _next_handle[0]
    _next_handle[0] += 1
    _steps[handle] = step
    return handle


def unregister_step(handle):
    """Forgets a handle of register_step (the step itself lives on while the caller holds it)."""
    if _steps.pop(int(handle), None) is None:
        raise Error(f"kvsift.torch_ops.unregister_step: handle (= {handle}) is not a registered step")


def _step(where, handle, kind=DecodeStep):
    step = _steps.get(handle)
    if step is None:
        raise Error(f"kvsift::{where}: step (= {handle}) is not a handle of kvsift.torch_ops.register_step "
                    f"({len(_steps)} registered)")
    if not isinstance(step, kind):
        raise Error(f"kvsift::{where}: step (= {handle}) is a {type(step).__name__}, this op runs a {kind.__name__}")
    return step


def _step_caches(where, step, cache, layout, q_device, split_layout):
    """The step's KVCache and run()'s split arguments. A split step's cache list is its own cache's tensors (in
    `layout`, on the selector's device), then the other half's (in split_layout, default `layout`): a CPU
    selector's device_cache (the GPU's, holding the window's rows; with q_device, the GPU's query), a GPU
    selector's host_cache (pinned, holding the middle's rows)."""
    if step.placement == "local":
        if q_device is not None or split_layout is not None:
            raise Error(f"kvsift::{where}: q_device and split_layout are the split placements'; this step's placement "
                        f"is 'local'")
        return _cache(where, cache, layout), {}
    other_layout = layout if split_layout is None else split_layout
    own, other = _tensor_names(where, layout), _tensor_names(where, other_layout)
    side, second = (("CPU", "device_cache (the GPU's: the window)") if step.device == "cpu" else
                    ("GPU", "host_cache (pinned: the middle)"))
    if len(cache) != len(own) + len(other):
        raise Error(f"kvsift::{where}: a '{step.placement}' step with its selector on the {side} takes its {layout} "
                    f"cache [{', '.join(own)}] then its {second} in {other_layout} [{', '.join(other)}]: "
                    f"{len(own) + len(other)} tensors, got {len(cache)}")
    caches = _cache(where, cache[:len(own)], layout), _cache(where, cache[len(own):], other_layout)
    if step.device == "cpu":
        if q_device is None:
            raise Error(f"kvsift::{where}: a CPU selector's '{step.placement}' step takes q_device (the query on "
                        f"the GPU, beside q on the CPU)")
        return caches[0], {"q_device": q_device, "device_cache": caches[1]}
    if q_device is not None:
        raise Error(f"kvsift::{where}: q_device is a CPU selector's; this step's selector runs on the GPU, q is its "
                    f"query")
    return caches[0], {"host_cache": caches[1]}


@torch.library.custom_op("kvsift::decode_step_into", mutates_args=("o", "lse"))
def decode_step_into(step: int, q: Tensor, cache: List[Tensor], layout: str, slots: Tensor, o: Tensor,
                     lse: Tensor, q_device: Optional[Tensor] = None, split_layout: Optional[str] = None) -> None:
    """The registered DecodeStep `step` on q, its cache and slots, into o and lse (as its run). A split step
    ('middle_on_cpu', 'middle_on_gpu'): `cache` holds its cache's tensors then the other half's (split_layout,
    default layout; see _step_caches), q_device is a CPU selector's query on the GPU, and o, lse are on the GPU.
    A split step waits for its CPU half every call: it runs eagerly and under torch.compile (without CUDA graphs),
    and is refused inside a CUDA graph capture (torch.cuda.graph), where it cannot run."""
    where = "decode_step_into"
    decode = _step(where, step)
    own, split = _step_caches(where, decode, cache, layout, q_device, split_layout)
    if split and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise Error(f"kvsift::{where}: placement '{decode.placement}' synchronizes with the host every step and cannot "
                    f"be captured in a CUDA graph: run it eagerly, or under torch.compile without CUDA graphs")
    decode.run(q, own, slots, o=o, lse=lse, **split)


@decode_step_into.register_fake
def _(step, q, cache, layout, slots, o, lse, q_device=None, split_layout=None):
    return None


@torch.library.custom_op("kvsift::decode_step", mutates_args=())
def decode_step(step: int, q: Tensor, cache: List[Tensor], layout: str, slots: Tensor,
                out_dtype: Optional[torch.dtype], q_device: Optional[Tensor] = None,
                split_layout: Optional[str] = None) -> Tuple[Tensor, Tensor]:
    """decode_step_into's (o, lse), allocated beside q, or beside q_device for a CPU selector's split step."""
    o, lse = _new_state(q if q_device is None else q_device, q.shape[1], out_dtype)
    decode_step_into(step, q, cache, layout, slots, o, lse, q_device, split_layout)
    return o, lse


@decode_step.register_fake
def _(step, q, cache, layout, slots, out_dtype, q_device=None, split_layout=None):
    return _new_state(q if q_device is None else q_device, q.shape[1], out_dtype)


# ---- SpeContext: one selection per model step, every layer attends it ---------------------------------------------
# specontext_select returns a ticket (one int32, zero) that each specontext_attend takes: the data dependency that
# orders a step's attends after its select for a compiler that sees no other link between them (the selection lives
# in the step).

@torch.library.custom_op("kvsift::specontext_select", mutates_args=())
def specontext_select(step: int, q: Tensor, k: Tensor, cache: List[Tensor], layout: str, slots: Tensor) -> Tensor:
    """The retrieval head's q [batch, q_heads, head_dim] and new key k [batch, kv_heads, head_dim] (before RoPE)
    append the key and select, as SpeContextStep.select; returns the ticket the step's attends take."""
    _step("specontext_select", step, SpeContextStep).select(q, k, _cache("specontext_select", cache, layout), slots)
    return torch.zeros(1, dtype=torch.int32, device=q.device)


@specontext_select.register_fake
def _(step, q, k, cache, layout, slots):
    return q.new_empty((1,), dtype=torch.int32)


@torch.library.custom_op("kvsift::specontext_attend_into", mutates_args=("o", "lse"))
def specontext_attend_into(step: int, layer: int, q: Tensor, cache: List[Tensor], layout: str, ticket: Tensor,
                           o: Tensor, lse: Tensor) -> None:
    _step("specontext_attend_into", step, SpeContextStep).attend(
        layer, q, _cache("specontext_attend_into", cache, layout), o=o, lse=lse)


@specontext_attend_into.register_fake
def _(step, layer, q, cache, layout, ticket, o, lse):
    return None


@torch.library.custom_op("kvsift::specontext_attend", mutates_args=())
def specontext_attend(step: int, layer: int, q: Tensor, cache: List[Tensor], layout: str, ticket: Tensor,
                      out_dtype: Optional[torch.dtype]) -> Tuple[Tensor, Tensor]:
    """Layer `layer` attends the last select's selection and the window, as SpeContextStep.attend (the engine has
    written the layer's token to its cache)."""
    o, lse = _new_state(q, q.shape[1], out_dtype)
    specontext_attend_into(step, layer, q, cache, layout, ticket, o, lse)
    return o, lse


@specontext_attend.register_fake
def _(step, layer, q, cache, layout, ticket, out_dtype):
    return _new_state(q, q.shape[1], out_dtype)
