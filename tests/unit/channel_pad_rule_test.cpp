// The channel count a padded half-precision convolution runs on (src/backend/channel_pad_rule.h).
#include "backend/channel_pad_rule.h"

#include <gtest/gtest.h>

namespace kiln {
namespace {

TEST(ChannelPadRule, FirstLayersTakeFourChannels) {
  EXPECT_EQ(padded_channel_count(1), 4);  // grey images
  EXPECT_EQ(padded_channel_count(2), 4);
  EXPECT_EQ(padded_channel_count(3), 4);  // RGB
  EXPECT_EQ(padded_channel_count(4), 4);  // already 4: not padded
}

TEST(ChannelPadRule, OtherCountsGoToTheNextMultipleOfEight) {
  EXPECT_EQ(padded_channel_count(5), 8);
  EXPECT_EQ(padded_channel_count(7), 8);
  EXPECT_EQ(padded_channel_count(8), 8);  // not padded
  EXPECT_EQ(padded_channel_count(12), 16);
  EXPECT_EQ(padded_channel_count(64), 64);
  EXPECT_EQ(padded_channel_count(65), 72);
}

}  // namespace
}  // namespace kiln
