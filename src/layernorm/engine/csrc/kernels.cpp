// A kernel set's table (engine.h, Kernels): the one symbol its shared object exports. The set
// is compiled with -march=x86-64-<LAYERNORM_ISA> and -DLAYERNORM_ISA=<v3|v4>, which also names
// its namespace; the table is a constant (no code runs when the object is loaded).

#include "engine.h"

#ifndef LAYERNORM_ISA
#error "the kernel files are compiled once per instruction set, with -DLAYERNORM_ISA=<v3|v4>"
#endif

#define LAYERNORM_STRING(s) #s
#define LAYERNORM_SET(isa) "x86-64-" LAYERNORM_STRING(isa)

namespace {
namespace set = layernorm::engine::LAYERNORM_ISA;
constexpr layernorm::engine::Kernels kTable{
    sizeof(layernorm::engine::Kernels), LAYERNORM_SET(LAYERNORM_ISA), &set::forward_rows,
    &set::quantize_rows,  &set::backward_chunks, &set::reduce_chunks, &set::compute_row, &set::copy_blocks};
}  // namespace

extern "C" __attribute__((visibility("default"))) const layernorm::engine::Kernels*
layernorm_kernels() {
  return &kTable;
}
