// pybind11 bindings: ggml_py_simd._simd
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstring>

#include "plugin.h"
#include "runtime.h"

namespace py = pybind11;
using namespace gp;

namespace {

int level_arg(py::object level) {
    if (level.is_none()) return current_level();
    const std::string name = level.cast<std::string>();
    const int l = level_from_name(name);
    if (l < 0) throw py::value_error("unknown SIMD level '" + name + "' (scalar, avx2, avx512)");
    std::string missing;
    if (!level_supported(l, &missing))
        throw py::value_error("SIMD level '" + name + "' is not supported by this CPU (missing: " + missing + ")");
    return l;
}

struct StreamJob : Job {
    const uint8_t* p;
    size_t n;
    const KernelTable* kt;
    double sink[64] = {0};
    void run(int ith, int nth) override {
        size_t per = (n / (size_t)nth) & ~(size_t)127;
        size_t a = per * (size_t)ith;
        size_t b = ith == nth - 1 ? n : a + per;
        sink[ith % 64] += kt->stream_read(p + a, b - a);
    }
};

}  // namespace

PYBIND11_MODULE(_simd, m) {
    m.doc() = "ggml_py SIMD backend: its ABI v2 plugin table, ISA level selection, kernel utilities for tests and benchmarks";

    m.def(
        "plugin_table", [] { return (uintptr_t)simd_plugin(); },
        "Address of the backend's ggml_py_plugin table (ABI v2), for ggml_py.runtime.native.load_table.");

    m.def("level", [] { return std::string(level_name(current_level())); }, "The active SIMD level.");
    m.def(
        "set_level",
        [](const std::string& name) {
            const int l = level_from_name(name);
            if (l < 0) throw py::value_error("unknown SIMD level '" + name + "' (scalar, avx2, avx512)");
            try {
                set_current_level(l);
            } catch (const std::invalid_argument& e) {
                throw py::value_error(e.what());
            }
        },
        py::arg("name"), "Select the SIMD level for plans built afterwards; refuses one this CPU lacks.");
    m.def("best_level", [] { return std::string(level_name(best_level())); });
    m.def("all_levels", [] {
        std::vector<std::string> v;
        for (int l = 0; l < LEVEL_COUNT; ++l) v.push_back(level_name(l));
        return v;
    });
    m.def("levels", [] {
        std::vector<std::string> v;
        for (int l = 0; l < LEVEL_COUNT; ++l)
            if (level_supported(l)) v.push_back(level_name(l));
        return v;
    }, "Levels this CPU supports.");
    m.def("level_missing", [](const std::string& name) {
        const int l = level_from_name(name);
        if (l < 0) throw py::value_error("unknown SIMD level '" + name + "'");
        std::string missing;
        level_supported(l, &missing);
        return missing;
    });
    m.def("cpu_features", [] {
        const CpuFeatures& f = cpu_features();
        py::dict d;
        d["vendor"] = f.vendor;
        d["brand"] = f.brand;
        d["sse2"] = f.sse2;
        d["ssse3"] = f.ssse3;
        d["sse4_1"] = f.sse41;
        d["avx"] = f.avx;
        d["avx2"] = f.avx2;
        d["fma"] = f.fma;
        d["f16c"] = f.f16c;
        d["bmi2"] = f.bmi2;
        d["avx512f"] = f.avx512f;
        d["avx512bw"] = f.avx512bw;
        d["avx512vl"] = f.avx512vl;
        d["avx512dq"] = f.avx512dq;
        d["avx512cd"] = f.avx512cd;
        d["avx512vnni"] = f.avx512vnni;
        d["avx512bf16"] = f.avx512bf16;
        d["avxvnni"] = f.avxvnni;
        d["os_avx"] = f.os_avx;
        d["os_avx512"] = f.os_avx512;
        return d;
    });
    m.def("physical_cores", &physical_cores);

    m.attr("GEMM_MIN_ROWS") = (long long)gemm_min_rows(T_Q2_K);  // of the quantized types not repacked

    m.def(
        "plan_info",
        [](uintptr_t handle) {
            const Plan* p = (const Plan*)handle;
            py::dict d;
            d["level"] = std::string(level_name(p->level()));
            d["n_threads"] = p->n_threads();
            d["n_nodes"] = p->n_nodes();
            d["n_tasks"] = p->n_tasks();
            d["grouped_products"] = p->grouped_products();
            d["get_rows_from_repack"] = p->get_rows_from_repack();
            d["scratch"] = py::make_tuple(p->shared_scratch(), p->thread_scratch());
            return d;
        },
        py::arg("handle"), "What a plan made by this backend's graph_plan_create chose (its handle's address).");

    m.def(
        "repacked_nbytes",
        [](int type, int64_t ne0, int64_t ne1, py::object level) -> int64_t {
            const int g = repack_group_rows(type);
            if (!level_table(level_arg(level))->uses_repack || g == 0 || ne1 < g || ne0 <= 0) return 0;
            return ne1 / g * g * repack_row_bytes(type, ne0);
        },
        py::arg("type"), py::arg("ne0"), py::arg("ne1"), py::arg("level") = py::none(),
        "Bytes of the repacked copy (x8 or p16) a constant (ne1 rows of ne0) matrix gets in plans of that level "
        "(default: the active one); 0 if it is not repacked.");

    m.def(
        "stream_read_bandwidth",
        [](py::buffer buf, int n_threads, int reps, py::object level) {
            py::buffer_info info = buf.request();
            StreamJob job;
            job.p = (const uint8_t*)info.ptr;
            job.n = (size_t)(info.size * info.itemsize);
            job.kt = level_table(level_arg(level));
            const int nth = n_threads > 0 ? n_threads : physical_cores();
            double best = 0.0;
            {
                py::gil_scoped_release nogil;
                for (int r = 0; r < (reps > 0 ? reps : 1); ++r) {
                    auto t0 = std::chrono::steady_clock::now();
                    ThreadPool::instance().run(&job, nth);
                    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
                    const double gbs = (double)job.n / s / 1e9;
                    if (gbs > best) best = gbs;
                }
            }
            return best;
        },
        py::arg("buffer"), py::arg("n_threads") = 0, py::arg("reps") = 5, py::arg("level") = py::none(),
        "Best-of-reps read bandwidth (GB/s) of streaming through the buffer with n_threads threads.");

    m.def(
        "dequantize",
        [](int type, py::buffer src, int64_t n, py::object level) {
            const int bs = type_block(type);
            if (bs == 0 || n % bs) throw py::value_error("bad type or element count");
            py::buffer_info info = src.request();
            if ((int64_t)info.size * info.itemsize < row_bytes(type, n)) throw py::value_error("source too small");
            py::array_t<float> out(n);
            level_table(level_arg(level))->dequantize_row(type, info.ptr, out.mutable_data(), n);
            return out;
        },
        py::arg("type"), py::arg("src"), py::arg("n"), py::arg("level") = py::none());
    m.def(
        "quantize",
        [](int type, py::array_t<float, py::array::c_style | py::array::forcecast> x, py::object level) {
            const int64_t n = (int64_t)x.size();
            const int bs = type_block(type);
            if (bs <= 1 || n % bs) throw py::value_error("bad type or element count");
            if (!type_is_cpy_dst(type))
                throw py::value_error("quantization is implemented for the quantized types CPY writes "
                                      "(ggml_py.ir.ops.CPY_DST_TYPES)");
            py::array_t<uint8_t> out(row_bytes(type, n));
            level_table(level_arg(level))->quantize_row(type, x.data(), out.mutable_data(), n);
            return out;
        },
        py::arg("type"), py::arg("x"), py::arg("level") = py::none());
}
