// The SIMD backend's ABI v2 plugin table (plugin.cpp).
#pragma once

#include "ggml_py/backend_abi.h"

namespace gp {
const ggml_py_plugin* simd_plugin();
}
