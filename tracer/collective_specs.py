"""What tracer/collectives.py needs to know of each c10d collective (its parameters, which hold
its input and output tensors, whether it reduces), how its record's layout is built, and the
rows an all_reduce's inputs are nonzero in."""

from __future__ import annotations

import torch

from tensor_trace.tracer import host_values

# op -> (parameter names, input tensors, output tensors, has reduce op, async from argument)
C10D_SPECS = {
    "all_reduce": (("tensor", "op", "group", "async_op"), "tensor", "tensor", True),
    "reduce_scatter": (("output", "input_list", "op", "group", "async_op"), "input_list", "output", True),
    "reduce_scatter_tensor": (("output", "input", "op", "group", "async_op"), "input", "output", True),
    "reduce_scatter_single": (("output", "input", "op", "group", "async_op"), "input", "output", True),
    "_reduce_scatter_base": (("output", "input", "op", "group", "async_op"), "input", "output", True),
    "all_gather": (("tensor_list", "tensor", "group", "async_op"), "tensor", "tensor_list", False),
    "all_gather_into_tensor": (("output_tensor", "input_tensor", "group", "async_op"), "input_tensor",
                               "output_tensor", False),
    "all_gather_single": (("output_tensor", "input_tensor", "group", "async_op"), "input_tensor",
                          "output_tensor", False),
    "all_reduce_coalesced": (("tensors", "op", "group", "async_op"), "tensors", "tensors", True),
    "_all_gather_base": (("output_tensor", "input_tensor", "group", "async_op"), "input_tensor",
                         "output_tensor", False),
    "all_gather_object": (("object_list", "obj", "group"), None, None, False),
    "all_to_all": (("output_tensor_list", "input_tensor_list", "group", "async_op"), "input_tensor_list",
                   "output_tensor_list", False),
    "all_to_all_single": (("output", "input", "output_split_sizes", "input_split_sizes", "group",
                           "async_op"), "input", "output", False),
    "broadcast": (("tensor", "src", "group", "async_op"), "tensor", "tensor", False),
    "reduce": (("tensor", "dst", "op", "group", "async_op"), "tensor", "tensor", True),
    "gather": (("tensor", "gather_list", "dst", "group", "async_op"), "tensor", "gather_list", False),
    "scatter": (("tensor", "scatter_list", "src", "group", "async_op"), "scatter_list", "tensor", False),
    "barrier": (("group", "async_op"), None, None, False),
    "send": (("tensor", "dst", "group", "tag"), "tensor", None, False),
    "recv": (("tensor", "src", "group", "tag"), None, "tensor", False),
    "isend": (("tensor", "dst", "group", "tag"), "tensor", None, False),
    "irecv": (("tensor", "src", "group", "tag"), None, "tensor", False),
}
ALWAYS_ASYNC = {"isend", "irecv"}
REDUCING = {name for name, spec in C10D_SPECS.items() if spec[3]}

def reduce_op_name(op) -> str:
    """A reduce op (a ReduceOp, its name, None for sum) as written in the trace."""
    if op is None:
        return "sum"
    if isinstance(op, str):
        return op.lower()
    name = getattr(op, "name", None)
    if name is None:
        name = str(op).rsplit(".", 1)[-1]
    return str(name).lower()


def layout_of(tracer, writer, inputs, outputs, key: int) -> tuple:
    """(layout id, bytes of the inputs, else of the outputs) of a collective's tensors, read in
    Python; kept under ``key`` (tracer/native.py's call_key of the inputs at positions 0.. and the outputs as
    items of a list result: one int for the metadata of all of them, read in C) when it is one
    (>= 0), so that a collective of a layout seen before in this rank file reads no shape, dtype
    or device in Python (the fourteen collectives of a TP step each made six such reads, three
    f-strings and a nested tuple's hash)."""
    slots = [(f"input.{i}", t) for i, t in enumerate(inputs)]
    slots += [(f"output.{i}", t) for i, t in enumerate(outputs)]
    # (a recv has no input: what it moved is its output)
    hit = (writer.layout(tuple([(s, t.shape, t.dtype, t.device) for s, t in slots])),
           sum(t.numel() * t.element_size() for t in (inputs or outputs)))
    if key >= 0:
        tracer.layouts.coll[key] = hit
    return hit


# All_reduces whose inputs may be zero-padded slices (a gather done as a sum, as SGLang's DP
# attention does): the rows each rank's input is nonzero in tell a gather from a reduction.
ROW_CHECKED = {"all_reduce", "all_reduce_", "all_reduce_coalesced"}


def nonzero_rows(inputs):
    """Per input tensor ``[first, last, count]`` of its dim-0 rows holding a nonzero value
    (``[0, 0, 0]`` when none), for CPU tensors only: on a GPU the answer would need a device
    sync inside the collective's call. None when there is nothing to say."""
    out = []
    native = host_values.native_rows  # (None until the extension is built)
    for t in inputs:
        rows = native(t) if native is not None else None  # (None: a tensor it does not read)
        if rows is not None:
            out.append(rows)
            continue
        if type(t) is not torch.Tensor or t.device.type != "cpu" or t.dim() == 0 or t.numel() == 0 \
                or t.is_complex() or t.layout is not torch.strided:
            return None
        rows = host_values.nonzero_rows(t)  # (numpy: about 9 us against 84 for these torch ops)
        if rows is None:
            nz = torch.nonzero(t.reshape(t.shape[0], -1).ne(0).any(1)).flatten()
            n = int(nz.numel())
            rows = [int(nz[0]), int(nz[-1]), n] if n else [0, 0, 0]
        out.append(rows)
    return out or None
