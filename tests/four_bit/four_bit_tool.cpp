// Runs keel's 4-bit codec (core/four_bit.h) on raw little-endian fp32 files, for
// tests/reference/four_bit_reference.py to compare with bitsandbytes:
//   keel_four_bit_tool nf4|fp4 IN.f32 N OUT_DIR
// writes OUT_DIR/packed.u8, absmax.f32, dequantized.f32 (of the type), and for double quantization of
// the absmax values absmax_codes.u8, absmax2.f32, offset.f32, absmax_dequantized.f32.
// The comparison with bitsandbytes is the Python test's; the tool itself checks the format's own
// invariants and exits 1 naming the first elements that break one: each block's absmax is the
// largest |x| in it; every dequantized value lies within its block's absmax, has its input's sign
// (or is 0) and is within half the widest gap between the type's sorted values of it; each absmax after double
// quantization is within half the dynamic map's widest step (0.0141) of the original.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "keel/core/four_bit.h"

namespace {

template <typename T>
std::vector<T> read_raw(const std::string& path, size_t n) {
  std::vector<T> v(n);
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f || std::fread(v.data(), sizeof(T), n, f) != n) {
    std::fprintf(stderr, "cannot read %zu values from %s\n", n, path.c_str());
    std::exit(2);
  }
  std::fclose(f);
  return v;
}

template <typename T>
void write_raw(const std::string& path, const std::vector<T>& v) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f || std::fwrite(v.data(), sizeof(T), v.size(), f) != v.size()) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    std::exit(2);
  }
  std::fclose(f);
}

int failures = 0;
void check(bool ok, const std::string& what) {
  if (ok) return;
  if (failures++ < 10) std::fprintf(stderr, "keel_four_bit_tool: %s\n", what.c_str());
}

void check_values(keel::FourBitType type, const std::vector<float>& x, const std::vector<float>& absmax,
                  const std::vector<float>& dequantized) {
  std::vector<float> sorted(keel::four_bit_values(type), keel::four_bit_values(type) + 16);
  std::sort(sorted.begin(), sorted.end());
  float widest_gap = 0.0f;
  for (int i = 0; i + 1 < 16; ++i) widest_gap = std::max(widest_gap, sorted[size_t(i) + 1] - sorted[size_t(i)]);
  const size_t block = size_t(keel::kFourBitBlockSize);
  for (size_t i = 0; i < x.size(); ++i) {
    const size_t b = i / block;
    if (i % block == 0) {
      float m = 0.0f;
      for (size_t j = i; j < std::min(x.size(), i + block); ++j) m = std::max(m, std::fabs(x[j]));
      check(m == absmax[b], "block " + std::to_string(b) + ": absmax is not the largest |x|");
    }
    const float d = dequantized[i];
    check(std::fabs(d) <= absmax[b], "element " + std::to_string(i) + ": dequantized beyond its block's absmax");
    check(d == 0.0f || (d > 0) == (x[i] > 0), "element " + std::to_string(i) + ": dequantized with the wrong sign");
    check(std::fabs(d - x[i]) <= 0.5f * widest_gap * absmax[b] * (1 + 1e-5f),
          "element " + std::to_string(i) + ": farther from its input than half the widest gap between values");
  }
}

void check_absmax(const std::vector<float>& absmax, const std::vector<float>& absmax2, const std::vector<float>& back) {
  for (size_t i = 0; i < absmax.size(); ++i) {
    const float scale = absmax2[i / size_t(keel::kAbsmaxBlockSize)];
    check(std::fabs(back[i] - absmax[i]) <= 0.5f * 0.0141f * scale + 1e-6f * std::fabs(absmax[i]),
          "absmax " + std::to_string(i) + ": double quantization moved it by more than half a step");
  }
}

}  // namespace

int main(int argc, char** argv) {
  const auto type = argc == 5 ? keel::parse_four_bit_type(argv[1]) : std::nullopt;
  if (!type) {
    std::fprintf(stderr, "usage: keel_four_bit_tool nf4|fp4 IN.f32 N OUT_DIR\n");
    return 2;
  }
  const std::string out = argv[4];
  const int64_t n = std::atoll(argv[3]);
  const auto x = read_raw<float>(argv[2], size_t(n));
  const int64_t blocks = (n + keel::kFourBitBlockSize - 1) / keel::kFourBitBlockSize;
  std::vector<uint8_t> packed(static_cast<size_t>((n + 1) / 2));
  std::vector<float> absmax(static_cast<size_t>(blocks)), dequantized(static_cast<size_t>(n));
  keel::four_bit_quantize(*type, x.data(), n, packed.data(), absmax.data());
  keel::four_bit_dequantize(*type, packed.data(), absmax.data(), n, dequantized.data());
  write_raw(out + "/packed.u8", packed);
  write_raw(out + "/absmax.f32", absmax);
  write_raw(out + "/dequantized.f32", dequantized);

  std::vector<uint8_t> codes(static_cast<size_t>(blocks));
  std::vector<float> absmax2(size_t((blocks + keel::kAbsmaxBlockSize - 1) / keel::kAbsmaxBlockSize));
  std::vector<float> offset(1), absmax_back(static_cast<size_t>(blocks));
  keel::quantize_absmax(absmax.data(), blocks, codes.data(), absmax2.data(), offset.data());
  keel::dequantize_absmax(codes.data(), absmax2.data(), offset[0], blocks, absmax_back.data());
  write_raw(out + "/absmax_codes.u8", codes);
  write_raw(out + "/absmax2.f32", absmax2);
  write_raw(out + "/offset.f32", offset);
  write_raw(out + "/absmax_dequantized.f32", absmax_back);
  check_values(*type, x, absmax, dequantized);
  check_absmax(absmax, absmax2, absmax_back);
  if (failures) std::fprintf(stderr, "keel_four_bit_tool: %d invariant(s) broken\n", failures);
  return failures ? 1 : 0;
}
