import gguf.quants as q

import ggml_py.dtypes as d


def quantize(x, t): return q.quantize(x, d.get(t).ggml_id)
def dequantize(x, t): return q.dequantize(x, d.get(t).ggml_id)
