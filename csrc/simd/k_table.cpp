// The kernel table of one ISA level.
#include "isa.h"

namespace gp {
namespace GP_NS {

static KernelTable make_table() {
    KernelTable t;
    memset(&t, 0, sizeof t);
#if GP_AVX512
    t.name = "avx512";
#elif GP_AVX2
    t.name = "avx2";
#else
    t.name = "scalar";
#endif
    t.ops[GGML_PY_OP_GET_ROWS] = k_get_rows;
    t.ops[GGML_PY_OP_SET_ROWS] = k_set_rows;
    t.ops[GGML_PY_OP_ADD] = t.ops[GGML_PY_OP_SUB] = t.ops[GGML_PY_OP_MUL] = t.ops[GGML_PY_OP_DIV] = k_binary;
    const int unary[] = {GGML_PY_OP_SCALE, GGML_PY_OP_SQR, GGML_PY_OP_SQRT, GGML_PY_OP_NEG, GGML_PY_OP_ABS, GGML_PY_OP_EXP, GGML_PY_OP_LOG,
                         GGML_PY_OP_SILU, GGML_PY_OP_GELU, GGML_PY_OP_RELU, GGML_PY_OP_TANH, GGML_PY_OP_SIGMOID, GGML_PY_OP_CLAMP};
    for (int op : unary) t.ops[op] = k_unary;
    t.ops[GGML_PY_OP_SWIGLU] = t.ops[GGML_PY_OP_GEGLU] = k_glu;
    t.ops[GGML_PY_OP_NORM] = k_norm;
    t.ops[GGML_PY_OP_RMS_NORM] = k_rms_norm;
    t.ops[GGML_PY_OP_MUL_MAT] = k_mul_mat;
    t.ops[GGML_PY_OP_SOFT_MAX] = k_soft_max;
    t.ops[GGML_PY_OP_ROPE] = k_rope;
    t.ops[GGML_PY_OP_DIAG_MASK_INF] = k_diag_mask_inf;
    t.ops[GGML_PY_OP_FLASH_ATTN_EXT] = k_flash_attn_ext;
    t.ops[GGML_PY_OP_CPY] = t.ops[GGML_PY_OP_CONT] = k_cpy;
    t.ops[GGML_PY_OP_CONCAT] = k_concat;
    t.ops[GGML_PY_OP_SUM_ROWS] = t.ops[GGML_PY_OP_MEAN] = k_sum_rows;
    t.ops[GGML_PY_OP_ARGMAX] = k_argmax;
    t.ops[GGML_PY_OP_TOP_K] = k_top_k;
    t.ops[GGML_PY_OP_REPEAT] = k_repeat;
    t.ops[GGML_PY_OP_PAD] = k_pad;
    t.stream_read = stream_read;
    t.dequantize_row = dequantize_row;
    t.quantize_row = quantize_row_ref;
    t.uses_repack = GP_AVX2 != 0;
    return t;
}

const KernelTable* table() {
    static const KernelTable t = make_table();
    return &t;
}

}  // namespace GP_NS
}  // namespace gp
