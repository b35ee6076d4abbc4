"""What a graph is: types, symbolic dims, tensors, ops (the op schema is their single source), graphs.

Importing this package imports `ops`, which attaches the operator sugar (+, -, *, /, @) to `Tensor`."""

from ggml_py.ir import ops as ops
