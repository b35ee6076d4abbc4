// The kernel table of one ISA level.
#include "isa.h"

namespace gp {
namespace GP_NS {

// The kernel of each op. The ops of a family share their family's kernel, which dispatches on the op (its cases
// come from the same lists); every other op is named once here. nullptr: no kernel, which make_table refuses at
// compile time for every op of the schema (GGML_PY_OPS_COMPUTE).
static constexpr KernelFn kernel_of(int op) {
    switch (op) {
        GGML_PY_OPS_BINARY(GP_OP_CASE) return k_binary;
        GGML_PY_OPS_UNARY(GP_OP_CASE) case GGML_PY_OP_SCALE: case GGML_PY_OP_CLAMP: return k_unary;
        GGML_PY_OPS_GLU(GP_OP_CASE) return k_glu;
        case GGML_PY_OP_GET_ROWS: return k_get_rows;
        case GGML_PY_OP_SET_ROWS: return k_set_rows;
        case GGML_PY_OP_NORM: return k_norm;
        case GGML_PY_OP_RMS_NORM: return k_rms_norm;
        case GGML_PY_OP_MUL_MAT: return k_mul_mat;
        case GGML_PY_OP_SOFT_MAX: return k_soft_max;
        case GGML_PY_OP_ROPE: return k_rope;
        case GGML_PY_OP_DIAG_MASK_INF: return k_diag_mask_inf;
        case GGML_PY_OP_FLASH_ATTN_EXT: return k_flash_attn_ext;
        case GGML_PY_OP_CPY: case GGML_PY_OP_CONT: return k_cpy;
        case GGML_PY_OP_CONCAT: return k_concat;
        case GGML_PY_OP_SUM_ROWS: case GGML_PY_OP_MEAN: return k_sum_rows;
        case GGML_PY_OP_ARGMAX: return k_argmax;
        case GGML_PY_OP_TOP_K: return k_top_k;
        case GGML_PY_OP_REPEAT: return k_repeat;
        case GGML_PY_OP_PAD: return k_pad;
        default: return nullptr;
    }
}

static KernelTable make_table() {
    KernelTable t;
    memset(&t, 0, sizeof t);
    t.name = GP_LEVEL_NAME;
#define GP_KERNEL(NAME)                                                                                             \
    static_assert(kernel_of(GGML_PY_OP_##NAME) != nullptr, #NAME ": no kernel (csrc/simd/k_table.cpp, kernel_of)"); \
    t.ops[GGML_PY_OP_##NAME] = kernel_of(GGML_PY_OP_##NAME);
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
