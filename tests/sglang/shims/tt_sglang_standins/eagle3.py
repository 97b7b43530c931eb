"""EAGLE-3 speculative decoding on a CPU without sgl_kernel's CPU build (BEYOND-LLAMA.md, 5).

Three things real SGLang 0.5.23 needs here:

1. The ``sgl_kernel`` ``*_cpu`` kernels that speculative decoding really calls. Each SGLang
   module did ``from sgl_kernel import name_cpu`` at import, so the name is bound in that
   module's globals (the ``*_func`` wrappers look it up there at call time): the ports below
   replace it in the module that uses it, not in ``sgl_kernel``. Each is a torch/Python port of
   the Triton original next to it (batch loops: test batches hold a few requests).
2. ``DraftBackendFactory`` entries for ``torch_native``: a plain TorchNativeAttnBackend for draft
   extend; for multi-step draft decode, one backend per step whose decode reads
   ``seq_lens + step + 1`` tokens (topk = 1: each request's draft chain is one contiguous run).
3. Target verify in ``TorchNativeAttnBackend.forward_extend``: a verify batch carries no extend
   lengths. It extends the verified prefix ``seq_lens`` by n = tokens / batch size draft tokens,
   so the KV length is ``seq_lens + n``; with topk = 1 the tree mask is the causal mask.
"""

from __future__ import annotations

import ctypes

# ---------------------------------------------------------------- sgl_kernel *_cpu ports


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """Row ``src_loc[j]`` of every buffer (its base address in ``data_ptrs``, its row size in
    bytes in ``strides``) copied to row ``tgt_loc[j]``. All rows are read before any is
    written, as the Triton kernel loads a tile of rows before it stores them."""
    src = [int(x) for x in src_loc.tolist()]
    tgt = [int(x) for x in tgt_loc.tolist()]
    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        base, stride = int(base), int(stride)
        rows = [ctypes.string_at(base + s * stride, stride) for s in src]
        for t, row in zip(tgt, rows):
            ctypes.memmove(base + t * stride, row, stride)


def assign_draft_cache_locs_contiguous_cpu(req_pool_indices, req_to_token, seq_lens, out_cache_loc,
                                           pool_len, topk, num_cols):
    """Request i's ``topk * num_cols`` KV slots from ``seq_lens[i]`` on, packed per request."""
    n = topk * num_cols
    for i, (r, s) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        out_cache_loc[i * n:(i + 1) * n] = req_to_token[r, s:s + n]


def assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, start_offset, end_offset,
                                 out_cache_loc, pool_len):
    """``req_to_token[req, start:end]`` of each request, laid end to end."""
    pt = 0
    for r, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        out_cache_loc[pt:pt + e - s] = req_to_token[r, s:e]
        pt += e - s


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset,
                                 out_cache_loc, pool_len):
    """The reverse of assign_extend_cache_locs: ``out_cache_loc``'s runs into ``req_to_token``."""
    pt = 0
    for r, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        req_to_token[r, s:e] = out_cache_loc[pt:pt + e - s].to(req_to_token.dtype)
        pt += e - s


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride):
    """Each request's last accepted token (``accept_lens`` counts the bonus token)."""
    flat = accept_tokens.reshape(-1)
    for i, n in enumerate(accept_lens.tolist()):
        bonus_tokens[i] = flat[accept_stride * i + n - 1]


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc):
    """The KV slots of the accepted tokens (``accept_index`` != -1), packed in order."""
    dst = 0
    for src in accept_index.reshape(-1).tolist():
        if src > -1:
            accept_out_cache_loc[dst] = out_cache_loc[src]
            dst += 1


def build_tree_kernel_efficient_cpu(parent_list, selected_index, verified_seq_len, tree_mask, positions,
                                    retrieve_index, retrieve_next_token, retrieve_next_sibling,
                                    topk, depth, draft_token_num, tree_mask_mode):
    """Port of spec_tree.py's ``sgl_build_tree_kernel_efficient_triton``, one request at a
    time: retrieve index/next-token/next-sibling links, positions and the tree mask."""
    import torch

    bs = verified_seq_len.shape[0]
    dn = draft_token_num
    seq = [int(x) for x in verified_seq_len.tolist()]
    prefix = [sum(seq[:b]) for b in range(bs)]
    parents = parent_list.reshape(bs, -1).tolist()
    sel = selected_index.reshape(bs, -1).tolist()
    nxt = retrieve_next_token.reshape(-1).tolist()
    sib = retrieve_next_sibling.reshape(-1).tolist()
    ridx = retrieve_index.reshape(-1).tolist()
    pos = positions.reshape(-1).tolist()
    mask = tree_mask.view(-1)
    full = int(tree_mask_mode) == 0

    def position_of(b, token):
        for pp in range(dn - 1):
            if sel[b][pp] == token:
                return pp
        return None

    for b in range(bs):
        seq_len = seq[b]
        seq_tree_idx = dn * dn * b + prefix[b] * dn
        pos[b * dn] = seq_len
        for i in range(dn - 1, 0, -1):
            ridx[b * dn + i] = b * dn + i
            parent_tb = sel[b][i - 1] // topk
            parent_position = 0
            found = parent_tb == 0
            if not found:
                pp = position_of(b, parents[b][parent_tb])
                if pp is not None:
                    parent_position, found = pp + 1, True
            if found:
                addr = b * dn + parent_position
                if nxt[addr] != -1:
                    sib[b * dn + i] = nxt[addr]
                nxt[addr] = i
        ridx[b * dn] = b * dn
        for x in range(dn):
            if full:
                t = seq_tree_idx + (seq_len + dn) * x + seq_len + 1
            else:
                t = dn * dn * b + dn * x + 1
            mask[t - 1] = True
            mask[t:t + dn - 1] = False
            if x > 0:
                cur, position = x - 1, 0
                for _ in range(depth):
                    position += 1
                    mask[t + cur] = True
                    parent_tb = sel[b][cur] // topk
                    if parent_tb == 0:
                        break
                    cp = position_of(b, parents[b][parent_tb])
                    if cp is None:
                        break
                    cur = cp
                pos[b * dn + x] = position + seq_len
    for tensor, values in ((retrieve_next_token, nxt), (retrieve_next_sibling, sib),
                           (retrieve_index, ridx), (positions, pos)):
        tensor.view(-1).copy_(torch.tensor(values, dtype=tensor.dtype))


def verify_tree_greedy_cpu(predicts, accept_index, accept_token_num, candidates, retrive_index,
                           retrive_next_token, retrive_next_sibling, target_predict):
    """Port of spec_tree.py's ``verify_tree_greedy_kernel_triton``: walk each request's tree,
    accepting a draft token where it equals the target's prediction at its parent."""
    bs, dn = candidates.shape[0], candidates.shape[1]
    ns = accept_index.shape[1]
    cand = candidates.reshape(-1).tolist()
    ridx = retrive_index.reshape(-1).tolist()
    nxt = retrive_next_token.reshape(-1).tolist()
    sib = retrive_next_sibling.reshape(-1).tolist()
    target = target_predict.reshape(-1).tolist()
    pred = predicts.view(-1)
    acc = accept_index.view(-1)
    for b in range(bs):
        last = ridx[b * dn]
        acc[b * ns] = last
        n_acc, cur = 0, 0
        for _ in range(1, ns):
            cur = nxt[b * dn + cur]
            want = target[last]
            matched = False
            while cur != -1:
                if cand[b * dn + cur] == want:
                    pred[last] = want
                    n_acc += 1
                    acc[b * ns + n_acc] = ridx[b * dn + cur]
                    last = ridx[b * dn + cur]
                    matched = True
                    break
                cur = sib[b * dn + cur]
            if not matched:
                break
        accept_token_num[b] = n_acc
        pred[last] = target[last]


def _bind(**ports):
    def apply(module):
        for name, fn in ports.items():
            setattr(module, name, fn)

    return apply


# ---------------------------------------------------------------- attention backends


def _step_backend_class(base):
    class TorchNativeDraftStepBackend(base):
        """Draft decode step ``step`` of a multi-step draft: the request's prefix plus the
        ``step + 1`` draft tokens written so far."""

        step_seq_lens = None

        def _run_sdpa_forward_decode(self, query, output, k_cache, v_cache, req_to_token,
                                     req_pool_indices, seq_lens, *args, **kwargs):
            if self.step_seq_lens is not None:
                seq_lens = self.step_seq_lens
            return super()._run_sdpa_forward_decode(query, output, k_cache, v_cache, req_to_token,
                                                    req_pool_indices, seq_lens, *args, **kwargs)

    return TorchNativeDraftStepBackend


class TorchNativeMultiStepDraftBackend:
    """One TorchNativeAttnBackend per draft decode step (topk = 1)."""

    def __init__(self, model_runner, topk, speculative_num_steps):
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

        if topk != 1:
            raise ValueError(f"the torch_native EAGLE draft stand-in supports topk=1, not {topk}")
        cls = _step_backend_class(TorchNativeAttnBackend)
        self.topk = topk
        self.speculative_num_steps = speculative_num_steps
        self.attn_backends = [cls(model_runner) for _ in range(speculative_num_steps - 1)]

    def init_forward_metadata(self, forward_batch):
        for step, backend in enumerate(self.attn_backends):
            backend.init_forward_metadata(forward_batch)
            backend.step_seq_lens = forward_batch.seq_lens + step + 1


def _patch_draft_factory(module):
    cls = module.DraftBackendFactory
    create_decode, create_extend = cls.create_decode_backend, cls.create_draft_extend_backend

    def is_torch_native(self, which):
        from sglang.srt.runtime_context import attention_backends

        prefill, decode = attention_backends()
        return (self.draft_attn_backend or (decode if which == "decode" else prefill)) == "torch_native"

    def create_decode_backend(self):
        if self.speculative_num_steps > 1 and self.qsa_profile is None and is_torch_native(self, "decode"):
            backend = TorchNativeMultiStepDraftBackend(self.draft_model_runner, self.topk,
                                                       self.speculative_num_steps)
            for child in backend.attn_backends:
                child.prefill_attention_backend_str = child.decode_attention_backend_str = "torch_native"
            return backend
        return create_decode(self)

    def create_draft_extend_backend(self):
        if self.qsa_profile is None and is_torch_native(self, "prefill"):
            from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

            backend = TorchNativeAttnBackend(self.draft_model_runner)
            backend.prefill_attention_backend_str = backend.decode_attention_backend_str = "torch_native"
            return backend
        return create_extend(self)

    cls.create_decode_backend = create_decode_backend
    cls.create_draft_extend_backend = create_draft_extend_backend


def _patch_target_verify(module):
    cls = module.TorchNativeAttnBackend
    forward_extend = cls.forward_extend

    def forward_extend_or_verify(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        mode = forward_batch.forward_mode
        if forward_batch.extend_prefix_lens is None and mode.is_target_verify():
            import copy

            import torch

            bs = forward_batch.batch_size
            n = q.shape[0] // bs
            prefix = forward_batch.seq_lens
            verify = copy.copy(forward_batch)  # shallow: only the lengths differ
            verify.extend_prefix_lens = prefix
            verify.extend_seq_lens = torch.full_like(prefix, n)
            verify.seq_lens = prefix + n
            return forward_extend(self, q, k, v, layer, verify, save_kv_cache)
        return forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache)

    cls.forward_extend = forward_extend_or_verify


PATCHES = {
    "sglang.kernels.ops.kvcache.cache_move": _bind(copy_all_layer_kv_cache_cpu=copy_all_layer_kv_cache_cpu),
    "sglang.kernels.ops.speculative.cache_locs": _bind(
        assign_draft_cache_locs_contiguous_cpu=assign_draft_cache_locs_contiguous_cpu,
        assign_extend_cache_locs_cpu=assign_extend_cache_locs_cpu),
    "sglang.srt.mem_cache.allocation": _bind(assign_req_to_token_pool_cpu=assign_req_to_token_pool_cpu),
    "sglang.kernels.ops.speculative.spec_tree": _bind(
        sgl_build_tree_kernel_efficient_cpu=build_tree_kernel_efficient_cpu,
        sgl_verify_tree_greedy_cpu=verify_tree_greedy_cpu),
    "sglang.kernels.ops.speculative.eagle": _bind(fill_bonus_tokens_cpu=fill_bonus_tokens_cpu,
                                                  fill_accept_out_cache_loc_cpu=fill_accept_out_cache_loc_cpu),
    "sglang.srt.speculative.draft_utils": _patch_draft_factory,
    "sglang.srt.layers.attention.torch_native_backend": _patch_target_verify,
}
