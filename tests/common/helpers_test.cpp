#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "tidal/common/enum_names.hpp"
#include "tidal/common/error.hpp"
#include "tidal/common/stats.hpp"
#include "tidal/common/text.hpp"

namespace tidal {
namespace {

// The fast median (nth_element) against the textbook one (sort) on random samples of every
// small size, odd and even, with repeated values.
TEST(Median, AgreesWithSortingOnRandomSamples) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> value(-20, 20);
  for (int n = 1; n <= 40; ++n) {
    for (int rep = 0; rep < 20; ++rep) {
      std::vector<double> v(static_cast<std::size_t>(n));
      for (auto& x : v) x = value(rng) / 4.0;
      auto sorted = v;
      std::sort(sorted.begin(), sorted.end());
      const std::size_t m = sorted.size() / 2;
      const double want = n % 2 == 1 ? sorted[m] : (sorted[m - 1] + sorted[m]) / 2;
      EXPECT_EQ(median(v), want) << "n = " << n;
    }
  }
  EXPECT_EQ(median({}), 0.0);
}

TEST(SplitList, DropsEmptyItemsAndKeepsEverythingElse) {
  EXPECT_EQ(split_list("a,b,,c,"), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_EQ(split_list(",/mnt/nvme0"), (std::vector<std::string>{"/mnt/nvme0"}));
  EXPECT_EQ(split_list(""), std::vector<std::string>{});
  EXPECT_EQ(split_list(" x y "), std::vector<std::string>{" x y "});
  EXPECT_EQ(split_list("1:2", ':'), (std::vector<std::string>{"1", "2"}));
}

enum class Colour { kRed, kGreen, kBlue };
constexpr EnumName<Colour> kColours[] = {
    {Colour::kRed, "red"}, {Colour::kGreen, "green"}, {Colour::kBlue, "blue"}};

TEST(EnumNames, BothWaysAndTheChoicesOnAnUnknownName) {
  for (const auto& c : kColours) {
    EXPECT_EQ(enum_value(kColours, enum_name(kColours, c.value), "colour"), c.value);
  }
  EXPECT_STREQ(enum_name(kColours, static_cast<Colour>(7)), "?");
  EXPECT_EQ(enum_names(kColours), "red, green, blue");
  try {
    enum_value(kColours, "mauve", "colour");
    FAIL() << "accepted an unknown name";
  } catch (const InvalidArgument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("unknown colour 'mauve'"), std::string::npos) << what;
    EXPECT_NE(what.find("red, green, blue"), std::string::npos) << what;
  }
}

}  // namespace
}  // namespace tidal
