// Runs keel's NF4 codec (core/nf4.h) on raw little-endian fp32 files, for
// tests/reference/nf4_reference.py to compare with bitsandbytes:
//   keel_nf4_tool IN.f32 N OUT_DIR
// writes OUT_DIR/packed.u8, absmax.f32, dequantized.f32 (NF4), and for double quantization of
// the absmax values absmax_codes.u8, absmax2.f32, offset.f32, absmax_dequantized.f32.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "keel/core/nf4.h"

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

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: keel_nf4_tool IN.f32 N OUT_DIR\n");
    return 2;
  }
  const std::string out = argv[3];
  const int64_t n = std::atoll(argv[2]);
  const auto x = read_raw<float>(argv[1], size_t(n));
  const int64_t blocks = (n + keel::kNf4BlockSize - 1) / keel::kNf4BlockSize;
  std::vector<uint8_t> packed(static_cast<size_t>((n + 1) / 2));
  std::vector<float> absmax(static_cast<size_t>(blocks)), dequantized(static_cast<size_t>(n));
  keel::nf4_quantize(x.data(), n, packed.data(), absmax.data());
  keel::nf4_dequantize(packed.data(), absmax.data(), n, dequantized.data());
  write_raw(out + "/packed.u8", packed);
  write_raw(out + "/absmax.f32", absmax);
  write_raw(out + "/dequantized.f32", dequantized);

  std::vector<uint8_t> codes(static_cast<size_t>(blocks));
  std::vector<float> absmax2(size_t((blocks + keel::kNf4DoubleBlockSize - 1) / keel::kNf4DoubleBlockSize));
  std::vector<float> offset(1), absmax_back(static_cast<size_t>(blocks));
  keel::nf4_quantize_absmax(absmax.data(), blocks, codes.data(), absmax2.data(), offset.data());
  keel::nf4_dequantize_absmax(codes.data(), absmax2.data(), offset[0], blocks, absmax_back.data());
  write_raw(out + "/absmax_codes.u8", codes);
  write_raw(out + "/absmax2.f32", absmax2);
  write_raw(out + "/offset.f32", offset);
  write_raw(out + "/absmax_dequantized.f32", absmax_back);
  return 0;
}
