// CPU feature detection (cpuid + xgetbv), level selection, physical core count.
#include <sched.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <set>
#include <stdexcept>
#include <utility>

#include "runtime.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define GP_X86 1
#else
#define GP_X86 0
#endif

namespace gp {
namespace scalar { const KernelTable* table(); }
#if GP_X86
namespace avx2 { const KernelTable* table(); }
#if !GP_NO_AVX512
namespace avx512 { const KernelTable* table(); }
#endif
#endif

#if GP_X86
static uint64_t xgetbv0() {
    uint32_t eax, edx;
    __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
    return ((uint64_t)edx << 32) | eax;
}
#endif

static CpuFeatures detect() {
    CpuFeatures f;
#if GP_X86
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return f;
    const unsigned max_leaf = a;
    char vendor[13];
    memcpy(vendor, &b, 4);
    memcpy(vendor + 4, &d, 4);
    memcpy(vendor + 8, &c, 4);
    vendor[12] = 0;
    f.vendor = vendor;
    __get_cpuid(1, &a, &b, &c, &d);
    f.sse2 = d & (1u << 26);
    f.ssse3 = c & (1u << 9);
    f.sse41 = c & (1u << 19);
    f.fma = c & (1u << 12);
    f.f16c = c & (1u << 29);
    const bool osxsave = c & (1u << 27);
    f.avx = c & (1u << 28);
    if (osxsave) {
        const uint64_t xcr0 = xgetbv0();
        f.os_avx = (xcr0 & 0x6) == 0x6;
        f.os_avx512 = (xcr0 & 0xe6) == 0xe6;
    }
    if (max_leaf >= 7) {
        __get_cpuid_count(7, 0, &a, &b, &c, &d);
        f.avx2 = b & (1u << 5);
        f.bmi2 = b & (1u << 8);
        f.avx512f = b & (1u << 16);
        f.avx512dq = b & (1u << 17);
        f.avx512cd = b & (1u << 28);
        f.avx512bw = b & (1u << 30);
        f.avx512vl = b & (1u << 31);
        f.avx512vnni = c & (1u << 11);
        unsigned a1, b1, c1, d1;
        __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1);
        f.avx512bf16 = a1 & (1u << 5);
        f.avxvnni = a1 & (1u << 4);
    }
    unsigned ext = __get_cpuid_max(0x80000000u, nullptr);
    if (ext >= 0x80000004u) {
        char brand[49];
        unsigned* p = (unsigned*)brand;
        for (unsigned i = 0; i < 3; ++i) __get_cpuid(0x80000002u + i, &p[4 * i], &p[4 * i + 1], &p[4 * i + 2], &p[4 * i + 3]);
        brand[48] = 0;
        f.brand = brand;
        while (!f.brand.empty() && f.brand.back() == ' ') f.brand.pop_back();
        size_t s = f.brand.find_first_not_of(' ');
        f.brand = s == std::string::npos ? "" : f.brand.substr(s);
    }
#endif
    return f;
}

const CpuFeatures& cpu_features() {
    static const CpuFeatures f = detect();
    return f;
}

bool cpu_has_avx512_vnni() { return cpu_features().avx512vnni; }
bool cpu_is_amd() { return cpu_features().vendor == "AuthenticAMD"; }

const char* level_name(int level) {
    switch (level) {
        case LEVEL_SCALAR: return "scalar";
        case LEVEL_AVX2: return "avx2";
        case LEVEL_AVX512: return "avx512";
        default: return "?";
    }
}

int level_from_name(const std::string& name) {
    for (int l = 0; l < LEVEL_COUNT; ++l)
        if (name == level_name(l)) return l;
    return -1;
}

bool level_supported(int level, std::string* missing) {
    const CpuFeatures& f = cpu_features();
    std::vector<std::pair<const char*, bool>> need;
    switch (level) {
        case LEVEL_SCALAR: return true;
        case LEVEL_AVX2:
            need = {{"avx2", f.avx2}, {"fma", f.fma}, {"f16c", f.f16c}, {"os-avx-state", f.os_avx}};
            break;
        case LEVEL_AVX512:
#if GP_NO_AVX512
            if (missing) *missing = "not built (a sanitizer build on a CPU without AVX-512)";
            return false;
#endif
            need = {{"avx2", f.avx2},         {"fma", f.fma},           {"f16c", f.f16c},
                    {"avx512f", f.avx512f},   {"avx512bw", f.avx512bw}, {"avx512vl", f.avx512vl},
                    {"avx512dq", f.avx512dq}, {"avx512cd", f.avx512cd}, {"os-avx512-state", f.os_avx512}};
            break;
        default:
            if (missing) *missing = "unknown level";
            return false;
    }
#if !GP_X86
    if (missing) *missing = "not an x86 CPU";
    return false;
#endif
    std::string m;
    for (auto& p : need)
        if (!p.second) m += (m.empty() ? "" : ",") + std::string(p.first);
    if (missing) *missing = m;
    return m.empty();
}

int best_level() {
    for (int l = LEVEL_COUNT - 1; l > 0; --l)
        if (level_supported(l)) return l;
    return LEVEL_SCALAR;
}

static std::atomic<int>& level_var() {
    static std::atomic<int> v{best_level()};
    return v;
}
int current_level() { return level_var().load(); }
void set_current_level(int level) {
    std::string missing;
    if (level < 0 || level >= LEVEL_COUNT) throw std::invalid_argument("unknown SIMD level");
    if (!level_supported(level, &missing))
        throw std::invalid_argument(std::string("SIMD level '") + level_name(level) +
                                    "' is not supported by this CPU (missing: " + missing + ")");
    level_var().store(level);
}

const KernelTable* level_table(int level) {
    switch (level) {
#if GP_X86
#if !GP_NO_AVX512
        case LEVEL_AVX512: return avx512::table();
#endif
        case LEVEL_AVX2: return avx2::table();
#endif
        default: return scalar::table();
    }
}

int physical_cores() {
    static int cached = 0;
    if (cached) return cached;
    cpu_set_t set;
    CPU_ZERO(&set);
    int allowed = 0;
    std::set<std::pair<int, int>> cores;
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
            if (!CPU_ISSET(cpu, &set)) continue;
            ++allowed;
            char path[128];
            int core = -1, pkg = 0;
            snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%d/topology/core_id", cpu);
            std::ifstream fc(path);
            if (!(fc >> core)) core = cpu;
            snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%d/topology/physical_package_id", cpu);
            std::ifstream fp(path);
            if (!(fp >> pkg)) pkg = 0;
            cores.insert({pkg, core});
        }
    }
    int n = (int)cores.size();
    if (n <= 0) n = allowed > 0 ? allowed : (int)std::thread::hardware_concurrency();
    if (n <= 0) n = 1;
    cached = n;
    return n;
}

}  // namespace gp
