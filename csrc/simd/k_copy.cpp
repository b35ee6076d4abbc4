// Data movement: CPY/DUP/CONT (any strides, type conversion, quantization), GET_ROWS, SET_ROWS, CONCAT, REPEAT, PAD.
#include "isa.h"

namespace gp {
namespace GP_NS {

GP_INLINE void row_index(const Tensor& t, int64_t r, int64_t* i1, int64_t* i2, int64_t* i3) {
    *i1 = r % t.ne[1];
    *i2 = (r / t.ne[1]) % t.ne[2];
    *i3 = r / (t.ne[1] * t.ne[2]);
}

// Source elements [e, e+n) in logical order (ne[0] fastest) into floats.
static void gather_f32(const Tensor& s, int64_t e, int64_t n, float* out) {
    int64_t i0 = e % s.ne[0];
    int64_t rest = e / s.ne[0];
    int64_t i1 = rest % s.ne[1];
    rest /= s.ne[1];
    int64_t i2 = rest % s.ne[2];
    int64_t i3 = rest / s.ne[2];
    const int es = type_size(s.type);
    for (int64_t j = 0; j < n;) {
        const uint8_t* base = s.data + i1 * s.nb[1] + i2 * s.nb[2] + i3 * s.nb[3];
        const int64_t run = imin(n - j, s.ne[0] - i0);
        if (s.nb[0] == es && s.type != T_I32) {
            dequantize_row(s.type, base + i0 * es, out + j, run);
        } else {
            for (int64_t k = 0; k < run; ++k) {
                const uint8_t* p = base + (i0 + k) * s.nb[0];
                float v;
                switch (s.type) {
                    case T_F32: v = *(const float*)p; break;
                    case T_F16: v = fp16_to_fp32(*(const uint16_t*)p); break;
                    case T_BF16: v = bf16_to_fp32(*(const uint16_t*)p); break;
                    case T_I32: v = (float)*(const int32_t*)p; break;
                    default: v = 0.0f; break;
                }
                out[j + k] = v;
            }
        }
        j += run;
        i0 = 0;
        if (++i1 == s.ne[1]) {
            i1 = 0;
            if (++i2 == s.ne[2]) { i2 = 0; ++i3; }
        }
    }
}

// Same-type raw copy of source elements [e, e+n) (logical order) to contiguous dst bytes.
static void gather_raw(const Tensor& s, int64_t e, int64_t n, uint8_t* out) {
    int64_t i0 = e % s.ne[0];
    int64_t rest = e / s.ne[0];
    int64_t i1 = rest % s.ne[1];
    rest /= s.ne[1];
    int64_t i2 = rest % s.ne[2];
    int64_t i3 = rest / s.ne[2];
    const int es = type_size(s.type);
    for (int64_t j = 0; j < n;) {
        const uint8_t* base = s.data + i1 * s.nb[1] + i2 * s.nb[2] + i3 * s.nb[3];
        const int64_t run = imin(n - j, s.ne[0] - i0);
        if (s.nb[0] == es) {
            memmove(out + j * es, base + i0 * es, (size_t)(run * es));
        } else {
            for (int64_t k = 0; k < run; ++k) memcpy(out + (j + k) * es, base + (i0 + k) * s.nb[0], (size_t)es);
        }
        j += run;
        i0 = 0;
        if (++i1 == s.ne[1]) {
            i1 = 0;
            if (++i2 == s.ne[2]) { i2 = 0; ++i3; }
        }
    }
}

void k_cpy(Node& n, int phase, int ith, int nth, const ExecCtx& ctx) {
    (void)phase;
    const Tensor& d = n.dst;
    const Tensor& s = n.src[0];
    const int64_t nr = nrows(d), ne0 = d.ne[0];
    int64_t r0, r1;
    if (!my_rows(nr, ne0, ith, nth, &r0, &r1, 8192)) return;
    const int des = type_size(d.type);
    const bool quant = type_is_quant(d.type);
    const bool same_type = d.type == s.type;
    const bool same_shape = d.ne[0] == s.ne[0] && d.ne[1] == s.ne[1] && d.ne[2] == s.ne[2] && d.ne[3] == s.ne[3];
    float* tmp = (float*)ctx.thread_scratch(ith);
    uint8_t* rtmp = (uint8_t*)(tmp + ((ne0 + 15) & ~15));
    for (int64_t r = r0; r < r1; ++r) {
        int64_t i1, i2, i3;
        row_index(d, r, &i1, &i2, &i3);
        uint8_t* dp = d.data + i1 * d.nb[1] + i2 * d.nb[2] + i3 * d.nb[3];
        const bool dst_row_contig = quant || d.nb[0] == des;
        if (same_type) {
            uint8_t* out = dst_row_contig ? dp : rtmp;
            if (same_shape && s.nb[0] == des) {
                memmove(out, s.data + i1 * s.nb[1] + i2 * s.nb[2] + i3 * s.nb[3], (size_t)(ne0 * des));
            } else {
                gather_raw(s, r * ne0, ne0, out);
            }
            if (!dst_row_contig)
                for (int64_t i = 0; i < ne0; ++i) memcpy(dp + i * d.nb[0], rtmp + i * des, (size_t)des);
            continue;
        }
        const float* x;
        if (same_shape && s.type == T_F32 && s.nb[0] == 4) {
            x = (const float*)(s.data + i1 * s.nb[1] + i2 * s.nb[2] + i3 * s.nb[3]);
        } else {
            gather_f32(s, r * ne0, ne0, tmp);
            x = tmp;
        }
        if (dst_row_contig) {
            convert_row_from_f32(d.type, x, dp, ne0);
        } else {
            convert_row_from_f32(d.type, x, rtmp, ne0);
            for (int64_t i = 0; i < ne0; ++i) memcpy(dp + i * d.nb[0], rtmp + i * des, (size_t)des);
        }
    }
}

// GET_ROWS: dst[:, i10, i11, i12] = src0[:, idx[i10, i11, i12], i11, i12]
void k_get_rows(Node& n, int phase, int ith, int nth, const ExecCtx& ctx) {
    (void)phase;
    const Tensor& d = n.dst;
    const Tensor& s = n.src[0];
    const Tensor& ix = n.src[1];
    const int64_t nr = nrows(d), ne0 = d.ne[0];
    int64_t r0, r1;
    if (!my_rows(nr, ne0, ith, nth, &r0, &r1, 8192)) return;
    float* tmp = (float*)ctx.thread_scratch(ith);
    const int ses = type_size(s.type);
    for (int64_t r = r0; r < r1; ++r) {
        int64_t i10, i11, i12;
        row_index(d, r, &i10, &i11, &i12);
        const uint8_t* ip = ix.data + i10 * ix.nb[0] + i11 * ix.nb[1] + i12 * ix.nb[2];
        const int64_t row = ix.type == T_I64 ? *(const int64_t*)ip : (int64_t)*(const int32_t*)ip;
        if (row < 0 || row >= s.ne[1]) {
            char msg[160];
            snprintf(msg, sizeof msg, "GET_ROWS: row index %lld out of range 0..%lld", (long long)row,
                     (long long)(s.ne[1] - 1));
            set_error(ctx, msg);
            continue;
        }
        const uint8_t* sp = s.data + row * s.nb[1] + i11 * s.nb[2] + i12 * s.nb[3];
        if (n.repack && row < s.ne[1] / repack_group_rows(s.type) * repack_group_rows(s.type)) {
            uint8_t* packed = (uint8_t*)(tmp + ((ne0 + 15) & ~(int64_t)15));  // the scratch past the floats
            unrepack_row(s, n.repack, row, packed);
            sp = packed;
        }
        uint8_t* dp = d.data + i10 * d.nb[1] + i11 * d.nb[2] + i12 * d.nb[3];
        if (s.type == d.type) {  // I32 -> I32, F32 -> F32
            if (s.nb[0] == ses && d.nb[0] == ses) {
                memmove(dp, sp, (size_t)(ne0 * ses));
            } else {
                for (int64_t i = 0; i < ne0; ++i) memcpy(dp + i * d.nb[0], sp + i * s.nb[0], (size_t)ses);
            }
            continue;
        }
        if (type_is_quant(s.type) || s.nb[0] == ses) {
            float* out = d.nb[0] == 4 ? (float*)dp : tmp;
            dequantize_row(s.type, sp, out, ne0);
            if (out == tmp)
                for (int64_t i = 0; i < ne0; ++i) *(float*)(dp + i * d.nb[0]) = tmp[i];
        } else {
            for (int64_t i = 0; i < ne0; ++i) {
                const uint8_t* p = sp + i * s.nb[0];
                float v = s.type == T_F16 ? fp16_to_fp32(*(const uint16_t*)p)
                                          : (s.type == T_BF16 ? bf16_to_fp32(*(const uint16_t*)p) : *(const float*)p);
                *(float*)(dp + i * d.nb[0]) = v;
            }
        }
    }
}

// SET_ROWS: dst[:, idx[i, i02 % ne11, i03 % ne12], i02, i03] = convert(src[:, i, i02, i03])
void k_set_rows(Node& n, int phase, int ith, int nth, const ExecCtx& ctx) {
    (void)phase;
    const Tensor& d = n.dst;
    const Tensor& s = n.src[0];
    const Tensor& ix = n.src[1];
    const int64_t nr = nrows(s), ne0 = s.ne[0];
    int64_t r0, r1;
    if (!my_rows(nr, ne0, ith, nth, &r0, &r1, 8192)) return;
    float* tmp = (float*)ctx.thread_scratch(ith);
    uint8_t* rtmp = (uint8_t*)(tmp + ((ne0 + 15) & ~15));
    const int des = type_size(d.type);
    const bool quant = type_is_quant(d.type);
    for (int64_t r = r0; r < r1; ++r) {
        int64_t i, i02, i03;
        row_index(s, r, &i, &i02, &i03);
        const uint8_t* ip = ix.data + i * ix.nb[0] + (i02 % ix.ne[1]) * ix.nb[1] + (i03 % ix.ne[2]) * ix.nb[2];
        const int64_t row = ix.type == T_I64 ? *(const int64_t*)ip : (int64_t)*(const int32_t*)ip;
        if (row < 0 || row >= d.ne[1]) {
            char msg[160];
            snprintf(msg, sizeof msg, "SET_ROWS: row index %lld out of range 0..%lld", (long long)row,
                     (long long)(d.ne[1] - 1));
            set_error(ctx, msg);
            continue;
        }
        const uint8_t* sp = s.data + i * s.nb[1] + i02 * s.nb[2] + i03 * s.nb[3];
        uint8_t* dp = d.data + row * d.nb[1] + i02 * d.nb[2] + i03 * d.nb[3];
        const float* x = (const float*)sp;
        if (s.nb[0] != 4) {
            for (int64_t k = 0; k < ne0; ++k) tmp[k] = *(const float*)(sp + k * s.nb[0]);
            x = tmp;
        }
        if (quant || d.nb[0] == des) {
            convert_row_from_f32(d.type, x, dp, ne0);
        } else {
            convert_row_from_f32(d.type, x, rtmp, ne0);
            for (int64_t k = 0; k < ne0; ++k) memcpy(dp + k * d.nb[0], rtmp + k * des, (size_t)des);
        }
    }
}

// copy n elements of size es between strided rows
GP_INLINE void copy_elems(uint8_t* d, int64_t ds, const uint8_t* s, int64_t ss, int64_t n, int es) {
    if (ds == es && ss == es) {
        memmove(d, s, (size_t)(n * es));
        return;
    }
    for (int64_t i = 0; i < n; ++i) memcpy(d + i * ds, s + i * ss, (size_t)es);
}
GP_INLINE void zero_elems(uint8_t* d, int64_t ds, int64_t n, int es) {
    if (ds == es) {
        memset(d, 0, (size_t)(n * es));
        return;
    }
    for (int64_t i = 0; i < n; ++i) memset(d + i * ds, 0, (size_t)es);
}

void k_concat(Node& n, int phase, int ith, int nth, const ExecCtx& ctx) {
    (void)phase;
    (void)ctx;
    const Tensor& d = n.dst;
    const Tensor& a = n.src[0];
    const Tensor& b = n.src[1];
    const int dim = n.params.i[GGML_PY_P_CONCAT_AXIS];
    const int64_t nr = nrows(d), ne0 = d.ne[0];
    int64_t r0, r1;
    if (!my_rows(nr, ne0, ith, nth, &r0, &r1, 8192)) return;
    const int es = type_size(d.type);
    for (int64_t r = r0; r < r1; ++r) {
        int64_t i[4] = {0, 0, 0, 0};
        row_index(d, r, &i[1], &i[2], &i[3]);
        uint8_t* dp = d.data + i[1] * d.nb[1] + i[2] * d.nb[2] + i[3] * d.nb[3];
        if (dim == 0) {
            copy_elems(dp, d.nb[0], a.data + i[1] * a.nb[1] + i[2] * a.nb[2] + i[3] * a.nb[3], a.nb[0], a.ne[0], es);
            copy_elems(dp + a.ne[0] * d.nb[0], d.nb[0], b.data + i[1] * b.nb[1] + i[2] * b.nb[2] + i[3] * b.nb[3],
                       b.nb[0], b.ne[0], es);
            continue;
        }
        const Tensor* src = &a;
        if (i[dim] >= a.ne[dim]) {
            i[dim] -= a.ne[dim];
            src = &b;
        }
        copy_elems(dp, d.nb[0], src->data + i[1] * src->nb[1] + i[2] * src->nb[2] + i[3] * src->nb[3], src->nb[0],
                   ne0, es);
    }
}

void k_repeat(Node& n, int phase, int ith, int nth, const ExecCtx& ctx) {
    (void)phase;
    (void)ctx;
    const Tensor& d = n.dst;
    const Tensor& s = n.src[0];
    const int64_t nr = nrows(d), ne0 = d.ne[0];
    int64_t r0, r1;
    if (!my_rows(nr, ne0, ith, nth, &r0, &r1, 8192)) return;
    const int es = type_size(d.type);
    for (int64_t r = r0; r < r1; ++r) {
        int64_t i1, i2, i3;
        row_index(d, r, &i1, &i2, &i3);
        uint8_t* dp = d.data + i1 * d.nb[1] + i2 * d.nb[2] + i3 * d.nb[3];
        const uint8_t* sp = s.data + (i1 % s.ne[1]) * s.nb[1] + (i2 % s.ne[2]) * s.nb[2] + (i3 % s.ne[3]) * s.nb[3];
        for (int64_t j = 0; j < ne0; j += s.ne[0]) copy_elems(dp + j * d.nb[0], d.nb[0], sp, s.nb[0], s.ne[0], es);
    }
}

void k_pad(Node& n, int phase, int ith, int nth, const ExecCtx& ctx) {
    (void)phase;
    (void)ctx;
    const Tensor& d = n.dst;
    const Tensor& s = n.src[0];
    const int64_t nr = nrows(d), ne0 = d.ne[0];
    int64_t r0, r1;
    if (!my_rows(nr, ne0, ith, nth, &r0, &r1, 8192)) return;
    const int es = type_size(d.type);
    for (int64_t r = r0; r < r1; ++r) {
        int64_t i1, i2, i3;
        row_index(d, r, &i1, &i2, &i3);
        uint8_t* dp = d.data + i1 * d.nb[1] + i2 * d.nb[2] + i3 * d.nb[3];
        if (i1 < s.ne[1] && i2 < s.ne[2] && i3 < s.ne[3]) {
            copy_elems(dp, d.nb[0], s.data + i1 * s.nb[1] + i2 * s.nb[2] + i3 * s.nb[3], s.nb[0], s.ne[0], es);
            zero_elems(dp + s.ne[0] * d.nb[0], d.nb[0], ne0 - s.ne[0], es);
        } else {
            zero_elems(dp, d.nb[0], ne0, es);
        }
    }
}

}  // namespace GP_NS
}  // namespace gp
