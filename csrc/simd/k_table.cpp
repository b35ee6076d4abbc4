// The kernel table of one ISA level.
#include "isa.h"

namespace gp {
namespace GP_NS {

// The kernels of this level, once: an id each (for compile-time checks: a function's address is not a constant
// expression under UBSan when the function is defined in another file) and the function itself.
#define GP_KERNELS(X)                                                                                              \
    X(binary) X(unary) X(glu) X(get_rows) X(set_rows) X(norm) X(rms_norm) X(mul_mat) X(mul_mat_id) X(soft_max)  \
    X(rope) X(diag_mask_inf) X(flash_attn_ext) X(cpy) X(concat) X(sum_rows) X(argmax) X(top_k) X(repeat) X(pad)
enum KernelId {
    K_none,
#define GP_KERNEL_ID(NAME) K_##NAME,
    GP_KERNELS(GP_KERNEL_ID)
#undef GP_KERNEL_ID
};
static const KernelFn KERNELS[] = {
    nullptr,
#define GP_KERNEL_FN(NAME) k_##NAME,
    GP_KERNELS(GP_KERNEL_FN)
#undef GP_KERNEL_FN
};

// The kernel of each op. The ops of a family share their family's kernel, which dispatches on the op (its cases
// come from the same lists); every other op is named once here. K_none: no kernel, which make_table refuses at
// compile time for every op of the schema (GGML_PY_OPS_COMPUTE).
static constexpr KernelId kernel_of(int op) {
    switch (op) {
        GGML_PY_OPS_BINARY(GP_OP_CASE) return K_binary;
        GGML_PY_OPS_UNARY(GP_OP_CASE) case GGML_PY_OP_SCALE: case GGML_PY_OP_CLAMP: return K_unary;
        GGML_PY_OPS_GLU(GP_OP_CASE) return K_glu;
        case GGML_PY_OP_GET_ROWS: return K_get_rows;
        case GGML_PY_OP_SET_ROWS: return K_set_rows;
        case GGML_PY_OP_NORM: return K_norm;
        case GGML_PY_OP_RMS_NORM: return K_rms_norm;
        case GGML_PY_OP_MUL_MAT: return K_mul_mat;
        case GGML_PY_OP_MUL_MAT_ID: return K_mul_mat_id;
        case GGML_PY_OP_SOFT_MAX: return K_soft_max;
        case GGML_PY_OP_ROPE: return K_rope;
        case GGML_PY_OP_DIAG_MASK_INF: return K_diag_mask_inf;
        case GGML_PY_OP_FLASH_ATTN_EXT: return K_flash_attn_ext;
        case GGML_PY_OP_CPY: case GGML_PY_OP_CONT: return K_cpy;
        case GGML_PY_OP_CONCAT: return K_concat;
        case GGML_PY_OP_SUM_ROWS: case GGML_PY_OP_MEAN: return K_sum_rows;
        case GGML_PY_OP_ARGMAX: return K_argmax;
        case GGML_PY_OP_TOP_K: return K_top_k;
        case GGML_PY_OP_REPEAT: return K_repeat;
        case GGML_PY_OP_PAD: return K_pad;
        default: return K_none;
    }
}

static KernelTable make_table() {
    KernelTable t;
    memset(&t, 0, sizeof t);
    t.name = GP_LEVEL_NAME;
#define GP_KERNEL(NAME)                                                                                             \
    static_assert(kernel_of(GGML_PY_OP_##NAME) != K_none, #NAME ": no kernel (csrc/simd/k_table.cpp, kernel_of)"); \
    t.ops[GGML_PY_OP_##NAME] = KERNELS[kernel_of(GGML_PY_OP_##NAME)];
    GGML_PY_OPS_COMPUTE(GP_KERNEL)
#undef GP_KERNEL
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
