// Node validation: what the kernels accept (types, shapes, layouts), checked before a plan is built and by
// supports_op; any failure is a message naming the op, never a crash.
#include <sstream>

#include "runtime.h"

namespace gp {

std::string shape_str(const Tensor& t) {
    std::ostringstream o;
    o << "[" << t.ne[0] << "," << t.ne[1] << "," << t.ne[2] << "," << t.ne[3] << "]";
    return o.str();
}

static bool same_shape(const Tensor& a, const Tensor& b) {
    for (int i = 0; i < 4; ++i)
        if (a.ne[i] != b.ne[i]) return false;
    return true;
}
static bool tiles(const Tensor& small, const Tensor& big) {  // each dim of small divides big's
    for (int i = 0; i < 4; ++i) {
        if (small.ne[i] == 0) {
            if (big.ne[i] != 0) return false;
            continue;
        }
        if (big.ne[i] % small.ne[i]) return false;
    }
    return true;
}
static bool is_float_storage(int t) { return t == T_F32 || t == T_F16 || t == T_BF16; }
static bool is_weight_type(int t) {
    return is_float_storage(t) || t == T_Q4_0 || t == T_Q4_1 || t == T_Q5_0 || t == T_Q5_1 || t == T_Q8_0 ||
           t == T_Q2_K || t == T_Q3_K || t == T_Q4_K || t == T_Q5_K || t == T_Q6_K || t == T_IQ4_NL || t == T_IQ4_XS;
}

std::string validate_node(const Node& n) {
    const char* op = (n.op > 0 && n.op < GGML_PY_OP_COUNT) ? op_name(n.op) : "?";
    auto fail = [&](const std::string& m) { return std::string(op) + ": " + m; };
    if (n.op <= 0 || n.op >= GGML_PY_OP_COUNT) return "unknown op code " + std::to_string(n.op);
    // generic tensor checks
    auto check_t = [&](const Tensor& t, const char* role) -> std::string {
        if (type_size(t.type) == 0) return fail(std::string(role) + " has unsupported type id " + std::to_string(t.type));
        for (int i = 0; i < 4; ++i) {
            if (t.ne[i] < 0 || t.ne[i] > ((int64_t)1 << 40)) return fail(std::string(role) + " has a bad dimension " + shape_str(t));
            if (t.nb[i] < 0 || t.nb[i] > ((int64_t)1 << 44)) return fail(std::string(role) + " has a bad stride");
        }
        if (type_is_quant(t.type)) {
            if (t.ne[0] % type_block(t.type)) return fail(std::string(role) + " row length is not a multiple of the block size");
            if (t.nb[0] != type_size(t.type)) return fail(std::string(role) + " quantized rows must be contiguous");
        }
        if (tensor_extent(t) < 0) return fail(std::string(role) + " is too large");
        return "";
    };
    std::string e = check_t(n.dst, "dst");
    if (!e.empty()) return e;
    static const char* names[4] = {"src0", "src1", "src2", "src3"};
    for (int i = 0; i < MAX_SRC; ++i) {
        if (!n.has[i]) continue;
        e = check_t(n.src[i], names[i]);
        if (!e.empty()) return e;
    }
    const Tensor& d = n.dst;
    const Tensor& a = n.src[0];
    const Tensor& b = n.src[1];
    auto need = [&](int count) -> bool {
        for (int i = 0; i < count; ++i)
            if (!n.has[i]) return false;
        return true;
    };
    auto f32 = [](const Tensor& t) { return t.type == T_F32; };
    switch (n.op) {
        case GGML_PY_OP_GET_ROWS:
            if (!need(2)) return fail("needs 2 sources");
            if (!(is_weight_type(a.type) || a.type == T_I32)) return fail("unsupported source type");
            if (b.type != T_I32 && b.type != T_I64) return fail("indices must be I32/I64");
            if (a.type == T_I32 ? d.type != T_I32 : d.type != T_F32) return fail("bad dst type");
            if (d.ne[0] != a.ne[0] || d.ne[1] != b.ne[0] || d.ne[2] != b.ne[1] || d.ne[3] != b.ne[2] || b.ne[3] != 1 ||
                a.ne[2] != b.ne[1] || a.ne[3] != b.ne[2])
                return fail("shapes " + shape_str(a) + " " + shape_str(b) + " -> " + shape_str(d) + " do not fit");
            return "";
        case GGML_PY_OP_SET_ROWS:
            if (!need(2)) return fail("needs 2 sources (rows, indices)");
            if (!type_is_cpy_dst(d.type)) return fail("unsupported destination type");
            if (!f32(a)) return fail("rows must be F32");
            if (b.type != T_I32 && b.type != T_I64) return fail("indices must be I32/I64");
            if (a.ne[0] != d.ne[0] || b.ne[0] != a.ne[1] || a.ne[2] != d.ne[2] || a.ne[3] != d.ne[3] || b.ne[3] != 1)
                return fail("shapes " + shape_str(a) + " " + shape_str(b) + " -> " + shape_str(d) + " do not fit");
            if ((b.ne[1] == 0 || a.ne[2] % b.ne[1]) && a.ne[2]) return fail("index broadcast does not fit");
            if ((b.ne[2] == 0 || a.ne[3] % b.ne[2]) && a.ne[3]) return fail("index broadcast does not fit");
            return "";
        GGML_PY_OPS_BINARY(GP_OP_CASE)
            if (!need(2)) return fail("needs 2 sources");
            if (!f32(a) || !f32(b) || !f32(d)) return fail("only F32");
            if (!same_shape(a, d)) return fail("dst shape differs from src0");
            if (!tiles(b, a)) return fail("src1 " + shape_str(b) + " does not tile src0 " + shape_str(a));
            return "";
        GGML_PY_OPS_UNARY(GP_OP_CASE)
        case GGML_PY_OP_SCALE: case GGML_PY_OP_CLAMP: case GGML_PY_OP_NORM: case GGML_PY_OP_RMS_NORM:
        case GGML_PY_OP_DIAG_MASK_INF:
            if (!need(1)) return fail("needs a source");
            if (!f32(a) || !f32(d)) return fail("only F32");
            if (!same_shape(a, d)) return fail("dst shape differs from src0");
            return "";
        GGML_PY_OPS_GLU(GP_OP_CASE)
            if (!need(1)) return fail("needs a source");
            if (!f32(a) || !f32(d) || (n.has[1] && !f32(b))) return fail("only F32");
            if (n.has[1]) {
                if (!same_shape(a, d) || !same_shape(b, d)) return fail("gate, value and dst must have one shape");
            } else {
                if (a.ne[0] != 2 * d.ne[0] || a.ne[1] != d.ne[1] || a.ne[2] != d.ne[2] || a.ne[3] != d.ne[3])
                    return fail("src0 must be twice as wide as dst");
            }
            return "";
        case GGML_PY_OP_MUL_MAT:
            if (!need(2)) return fail("needs 2 sources");
            if (!is_weight_type(a.type)) return fail("unsupported weight type");
            if (!f32(b) || !f32(d)) return fail("activations and dst must be F32");
            if (a.nb[0] != type_size(a.type)) return fail("weight rows must be contiguous");
            if (d.nb[0] != 4) return fail("dst rows must be contiguous");
            if (a.ne[0] != b.ne[0]) return fail("inner dimensions differ");
            if (d.ne[0] != a.ne[1] || d.ne[1] != b.ne[1] || d.ne[2] != b.ne[2] || d.ne[3] != b.ne[3])
                return fail("dst " + shape_str(d) + " does not fit " + shape_str(a) + " x " + shape_str(b));
            if (a.ne[2] == 0 || a.ne[3] == 0 || b.ne[2] % a.ne[2] || b.ne[3] % a.ne[3])
                return fail("weight batch dims must divide the activation batch dims");
            return "";
        case GGML_PY_OP_MUL_MAT_ID: {
            if (!need(3)) return fail("needs 3 sources (expert weights, activations, ids)");
            const Tensor& ids = n.src[2];
            if (!is_weight_type(a.type)) return fail("unsupported weight type");
            if (!f32(b) || !f32(d)) return fail("activations and dst must be F32");
            if (ids.type != T_I32) return fail("ids must be I32");
            if (a.nb[0] != type_size(a.type)) return fail("weight rows must be contiguous");
            if (d.nb[0] != 4) return fail("dst rows must be contiguous");
            if (a.ne[0] != b.ne[0]) return fail("inner dimensions differ");
            if (a.ne[2] < 1 || a.ne[3] != 1 || b.ne[3] != 1 || ids.ne[2] != 1 || ids.ne[3] != 1)
                return fail("expects weights [K, M, E], activations [K, S, T] and ids [k, T]");
            if (ids.ne[1] != b.ne[2]) return fail("ids need one row per token of the activations");
            if (b.ne[1] == 0 || ids.ne[0] % b.ne[1]) return fail("activation rows per token must divide ids' k");
            if (d.ne[0] != a.ne[1] || d.ne[1] != ids.ne[0] || d.ne[2] != b.ne[2] || d.ne[3] != 1)
                return fail("dst " + shape_str(d) + " does not fit " + shape_str(a) + " x " + shape_str(b));
            return "";
        }
        case GGML_PY_OP_SOFT_MAX:
            if (!need(1)) return fail("needs a source");
            if (!f32(a) || !f32(d)) return fail("only F32");
            if (!same_shape(a, d)) return fail("dst shape differs from src0");
            if (n.has[1]) {
                if (b.type != T_F32 && b.type != T_F16) return fail("mask must be F32/F16");
                if (b.ne[0] != a.ne[0] || b.ne[1] < a.ne[1]) return fail("mask " + shape_str(b) + " too small for " + shape_str(a));
                if (b.ne[2] == 0 || b.ne[3] == 0 || a.ne[2] % b.ne[2] || a.ne[3] % b.ne[3]) return fail("mask broadcast does not fit");
            }
            return "";
        case GGML_PY_OP_ROPE:
            if (!need(2)) return fail("needs 2 sources");
            if (!f32(a) || !f32(d)) return fail("only F32");
            if (!same_shape(a, d)) return fail("dst shape differs from src0");
            if (b.type != T_I32 || b.ne[0] != a.ne[2] || b.ne[1] != 1 || b.ne[2] != 1 || b.ne[3] != 1)
                return fail("positions must be I32 [n_tokens]");
        {
            const int32_t n_dims = n.params.i[GGML_PY_P_ROPE_N_DIMS], mode = n.params.i[GGML_PY_P_ROPE_MODE];
            if (n_dims <= 0 || n_dims % 2 || n_dims > a.ne[0]) return fail("bad n_dims");
            if (mode != 0 && mode != 2) return fail("only modes 0 (normal) and 2 (neox)");
            if (n.has[2]) {
                const Tensor& ff = n.src[2];
                if (!f32(ff) || ff.ne[0] != n_dims / 2 || ff.ne[1] != 1 || ff.ne[2] != 1 || ff.ne[3] != 1)
                    return fail("freq_factors must be F32 [n_dims/2], got " + shape_str(ff));
            }
        }
            return "";
        case GGML_PY_OP_FLASH_ATTN_EXT: {
            if (!need(3)) return fail("needs q, k, v");
            const Tensor& k = n.src[1];
            const Tensor& v = n.src[2];
            if (!f32(a) || !f32(d)) return fail("q and dst must be F32");
            if ((k.type != T_F16 && k.type != T_F32) || (v.type != T_F16 && v.type != T_F32)) return fail("k, v must be F16/F32");
            if (a.ne[0] != k.ne[0] || k.ne[1] != v.ne[1] || k.ne[2] != v.ne[2] || a.ne[3] != k.ne[3] || a.ne[3] != v.ne[3])
                return fail("q " + shape_str(a) + " k " + shape_str(k) + " v " + shape_str(v) + " do not fit");
            if (k.ne[2] == 0 || a.ne[2] % k.ne[2]) return fail("q heads must be a multiple of kv heads");
            if (d.ne[0] != v.ne[0] || d.ne[1] != a.ne[2] || d.ne[2] != a.ne[1] || d.ne[3] != a.ne[3])
                return fail("dst " + shape_str(d) + " does not fit");
            if (n.has[3]) {
                const Tensor& m = n.src[3];
                if (m.type != T_F16 && m.type != T_F32) return fail("mask must be F16/F32");
                if (m.ne[0] != k.ne[1] || m.ne[1] < a.ne[1]) return fail("mask " + shape_str(m) + " too small");
                if (m.ne[2] == 0 || m.ne[3] == 0 || a.ne[2] % m.ne[2] || a.ne[3] % m.ne[3]) return fail("mask broadcast does not fit");
            }
            return "";
        }
        case GGML_PY_OP_CPY: case GGML_PY_OP_CONT:
            if (!need(1)) return fail("needs a source");
            if (!(is_float_storage(a.type) || a.type == T_I32)) return fail("unsupported source type");
            if (!type_is_cpy_dst(d.type) && d.type != T_I32) return fail("unsupported destination type");
            if ((a.type == T_I32) != (d.type == T_I32)) return fail("I32 copies only to I32");
            if (type_is_quant(d.type) && a.type != T_F32 && a.type != T_F16) return fail("only F32/F16 can be quantized");
            if (nelements(a) != nelements(d)) return fail("element counts differ");
            return "";
        case GGML_PY_OP_CONCAT: {
            if (!need(2)) return fail("needs 2 sources");
            if (a.type != d.type || b.type != d.type || type_is_quant(d.type)) return fail("types differ");
            const int dim = n.params.i[GGML_PY_P_CONCAT_AXIS];
            if (dim < 0 || dim > 3) return fail("bad dim");
            for (int i = 0; i < 4; ++i) {
                if (i == dim) {
                    if (d.ne[i] != a.ne[i] + b.ne[i]) return fail("dst size along dim is not the sum");
                } else if (a.ne[i] != d.ne[i] || b.ne[i] != d.ne[i]) {
                    return fail("shapes differ outside dim");
                }
            }
            return "";
        }
        case GGML_PY_OP_SUM_ROWS: case GGML_PY_OP_MEAN:
            if (!need(1)) return fail("needs a source");
            if (!f32(a) || !f32(d)) return fail("only F32");
            if (d.ne[0] != 1 || d.ne[1] != a.ne[1] || d.ne[2] != a.ne[2] || d.ne[3] != a.ne[3]) return fail("dst shape must be [1, ...]");
            return "";
        case GGML_PY_OP_ARGMAX:
            if (!need(1)) return fail("needs a source");
            if (!f32(a) || d.type != T_I32) return fail("F32 -> I32");
            if (!is_contiguous(d)) return fail("dst must be contiguous");
            if (nelements(d) != nrows(a)) return fail("dst must have one element per row");
            if (a.ne[0] == 0 && nrows(a) > 0) return fail("empty rows");
            return "";
        case GGML_PY_OP_TOP_K:
            if (!need(1)) return fail("needs a source");
            if (!f32(a) || d.type != T_I32) return fail("F32 -> I32");
            if (!is_contiguous(d)) return fail("dst must be contiguous");
            if (d.ne[0] != n.params.i[GGML_PY_P_TOP_K_K] || d.ne[0] < 1 || d.ne[0] > a.ne[0]) return fail("k must be in 1..ne0 and dst ne0");
            if (d.ne[1] != a.ne[1] || d.ne[2] != a.ne[2] || d.ne[3] != a.ne[3]) return fail("dst rows differ from src rows");
            return "";
        case GGML_PY_OP_REPEAT:
            if (!need(1)) return fail("needs a source");
            if (a.type != d.type || type_is_quant(d.type)) return fail("types differ");
            if (!tiles(a, d)) return fail("src does not tile dst");
            return "";
        case GGML_PY_OP_PAD:
            if (!need(1)) return fail("needs a source");
            if (a.type != d.type || type_is_quant(d.type)) return fail("types differ");
            for (int i = 0; i < 4; ++i)
                if (d.ne[i] < a.ne[i]) return fail("dst smaller than src");
            return "";
        default:
            return fail("not supported");
    }
}

}  // namespace gp
