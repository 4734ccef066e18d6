// Fixed-capacity open-addressing map from a 64-bit block hash to a block id.
// NOTE: capacity is sized once for num_blocks entries, so inserts never allocate.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ingot {

inline uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

class BlockHashMap {
 public:
  explicit BlockHashMap(int32_t max_entries) {
    size_t cap = 16;
    while (cap < 2 * static_cast<size_t>(max_entries) + 2) cap <<= 1;
    keys_.assign(cap, 0);
    vals_.assign(cap, -1);
    mask_ = cap - 1;
  }

  // Block id stored under `key`, or -1.
  int32_t find(uint64_t key) const {
    for (size_t i = home(key);; i = (i + 1) & mask_) {
      if (vals_[i] < 0) return -1;
      if (keys_[i] == key) return vals_[i];
    }
  }

  // Inserts key -> val; returns false (and changes nothing) if the key is present.
  bool insert(uint64_t key, int32_t val) {
    for (size_t i = home(key);; i = (i + 1) & mask_) {
      if (vals_[i] < 0) {
        keys_[i] = key;
        vals_[i] = val;
        ++size_;
        return true;
      }
      if (keys_[i] == key) return false;
    }
  }

  // Removes `key` if present (backward-shift deletion keeps probe chains intact).
  void erase(uint64_t key) {
    size_t i = home(key);
    while (true) {
      if (vals_[i] < 0) return;
      if (keys_[i] == key) break;
      i = (i + 1) & mask_;
    }
    vals_[i] = -1;
    --size_;
    for (size_t j = (i + 1) & mask_; vals_[j] >= 0; j = (j + 1) & mask_) {
      size_t k = home(keys_[j]);
      if (((j - k) & mask_) >= ((j - i) & mask_)) {
        keys_[i] = keys_[j];
        vals_[i] = vals_[j];
        vals_[j] = -1;
        i = j;
      }
    }
  }

  size_t size() const { return size_; }

  template <class F>
  void for_each(F&& f) const {
    for (size_t i = 0; i <= mask_; ++i)
      if (vals_[i] >= 0) f(keys_[i], vals_[i]);
  }

 private:
  size_t home(uint64_t key) const { return mix64(key ^ 0x2545f4914f6cdd1dULL) & mask_; }

  std::vector<uint64_t> keys_;
  std::vector<int32_t> vals_;
  size_t mask_ = 0;
  size_t size_ = 0;
};

}  // namespace ingot
