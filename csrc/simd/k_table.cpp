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
    t.ops[OP_GET_ROWS] = k_get_rows;
    t.ops[OP_SET_ROWS] = k_set_rows;
    t.ops[OP_ADD] = t.ops[OP_SUB] = t.ops[OP_MUL] = t.ops[OP_DIV] = k_binary;
    const int unary[] = {OP_SCALE, OP_SQR, OP_SQRT, OP_NEG, OP_ABS, OP_EXP, OP_LOG,
                         OP_SILU, OP_GELU, OP_RELU, OP_TANH, OP_SIGMOID, OP_CLAMP};
    for (int op : unary) t.ops[op] = k_unary;
    t.ops[OP_SWIGLU] = t.ops[OP_GEGLU] = k_glu;
    t.ops[OP_NORM] = k_norm;
    t.ops[OP_RMS_NORM] = k_rms_norm;
    t.ops[OP_MUL_MAT] = k_mul_mat;
    t.ops[OP_SOFT_MAX] = k_soft_max;
    t.ops[OP_ROPE] = k_rope;
    t.ops[OP_DIAG_MASK_INF] = k_diag_mask_inf;
    t.ops[OP_FLASH_ATTN_EXT] = k_flash_attn_ext;
    t.ops[OP_CPY] = t.ops[OP_DUP] = t.ops[OP_CONT] = k_cpy;
    t.ops[OP_CONCAT] = k_concat;
    t.ops[OP_SUM_ROWS] = t.ops[OP_MEAN] = k_sum_rows;
    t.ops[OP_ARGMAX] = k_argmax;
    t.ops[OP_REPEAT] = k_repeat;
    t.ops[OP_PAD] = k_pad;
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
