"""CPU stand-ins for the nine `sgl_kernel` functions SGLang imports with the CPU engine.

Only `assign_req_to_token_pool_cpu` is called by plain serving; it is written here with the
meaning of SGLang's C++ kernel. The others belong to speculative decoding and KV copies and
raise: a test that reaches one would otherwise pass on a wrong answer.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_req_to_token_pool_cpu",
    "build_tree_kernel_efficient_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "rotate_input_ids_cpu",
    "verify_tree_greedy_cpu",
]


def assign_req_to_token_pool_cpu(
    req_pool_indices: Any,
    req_to_token: Any,
    start_offset: Any,
    end_offset: Any,
    out_cache_loc: Any,
    pool_len: int,
) -> None:
    """For each request i, `req_to_token[req_pool_indices[i], start[i]:end[i]]` takes the
    next `end[i] - start[i]` entries of `out_cache_loc`, in request order."""
    del pool_len  # the C++ kernel's row stride; torch indexing knows it
    pos = 0
    for row, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[pos : pos + n].to(req_to_token.dtype)
        pos += n


def _unavailable(name: str) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"sgl_kernel.{name} has no CPU stand-in here (test stub)")

    call.__name__ = name
    return call


assign_draft_cache_locs_contiguous_cpu = _unavailable("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = _unavailable("assign_extend_cache_locs_cpu")
build_tree_kernel_efficient_cpu = _unavailable("build_tree_kernel_efficient_cpu")
copy_all_layer_kv_cache_cpu = _unavailable("copy_all_layer_kv_cache_cpu")
fill_accept_out_cache_loc_cpu = _unavailable("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _unavailable("fill_bonus_tokens_cpu")
rotate_input_ids_cpu = _unavailable("rotate_input_ids_cpu")
verify_tree_greedy_cpu = _unavailable("verify_tree_greedy_cpu")
