// The progress text: step, epoch, loss, rates (tokens/s only for text
// models), learning rate and ETA; durations format as s, m:ss, h:mm:ss.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "meshtrain/train/progress.h"

namespace mt {
namespace {

TEST(Progress, DurationFormats) {
  EXPECT_EQ(Progress::format_duration(0), "0s");
  EXPECT_EQ(Progress::format_duration(59.4), "59s");
  EXPECT_EQ(Progress::format_duration(59.6), "1:00");
  EXPECT_EQ(Progress::format_duration(185), "3:05");
  EXPECT_EQ(Progress::format_duration(3723), "1:02:03");
  EXPECT_EQ(Progress::format_duration(-1), "?");
  EXPECT_EQ(Progress::format_duration(std::numeric_limits<double>::infinity()), "?");
}

TEST(Progress, ImageModelLineHasEpochAndEta) {
  ProgressUpdate u{120, 2, 5, 0.43216, 12345.4, 0, 0.05};
  EXPECT_EQ(Progress::describe(u, 1000, 42.2),
            "step 120/1000 epoch 2/5  loss 0.4322  12345 samples/s  lr 0.05  ETA 42s");
  EXPECT_EQ(Progress::describe(u, 1000, -1),
            "step 120/1000 epoch 2/5  loss 0.4322  12345 samples/s  lr 0.05  ETA --");
}

TEST(Progress, TextModelLineHasTokensPerSecond) {
  ProgressUpdate u{7, 1, 1, 2.5, 100, 12800, 6e-4};
  EXPECT_EQ(Progress::describe(u, 300, 185),
            "step 7/300 epoch 1/1  loss 2.5000  100 samples/s  12800 tokens/s  lr 0.0006  "
            "ETA 3:05");
}

TEST(Progress, LastStepSaysDone) {
  ProgressUpdate u{300, 1, 1, 2.5, 100, 0, 6e-4};
  EXPECT_EQ(Progress::describe(u, 300, 0),
            "step 300/300 epoch 1/1  loss 2.5000  100 samples/s  lr 0.0006  done");
}

}  // namespace
}  // namespace mt
