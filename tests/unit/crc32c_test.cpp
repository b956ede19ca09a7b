// CRC-32C against the check values of RFC 3720 (iSCSI, appendix B.4), the polynomial TFRecord's
// framing uses; the event files themselves are checked by TensorBoard's reader
// (tests/reference/tensorboard_reference.py).
#include <gtest/gtest.h>

#include <string>

#include "keel/core/checksum.h"

TEST(Crc32c, CheckValues) {
  EXPECT_EQ(keel::crc32c("123456789"), 0xE3069283u);  // the catalogue's check value
  EXPECT_EQ(keel::crc32c(std::string(32, '\0')), 0x8A9136AAu);
  EXPECT_EQ(keel::crc32c(std::string(32, '\xff')), 0x62A8AB43u);
  std::string ascending(32, '\0');
  for (int i = 0; i < 32; ++i) ascending[size_t(i)] = char(i);
  EXPECT_EQ(keel::crc32c(ascending), 0x46DD794Eu);
  EXPECT_EQ(keel::crc32c(""), 0u);
}
