// pybind11 bindings: ggml_py_simd._simd
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstring>

#include "runtime.h"

namespace py = pybind11;
using namespace gp;

namespace {

// 64-byte aligned, zeroed host memory owned by this object.
struct AlignedBuffer {
    uint8_t* ptr = nullptr;
    size_t size = 0;
    bool mmapped = false;
    explicit AlignedBuffer(size_t n) : size(n) { ptr = aligned_alloc_bytes(n, &mmapped); }
    ~AlignedBuffer() { release(); }
    void release() {
        aligned_free_bytes(ptr, size, mmapped);
        ptr = nullptr;
        size = 0;
    }
    AlignedBuffer(const AlignedBuffer&) = delete;
    AlignedBuffer& operator=(const AlignedBuffer&) = delete;
};

// Existing host memory (any C-contiguous buffer-protocol object), kept alive and never copied.
struct HostView {
    Py_buffer view;
    bool held = false;
    explicit HostView(py::object obj) {
        if (PyObject_GetBuffer(obj.ptr(), &view, PyBUF_C_CONTIGUOUS) != 0) throw py::error_already_set();
        held = true;
    }
    ~HostView() {
        if (held) PyBuffer_Release(&view);
    }
    HostView(const HostView&) = delete;
    HostView& operator=(const HostView&) = delete;
    uint64_t address() const { return (uint64_t)(uintptr_t)view.buf; }
    size_t size() const { return (size_t)view.len; }
    bool readonly() const { return view.readonly != 0; }
};

Affine parse_affine(py::handle v) {
    Affine a;
    if (py::isinstance<py::int_>(v)) {
        a.c0 = v.cast<int64_t>();
        return a;
    }
    py::tuple t = py::reinterpret_borrow<py::tuple>(v);
    if (t.size() != 2) throw py::value_error("an affine value is an int or (c0, [(symbol_index, coef), ...])");
    a.c0 = t[0].cast<int64_t>();
    py::sequence terms = py::reinterpret_borrow<py::sequence>(t[1]);
    for (py::handle term : terms) {
        py::tuple tt = py::reinterpret_borrow<py::tuple>(term);
        const int s = tt[0].cast<int>();
        const int64_t c = tt[1].cast<int64_t>();
        if (c == 0) continue;
        bool merged = false;
        for (int k = 0; k < a.n; ++k)
            if (a.sym[k] == s) {
                a.coef[k] += c;
                merged = true;
            }
        if (merged) continue;
        if (a.n >= MAX_TERMS) throw py::value_error("too many symbolic terms in one value");
        a.sym[a.n] = s;
        a.coef[a.n] = c;
        ++a.n;
    }
    return a;
}

TensorDesc parse_tensor(py::handle h) {
    TensorDesc d;
    if (h.is_none()) return d;
    py::sequence t = py::reinterpret_borrow<py::sequence>(h);
    if (py::len(t) != 5 && py::len(t) != 6)
        throw py::value_error("a tensor is (type_id, ne[4], nb[4], base_address, offset[, const_id])");
    d.present = true;
    d.type = t[0].cast<int32_t>();
    py::sequence ne = py::reinterpret_borrow<py::sequence>(t[1]);
    py::sequence nb = py::reinterpret_borrow<py::sequence>(t[2]);
    if (py::len(ne) != 4 || py::len(nb) != 4) throw py::value_error("ne and nb must have 4 entries (ggml order)");
    for (int i = 0; i < 4; ++i) {
        d.ne[i] = parse_affine(ne[i]);
        d.nb[i] = parse_affine(nb[i]);
    }
    d.base = t[3].cast<uint64_t>();
    d.offset = parse_affine(t[4]);
    if (py::len(t) == 6) d.const_id = t[5].cast<int64_t>();
    return d;
}

NodeDesc parse_node(py::handle h) {
    py::sequence t = py::reinterpret_borrow<py::sequence>(h);
    if (py::len(t) < 3 || py::len(t) > 5) throw py::value_error("a node is (op, dst, [srcs], [int params], [float params])");
    NodeDesc n;
    n.op = t[0].cast<int32_t>();
    n.dst = parse_tensor(t[1]);
    py::sequence srcs = py::reinterpret_borrow<py::sequence>(t[2]);
    if (py::len(srcs) > MAX_SRC) throw py::value_error("at most 4 sources");
    for (size_t i = 0; i < py::len(srcs); ++i) n.src[i] = parse_tensor(srcs[i]);
    if (py::len(t) > 3) n.ip = t[3].cast<std::vector<int32_t>>();
    if (py::len(t) > 4) n.fp = t[4].cast<std::vector<float>>();
    return n;
}

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

unsigned long main_thread_ident = 0;

// The interrupt poll of a compute on the main thread: run pending Python signal handlers under the GIL. When one
// raises (KeyboardInterrupt), its exception stays set on this thread and compute() rethrows it.
bool run_signal_handlers() {
    py::gil_scoped_acquire gil;
    return PyErr_CheckSignals() != 0;
}

}  // namespace

PYBIND11_MODULE(_simd, m) {
    main_thread_ident = py::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>();

    m.doc() = "ggml_py SIMD backend: aligned buffers, runtime ISA dispatch, plan executor";

    py::register_exception<PlanError>(m, "PlanError", PyExc_RuntimeError);

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

    py::dict ops;
    for (int i = 1; i < OP_COUNT; ++i) ops[OP_NAMES[i]] = i;
    m.attr("OPS") = ops;
    m.attr("GEMM_MIN_ROWS") = (int)GEMM_MIN_ROWS;

    py::class_<AlignedBuffer>(m, "Buffer", py::buffer_protocol(), "64-byte aligned, zeroed host memory.")
        .def(py::init<size_t>(), py::arg("size"))
        .def_property_readonly("address", [](const AlignedBuffer& b) { return (uint64_t)(uintptr_t)b.ptr; })
        .def_property_readonly("size", [](const AlignedBuffer& b) { return b.size; })
        .def_property_readonly("alignment", [](const AlignedBuffer&) { return 64; })
        .def_buffer([](AlignedBuffer& b) -> py::buffer_info {
            return py::buffer_info(b.ptr, 1, py::format_descriptor<uint8_t>::format(), 1, {(py::ssize_t)b.size},
                                   {(py::ssize_t)1});
        });

    py::class_<HostView>(m, "HostView", py::buffer_protocol(),
                         "Existing host memory (a C-contiguous buffer-protocol object), wrapped without copying; "
                         "the object is kept alive.")
        .def(py::init<py::object>(), py::arg("obj"))
        .def_property_readonly("address", &HostView::address)
        .def_property_readonly("size", &HostView::size)
        .def_property_readonly("readonly", &HostView::readonly)
        .def_buffer([](HostView& h) -> py::buffer_info {
            return py::buffer_info(h.view.buf, 1, py::format_descriptor<uint8_t>::format(), 1,
                                   {(py::ssize_t)h.view.len}, {(py::ssize_t)1}, h.readonly());
        });

    py::class_<Plan>(m, "Plan", "A lowered list of nodes, validated once, run by compute() in one call.")
        .def(py::init([](py::sequence nodes, py::sequence ranges, std::vector<int64_t> sym_max, int n_threads,
                         py::object level) {
                 std::vector<NodeDesc> nd;
                 nd.reserve(py::len(nodes));
                 for (py::handle h : nodes) nd.push_back(parse_node(h));
                 std::vector<Range> rs;
                 for (py::handle h : ranges) {
                     py::tuple t = py::reinterpret_borrow<py::tuple>(h);
                     rs.push_back({t[0].cast<uint64_t>(), t[1].cast<uint64_t>()});
                 }
                 const int l = level_arg(level);
                 return new Plan(nd, rs, sym_max, n_threads, l);
             }),
             py::arg("nodes"), py::arg("ranges"), py::arg("sym_max") = std::vector<int64_t>(),
             py::arg("n_threads") = 0, py::arg("level") = py::none())
        .def(
            "compute",
            [](Plan& p, std::vector<int64_t> syms) {
                // Python runs signal handlers only on the main thread, so only there is the compute polled.
                const bool on_main = PyThread_get_thread_ident() == main_thread_ident;
                bool interrupted = false;
                {
                    py::gil_scoped_release nogil;
                    try {
                        p.compute(syms, on_main ? run_signal_handlers : nullptr);
                    } catch (const Interrupted&) {
                        interrupted = true;
                    }
                }
                if (interrupted) throw py::error_already_set();  // the handler's exception (KeyboardInterrupt)
            },
            py::arg("syms") = std::vector<int64_t>(),
            "Run the plan. A signal handler that raises on the main thread (Ctrl-C) stops it between nodes.")
        .def_property("n_threads", &Plan::n_threads, &Plan::set_n_threads)
        .def_property("force_parallel", &Plan::force_parallel, &Plan::set_force_parallel,
                      "Run every node on all threads (barrier after each), ignoring the small-node rule.")
        .def_property("profiling", &Plan::profiling, &Plan::set_profiling,
                      "Accumulate per-node wall time (thread 0, including the barrier after the node).")
        .def_property_readonly("node_seconds", &Plan::node_seconds)
        .def_property_readonly("node_ops", [](const Plan& p) {
            std::vector<std::string> v;
            for (int op : p.node_ops()) v.push_back(OP_NAMES[op]);
            return v;
        })
        .def_property_readonly("node_shapes", &Plan::node_shapes)
        .def_property_readonly("n_nodes", &Plan::n_nodes)
        .def_property_readonly("n_tasks", &Plan::n_tasks)
        .def_property_readonly("level", [](const Plan& p) { return std::string(level_name(p.level())); })
        .def_property_readonly("scratch", [](const Plan& p) { return py::make_tuple(p.shared_scratch(), p.thread_scratch()); })
        .def_property_readonly("sym_max", &Plan::sym_max);

    m.def(
        "validate",
        [](py::handle node, std::vector<int64_t> sym_max) -> std::string {
            std::vector<NodeDesc> nd{parse_node(node)};
            std::vector<Range> rs{{0, (uint64_t)1 << 62}};
            try {
                Plan p(nd, rs, sym_max, 1, LEVEL_SCALAR, true);
            } catch (const PlanError& e) {
                return e.what();
            }
            return "";
        },
        py::arg("node"), py::arg("sym_max") = std::vector<int64_t>(),
        "Check one node description (addresses ignored) at the corners of the symbol box; '' if it is supported.");

    m.def(
        "repacked_nbytes",
        [](int type, int64_t ne0, int64_t ne1, py::object level) -> int64_t {
            if (!level_table(level_arg(level))->uses_repack || !repack_supported(type) || ne1 < 8 || ne0 <= 0)
                return 0;
            return ne1 / 8 * 8 * repack_row_bytes(type, ne0);
        },
        py::arg("type"), py::arg("ne0"), py::arg("ne1"), py::arg("level") = py::none(),
        "Bytes of the interleaved copy a constant (ne1 rows of ne0) matrix gets for GEMV in plans of that level "
        "(default: the active one); 0 if it is not repacked.");

    m.def(
        "stream_read_bandwidth",
        [](py::object buf, int n_threads, int reps, py::object level) {
            HostView hv(buf);
            StreamJob job;
            job.p = (const uint8_t*)hv.view.buf;
            job.n = (size_t)hv.view.len;
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
            if (!(type == T_Q8_0 || type == T_Q4_0 || type == T_Q4_1 || type == T_Q5_0 || type == T_Q5_1))
                throw py::value_error("quantization is implemented for Q8_0, Q4_0, Q4_1, Q5_0, Q5_1");
            py::array_t<uint8_t> out(row_bytes(type, n));
            level_table(level_arg(level))->quantize_row(type, x.data(), out.mutable_data(), n);
            return out;
        },
        py::arg("type"), py::arg("x"), py::arg("level") = py::none());
}
