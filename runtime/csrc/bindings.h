// Shared helpers for the nanobind module `ingot.runtime._core`.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>

namespace ingot {

namespace nb = nanobind;

using I32Array = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using I8Array = nb::ndarray<const int8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using I64Array = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// A 1-D numpy view over C++-owned memory that keeps `owner` alive.
template <class T>
nb::ndarray<nb::numpy, T> view1d(T* data, size_t n, nb::handle owner) {
  size_t shape[1] = {n};
  return nb::ndarray<nb::numpy, T>(data, 1, shape, owner);
}

void bind_block_manager(nb::module_& m);
void bind_scheduler(nb::module_& m);

}  // namespace ingot
